"""The FlashInfer MLA backend on CPU, driven through a fake `flashinfer.mla` whose wrapper executes FlashInfer's
documented BatchMLAPagedAttentionWrapper plan() / run() semantics densely in float64, against the torch backend
over the same latent pool (AttentionContext.attend_latent), for prefill chunks and decode; plan arguments worked
by hand. (On a GPU the real kernels would be checked the same way; no GPU was lent to write this.)"""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

from fastspec.attention import AttentionContext, TorchAttnBackend, decode_metadata, extend_metadata
from fastspec.attention.flashinfer_mla import PLAN_ORDER, FlashInferMLABackend, MLAShape, mla_plan_args
from fastspec.memory import KVPool

H, C, R = 4, 32, 16  # heads, kv_lora_rank, rope dim
I32 = torch.int32


class FakeMLAWrapper:
    def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None, kv_indptr=None,
                 kv_indices=None, kv_len_arr=None, backend="auto"):
        self.plans = []

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type, use_profiler=False):
        for t in (qo_indptr, kv_indptr, kv_indices, kv_len_arr):
            assert t.dtype == I32
        assert page_size == 1 and torch.equal(kv_len_arr, kv_indptr[1:] - kv_indptr[:-1])  # page size 1
        self.plans.append(dict(rows=int(qo_indptr[-1]), causal=causal))
        self.state = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len=kv_len_arr,
                          heads=num_heads, ckv=head_dim_ckv, kpe=head_dim_kpe, causal=causal, scale=sm_scale,
                          q_dtype=q_data_type)

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False):
        s = self.state
        assert q_nope.shape[1:] == (s["heads"], s["ckv"]) and q_pe.shape[1:] == (s["heads"], s["kpe"])
        assert ckv_cache.shape[1:] == (1, s["ckv"]) and kpe_cache.shape[1:] == (1, s["kpe"])
        assert q_nope.dtype == s["q_dtype"]
        o = torch.zeros(q_nope.shape, dtype=torch.float64)
        for b in range(s["qo_indptr"].numel() - 1):
            q0, q1 = int(s["qo_indptr"][b]), int(s["qo_indptr"][b + 1])
            slots = s["kv_indices"][int(s["kv_indptr"][b]): int(s["kv_indptr"][b + 1])].long()
            ckv, kpe = ckv_cache[slots, 0].double(), kpe_cache[slots, 0].double()
            logits = (torch.einsum("qhc,kc->hqk", q_nope[q0:q1].double(), ckv)
                      + torch.einsum("qhr,kr->hqk", q_pe[q0:q1].double(), kpe)) * s["scale"]
            n, q = slots.numel(), q1 - q0
            allowed = torch.arange(n)[None, :] <= n - q + torch.arange(q)[:, None] if s["causal"] else \
                torch.ones(q, n, dtype=torch.bool)
            o[q0:q1] = torch.einsum("hqk,kc->qhc", logits.masked_fill(~allowed, -torch.inf).softmax(-1), ckv)
        return o.to(q_nope.dtype)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = types.ModuleType("flashinfer")
    module.mla = types.SimpleNamespace(BatchMLAPagedAttentionWrapper=FakeMLAWrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


def test_plan_args_by_hand():
    table = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]], dtype=I32)
    meta = extend_metadata(table, torch.tensor([1, 0]), torch.tensor([1, 0]), torch.tensor([2, 3]))
    args = mla_plan_args(meta, MLAShape(H, C, R, torch.bfloat16, torch.bfloat16, 0.1))
    assert list(args) == list(PLAN_ORDER)
    assert args["qo_indptr"].tolist() == [0, 2, 5] and args["kv_indptr"].tolist() == [0, 3, 6]
    assert args["kv_indices"].tolist() == [9, 10, 11, 5, 6, 7] and args["kv_len_arr"].tolist() == [3, 3]
    assert (args["head_dim_ckv"], args["head_dim_kpe"], args["page_size"], args["causal"]) == (C, R, 1, True)


@pytest.mark.parametrize("kind", ["extend", "decode"])
def test_fake_flashinfer_mla_matches_torch_backend(fake_flashinfer, kind):
    compare_with_torch_backend(kind, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["extend", "decode"])
def test_flashinfer_mla_matches_torch_backend(kind):
    pytest.importorskip("flashinfer")
    compare_with_torch_backend(kind, "cuda")


def compare_with_torch_backend(kind: str, device: str):
    gen = torch.Generator().manual_seed(0)
    table = (torch.randperm(60, generator=gen)[:3 * 16] + 1).view(3, 16).to(I32)
    pool = KVPool(2, 1, C + R, capacity=64, dtype=torch.bfloat16, separate_v=False)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    rows = torch.tensor([2, 0, 1])
    if kind == "extend":  # chunks after cached prefixes of different lengths
        meta = extend_metadata(table, rows, torch.tensor([0, 5, 9]), torch.tensor([4, 3, 1]))
    else:
        meta = decode_metadata(table, rows, torch.tensor([7, 1, 12]))
    T = meta.num_tokens
    q = torch.randn(T, H, C + R, generator=gen).to(torch.bfloat16)
    latent = torch.randn(T, 1, C + R, generator=gen).to(torch.bfloat16)
    if device != "cpu":
        pool.k = pool.k.to(device)
        meta, q, latent = (dataclasses.replace(meta, **{f.name: getattr(meta, f.name).to(device) for f in
                                                         dataclasses.fields(meta) if f.name != "custom_mask"
                                                         and isinstance(getattr(meta, f.name), torch.Tensor)}),
                           q.to(device), latent.to(device))
    scale = 0.13
    out = {}
    for name, backend in (("torch", TorchAttnBackend()),
                          ("flashinfer", FlashInferMLABackend(H, C, R, torch.bfloat16, device, 0.1, 128 << 20))):
        ctx = AttentionContext.build(backend, meta, pool)
        out[name] = ctx.attend_latent(1, q, latent, C, scale).float().cpu()  # 0.13 != planned 0.1: q rescaled
    assert out["flashinfer"].shape == (T, H, C)
    torch.testing.assert_close(out["flashinfer"], out["torch"], atol=3e-2, rtol=3e-2)


def test_custom_masks_and_mismatched_caches_are_refused(fake_flashinfer):
    backend = FlashInferMLABackend(H, C, R, torch.bfloat16, "cpu", 0.1, 64)
    table = torch.arange(1, 9, dtype=I32).view(1, 8)
    meta = extend_metadata(table, torch.tensor([0]), torch.tensor([2]), torch.tensor([2]))
    masked = dataclasses.replace(meta, custom_mask=torch.ones(8, dtype=torch.bool))
    with pytest.raises(ValueError, match="no custom mask"):
        backend.plan(masked)
    plan = backend.plan(meta)
    cache = torch.zeros(16, 1, C + R + 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="does not match"):
        backend.run(plan, torch.zeros(2, H, C + R, dtype=torch.bfloat16), cache, cache[..., :C], 0.1)
