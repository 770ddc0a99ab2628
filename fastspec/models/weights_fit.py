"""Whether a checkpoint's weights fit in memory, from its files alone (no tensor is read): the bytes they take in a
dtype (`check_weights_fit`: one line before loading) and --dtype auto decided with them (`resolve_model_dtype`).
Does not own: finding or checking the checkpoints (sources.py)."""

from __future__ import annotations

import math
from pathlib import Path

from fastspec.config import resolve_dtype
from fastspec.errors import FastspecError, first_line
from fastspec.models.loader import weight_files
from fastspec.models.model_config import ModelConfig
from fastspec.models.quant_config import QuantScheme
from fastspec.models.sources import ModelSources


def resolve_model_dtype(dtype: str, device: str, sources: ModelSources) -> str:
    """--dtype with auto decided for these models (config.resolve_dtype). On the CPU a float checkpoint stored in
    bfloat16 keeps its dtype where fastspec's GEMM multiplies it with the CPU's bfloat16 dot products (AVX512-BF16,
    AMX: half the bytes a decode step reads, 1.6-2.0x float32's one-row product by bench/bench_dtype_probe.py on an
    EPYC with them), and any 16-bit checkpoint keeps its dtype where a float32 copy would not fit in memory; else, and
    for quantised or dequantised weights (float32: the exact reference), float32. Without bfloat16 dot products the
    GEMM widens 16-bit weights to float32 first, a gain over float32 that varies by CPU (bench/bench_dtype_probe.py
    measures it; --dtype bfloat16 takes it): float32 stays their default. Decided by the CPU's flags, not timed at
    start-up: a busy machine measures anything."""
    stored = sources.config.torch_dtype
    if (dtype != "auto" or device != "cpu" or stored not in ("bfloat16", "float16") or sources.scheme is not None
            or sources.quantization is not None):
        return resolve_dtype(dtype, device, stored)
    from fastspec.kernels import cpu_library
    from fastspec.memory.kv_pool import available_bytes

    if _need(sources.model_dir, sources.config, None, "float32") > 0.8 * available_bytes("cpu"):
        return stored  # float32 would not fit (with room left for the KV cache)
    return stored if stored == "bfloat16" and cpu_library.has_bf16_dot() else "float32"


def check_weights_fit(sources: ModelSources, dtype: str, device: str) -> None:
    """A target whose weights cannot fit in the memory `device` has free: one line before loading (it would be
    killed for memory midway on a CPU, or fail in torch on a GPU). The need is the checkpoint's bytes and its
    draft's, scaled to `dtype` for float weights (an online quantisation holds them in it first), a lower bound for
    quantised ones."""
    from fastspec.memory.kv_pool import available_bytes

    need = _need(sources.model_dir, sources.config, sources.scheme, dtype, sources.quantization is None)
    drafted = sources.draft_dir not in (None, sources.model_dir)  # (an MTP draft is the target's own checkpoint)
    if drafted:
        need += _need(sources.draft_dir, sources.draft_config, sources.draft_scheme, dtype,
                      sources.draft_quantization is None)
    free = available_bytes(device)
    if need > free:
        hint = ("pass --dtype bfloat16 (--quantization int8 / int4 rounds the weights after loading them in --dtype)"
                if dtype == "float32" else "use a quantised checkpoint (GGUF, GPTQ, AWQ: loaded as stored)")
        raise FastspecError(f"{sources.model_dir}{' and its draft' if drafted else ''}: the weights need "
                            f"{need / 2**30:.1f} GiB as {dtype} and {device} has {free / 2**30:.1f} GiB free; {hint}, "
                            "or free memory")


def _need(directory: Path, config: ModelConfig, scheme: QuantScheme | None, dtype: str,
          dequantised: bool = False) -> int:
    """The bytes `directory`'s weights take loaded in `dtype`: a float checkpoint's scaled from the dtype its tensors
    are stored in, a quantised one's as stored (a lower bound) or, `dequantised` (--quantization none), each of its
    values in `dtype`."""
    if scheme is not None and not dequantised:
        return _stored_bytes(directory)
    shapes = _headers(directory)
    if scheme is not None and shapes is not None:
        # int32 words hold 32 / bits values (GPTQ / AWQ / compressed-tensors packing; their packed zero points and
        # g_idx are counted alike: a group's share too many); every other element one value
        return sum(math.prod(shape) * (32 // scheme.bits if code == "I32" else 1)
                   for code, shape in shapes) * _ITEMSIZE[dtype]
    need, stored = _stored_bytes(directory), _stored_dtype(shapes, config)
    return need * _ITEMSIZE[dtype] // _ITEMSIZE[stored] if scheme is None and stored in _ITEMSIZE else need


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def _headers(model_dir: Path) -> list[tuple[str, list[int]]] | None:
    """(dtype code, shape) of each tensor in `model_dir`'s *.safetensors, from their headers; None for .bin files."""
    from safetensors import safe_open

    files = weight_files(model_dir)
    if not files or files[0].suffix != ".safetensors":
        return None
    shapes = []
    for path in files:
        try:
            with safe_open(str(path), "pt") as handle:
                shapes += [(s.get_dtype(), s.get_shape()) for s in map(handle.get_slice, handle.keys())]
        except Exception as e:  # (a download cut short: the loader's line, before it; no common error class)
            raise FastspecError(f"{path}: corrupt or truncated weights file ({first_line(e, None)})") from None
    return shapes


def _stored_dtype(shapes: list | None, config: ModelConfig) -> str | None:
    """The float dtype most of the checkpoint's values are stored in: config.json's torch_dtype may disagree with
    the tensors (an fp16 export whose config says float32 would be counted at twice its size); config's where the
    headers can't say."""
    values: dict[str, int] = {}
    for code, shape in shapes or ():
        values[code] = values.get(code, 0) + math.prod(shape)
    return _SAFETENSORS_DTYPES.get(max(values, key=values.get), config.torch_dtype) if values else config.torch_dtype


def _stored_bytes(model_dir: Path) -> int:
    """The bytes of the weight files the loader reads: *.safetensors (else pytorch_model*.bin), and a converted
    GGUF's blocks' quants (the packed kernels hold at least those; the blocks file's float32 scales and offsets are
    repacked smaller, so its size would overstate them)."""
    return sum(f.stat().st_size for f in weight_files(model_dir)) + _block_quant_bytes(model_dir)


def _block_quant_bytes(model_dir: Path) -> int:
    from safetensors import safe_open

    from fastspec.models.gguf_blocks import BLOCKS_FILE

    if not (model_dir / BLOCKS_FILE).is_file():
        return 0
    with safe_open(str(model_dir / BLOCKS_FILE), "pt") as blocks:  # (the header only: 1-byte quants, 4-bit packed)
        return sum(math.prod(blocks.get_slice(k).get_shape()) for k in blocks.keys() if k.endswith(".q"))
