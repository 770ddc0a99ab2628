"""How many threads torch's CPU ops use: `--threads N`, or 0 = auto (every core no other process keeps busy).

torch runs one OpenMP thread per core. When another process keeps a core busy, every parallel op waits at its
barrier for the thread sharing that core, and the small ops of a decode step become much slower (one thread
beats every core beside a spinning process; bench/bench_threads.py measures both). So auto measures the machine's
load at start-up (/proc/stat read twice, 0.2 s apart, while this process waits) and leaves out the cores others
keep busy. Timing matmuls at both counts instead picks wrongly: single small matmuls flip-flop run to run.
The reading is taken once per process (the first command or `fastspec.LLM`), so later engines agree with it.
fastspec's C kernels share torch's OpenMP runtime, so the count governs them too.
"""

from __future__ import annotations

import functools
import os
import time

import torch

from fastspec.errors import FastspecError

ALL = torch.get_num_threads()  # torch's own default (every core, or OMP_NUM_THREADS), before anyone changes it
SAMPLE_S = 0.2


def apply_threads(requested: int, name: str = "--threads") -> int:
    """Set torch's thread count: `requested` >= 1, or 0 = auto (see auto_threads); returns the count in use."""
    if not isinstance(requested, int) or isinstance(requested, bool) or requested < 0:
        raise FastspecError(f"{name} must be >= 1, or 0 for auto, got {requested!r}")
    if requested == 0:
        requested = auto_threads()
    torch.set_num_threads(requested)
    return requested


@functools.cache
def auto_threads() -> int:
    """Every core (torch's default) less the cores other processes keep busy right now; at least one."""
    before = _cpu_times()
    if before is None:  # not Linux: no cheap load reading
        return ALL
    time.sleep(SAMPLE_S)
    return threads_for_load(ALL, busy_cores(before, _cpu_times(), os.cpu_count() or ALL))


def busy_cores(before: list[int], after: list[int], cores: int) -> float:
    """Cores busy over the interval between two /proc/stat `cpu` lines (user nice system idle iowait irq softirq
    steal ...): everything but idle and iowait, steal included (the hypervisor gave that time to someone else)."""
    delta = [a - b for a, b in zip(after, before)]
    total = sum(delta[:8])
    return 0.0 if total <= 0 else cores * (total - delta[3] - delta[4]) / total


def threads_for_load(all_threads: int, busy: float) -> int:
    """E.g. 2 threads beside 0.97 busy cores -> 1; on a quiet machine (0.05 busy) -> 2."""
    return max(1, all_threads - round(busy))


def _cpu_times() -> list[int] | None:
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    return [int(v) for v in fields[1:9]] if fields and fields[0] == "cpu" else None
