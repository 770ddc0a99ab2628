"""Weight-only GEMM over byte-coded weights in Triton: y = x @ w.T with w[n, k] = v[n, k] * scale[n, k // cols] +
offset[n, k // cols], v decoded in the kernel from the stored bytes, so a step reads one byte (or half of one) per
weight instead of two. FORMAT picks the code:

  E4M3   a byte is an fp8 e4m3 value, decoded from its bits (exact: sign, 4 exponent, 3 mantissa bits)
  INT8   a byte is a signed int8
  UINT4  a byte holds two values 0..15, input 2j in its low nibble and 2j + 1 in its high one

One program computes BLOCK_M x BLOCK_N outputs over the whole of K; each K tile lies in one scale column (cols is a
multiple of BLOCK_K), so the tile's products are scaled once: acc += dot(x, v.T) * scale + sum(x) * offset. With
float16 / bfloat16 activations v is cast to their type (every code is exact there) and dotted on tensor cores;
float32 activations are dotted in float32. Sums are float32 either way. The
grid depends on shapes alone: capturable. `matmul_twin` is the same arithmetic in torch; tests run both under
TRITON_INTERPRET=1 on CPU. Knows nothing about checkpoints (fastspec.models.quant_decode reads the bytes).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

E4M3, INT8, UINT4 = 0, 1, 2


@triton.jit
def decode_codes(raw, FORMAT: tl.constexpr):
    """Stored bytes (int32 0..255, one value each) -> float32 values."""
    if FORMAT == 0:  # e4m3: normal (8 + m) * 2^(e - 10) built as float32 bits, subnormal m * 2^-9
        e, m = (raw >> 3) & 15, raw & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        value = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
        return tl.where((raw & 128) != 0, -value, value)
    if FORMAT == 1:
        return tl.where(raw >= 128, raw - 256, raw).to(tl.float32)
    return raw.to(tl.float32)


@triton.jit
def _byte_gemm_kernel(X, W, S, O, Y, M, N, K, cols, stride_xm, stride_wn, stride_sn, stride_ym,
            FORMAT: tl.constexpr, HAS_OFFSET: tl.constexpr, HALF: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(X + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0)  # [BM, BK]
        wmask = (rn[:, None] < N) & (kk[None, :] < K)
        if FORMAT == 2:  # two values a byte: value k is byte k // 2's low (even k) or high nibble
            raw = tl.load(W + rn[:, None] * stride_wn + kk[None, :] // 2, mask=wmask, other=0).to(tl.int32)
            raw = (raw >> ((kk[None, :] % 2) * 4)) & 15
        else:
            raw = tl.load(W + rn[:, None] * stride_wn + kk[None, :], mask=wmask, other=0).to(tl.int32)
        v = decode_codes(raw & 255, FORMAT)  # [BN, BK]
        col = k0 // cols
        scale = tl.load(S + rn * stride_sn + col, mask=rn < N, other=0.0)  # [BN]
        if HALF:  # every code is exact in 16 bits: tensor-core dots, float32 sums
            acc += tl.dot(x, tl.trans(v.to(x.dtype))) * scale[None, :]
        else:
            acc += tl.dot(x.to(tl.float32), tl.trans(v), input_precision="ieee") * scale[None, :]
        if HAS_OFFSET:
            offset = tl.load(O + rn * stride_sn + col, mask=rn < N, other=0.0)
            acc += tl.sum(x.to(tl.float32), 1)[:, None] * offset[None, :]
    tl.store(Y + rm[:, None] * stride_ym + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def block_k(cols: int, k: int) -> int:
    """The K tile: the largest of 64, 32, 16 dividing both the scale's column width and K."""
    for b in (64, 32, 16):
        if cols % b == 0 and k % b == 0:
            return b
    raise ValueError(f"a scale per {cols} inputs over K = {k}: no K tile of 16, 32 or 64 fits")


def matmul(x: torch.Tensor,       # [M, K] float
           w: torch.Tensor,       # uint8 [N, K] (E4M3 / INT8: one byte a value) or [N, K / 2] (UINT4)
           scale: torch.Tensor,   # float32 [N, K / cols]
           offset: torch.Tensor | None,  # float32 [N, K / cols] or None (no offset)
           cols: int, fmt: int, block_n: int = 64) -> torch.Tensor:  # [M, N] float32
    m, k = x.shape
    n = w.shape[0]
    x, w, scale = x.contiguous(), w.contiguous(), scale.contiguous()
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    bm, bn, bk = 16, block_n, block_k(cols, k)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
    _byte_gemm_kernel[grid](x, w, scale, scale if offset is None else offset.contiguous(), y, m, n, k, cols,
                            x.stride(0), w.stride(0), scale.stride(0), y.stride(0), FORMAT=fmt,
                            HAS_OFFSET=offset is not None, HALF=x.dtype in (torch.float16, torch.bfloat16),
                            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return y


def decode_twin(w: torch.Tensor, fmt: int) -> torch.Tensor:  # -> float32 [N, K]
    if fmt == E4M3:
        return w.view(torch.float8_e4m3fn).float()
    if fmt == INT8:
        return w.view(torch.int8).float()
    return torch.stack([w & 15, w >> 4], -1).flatten(1).float()


def matmul_twin(x, w, scale, offset, cols: int, fmt: int) -> torch.Tensor:
    """The same product in torch: the weights decoded and scaled per (row, cols-block), then one float32 GEMM."""
    v = decode_twin(w, fmt)
    k = v.shape[1]
    weight = v * scale.repeat_interleave(cols, 1)[:, :k]
    if offset is not None:
        weight = weight + offset.repeat_interleave(cols, 1)[:, :k]
    return x.float() @ weight.t()


def kernel_for(device: torch.device) -> str:
    """Which implementation byte_matmul runs on `device`: "triton" on CUDA (or anywhere with
    FASTSPEC_TRITON_QUANT=1, e.g. the interpreter on CPU), else "torch" (the twin)."""
    if torch.device(device).type == "cuda" or os.environ.get("FASTSPEC_TRITON_QUANT") == "1":
        return "triton"
    return "torch"


@torch.library.custom_op("fastspec::byte_matmul", mutates_args=())
def byte_matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, cols: int,
                fmt: int) -> torch.Tensor:
    """`matmul` as an opaque op for torch.compile / graph capture: x [M, K] -> float32 [M, N]."""
    if kernel_for(x.device) == "triton":
        return matmul(x, w, scale, offset, cols, fmt)
    return matmul_twin(x, w, scale, offset, cols, fmt)


@byte_matmul.register_fake
def _(x, w, scale, offset, cols, fmt):
    return x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32)
