"""How many threads torch's CPU ops use: `--threads N`, or 0 = auto (every core, torch's default).

torch runs one OpenMP thread per core. When another process keeps a core busy, every parallel op waits at its
barrier for the thread sharing that core, and the small ops of a decode step become much slower: measured by
bench/bench_threads.py on a 2-core VM, one thread decodes 2.5x faster than two beside a spinning process, and
0.89x as fast on a quiet machine, so auto keeps every core and `--threads 1` is the advice beside a busy job. A
start-up probe (timing decode-sized matmuls at both counts) picked wrongly in both conditions there, so auto
does not probe (the bench keeps the probe and its picks as evidence).
"""

from __future__ import annotations

import torch

from fastspec.errors import FastspecError

ALL = torch.get_num_threads()  # torch's own default (every core, or OMP_NUM_THREADS), before anyone changes it


def apply_threads(requested: int, device: str) -> int:
    """Set torch's thread count: `requested` >= 1, or 0 = auto (every core); returns the count in use."""
    if requested < 0:
        raise FastspecError(f"--threads must be >= 1, or 0 for auto, got {requested}")
    if requested == 0:
        requested = ALL
    torch.set_num_threads(requested)
    return requested
