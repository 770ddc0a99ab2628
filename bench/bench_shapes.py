"""Tree shapes at batch 1 against plain decoding, end to end, on the embedded model and its EAGLE-3 head: what the
CPU default tree (fastspec.spec_config._AUTO_SPEC_CPU) is chosen by.

    .venv/bin/python bench/bench_shapes.py [--shapes 5,4,8 --shapes 3,2,4 ...] [--trials 3] [--max-new-tokens 96]
        [--output bench/results/shapes.json]

One process, one engine per shape (no tuned file, no measured fallback: every round speculates), four chat
questions of bench_chat.py, greedy, `max_new_tokens` each; engines alternate within each trial and the median
over trials of ms per token (prefill included) is reported with the ratio to plain decoding, the mean tau and
the median round time. Prints a markdown table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import fastspec
from bench_chat import QUESTIONS as CHAT_QUESTIONS  # this directory: scripts run as `python bench/...`
from fastspec.sampling import SamplingParams

MODEL = "smollm2-135m-instruct"
QUESTIONS = CHAT_QUESTIONS[:4]
SHAPES = ["5,4,8", "4,2,6", "3,2,4", "3,1,4", "2,2,3", "2,1,3"]


def engine(shape: str) -> fastspec.LLM:
    if shape == "NONE":
        return fastspec.LLM(model=MODEL, speculative_algorithm="NONE", tuned=False)
    steps, topk, n = map(int, shape.split(","))
    return fastspec.LLM(model=MODEL, speculative_algorithm="EAGLE3", num_steps=steps, topk=topk,
                        num_draft_tokens=n, tuned=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", action="append", help="num_steps,topk,num_draft_tokens (repeat)")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "shapes.json")
    args = parser.parse_args()
    llms = {shape: engine(shape) for shape in ["NONE", *(args.shapes or SHAPES)]}
    prompts = [llms["NONE"].encode(q, chat=True) for q in QUESTIONS]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    for llm in llms.values():
        llm.generate(prompts[:1], params)  # warm-up
    ms = {s: [] for s in llms}
    taus = {s: [] for s in llms}
    rounds = {s: [] for s in llms}
    for _ in range(args.trials):
        for shape, llm in llms.items():
            times = llm.engine.worker.times
            times.reset()
            start = time.perf_counter()
            for prompt in prompts:
                out = llm.generate([prompt], params)[0]
                taus[shape].append(out.metrics.tau)
            ms[shape].append((time.perf_counter() - start) / (len(prompts) * args.max_new_tokens) * 1e3)
            if times.counts.get("round"):
                rounds[shape].append(times.split()["round"] / times.counts["round"] * 1e3)
    plain = statistics.median(ms["NONE"])
    rows = [{"shape": s, "ms_per_token": statistics.median(ms[s]), "trials": ms[s],
             "vs_plain": plain / statistics.median(ms[s]), "tau": statistics.mean(taus[s]),
             "round_ms": statistics.median(rounds[s]) if rounds[s] else None} for s in llms]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"model": MODEL, "max_new_tokens": args.max_new_tokens, "rows": rows},
                                      indent=1))
    print("| tree | ms / token | vs plain | tau | round ms |\n|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['ms_per_token']:.1f} | {r['vs_plain']:.2f}x | {r['tau']:.2f} | "
              + (f"{r['round_ms']:.1f} |" if r["round_ms"] else "- |"))


if __name__ == "__main__":
    main()
