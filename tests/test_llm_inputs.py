"""fastspec.LLM's inputs as a vLLM user gives them: token ids streamed from a checkpoint without a tokenizer."""

import pytest
from tiny_models import make_hf_model

import fastspec
from fastspec import SamplingParams
from fastspec.errors import FastspecError

PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)
PROMPTS = [[3, 4, 5, 6], [7, 8, 9, 10]]


@pytest.fixture(scope="module")
def bare_dir(tmp_path_factory):
    """A tiny llama checkpoint shipped without a tokenizer (config and weights only)."""
    directory = tmp_path_factory.mktemp("bare-target")
    make_hf_model("llama").save_pretrained(directory)
    assert not (directory / "tokenizer.json").exists()
    return directory


@pytest.fixture(scope="module")
def bare_llm(bare_dir):
    return fastspec.LLM(str(bare_dir), speculative_algorithm="NGRAM", max_total_tokens=512)


def test_token_ids_stream_without_a_tokenizer_as_they_generate(bare_llm):
    """generate of ids needs no tokenizer (text None); stream of the same ids yields the same tokens step by step,
    text None, each prompt finished once with generate's reason (it failed loading tokenizer.json). Stop strings
    are text: a one-line refusal."""
    expected = bare_llm.generate(PROMPTS, PARAMS)
    assert all(c.text is None for c in expected)
    got, reasons = [[], []], {}
    for step in bare_llm.stream(PROMPTS, PARAMS):
        for delta in step:
            assert delta.text is None and delta.index not in reasons
            got[delta.index] += delta.new_ids
            if delta.finish_reason is not None:
                reasons[delta.index] = delta.finish_reason
    assert got == [c.output_ids for c in expected]
    assert reasons == {i: c.finish_reason for i, c in enumerate(expected)} == {0: "length", 1: "length"}
    with pytest.raises(FastspecError, match="cannot load the tokenizer"):
        next(bare_llm.stream(PROMPTS, SamplingParams(max_new_tokens=8, stop=("x",))))
    assert [c.output_ids for c in bare_llm.generate(PROMPTS, PARAMS)] == got  # (the refused stream left nothing)

