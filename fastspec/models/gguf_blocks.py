"""GGUF's 4- and 8-bit block formats read as tensors without dequantising them, and a 4-bit linear that runs on
them packed (torch's int4 CPU kernel): the pieces a GGUF model kept packed is built from.

A weight [N, K] is stored row by row in blocks of 32 values, each block with its own scale (ggml's layout):
  Q4_0    f16 d, 16 bytes of nibbles                        w = d * (q - 8)
  Q4_1    f16 d, f16 m, 16 bytes                            w = d * q + m
  Q5_0    f16 d, 4 bytes of fifth bits, 16 bytes            w = d * (q - 16)
  Q5_1    f16 d, f16 m, 4 bytes of fifth bits, 16 bytes     w = d * q + m
  Q8_0    f16 d, 32 int8                                    w = d * q
  IQ4_NL  f16 d, 16 bytes of nibbles                        w = d * IQ4_VALUES[q]
A block's element j sits in the low nibble of byte j and element j + 16 in its high nibble; a Q5 block's fifth bits
are a little-endian uint32 whose bit j tops element j. Every format is read as w = q * scale + offset per block, q
4-bit (Q4_0 / Q4_1: offset -8 d or m) or an int8 (Q5_0: q - 16; Q5_1: offset m; Q8_0; IQ4_NL: the level itself), which
is what the packed kernels take, exactly.
Also how blocks are stored beside a converted model (`blocks_state`, `blocks_from_state`). Does not own: reading
the GGUF file (fastspec.models.gguf), the modules that run on blocks (packed_layers) nor which module each weight
becomes (gguf_packed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

BLOCK = 32
BLOCKS_FILE = "gguf_blocks/blocks.safetensors"  # a subdirectory: not one of the model's *.safetensors
FORMATS = {  # bytes per block, f16 values before the quants
    "Q4_0": (18, 1), "Q4_1": (20, 2), "Q5_0": (22, 1), "Q5_1": (24, 2), "Q8_0": (34, 1), "IQ4_NL": (18, 1)}
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # IQ4_NL / IQ4_XS's levels


@dataclass(frozen=True)
class Blocks:
    """One quantised weight [N, K]: w[n, k] = q[n, k] * scale[n, k // g] + offset[n, k // g], g = `group` (32; 16
    for the sub-blocks of Q2_K, Q3_K and Q6_K)."""

    q: torch.Tensor  # [N, K]  4-bit (Q4_0 / Q4_1 / Q4_K): uint8 0..15; 8-bit (every other type): int8
    scale: torch.Tensor  # float32 [N, K/g]
    offset: torch.Tensor  # float32 [N, K/g]
    bits: int  # 4 or 8

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def dequantise(self, dtype: torch.dtype = torch.float32, rows: int = 4096) -> torch.Tensor:  # [N, K]
        """w in float32 arithmetic, stored as `dtype`, `rows` rows at a time (no float32 copy of a large table)."""
        n, k = self.q.shape
        w = torch.empty(n, k, dtype=dtype, device=self.q.device)
        for r in range(0, n, rows):
            q = self.q[r:r + rows].view(-1, k // self.group, self.group).float()
            w[r:r + rows] = (q * self.scale[r:r + rows, :, None] + self.offset[r:r + rows, :, None]).view(-1, k)
        return w

    def pad_rows(self, multiple: int) -> Blocks:
        """The same weight with zero rows appended up to a multiple of `multiple` rows (a kernel's tile): scales and
        offsets 0, values the last row's (a zero row then adds no value a packing sees: no level, no wider range)."""
        extra = -self.q.shape[0] % multiple
        if not extra:
            return self
        q = torch.cat([self.q, self.q[-1:].expand(extra, -1)])
        return Blocks(q, *(F.pad(t, (0, 0, 0, extra)) for t in (self.scale, self.offset)), self.bits)

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
    scale, body = torch.from_numpy(f16[..., 0].copy()), blocks[..., 2 * halves:]
    zero = torch.zeros_like(scale)
    if kind == "Q8_0":
        return Blocks(torch.from_numpy(body.copy().view(np.int8)).reshape(n, -1), scale, zero, 8)
    if kind in ("Q5_0", "Q5_1"):
        fifth = body[..., :4].copy().view("<u4")  # [N, K/32, 1]
        body = body[..., 4:]
    q = np.concatenate([body & 15, body >> 4], -1)  # uint8 [N, K/32, 32]: low nibbles are elements 0..15
    if kind == "IQ4_NL":
        return Blocks(_int8(np.array(IQ4_VALUES, dtype=np.int8)[q], n), scale, zero, 8)
    if kind == "Q5_0":
        return Blocks(_int8(_top(q, fifth).astype(np.int8) - 16, n), scale, zero, 8)
    if kind == "Q5_1":
        return Blocks(_int8(_top(q, fifth).astype(np.int8), n), scale, torch.from_numpy(f16[..., 1].copy()), 8)
    offset = torch.from_numpy(f16[..., 1].copy()) if kind == "Q4_1" else -8 * scale
    return Blocks(torch.from_numpy(q).reshape(n, -1), scale, offset, 4)


def _top(nibbles: np.ndarray, fifth: np.ndarray) -> np.ndarray:
    """Q5's values 0..31: nibbles [N, K/32, 32] topped by bit j of `fifth` [N, K/32, 1] (uint32) for element j."""
    return nibbles | (((fifth >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def _int8(q: np.ndarray, n: int) -> torch.Tensor:  # int8 [N, K/g, g] -> [N, K]
    return torch.from_numpy(np.ascontiguousarray(q, dtype=np.int8)).reshape(n, -1)


def quantise_rows(rows, n: int, chunk: int = 4096, group: int = BLOCK) -> Blocks:
    """The float weight whose rows `rows(ids)` returns ([len(ids), K]) rounded to 4 bits as Q4_1 does (per group of
    `group`, 32 as Q4_1: offset the minimum, scale (max - min) / 15), `chunk` rows at a time, on the rows' device:
    an approximation within half a step."""
    q, scale, offset = None, [], []
    for r in range(0, n, chunk):
        w = rows(torch.arange(r, min(r + chunk, n))).float().unflatten(-1, (-1, group))  # [rows, K/g, g]
        low, high = w.amin(-1), w.amax(-1)
        step = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
        q = torch.empty(n, w.shape[1] * group, dtype=torch.uint8, device=w.device) if q is None else q
        q[r:r + chunk] = torch.round((w - low[..., None]) / step[..., None]).clamp(0, 15).flatten(-2)
        scale.append(step)
        offset.append(low)
    return Blocks(q, torch.cat(scale), torch.cat(offset), 4)


def round_8bit(weight: torch.Tensor) -> Blocks:
    """A float weight [N, K] (K % 16 == 0) rounded to int8 values with a scale per 16 (max |w| / 127, offset 0): each
    value within half a step, 1/254 of its group's largest."""
    w = weight.detach().float().unflatten(-1, (-1, 16))  # [N, K/16, 16]
    scale = (w.abs().amax(-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)  # [N, K/16]
    q = torch.round(w / scale[..., None]).clamp(-127, 127).to(torch.int8).flatten(-2)
    return Blocks(q, scale, torch.zeros_like(scale), 8)


def blocks_state(name: str, b: Blocks) -> dict[str, torch.Tensor]:
    """How `b` is stored under `name` (safetensors): 4-bit values two to a byte (element 2j in the low nibble, 2j + 1
    in the high one), 8-bit values as int8, scales and offsets as float32."""
    q = b.q[:, 0::2] | b.q[:, 1::2] << 4 if b.bits == 4 else b.q
    return {f"{name}.q": q.contiguous(), f"{name}.scale": b.scale.contiguous(), f"{name}.offset": b.offset.contiguous()}


def blocks_from_state(get, name: str) -> Blocks:
    """The Blocks stored under `name` (see blocks_state); `get(key)` returns one stored tensor."""
    q = get(f"{name}.q")
    if q.dtype == torch.uint8:
        return Blocks(torch.stack([q & 15, q >> 4], -1).flatten(1), get(f"{name}.scale"), get(f"{name}.offset"), 4)
    return Blocks(q, get(f"{name}.scale"), get(f"{name}.offset"), 8)


def stored_floats(model_dir, keep=None) -> dict[str, torch.Tensor]:
    """A converted GGUF directory's weights kept only as blocks (BLOCKS_FILE), dequantised to float32 (those whose
    name `keep(name)` accepts); {} for any other directory. The conversion writes no float copy of them."""
    from safetensors import safe_open

    path = Path(model_dir) / BLOCKS_FILE
    if not path.is_file():
        return {}
    with safe_open(str(path), "pt") as stored:
        return {name: blocks_from_state(stored.get_tensor, name).dequantise(torch.float32)
                for name in _block_names(stored.keys()) if keep is None or keep(name)}


def stored_names(model_dir) -> list[str]:
    """The names of the weights a converted GGUF directory keeps only as blocks, without reading them ([] for any
    other directory)."""
    from safetensors import safe_open

    path = Path(model_dir) / BLOCKS_FILE
    if not path.is_file():
        return []
    with safe_open(str(path), "pt") as stored:
        return _block_names(stored.keys())


def _block_names(keys) -> list[str]:
    return sorted({key.rsplit(".", 1)[0] for key in keys})  # "<name>.q" / ".scale" / ".offset" -> "<name>"


def merge_rows(parts: list[Blocks]) -> Blocks:
    """Several weights over the same input stacked by rows (fused QKV, gate_up), still quantised; parts of different
    bit widths or groups (Q4_K beside Q6_K in a Q4_K_M file) as 8-bit values with a scale per 16 (`as_8bit_16`)."""
    if len({(p.bits, p.group) for p in parts}) != 1:
        parts = [as_8bit_16(p) for p in parts]
    return Blocks(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "offset")), parts[0].bits)


def as_8bit_16(b: Blocks) -> Blocks:
    """The same weight as int8 values with a scale and an offset per 16 (exact: a 4-bit value is an int8 one, a
    group of 32 two groups of 16 with its scale and offset)."""
    repeat = b.group // 16
    return Blocks(b.q.to(torch.int8), b.scale.repeat_interleave(repeat, -1), b.offset.repeat_interleave(repeat, -1), 8)
