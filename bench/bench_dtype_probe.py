"""The measurement behind `--dtype auto`'s rule on the CPU (a bfloat16 checkpoint stays bfloat16 where the CPU has
AVX512-BF16): how much faster a decode step's one-row product through fastspec's GEMM runs over bfloat16 / float16
weights than over float32's, at the gate_up shape [2 x intermediate, hidden] of a few models, measured several times
to show how far the figure moves (run it on a quiet machine: a busy one measures anything, which is why the rule
reads the CPU's flags rather than timing at start-up).

    .venv/bin/python bench/bench_dtype_probe.py [--repeats 3]

Each figure: the median over 9 rounds of float32's time over the 16-bit one's, each the best of 3 runs, alternating.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fastspec.kernels import cpu_library
from fastspec.kernels.cpu_row_gemm import row_gemm

SHAPES = {"SmolLM2-135M": (3072, 576), "Qwen2.5-1.5B": (17920, 1536), "Llama-3-8B": (28672, 4096)}


def speedup(dtype: torch.dtype, rows: int, cols: int, rounds: int = 9, runs: int = 3) -> float:
    rows = min(rows, (1 << 24) // cols)  # at most 16M weights (64 MB as float32): past the caches
    ops = {d: (torch.full((1, cols), 0.5, dtype=d), torch.full((rows, cols), 0.01, dtype=d))
           for d in (torch.float32, dtype)}
    for x, w in ops.values():
        row_gemm(x, w)
    ratios = []
    for _ in range(rounds):
        best = {}
        for d, (x, w) in ops.items():
            best[d] = float("inf")
            for _ in range(runs):
                start = time.perf_counter()
                row_gemm(x, w)
                best[d] = min(best[d], time.perf_counter() - start)
        ratios.append(best[torch.float32] / best[dtype])
    return statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"fastspec's GEMM library: {'built' if cpu_library.available() else 'missing'}; "
          f"bfloat16 dot products (AVX512-BF16): {cpu_library.has_bf16_dot()}")
    for dtype in (torch.bfloat16, torch.float16):
        for name, (rows, cols) in SHAPES.items():
            runs = [speedup(dtype, rows, cols) for _ in range(args.repeats)]
            print(f"{str(dtype)[6:]:9s} {name:13s} [{rows}, {cols}]: " + " ".join(f"{r:.2f}x" for r in runs))


if __name__ == "__main__":
    main()
