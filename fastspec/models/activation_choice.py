"""The per-machine choice of the 4-bit CPU kernel's activations (`fast_activation`) and of the float dtype the
float weights beside 4-bit ones are kept in (`float_dtype`): measured once per process, as CPUs with bf16
instructions and AVX2-only ones rank the candidates in opposite orders.
"""

from __future__ import annotations

import functools
import time

import torch

from fastspec.kernels import cpu_library
from fastspec.models.gguf_blocks import Blocks
from fastspec.models.packed_layers import int4_linear


def fast_activation() -> torch.dtype:
    """The activations of the fastest 4-bit CPU matmul on this machine: torch.int16 (fastspec's kernel, where the C
    library builds), torch.bfloat16 or torch.float32 (torch's int4 kernel; bfloat16 is about 10x faster than float32
    where the CPU has bf16 instructions, slower where it is emulated). Measured once per process, see `_seconds`."""
    candidates = (torch.bfloat16, torch.float32, *((torch.int16,) if cpu_library.available() else ()))
    return min(candidates, key=_seconds)


def float_dtype(activation: torch.dtype) -> torch.dtype:
    """The dtype float weights next to 4-bit ones are kept in (CastLinear, a draft head): the activation dtype itself
    where it is a float one, else the faster of bfloat16 and float32 for torch's int4 kernel (a proxy for whether
    this CPU has bf16 instructions)."""
    if activation.is_floating_point:
        return activation
    return min((torch.bfloat16, torch.float32), key=_seconds)


@functools.cache
def _seconds(activation: torch.dtype, reps: int = 16) -> float:
    """One token through a [1536, 576] 4-bit weight with `activation`: the fastest of `reps` calls on one thread (a
    busy second core would stall a 2-thread call), ~20 ms."""
    q = torch.randint(0, 16, (1536, 576), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    blocks = Blocks(q, torch.full((1536, 18), 0.01), torch.zeros(1536, 18), 4)
    linear, x = int4_linear(blocks, activation), torch.randn(1, 576)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        linear(x)  # warm-up
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            linear(x)
            times.append(time.perf_counter() - start)
        return min(times)
    finally:
        torch.set_num_threads(threads)
