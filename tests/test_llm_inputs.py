"""fastspec.LLM's inputs as a vLLM user gives them: token ids streamed from a checkpoint without a tokenizer, and
prompts as numpy / torch arrays; the fixtures of a tokenizer given apart from the model (test_llm_tokenizer.py) and
of a chat's last message continued (test_llm_continue.py)."""

import numpy as np
import pytest
import torch
from tiny_models import make_hf_model, write_word_tokenizer

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
    """A 1-D integer array is one prompt's ids (as a flat list of ints is), a 2-D one a batch, and arrays may stand in
    a list of prompts; the output is the lists' output. Bool and float arrays (and bools in a list), and arrays of the
    wrong rank, are one-line refusals."""
    expected = [c.output_ids for c in bare_llm.generate(PROMPTS, PARAMS)]

    def outputs(prompts):
        return [c.output_ids for c in bare_llm.generate(prompts, PARAMS)]

    assert outputs(np.array(PROMPTS)) == outputs(torch.tensor(PROMPTS, dtype=torch.int32)) == expected
    assert outputs([np.array(PROMPTS[0], dtype=np.uint16), torch.tensor(PROMPTS[1])]) == expected
    assert outputs(np.array(PROMPTS[1])) == outputs(torch.tensor(PROMPTS[1])) == expected[1:]
    assert outputs(list(np.array(PROMPTS[1]))) == expected[1:]  # (numpy's ints in a flat list: one prompt too)
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
                             (np.ma.array(PROMPTS[0], mask=[0, 1, 0, 0]), f"{array} hold integer token ids, got mask"),
                             (torch.tensor(PROMPTS[0], device="meta"), "prompts as an array cannot be read"),
                             ([np.True_, np.False_], "prompts: token ids must be ints, got a bool"),
                             (np.int64(3), r"prompts must be a string, a list of token ids \(one prompt\), a list of "
                                           "strings or a list of token-id lists")):
        with pytest.raises(FastspecError, match=f"^{message}"):
            bare_llm.generate(prompts, PARAMS)


TEMPLATE = ("{% for m in messages %}{% if m.role == 'user' %}<user>{% else %}<bot>{% endif %} {{ m.content }} </s> "
            "{% endfor %}{% if add_generation_prompt %}<bot>{% endif %}")


@pytest.fixture(scope="module")
def words_dir(tmp_path_factory):
    """A tokenizer of its own (no model): word-level, `wN` is id N, with a chat template that tells roles apart."""
    return write_word_tokenizer(tmp_path_factory.mktemp("words") / "tokenizer", template=TEMPLATE)


@pytest.fixture(scope="module")
def words_llm(bare_dir, words_dir):
    return fastspec.LLM(str(bare_dir), tokenizer=words_dir, speculative_algorithm="NGRAM", max_total_tokens=512)
