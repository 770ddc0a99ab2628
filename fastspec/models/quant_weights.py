"""The two exact forms a quantised linear's weight is read into, whatever the method that wrote it:

  IntWeight  4- / 8-bit integers as gguf_blocks.Blocks: w[n, k] = q * scale + offset per group of input columns
             (offset = -zero * scale), over the input columns in `perm` order (GPTQ's desc_act, compressed-tensors'
             actorder group; None: in order)
  Fp8Weight  e4m3 values [N, K] times a float32 scale per row and per `cols` input columns (per tensor and per
             channel: cols = K; a 128 x 128 block: its scale repeated on each of its 128 rows)

Both dequantise exactly in float32 (a 16-bit scale times a small integer, or an e4m3 value times a float32 scale:
one rounding at most), and merge by rows (fused QKV / gate_up) without changing a weight.
Readers of the checkpoints' layouts: quant_decode. Does not build modules (quant_layers) nor read files (loader).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastspec.models.gguf_blocks import Blocks


@dataclass(frozen=True)
class IntWeight:
    blocks: Blocks  # [N, K] over the input columns in perm order
    perm: torch.Tensor | None = None  # int64 [K]: blocks' column j is input perm[j]; None: in order

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.blocks.q.shape)

    def dequantise(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [N, K]
        w = self.blocks.dequantise(torch.float32)
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w.to(dtype)

    @staticmethod
    def merge(parts: list[IntWeight]) -> IntWeight | None:
        """The parts stacked by rows, or None where their column orders differ (they then stay separate)."""
        perms = [p.perm for p in parts]
        if any(p is None for p in perms) != all(p is None for p in perms):
            return None
        if perms[0] is not None and not all(torch.equal(perms[0], p) for p in perms[1:]):
            return None
        if len({(p.blocks.bits, p.blocks.group) for p in parts}) != 1:
            return None
        b = [p.blocks for p in parts]
        return IntWeight(Blocks(*(torch.cat([getattr(x, f) for x in b]) for f in ("q", "scale", "offset")),
                                b[0].bits), perms[0])


@dataclass(frozen=True)
class Fp8Weight:
    weight: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [N, ceil(K / cols)]
    cols: int  # input columns per scale (K: per channel or per tensor)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    @property
    def per_channel(self) -> bool:
        return self.cols >= self.weight.shape[1]

    def dequantise(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [N, K]
        k = self.weight.shape[1]
        return (self.weight.float() * self.scale.repeat_interleave(self.cols, 1)[:, :k]).to(dtype)

    @staticmethod
    def merge(parts: list[Fp8Weight]) -> Fp8Weight | None:
        if len({p.cols for p in parts}) != 1:
            return None
        return Fp8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]), parts[0].cols)


QuantWeight = IntWeight | Fp8Weight


def merge(parts: list[QuantWeight]) -> QuantWeight | None:
    """Several quantised weights over the same input stacked by rows, or None where they cannot share one form."""
    if len({type(p) for p in parts}) != 1:
        return None
    return type(parts[0]).merge(parts)
