"""The 4-bit CPU GEMM on int16 activations (cpu_q4.c): y = x @ w.T for w = q * scale + offset per group of 32, x
rounded to int16 per group of 32 (scale max |x| / 32767); exact integer dot products, one float multiply-add per
group. Not exact, but closer to it than bfloat16 activations (an int8 rounding, llama.cpp's Q8 scheme, moved the
embedded model's greedy choice at ~6 % of positions), and measured against torch's int4 kernel by
packed_layers.fast_activation. `pack` lays a weight out for it, `matmul` runs it (the torch twin where the C library
is not built, and for the tests). Knows nothing about models.
"""

from __future__ import annotations

import torch

from fastspec.kernels import cpu_library

GROUP, TILE = 32, 16  # inputs per scale, output rows per tile (the kernel's shapes: N % 16 == 0, K % 32 == 0)
HALF_MAX = 65504.0  # the largest float16: scales and offsets are stored as float16


def pack(q: torch.Tensor,       # uint8 [N, K]  values 0..15
         scale: torch.Tensor,   # float32 [N, K/32]
         offset: torch.Tensor,  # float32 [N, K/32]
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [N/16, K/32, 256], scales float16 [N/16, K/32, 2, 16]) in cpu_q4.c's layout: in a tile's group,
    byte 64 v + 4 j + i holds row j's input 4 v + i in its low nibble and input 16 + 4 v + i in its high one."""
    n, k = q.shape
    if n % TILE or k % GROUP:
        raise ValueError(f"the int16 x 4-bit kernel takes N % 16 == 0 and K % 32 == 0, got [{n}, {k}]")
    if max(scale.abs().max().item(), offset.abs().max().item(), 0.0) > HALF_MAX:
        raise ValueError("scales beyond float16's range")
    groups = k // GROUP
    x = q.view(n // TILE, TILE, groups, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)  # [tile, g, v, j, i, half]
    packed = (x[..., 0] | (x[..., 1] << 4)).reshape(n // TILE, groups, 256).contiguous()
    scales = torch.stack([scale, offset]).view(2, n // TILE, TILE, groups).permute(1, 3, 0, 2).half().contiguous()
    return packed, scales


def matmul(x: torch.Tensor,       # float32 [M, K]
           packed: torch.Tensor,  # uint8 [N/16, K/32, 256]
           scales: torch.Tensor,  # float16 [N/16, K/32, 2, 16]
           ) -> torch.Tensor:     # float32 [M, N]
    lib = cpu_library.library()
    if lib is None:
        return matmul_twin(x, packed, scales)
    x = x.contiguous()
    y = x.new_empty(x.shape[0], packed.shape[0] * TILE)
    if cpu_library.call(lib.q4_gemm, x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), scales.data_ptr(),
                        y.shape[1], y.data_ptr()):
        raise MemoryError("the int16 x 4-bit kernel's scratch memory")
    return y


def matmul_twin(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The kernel's math in torch: x rounded per group to int16 (round half to even, as lrintf), exact integer dot
    products (in float64: exact below 2^53), then scale * x_scale * dot + offset * sum(x) per group."""
    m, k = x.shape
    tiles, groups = packed.shape[:2]
    low, high = (packed & 15).view(tiles, groups, 4, TILE, 4), (packed >> 4).view(tiles, groups, 4, TILE, 4)
    q = torch.stack([low, high], 2).permute(0, 4, 1, 2, 3, 5).reshape(tiles * TILE, groups, GROUP)  # [N, G, 32]
    scale, offset = scales.float().permute(2, 0, 3, 1).reshape(2, tiles * TILE, groups)  # each [N, G]
    xg = x.float().view(m, groups, GROUP)
    amax = xg.abs().amax(-1)  # [M, G]
    inverse = torch.where(amax > 0, torch.full_like(amax, 32767) / amax, 0)  # a division, as the C code's (a
    x16 = torch.round(xg * inverse[..., None])  # scalar / tensor would be a reciprocal times 32767: another rounding)
    dots = torch.einsum("mgk,ngk->mng", x16.double(), q.double()).float()  # [M, N, G]
    terms = dots * (scale[None] * (amax / 32767)[:, None]) + offset[None] * xg.sum(-1)[:, None]
    return terms.sum(-1)
