"""The Triton paged-attention kernels against an independent float64 loop and against the torch twin (on CPU in
Triton's interpreter, TRITON_INTERPRET=1 set by conftest; on a GPU compiled): pages of 1 and 16 slots, mixed and
zero prefix lengths, tree and causal blocks, the draft loop's rows (topk > 1, ancestors as the block), GQA and
MLA's latent MQA (V a view of K), float32 and float16, several prefix splits."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: E402,F401  (a dev dependency: CI must not skip these)

from fastspec.attention.paged import paged_attention_twin, paged_block_plan  # noqa: E402
from fastspec.attention.triton_paged import paged_attention as triton_paged_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 3e-3}


def oracle(q, k_cache, v_cache, table, rows, prefix_lens, block_slots, block_mask, scale):
    """Per (row, head): the visible slots listed by hand, softmax in float64."""
    bs, q_rows, _ = block_mask.shape
    hq, hkv = q.shape[1], k_cache.shape[1]
    out = torch.empty(q.shape[0], hq, v_cache.shape[-1], dtype=torch.float64)
    for b in range(bs):
        prefix = [int(s) for s in table[rows[b], : int(prefix_lens[b])]]
        for i in range(q_rows):
            slots = prefix + [int(s) for s, ok in zip(block_slots[b], block_mask[b, i]) if ok]
            for h in range(hq):
                kvh = h // (hq // hkv)
                k = k_cache[slots, kvh].double()
                v = v_cache[slots, kvh].double()
                w = torch.softmax(k @ q[b * q_rows + i, h].double() * scale, 0)
                out[b * q_rows + i, h] = w @ v
    return out


def paged_table(lens: list[int], page: int, slots_total: int, gen) -> torch.Tensor:
    """int32 [bs, max_len]: each request's positions on pages taken at random (slot = page * P + offset)."""
    pages = torch.randperm(slots_total // page - 1, generator=gen) + 1  # page 0 holds dummy slot 0
    width, taken, table = max(lens), 0, []
    for n in lens:
        need = -(-width // page)
        own = pages[taken: taken + need]
        taken += need
        table.append((own[:, None] * page + torch.arange(page)[None, :]).flatten()[:width])
    return torch.stack(table).to(torch.int32)


def case(prefix_lens, q_rows, block, page, hq, hkv, d, dv, dtype, seed=0, latent=False):
    gen = torch.Generator().manual_seed(seed)
    bs = len(prefix_lens)
    slots_total = 4096
    table = paged_table([n + q_rows + 8 for n in prefix_lens], page, slots_total, gen)
    rows = torch.randperm(bs, generator=gen)  # table rows out of request order
    table = table[torch.argsort(rows)]
    k_cache = torch.randn(slots_total, hkv, d, generator=gen).to(dtype)
    v_cache = k_cache[..., :dv] if latent else torch.randn(slots_total, hkv, dv, generator=gen).to(dtype)
    q = torch.randn(bs * q_rows, hq, d, generator=gen).to(dtype)
    lens = torch.tensor(prefix_lens)
    if block == "tree":  # a random tree over the Q new tokens: ancestors + self
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, q_rows)]
        mask = torch.eye(q_rows, dtype=torch.bool)
        for i in range(1, q_rows):
            mask[i] |= mask[parents[i]]
        block_mask = mask.expand(bs, q_rows, q_rows).clone()
        block_slots = table[rows[:, None], lens[:, None] + torch.arange(q_rows)].long()
    else:  # "draft": Q = 1 row per branch, its block = a few ancestor slots + its own, all visible
        x = 3
        block_slots = torch.randint(1, slots_total, (bs, x), generator=gen)
        block_mask = torch.ones(bs, 1, x, dtype=torch.bool)
    args = [t.to(DEVICE) if isinstance(t, torch.Tensor) else t
            for t in (q, k_cache, v_cache, table, rows, lens, block_slots, block_mask)]
    return args, d ** -0.5


CASES = {
    "tree_page1": dict(prefix_lens=[5, 0, 130, 77], q_rows=6, block="tree", page=1, hq=4, hkv=2, d=32, dv=32),
    "tree_page16": dict(prefix_lens=[33, 200, 16, 1], q_rows=8, block="tree", page=16, hq=4, hkv=2, d=24, dv=24),
    "decode_mha": dict(prefix_lens=[300, 7, 64], q_rows=1, block="tree", page=16, hq=3, hkv=3, d=16, dv=16),
    # draft loop, topk 3: three branch rows per request share its table row and prefix
    "draft_topk3": dict(prefix_lens=[40, 40, 40, 9, 9, 9], q_rows=1, block="draft", page=1, hq=4, hkv=1, d=16, dv=16),
    "mla_latent": dict(prefix_lens=[70, 3], q_rows=4, block="tree", page=16, hq=4, hkv=1, d=40, dv=32, latent=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_oracle_and_twin(name, dtype):
    spec = CASES[name]
    args, scale = case(**spec, dtype=dtype)
    want = oracle(*[a.cpu() for a in args], scale)
    twin = paged_attention_twin(*args, scale).cpu()
    torch.testing.assert_close(twin.double(), want, atol=TOL[dtype], rtol=TOL[dtype])
    for splits in (0, 1, 3):  # 0: one kernel, no combine
        got = triton_paged_attention(*args, scale, splits=splits).cpu()
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])
    if spec["block"] == "tree":  # the new tokens' own keys by self_visible instead of the mask's diagonal
        q_rows = spec["q_rows"]
        off_diagonal = args[7] & ~torch.eye(q_rows, dtype=torch.bool, device=args[7].device)
        bare = [*args[:7], off_diagonal]
        torch.testing.assert_close(paged_attention_twin(*bare, scale, True).cpu(), twin)
        for splits in (0, 3):
            got = triton_paged_attention(*bare, scale, self_visible=True, splits=splits).cpu()
            torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("name, kv", [("tree_page16", torch.float16), ("mla_latent", torch.float16),
                                      ("tree_page16", torch.float8_e4m3fn), ("decode_mha", torch.float8_e5m2)])
def test_a_smaller_cache_under_float32_queries(name, kv):
    """--kv-cache-dtype float16 / fp8 on a float32 model: the kernel widens the stored keys and values; its output
    is float32, the oracle's over the same stored values to float32 rounding."""
    args, scale = case(**CASES[name], dtype=torch.float32)
    latent = CASES[name].get("latent", False)
    args[1] = args[1].to(kv)
    args[2] = args[1][..., :args[2].shape[-1]] if latent else args[2].to(kv)
    want = oracle(*[a.cpu() for a in args], scale)
    for splits in (0, 2):
        got = triton_paged_attention(*args, scale, splits=splits).cpu()
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, atol=TOL[torch.float32], rtol=TOL[torch.float32])
    torch.testing.assert_close(paged_attention_twin(*args, scale).cpu().double(), want, atol=TOL[torch.float32],
                               rtol=TOL[torch.float32])


def test_rows_that_see_only_the_block_and_one_key():
    """Zero prefix everywhere and a block mask allowing one key per row: each output is exactly that key's V."""
    args, scale = case(prefix_lens=[0, 0], q_rows=3, block="tree", page=1, hq=2, hkv=1, d=8, dv=8,
                       dtype=torch.float32)
    q, k_cache, v_cache, table, rows, lens, block_slots, _ = args
    diag = torch.eye(3, dtype=torch.bool, device=q.device).expand(2, 3, 3).contiguous()
    want = v_cache[block_slots.flatten()].expand(-1, 2, -1)
    nothing = torch.zeros_like(diag)  # the same keys through self_visible alone
    for splits in (0, 2):
        got = triton_paged_attention(q, k_cache, v_cache, table, rows, lens, block_slots, diag, scale, splits=splits)
        torch.testing.assert_close(got, want)
        got = triton_paged_attention(q, k_cache, v_cache, table, rows, lens, block_slots, nothing, scale,
                                     self_visible=True, splits=splits)
        torch.testing.assert_close(got, want)


def test_a_shared_key_after_the_block_keeps_each_row_its_own_key():
    """paged_block_plan's `shared` key per request (a STANDALONE draft's first-token key) after the new tokens: row i
    still sees block key i by self_visible (the mask here has no diagonal), and every row sees the shared key."""
    args, scale = case(**CASES["tree_page16"], dtype=torch.float32)
    q, k_cache, v_cache, table, rows, lens, block_slots, block_mask = args
    eye = torch.eye(block_mask.shape[1], dtype=torch.bool, device=q.device)
    shared = torch.tensor([5, 4000, 17, 1000], device=q.device)
    plan = paged_block_plan(table, rows, lens, block_slots, block_mask & ~eye, shared)
    want = oracle(*(t.cpu() for t in (q, k_cache, v_cache, table, rows, lens, plan.block_slots)),
                  torch.cat([block_mask, torch.ones_like(block_mask[..., :1])], 2).cpu(), scale)
    for splits in (0, 2):
        got = triton_paged_attention(q, k_cache, v_cache, table, rows, lens, plan.block_slots, plan.block_mask, scale,
                                     self_visible=True, splits=splits)
        torch.testing.assert_close(got.cpu().double(), want, atol=TOL[torch.float32], rtol=TOL[torch.float32])


@pytest.mark.parametrize("page_size", [1, 16])
def test_speculative_decoding_through_the_triton_kernels_is_lossless(monkeypatch, tiny_dirs, draft_dirs, page_size):
    """EAGLE-3 with a topk-2 tree whose draft loop, draft extend and verify attend through the Triton kernels
    (interpreted on CPU) decodes exactly what target-only decoding does."""
    from test_speculative import PROMPTS, reference, spec_llm

    from fastspec.sampling import SamplingParams

    monkeypatch.setenv("FASTSPEC_TRITON_ATTENTION", "1")
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    llm = spec_llm(tiny_dirs, draft_dirs, "llama", "EAGLE3", "eagle3", 3, 2, 4, page_size, device=DEVICE,
                   graphs="eager")
    outputs = llm.engine.generate(PROMPTS[:2], [params] * 2)
    assert [o.output_ids for o in outputs] == reference(tiny_dirs, "llama", page_size, PROMPTS[:2], params)
    assert all(o.metrics.verify_rounds for o in outputs)


def test_eager_backend_plans_once_per_forward_and_equals_the_op(monkeypatch):
    """PagedAttnBackend eager on the host builds the twin's dense plan on a forward's first call and reuses it for
    the others (same plan object); a new plan object (the next forward) is planned anew, never served stale."""
    from fastspec.attention import paged

    backend, calls = paged.PagedAttnBackend(), []
    real = paged.twin_plan

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(paged, "twin_plan", counted)
    first, second = (case(**CASES[name], dtype=torch.float32) for name in ("tree_page16", "draft_topk3"))
    for args, scale in (first, second, first):
        q, k_cache, v_cache, table, rows, lens, block_slots, block_mask = (a.cpu() for a in args)
        plan = paged.PagedPlan(table, rows, lens, block_slots, block_mask, block_slots.flatten())
        want = oracle(q, k_cache, v_cache, table, rows, lens, block_slots, block_mask, scale)
        for _ in range(3):  # three layers of one forward
            got = backend.run(plan, q, k_cache, v_cache, scale)
            torch.testing.assert_close(got.double(), want, atol=TOL[torch.float32], rtol=TOL[torch.float32])
    assert len(calls) == 3  # one plan per forward
