"""The draft heads users download, in the formats their authors publish, each against a hand-built twin in the
SGLang / SpecForge format with the same weights: the same draft tokens, the same accepted lengths, the same output.
Bad heads are one line each, before any weight is read."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import fastspec
from fastspec.errors import FastspecError
from fastspec.models.heads import write_random_head
from fastspec.sampling import SamplingParams

PROMPTS = [[5, 9, 13, 3, 40], [7, 7, 8, 60, 61, 62, 7, 7]]
PARAMS = SamplingParams(max_new_tokens=24, ignore_eos=True)


def drafted(target, head, algorithm, **options):
    """(output ids, accepted tokens, verify rounds) per prompt, every round speculating."""
    llm = fastspec.LLM(str(target), speculative_algorithm=algorithm, draft_model=str(head), max_total_tokens=1024,
                       tuned=False, **options)
    llm.engine.policy = None
    outs = llm.generate(PROMPTS, PARAMS)
    return [(o.output_ids, o.metrics.accepted_tokens, o.metrics.verify_rounds) for o in outs]


def rewrite(head, out, config_changes=None, drop=(), rename=None):
    """A copy of `head` with its config changed, tensors dropped and keys renamed."""
    out.mkdir(parents=True)
    state = load_file(head / "model.safetensors")
    state = {(rename(k) if rename else k): v for k, v in state.items() if k not in drop}
    save_file(state, out / "model.safetensors")
    config = json.loads((head / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **(config_changes or {})}))
    return out


@pytest.fixture
def eagle_twins(tiny_dirs, tmp_path):
    """An EAGLE-2 head in SGLang's format with a zero fc bias, and the same weights as an EAGLE-1 repo publishes
    them: `LlamaForCausalLM`, `"bias": false`, no fc.bias."""
    h = tiny_dirs["llama"][1].config.hidden_size
    head = write_random_head(tmp_path / "sglang", h, 97, "eagle")
    state = load_file(head / "model.safetensors")
    state["fc.bias"] = torch.zeros_like(state["fc.bias"])
    save_file(state, head / "model.safetensors")
    eagle1 = rewrite(head, tmp_path / "eagle1", {"architectures": ["LlamaForCausalLM"], "bias": False},
                     drop=("fc.bias",))
    return head, eagle1


def test_an_eagle1_head_labelled_llama_drafts_as_its_sglang_twin(tiny_dirs, eagle_twins):
    target = tiny_dirs["llama"][0]
    sglang, eagle1 = eagle_twins
    expected = drafted(target, sglang, "EAGLE")
    assert drafted(target, eagle1, "EAGLE") == expected
    assert all(rounds > 0 for _, _, rounds in expected)


def test_an_eagle3_head_labelled_llama_is_read_as_one(tiny_dirs, draft_dirs, tmp_path):
    target = tiny_dirs["llama"][0]
    head = draft_dirs["llama"]["eagle3"]
    relabelled = rewrite(head, tmp_path / "eagle3", {"architectures": ["LlamaForCausalLM"]})
    assert drafted(target, relabelled, "EAGLE3") == drafted(target, head, "EAGLE3")


def test_a_head_whose_config_promises_an_fc_bias_it_lacks_is_one_line(tiny_dirs, eagle_twins, tmp_path):
    broken = rewrite(eagle_twins[0], tmp_path / "broken", drop=("fc.bias",))
    with pytest.raises(FastspecError, match="missing weight fc.bias"):
        drafted(tiny_dirs["llama"][0], broken, "EAGLE")


def test_a_full_model_as_an_eagle_head_says_what_to_pass_where_it_would_work(tiny_dirs, draft_dirs, tmp_path):
    """The same vocabulary: STANDALONE is suggested (and works); another vocabulary: no advice that would fail."""
    target = tiny_dirs["llama"][0]
    full = draft_dirs["llama"]["standalone"]
    with pytest.raises(FastspecError, match="is not an EAGLE draft head .*--speculative-algorithm STANDALONE"):
        drafted(target, full, "EAGLE")
    assert drafted(target, full, "STANDALONE")[0][0]
    other = tmp_path / "other-vocab"
    shutil.copytree(full, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"vocab_size": 120}))
    with pytest.raises(FastspecError) as e:
        drafted(target, other, "EAGLE")
    assert "STANDALONE" not in str(e.value)
