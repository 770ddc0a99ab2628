"""fastspec.attention's torch backend against a dense float64 oracle (attention_oracle: it never looks at
AttnMetadata), every mode over random slot layouts; padded rows; the attention context. Metadata worked by hand:
test_attention_metadata.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_oracle import (causal_mask, full_tree_mask, oracle, patterned_table, random_parents, random_rows,
                              random_table, run_backend)

from fastspec.attention import (AttentionContext, AttnMode, TorchAttnBackend, decode_metadata, draft_decode_metadata,
                                draft_extend_metadata, extend_metadata, verify_metadata)
from fastspec.attention.torch_backend import attend_padded
from fastspec.memory.kv_pool import KVPool, as_cache

HEADS = [(4, 4), (6, 2), (9, 3), (4, 1)]  # (Hq, Hkv)


# ---------------------------------------------------------------------------------------------------------
# every mode against the dense oracle, random slot layouts


def build_case(mode: AttnMode, data, gen: torch.Generator, width: int = 48):
    """Random batch for `mode`: (metadata, oracle specs, expected out_cache_loc, num_slots)."""
    bs = data.draw(st.integers(1, 4), label="bs")
    table, num_slots = random_table(gen, num_rows=6, width=width)
    rows = random_rows(gen, bs, 6)
    tab = [table[r].tolist() for r in rows.tolist()]
    lens = lambda lo, hi: [data.draw(st.integers(lo, hi)) for _ in range(bs)]  # noqa: E731
    if mode is AttnMode.EXTEND:
        pre, ext = lens(0, 12), lens(1, 9)
        meta = extend_metadata(table, rows, torch.tensor(pre), torch.tensor(ext))
        specs = [(t[: p + e], causal_mask(e, p + e)) for t, p, e in zip(tab, pre, ext)]
        out = [s for t, p, e in zip(tab, pre, ext) for s in t[p: p + e]]
    elif mode is AttnMode.DECODE:
        seq = lens(1, 30)
        meta = decode_metadata(table, rows, torch.tensor(seq))
        specs = [(t[:s], torch.ones(1, s, dtype=torch.bool)) for t, s in zip(tab, seq)]
        out = [t[s - 1] for t, s in zip(tab, seq)]
    elif mode is AttnMode.DRAFT_DECODE:
        topk, steps = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
        step = data.draw(st.integers(0, steps - 1))
        seq = lens(1, 20)
        meta = draft_decode_metadata(table, rows, torch.tensor(seq), topk, steps, step)
        specs, out = [], []
        for t, s in zip(tab, seq):
            for k in range(topk):
                scratch = t[s + k * steps: s + k * steps + step + 1]
                specs.append((t[:s] + scratch, torch.ones(1, s + step + 1, dtype=torch.bool)))
                out.append(scratch[-1])
    elif mode is AttnMode.DRAFT_EXTEND:
        ext = lens(1, 5)
        seq = [e + data.draw(st.integers(0, 20)) for e in ext]
        meta = draft_extend_metadata(table, rows, torch.tensor(seq), torch.tensor(ext))
        specs = [(t[:s], causal_mask(e, s)) for t, s, e in zip(tab, seq, ext)]
        out = [x for t, s, e in zip(tab, seq, ext) for x in t[s - e: s]]
    else:
        n = data.draw(st.integers(1, 8))
        seq = lens(0, 20)
        blocks = full_tree_mask(seq, [random_parents(gen, n) for _ in range(bs)])
        meta = verify_metadata(table, rows, torch.tensor(seq), n, torch.cat([b.flatten() for b in blocks]))
        specs = [(t[: s + n], b) for t, s, b in zip(tab, seq, blocks)]
        out = [x for t, s in zip(tab, seq) for x in t[s: s + n]]
    return meta, specs, out, num_slots


@settings(max_examples=60, deadline=None)
@given(mode=st.sampled_from(list(AttnMode)), heads=st.sampled_from(HEADS), seed=st.integers(0, 2**31 - 1),
       data=st.data())
def test_backend_matches_oracle_every_mode(mode, heads, seed, data):
    gen = torch.Generator().manual_seed(seed)
    meta, specs, out_slots, num_slots = build_case(mode, data, gen)
    assert meta.mode is mode
    assert meta.out_cache_loc.tolist() == out_slots
    hq, hkv, d = heads[0], heads[1], 16
    q = torch.randn(meta.num_tokens, hq, d, generator=gen)
    k_cache = torch.randn(num_slots, hkv, d, generator=gen)
    v_cache = torch.randn(num_slots, hkv, d, generator=gen)
    got = run_backend(meta, q, k_cache, v_cache, scale=d ** -0.5)
    torch.testing.assert_close(got.double(), oracle(q, k_cache, v_cache, d ** -0.5, specs), atol=1e-5, rtol=1e-5)


@settings(max_examples=20, deadline=None)
@given(mode=st.sampled_from(list(AttnMode)), dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       seed=st.integers(0, 2**31 - 1), data=st.data())
def test_backend_matches_oracle_low_precision(mode, dtype, seed, data):
    gen = torch.Generator().manual_seed(seed)
    meta, specs, _, num_slots = build_case(mode, data, gen)
    q = torch.randn(meta.num_tokens, 9, 64, generator=gen).to(dtype)
    k_cache = torch.randn(num_slots, 3, 64, generator=gen).to(dtype)
    v_cache = torch.randn(num_slots, 3, 64, generator=gen).to(dtype)
    got = run_backend(meta, q, k_cache, v_cache, scale=0.125)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), oracle(q, k_cache, v_cache, 0.125, specs), atol=3e-2, rtol=3e-2)


def test_decode_batch_matches_oracle():
    gen = torch.Generator().manual_seed(0)
    table, num_slots = random_table(gen, num_rows=8, width=64)
    rows, seq = torch.tensor([5, 0, 7, 2, 3]), [1, 64, 17, 2, 40]
    meta = decode_metadata(table, rows, torch.tensor(seq))
    specs = [(table[r, :s].tolist(), torch.ones(1, s, dtype=torch.bool)) for r, s in zip(rows.tolist(), seq)]
    q, k_cache, v_cache = torch.randn(5, 9, 64), torch.randn(num_slots, 3, 64), torch.randn(num_slots, 3, 64)
    got = run_backend(meta, q, k_cache, v_cache, scale=0.125)
    torch.testing.assert_close(got.double(), oracle(q, k_cache, v_cache, 0.125, specs), atol=1e-5, rtol=1e-5)


def test_one_query_plans_are_the_general_plans():
    """Decode and draft-decode plans (one query row per request) take a shorter path: the same plan as the general
    one builds for the same rows, masks of ragged lengths included."""
    table = patterned_table(width=40)
    metas = [decode_metadata(table, torch.tensor([1]), torch.tensor([7])),
             decode_metadata(table, torch.tensor([0, 2, 1]), torch.tensor([5, 31, 9])),
             draft_decode_metadata(table, torch.tensor([0, 2]), torch.tensor([6, 11]), 2, 3, 1)]
    for meta in metas:
        fast = TorchAttnBackend().plan(meta)
        general = TorchAttnBackend().plan(dataclasses.replace(meta, mode=AttnMode.EXTEND))
        for name in ("q_index", "kv_slots", "mask", "out_index", "out_cache_loc"):
            a, b = getattr(fast, name), getattr(general, name)
            assert (a is None and b is None) or torch.equal(a, b), name
        assert fast.uniform_qo == general.uniform_qo


def test_single_decode_plans_without_mask():
    meta = decode_metadata(patterned_table(), torch.tensor([1]), torch.tensor([7]))
    plan = TorchAttnBackend().plan(meta)
    assert plan.mask is None
    assert plan.kv_slots.tolist() == [[20, 21, 22, 23, 24, 25, 26]]


# ---------------------------------------------------------------------------------------------------------
# padding


def test_padded_query_rows_are_finite():
    # request 0 has 1 query row, request 1 has 6: rows 1..5 of request 0 are padding; a -inf-free mask
    # must still leave every padded row at least one key, or SDPA may return NaN there.
    meta = extend_metadata(patterned_table(width=16), torch.tensor([0, 1]), torch.tensor([3, 0]),
                           torch.tensor([1, 6]))
    plan = TorchAttnBackend().plan(meta)
    assert plan.mask is not None and plan.mask.shape == (2, 1, 6, 6)
    assert bool(plan.mask.any(-1).all())
    q = torch.randn(7, 4, 8) * 50
    k_cache, v_cache = torch.randn(64, 2, 8) * 50, torch.randn(64, 2, 8)
    for dtype in (torch.float32, torch.bfloat16):
        padded = attend_padded(plan, q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), scale=1.0)
        assert padded.shape == (2, 6, 4, 8) and bool(torch.isfinite(padded).all())
    specs = [(list(range(10, 14)), causal_mask(1, 4)), (list(range(20, 26)), causal_mask(6, 6))]
    got = TorchAttnBackend().run(plan, q, k_cache, v_cache, scale=1.0)
    torch.testing.assert_close(got.double(), oracle(q, k_cache, v_cache, 1.0, specs), atol=1e-4, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# AttentionContext with a stand-in pool


class StandInPool:
    def __init__(self, num_layers: int, num_slots: int, hkv: int, d: int, gen: torch.Generator):
        self.k = torch.randn(num_layers, num_slots, hkv, d, generator=gen)
        self.v = torch.randn(num_layers, num_slots, hkv, d, generator=gen)
        self.writes: list[tuple[int, list[int]]] = []

    def scale(self, layer):
        return 1.0, 1.0

    def write(self, layer, slots, k, v):
        self.writes.append((layer, slots.tolist()))
        self.k[layer, slots] = k
        self.v[layer, slots] = v


def test_context_writes_then_attends():
    gen = torch.Generator().manual_seed(3)
    table, num_slots = random_table(gen, num_rows=4, width=32)
    pool = StandInPool(3, num_slots, 2, 16, gen)
    before = pool.k.clone()
    rows, pre, ext = torch.tensor([3, 1]), [5, 0], [2, 4]
    meta = extend_metadata(table, rows, torch.tensor(pre), torch.tensor(ext))
    ctx = AttentionContext.build(TorchAttnBackend(), meta, pool)
    q, k, v = torch.randn(6, 6, 16), torch.randn(6, 2, 16), torch.randn(6, 2, 16)
    got = ctx.attend(1, q, k, v, scale=0.25)
    new_slots = meta.out_cache_loc.tolist()
    assert pool.writes == [(1, new_slots)]
    torch.testing.assert_close(pool.k[1, new_slots], k)
    torch.testing.assert_close(pool.k[0], before[0])
    torch.testing.assert_close(pool.k[2], before[2])
    specs = [(table[r, : p + e].tolist(), causal_mask(e, p + e)) for r, p, e in zip(rows.tolist(), pre, ext)]
    torch.testing.assert_close(got.double(), oracle(q, pool.k[1], pool.v[1], 0.25, specs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_pool_with_kv_scales_stores_k_over_its_scale_and_attends_over_it_times_the_scale(kv):
    """A checkpoint's fp8 KV scales (fastspec.models.kv_scales): K is stored rounded from K / k_scale, V from
    V / v_scale, and attention is the oracle's over the stored values times their scales. Keys ~250x past e4m3's
    largest value fit once divided by k_scale 200 (saturated without it); other layers keep their own scales."""
    gen = torch.Generator().manual_seed(8)
    table, num_slots = random_table(gen, num_rows=4, width=32)
    scales = ((1.0, 1.0), (200.0, 0.01), (3.0, 7.0))
    pool = KVPool(3, 2, 16, num_slots, dtype=kv, scales=scales)
    rows, pre, ext = torch.tensor([3, 1]), [5, 0], [2, 4]
    meta = extend_metadata(table, rows, torch.tensor(pre), torch.tensor(ext))
    ctx = AttentionContext.build(TorchAttnBackend(), meta, pool)
    q = torch.randn(6, 6, 16, generator=gen) / 3000
    k, v = torch.randn(6, 2, 16, generator=gen) * 2e4, torch.randn(6, 2, 16, generator=gen) / 100
    for layer, (k_scale, v_scale) in enumerate(scales):  # every layer's K / V stays in its own scale
        ctx.attend(layer, q, k * k_scale / 200, v * v_scale / 0.01, scale=0.25)
    got = ctx.attend(1, q, k, v, scale=0.25)
    slots = meta.out_cache_loc
    assert torch.equal(pool.k[1, slots].view(torch.uint8), as_cache(k * (1 / 200), kv).view(torch.uint8))
    assert torch.equal(pool.v[1, slots].view(torch.uint8), as_cache(v * (1 / 0.01), kv).view(torch.uint8))
    assert pool.k[1, slots].float().abs().max() < 448  # not saturated
    stored_k, stored_v = pool.k[1].double() * 200, pool.v[1].double() * 0.01
    specs = [(table[r, : p + e].tolist(), causal_mask(e, p + e)) for r, p, e in zip(rows.tolist(), pre, ext)]
    expected = oracle(q, stored_k, stored_v, 0.25, specs)
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(pool.k[2, slots].double() * 3, (k * 3 / 200).double(), atol=0, rtol=2 ** -2)


def test_non_causal_without_mask_attends_everywhere():
    gen = torch.Generator().manual_seed(5)
    table, num_slots = random_table(gen, num_rows=3, width=16)
    rows, pre, ext = [2, 0], [3, 0], [2, 5]
    meta = extend_metadata(table, torch.tensor(rows), torch.tensor(pre), torch.tensor(ext))
    meta = dataclasses.replace(meta, causal=False)
    specs = [(table[r, : p + e].tolist(), torch.ones(e, p + e, dtype=torch.bool))
             for r, p, e in zip(rows, pre, ext)]
    q, k_cache, v_cache = torch.randn(7, 4, 8), torch.randn(num_slots, 2, 8), torch.randn(num_slots, 2, 8)
    got = run_backend(meta, q, k_cache, v_cache, scale=0.3)
    torch.testing.assert_close(got.double(), oracle(q, k_cache, v_cache, 0.3, specs), atol=1e-5, rtol=1e-5)
