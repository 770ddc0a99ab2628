"""CPU linear layers over MKL-prepacked weights for the few row counts a speculative round uses.

Why: torch's CPU GEMM packs the weight on every call, so a linear over a handful of rows (a verify of 8 tree
tokens, a draft step over bs*topk rows) costs several one-row GEMVs, while over a weight packed once for exactly
that row count it costs little more than one (MKL's packed GEMM is per row count; any other count falls back to
the plain linear). Applied after loading, on CPU in float32, for eager and compiled
round functions alike: inside a compiled graph the packed GEMM is the custom op `fastspec::packed_linear`
(Inductor's own MKL lowering packs only frozen weights, and freezing would bake the weights into the graph and its
cache key). Each packed row count costs one more copy of the weights.
Owns the module swap (the models stay plain nn.Linear math) and two host facts its callers need: whether bf16
GEMMs are fast on this CPU, and handing freed weight copies back to the OS.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import time

import torch
import torch.nn.functional as F
from torch import nn


def can_prepack(device: str, dtype: torch.dtype) -> bool:
    return (device == "cpu" and dtype == torch.float32 and torch.backends.mkl.is_available()
            and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))


@functools.cache
def bf16_matmul_is_faster(rows: int = 512, width: int = 576, out: int = 1536, reps: int = 4) -> bool:
    """Whether a bfloat16 GEMM beats float32 on this CPU, measured once per process (~0.1 s).

    CPUs with AMX or AVX512-BF16 run bf16 faster than float32; AVX2-only CPUs emulate it several times slower,
    so bf16 autocast must be a measured choice."""
    def seconds(dtype: torch.dtype) -> float:
        x, w = torch.randn(rows, width, dtype=dtype), torch.randn(out, width, dtype=dtype)
        F.linear(x, w)  # warm-up: oneDNN picks and caches its kernel
        start = time.perf_counter()
        for _ in range(reps):
            F.linear(x, w)
        return time.perf_counter() - start

    return seconds(torch.bfloat16) < seconds(torch.float32)


class PackedLinear(nn.Module):
    """y = x @ W.T (+ b); inputs of a prepacked row count use MKL's packed GEMM, others F.linear (inference)."""

    gemm_kernel = "MKL packed GEMM (prepacked row counts), else F.linear"

    def __init__(self, linear: nn.Linear, rows: tuple[int, ...]):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # shared, not copied
        w = linear.weight.detach()
        self.packed = {m: torch.ops.mkl._mkl_reorder_linear_weight(w, m) for m in rows}  # rows -> packed W

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., in] -> [..., out]
        flat = x.reshape(-1, self.in_features)
        packed = self.packed.get(flat.shape[0])
        if packed is None:
            return F.linear(x, self.weight, self.bias)
        gemm = packed_linear if torch.compiler.is_compiling() else torch.ops.mkl._mkl_linear
        y = gemm(flat, packed, self.weight, self.bias, flat.shape[0])
        return y.view(*x.shape[:-1], self.out_features)


@torch.library.custom_op("fastspec::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  rows: int) -> torch.Tensor:
    """MKL's packed GEMM as an opaque op for torch.compile: x [rows, in] @ weight.T (+ bias) -> [rows, out]."""
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)


@packed_linear.register_fake
def _(x, packed, weight, bias, rows):
    return x.new_empty(x.shape[0], weight.shape[0])


def prepack_linears(model: nn.Module, rows: tuple[int, ...]) -> nn.Module:
    """Make every linear of `model` (in place) packed for exactly these row counts (dropping other packs),
    then hand the dropped packs' memory back to the OS (`fastspec tune` repacks for every shape it times)."""
    _prepack(model, tuple(sorted({m for m in rows if m > 1})))  # one row is a GEMV: nothing to gain
    trim_host_heap()
    return model


def _prepack(model: nn.Module, rows: tuple[int, ...]) -> None:
    for name, child in list(model.named_children()):
        if isinstance(child, PackedLinear):
            w = child.weight.detach()
            child.packed = {m: child.packed[m] if m in child.packed else torch.ops.mkl._mkl_reorder_linear_weight(w, m)
                            for m in rows}
        elif isinstance(child, nn.Linear):
            if rows:
                setattr(model, name, PackedLinear(child, rows))
        else:
            _prepack(child, rows)


def trim_host_heap() -> None:
    """Return freed heap memory to the OS (glibc's malloc_trim; a no-op elsewhere).

    Why: after the first large free glibc raises its mmap threshold (up to 32 MB), so later weight-sized blocks
    (packed linears, a dropped engine's layers) come from the heap and stay resident after they are freed."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _libc():
    name = ctypes.util.find_library("c")
    lib = ctypes.CDLL(name) if name else None
    return lib if lib is not None and hasattr(lib, "malloc_trim") else None


_LIBC = _libc()
