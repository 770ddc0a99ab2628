"""`fastspec tune` against a grid measured end to end, in one process, on the embedded SmolLM2-135M-Instruct
with its shipped EAGLE-3 head.

    .venv/bin/python bench/bench_tune.py [--batch-sizes 1,4,8] [--budget 600] [--max-new-tokens 96]

1. Runs the tuner (replay + measured costs + successive halving) and times it, or (--from-tuned) reads the
   choice `fastspec tune` wrote.
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
from fastspec.sampling import SamplingParams
from fastspec.tune.replay import record, replay_tau
from fastspec.tune.tuned import read_tuned, tuned_path
from fastspec.tune.tuner import Candidate, TuneConfig, TuneResult, _run, tune

GRID = [SpecParams(s, 1, s + 1) for s in range(1, 7)] + [  # chains, then trees: a coarse but wide grid
    SpecParams(s, k, n) for k in (2, 4, 8) for s in (2, 4, 6) for n in (4, 8, 16) if n <= 1 + k + (s - 1) * k * k]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,4,8")
    ap.add_argument("--budget", type=float, default=600.0)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--output", default="bench/results/tune.json")
    ap.add_argument("--from-tuned", action="store_true", help="take the choice from the tuned file, do not tune")
    args = ap.parse_args()
    sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    cfg = TuneConfig(batch_sizes=sizes, max_new_tokens=args.max_new_tokens, budget=args.budget)
    llm = fastspec.LLM(speculative_algorithm="EAGLE3", draft_model=str(embedded_head(DEFAULT_MODEL)), tuned=False,
                       num_steps=cfg.max_steps, topk=max(cfg.topks), num_draft_tokens=cfg.max_draft_tokens,
                       max_running_requests=max(sizes))
    prompts = [llm.encode(t, chat=True) for t in load_prompts("all", "train")[::37][:args.num_prompts]]
    if args.from_tuned:  # the tuned file `fastspec tune` wrote (same prompts and lengths by default)
        data = read_tuned(tuned_path(llm.engine.model_dir, embedded_head(DEFAULT_MODEL)))
        winners = {t["max_batch_size"]: Candidate(t["max_batch_size"], t["params"] and SpecParams(*t["params"]),
                                                  t["tau"], t["predicted_tok_s"]) for t in data["tiers"]}
        result, tune_seconds = TuneResult(winners), None
        result.taus.update(_replayed(llm, prompts, cfg))
    else:
        start = time.perf_counter()
        result = tune(llm, prompts, cfg, say=print)
        tune_seconds = round(time.perf_counter() - start, 1)
    grid = GRID
    rows = []
    for bs in sizes:
        batch = [prompts[i % len(prompts)] for i in range(bs)]
        measured = {}
        for p in dict.fromkeys([None, result.winners[bs].params, *grid]):  # the tuned choice may be off-grid
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
    out = {"tune_seconds": tune_seconds, "replay_seconds": round(result.replay_seconds, 1),
           "cost_seconds": round(result.cost_seconds, 1), "confirm_seconds": round(result.confirm_seconds, 1),
           "tiers": result.tiers(), "confirmed": [c.row() for c in result.confirmed], "per_batch_size": rows,
           "config": vars(args)}
    Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
    for r in rows:
        print(f"bs {r['bs']}: tuned {r['chosen']} {r['chosen_tok_s']:.1f} tok/s = {r['chosen_vs_best']:.1%} of "
              f"grid best {r['grid_best']} ({r['grid_best_tok_s']:.1f}); {r['chosen_vs_plain']:.2f}x plain")
    print(f"tuning took {tune_seconds} s; wrote {args.output}")


def _replayed(llm, prompts, cfg) -> dict:
    """Replayed tau of every grid shape (what `tune` computes first), for the replayed-vs-measured check."""
    engine = llm.engine
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=cfg.max_new_tokens, ignore_eos=True))
    recorded = [record(engine.model, engine.drafter.model, engine.drafter.hot_token_id, engine.feature,
                       o.prompt_ids, o.output_ids, GRID) for o in outs]
    return {p: emitted / rounds for p in GRID for rounds, emitted in [replay_tau(recorded, p)]}


def _shape(p: SpecParams | None) -> str:
    return "plain" if p is None else f"{p.num_steps}/{p.topk}/{p.num_draft_tokens}"


if __name__ == "__main__":
    main()
