"""Reading a GGUF's tensors as Hugging Face weights: the gguf package's reader (refusing types it does not know and
truncated files), each tensor dequantised or kept as its blocks, llama.cpp's rope row permutation of a llama's q / k
undone, a fused tensor's rows split and a stacked experts tensor split per expert.
Does not own: the names (gguf_names) nor writing anything (gguf.py)."""

from importlib.metadata import version
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import dequantize

from fastspec.errors import FastspecError
from fastspec.models.gguf_blocks import FORMATS, blocks_state
from fastspec.models.gguf_config import arch_meta
from fastspec.models.gguf_kquants import READERS, read
from fastspec.models.gguf_names import arch_spec, hf_name
from fastspec.models.gguf_rope import LONGROPE, ROPE_FACTORS

BLOCK_KINDS = (*FORMATS, *READERS)  # GGUF types also stored as blocks


def unpermute_rope_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:  # weight: [n_head * head_dim, in]
    """Undo llama.cpp's q/k row order: GGUF row 2j (2j+1) of a head is HF row j (j + head_dim/2).

    HF rotates (x_j, x_{j+d/2}) together (rotate_half); llama.cpp rotates adjacent pairs (x_2j, x_2j+1).
    E.g. head_dim 4: GGUF rows [a0, b0, a1, b1] -> HF rows [a0, a1, b0, b1].
    """
    rows, cols = weight.shape
    return weight.reshape(n_head, rows // n_head // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


class UnknownType(Exception):
    """A tensor type the gguf package cannot name (_Reader)."""


class _Reader(gguf.GGUFReader):
    """The gguf package's reader, refusing a tensor type the package does not know (one newer than it, such as
    llama.cpp's Q2_0) by the tensor's name and the type's id: its own error reads as a malformed file."""

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        known = {t.value for t in gguf.GGMLQuantizationType}
        for field in fields:  # parts: name length, name, n_dims, dims, type, offset
            kind = int(field.parts[4][0])
            if kind not in known:
                raise UnknownType(f"tensor {field.name} has GGML type {kind}, which gguf "
                                  f"{version('gguf')} does not know: not supported")
        super()._build_tensors(start_offs, fields)


def open_reader(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise FastspecError(f"{path}: GGUF file not found")
    try:
        reader = _Reader(path)
        for tensor in reader.tensors:  # a truncated data section shows up as a short tensor buffer
            if tensor.data.nbytes != tensor.n_bytes:
                raise ValueError(f"tensor {tensor.name} is truncated")
        return reader
    except UnknownType as e:
        raise FastspecError(f"{path}: {e}") from None
    except (ValueError, KeyError, IndexError, TypeError, OverflowError) as e:
        raise FastspecError(f"{path}: not a valid GGUF file ({e})") from None


def read_tensors(reader, path: Path, dtype: torch.dtype, arch: str) -> tuple[dict, dict, dict]:
    """(HF name -> dequantised tensor in `dtype` for every tensor not of a block format, the block-format tensors'
    blocks (blocks_state: loaders dequantise them, gguf_blocks.stored_floats), HF name -> GGUF type name); q / k rows
    in HF's rope order (llama.cpp pairs a llama's rows for its rope; the others rotate halves, as HF does), a fused
    tensor's rows split into the weights it stacks."""
    m = arch_meta(reader, arch, path)
    n_head = m("attention.head_count")
    n_kv_head = m("attention.head_count_kv", n_head)
    spec = arch_spec(reader, arch)
    tensors, blocks, kinds = {}, {}, {}
    for t in reader.tensors:
        if t.name == ROPE_FACTORS:
            continue
        if t.name in LONGROPE:
            raise FastspecError(f"{path}: LongRoPE ({t.name}: Phi-3 128k, Phi-3.5, Phi-4-mini) is not supported")
        layer, _, part = t.name.removeprefix("blk.").partition(".")
        if t.name.startswith("blk.") and part in spec.fused:
            names, sizes = spec.fused[part]
            edges = np.cumsum([0, *sizes(int(t.shape[-1]), n_head, n_kv_head)])
            pieces = [(f"model.layers.{layer}.{n}", lambda x, a=a, b=b: x[a:b].contiguous())
                      for n, a, b in zip(names, edges[:-1], edges[1:])]
        elif "{e}" in spec.extra.get(part, ""):  # [E, rows, columns]: expert e is t.data[e]
            _read_experts(t, f"model.layers.{layer}.{spec.extra[part]}", path, dtype, (tensors, blocks, kinds))
            continue
        else:
            name = hf_name(t.name, arch, spec)
            heads = n_head if name.endswith("q_proj.weight") else n_kv_head if name.endswith("k_proj.weight") else None
            rows = (lambda x, h=heads: unpermute_rope_rows(x, h)) if heads and spec.paired_rope_rows else None
            pieces = [(name, rows)]
        kind = t.tensor_type.name
        if kind in BLOCK_KINDS and t.data.ndim == 2:
            b = read(t.data, kind)
            for name, rows in pieces:
                blocks.update(blocks_state(name, b if rows is None else b.map_rows(rows)))
                kinds[name] = kind
            continue
        weight = _dequantised(t, path)
        for name, rows in pieces:
            tensors[name] = (weight if rows is None else rows(weight)).to(dtype).contiguous()
            kinds[name] = kind
    return tensors, blocks, kinds


def _read_experts(t, template: str, path: Path, dtype: torch.dtype, into: tuple[dict, dict, dict]) -> None:
    """A stacked experts tensor [E, rows, columns] as expert e's weight `template.format(e=e)`: its blocks, or its
    floats in `dtype`, as any other weight's."""
    tensors, blocks, kinds = into
    kind = t.tensor_type.name
    floats = None if kind in BLOCK_KINDS else _dequantised(t, path)
    for e in range(t.data.shape[0]):
        name = template.format(e=e)
        if floats is None:
            blocks.update(blocks_state(name, read(t.data[e], kind)))
        else:
            tensors[name] = floats[e].to(dtype).contiguous()
        kinds[name] = kind


def _dequantised(t, path: Path) -> torch.Tensor:
    try:
        array = dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise FastspecError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, which gguf {version('gguf')} "
                            "cannot dequantise: not supported") from None
    return torch.from_numpy(np.array(array, dtype=np.float32))  # a copy: F32 data is a read-only mmap
