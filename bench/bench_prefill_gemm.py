"""The 4-bit CPU GEMM over a prefill's rows, on AMX tiles against the AVX-512 VNNI kernel, at the embedded model's
projection shapes (fused QKV, o, gate_up, down): what a long prompt's linears cost per layer on each, and that the two
give the same numbers bit for bit.

    .venv/bin/python bench/bench_prefill_gemm.py [--rows 2000] [--trials 9]

Random Q4_1 weights (bench_packed.q4_1) packed as BlockLinear packs them; the rows in one call, as
the layer stack makes it. Trials alternate between the kernels; medians. Without AMX (or where the kernel is refused
the tiles) only the VNNI column is measured. Writes bench/results/prefill_gemm.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import bench_packed
import torch

from fastspec.kernels import cpu_library, cpu_q4
from fastspec.models.packed_layers import BlockLinear

SHAPES = dict(zip(("qkv", "o", "gate_up", "down"), bench_packed.SHAPES))  # name -> (N, K)
RESULTS = Path(__file__).parent / "results" / "prefill_gemm.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--trials", type=int, default=9)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    lib = cpu_library.library()
    if lib is None:
        raise SystemExit("no C compiler: the CPU kernels are not built here")
    kernels = ("amx", "vnni") if lib.amx_q4_enable(1) else ("vnni",)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        weight, x = BlockLinear.pack(bench_packed.q4_1(n, k, gen)), torch.randn(args.rows, k, generator=gen)
        times, outputs = {kernel: [] for kernel in kernels}, {}
        for _ in range(args.trials):
            for kernel in kernels:
                lib.amx_q4_enable(kernel == "amx")
                start = time.perf_counter()
                outputs[kernel] = cpu_q4.matmul(x, *weight)
                times[kernel].append(time.perf_counter() - start)
        lib.amx_q4_enable(1)
        same = all(torch.equal(outputs[kernel], outputs["vnni"]) for kernel in kernels)
        row = dict(shape=name, n=n, k=k, rows=args.rows, bit_for_bit=same)
        for kernel in kernels:
            ms = 1e3 * statistics.median(times[kernel])
            row[f"{kernel}_ms"], row[f"{kernel}_gflops"] = round(ms, 2), round(2 * args.rows * n * k / ms / 1e6, 1)
        rows.append(row)
        print(f"{name:8s} [{n}, {k}] x {args.rows} rows  " + "  ".join(
            f"{kernel} {row[f'{kernel}_ms']:7.2f} ms ({row[f'{kernel}_gflops']:6.1f} GFLOP/s)" for kernel in kernels)
            + ("" if len(kernels) == 1 else f"  {row['vnni_ms'] / row['amx_ms']:.2f}x") + f"  same: {same}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(dict(threads=torch.get_num_threads(), rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
