"""Attention for the static round functions without a KV width: each request's committed prefix is read through its
req_to_token row up to its length (device tensors), then a block of explicit keys under a per-row mask.

Owns `PagedPlan` (built on the device, no host value: graph-safe), `paged_block_plan` (the new tokens of an
extend / verify / decode as the block), `PagedAttnBackend` and the op `fastspec::paged_attention` it calls: on
CUDA the Triton kernels (fastspec.attention.triton_paged), on CPU the C kernel fastspec.kernels.cpu_attention
registers for it where the C library is built, elsewhere the torch twin below. The op is opaque to
torch.compile, so a compiled round function has no KV width in it: one compile (and one CUDA graph per batch
bucket) serves every context length. The twin reads the longest length on the host, which only an opaque op may.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from fastspec.attention.torch_backend import TorchAttnPlan, attend_padded


@dataclass(frozen=True)
class PagedPlan:
    """Every request has Q query rows; row (b, i) sees table[rows[b], :prefix_lens[b]] and the block keys
    block_slots[b, x] where block_mask[b, i, x] (and, with `self_visible`, block key i: the new tokens' own)."""

    table: torch.Tensor          # int32 [max_requests, max_context]  read in place, never copied
    rows: torch.Tensor           # int64 [bs]
    prefix_lens: torch.Tensor    # int64 [bs]
    block_slots: torch.Tensor    # int64 [bs, X]
    block_mask: torch.Tensor     # bool [bs, Q, X]  each row allows at least one key (counting self_visible)
    out_cache_loc: torch.Tensor  # int64 [bs*Q]  slots receiving the new tokens' K/V
    self_visible: bool = False   # row i also sees block key i (the op adds the diagonal: no mask tensor per layer)


def paged_block_plan(table: torch.Tensor, rows: torch.Tensor, prefix_lens: torch.Tensor,
                     new_slots: torch.Tensor,  # int64 [bs, Q]  this forward's tokens (padded rows: slot 0)
                     new_mask: torch.Tensor,   # bool [bs, Q, Q]  which new tokens each new token sees
                     shared: torch.Tensor | None = None,  # int64 [bs]  a key every row of its request also sees
                     ) -> PagedPlan:
    """The new tokens as the block (causal for extend, the tree for verify), then the `shared` keys if given. Every
    new token sees itself (`self_visible`: the op adds the diagonal, so a compiled graph does not build a mask per
    layer), so no row is fully masked (a NaN from one would reach dummy slot 0 and, through 0 * NaN, every row
    reading it)."""
    block, mask = new_slots, new_mask
    if shared is not None:  # after the new tokens: block key i stays row i's own
        block = torch.cat([new_slots, shared[:, None]], 1)
        mask = torch.cat([new_mask, new_mask.new_ones(*new_mask.shape[:2], 1)], 2)
    return PagedPlan(table, rows, prefix_lens, block, mask, new_slots.flatten(), self_visible=True)


class PagedAttnBackend:
    """`run(plan, q, k_cache, v_cache, scale)` as the other backends; the plan is built by the caller.

    Eager on the host (no compile tracing it) the torch twin's dense plan is built once per forward, on the first
    layer's call, and reused by the others (each layer rebuilding it, with its host read of the longest length,
    cost a CPU verify of 8 tokens more than its GEMMs' extra over a one-token step)."""

    def __init__(self):
        self._last: tuple[PagedPlan | None, TorchAttnPlan | None] = (None, None)

    def dense(self, plan: PagedPlan, build=None) -> TorchAttnPlan:
        """The torch twin's dense plan of `plan`, built on its first use in a forward (eager, on the host) by
        `build(plan)` where given (the fused CPU layers pass cpu_fused.paged_dense_plan: the same plan in one C call),
        else by twin_plan."""
        last, dense = self._last
        if last is not plan:  # a new forward (plans are built per forward and never changed)
            dense = build(plan) if build is not None else twin_plan(
                plan.table, plan.rows, plan.prefix_lens, plan.block_slots, plan.block_mask, plan.self_visible)
            self._last = (plan, dense)
        return dense

    def run(self, plan: PagedPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            scale: float) -> torch.Tensor:
        if kernel_for(q.device) == "torch" and not torch.compiler.is_compiling():
            return _twin_output(self.dense(plan), q, k_cache, v_cache, scale)
        return torch.ops.fastspec.paged_attention(q, k_cache, v_cache, plan.table, plan.rows, plan.prefix_lens,
                                                  plan.block_slots, plan.block_mask, scale, plan.self_visible)


def kernel_for(device: torch.device) -> str:
    """Which implementation the op runs for tensors on `device`: "triton" or "torch"."""
    if torch.device(device).type == "cuda" or os.environ.get("FASTSPEC_TRITON_ATTENTION") == "1":
        return "triton"
    return "torch"


@torch.library.custom_op("fastspec::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                    rows: torch.Tensor, prefix_lens: torch.Tensor, block_slots: torch.Tensor,
                    block_mask: torch.Tensor, scale: float, self_visible: bool = False) -> torch.Tensor:
    """[T, Hq, Dv]. FASTSPEC_TRITON_ATTENTION=1 runs the Triton kernels on CPU too (with TRITON_INTERPRET=1).
    fastspec.kernels.cpu_attention registers the C kernel for CPU tensors, which falls back to this."""
    return paged_attention_default(q, k_cache, v_cache, table, rows, prefix_lens, block_slots, block_mask, scale,
                                   self_visible)


def paged_attention_default(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                            rows: torch.Tensor, prefix_lens: torch.Tensor, block_slots: torch.Tensor,
                            block_mask: torch.Tensor, scale: float, self_visible: bool = False) -> torch.Tensor:
    """The op without a device kernel registered: the Triton kernels, else the torch twin."""
    args = (q, k_cache, v_cache, table, rows, prefix_lens, block_slots, block_mask, scale, self_visible)
    if kernel_for(q.device) == "triton":
        from fastspec.attention.triton_paged import paged_attention as triton_paged_attention

        return triton_paged_attention(*args)
    return paged_attention_twin(*args)


@paged_attention.register_fake
def _(q, k_cache, v_cache, table, rows, prefix_lens, block_slots, block_mask, scale, self_visible=False):
    return q.new_empty(*q.shape[:-1], v_cache.shape[-1])


def paged_attention_twin(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                         rows: torch.Tensor, prefix_lens: torch.Tensor, block_slots: torch.Tensor,
                         block_mask: torch.Tensor, scale: float, self_visible: bool = False) -> torch.Tensor:
    """The torch twin: gather the prefix up to the longest length (a host read), then one masked SDPA."""
    plan = twin_plan(table, rows, prefix_lens, block_slots, block_mask, self_visible)
    return _twin_output(plan, q, k_cache, v_cache, scale)


def twin_plan(table: torch.Tensor, rows: torch.Tensor, prefix_lens: torch.Tensor, block_slots: torch.Tensor,
              block_mask: torch.Tensor, self_visible: bool) -> TorchAttnPlan:
    """A PagedPlan's fields as the dense padded plan of the torch backend (prefix up to the longest length)."""
    bs, q_rows, x = block_mask.shape
    if self_visible:
        block_mask = block_mask | torch.eye(q_rows, x, dtype=torch.bool, device=block_mask.device)
    width = int(prefix_lens.max()) if bs else 0
    valid = torch.arange(width, device=rows.device)[None, :] < prefix_lens[:, None]  # [bs, width]
    prefix_slots = torch.where(valid, table[rows, :width].to(torch.int64), 0)
    mask = torch.cat([valid[:, None, :].expand(bs, q_rows, width), block_mask], 2)
    index = torch.arange(bs * q_rows, device=rows.device)
    return TorchAttnPlan(q_index=index.view(bs, q_rows), kv_slots=torch.cat([prefix_slots, block_slots], 1),
                         mask=mask[:, None], out_index=index, out_cache_loc=index, uniform_qo=True)


def _twin_output(plan: TorchAttnPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 scale: float) -> torch.Tensor:
    return attend_padded(plan, q, k_cache, v_cache, scale).reshape(*q.shape[:-1], v_cache.shape[-1]).contiguous()
