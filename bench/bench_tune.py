"""`fastspec tune` against a grid measured end to end, in one process, on the embedded SmolLM2-135M-Instruct
with its shipped EAGLE-3 head.

    .venv/bin/python bench/bench_tune.py [--batch-sizes 1,4,8] [--budget 600] [--max-new-tokens 96]

1. Runs the tuner (replay + measured costs + successive halving) and times it.
2. Measures a grid of shapes (chains of 1..6 steps; topk 2/4/8 x steps 2/4/6 x N 4/8/16; no speculation) end to end at each
   batch size on the same prompts and output length, alternating shapes, and reports the tuned choice's tok/s
   as a fraction of the grid's best, and replayed tau against the tau measured for the same shape.
Writes bench/results/tune.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import fastspec
from fastspec.config import SpecParams
from fastspec.models.embedded import DEFAULT_MODEL, embedded_head
from fastspec.prompts import load_prompts
from fastspec.tune.tuner import Candidate, TuneConfig, _run, tune

GRID = [SpecParams(s, 1, s + 1) for s in range(1, 7)] + [  # chains, then trees: a coarse but wide grid
    SpecParams(s, k, n) for k in (2, 4, 8) for s in (2, 4, 6) for n in (4, 8, 16) if n <= 1 + k + (s - 1) * k * k]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,4,8")
    ap.add_argument("--budget", type=float, default=600.0)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--output", default="bench/results/tune.json")
    args = ap.parse_args()
    sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    cfg = TuneConfig(batch_sizes=sizes, max_new_tokens=args.max_new_tokens, budget=args.budget)
    llm = fastspec.LLM(speculative_algorithm="EAGLE3", draft_model=str(embedded_head(DEFAULT_MODEL)), tuned=False,
                       num_steps=cfg.max_steps, topk=max(cfg.topks), num_draft_tokens=cfg.max_draft_tokens,
                       max_running_requests=max(sizes))
    prompts = [llm.encode(t, chat=True) for t in load_prompts("all", "train")[::37][:args.num_prompts]]
    start = time.perf_counter()
    result = tune(llm, prompts, cfg, say=print)
    tune_seconds = time.perf_counter() - start
    grid = GRID
    rows = []
    for bs in sizes:
        batch = [prompts[i % len(prompts)] for i in range(bs)]
        measured = {}
        for p in [None, *grid]:
            rate, tau = _run(llm, batch, Candidate(bs, p, 0.0, 0.0), cfg.max_new_tokens)
            measured[p] = (rate, tau)
            print(bs, p, round(rate, 2), round(tau, 3), flush=True)
        best = max(measured, key=lambda p: measured[p][0])
        chosen = result.winners[bs].params
        rows.append({"bs": bs, "chosen": _shape(chosen), "chosen_tok_s": measured[chosen][0],
                     "grid_best": _shape(best), "grid_best_tok_s": measured[best][0],
                     "chosen_vs_best": measured[chosen][0] / measured[best][0],
                     "plain_tok_s": measured[None][0], "chosen_vs_plain": measured[chosen][0] / measured[None][0],
                     "replayed_vs_measured_tau": {_shape(p): [round(result.taus[p], 3), round(measured[p][1], 3)]
                                                  for p in grid if p in result.taus},
                     "grid": {_shape(p): [round(v, 3) for v in measured[p]] for p in measured}})
    out = {"tune_seconds": round(tune_seconds, 1), "replay_seconds": round(result.replay_seconds, 1),
           "cost_seconds": round(result.cost_seconds, 1), "confirm_seconds": round(result.confirm_seconds, 1),
           "tiers": result.tiers(), "confirmed": [c.row() for c in result.confirmed], "per_batch_size": rows,
           "config": vars(args)}
    Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
    for r in rows:
        print(f"bs {r['bs']}: tuned {r['chosen']} {r['chosen_tok_s']:.1f} tok/s = {r['chosen_vs_best']:.1%} of "
              f"grid best {r['grid_best']} ({r['grid_best_tok_s']:.1f}); {r['chosen_vs_plain']:.2f}x plain")
    print(f"tuning took {tune_seconds:.0f} s; wrote {args.output}")


def _shape(p: SpecParams | None) -> str:
    return "plain" if p is None else f"{p.num_steps}/{p.topk}/{p.num_draft_tokens}"


if __name__ == "__main__":
    main()
