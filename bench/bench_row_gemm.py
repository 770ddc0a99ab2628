"""fastspec's row-invariant GEMM (fastspec.kernels.cpu_row_gemm) against torch's F.linear in the same dtype (and, in
float32, MKL's GEMM prepacked for the row count, fastspec.kernels.cpu_linear, what float32 linears ran before), at the
embedded model's projection shapes and lm_head, over the row counts of a decode step, a verify, a draft step and a
prefill chunk; and at which row counts M each gives row M - 1 of an M-row product otherwise than the row alone (M up
to 70).

    .venv/bin/python bench/bench_row_gemm.py [--rows 1,4,16,64,512] [--dtypes float32,bfloat16,float16] [--trials 9]

Random weights and rows; trials alternate between the kernels; medians, in microseconds. Writes
bench/results/row_gemm.json.
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
from torch import nn

from fastspec.kernels import cpu_library
from fastspec.kernels.cpu_linear import PackedLinear
from fastspec.kernels.cpu_row_gemm import row_gemm

SHAPES = {**dict(zip(("qkv", "o", "gate_up", "down"), bench_packed.SHAPES)), "lm_head": (49152, 576)}  # (N, K)
RESULTS = Path(__file__).parent / "results" / "row_gemm.json"


def variant_rows(fn, x: torch.Tensor) -> list[int]:
    """The row counts M at which fn's row M - 1 among M rows differs from that row alone."""
    return [m for m in range(2, x.shape[0] + 1) if not torch.equal(fn(x[:m])[m - 1], fn(x[m - 1:m])[0])]


def kernels(w: torch.Tensor, rows: int) -> dict:
    """name -> x -> y: torch's F.linear, fastspec's, and in float32 MKL's prepacked for `rows` rows."""
    fns = {"torch": lambda x: F.linear(x, w), "fastspec": lambda x: row_gemm(x, w)}
    if w.dtype == torch.float32 and rows > 1:
        linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.data = w
        fns["mkl_packed"] = PackedLinear(linear, (rows,))
    return fns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,16,64,512")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--trials", type=int, default=9)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if cpu_library.library() is None:
        raise SystemExit("no C compiler: the CPU kernels are not built here")
    gen, results = torch.Generator().manual_seed(0), []
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, generator=gen).to(dtype)
            probe = torch.randn(70, k, generator=gen).to(dtype)
            variant = {label: variant_rows(fn, probe) for label, fn in kernels(w, 1).items()}
            for m in (int(r) for r in args.rows.split(",")):
                x, fns = torch.randn(m, k, generator=gen).to(dtype), kernels(w, m)
                times = {label: [] for label in fns}
                for _ in range(args.trials):
                    for label, fn in fns.items():
                        start = time.perf_counter()
                        fn(x)
                        times[label].append(time.perf_counter() - start)
                us = {label: round(1e6 * statistics.median(t), 1) for label, t in times.items()}
                results.append(dict(dtype=str(dtype).removeprefix("torch."), shape=name, n=n, k=k, rows=m, us=us,
                                    variant_rows=variant))
                print(f"{results[-1]['dtype']:8s} {name:8s} [{n:5d}, {k:4d}] x {m:4d} rows  "
                      + "  ".join(f"{label} {t:8.1f} us" for label, t in us.items())
                      + f"  (torch / fastspec {us['torch'] / us['fastspec']:.2f}x)  row-variant M: "
                      + ", ".join(f"{label} {rows[:5]}" for label, rows in variant.items()))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(dict(threads=torch.get_num_threads(), results=results), indent=1) + "\n")


if __name__ == "__main__":
    main()
