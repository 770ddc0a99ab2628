"""fastspec.LLM's inputs as a vLLM user gives them: token ids streamed from a checkpoint without a tokenizer, prompts
as numpy / torch arrays."""

import numpy as np
import pytest
import torch
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


def test_numpy_and_torch_prompts_are_token_id_lists(bare_llm):
    """A 1-D integer array is one prompt's ids, a 2-D one a batch, and arrays may stand in a list of prompts; the
    output is the lists' output. Bool and float arrays, and arrays of the wrong rank, are one-line refusals."""
    expected = [c.output_ids for c in bare_llm.generate(PROMPTS, PARAMS)]

    def outputs(prompts):
        return [c.output_ids for c in bare_llm.generate(prompts, PARAMS)]

    assert outputs(np.array(PROMPTS)) == outputs(torch.tensor(PROMPTS, dtype=torch.int32)) == expected
    assert outputs([np.array(PROMPTS[0], dtype=np.uint16), torch.tensor(PROMPTS[1])]) == expected
    assert outputs(np.array(PROMPTS[1])) == outputs(torch.tensor(PROMPTS[1])) == expected[1:]
    assert bare_llm.generate(np.array(PROMPTS[0]), PARAMS)[0].prompt_ids == PROMPTS[0]  # Python ints
    assert type(bare_llm.generate(np.array(PROMPTS[0]), PARAMS)[0].prompt_ids[0]) is int
    streamed = [d.new_ids for step in bare_llm.stream(torch.tensor(PROMPTS[:1]), PARAMS) for d in step]
    assert sum(streamed, []) == expected[0]
    array = "prompts as an array must"
    for prompts, message in ((np.array(PROMPTS, dtype=np.float16), f"{array} hold integer token ids, got float16"),
                             (torch.tensor([True, False]), f"{array} hold integer token ids, got bool"),
                             ([torch.tensor([1.0, 2.0])], "a prompt as an array must hold integer token ids"),
                             (np.zeros((1, 2, 3), dtype=np.int64), f"{array} be 1-D .* or 2-D .*, got 3-D"),
                             ([np.array(PROMPTS)], r"a prompt as an array must be 1-D \(one prompt's ids\), got 2-D"),
                             (np.int64(3), "prompts must be a string, a list of strings or a list of token-id lists")):
        with pytest.raises(FastspecError, match=f"^{message}"):
            bare_llm.generate(prompts, PARAMS)
