"""GGUF's 4- and 8-bit block formats read as tensors without dequantising them, and a 4-bit linear that runs on
them packed (torch's int4 CPU kernel): the pieces a GGUF model kept packed is built from.

A weight [N, K] is stored row by row in blocks of 32 values, each block with its own scale (ggml's layout):
  Q4_0  f16 d, 16 bytes of nibbles      w = d * (q - 8)
  Q4_1  f16 d, f16 m, 16 bytes          w = d * q + m
  Q8_0  f16 d, 32 int8                  w = d * q
A Q4 block's element j sits in the low nibble of byte j and element j + 16 in its high nibble. Every format is
read as w = q * scale + offset per block (offset: -8 d, m or 0), which is what the packed kernels take.
Does not own: reading the file (fastspec.models.gguf) nor choosing a kernel per machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

BLOCK = 32
FORMATS = {"Q4_0": (18, 1), "Q4_1": (20, 2), "Q8_0": (34, 1)}  # bytes per block, f16 values before the quants


@dataclass(frozen=True)
class Blocks:
    """One quantised weight [N, K]: w[n, k] = q[n, k] * scale[n, k // 32] + offset[n, k // 32]."""

    q: torch.Tensor  # int32 [N, K]  Q4: 0..15, Q8: -128..127
    scale: torch.Tensor  # float32 [N, K/32]
    offset: torch.Tensor  # float32 [N, K/32]
    bits: int  # 4 or 8

    def dequantise(self) -> torch.Tensor:  # float32 [N, K]
        n, k = self.q.shape
        w = self.q.view(n, k // BLOCK, BLOCK).float() * self.scale[..., None] + self.offset[..., None]
        return w.view(n, k)

    def map_rows(self, fn) -> Blocks:
        """The same weight with its rows rearranged by `fn` ([N, x] -> [N, x], e.g. undoing the rope row order):
        a block never spans two rows, so values and scales move together."""
        return Blocks(fn(self.q), fn(self.scale), fn(self.offset), self.bits)


def read_blocks(data: np.ndarray, kind: str) -> Blocks:
    """A GGUF tensor's raw rows (uint8 [N, bytes per row], as gguf.GGUFReader gives them) of type `kind`."""
    if kind not in FORMATS:
        raise ValueError(f"{kind} is not a block format read here ({', '.join(FORMATS)})")
    size, halves = FORMATS[kind]
    n = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(n, -1, size)  # [N, K/32, bytes]
    f16 = blocks[..., : 2 * halves].copy().view(np.float16).astype(np.float32)  # [N, K/32, halves]
    scale = torch.from_numpy(f16[..., 0].copy())
    if kind == "Q8_0":
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).astype(np.int32))
        return Blocks(q.reshape(n, -1), scale, torch.zeros_like(scale), 8)
    packed = torch.from_numpy(blocks[..., 2 * halves:].astype(np.int32))  # [N, K/32, 16]
    q = torch.cat([packed & 15, packed >> 4], -1).reshape(n, -1)  # low nibbles are elements 0..15
    offset = torch.from_numpy(f16[..., 1].copy()) if kind == "Q4_1" else -8 * scale
    return Blocks(q, scale, offset, 4)


def merge_rows(parts: list[Blocks]) -> Blocks:
    """Several weights over the same input stacked by rows (fused QKV, gate_up), still quantised."""
    if len({p.bits for p in parts}) != 1:
        raise ValueError("merged weights must share a bit width")
    return Blocks(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "offset")), parts[0].bits)


class Int4Linear(nn.Module):
    """y = x @ w.T for a 4-bit Blocks weight, packed for torch's int4 CPU matmul (group 32).

    The kernel reads w = (q - 8) * scale + zero, so zero = offset + 8 * scale holds Q4_0 and Q4_1 exactly.
    `activation`: the dtype x is cast to for the kernel. With bfloat16 (scales in bfloat16 too) it is the fast
    one; with float32 it is exact to float32 rounding and many times slower (bench/bench_packed.py measures both).
    """

    def __init__(self, blocks: Blocks, activation: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None):
        super().__init__()
        if blocks.bits != 4:
            raise ValueError("Int4Linear takes a 4-bit weight")
        n, k = blocks.q.shape
        if k % BLOCK or n % 8:
            raise ValueError(f"a packed int4 weight needs K % 32 == 0 and N % 8 == 0, got [{n}, {k}]")
        self.in_features, self.out_features, self.activation = k, n, activation
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.q, 2))
        zero = blocks.offset + 8 * blocks.scale
        self.register_buffer("scale_zero", torch.stack([blocks.scale, zero], -1).transpose(0, 1).contiguous()
                             .to(activation))  # [K/32, N, 2]
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        flat = x.reshape(-1, self.in_features).to(self.activation)
        y = int4_matmul(flat, self.packed, self.scale_zero).to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


@torch.library.custom_op("fastspec::int4_matmul", mutates_args=())
def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """torch's int4 CPU matmul, group 32, as an opaque op for torch.compile (Inductor's own lowering of it fails
    on torch 2.13: "group size must be a scalar"): x [M, K] @ w.T -> [M, N], packed [N, K/2]."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, BLOCK, scale_zero)


@int4_matmul.register_fake
def _(x, packed, scale_zero):
    return x.new_empty(x.shape[0], packed.shape[0])
