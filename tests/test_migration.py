"""Names a user brings from vLLM and SGLang (SamplingParams fields, LLM keywords, command-line flags): each one
either works as it does there or is refused in one line that names what fastspec has instead, never Python's bare
TypeError or a traceback from inside."""

import pickle
from dataclasses import replace

import pytest

from fastspec.errors import FastspecError
from fastspec.sampling import SamplingParams

# vLLM's SamplingParams fields and SGLang's sampling_params keys, each with a value a user would pass
VLLM_FIELDS = dict(n=1, best_of=1, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                   temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=1, stop=["x"], stop_token_ids=[2],
                   ignore_eos=True, max_tokens=8, min_tokens=1, logprobs=2, prompt_logprobs=1, detokenize=True,
                   skip_special_tokens=True, spaces_between_special_tokens=True, include_stop_str_in_output=False,
                   truncate_prompt_tokens=5, guided_decoding=None, structured_outputs=None, logit_bias={1: 0.5},
                   bad_words=["x"], allowed_token_ids=[1], logits_processors=[])
SGLANG_FIELDS = dict(max_new_tokens=8, min_new_tokens=1, stop="x", stop_token_ids=[2], stop_regex="x+",
                     temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, frequency_penalty=0.5, presence_penalty=0.5,
                     repetition_penalty=1.1, ignore_eos=True, skip_special_tokens=True, no_stop_trim=True, n=1,
                     json_schema='{"type": "object"}', regex="[0-9]+", ebnf='root ::= "a"', structural_tag="{}",
                     logit_bias={1: 0.5}, sampling_seed=1)


@pytest.mark.parametrize("key, value", [*VLLM_FIELDS.items(), *SGLANG_FIELDS.items()])
def test_every_vllm_and_sglang_sampling_field_works_or_is_one_line(key, value):
    """A field fastspec has takes the value as given; any other is a FastspecError naming it (was a TypeError)."""
    try:
        params = SamplingParams(**{key: value})
    except FastspecError as e:
        assert str(e).startswith(f"SamplingParams has no {key!r}; ") and "\n" not in str(e)
        return
    got, want = getattr(params, key), value
    assert got == (tuple(want) if isinstance(want, list) else (want,) if key == "stop" else
                   tuple(want.items()) if isinstance(want, dict) else want)


@pytest.mark.parametrize("key, hint", [
    ("max_tokens", "use max_new_tokens"), ("sampling_seed", "use seed"), ("n", "answers each prompt once"),
    ("min_tokens", "ignore_eos=True runs an answer to max_new_tokens"),
    ("include_stop_str_in_output", "always trims a stop string"), ("no_stop_trim", "always trims a stop string"),
    ("guided_decoding", "one of the fields json_schema, regex or ebnf"), ("guided_json", "use json_schema"),
    ("temprature", "did you mean temperature?"), ("colour", "its fields are temperature, top_k, top_p")])
def test_a_foreign_sampling_field_names_fastspecs_own(key, hint):
    with pytest.raises(FastspecError, match=f"^SamplingParams has no '{key}'; .*{hint}"):
        SamplingParams(**{key: 1})


def test_sampling_params_still_copy_and_pickle():
    """(The check of foreign keywords is SamplingParams.__new__: copies, replace and pickle pass through it.)"""
    params = SamplingParams(max_new_tokens=5, stop="x", logit_bias={3: 1.0}, json_schema={"type": "object"})
    assert pickle.loads(pickle.dumps(params)) == params
    assert replace(params, seed=3) == SamplingParams(max_new_tokens=5, stop="x", logit_bias={3: 1.0},
                                                     json_schema={"type": "object"}, seed=3)
    assert SamplingParams(0.5, 10) == SamplingParams(temperature=0.5, top_k=10)
