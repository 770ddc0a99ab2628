"""GGML's K-quant formats (and IQ4_XS) as seen by the packed path: each read as `Blocks`, exactly, and the codebook
types that stay dequantised. Does not own: reading the file, choosing a reader per tensor type (the caller's), nor
the kernels (gguf_blocks, packed_layers).

Each row is stored in super-blocks of 256 values, with a scale (and a min) per sub-block j:
  Q2_K   84 bytes: 16 bytes of 4-bit scale / min pairs, 64 bytes of 2-bit values, f16 d, f16 dmin
                                                   w = d * sc[j] * q - dmin * m[j]   q in 0..3,   j per 16 values
  Q3_K  110 bytes: 32 bytes of third bits, 64 of 2-bit values, 12 bytes of 6-bit scales, f16 d
                                                   w = d * (sc[j] - 32) * q          q in -4..3,  j per 16 values
  Q4_K  144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
                                                   w = d * sc[j] * q - dmin * m[j]   q in 0..15,  j per 32 values
  Q5_K  176 bytes: Q4_K's, with 32 bytes of fifth bits before the nibbles
                                                   w = d * sc[j] * q - dmin * m[j]   q in 0..31,  j per 32 values
  Q6_K  210 bytes: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, f16 d
                                                   w = d * sc[j] * q                 q in -32..31, j per 16 values
  IQ4_XS 136 bytes: f16 d, 2 + 4 bytes of 6-bit scales, 128 bytes of nibbles indexing IQ4_VALUES
                                                   w = d * (sc[j] - 32) * IQ4_VALUES[q],         j per 32 values
Each is Blocks' w = q * scale + offset with scale = d * sc[j] and offset = -dmin * m[j] (or 0): Q4_K as 4-bit
Blocks, the others as 8-bit ones (int8 values), which fastspec's kernels take in 5, 6 or 8 bits (cpu_q4.narrow);
torch's int4 kernel does not.
The float32 arithmetic is the gguf package's, so every `dequantise()` equals gguf.quants.dequantize bit for bit.
Q8_K (f32 d per 256 values, int8 values) is ggml's activation format for K-quant dot products, not a stored weight.
"""

from __future__ import annotations

import numpy as np
import torch

from fastspec.models.gguf_blocks import IQ4_VALUES, Blocks, read_blocks

SUPER_BLOCK = 256  # values per K-quant super-block
BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "IQ4_XS": 136}  # per super-block

# GGML types the packed path keeps as their converted (dequantised) weights: the codebook types, whose values come
# from lattice grids with signs, and the ternary TQ types (int8 values with a scale per 256; not read here yet).
DEQUANTISED = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "TQ1_0", "TQ2_0")


def read_q4_k(data: np.ndarray) -> Blocks:
    """A Q4_K tensor's raw rows (uint8 [N, K / 256 * 144], as gguf.GGUFReader gives them) as a 4-bit Blocks [N, K].
    scale = f32(d) * sc, offset = -(f32(dmin) * m): q * scale + (-dm) == q * scale - dm, the gguf package's."""
    blocks = _super_blocks(data, "Q4_K")  # uint8 [N, S, 144]
    return _rows(unpack_nibbles(blocks[..., 16:]), *_scales_mins(blocks), 4)


def read_q5_k(data: np.ndarray) -> Blocks:
    """A Q5_K tensor's raw rows (uint8 [N, K / 256 * 176]) as an 8-bit Blocks [N, K] (values 0..31, a scale and
    offset per 32 as Q4_K's): value l of sub-block j is Q4_K's nibble topped by bit j of fifth-bit byte l."""
    blocks = _super_blocks(data, "Q5_K")  # uint8 [N, S, 176]
    fifth = (blocks[..., 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1  # [N, S, 32 l, 8 j]
    q = unpack_nibbles(blocks[..., 48:]) | (np.swapaxes(fifth, -1, -2) << 4).reshape(*blocks.shape[:2], SUPER_BLOCK)
    return _rows(q.astype(np.int8), *_scales_mins(blocks), 8)


def read_q6_k(data: np.ndarray) -> Blocks:
    """A Q6_K tensor's raw rows (uint8 [N, K / 256 * 210]) as an 8-bit Blocks [N, K] with a scale per 16 values:
    q = value - 32 (int8), scale = f32(d) * sc, offset 0. Each half super-block of 128 values takes 64 bytes of low
    nibbles and 32 of high bit pairs: value 32 c + l (c = 0..3, l = 0..31) is the low (c < 2) or high nibble of low
    byte 32 (c % 2) + l, topped by bits 2c, 2c + 1 of high byte l."""
    blocks = _super_blocks(data, "Q6_K")  # uint8 [N, S, 210]
    n = blocks.shape[0]
    low, high = blocks[..., :128].reshape(n, -1, 2, 2, 32), blocks[..., 128:192].reshape(n, -1, 2, 32)
    nibbles = np.stack([low[..., 0, :] & 15, low[..., 1, :] & 15, low[..., 0, :] >> 4, low[..., 1, :] >> 4], -2)
    pairs = np.stack([(high >> shift) & 3 for shift in (0, 2, 4, 6)], -2)  # [N, S, 2 halves, 4, 32]
    q = (nibbles | (pairs << 4)).astype(np.int16) - 32
    scale = _f16(blocks[..., 208:210]) * blocks[..., 192:208].copy().view(np.int8).astype(np.float32)  # [N, S, 16]
    return _rows(q.astype(np.int8), scale, np.zeros_like(scale), 8)


def read_q2_k(data: np.ndarray) -> Blocks:
    """A Q2_K tensor's raw rows (uint8 [N, K / 256 * 84]) as an 8-bit Blocks [N, K] (values 0..3, a scale and an
    offset per 16): each half super-block of 128 values takes 32 bytes; value 32 c + l (c = 0..3, l = 0..31) is bits
    2c, 2c + 1 of byte l. Scale byte j: sc[j] low nibble, m[j] high; scale = f32(d) * sc, offset = -(f32(dmin) * m)."""
    blocks = _super_blocks(data, "Q2_K")  # uint8 [N, S, 84]
    q = _crumbs(blocks[..., 16:80])
    sc = blocks[..., :16]
    scale = _f16(blocks[..., 80:82]) * (sc & 15).astype(np.float32)  # [N, S, 16]
    offset = -(_f16(blocks[..., 82:84]) * (sc >> 4).astype(np.float32))
    return _rows(q.astype(np.int8), scale, offset, 8)


def read_q3_k(data: np.ndarray) -> Blocks:
    """A Q3_K tensor's raw rows (uint8 [N, K / 256 * 110]) as an 8-bit Blocks [N, K] (values -4..3, a scale per
    16): Q2_K's 2-bit layout, less 4 where value v's third bit (bit v // 32 of byte v % 32) is clear. Scale j's low
    4 bits are the low (j < 8) or high nibble of byte j % 8 of the 12, its top 2 bits are bits 2 (j // 4) of byte
    8 + j % 4; scale = f32(d) * (sc - 32), offset 0."""
    blocks = _super_blocks(data, "Q3_K")  # uint8 [N, S, 110]
    third = (blocks[..., None, :32] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [N, S, 8, 32]
    q = _crumbs(blocks[..., 32:96]).astype(np.int8) - 4 * (1 - third.reshape(*blocks.shape[:2], SUPER_BLOCK))
    packed = blocks[..., 96:108]
    low = np.concatenate([packed[..., :8] & 15, packed[..., :8] >> 4], -1)  # [N, S, 16]
    top = (packed[..., None, 8:12] >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3  # [N, S, 4, 4]
    sc = (low | top.reshape(low.shape) << 4).astype(np.int8) - 32
    scale = _f16(blocks[..., 108:110]) * sc.astype(np.float32)
    return _rows(q.astype(np.int8), scale, np.zeros_like(scale), 8)


def read_iq4_xs(data: np.ndarray) -> Blocks:
    """An IQ4_XS tensor's raw rows (uint8 [N, K / 256 * 136]) as an 8-bit Blocks [N, K] of IQ4_NL's levels with a
    scale per 32: sub-block j's 6-bit sc takes nibble j % 2 of byte 4 + j // 2 and bits 2j, 2j + 1 of the uint16 at
    bytes 2-3; scale = f32(d) * (sc - 32). Its 16 bytes of nibbles are laid out as an IQ4_NL / Q4_0 block's."""
    blocks = _super_blocks(data, "IQ4_XS")  # uint8 [N, S, 136]
    packed = blocks[..., 8:].reshape(*blocks.shape[:2], 8, 16)
    nibbles = np.concatenate([packed & 15, packed >> 4], -1).reshape(*blocks.shape[:2], SUPER_BLOCK)
    low = np.stack([blocks[..., 4:8] & 15, blocks[..., 4:8] >> 4], -1).reshape(*blocks.shape[:2], 8)
    top = (blocks[..., 2:4].copy().view("<u2") >> np.arange(0, 16, 2, dtype=np.uint16)) & 3  # [N, S, 8]
    sc = (low | (top.astype(np.uint8) << 4)).astype(np.int8) - 32
    scale = _f16(blocks[..., 0:2]) * sc.astype(np.float32)
    return _rows(np.array(IQ4_VALUES, dtype=np.int8)[nibbles], scale, np.zeros_like(scale), 8)


READERS = {"Q2_K": read_q2_k, "Q3_K": read_q3_k, "Q4_K": read_q4_k, "Q5_K": read_q5_k, "Q6_K": read_q6_k,
           "IQ4_XS": read_iq4_xs}


def read(data: np.ndarray, kind: str) -> Blocks:
    """The Blocks of raw GGUF rows of any type stored as blocks: a K-quant or IQ4_XS here, the others gguf_blocks'."""
    return READERS[kind](data) if kind in READERS else read_blocks(data, kind)


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


def _super_blocks(data: np.ndarray, kind: str) -> np.ndarray:  # uint8 [N, bytes] -> [N, S, bytes per super-block]
    size = BYTES[kind]
    if data.dtype != np.uint8 or data.ndim != 2:
        raise ValueError(f"{kind} data must be raw rows, uint8 [N, bytes per row]; got {data.dtype} "
                         f"{list(data.shape)}")
    if data.shape[1] % size:
        raise ValueError(f"a {kind} row is whole super-blocks of {size} bytes ({SUPER_BLOCK} values); got "
                         f"{data.shape[1]} bytes per row")
    return np.ascontiguousarray(data).reshape(data.shape[0], -1, size)


def _scales_mins(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's (scale, offset) per 32-value sub-block, each float32 [N, S, 8], from their first 16 bytes."""
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # float32 [N, S, 1]
    sc, m = unpack_scales_mins(blocks[..., 4:16])  # uint8 [N, S, 8], 0..63
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _crumbs(packed: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K's 2-bit values: uint8 [N, S, 64] -> [N, S, 256] in 0..3, value 128 h + 32 c + l from bits 2c, 2c + 1
    of byte 32 h + l."""
    halves = packed.reshape(*packed.shape[:2], 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    return (halves & 3).reshape(*packed.shape[:2], SUPER_BLOCK)


def _rows(q: np.ndarray, scale: np.ndarray, offset: np.ndarray, bits: int) -> Blocks:
    """Blocks [N, K] from per-super-block arrays: q [N, S, 256], scale and offset [N, S, sub-blocks]."""
    n = q.shape[0]
    return Blocks(*(torch.from_numpy(np.ascontiguousarray(a).reshape(n, -1)) for a in (q, scale, offset)), bits)


def _f16(pair: np.ndarray) -> np.ndarray:  # uint8 [..., 2] -> float32 [..., 1], little-endian f16
    return pair.copy().view(np.float16).astype(np.float32)
