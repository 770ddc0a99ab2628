"""How many threads torch's CPU ops use: `--threads N`, or `auto` (the default), measured at start-up.

torch runs one OpenMP thread per core. When another process keeps a core busy, every parallel op waits at its
barrier for the thread sharing that core, and the small ops of a decode step (hundreds per token) become
10-40x slower; one thread is then much faster. On a quiet machine every core wins. `auto` times a decode-sized
matrix-vector loop with every core and with one thread (alternating, ~0.1 s) and keeps the faster, so a command
started beside a busy job does not crawl. The choice holds for the whole command: a load that starts later is
not seen (`--threads 1` pins it). GPU runs keep torch's default: their CPU side is host work, not math.
"""

from __future__ import annotations

import statistics
import time

import torch

from fastspec.errors import FastspecError

ALL = torch.get_num_threads()  # torch's own default (every core, or OMP_NUM_THREADS), before anyone changes it


def apply_threads(requested: int, device: str) -> int:
    """Set torch's thread count: `requested` >= 1, or 0 = auto (measured on CPU); returns the count in use."""
    if requested < 0:
        raise FastspecError(f"--threads must be >= 1, or 0 for auto, got {requested}")
    if requested == 0:
        requested = ALL if device != "cpu" or ALL == 1 else faster_thread_count()
    torch.set_num_threads(requested)
    return requested


def faster_thread_count(hidden: int = 576, inner: int = 1536, reps: int = 40, rounds: int = 3) -> int:
    """ALL or 1, whichever runs a [1, hidden] x [hidden, inner] matmul loop (one decode MLP of the embedded
    model) faster right now: the median of `rounds` alternating timings of `reps` matmuls each."""
    x, w = torch.randn(1, hidden), torch.randn(hidden, inner)
    times = {ALL: [], 1: []}
    try:
        for _ in range(rounds):
            for n in times:
                torch.set_num_threads(n)
                x @ w  # the pool spins up / down between settings
                start = time.perf_counter()
                for _ in range(reps):
                    x @ w
                times[n].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(ALL)
    return min(times, key=lambda n: statistics.median(times[n]))
