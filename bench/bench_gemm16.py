"""fastspec's row-invariant 16-bit GEMM (fastspec.kernels.cpu_gemm16) against torch's F.linear in the same dtype, at
the embedded model's projection shapes and lm_head, over the row counts of a decode step, a verify, a draft step and
a prefill chunk; and whether each gives row M - 1 of an M-row product what it gives the row alone (M up to 70).

    .venv/bin/python bench/bench_gemm16.py [--rows 1,4,16,64,512] [--dtypes bfloat16,float16] [--trials 9]

Random weights and rows; trials alternate between the two; medians, in microseconds. Writes
bench/results/gemm16.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import bench_packed
import torch
import torch.nn.functional as F

from fastspec.kernels import cpu_library
from fastspec.kernels.cpu_gemm16 import gemm16

SHAPES = {**dict(zip(("qkv", "o", "gate_up", "down"), bench_packed.SHAPES)), "lm_head": (49152, 576)}  # (N, K)
RESULTS = Path(__file__).parent / "results" / "gemm16.json"


def variant_rows(fn, x: torch.Tensor, w: torch.Tensor) -> list[int]:
    """The row counts M at which fn's row M - 1 among M rows differs from that row alone."""
    return [m for m in range(2, x.shape[0] + 1) if not torch.equal(fn(x[:m], w)[m - 1], fn(x[m - 1:m], w)[0])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,16,64,512")
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--trials", type=int, default=9)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if cpu_library.library() is None:
        raise SystemExit("no C compiler: the CPU kernels are not built here")
    gen, results = torch.Generator().manual_seed(0), []
    ours = lambda x, w: gemm16(x, w)  # noqa: E731
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, generator=gen).to(dtype)
            probe = torch.randn(70, k, generator=gen).to(dtype)
            variant = {"torch": variant_rows(F.linear, probe, w), "fastspec": variant_rows(ours, probe, w)}
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, generator=gen).to(dtype)
                times = {"torch": [], "fastspec": []}
                for _ in range(args.trials):
                    for label, fn in (("torch", F.linear), ("fastspec", ours)):
                        start = time.perf_counter()
                        fn(x, w)
                        times[label].append(time.perf_counter() - start)
                us = {label: 1e6 * statistics.median(t) for label, t in times.items()}
                results.append(dict(dtype=str(dtype).removeprefix("torch."), shape=name, n=n, k=k, rows=m,
                                    torch_us=round(us["torch"], 1), fastspec_us=round(us["fastspec"], 1),
                                    torch_variant_rows=variant["torch"], fastspec_variant_rows=variant["fastspec"]))
                print(f"{results[-1]['dtype']:8s} {name:8s} [{n:5d}, {k:4d}] x {m:4d} rows  torch {us['torch']:9.1f} us"
                      f"  fastspec {us['fastspec']:9.1f} us  ({us['torch'] / us['fastspec']:.2f}x)"
                      f"  row-variant M: torch {variant['torch'][:6]} fastspec {variant['fastspec'][:6]}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(dict(threads=torch.get_num_threads(), results=results), indent=1) + "\n")


if __name__ == "__main__":
    main()
