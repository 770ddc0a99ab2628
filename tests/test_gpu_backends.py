"""GPU backends: FlashInfer attention, checked on CPU and (marked `gpu`) on CUDA (sgl_kernel: test_kernel_dispatch).

CPU (the plan-argument functions against hand-worked metadata: test_flashinfer_plan): the whole
FlashInferAttnBackend driven through a fake `flashinfer` module whose wrappers execute FlashInfer's documented
plan()/run() semantics with a dense float64 loop (keyword-only optional plan arguments, int32 index checks, fixed
batch and row capacity in graph mode), compared with TorchAttnBackend. GPU: the real flashinfer against the torch
backend.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from fake_flashinfer import FakeDecodeWrapper, FakePrefillWrapper
from test_flashinfer_plan import I32, t32

from fastspec.attention import (
    AttentionContext,
    TorchAttnBackend,
    decode_metadata,
    draft_decode_metadata,
    draft_extend_metadata,
    extend_metadata,
    make_backend,
    verify_metadata,
)
from fastspec.attention.flashinfer_backend import FlashInferAttnBackend
from fastspec.attention.flashinfer_plan import GraphBucket, GraphLimits
from fastspec.attention.metadata import AttnMetadata, AttnMode
from fastspec.errors import FastspecError
from fastspec.kernels.tree_build import ancestor_mask, full_tree_mask


# ---------------------------------------------------------------------------------------------------------
# metadata fixtures


def random_tree_mask(gen, seq_lens: torch.Tensor, n: int) -> torch.Tensor:
    """FULL_MASK of a random tree per request (parent of node t uniform in [0, t))."""
    bs = seq_lens.numel()
    parents = (torch.rand(bs, n - 1, generator=gen) * torch.arange(1, n)).long()
    parent_pos = torch.cat([torch.full((bs, 1), -1), parents], 1)
    return full_tree_mask(ancestor_mask(parent_pos), seq_lens, int(seq_lens.sum()))


def scenario(device="cpu", rows=(0, 1, 2), seq=(5, 3, 7), seed=0):
    """Random slot table, K/V pool and one metadata per mode for requests `rows` with lengths `seq`."""
    gen = torch.Generator().manual_seed(seed)
    num_rows, width = 4, 32
    num_slots = num_rows * width + 1
    table = (torch.randperm(num_slots - 1, generator=gen)[: num_rows * width] + 1).view(num_rows, width).to(I32)
    k = torch.randn(num_slots, 2, 16, generator=gen).to(torch.bfloat16)
    v = torch.randn(num_slots, 2, 16, generator=gen).to(torch.bfloat16)
    rows_t, seq_t = torch.tensor(rows), torch.tensor(seq)
    metas = {
        "extend": extend_metadata(table, rows_t, seq_t - seq_t.clamp(max=3), seq_t.clamp(max=3)),
        "decode": decode_metadata(table, rows_t, seq_t),
        "draft_decode": draft_decode_metadata(table, rows_t, seq_t, topk=2, num_steps=3, step=1),
        "draft_extend": draft_extend_metadata(table, rows_t, seq_t, torch.minimum(seq_t % 3 + 1, seq_t)),
        "verify": verify_metadata(table, rows_t, seq_t, 4, random_tree_mask(gen, seq_t, 4)),
    }
    to = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
    metas = {name: AttnMetadata(*[to(getattr(m, f)) for f in AttnMetadata.__dataclass_fields__])
             for name, m in metas.items()}
    return table.to(device), k.to(device), v.to(device), metas


def reference(meta, q, k, v, scale):
    """TorchAttnBackend in float32 on the same (bf16-rounded) inputs."""
    backend = TorchAttnBackend()
    return backend.run(backend.plan(meta), q.float(), k.float(), v.float(), scale)


# ---------------------------------------------------------------------------------------------------------
# the whole backend through a fake flashinfer, against the torch backend


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = FakePrefillWrapper
    module.BatchDecodeWithPagedKVCacheWrapper = FakeDecodeWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


def fake_backend(**kwargs) -> FlashInferAttnBackend:
    return FlashInferAttnBackend(8, 2, 16, torch.bfloat16, "cpu", workspace_bytes=64, **kwargs)


MODES = ["extend", "decode", "draft_decode", "draft_extend", "verify"]


@pytest.mark.parametrize("name", MODES)
def test_fake_flashinfer_backend_matches_torch_backend(fake_flashinfer, name):
    _, k, v, metas = scenario()
    meta = metas[name]
    backend = fake_backend()
    q = torch.randn(meta.num_tokens, 8, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    plan = backend.plan(meta)
    out = backend.run(plan, q, k, v, 0.3)  # 0.3 != 16 ** -0.5: the q_scale path
    torch.testing.assert_close(out.float(), reference(meta, q, k, v, 0.3), atol=2e-2, rtol=2e-2)
    decode = meta.mode in (AttnMode.DECODE, AttnMode.DRAFT_DECODE)
    assert isinstance(plan.wrapper, FakeDecodeWrapper if decode else FakePrefillWrapper)
    assert plan.out_cache_loc is meta.out_cache_loc and not plan.wrapper.use_cuda_graph
    if decode:
        assert plan.wrapper.use_tensor_cores  # GQA group 8 / 2 = 4
    else:
        assert plan.wrapper.backend == ("fa2" if name == "draft_extend" else "auto")


@pytest.mark.parametrize("graph", [False, True])
def test_draft_steps_planned_up_front_keep_their_own_wrappers(fake_flashinfer, graph):
    table, k, v, _ = scenario()
    rows, seq = torch.tensor([0, 1, 2]), torch.tensor([5, 3, 7])
    backend = fake_backend(graph_limits=GraphLimits(8, 8, 32) if graph else None)
    bucket = GraphBucket(8, 8) if graph else None
    metas = [draft_decode_metadata(table, rows, seq, topk=2, num_steps=3, step=s) for s in range(2)]
    plans = [backend.plan(meta, step=s, graph=bucket) for s, meta in enumerate(metas)]  # plan both, then run
    assert plans[0].wrapper is not plans[1].wrapper and plans[0].key != plans[1].key
    for meta, plan in zip(metas, plans):
        q = torch.randn(8 if graph else 6, 8, 16).to(torch.bfloat16)
        out = backend.run(plan, q, k, v, 0.25)[:6]
        torch.testing.assert_close(out.float(), reference(meta, q[:6], k, v, 0.25), atol=2e-2, rtol=2e-2)


def test_graph_mode_verify_pads_and_replans_the_same_buffers(fake_flashinfer):
    backend = fake_backend(graph_limits=GraphLimits(4, 16, 32))
    bucket = GraphBucket(4, 16)  # 4 requests x N = 4 tree tokens
    plans = []
    for rows, seq, seed in (((0, 1, 2), (5, 3, 7), 0), ((3, 1), (9, 2), 1)):
        _, k, v, metas = scenario(rows=rows, seq=seq, seed=seed)
        meta = metas["verify"]
        plan = backend.plan(meta, graph=bucket)
        real = meta.num_tokens
        assert torch.equal(plan.out_cache_loc[:real], meta.out_cache_loc)
        assert bool((plan.out_cache_loc[real:] == 0).all())  # padded rows write the dummy slot
        q = torch.randn(16, 8, 16).to(torch.bfloat16)
        out = backend.run(plan, q, k, v, 0.25)[:real]
        torch.testing.assert_close(out.float(), reference(meta, q[:real], k, v, 0.25), atol=2e-2, rtol=2e-2)
        plans.append(plan)
    assert plans[0].wrapper is plans[1].wrapper
    assert plans[0].out_cache_loc.data_ptr() == plans[1].out_cache_loc.data_ptr()  # what the graph reads
    first = plans[0].wrapper.plans[0]  # the capture-shape plan: 4 dummy requests covering all 16 rows
    assert torch.equal(first["qo_indptr"], t32([0, 1, 2, 3, 16])) and first["masked"]
    assert [p["rows"] for p in plans[0].wrapper.plans] == [16, 16, 16]
    with pytest.raises(ValueError):
        backend.plan(scenario()[3]["decode"], graph=GraphBucket(4, 8))  # a decode bucket has one row per request
    with pytest.raises(ValueError):
        fake_backend().plan(scenario()[3]["verify"], graph=bucket)  # no graph_limits


def test_make_backend_and_constructor_errors(fake_flashinfer, monkeypatch):
    assert isinstance(make_backend("torch"), TorchAttnBackend)
    with pytest.raises(FastspecError, match="flashinfer needs a CUDA device"):
        make_backend("flashinfer", num_qo_heads=8, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16, device="cpu")
    with pytest.raises(FastspecError, match="unknown attention backend"):
        make_backend("triton")
    with pytest.raises(FastspecError, match="float16 or bfloat16"):
        FlashInferAttnBackend(8, 2, 16, torch.float32, "cpu", workspace_bytes=64)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(FastspecError, match="MLA attention reads the latent cache in"):  # before any CUDA call
        make_backend("flashinfer", num_qo_heads=8, num_kv_heads=1, head_dim=80, dtype=torch.bfloat16, device="cuda",
                     kv_lora_rank=64, sm_scale=0.1, kv_dtype=torch.float8_e4m3fn)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer -> ImportError
    with pytest.raises(FastspecError, match="flashinfer is not importable"):
        fake_backend()


# ---------------------------------------------------------------------------------------------------------
# GPU: the real flashinfer


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])  # tensor-core decode and plain decode
@pytest.mark.parametrize("name", MODES)
@pytest.mark.parametrize("kv", [torch.bfloat16, torch.float8_e4m3fn])
def test_flashinfer_matches_torch_backend(name, heads, kv):
    """kv: the cache's dtype (an fp8 cache as --kv-cache-dtype fp8_e4m3 stores it; the reference reads the same
    stored values)."""
    pytest.importorskip("flashinfer")
    hq, hkv = heads
    _, k, v, metas = scenario("cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    k = torch.randn(k.shape[0], hkv, 64, device="cuda", generator=gen).to(kv)
    v = torch.randn(k.shape[0], hkv, 64, device="cuda", generator=gen).to(kv)
    meta = metas[name]
    backend = make_backend("flashinfer", num_qo_heads=hq, num_kv_heads=hkv, head_dim=64, dtype=torch.bfloat16,
                           kv_dtype=kv, device="cuda")
    q = torch.randn(meta.num_tokens, hq, 64, device="cuda", generator=gen).to(torch.bfloat16)
    out = backend.run(backend.plan(meta), q, k, v, 0.125)
    wide = (k.to(torch.bfloat16), v.to(torch.bfloat16))
    torch.testing.assert_close(out.float(), reference(meta, q, *wide, 0.125), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["extend", "decode", "verify"])
def test_flashinfer_over_a_pool_with_kv_scales_is_the_torch_backend(name):
    """An fp8 pool with a checkpoint's KV scales (K stored / k_scale: flashinfer reads it with k_scale x its planned
    softmax scale through q_scale; V's scale on its output), through AttentionContext as the model calls it."""
    pytest.importorskip("flashinfer")
    from fastspec.memory.kv_pool import KVPool

    meta = scenario("cuda")[3][name]
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(meta.num_tokens, h, 64, device="cuda", generator=gen).to(torch.bfloat16) * m
               for h, m in ((8, 1 / 300), (2, 300.0), (2, 0.01)))
    keys = torch.randn(128, 2, 64, device="cuda", generator=gen) * 300  # every slot of the table holds a key
    values = torch.randn(128, 2, 64, device="cuda", generator=gen) / 100
    outs = []
    for backend in (make_backend("flashinfer", num_qo_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                                 kv_dtype=torch.float8_e4m3fn, device="cuda"), TorchAttnBackend()):
        pool = KVPool(2, 2, 64, 4 * 32, dtype=torch.float8_e4m3fn, device="cuda", scales=((1.0, 1.0), (4.0, 0.001)))
        pool.write(1, torch.arange(1, 4 * 32 + 1, device="cuda"), keys, values)
        outs.append(AttentionContext.build(backend, meta, pool).attend(1, q, k, v, 0.125).float())
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2 * outs[1].abs().max().item(), rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("name,bucket", [("verify", GraphBucket(4, 16)), ("draft_decode", GraphBucket(8, 8))])
def test_flashinfer_graph_capture_and_replay(name, bucket):
    pytest.importorskip("flashinfer")
    backend = make_backend("flashinfer", num_qo_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                           device="cuda", graph_limits=GraphLimits(8, 16, 32))
    _, k, v, metas = scenario("cuda", rows=(0, 1, 2), seq=(5, 3, 7))
    k = torch.randn(k.shape[0], 2, 64, device="cuda").to(torch.bfloat16)
    v = torch.randn_like(k)
    q_static = torch.zeros(bucket.num_tokens, 8, 64, device="cuda", dtype=torch.bfloat16)
    plan = backend.plan(metas[name], graph=bucket)
    backend.run(plan, q_static, k, v, 0.125)  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = backend.run(plan, q_static, k, v, 0.125)
    for rows, seq in (((0, 1, 2), (5, 3, 7)), ((3, 1), (9, 2))):
        meta = scenario("cuda", rows=rows, seq=seq)[3][name]
        replanned = backend.plan(meta, graph=bucket)
        assert replanned.wrapper is plan.wrapper
        q = torch.randn(meta.num_tokens, 8, 64, device="cuda").to(torch.bfloat16)
        q_static[: meta.num_tokens].copy_(q)
        graph.replay()
        torch.testing.assert_close(out_static[: meta.num_tokens].float(), reference(meta, q, k, v, 0.125),
                                   atol=2e-2, rtol=2e-2)
