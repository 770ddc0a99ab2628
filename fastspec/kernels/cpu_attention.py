"""The CPU attention backends: cpu_attention.c (cpu_fused.attend) behind the torch backends' interfaces, where the C
library is built and reads the caches; elsewhere (CUDA, a latent pool's V view, no compiler) the backends' own code.

Why: that kernel takes each query row over exactly the keys it sees, in one order whatever else is in the batch, so a
verify row computes bit for bit what the decode step of its token computes, and a prefill token what it computes
alone (a cached prefix's KV is what recomputing it gives). torch's SDPA over a padded, masked block rounds otherwise,
and in bfloat16 / float16 that alone made greedy speculative output leave plain output (bench/spec_agreement.py).
`CpuTorchBackend` serves the engine's prefill and extend metadata, `CpuPagedBackend` the round functions eagerly, and
the "cpu" kernel registered for `fastspec::paged_attention` the same under torch.compile. Knows nothing about models.
"""

from __future__ import annotations

import torch

from fastspec.attention.paged import PagedAttnBackend, PagedPlan, kernel_for, paged_attention_default
from fastspec.attention.torch_backend import TorchAttnBackend, TorchAttnPlan
from fastspec.kernels import cpu_fused

ATTEND_Q = (torch.float32, torch.bfloat16, torch.float16)  # query dtypes it takes (widened to float32)


def c_attends(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the C kernel serves these operands: CPU tensors the torch kernel would take, caches of a dtype it reads
    with V laid out as K (a cache of its own, or a latent pool's view of K's first values), the library built."""
    return (q.device.type == "cpu" and kernel_for(q.device) == "torch" and q.dtype in ATTEND_Q
            and k_cache.dtype in cpu_fused.KV and v_cache.dtype == k_cache.dtype
            and v_cache.shape[:-1] == k_cache.shape[:-1] and v_cache.shape[-1] <= k_cache.shape[-1]
            and k_cache.shape[-1] == q.shape[-1] and k_cache.is_contiguous() and v_cache.stride() == k_cache.stride()
            and cpu_fused.available())


def attend_dense(plan: TorchAttnPlan, q: torch.Tensor,  # [T, Hq, D]
                 k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:  # [T, Hq, Dv] q's dtype
    """The C kernel over a dense plan (float32 math, rounded to q's dtype once)."""
    out_dtype = q.dtype if q.dtype in cpu_fused.ACT else torch.float32
    o = cpu_fused.attend(plan, q.float().contiguous(), k_cache, v_cache, scale, out_dtype)
    return o.view(*q.shape[:-1], v_cache.shape[-1]).to(q.dtype)


class CpuTorchBackend(TorchAttnBackend):
    """TorchAttnBackend (its dense plan) with the C kernel where `c_attends`."""

    def run(self, plan: TorchAttnPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            scale: float) -> torch.Tensor:
        if torch.compiler.is_compiling() or not c_attends(q, k_cache, v_cache):
            return super().run(plan, q, k_cache, v_cache, scale)
        return attend_dense(plan, q, k_cache, v_cache, scale)


class CpuPagedBackend(PagedAttnBackend):
    """PagedAttnBackend whose eager CPU kernel is cpu_attention.c where `c_attends` (the dense plan built once per
    forward, as the twin's is)."""

    def run(self, plan: PagedPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            scale: float) -> torch.Tensor:
        if torch.compiler.is_compiling() or not c_attends(q, k_cache, v_cache):
            return super().run(plan, q, k_cache, v_cache, scale)
        return attend_dense(self.dense(plan, cpu_fused.paged_dense_plan), q, k_cache, v_cache, scale)


@torch.library.register_kernel("fastspec::paged_attention", "cpu")
def _paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                         rows: torch.Tensor, prefix_lens: torch.Tensor, block_slots: torch.Tensor,
                         block_mask: torch.Tensor, scale: float, self_visible: bool = False) -> torch.Tensor:
    if not c_attends(q, k_cache, v_cache):
        return paged_attention_default(q, k_cache, v_cache, table, rows, prefix_lens, block_slots, block_mask, scale,
                                       self_visible)
    plan = PagedPlan(table, rows, prefix_lens, block_slots, block_mask, block_slots.flatten(), self_visible)
    return attend_dense(cpu_fused.paged_dense_plan(plan), q, k_cache, v_cache, scale)
