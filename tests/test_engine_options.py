"""EngineConfig's refusals of an API caller's engine options (fastspec.LLM's keywords) of the wrong type: one line
naming the option, checked before any value is read; a torch.device, a path and a list of buckets are taken."""

import dataclasses
from pathlib import Path

import pytest

from fastspec.config import EngineConfig
from fastspec.errors import FastspecError, OptionError


@pytest.mark.parametrize("options, message", [
    (dict(device=0), r"^device must be a str such as 'cpu' or 'cuda:0' \(or a torch.device\), got int$"),
    (dict(device=None), "^device must be a str .*, got NoneType$"),
    (dict(kv_cache_dtype=["fp8"]), "^kv_cache_dtype must be a str, got list$"),
    (dict(dtype=16), "^dtype must be a str, got int$"),
    (dict(load_format=b"dummy"), "^load_format must be a str, got bytes$"),
    (dict(graphs=["eager"]), "^graphs must be a str, got list$"),
    (dict(overlap_schedule=False), "^overlap_schedule must be a str, got bool$"),
    (dict(attention_backend=["torch"]), "^attention_backend must be a str, got list$"),
    (dict(quantization=8), "^quantization must be a str or None, got int$"),
    (dict(kv_mem_fraction="0.5"), r"^kv_mem_fraction must be a number in \(0, 1\], got str$"),
    (dict(kv_mem_fraction=True), r"^kv_mem_fraction must be a number in \(0, 1\], got bool$"),
    (dict(kv_mem_fraction=1.5, max_total_tokens=512), r"^kv_mem_fraction must be a number in \(0, 1\], got 1.5$"),
    (dict(kv_mem_fraction=0), r"^kv_mem_fraction must be a number in \(0, 1\], got 0.0$"),
    (dict(kv_mem_fraction=float("nan")), r"^kv_mem_fraction must be a number in \(0, 1\], got nan$"),
    (dict(speculative_fallback="no"), "^speculative_fallback must be True or False, got str$"),
    (dict(radix_cache=0), "^radix_cache must be True or False, got int$"),
    (dict(cuda_graph_bs=4), r"^cuda_graph_bs must be None or a non-empty tuple of integers >= 1, got int$"),
    (dict(cuda_graph_bs=()), r"^cuda_graph_bs must be None or a non-empty tuple of integers >= 1$"),
    (dict(cuda_graph_bs=[1, 0]), "^cuda_graph_bs must be None or a non-empty tuple of integers >= 1$"),
    (dict(cuda_graph_bs=(1, 2.0)), "^cuda_graph_bs must be None or a non-empty tuple of integers >= 1$"),
    (dict(cuda_graph_bs=(True,)), "^cuda_graph_bs must be None or a non-empty tuple of integers >= 1$"),
    (dict(model=5), "^model must be a directory, a hub id, a .gguf file or an embedded model's name, got int$"),
    (dict(page_size="16"), "^page_size must be an integer, got str$"),
    (dict(max_total_tokens=512.0), "^max_total_tokens must be an integer or None, got float$")])
def test_an_engine_option_of_the_wrong_type_is_one_line(options, message):
    """(device=0 was an AttributeError from str.startswith, a list kv_cache_dtype or attention_backend a TypeError
    from a dict lookup; a str kv_mem_fraction a TypeError once the KV pool was sized, one past 1 taken where
    max_total_tokens sized the pool; radix_cache=0, speculative_fallback="no", cuda_graph_bs=() or [0] were taken.)"""
    with pytest.raises(OptionError, match=message):
        EngineConfig(**({"device": "cpu"} | options))


def test_the_api_refuses_them_before_reading_a_model():
    import fastspec

    with pytest.raises(FastspecError, match="^device must be a str .*, got int$"):
        fastspec.LLM("no-such-model", device=0)


def test_a_torch_device_a_path_and_a_list_of_buckets_are_taken_as_str_and_tuple():
    import torch

    config = EngineConfig(model=Path("/models/x"), device=torch.device("cpu"), cuda_graph_bs=[2, 1],
                          kv_mem_fraction=1)
    assert (config.model, config.device, config.cuda_graph_bs, config.kv_mem_fraction) == ("/models/x", "cpu", (2, 1),
                                                                                            1.0)
    assert hash(config) == hash(dataclasses.replace(config))  # (frozen: hashable, as a list field was not)
    with pytest.raises(OptionError, match=r"^device must be auto, cpu or cuda\[:N\], got 'meta'$"):
        EngineConfig(device=torch.device("meta"))


def test_every_engine_option_has_its_type_checked():
    from fastspec.config import _TYPES

    assert set(_TYPES) == {f.name for f in dataclasses.fields(EngineConfig)}
