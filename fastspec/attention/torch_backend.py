"""Pure-torch reference attention backend: `plan(metadata)` once per forward, `run(...)` once per layer.

Owns the dense, padded view of an `AttnMetadata` (every index built in plan(), none in run()) and the one
batched scaled_dot_product_attention that executes it. It does not write K/V (see context.py) and knows
nothing about models. This is the slow twin a FlashInfer backend with the same plan/run interface is
tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastspec.attention.metadata import AttnMetadata, AttnMode


@dataclass(frozen=True)
class TorchAttnPlan:
    """Per-request padded view: request b owns query rows [0, qo_len_b) and key columns [0, kv_len_b)."""

    q_index: torch.Tensor        # int64 [bs, max_qo]  token row of q feeding (b, i); padding -> 0
    kv_slots: torch.Tensor       # int64 [bs, max_kv]  KV slot of key column (b, j); padding -> slot 0
    mask: torch.Tensor | None    # bool [bs, 1, max_qo, max_kv]  True = attend; None = attend everywhere
    out_index: torch.Tensor      # int64 [T]  row of the flattened [bs*max_qo] output holding token t
    out_cache_loc: torch.Tensor  # int64 [T]  slots receiving the new tokens' K/V
    uniform_qo: bool             # every request has max_qo rows: q and the output need no gather


class TorchAttnBackend:
    """Gather K/V by slot into [bs, Hkv, max_kv, D] and run one masked SDPA over the whole batch."""

    def plan(self, meta: AttnMetadata) -> TorchAttnPlan:
        if meta.mode in (AttnMode.DECODE, AttnMode.DRAFT_DECODE):
            return _one_query_plan(meta)
        qo_lens = meta.qo_lens.to(torch.int64)
        kv_lens = meta.kv_lens.to(torch.int64)
        device = qo_lens.device
        max_qo = int(qo_lens.max()) if qo_lens.numel() else 0
        max_kv = int(kv_lens.max()) if kv_lens.numel() else 0
        qi = torch.arange(max_qo, device=device)          # [max_qo]
        kj = torch.arange(max_kv, device=device)          # [max_kv]
        valid_q = qi[None, :] < qo_lens[:, None]          # [bs, max_qo]
        valid_kv, kv_slots = _key_columns(meta, kv_lens, kj)
        q_index = torch.where(valid_q, meta.qo_indptr[:-1, None].to(torch.int64) + qi[None, :], 0)
        token_req = torch.repeat_interleave(torch.arange(qo_lens.numel(), device=device), qo_lens)
        token_pos = torch.arange(token_req.numel(), device=device) - meta.qo_indptr.to(torch.int64)[token_req]
        return TorchAttnPlan(
            q_index=q_index,
            kv_slots=kv_slots,
            mask=_dense_mask(meta, valid_q, valid_kv),
            out_index=token_req * max_qo + token_pos,
            out_cache_loc=meta.out_cache_loc.to(torch.int64),
            uniform_qo=bool((qo_lens == max_qo).all()),
        )

    def run(self, plan: TorchAttnPlan,
            q: torch.Tensor,        # [T, Hq, D]
            k_cache: torch.Tensor,  # [num_slots, Hkv, D]  one layer, new tokens' K/V already written
            v_cache: torch.Tensor,  # [num_slots, Hkv, D]
            scale: float) -> torch.Tensor:  # [T, Hq, Dv] in q's dtype (Dv = v_cache's last dim)
        out = attend_padded(plan, q, k_cache, v_cache, scale)         # [bs, max_qo, Hq, Dv]
        if plan.uniform_qo:
            return out.reshape(*q.shape[:-1], v_cache.shape[-1])
        return out.flatten(0, 1).index_select(0, plan.out_index)


def _one_query_plan(meta: AttnMetadata) -> TorchAttnPlan:
    """plan(meta) for one query row per request (a decode, a draft step: causal, no custom mask), in a third of its
    ops: each row sees its first kv_len columns."""
    kv_lens = meta.kv_lens.to(torch.int64)
    device, bs = kv_lens.device, kv_lens.numel()
    kj = torch.arange(int(kv_lens.max()) if bs else 0, device=device)
    valid_kv, kv_slots = _key_columns(meta, kv_lens, kj)
    allowed = valid_kv | (~valid_kv.any(-1, keepdim=True) & (kj == 0))  # (a row with no key attends to column 0)
    rows = torch.arange(bs, device=device)
    return TorchAttnPlan(
        q_index=rows[:, None],
        kv_slots=kv_slots,
        mask=None if bool(allowed.all()) else allowed[:, None, None, :],
        out_index=rows,
        out_cache_loc=meta.out_cache_loc.to(torch.int64),
        uniform_qo=True,
    )


def _key_columns(meta: AttnMetadata, kv_lens: torch.Tensor,  # int64 [bs]
                 kj: torch.Tensor,  # int64 [max_kv]  arange
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid_kv bool [bs, max_kv]: column j is one of request b's keys, kv_slots int64 [bs, max_kv]: its KV slot,
    padding -> slot 0)."""
    valid_kv = kj[None, :] < kv_lens[:, None]
    kv_pos = torch.where(valid_kv, meta.kv_indptr[:-1, None].to(torch.int64) + kj[None, :], 0)
    return valid_kv, torch.where(valid_kv, meta.kv_indices.to(torch.int64)[kv_pos], 0)


def attend_padded(plan: TorchAttnPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """The padded output [bs, max_qo, Hq, Dv], padded query rows included (always finite)."""
    bs, max_qo = plan.q_index.shape
    max_kv = plan.kv_slots.shape[1]
    # index_select on flat indices: several times faster on CPU than advanced indexing with a 2-D index
    qp = q if plan.uniform_qo else q.index_select(0, plan.q_index.flatten())
    qp = qp.reshape(bs, max_qo, *q.shape[1:]).transpose(1, 2)                              # [bs, Hq, max_qo, D]
    slots = plan.kv_slots.flatten()
    kp = k_cache.index_select(0, slots).view(bs, max_kv, *k_cache.shape[1:]).transpose(1, 2)  # [bs, Hkv, max_kv, D]
    vp = v_cache.index_select(0, slots).view(bs, max_kv, *v_cache.shape[1:]).transpose(1, 2)  # [.., Dv]
    out = F.scaled_dot_product_attention(qp, kp.to(q.dtype), vp.to(q.dtype), attn_mask=plan.mask, scale=scale,
                                         enable_gqa=True)
    return out.transpose(1, 2)


def _dense_mask(meta: AttnMetadata,
                valid_q: torch.Tensor,   # bool [bs, max_qo]
                valid_kv: torch.Tensor,  # bool [bs, max_kv]
                ) -> torch.Tensor | None:
    """bool [bs, 1, max_qo, max_kv] or None when every pair may attend (no padding, no masking)."""
    qo_lens = meta.qo_lens.to(torch.int64)[:, None, None]
    kv_lens = meta.kv_lens.to(torch.int64)[:, None, None]
    qi = torch.arange(valid_q.shape[1], device=valid_q.device)[None, :, None]
    kj = torch.arange(valid_kv.shape[1], device=valid_kv.device)[None, None, :]
    valid = valid_q[:, :, None] & valid_kv[:, None, :]
    if meta.custom_mask is not None:
        # element (b, i, j) of the flat mask sits at mask_indptr[b] + i * kv_len_b + j
        mask_start = torch.cumsum(qo_lens * kv_lens, 0) - qo_lens * kv_lens
        flat = torch.where(valid, mask_start + qi * kv_lens + kj, 0)
        allowed = valid & meta.custom_mask[flat] if meta.custom_mask.numel() else valid
    elif meta.causal:
        allowed = valid & (kj <= kv_lens - qo_lens + qi)      # bottom-right aligned
    else:
        allowed = valid
    # a row with no visible key (a padded query row) attends to column 0 so SDPA never returns NaN
    allowed = allowed | (~allowed.any(-1, keepdim=True) & (kj == 0))
    if bool(allowed.all()):
        return None
    return allowed[:, None]


def block_plan(prefix_slots: torch.Tensor,  # int64 [bs, Kp]  KV slots every new token may see (padding -> 0)
               prefix_valid: torch.Tensor,  # bool [bs, Kp]   which of them are real
               new_slots: torch.Tensor,     # int64 [bs, Q]   slots of this forward's Q tokens per request
               new_mask: torch.Tensor,      # bool [bs, Q, Q] which new tokens each new token sees
               ) -> TorchAttnPlan:
    """A static-shape plan built on the device (no host sync, graph-safe): every request has Q query rows that
    see its valid prefix plus the new tokens `new_mask` allows (causal for extend, the tree for verify).
    New tokens' K/V go to `new_slots`; padded rows name dummy slot 0. Every new token sees itself, so no row
    is fully masked (a NaN from one would reach dummy slot 0 and, through 0 * NaN, every row reading it)."""
    bs, kp = prefix_slots.shape
    q = new_slots.shape[1]
    new_mask = new_mask | torch.eye(q, dtype=torch.bool, device=new_mask.device)
    mask = torch.cat([prefix_valid[:, None, :].expand(bs, q, kp), new_mask], dim=2)  # [bs, Q, Kp+Q]
    q_index = torch.arange(bs * q, device=new_slots.device).view(bs, q)
    return TorchAttnPlan(q_index=q_index, kv_slots=torch.cat([prefix_slots, new_slots], 1), mask=mask[:, None],
                         out_index=q_index.flatten(), out_cache_loc=new_slots.flatten(), uniform_qo=True)
