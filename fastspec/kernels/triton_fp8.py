"""fastspec.kernels.fp8_block's product in Triton: y = sum over groups of sx * sw * (xq . wq) for e4m3 activations
rounded per token and group and e4m3 weights with a scale per row and group.

One program computes BLOCK_M x BLOCK_N outputs over the whole of K; each K tile lies in one group (the group is a
multiple of BLOCK_K), so its dot is scaled once: acc += dot(xq, wq.T) * sx[:, None] * sw[None, :]. NATIVE (a GPU
with fp8 tensor cores) dots the e4m3 codes themselves; otherwise (Triton's interpreter on CPU, whose fp8 dot is not
exact) both tiles are decoded to float32 (triton_quant's exact e4m3 decoder) and dotted in float32. The grid
depends on shapes alone: capturable. Tests run it under TRITON_INTERPRET=1 against fp8_block.matmul_twin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastspec.kernels.triton_quant import decode_codes


@triton.jit
def _fp8_block_gemm_kernel(XQ, SX, W, SW, Y, M, N, K, group, stride_xm, stride_sxm, stride_wn, stride_swn, stride_ym,
                           NATIVE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(XQ + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0)
        w = tl.load(W + rn[:, None] * stride_wn + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0)
        if NATIVE:
            part = tl.dot(x.to(tl.float8e4nv, bitcast=True), tl.trans(w.to(tl.float8e4nv, bitcast=True)))
        else:
            part = tl.dot(decode_codes(x.to(tl.int32) & 255, 0), tl.trans(decode_codes(w.to(tl.int32) & 255, 0)),
                          input_precision="ieee")
        g = k0 // group
        sx = tl.load(SX + rm * stride_sxm + g, mask=rm < M, other=0.0)  # [BM]
        sw = tl.load(SW + rn * stride_swn + g, mask=rn < N, other=0.0)  # [BN]
        acc += part * sx[:, None] * sw[None, :]
    tl.store(Y + rm[:, None] * stride_ym + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def block_k(group: int) -> int:
    """The K tile: the largest of 128, 64, 32 dividing the group (an fp8 dot takes 32 inputs at least)."""
    for b in (128, 64, 32):
        if group % b == 0:
            return b
    raise ValueError(f"a scale per {group} inputs: no K tile of 32, 64 or 128 fits")


def matmul(xq: torch.Tensor,   # e4m3 [M, K]
           sx: torch.Tensor,   # float32 [M, ceil(K / group)]
           w: torch.Tensor,    # e4m3 [N, K]
           sw: torch.Tensor,   # float32 [N, ceil(K / group)]
           group: int, out_dtype: torch.dtype, block_n: int = 64, *,
           native: bool) -> torch.Tensor:  # [M, N]; native: fp8_block.fp8_tensor_cores(device)
    m, k = xq.shape
    n = w.shape[0]
    xq, w = xq.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)
    sx, sw = sx.float().contiguous(), sw.float().contiguous()
    y = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    bm, bn, bk = 16, block_n, block_k(group)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
    _fp8_block_gemm_kernel[grid](xq, sx, w, sw, y, m, n, k, group, xq.stride(0), sx.stride(0), w.stride(0),
                                 sw.stride(0), y.stride(0), NATIVE=native, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return y
