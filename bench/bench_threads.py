"""Why `--threads auto`: plain decoding tok/s on the embedded model with every core vs one thread, on a quiet
machine and beside a busy process (one core kept spinning), what auto (the load other processes put on the cores,
from /proc/stat) picks in each case, and what a dropped start-up probe (decode-sized matmul timings) picked.

    .venv/bin/python bench/bench_threads.py [--max-new-tokens 32] [--trials 3]

Greedy, batch 1, EOS ignored; the two thread counts alternate within every trial, the median tok/s is reported.
The busy process is a Python loop spinning on one core for the whole condition. Writes
bench/results/threads.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from pathlib import Path

import torch

import fastspec
from fastspec.sampling import SamplingParams
from fastspec.utils import threads


def probe_pick(hidden: int = 576, inner: int = 1536, reps: int = 40, rounds: int = 3) -> int:
    """threads.ALL or 1, whichever runs a [1, hidden] x [hidden, inner] matmul loop (one decode MLP of the embedded
    model) faster right now: the median of `rounds` alternating timings of `reps` matmuls each."""
    x, w = torch.randn(1, hidden), torch.randn(hidden, inner)
    times = {threads.ALL: [], 1: []}
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
        torch.set_num_threads(threads.ALL)
    return min(times, key=lambda n: statistics.median(times[n]))


def spin() -> None:
    while True:
        pass


def tok_s(llm, ids, params) -> float:
    start = time.perf_counter()
    out = llm.engine.generate([ids], [params])[0]
    return len(out.output_ids) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    llm = fastspec.LLM(speculative_algorithm="NONE", max_total_tokens=2048, radix_cache=False)
    ids = llm.encode("Write a short story about a lighthouse keeper.", chat=True)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    results = []
    for condition in ("quiet", "one core busy"):
        busy = multiprocessing.Process(target=spin, daemon=True) if condition != "quiet" else None
        if busy:
            busy.start()
            time.sleep(0.5)
        rates = {threads.ALL: [], 1: []}
        for n in rates:  # warm-up
            torch.set_num_threads(n)
            tok_s(llm, ids, SamplingParams(max_new_tokens=4, ignore_eos=True))
        for _ in range(args.trials):
            for n in rates:
                torch.set_num_threads(n)
                rates[n].append(tok_s(llm, ids, params))
        auto, probe = threads.auto_threads(), probe_pick()
        if busy:
            busy.terminate()
        median = {n: statistics.median(r) for n, r in rates.items()}
        row = {"condition": condition, "tok_s": {f"{n} threads": round(v, 2) for n, v in median.items()},
               "one_thread_vs_all": round(median[1] / median[threads.ALL], 2), "auto_picks": auto,
               "dropped_matmul_probe_picks": probe}
        results.append(row)
        print(json.dumps(row))
    torch.set_num_threads(threads.ALL)
    out = Path(__file__).parent / "results" / "threads.json"
    out.write_text(json.dumps({"cores": threads.ALL, "max_new_tokens": args.max_new_tokens, "trials": args.trials,
                               "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
