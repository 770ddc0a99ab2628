"""`fastspec train-draft` on a tiny random target: the objective, the data layout, the job end to end.

The tiny target gets a word-level tokenizer and a chat template so the whole job (chat-templated prompts ->
the target's own answers -> features -> TTT -> SGLang-format head) runs as a user runs it, in seconds. A run that
stops and goes on (resume, what --out holds): test_train_resume.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tiny_models import write_chat_target, write_prompt_file
from typer.testing import CliRunner

from fastspec.cli import app
from fastspec.errors import FastspecError
from fastspec.llm import LLM
from fastspec.models.loader import read_config
from fastspec.sampling import SamplingParams
from fastspec.train.trainer import TrainConfig, train_draft
from fastspec.train.ttt import TTTAttention

pytestmark = pytest.mark.commands  # a `fastspec` command: .ci/run runs these again over a hostile user cache


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    """The tiny llama target with a word-level tokenizer (ids 0..89) and a chat template."""
    return write_chat_target(tmp_path_factory.mktemp("chat-target"))


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    return write_prompt_file(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")


def tiny_config(out, target, prompts, **overrides) -> TrainConfig:
    return TrainConfig(**dict(out=out, model=str(target), prompts=prompts, max_new_tokens=24, draft_vocab_size=40,
                              ttt_steps=3, epochs=12, lr=3e-3, batch_tokens=128, val_fraction=0.2,
                              checkpoint_every=4, generate_batch=8, bf16=False) | overrides)


def test_report_records_the_draft_vocabulary_used_where_left_out(chat_target, prompt_file, tmp_path):
    out = tmp_path / "head"
    train_draft(tiny_config(out, chat_target, prompt_file, draft_vocab_size=None, max_prompts=2, epochs=1),
                lambda _: None)
    vocab = json.loads((out / "config.json").read_text())["draft_vocab_size"]
    assert json.loads((out / "train" / "report.json").read_text())["config"]["draft_vocab_size"] == vocab > 0


@pytest.fixture(scope="module")
def trained(chat_target, prompt_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("head") / "head"
    events = []
    report = train_draft(tiny_config(out, chat_target, prompt_file), events.append)
    return out, events, report


def test_training_lowers_the_loss(trained):
    _, events, report = trained
    losses = [e.info["loss"] for e in events if e.phase == "train"]
    assert len(losses) == report["steps"] > 10
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3
    assert 0 < report["val_acceptance"][0] <= 1 and report["val_chain_tau"] >= 1


def test_exported_head_is_the_eagle3_format_and_decodes_losslessly(trained, chat_target):
    out, _, _ = trained
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == 40 and config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 1, 0]
    assert read_config(out).is_eagle3
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        d2t, t2d, head = f.get_tensor("d2t"), f.get_tensor("t2d"), f.get_tensor("lm_head.weight")
    assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "norm.weight",
            "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight", "lm_head.weight"} <= keys
    assert not any(k.startswith("embed_tokens") for k in keys)  # shared with the target, as in SGLang
    assert head.dtype == torch.bfloat16 and head.shape[0] == 40
    hot = d2t + torch.arange(40)  # draft id -> target id, ascending, and exactly the t2d set
    assert bool((hot[1:] > hot[:-1]).all()) and torch.equal(t2d.nonzero().flatten(), hot)
    prompts = [[1, 5, 9, 13], [1, 40, 41]]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    plain = LLM(model=str(chat_target)).generate(prompts, params)
    spec = LLM(model=str(chat_target), speculative_algorithm="EAGLE3", draft_model=str(out), num_steps=3, topk=2,
               num_draft_tokens=5).generate(prompts, params)
    assert [o.output_ids for o in spec] == [o.output_ids for o in plain]


def test_resuming_with_another_draft_vocab_size_is_a_one_line_error(trained, chat_target, prompt_file):
    """The draft vocabulary shapes the head: resuming with another size is refused before anything is written."""
    out, _, _ = trained
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    result = CliRunner().invoke(app, ["train-draft", "--out", str(out), "--model", str(chat_target), "--prompts",
                                      str(prompt_file), "--draft-vocab-size", "30", "--resume"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert "40 tokens, not --draft-vocab-size 30" in result.stderr and "--overwrite" in result.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


@pytest.mark.gpu
def test_training_on_cuda_lowers_the_loss_and_its_head_decodes_losslessly(chat_target, prompt_file, tmp_path):
    out = tmp_path / "head"
    events = []
    report = train_draft(tiny_config(out, chat_target, prompt_file, device="cuda"), events.append)
    losses = [e.info["loss"] for e in events if e.phase == "train"]
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3 and report["val_chain_tau"] >= 1
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    plain = LLM(model=str(chat_target), dtype="float32").generate([[1, 5, 9, 13]], params)
    spec = LLM(model=str(chat_target), dtype="float32", speculative_algorithm="EAGLE3", draft_model=str(out),
               num_steps=3, topk=2, num_draft_tokens=5).generate([[1, 5, 9, 13]], params)
    assert spec[0].output_ids == plain[0].output_ids


@pytest.mark.parametrize("device, message", [("tpu", "must be auto, cpu or cuda"), ("cuda:x", "must be auto, cpu or cuda"),
                                             ("cuda:99", "cuda:99")])
def test_a_bad_or_missing_device_is_one_line_before_anything_is_written(chat_target, tmp_path, device, message):
    result = CliRunner().invoke(app, ["train-draft", "--out", str(tmp_path / "o"), "--model", str(chat_target),
                                      "--device", device])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_a_kv_pool_past_memory_names_the_flag_train_draft_sizes_it_by(chat_target, prompt_file, tmp_path,
                                                                       monkeypatch):
    """train-draft sizes its target's KV pool from --max-new-tokens (it has no --max-total-tokens): a pool past the
    memory available names that flag."""
    from fastspec.memory import kv_pool

    monkeypatch.setattr(kv_pool, "available_bytes", lambda device="cpu": 8 * 2**20)  # (the tiny target fits)
    result = CliRunner().invoke(app, ["train-draft", "--out", str(tmp_path / "o"), "--model", str(chat_target),
                                      "--prompts", str(prompt_file), "--max-new-tokens", "24", "--device", "cpu"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert result.stderr.startswith("error: a KV pool of ") and result.stderr.endswith(": lower --max-new-tokens\n")


def test_bad_prompt_line_and_existing_dir_are_one_line_errors(chat_target, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "w3 w4"}\n{"prompt": 5}\n')
    result = CliRunner().invoke(app, ["train-draft", "--out", str(tmp_path / "o"), "--model", str(chat_target),
                                      "--prompts", str(bad)])
    assert result.exit_code == 2 and "bad.jsonl:2" in result.output and "Traceback" not in result.output
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    result = CliRunner().invoke(app, ["train-draft", "--out", str(tmp_path / "mine"), "--model", str(chat_target),
                                      "--overwrite"])
    assert result.exit_code == 2 and "refusing" in result.output
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    for flag in ("--out", "--corpus"):
        result = CliRunner().invoke(app, ["train-draft", "--out", str(tmp_path / "o"), "--model", str(chat_target),
                                          flag, str(bad)])
        assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
        assert f"{flag} {bad} exists and is not a directory" in result.stderr


@pytest.mark.parametrize("case, message", [
    ("long prompt", 'long.jsonl: prompt 2 ("w5 w5 w5'), ("no chat template", "has no chat template"),
    ("no tokenizer", "cannot load the tokenizer"), ("a head as the target", "is a draft head, not a target model")])
def test_what_the_target_cannot_answer_is_one_line_before_out_is_made(chat_target, trained, tmp_path, case,
                                                                       message):
    """Found only once the answers were being generated, these left --out behind (so the corrected command
    needed --resume or --overwrite), and an over-long prompt was not named."""
    model, prompts = tmp_path / "target", tmp_path / "long.jsonl"
    shutil.copytree(chat_target, model)
    prompts.write_text(json.dumps({"prompt": "w3 w4"}) + "\n" + json.dumps({"prompt": " ".join(["w5"] * 240)}) + "\n")
    if case == "no chat template":
        (model / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    elif case == "no tokenizer":
        (model / "tokenizer.json").unlink()
    elif case == "a head as the target":
        model = trained[0]
    if case != "long prompt":
        prompts.write_text(json.dumps({"prompt": "w3 w4"}) + "\n")
    result = CliRunner().invoke(app, ["train-draft", "--out", str(tmp_path / "o"), "--model", str(model),
                                      "--prompts", str(prompts), "--max-new-tokens", "24"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and message in result.stderr, result.output
    assert not (tmp_path / "o").exists()


def test_a_run_with_nothing_held_out_says_so_instead_of_nan(chat_target, prompt_file, tmp_path):
    result = CliRunner().invoke(app, ["train-draft", "--out", str(tmp_path / "o"), "--model", str(chat_target),
                                      "--prompts", str(prompt_file), "--max-new-tokens", "16", "--draft-vocab-size",
                                      "40", "--ttt-steps", "2", "--epochs", "1", "--batch-tokens", "128",
                                      "--val-fraction", "0", "--no-bf16"])
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())  # rich wraps the line
    assert "no held-out conversations (--val-fraction 0 held out none of 12): held-out tau not measured" in said
    assert "nan" not in said and "None" not in said


def test_soft_label_training_lowers_the_loss_and_decodes_losslessly(chat_target, prompt_file, tmp_path):
    events = []
    report = train_draft(tiny_config(tmp_path / "soft", chat_target, prompt_file, soft_topk=8, epochs=6),
                         events.append)
    losses = [e.info["loss"] for e in events if e.phase == "train"]
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3 and report["val_chain_tau"] >= 1
    prompts, params = [[1, 5, 9, 13], [1, 40, 41]], SamplingParams(max_new_tokens=16, ignore_eos=True)
    plain = LLM(model=str(chat_target), speculative_algorithm="NONE").generate(prompts, params)
    spec = LLM(model=str(chat_target), speculative_algorithm="EAGLE3", draft_model=str(tmp_path / "soft"),
               num_steps=3, topk=2, num_draft_tokens=5).generate(prompts, params)
    assert [o.output_ids for o in spec] == [o.output_ids for o in plain]


@pytest.mark.parametrize("flags, message", [(["--draft-vocab-size", "40", "--soft-labels", "41"], "--soft-labels"),
                                           (["--draft-vocab-size", "0"], "--draft-vocab-size must be >= 1"),
                                           # typed above the target's vocabulary: refused, not quietly capped
                                           (["--draft-vocab-size", "500"], "--draft-vocab-size 500 is above the "
                                                                           "target's vocabulary of 97 tokens"),
                                           # left out: the whole vocabulary (97), which caps --soft-labels
                                           (["--soft-labels", "98"], "--soft-labels must be in [0, "
                                                                     "--draft-vocab-size 97], got 98"),
                                           (["--lr", "inf"], "--lr must be a finite number > 0, got inf")])
def test_draft_vocabulary_flags_are_one_line_before_any_answer(chat_target, tmp_path, flags, message):
    result = CliRunner().invoke(app, ["train-draft", "--out", str(tmp_path / "o"), "--model", str(chat_target),
                                      *flags])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and message in result.stderr
    assert not (tmp_path / "o").exists()


def test_warm_start_makes_the_head_the_targets_layer(chat_target):
    """With the embedding half of q/k/v zeroed, a warm-started head at step 0 computes target layer L exactly:
    fc passes the input of L through and the midlayer is L. On the tiny target the capture layers are (2, 2, 1),
    so L = 1 and its output is the input of layer 2: the first captured feature, an independent oracle."""
    from fastspec.models.causal_lm import eagle3_capture_layers
    from fastspec.models.loader import load_target
    from fastspec.models.model_config import ModelConfig
    from fastspec.train.checkpoint import head_config, init_head, warm_start
    from fastspec.train.data import PackedCausalAttention

    layers = eagle3_capture_layers(4, None)
    assert layers == (2, 2, 1)
    target = load_target(chat_target, torch.float32, capture_layers=layers)
    head_json = head_config(json.loads((chat_target / "config.json").read_text()), 40, 4)
    head = init_head(ModelConfig.from_hf(head_json), target, torch.arange(40), seed=0)
    random_q = head.midlayer.self_attn.q_proj.weight[:, :64].clone()
    warm_start(head, target, layers)
    assert torch.equal(head.midlayer.self_attn.q_proj.weight[:, :64], random_q)  # the embedding half: untouched
    assert torch.equal(head.midlayer.mlp.down_proj.weight, target.model.layers[1].mlp.down_proj.weight)
    ids = torch.tensor([1, 90, 5, 9, 13, 91, 40, 41])
    positions = torch.arange(len(ids))
    with torch.no_grad():
        aux = target(ids, positions, PackedCausalAttention(torch.zeros(len(ids)))).aux  # [T, 3H]
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(head.midlayer.self_attn, name).weight[:, :64] = 0
        out = head(ids, positions, aux, TTTAttention(torch.zeros(len(ids))))
    torch.testing.assert_close(out.carry, aux[:, :64], atol=1e-5, rtol=1e-5)
    with pytest.raises(FastspecError, match="--init"):
        TrainConfig(out=Path("x"), init="zeros")
