"""Speculative configurations refused or resolved before a token is drafted: a bad algorithm, draft or tree, a draft
that does not fit its target, a token map outside the vocabulary, and SGLang's tree-shape rules (topk 1 a chain,
the per-architecture defaults). (test_speculative.py: the helpers these tests share.)"""

import pytest
from test_speculative import spec_llm

import fastspec
from fastspec.errors import FastspecError


@pytest.mark.parametrize("kwargs, message", [
    (dict(speculative_algorithm="EAGLE"), "needs a draft model"),
    (dict(speculative_algorithm="MEDUSA"), "unknown speculative algorithm"),
    (dict(speculative_algorithm="EAGLE", draft_model="DRAFT", num_steps=2, topk=2, num_draft_tokens=9),
     "infeasible"),
    (dict(speculative_algorithm="EAGLE3", draft_model="DRAFT"), "needs a LlamaForCausalLMEagle3 head"),
    (dict(speculative_algorithm="STANDALONE", draft_model="DRAFT"), "needs a full model"),
    (dict(speculative_algorithm="EAGLE3", draft_model="TARGET"), "a full model: STANDALONE drafts with one"),
    (dict(speculative_algorithm="EAGLE", draft_model="DRAFT", accept_threshold_acc=1.5), "must be in [0, 1]"),
])
def test_bad_speculative_configs(tiny_dirs, draft_dirs, kwargs, message):
    if kwargs.get("draft_model") == "DRAFT":
        kwargs["draft_model"] = str(draft_dirs["llama"]["eagle"])
    if kwargs.get("draft_model") == "TARGET":
        kwargs["draft_model"] = str(tiny_dirs["llama"][0])
    with pytest.raises(FastspecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        fastspec.LLM(str(tiny_dirs["llama"][0]), max_total_tokens=1024, **kwargs)


def test_draft_that_does_not_fit_the_target(tiny_dirs, draft_dirs):
    from fastspec.models.draft_loader import check_draft_fits
    from fastspec.models.loader import read_config

    head = read_config(draft_dirs["llama"]["eagle"])
    target = read_config(tiny_dirs["llama"][0])
    with pytest.raises(FastspecError, match="draft expects target features of width 64"):
        check_draft_fits(head, target.replace(hidden_size=32), "draft")
    with pytest.raises(FastspecError, match="draft vocabulary 97 != target vocabulary 50"):
        check_draft_fits(head, target.replace(vocab_size=50), "draft")


def test_token_map_outside_the_vocabulary(tiny_dirs, draft_dirs, tmp_path):
    bad = tmp_path / "map.json"
    bad.write_text("[1, 2, 500]")
    with pytest.raises(FastspecError, match="outside the target vocabulary"):
        spec_llm(tiny_dirs, draft_dirs, "llama", "EAGLE", "eagle", 3, 2, 5, 1, token_map=str(bad))


def test_topk_one_forces_a_chain(tiny_dirs):
    from fastspec.spec_config import SpecConfig, SpecParams

    spec = SpecConfig.resolve("EAGLE", "LlamaForCausalLM", draft_model="x", num_steps=4, topk=1, num_draft_tokens=9)
    assert spec.num_draft_tokens == 5
    assert SpecConfig.resolve("EAGLE", "LlamaForCausalLM", draft_model="x").num_steps == 5  # Llama: (5, 4, 8)
    assert SpecConfig.resolve("EAGLE", "Qwen2ForCausalLM", draft_model="x").topk == 1  # others: (3, 1, 4)
    assert SpecConfig.resolve("NEXTN", "Qwen2ForCausalLM", draft_model="x").algorithm == "EAGLE"
    # on a CPU Llama's unset tree flags take the CPU's measured shape; set flags and other targets as on a GPU
    cpu = dict(draft_model="x", device="cpu")
    assert SpecConfig.resolve("EAGLE3", "LlamaForCausalLM", **cpu).params == SpecParams(2, 2, 3)
    assert SpecConfig.resolve("EAGLE3", "LlamaForCausalLM", topk=4, **cpu).params == SpecParams(2, 4, 3)
    assert SpecConfig.resolve("EAGLE3", "Qwen2ForCausalLM", **cpu).params == SpecParams(3, 1, 4)
    assert SpecConfig.resolve("STANDALONE", "LlamaForCausalLM", **cpu).params == SpecParams(3, 1, 4)
