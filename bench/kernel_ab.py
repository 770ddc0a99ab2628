"""The int16-activation block GEMMs (kernels/cpu_q4.c, cpu_q8.c) of a git revision against the working tree's, on this
CPU at the embedded model's shapes: both libraries built from their sources (-march=native), their outputs compared
bit for bit, then trials interleaved between them (a noisy 2-core box moves both alike), min and median ms per token's
linears (30 layers + lm_head, weights streamed from memory as in bench_packed.py).

    .venv/bin/python bench/kernel_ab.py REV [--bits 4|8] [--rows 1,4,8] [--threads 1,2] [--trials 9]

Prints one line per (threads, rows): same / differ, each side's min and median, and new / old (of the mins).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench_packed import HIDDEN, INTERMEDIATE, LAYERS, SHAPES, VOCAB, q4_1
from fastspec.kernels import cpu_library, cpu_q4
from fastspec.models.gguf_blocks import Blocks, as_8bit_16
from fastspec.models.packed_layers import BlockLinear


def build(rev: str | None, work: Path) -> ctypes.CDLL:
    """The C library from revision `rev`'s kernel sources (None: the working tree's), built into `work`."""
    sources = work / (rev or "tree")
    sources.mkdir()
    for f in (*cpu_library.SOURCES, *cpu_library.HEADERS):
        text = f.read_text() if rev is None else subprocess.run(
            ["git", "show", f"{rev}:fastspec/kernels/{f.name}"], capture_output=True, text=True, check=True).stdout
        (sources / f.name).write_text(text)
    own = cpu_library.SOURCES
    cpu_library.SOURCES = tuple(sources / f.name for f in own)
    try:
        cpu_library._build(sources / "lib.so")
    finally:
        cpu_library.SOURCES = own
    return cpu_library._typed(ctypes.CDLL(str(sources / "lib.so")))


def weights(bits: int) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """(N, K, packed, scales) of every linear of a token: 30 layers of random Q4_1 weights and the lm_head."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for n, k in SHAPES * LAYERS + [(VOCAB, HIDDEN)]:
        b = q4_1(n, k, gen)
        b = Blocks(b.q.to(torch.uint8), b.scale, b.offset, 4)
        linear = BlockLinear.from_blocks(b if bits == 4 else as_8bit_16(b))
        out.append((n, k, linear.packed, linear.scales))
    return out


def token(lib: ctypes.CDLL, linears, rows: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    xs = {k: torch.randn(rows, k, generator=gen) for k in (HIDDEN, INTERMEDIATE)}
    ys = []
    for n, k, packed, scales in linears:
        y = torch.empty(rows, n)
        lib.block_gemm(xs[k].data_ptr(), rows, k, packed.data_ptr(), scales.data_ptr(), n, y.data_ptr(),
                       cpu_q4.bits(packed), cpu_q4.weight_group(packed, scales), None)
        ys.append(y)
    return ys


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("rev")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--trials", type=int, default=9)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        libs = {"old": build(args.rev, Path(work)), "new": build(None, Path(work))}
        linears = weights(args.bits)
        for threads in map(int, args.threads.split(",")):
            torch.set_num_threads(threads)
            for rows in map(int, args.rows.split(",")):
                outs = [token(lib, linears, rows) for lib in libs.values()]
                same = all(torch.equal(a, b) for a, b in zip(*outs))
                times = {name: [] for name in libs}
                for _ in range(args.trials):
                    for name, lib in libs.items():
                        start = time.perf_counter()
                        token(lib, linears, rows)
                        times[name].append(1000 * (time.perf_counter() - start))
                print(f"{args.bits}-bit threads {threads} rows {rows}: {'same' if same else 'DIFFER'}  " + "  ".join(
                    f"{name} min {min(t):.2f} med {statistics.median(t):.2f} ms" for name, t in times.items())
                    + f"  new/old {min(times['new']) / min(times['old']):.2f}", flush=True)


if __name__ == "__main__":
    main()
