"""GGML's K-quant formats as seen by the packed path: Q4_K and Q6_K read as `Blocks`, and the K-quant mix types that
stay dequantised, with why. Does not own: reading the file, choosing a reader per tensor type (the caller's), nor
the kernels (gguf_blocks, packed_layers).

Q4_K stores each row in super-blocks of 256 values, 144 bytes each:
  f16 d, f16 dmin, 12 bytes of 6-bit scales sc[0..7] and mins m[0..7] (one per 32-value sub-block j),
  128 bytes of nibbles                                   w = d * sc[j] * q - dmin * m[j],  q in 0..15
which is Blocks' w = q * scale + offset with scale = d * sc[j] and offset = -dmin * m[j] per group of 32.
Q6_K stores super-blocks of 256 values in 210 bytes:
  128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales sc[0..15] (one per 16 values), f16 d
                                                         w = d * sc[j] * (q - 32),  q in 0..63
which is an 8-bit Blocks (int8 values q - 32) with scale = d * sc[j] and offset 0 per group of 16: fastspec's own
8-bit kernel (packed_layers.BlockLinear) takes it; torch's int4 / int8 kernels do not.

Which other formats could run packed exactly: Q5_0, Q5_1 and Q5_K have Blocks' 32-groups with a scale and an offset
but 5-bit values (0..31); they would be 8-bit Blocks as Q6_K is (not read here yet). Q8_K (f32 d per 256 values,
int8 values) is ggml's activation format for K-quant dot products, not a stored weight. Q2_K and Q3_K scale every
16 values with 2- / 3-bit values (see DEQUANTISED).
"""

from __future__ import annotations

import numpy as np
import torch

from fastspec.models.gguf_blocks import Blocks

SUPER_BLOCK = 256  # values per K-quant super-block: 8 sub-blocks of 32
Q4_K_BYTES = 144  # f16 d, f16 dmin, 12 bytes of scales and mins, 128 bytes of nibbles
Q6_K_BYTES = 210  # 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, f16 d

# GGML types of llama.cpp's K-quant mixes (Q2_K .. Q6_K files; Q5_0 / Q5_1 stand in for Q4_K / Q5_K in rows that
# are not a multiple of 256) that the packed path keeps as their converted (dequantised) weights.
DEQUANTISED = ("Q2_K", "Q3_K", "Q5_0", "Q5_1", "Q5_K")


def read_q4_k(data: np.ndarray) -> Blocks:
    """A Q4_K tensor's raw rows (uint8 [N, K / 256 * 144], as gguf.GGUFReader gives them) as a 4-bit Blocks [N, K].

    The float32 arithmetic is the gguf package's (scale = f32(d) * sc, offset = -(f32(dmin) * m)), so
    `dequantise()` equals gguf.quants.dequantize(data, Q4_K) bit for bit: q * scale + (-dm) == q * scale - dm."""
    blocks = _super_blocks(data, Q4_K_BYTES, "Q4_K")  # uint8 [N, S, 144]
    n = blocks.shape[0]
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # float32 [N, S, 1]
    sc, m = unpack_scales_mins(blocks[..., 4:16])  # uint8 [N, S, 8], 0..63
    scale = d * sc.astype(np.float32)  # [N, S, 8]: one per 32-value sub-block
    offset = -(dmin * m.astype(np.float32))
    q = unpack_nibbles(blocks[..., 16:])  # uint8 [N, S, 256]
    return Blocks(torch.from_numpy(q.reshape(n, -1)), torch.from_numpy(scale.reshape(n, -1)),
                  torch.from_numpy(offset.reshape(n, -1)), 4)


def read_q6_k(data: np.ndarray) -> Blocks:
    """A Q6_K tensor's raw rows (uint8 [N, K / 256 * 210]) as an 8-bit Blocks [N, K] with a scale per 16 values:
    q = value - 32 (int8), scale = f32(d) * sc, offset 0, so `dequantise()` equals gguf.quants.dequantize(data, Q6_K)
    bit for bit. Each half super-block of 128 values takes 64 bytes of low nibbles and 32 of high bit pairs: value
    32 c + l (c = 0..3, l = 0..31) is the low (c < 2) or high nibble of low byte 32 (c % 2) + l, topped by bits
    2c, 2c + 1 of high byte l."""
    blocks = _super_blocks(data, Q6_K_BYTES, "Q6_K")  # uint8 [N, S, 210]
    n = blocks.shape[0]
    low, high = blocks[..., :128].reshape(n, -1, 2, 2, 32), blocks[..., 128:192].reshape(n, -1, 2, 32)
    nibbles = np.stack([low[..., 0, :] & 15, low[..., 1, :] & 15, low[..., 0, :] >> 4, low[..., 1, :] >> 4], -2)
    pairs = np.stack([(high >> shift) & 3 for shift in (0, 2, 4, 6)], -2)  # [N, S, 2 halves, 4, 32]
    q = ((nibbles | (pairs << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, -1)
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)  # [N, S, 16]
    scale = (_f16(blocks[..., 208:210]) * sc).reshape(n, -1)
    return Blocks(torch.from_numpy(q), torch.from_numpy(scale), torch.zeros(scale.shape), 8)


def unpack_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4 for all sub-blocks at once: uint8 [..., 12] -> (sc, m), each uint8 [..., 8] in 0..63.

    Bytes 0-3 hold sc[0..3] in their low 6 bits, bytes 4-7 hold m[0..3]; sub-blocks 4..7 take their low 4 bits
    from bytes 8-11 (sc low nibble, m high nibble) and their top 2 bits from the top of bytes 0-3 (sc) / 4-7 (m).
    E.g. byte 0 = 0b10_000001, byte 8 = 0b0000_0011: sc[0] = 1, sc[4] = 0b10_0011 = 35."""
    low_sc, low_m, high = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]  # [..., 4] each
    sc = np.concatenate([low_sc & 0x3F, (high & 0x0F) | ((low_sc >> 2) & 0x30)], -1)
    m = np.concatenate([low_m & 0x3F, (high >> 4) | ((low_m >> 2) & 0x30)], -1)
    return sc, m


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., 128] -> uint8 [..., 256] in 0..15. Every 32 bytes hold 64 values: the low nibbles are values
    0..31 of that chunk and the high nibbles values 32..63 (unlike Q4_0's 16-byte blocks: low 0..15, high 16..31)."""
    chunks = packed.reshape(*packed.shape[:-1], 4, 1, 32)  # [..., 4 chunks, 1, 32 bytes]
    nibbles = np.concatenate([chunks & 0x0F, chunks >> 4], -2)  # [..., 4, 2, 32]: low then high
    return nibbles.reshape(*packed.shape[:-1], SUPER_BLOCK).astype(np.uint8)


def _super_blocks(data: np.ndarray, size: int, kind: str) -> np.ndarray:  # uint8 [N, bytes] -> [N, S, size]
    if data.dtype != np.uint8 or data.ndim != 2:
        raise ValueError(f"{kind} data must be raw rows, uint8 [N, bytes per row]; got {data.dtype} "
                         f"{list(data.shape)}")
    if data.shape[1] % size:
        raise ValueError(f"a {kind} row is whole super-blocks of {size} bytes ({SUPER_BLOCK} values); got "
                         f"{data.shape[1]} bytes per row")
    return np.ascontiguousarray(data).reshape(data.shape[0], -1, size)


def _f16(pair: np.ndarray) -> np.ndarray:  # uint8 [..., 2] -> float32 [..., 1], little-endian f16
    return pair.copy().view(np.float16).astype(np.float32)
