"""The 4-, 5-, 6- and 8-bit CPU GEMMs on int16 activations (cpu_q4.c, cpu_q8.c): y = x @ w.T for
w = q * scale + offset per group (32 values of a 4-bit weight, 16 or 32 of a 5-, 6- or 8-bit one),
x rounded to int16 per group of 32 (scale max |x| / 32767); exact integer dot products, one float multiply-add per
group. Not exact, but closer to it than bfloat16 activations (an int8 rounding, llama.cpp's Q8 scheme, moved the
embedded model's greedy choice at ~6 % of positions), and measured against torch's int4 kernel by
activation_choice.fast_activation. `pack` lays a weight out for them (`narrow` picks the fewest bits an 8-bit weight
fits), `matmul` runs them (the torch twin where the C library is not built, and for the tests). Knows nothing about
models.
"""

from __future__ import annotations

import torch

from fastspec.kernels import cpu_library

GROUP, TILE = 32, 16  # activation values per rounding scale, output rows per tile (N % 16 == 0, K % 32 == 0)
WEIGHT_GROUPS = {4: (32,), 5: (16, 32), 6: (16, 32), 8: (16, 32)}  # weight values per scale and offset, by bit width
UNIT_BYTES = {256: 4, 320: 5, 384: 6}  # a uint8 layout's bytes per tile and group of 32 -> its bit width
HALF_MAX = 65504.0  # the largest float16: scales and offsets are stored as float16


def bits(packed: torch.Tensor) -> int:
    """The bit width of a weight `pack` laid out."""
    return 8 if packed.dtype == torch.int8 else UNIT_BYTES[packed.shape[-1]]


def in_features(packed: torch.Tensor) -> int:
    return packed.shape[1] * (16 if packed.dtype == torch.int8 else GROUP)


def weight_group(packed: torch.Tensor, scales: torch.Tensor) -> int:
    """Weight values per scale and offset of a weight `pack` laid out (scales [N/16, K/g, 2, 16])."""
    return in_features(packed) // scales.shape[1]


def as_levels(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:  # int8 [N, K]
    """A weight whose int8 values take at most 16 distinct levels (IQ4_NL / IQ4_XS's) as (uint8 indices [N, K], the
    levels int8 [16], padded with the last): `pack`'s 4-bit layout with `levels`; else None."""
    chunks = q.split(1024)  # 1024 rows at a time: the int64 indices of a whole large weight would be 8 bytes a value
    counts = sum(torch.bincount(rows.flatten().long() + 128, minlength=256) for rows in chunks)
    levels = (counts.nonzero().flatten() - 128).to(torch.int8)  # sorted
    if len(levels) > 16:
        return None
    index = torch.zeros(256, dtype=torch.uint8)
    index[levels.long() + 128] = torch.arange(len(levels), dtype=torch.uint8)
    indices = torch.cat([index[rows.long() + 128] for rows in chunks])
    return indices, torch.cat([levels, levels[-1:].expand(16 - len(levels))])


def narrow(q: torch.Tensor,       # int8 [N, K]
           scale: torch.Tensor,   # float32 [N, K/g]  (g: 16 or 32)
           offset: torch.Tensor,  # float32 [N, K/g]
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """An 8-bit weight with a scale and an offset per g values as the fewest bits of `pack` it fits exactly: (q,
    scale, offset, bits), with bits 5 or 6 where every group fits (q then uint8; a group with negative values shifted
    up by 2^(bits-1), its offset lowered by 2^(bits-1) * scale: exact where the offset was 0, as in every signed GGUF
    type), else the weight as it is (8)."""
    groups = q.view(q.shape[0], scale.shape[1], -1).short()  # [N, K/g, g]
    low, high = groups.amin(-1), groups.amax(-1)
    shifted = low < 0
    for width in (5, 6):
        half = 1 << (width - 1)
        if bool(torch.where(shifted, (low >= -half) & (high < half), high < 2 * half).all()):
            lift = shifted.short() * half  # [N, K/16]
            narrowed = (groups + lift[..., None]).to(torch.uint8).view(q.shape)
            return narrowed, scale, offset - lift.float() * scale, width
    return q, scale, offset, 8


def pack(q: torch.Tensor,       # [N, K]  4- / 5- / 6-bit: uint8 0..2^bits - 1; 8-bit: int8
         scale: torch.Tensor,   # float32 [N, K/g]  (g in WEIGHT_GROUPS[bits])
         offset: torch.Tensor,  # float32 [N, K/g]
         bits: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed bytes, scales float16 [N/16, K/g, 2, 16]) in cpu_q4.c's layout. 4-bit: [N/16, K/32, 256]; in a
    tile's group, byte 64 v + 4 j + i holds row j's input 4 v + i in its low nibble and input 16 + 4 v + i in its
    high one. 5- / 6-bit: [N/16, K/32, 256 + 64 e] (e = bits - 4 high bits), the low 4 bits laid out so, then the
    high bits of byte 64 v + 4 j + i's two values in byte 64 c + 4 j + i of the high part (c = v e // 4), at bits
    t.. (input 16 + 4 v + i) and 4 + t.. (input 4 v + i), t = v e % 4. 8-bit: [N/16, K/16, 256]; byte 64 v + 4 j + i
    holds row j's input 4 v + i (int8)."""
    n, k = q.shape
    g = k // max(scale.shape[-1], 1)
    if n % TILE or k % GROUP or scale.shape != (n, k // g) or g not in WEIGHT_GROUPS[bits]:
        raise ValueError(f"the {bits}-bit x int16 kernel takes N % 16 == 0 and K % 32 == 0 with a scale per "
                         f"{' or '.join(map(str, WEIGHT_GROUPS[bits]))} values, got [{n}, {k}] with scales "
                         f"{list(scale.shape)}")
    if max(scale.abs().max().item(), offset.abs().max().item(), 0.0) > HALF_MAX:
        raise ValueError("scales beyond float16's range")
    groups = k // g
    if bits in (5, 6):
        packed = _pack_wide(q, bits)
    elif bits == 4:
        packed = _pack_nibbles(q)
    else:  # groups of 16 inputs whatever the scales' group
        packed = q.view(n // TILE, TILE, k // 16, 4, 4).permute(0, 2, 3, 1, 4).reshape(n // TILE, k // 16, 256)
        packed = packed.contiguous()
    scales = torch.stack([scale, offset]).view(2, n // TILE, TILE, groups).permute(1, 3, 0, 2).half().contiguous()
    return packed, scales


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:  # uint8 [N, K] 0..15 -> [N/16, K/32, 256]
    n, k = q.shape
    x = q.view(n // TILE, TILE, k // GROUP, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)  # [tile, g, v, j, i, half]
    return (x[..., 0] | (x[..., 1] << 4)).reshape(n // TILE, k // GROUP, 256).contiguous()


def _pack_wide(q: torch.Tensor, width: int) -> torch.Tensor:  # uint8 [N, K] -> [N/16, K/32, 256 + 64 e]
    n, k = q.shape
    e = width - 4
    high = (q >> 4).view(n // TILE, TILE, k // GROUP, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)  # [tile, g, v, j, i, half]
    part = torch.zeros(n // TILE, k // GROUP, e, TILE, 4, dtype=torch.uint8)  # [tile, g, c, j, i]
    for v in range(4):
        c, t = divmod(v * e, 4)
        part[:, :, c] |= (high[:, :, v, ..., 1] << t) | (high[:, :, v, ..., 0] << (4 + t))
    return torch.cat([_pack_nibbles(q & 15), part.view(n // TILE, k // GROUP, 64 * e)], -1).contiguous()


def matmul(x: torch.Tensor,       # float32 [M, K]
           packed: torch.Tensor,  # `pack`'s layout of any width
           scales: torch.Tensor,  # float16 [N/16, K/g, 2, 16]
           levels: torch.Tensor | None = None,  # int8 [16]: a 4-bit weight's nibbles index these (as_levels)
           ) -> torch.Tensor:     # float32 [M, N]
    lib = cpu_library.library()
    if lib is None:
        return matmul_twin(x, packed, scales, levels)
    x = x.contiguous()
    y = x.new_empty(x.shape[0], packed.shape[0] * TILE)
    width = bits(packed)
    if cpu_library.call(lib.block_gemm, x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), scales.data_ptr(),
                        y.shape[1], y.data_ptr(), width, weight_group(packed, scales),
                        None if levels is None else levels.data_ptr()):
        raise MemoryError(f"the int16 x {width}-bit kernel's scratch memory")
    return y


def amx() -> bool:
    """Whether the 4-bit kernel takes 16 rows or more on AMX tiles here (cpu_amx.c: the same numbers as VNNI)."""
    lib = cpu_library.library()
    return lib is not None and bool(lib.amx_q4_enable(-1))


def unpack(packed: torch.Tensor, scales: torch.Tensor, levels: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pack`'s inverse: (q [N, K] as float32 (with `levels`: the levels its nibbles index), scale [N, K/g], offset
    [N, K/g])."""
    if levels is not None:
        q, scale, offset = unpack(packed, scales)
        return levels.float()[q.long()], scale, offset
    tiles, groups = packed.shape[:2]
    width = bits(packed)
    if width in (5, 6):
        e = width - 4
        per32 = scales if scales.shape[1] == groups else scales[:, ::2]  # (only the nibbles are read from it)
        q = unpack(packed[..., :256], per32)[0].to(torch.uint8).view(tiles, TILE, groups, 2, 4, 4)
        part = packed[..., 256:].view(tiles, groups, e, TILE, 4)  # [tile, g, c, j, i]
        for v in range(4):
            c, t = divmod(v * e, 4)
            bits_v = (part[:, :, c] >> t).permute(0, 2, 1, 3)  # [tile, j, g, i]
            q[:, :, :, 1, v] |= (bits_v & ((1 << e) - 1)) << 4  # input 16 + 4 v + i
            q[:, :, :, 0, v] |= ((bits_v >> 4) & ((1 << e) - 1)) << 4  # input 4 v + i
        scale, offset = scales.float().permute(2, 0, 3, 1).reshape(2, tiles * TILE, -1)
        return q.view(tiles * TILE, -1).float(), scale, offset
    if packed.dtype == torch.uint8:
        low, high = (packed & 15).view(tiles, groups, 4, TILE, 4), (packed >> 4).view(tiles, groups, 4, TILE, 4)
        q = torch.stack([low, high], 2).permute(0, 4, 1, 2, 3, 5)  # [tile, j, g, half, v, i]
    else:
        q = packed.view(tiles, groups, 4, TILE, 4).permute(0, 3, 1, 2, 4)  # [tile, j, g, v, i]
    scale, offset = scales.float().permute(2, 0, 3, 1).reshape(2, tiles * TILE, -1)  # each [N, K/g]
    return q.reshape(tiles * TILE, -1).float(), scale, offset


def matmul_twin(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, levels: torch.Tensor | None = None
                ) -> torch.Tensor:
    """The kernels' math in torch: x rounded per group of 32 to int16 (round half to even, as lrintf), exact integer
    dot products per weight group (in float64: exact below 2^53), then scale * x_scale * dot + offset * sum(x)."""
    m, k = x.shape
    q, scale, offset = unpack(packed, scales, levels)  # [N, K], [N, G] each
    g = k // scale.shape[1]  # weight values per group
    xg = x.float().view(m, k // GROUP, GROUP)
    amax = xg.abs().amax(-1)  # [M, K/32]
    inverse = torch.where(amax > 0, torch.full_like(amax, 32767) / amax, 0)  # a division, as the C code's (a
    x16 = torch.round(xg * inverse[..., None]).view(m, -1, g)  # scalar / tensor would be a reciprocal times 32767)
    step = (amax / 32767).repeat_interleave(GROUP // g, -1)  # [M, K/g]
    dots = torch.einsum("mgk,ngk->mng", x16.double(), q.view(q.shape[0], -1, g).double()).float()  # [M, N, K/g]
    terms = dots * (scale[None] * step[:, None]) + offset[None] * x.float().view(m, -1, g).sum(-1)[:, None]
    return terms.sum(-1)
