"""`--load-format dummy`: a directory holding only config.json decodes with seeded random weights built in the
target dtype; without dummy the same directory is the usual one-line error; a bad format is one line."""

import json

import pytest
import torch
from tiny_models import FAMILIES, TINY
from typer.testing import CliRunner

import fastspec
from fastspec.cli import app
from fastspec.errors import FastspecError
from fastspec.models.draft_loader import load_draft
from fastspec.models.loader import load_target
from fastspec.sampling import SamplingParams

NEW = 6


@pytest.fixture
def config_dir(tmp_path):
    """A tiny Llama's config.json and nothing else (no weights, no tokenizer)."""
    _, arch, extra = FAMILIES["llama"]
    (tmp_path / "config.json").write_text(json.dumps(TINY | extra | {"architectures": [arch],
                                                                     "initializer_range": 0.05}))
    return tmp_path


def test_config_only_dir_generates_with_dummy(config_dir):
    llm = fastspec.LLM(str(config_dir), load_format="dummy", speculative_algorithm="NONE", device="cpu",
                       max_total_tokens=256)
    out = llm.generate([[1, 5, 9]], SamplingParams(max_new_tokens=NEW, ignore_eos=True))[0]
    assert len(out.output_ids) == NEW and all(0 <= t < TINY["vocab_size"] for t in out.output_ids)


def test_dummy_weights_are_seeded_in_the_target_dtype(config_dir):
    a, b = (load_target(config_dir, torch.bfloat16, load_format="dummy") for _ in range(2))
    state_a, state_b = a.state_dict(), b.state_dict()
    assert state_a.keys() == state_b.keys()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert {p.dtype for p in a.parameters()} == {torch.bfloat16}
    embed = a.model.embed_tokens.weight.float()
    assert 0.04 < embed.std().item() < 0.06  # the config's initializer_range
    assert torch.equal(a.model.norm.weight, torch.ones_like(a.model.norm.weight))
    assert not torch.equal(a.lm_head.weight, a.model.embed_tokens.weight)  # untied: drawn separately


def test_dummy_eagle3_head_without_weights_is_random(config_dir, tmp_path_factory):
    from fastspec.models.heads import write_random_head

    head = write_random_head(tmp_path_factory.mktemp("head"), TINY["hidden_size"], TINY["vocab_size"], "eagle3")
    (head / "model.safetensors").unlink()
    target = load_target(config_dir, torch.float32, capture_layers=(1, 2, 3), load_format="dummy")
    embed = target.model.embed_tokens.weight.clone()
    draft = load_draft(head, target, torch.float32, load_format="dummy")
    assert torch.equal(target.model.embed_tokens.weight, embed)  # shared weights are the target's, untouched
    assert draft.fc.weight.abs().sum() > 0
    with pytest.raises(FastspecError, match="no \\*.safetensors"):
        load_draft(head, target, torch.float32)


def test_config_only_dir_without_dummy_is_the_usual_error(config_dir):
    with pytest.raises(FastspecError, match="no \\*.safetensors or pytorch_model\\*.bin weights"):
        fastspec.LLM(str(config_dir), speculative_algorithm="NONE", device="cpu", max_total_tokens=256)


def test_bad_load_format_is_a_one_line_error(config_dir):
    with pytest.raises(FastspecError, match="^load_format must be auto or dummy, got 'npz'"):
        fastspec.LLM(str(config_dir), load_format="npz", device="cpu")


@pytest.mark.commands
@pytest.mark.parametrize("extra, code, message", [
    (["--load-format", "dummy"], 0, None),
    (["--load-format", "npz"], 2, "--load-format must be auto or dummy, got 'npz'"),
    ([], 2, "no *.safetensors or pytorch_model*.bin weights"),
])
def test_cli_load_format(config_dir, extra, code, message):
    args = ["generate", "--model", str(config_dir), "--input-ids", "1,5,9", "--max-new-tokens", str(NEW),
            "--ignore-eos", "--json", "--max-total-tokens", "256", "--speculative-algorithm", "NONE", "--device", "cpu"]
    result = CliRunner().invoke(app, args + extra)
    assert result.exit_code == code, result.output
    if message is None:
        assert len(json.loads(result.stdout)["output_ids"]) == NEW
    else:
        assert message in result.stderr and result.stderr.count("\n") == 1 and "Traceback" not in result.output
