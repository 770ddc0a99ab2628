"""Speculative decoding in fewer bits, still lossless: a KV cache stored in 16 or 8 bits, a bfloat16 / float16
target (a verify row rounds as its token's decode step does), the KV dtype `auto` picks for a packed CPU target,
and a head loaded beside a 16-bit target leaving the modules they share as they were. (test_speculative.py: the
float32 invariant and the helpers these tests share.)"""

import pytest
import torch
from conftest import all_slots_free
from test_speculative import NEW, PROMPTS, spec_llm

import fastspec
from fastspec.kernels.cpu_row_gemm import RowLinear
from fastspec.sampling import SamplingParams


def plain_and_speculative(tiny_dirs, draft_dirs, family, algorithm, draft, every_round=False, **extra):
    """(the speculative LLM, its outputs, the target-only output ids) over PROMPTS with the same engine options;
    a small tree (NGRAM: 6 tokens); `every_round`: no measured fallback to plain rounds."""
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    steps, topk, n = (None, None, 6) if algorithm == "NGRAM" else (3, 2, 5)
    plain = fastspec.LLM(str(tiny_dirs[family][0]), max_total_tokens=4096, **extra)
    expected = [o.output_ids for o in plain.engine.generate(PROMPTS, [params] * len(PROMPTS))]
    llm = spec_llm(tiny_dirs, draft_dirs, family, algorithm, draft, steps, topk, n, 16, **extra)
    if every_round:
        llm.engine.policy = None
    return llm, llm.engine.generate(PROMPTS, [params] * len(PROMPTS)), expected


@pytest.mark.parametrize("family, algorithm, draft, quantization, kv", [
    ("llama", "EAGLE3", "eagle3", None, "bfloat16"), ("qwen2", "STANDALONE", "self", "int4", "float16"),
    ("qwen3", "EAGLE", "eagle", "int4", "bf16"), ("llama", "NGRAM", None, None, "fp16"),
    ("llama", "EAGLE3", "eagle3", "int4", "fp8_e4m3"), ("qwen2", "STANDALONE", "self", None, "fp8_e5m2")])
def test_a_smaller_kv_cache_is_lossless(tiny_dirs, draft_dirs, family, algorithm, draft, quantization, kv):
    """--kv-cache-dtype: K and V (target's and draft's) stored rounded to 16 or 8 bits; speculative output still
    equals target-only output over the same cache dtype, on the float layers and on packed ones (the fused C
    kernels)."""
    llm, outputs, expected = plain_and_speculative(tiny_dirs, draft_dirs, family, algorithm, draft,
                                                   quantization=quantization, kv_cache_dtype=kv)
    assert [o.output_ids for o in outputs] == expected
    stored = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
              "fp8_e5m2": torch.float8_e5m2}.get(kv, torch.float16)
    assert {p.k.dtype for p in llm.engine.worker.memory.pools} == {stored}
    assert all_slots_free(llm.engine)


@pytest.mark.parametrize("family, algorithm, draft, dtype, quantization", [
    ("llama", "EAGLE3", "eagle3", "bfloat16", None), ("qwen3", "EAGLE", "eagle", "float16", None),
    ("qwen2", "STANDALONE", "self", "bfloat16", "int4"), ("llama", "NGRAM", None, "float16", None)])
def test_a_16_bit_target_is_lossless(tiny_dirs, draft_dirs, family, algorithm, draft, dtype, quantization):
    """--dtype bfloat16 / float16: a verify row rounds as the decode step of its token does (attention takes each row
    over exactly its keys, whatever the batch and the tree around it), so speculative output equals target-only output
    in 16 bits too, token for token (torch's SDPA over the padded verify block made greedy EAGLE-3 leave plain decoding
    in bfloat16)."""
    llm, outputs, expected = plain_and_speculative(tiny_dirs, draft_dirs, family, algorithm, draft, every_round=True,
                                                   dtype=dtype, quantization=quantization)
    invariant = gemms_row_invariant(llm.engine.worker.target.model, getattr(torch, dtype))
    if [o.output_ids for o in outputs] != expected and not invariant:
        pytest.skip(f"this CPU's {dtype} GEMMs round a row by the rows beside it: no kernel of ours can make a verify "
                    "row its decode step here")
    assert [o.output_ids for o in outputs] == expected
    assert sum(o.metrics.verify_rounds for o in outputs) > 0


def gemms_row_invariant(model, dtype: torch.dtype) -> bool:
    """Whether every linear of `model` gives a row alone what it gives it among others (1 to 40 rows): torch's 16-bit
    GEMMs do on the CPUs measured, but their kernels are the CPU library's choice, made by the row count."""
    g = torch.Generator().manual_seed(0)
    for module in model.modules():
        if type(module) in (torch.nn.Linear, RowLinear) or hasattr(module, "activation"):
            x = torch.randn(40, module.in_features, generator=g).to(dtype)
            whole = module(x)
            if not all(torch.equal(module(x[:m]), whole[:m]) for m in (1, 2, 3, 5, 8, 13, 24)):
                return False
    return True


def test_auto_stores_a_packed_cpu_targets_kv_cache_in_bfloat16(tiny_dirs):
    """--kv-cache-dtype auto: the model's --dtype, but bfloat16 for quantised weights run on the CPU in float32 (the
    embedded model's case, as llama.cpp's cache is 16-bit); float weights and an explicit float32 keep float32."""
    def stored(**kwargs) -> torch.dtype:
        llm = fastspec.LLM(str(tiny_dirs["llama"][0]), max_total_tokens=512, **kwargs)
        return llm.engine.worker.pool.k.dtype

    assert stored(quantization="int4") == torch.bfloat16
    assert stored() == stored(quantization="int4", kv_cache_dtype="float32") == torch.float32


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_loading_a_head_leaves_the_target_it_shares_modules_with_as_it_was(tiny_dirs, draft_dirs, kind):
    """A head shares the target's embedding (and EAGLE-1's lm_head); casting the head to its dtype cast those too,
    so a bfloat16 target whose shared module keeps a float32 table (a packed embedding's scales) computed other
    logits beside a head than alone: greedy EAGLE-3 differed from plain decoding on the embedded model in bfloat16.
    Every target tensor, float32 ones included, stays bit for bit what it was."""
    from fastspec.models.draft_loader import load_draft
    from fastspec.models.loader import load_target

    target = load_target(tiny_dirs["llama"][0], torch.bfloat16)
    target.model.embed_tokens.register_buffer("scale", torch.rand(7, dtype=torch.float64).float())  # a float32 table
    before = {k: v.clone() for k, v in target.state_dict().items()}
    head = load_draft(draft_dirs["llama"][kind], target, torch.bfloat16)
    after = target.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    assert all(p.dtype == torch.bfloat16 for n, p in head.named_parameters() if not n.startswith(("embed", "lm_head")))
