"""GGML's K-quant formats as seen by the packed path: Q4_K read as `Blocks` (its 32-value sub-blocks are exactly a
4-bit weight with a scale and an offset per group of 32, so Int4Linear takes it unchanged), and the K-quant mix
types that stay dequantised, with why. Does not own: reading the file, choosing a reader per tensor type (the
caller's), nor the kernels (gguf_blocks).

Q4_K stores each row in super-blocks of 256 values, 144 bytes each:
  f16 d, f16 dmin, 12 bytes of 6-bit scales sc[0..7] and mins m[0..7] (one per 32-value sub-block j),
  128 bytes of nibbles                                   w = d * sc[j] * q - dmin * m[j],  q in 0..15
which is Blocks' w = q * scale + offset with scale = d * sc[j] and offset = -dmin * m[j] per group of 32.

Which other formats could run packed exactly: only 4-bit values fit the int4 kernel (group 32, a scale and a zero
per group), and torch's int8 kernel takes one scale per output row. Q5_0, Q5_1 and Q5_K have Blocks' 32-groups with
a scale and an offset but 5-bit values (0..31): no int4 kernel takes them, and their per-group scales rule out the
per-row int8 one. Q8_K (f32 d per 256 values, int8 values) is 8-bit with offset 0 but one scale per 256 values, not
per row; it is ggml's activation format for K-quant dot products, not a stored weight (the gguf package has no
dequantiser for it). Q2_K, Q3_K and Q6_K scale every 16 values (see DEQUANTISED).
"""

from __future__ import annotations

import numpy as np
import torch

from fastspec.models.gguf_blocks import Blocks

SUPER_BLOCK = 256  # values per K-quant super-block: 8 sub-blocks of 32
Q4_K_BYTES = 144  # f16 d, f16 dmin, 12 bytes of scales and mins, 128 bytes of nibbles

# GGML types of llama.cpp's K-quant mixes (Q2_K .. Q6_K files; Q5_0 / Q5_1 stand in for Q4_K / Q5_K in rows that
# are not a multiple of 256) that no packed kernel here takes exactly: the packed path keeps their converted
# (dequantised) weights. Q6_K (attn_v, ffn_down and output in Q4_K_M files) has an int8 scale per 16 values and
# 6-bit values in -32..31: a 32-group Blocks could hold it only as q = sc * q6 (13-bit values, scale d), which
# no int4 or int8 kernel takes, so packing it would save nothing over its dequantised weight.
DEQUANTISED = ("Q2_K", "Q3_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K")


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
