"""The paged attention op's CPU kernel (fastspec.kernels.cpu_attention): eager, as the op and compiled it is one
computation, bit for bit; it is the torch twin to rounding; a verify row is the decode step of its token in every
dtype (what keeps 16-bit speculation lossless); where the C library is not there the op is its twin; the C dense plan
of a paged plan is the twin's. Skipped where no C compiler builds the kernels."""

from dataclasses import replace

import pytest
import torch

from fastspec.attention.paged import PagedPlan, paged_attention_twin, paged_block_plan, twin_plan
from fastspec.kernels import cpu_attention, cpu_fused, cpu_library
from fastspec.attention import TorchAttnBackend, decode_metadata, extend_metadata
from fastspec.kernels.cpu_attention import CpuPagedBackend, CpuTorchBackend
from fastspec.memory.kv_pool import as_cache

pytestmark = pytest.mark.skipif(not cpu_fused.available(), reason="no C compiler builds the CPU kernels")

HQ, HKV, D = 4, 2, 32
TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)  # node 3 skips node 1
TABLE = torch.arange(1, 2 * 160 + 1, dtype=torch.int32).view(2, 160)


def verify_plan(prefix: list[int]) -> PagedPlan:
    """A tree of 4 nodes per request after `prefix` committed tokens (slots 150..153 of its table row)."""
    return paged_block_plan(TABLE, torch.tensor([0, 1]), torch.tensor(prefix), TABLE[:, 150:154].long(),
                            TREE.expand(2, 4, 4))


def operands(dtype: torch.dtype, kv: torch.dtype, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(8, HQ, D, generator=g).to(dtype)
    k, v = (as_cache(torch.randn(330, HKV, D, generator=g), kv) for _ in range(2))
    return q, k, v


def op_args(plan: PagedPlan) -> tuple:
    return plan.table, plan.rows, plan.prefix_lens, plan.block_slots, plan.block_mask


DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
          (torch.bfloat16, torch.float8_e4m3fn)]


@pytest.mark.parametrize("dtype, kv", DTYPES)
def test_eager_op_and_compiled_are_one_computation_and_the_twin_to_rounding(dtype, kv):
    plan, (q, k, v) = verify_plan([5, 130]), operands(dtype, kv)
    eager = CpuPagedBackend().run(plan, q, k, v, D ** -0.5)
    op = torch.ops.fastspec.paged_attention(q, k, v, *op_args(plan), D ** -0.5, True)
    compiled = torch.compile(lambda *a: torch.ops.fastspec.paged_attention(*a) * 1, fullgraph=True, dynamic=False)(
        q, k, v, *op_args(plan), D ** -0.5, True)
    assert eager.dtype == dtype and torch.equal(eager, op) and torch.equal(eager, compiled)
    twin = paged_attention_twin(q, k, v, *op_args(plan), D ** -0.5, True)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]  # 16 bits: one step apart
    torch.testing.assert_close(eager.float(), twin.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, kv", DTYPES)
def test_a_verify_row_is_the_decode_step_of_its_token(dtype, kv):
    """Each tree node's row, bit for bit, is a one-row decode over the keys it sees: its prefix through the table,
    then its ancestors and itself as the block (what a plain step of that token reads). A prefix of 130 puts the
    tree past the kernel's first key chunk."""
    prefix = [5, 130]
    q, k, v = operands(dtype, kv)
    verified = CpuPagedBackend().run(verify_plan(prefix), q, k, v, D ** -0.5)
    for t in range(8):
        b, i = divmod(t, 4)
        seen = TABLE[b, 150:154][TREE[i]].long()[None]  # [1, ancestors + itself]
        alone = paged_block_plan(TABLE, torch.tensor([b]), torch.tensor([prefix[b]]), seen,
                                 torch.ones(1, 1, seen.shape[1], dtype=torch.bool))
        assert torch.equal(verified[t], CpuPagedBackend().run(alone, q[t:t + 1], k, v, D ** -0.5)[0]), t


def test_a_shared_key_after_the_block_is_one_more_key_of_every_row():
    """paged_block_plan's `shared` keys (a STANDALONE draft's first-token key) follow the new tokens: each row is,
    bit for bit, the decode step over its prefix, its ancestors, itself (by the diagonal alone: the mask here has
    none, so a shifted diagonal would show) and its request's shared key; the twin agrees to rounding."""
    prefix, shared = [5, 130], torch.tensor([325, 9])  # neither in its request's prefix or tree
    q, k, v = operands(torch.float32, torch.float32)
    strict = TREE & ~torch.eye(4, dtype=torch.bool)
    plan = paged_block_plan(TABLE, torch.tensor([0, 1]), torch.tensor(prefix), TABLE[:, 150:154].long(),
                            strict.expand(2, 4, 4), shared)
    assert torch.equal(plan.out_cache_loc, TABLE[:, 150:154].long().flatten())  # the shared keys are not written
    got = CpuPagedBackend().run(plan, q, k, v, D ** -0.5)
    torch.testing.assert_close(got, paged_attention_twin(q, k, v, *op_args(plan), D ** -0.5, True), atol=1e-5,
                               rtol=1e-5)
    for t in range(8):
        b, i = divmod(t, 4)
        seen = torch.cat([TABLE[b, 150:154][TREE[i]].long(), shared[b:b + 1]])[None]
        alone = paged_block_plan(TABLE, torch.tensor([b]), torch.tensor([prefix[b]]), seen,
                                 torch.ones(1, 1, seen.shape[1], dtype=torch.bool))
        assert torch.equal(got[t], CpuPagedBackend().run(alone, q[t:t + 1], k, v, D ** -0.5)[0]), t


def test_without_the_library_the_op_is_its_twin(monkeypatch):
    plan, (q, k, v) = verify_plan([5, 130]), operands(torch.bfloat16, torch.bfloat16)
    monkeypatch.setattr(cpu_library, "library", lambda: None)
    twin = paged_attention_twin(q, k, v, *op_args(plan), D ** -0.5, True)
    assert torch.equal(torch.ops.fastspec.paged_attention(q, k, v, *op_args(plan), D ** -0.5, True), twin)
    assert torch.equal(CpuPagedBackend().run(plan, q, k, v, D ** -0.5), twin)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_prefill_token_through_the_torch_backend_is_its_decode_step(dtype):
    """CpuTorchBackend over the engine's extend metadata (9 tokens after 140 cached): each token, bit for bit, is a
    decode step of it alone; the torch backend's SDPA to rounding."""
    table = TABLE[:1]
    q, k, v = operands(dtype, dtype)
    q = torch.cat([q, q[:1]])  # 9 tokens
    backend = CpuTorchBackend()
    meta = extend_metadata(table, torch.tensor([0]), torch.tensor([140]), torch.tensor([9]))
    prefilled = backend.run(backend.plan(meta), q, k, v, D ** -0.5)
    for t in range(9):
        alone = backend.plan(decode_metadata(table, torch.tensor([0]), torch.tensor([141 + t])))
        assert torch.equal(prefilled[t], backend.run(alone, q[t:t + 1], k, v, D ** -0.5)[0]), t
    sdpa = TorchAttnBackend().run(TorchAttnBackend().plan(meta), q, k, v, D ** -0.5)
    torch.testing.assert_close(prefilled.float(), sdpa.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype, kv", DTYPES)
def test_a_latent_pool_attends_in_the_kernel_as_its_decode_steps(dtype, kv):
    """MLA over its latent pool (one KV head, V = the first C values of K's row: a view, not a copy): the kernel
    takes it, each verify row is the decode step of its token bit for bit, and the torch twin to rounding. (On the
    twin's SDPA a bfloat16 DeepSeek target's logprobs moved by ~2e-2 with a prefix-cache hit.)"""
    C, R = 48, 16
    g = torch.Generator().manual_seed(5)
    q = torch.randn(8, HQ, C + R, generator=g).to(dtype)
    latent = as_cache(torch.randn(330, 1, C + R, generator=g), kv)
    v = latent[..., :C]
    assert cpu_attention.c_attends(q, latent, v)
    plan, scale = verify_plan([5, 130]), (C + R) ** -0.5
    verified = CpuPagedBackend().run(plan, q, latent, v, scale)
    assert verified.shape == (8, HQ, C) and verified.dtype == dtype
    for t in range(8):
        b, i = divmod(t, 4)
        seen = TABLE[b, 150:154][TREE[i]].long()[None]
        alone = paged_block_plan(TABLE, torch.tensor([b]), torch.tensor([[5, 130][b]]), seen,
                                 torch.ones(1, 1, seen.shape[1], dtype=torch.bool))
        assert torch.equal(verified[t], CpuPagedBackend().run(alone, q[t:t + 1], latent, v, scale)[0]), t
    twin = paged_attention_twin(q, latent, v, *op_args(plan), scale, True)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(verified.float(), twin.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("self_visible", [True, False])
def test_paged_dense_plan_is_the_twins(self_visible):
    """The C dense plan of a paged plan equals attention.paged.twin_plan: prefix columns from a table row up to each
    request's length (0 included), the block after them, the diagonal where self_visible; the table a column slice of
    a wider one (its row stride is not its width)."""
    g = torch.Generator().manual_seed(9)
    wide = torch.randint(0, 1000, (6, 40), generator=g, dtype=torch.int32)
    for bs, q_rows, x in ((1, 1, 1), (3, 1, 2), (2, 4, 4), (4, 3, 5)):
        prefix = PagedPlan(wide[:, :32], torch.randperm(6, generator=g)[:bs], torch.randint(0, 33, (bs,), generator=g),
                           torch.randint(0, 1000, (bs, x), generator=g), torch.rand(bs, q_rows, x, generator=g) < 0.5,
                           torch.zeros(bs * q_rows, dtype=torch.int64), self_visible)
        for plan in (prefix, replace(prefix, prefix_lens=torch.zeros(bs, dtype=torch.int64))):
            want = twin_plan(plan.table, plan.rows, plan.prefix_lens, plan.block_slots, plan.block_mask, self_visible)
            got = cpu_fused.paged_dense_plan(plan)
            for field in ("q_index", "kv_slots", "mask", "out_index", "out_cache_loc", "uniform_qo"):
                a, b = getattr(got, field), getattr(want, field)
                assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, field
