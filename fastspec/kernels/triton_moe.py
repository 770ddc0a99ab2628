"""Expert-indexed weight-only GEMM over byte-coded weights in Triton: for each (token, choice) pair p,
y[p] = x[rows[p]] @ w[experts[p]].T, where w is a MoE layer's experts stacked [E, N, K] in one of triton_quant's
byte codes (E4M3 / INT8: one byte a value, UINT4: two) with a float32 scale and offset [E, N, K / cols]. Only the
chosen experts' bytes are read: a decode step's few pairs read T * top_k experts, not all E.

One program computes one pair's BLOCK_N outputs over the whole of K (a product of one row: memory-bound, the
weights' bytes are the cost), the K tile in one scale column as in triton_quant (a tile's products are scaled once:
acc += sum(x * v) * scale + sum(x) * offset), every sum in float32 whatever the activations' type. The grid is
(N / BLOCK_N, pairs): shapes alone, so capturable. `expert_matmul_twin` is the same product in torch (the pairs'
weights gathered, decoded, one batched product); `expert_byte_matmul` is the op the models call (the kernel where
triton_quant.kernel_for says "triton", else the twin). Knows nothing about routing (fastspec.models.byte_experts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastspec.kernels.triton_quant import block_k, decode_codes, decode_twin, kernel_for


@triton.jit
def _expert_byte_gemm_kernel(X, ROWS, EXPERTS, W, S, O, Y, N, K, cols, stride_xm, stride_we, stride_wn,
                             stride_se, stride_sn, stride_ym,
                             FORMAT: tl.constexpr, HAS_OFFSET: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, p = tl.program_id(0), tl.program_id(1)
    row = tl.load(ROWS + p).to(tl.int64)
    e = tl.load(EXPERTS + p).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_base, s_base = W + e * stride_we, e * stride_se
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(X + row * stride_xm + kk, mask=kk < K, other=0.0).to(tl.float32)  # [BK]
        wmask = (rn[:, None] < N) & (kk[None, :] < K)
        if FORMAT == 2:  # two values a byte: value k is byte k // 2's low (even k) or high nibble
            raw = tl.load(w_base + rn[:, None] * stride_wn + kk[None, :] // 2, mask=wmask, other=0).to(tl.int32)
            raw = (raw >> ((kk[None, :] % 2) * 4)) & 15
        else:
            raw = tl.load(w_base + rn[:, None] * stride_wn + kk[None, :], mask=wmask, other=0).to(tl.int32)
        v = decode_codes(raw & 255, FORMAT)  # [BN, BK]
        col = k0 // cols
        scale = tl.load(S + s_base + rn * stride_sn + col, mask=rn < N, other=0.0)  # [BN]
        acc += tl.sum(v * x[None, :], 1) * scale
        if HAS_OFFSET:
            offset = tl.load(O + s_base + rn * stride_sn + col, mask=rn < N, other=0.0)
            acc += tl.sum(x, 0) * offset
    tl.store(Y + p * stride_ym + rn, acc, mask=rn < N)


def expert_matmul(x: torch.Tensor,        # [M, K] float: the rows the pairs read
                  rows: torch.Tensor,     # int [P]: pair p reads x[rows[p]]
                  experts: torch.Tensor,  # int [P]: pair p multiplies by w[experts[p]]
                  w: torch.Tensor,        # uint8 [E, N, K] (E4M3 / INT8) or [E, N, K / 2] (UINT4)
                  scale: torch.Tensor,    # float32 [E, N, K / cols]
                  offset: torch.Tensor | None,  # float32 [E, N, K / cols] or None (no offset)
                  cols: int, fmt: int, block_n: int = 64) -> torch.Tensor:  # [P, N] float32
    k, (n, pairs) = x.shape[1], (w.shape[1], rows.shape[0])
    x, w, scale = x.contiguous(), w.contiguous(), scale.contiguous()
    rows, experts = rows.contiguous(), experts.contiguous()
    y = torch.empty(pairs, n, dtype=torch.float32, device=x.device)
    if pairs == 0:
        return y
    grid = (triton.cdiv(n, block_n), pairs)
    _expert_byte_gemm_kernel[grid](x, rows, experts, w, scale, scale if offset is None else offset.contiguous(), y,
                                   n, k, cols, x.stride(0), w.stride(0), w.stride(1), scale.stride(0),
                                   scale.stride(1), y.stride(0), FORMAT=fmt, HAS_OFFSET=offset is not None,
                                   BLOCK_N=block_n, BLOCK_K=block_k(cols, k))
    return y


def expert_matmul_twin(x, rows, experts, w, scale, offset, cols: int, fmt: int) -> torch.Tensor:
    """The same product in torch: each pair's expert gathered, decoded and scaled per (row, cols-block), then one
    batched float32 product."""
    pw = w[experts]  # [P, N, Kb]
    v = decode_twin(pw.flatten(0, 1), fmt).view(pw.shape[0], pw.shape[1], -1)  # [P, N, K]
    k = x.shape[1]
    weight = v[..., :k] * scale[experts].repeat_interleave(cols, 2)[..., :k]
    if offset is not None:
        weight = weight + offset[experts].repeat_interleave(cols, 2)[..., :k]
    return torch.einsum("pk,pnk->pn", x[rows].float(), weight)


@torch.library.custom_op("fastspec::expert_byte_matmul", mutates_args=())
def expert_byte_matmul(x: torch.Tensor, rows: torch.Tensor, experts: torch.Tensor, w: torch.Tensor,
                       scale: torch.Tensor, offset: torch.Tensor | None, cols: int, fmt: int) -> torch.Tensor:
    """`expert_matmul` as an opaque op for torch.compile / graph capture: float32 [P, N]."""
    if kernel_for(x.device) == "triton":
        return expert_matmul(x, rows, experts, w, scale, offset, cols, fmt)
    return expert_matmul_twin(x, rows, experts, w, scale, offset, cols, fmt)


@expert_byte_matmul.register_fake
def _(x, rows, experts, w, scale, offset, cols, fmt):
    return x.new_empty(rows.shape[0], w.shape[1], dtype=torch.float32)

