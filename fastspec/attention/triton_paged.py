"""Paged attention in Triton: every length, table row and mask read from device tensors, so one launch (and one
CUDA graph around it) serves every context length.

Query row t = b*Q + i of head h sees (1) request b's committed prefix, the first prefix_lens[b] slots of its
req_to_token row, and (2) the block keys block_slots[b, x] that block_mask[b, i, x] allows (the new tokens under a
causal or tree mask; in the draft loop the slots of a row's ancestors and its own). Flash-decoding split: program
(t, h, s) attends split s of the prefix (s < SPLITS) or the block (s == SPLITS) with an online softmax and writes
its partial (max, sum, unnormalised output); a second kernel combines the partials. Where the (t, h) programs fill
the GPU without splits, one kernel reads prefix and block and writes the output (splits=0). The grid depends on shapes
alone, the loop bounds on device values: capturable, and no recapture when a context grows.

The semantics are fastspec.attention.paged's torch twin; tests run both under TRITON_INTERPRET=1 on CPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # prefix keys per loop iteration
MAX_SPLITS = 16


@triton.jit
def _online_tile(q, K, V, slots, ok, kvh, d, dv, scale, stride_ks, stride_kh, stride_vs, stride_vh, m_i, l_i, acc,
                 D: tl.constexpr, DV: tl.constexpr):
    """One tile of keys (`slots`, `ok` = which count) folded into the running (max, sum, output) of one query."""
    k = tl.load(K + slots[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                mask=ok[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)
    score = tl.where(ok, tl.sum(k * q[None, :], 1) * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(score, 0))
    p = tl.exp(score - m_new)
    alpha = tl.exp(m_i - m_new)
    v = tl.load(V + slots[:, None] * stride_vs + kvh * stride_vh + dv[None, :],
                mask=ok[:, None] & (dv[None, :] < DV), other=0.0).to(tl.float32)
    return m_new, l_i * alpha + tl.sum(p, 0), acc * alpha + tl.sum(p[:, None] * v, 0)


@triton.jit
def _prefix_tiles(q, K, V, Table, row, start, end, kvh, d, dv, scale, stride_ks, stride_kh, stride_vs, stride_vh,
                  stride_table, m_i, l_i, acc, D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr):
    """Prefix columns [start, end) of one request's table row, BLOCK_N keys at a time."""
    for j in range(start, end, BLOCK_N):
        cols = j + tl.arange(0, BLOCK_N)
        ok = cols < end
        slots = tl.load(Table + row * stride_table + cols, mask=ok, other=0).to(tl.int64)
        m_i, l_i, acc = _online_tile(q, K, V, slots, ok, kvh, d, dv, scale, stride_ks, stride_kh, stride_vs,
                                     stride_vh, m_i, l_i, acc, D, DV)
    return m_i, l_i, acc


@triton.jit
def _block_tile(q, K, V, BlockSlots, BlockMask, t, b, kvh, d, dv, scale, stride_ks, stride_kh, stride_vs, stride_vh,
                m_i, l_i, acc, X: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_X: tl.constexpr,
                Q_ROWS: tl.constexpr, SELF_VISIBLE: tl.constexpr):
    """The block: new tokens (or a draft row's ancestors) under row t's mask (and its own key: SELF_VISIBLE)."""
    x = tl.arange(0, BLOCK_X)
    in_block = x < X
    ok = tl.load(BlockMask + t * X + x, mask=in_block, other=0) != 0
    if SELF_VISIBLE:
        ok = ok | (x == t % Q_ROWS)
    slots = tl.load(BlockSlots + b * X + x, mask=in_block, other=0).to(tl.int64)
    return _online_tile(q, K, V, slots, ok, kvh, d, dv, scale, stride_ks, stride_kh, stride_vs, stride_vh,
                        m_i, l_i, acc, D, DV)


@triton.jit
def _paged_attention_kernel(Q, K, V, Table, Rows, PrefixLens, BlockSlots, BlockMask, MidO, MidML, Out, scale,
                            stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_table,
                            stride_ot, stride_oh, Q_ROWS: tl.constexpr, X: tl.constexpr, GROUP: tl.constexpr,
                            SPLITS: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_X: tl.constexpr, SELF_VISIBLE: tl.constexpr):
    """SPLITS > 0: program (t, h, s) writes the partial of prefix split s (s < SPLITS) or of the block (s == SPLITS)
    to MidO / MidML for the combine kernel. SPLITS == 0: program (t, h) reads the whole prefix and the block and
    writes the normalised output to Out (one launch, nothing to combine)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    b = t // Q_ROWS
    kvh = h // GROUP
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + t * stride_qt + h * stride_qh + d, mask=d < D, other=0.0).to(tl.float32)
    m_i = -1e30  # finite: a fully masked tile then adds exp(-inf) = 0 instead of a NaN
    l_i = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    n = tl.load(PrefixLens + b)
    start, end = 0, n
    if SPLITS > 0:  # this program's split of the committed prefix (empty for the block's program)
        chunk = tl.cdiv(n, SPLITS)
        start = tl.minimum(s * chunk, n)
        end = tl.minimum(start + chunk, n)
    m_i, l_i, acc = _prefix_tiles(q, K, V, Table, tl.load(Rows + b), start, end, kvh, d, dv, scale, stride_ks,
                                  stride_kh, stride_vs, stride_vh, stride_table, m_i, l_i, acc, D, DV, BLOCK_N)
    if SPLITS == 0:
        m_i, l_i, acc = _block_tile(q, K, V, BlockSlots, BlockMask, t, b, kvh, d, dv, scale, stride_ks, stride_kh,
                                    stride_vs, stride_vh, m_i, l_i, acc, X, D, DV, BLOCK_X, Q_ROWS, SELF_VISIBLE)
        tl.store(Out + t * stride_ot + h * stride_oh + dv, (acc / l_i).to(Out.dtype.element_ty), mask=dv < DV)
    else:
        if s == SPLITS:  # the block's program
            m_i, l_i, acc = _block_tile(q, K, V, BlockSlots, BlockMask, t, b, kvh, d, dv, scale, stride_ks,
                                        stride_kh, stride_vs, stride_vh, m_i, l_i, acc, X, D, DV, BLOCK_X, Q_ROWS,
                                        SELF_VISIBLE)
        part = (t * HQ + h) * (SPLITS + 1) + s
        tl.store(MidO + part * BLOCK_DV + dv, acc)
        tl.store(MidML + part * 2, m_i)
        tl.store(MidML + part * 2 + 1, l_i)


@triton.jit
def _paged_attention_combine(MidO, MidML, Out, stride_ot, stride_oh,
                    PARTS: tl.constexpr, HQ: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                    BLOCK_P: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.arange(0, BLOCK_P)
    dv = tl.arange(0, BLOCK_DV)
    in_parts = p < PARTS
    base = (t * HQ + h) * PARTS
    m = tl.load(MidML + (base + p) * 2, mask=in_parts, other=float("-inf"))
    l = tl.load(MidML + (base + p) * 2 + 1, mask=in_parts, other=0.0)
    acc = tl.load(MidO + (base + p)[:, None] * BLOCK_DV + dv[None, :], mask=in_parts[:, None], other=0.0)
    w = tl.exp(m - tl.max(m, 0))
    out = tl.sum(w[:, None] * acc, 0) / tl.sum(w * l, 0)
    tl.store(Out + t * stride_ot + h * stride_oh + dv, out.to(Out.dtype.element_ty), mask=dv < DV)


def default_splits(programs: int, device: torch.device) -> int:
    """Prefix splits per (row, head): enough programs to fill the GPU at batch 1; 0 (one kernel, no combine)
    where the (row, head) programs fill it already, and off a GPU."""
    if device.type != "cuda":
        return 0
    splits = min(MAX_SPLITS, -(-2 * _sm_count(device.index or 0) // max(programs, 1)))
    return splits if splits > 1 else 0


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def paged_attention(q: torch.Tensor,            # [T, Hq, D]  T = bs*Q, last dim contiguous
                    k_cache: torch.Tensor,      # [slots, Hkv, D]   last dim contiguous
                    v_cache: torch.Tensor,      # [slots, Hkv, Dv]  (may be a view of k_cache: MLA)
                    table: torch.Tensor,        # int32 [max_requests, max_context]
                    rows: torch.Tensor,         # int64 [bs]
                    prefix_lens: torch.Tensor,  # int64 [bs]
                    block_slots: torch.Tensor,  # int64 [bs, X]
                    block_mask: torch.Tensor,   # bool [bs, Q, X]  every row allows at least one key
                    scale: float,
                    self_visible: bool = False,  # row i also sees block key i
                    splits: int | None = None) -> torch.Tensor:  # [T, Hq, Dv] in q's dtype
    t, hq, d = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[-1]
    bs, q_rows, x = block_mask.shape
    if t != bs * q_rows or hq % hkv or block_slots.shape != (bs, x):
        raise ValueError(f"paged attention: q {tuple(q.shape)}, heads {hq}/{hkv}, block {tuple(block_slots.shape)}, "
                         f"mask {tuple(block_mask.shape)} do not fit together")
    splits = default_splits(t * hq, q.device) if splits is None else splits
    block_dv = triton.next_power_of_2(dv)
    out = torch.empty(t, hq, dv, dtype=q.dtype, device=q.device)
    inputs = (q, k_cache, v_cache, table, rows, prefix_lens, block_slots.contiguous(),
              block_mask.contiguous().view(torch.int8))  # bool as bytes: no i1 pointer loads
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
               table.stride(0))
    blocks = dict(BLOCK_D=triton.next_power_of_2(d), BLOCK_DV=block_dv, BLOCK_N=BLOCK_N,
                  BLOCK_X=triton.next_power_of_2(x))
    mid_o = torch.empty(t, hq, splits + 1, block_dv, dtype=torch.float32, device=q.device) if splits else out
    mid_ml = torch.empty(t, hq, splits + 1, 2, dtype=torch.float32, device=q.device) if splits else out
    _paged_attention_kernel[(t, hq, splits + 1 if splits else 1)](
        *inputs, mid_o, mid_ml, out, scale, *strides, out.stride(0), out.stride(1), Q_ROWS=q_rows, X=x,
        GROUP=hq // hkv, SPLITS=splits, HQ=hq, D=d, DV=dv, SELF_VISIBLE=self_visible, **blocks)
    if not splits:
        return out
    _paged_attention_combine[(t, hq)](mid_o, mid_ml, out, out.stride(0), out.stride(1), PARTS=splits + 1, HQ=hq,
                                      DV=dv, BLOCK_DV=block_dv, BLOCK_P=triton.next_power_of_2(splits + 1))
    return out
