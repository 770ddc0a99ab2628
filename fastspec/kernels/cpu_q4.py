"""The 4- and 8-bit CPU GEMMs on int16 activations (cpu_q4.c): y = x @ w.T for w = q * scale + offset per group (32
values of a 4-bit weight, 16 of an 8-bit one), x rounded to int16 per group of 32 (scale max |x| / 32767); exact
integer dot products, one float multiply-add per group. Not exact, but closer to it than bfloat16 activations (an
int8 rounding, llama.cpp's Q8 scheme, moved the embedded model's greedy choice at ~6 % of positions), and measured
against torch's int4 kernel by packed_layers.fast_activation. `pack` lays a weight out for them, `matmul` runs them
(the torch twin where the C library is not built, and for the tests). Knows nothing about models.
"""

from __future__ import annotations

import torch

from fastspec.kernels import cpu_library

GROUP, TILE = 32, 16  # activation values per rounding scale, output rows per tile (N % 16 == 0, K % 32 == 0)
WEIGHT_GROUP = {4: 32, 8: 16}  # weight values per scale and offset, by bit width
HALF_MAX = 65504.0  # the largest float16: scales and offsets are stored as float16


def pack(q: torch.Tensor,       # [N, K]  4-bit: uint8 0..15; 8-bit: int8
         scale: torch.Tensor,   # float32 [N, K/g]  (g = WEIGHT_GROUP[bits])
         offset: torch.Tensor,  # float32 [N, K/g]
         bits: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed [N/16, K/g, 256] bytes, scales float16 [N/16, K/g, 2, 16]) in cpu_q4.c's layout. 4-bit: in a tile's
    group, byte 64 v + 4 j + i holds row j's input 4 v + i in its low nibble and input 16 + 4 v + i in its high one;
    8-bit: byte 64 v + 4 j + i holds row j's input 4 v + i (int8)."""
    n, k = q.shape
    g = WEIGHT_GROUP[bits]
    if n % TILE or k % GROUP or scale.shape != (n, k // g):
        raise ValueError(f"the {bits}-bit x int16 kernel takes N % 16 == 0 and K % 32 == 0 with a scale per {g} "
                         f"values, got [{n}, {k}] with scales {list(scale.shape)}")
    if max(scale.abs().max().item(), offset.abs().max().item(), 0.0) > HALF_MAX:
        raise ValueError("scales beyond float16's range")
    groups = k // g
    if bits == 4:
        x = q.view(n // TILE, TILE, groups, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)  # [tile, g, v, j, i, half]
        packed = (x[..., 0] | (x[..., 1] << 4)).reshape(n // TILE, groups, 256).contiguous()
    else:
        packed = q.view(n // TILE, TILE, groups, 4, 4).permute(0, 2, 3, 1, 4).reshape(n // TILE, groups, 256)
        packed = packed.contiguous()
    scales = torch.stack([scale, offset]).view(2, n // TILE, TILE, groups).permute(1, 3, 0, 2).half().contiguous()
    return packed, scales


def matmul(x: torch.Tensor,       # float32 [M, K]
           packed: torch.Tensor,  # [N/16, K/g, 256]  uint8: 4-bit, int8: 8-bit
           scales: torch.Tensor,  # float16 [N/16, K/g, 2, 16]
           ) -> torch.Tensor:     # float32 [M, N]
    lib = cpu_library.library()
    if lib is None:
        return matmul_twin(x, packed, scales)
    x = x.contiguous()
    y = x.new_empty(x.shape[0], packed.shape[0] * TILE)
    kernel = lib.q4_gemm if packed.dtype == torch.uint8 else lib.q8_gemm
    if cpu_library.call(kernel, x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), scales.data_ptr(),
                        y.shape[1], y.data_ptr()):
        raise MemoryError("the int16 x 4-bit kernel's scratch memory")
    return y


def unpack(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pack`'s inverse: (q [N, K] as float32, scale [N, K/g], offset [N, K/g])."""
    tiles, groups = packed.shape[:2]
    if packed.dtype == torch.uint8:
        low, high = (packed & 15).view(tiles, groups, 4, TILE, 4), (packed >> 4).view(tiles, groups, 4, TILE, 4)
        q = torch.stack([low, high], 2).permute(0, 4, 1, 2, 3, 5)  # [tile, j, g, half, v, i]
    else:
        q = packed.view(tiles, groups, 4, TILE, 4).permute(0, 3, 1, 2, 4)  # [tile, j, g, v, i]
    scale, offset = scales.float().permute(2, 0, 3, 1).reshape(2, tiles * TILE, groups)  # each [N, G]
    return q.reshape(tiles * TILE, -1).float(), scale, offset


def matmul_twin(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The kernels' math in torch: x rounded per group of 32 to int16 (round half to even, as lrintf), exact integer
    dot products per weight group (in float64: exact below 2^53), then scale * x_scale * dot + offset * sum(x)."""
    m, k = x.shape
    q, scale, offset = unpack(packed, scales)  # [N, K], [N, G] each
    g = k // scale.shape[1]  # weight values per group
    xg = x.float().view(m, k // GROUP, GROUP)
    amax = xg.abs().amax(-1)  # [M, K/32]
    inverse = torch.where(amax > 0, torch.full_like(amax, 32767) / amax, 0)  # a division, as the C code's (a
    x16 = torch.round(xg * inverse[..., None]).view(m, -1, g)  # scalar / tensor would be a reciprocal times 32767)
    step = (amax / 32767).repeat_interleave(GROUP // g, -1)  # [M, K/g]
    dots = torch.einsum("mgk,ngk->mng", x16.double(), q.view(q.shape[0], -1, g).double()).float()  # [M, N, K/g]
    terms = dots * (scale[None] * step[:, None]) + offset[None] * x.float().view(m, -1, g).sum(-1)[:, None]
    return terms.sum(-1)
