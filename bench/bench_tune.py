"""`fastspec tune` against a grid measured end to end, in one process, on the embedded SmolLM2-135M-Instruct
with its shipped EAGLE-3 head.

    .venv/bin/python bench/bench_tune.py [--batch-sizes 1,4,8] [--budget 600] [--max-new-tokens 96]
    .venv/bin/python bench/bench_tune.py --rematch-only [--retune]

1. Runs the tuner (replay + measured costs + successive halving) and times it, or (--from-tuned) reads the
   choice `fastspec tune` wrote.
2. Measures a grid of shapes (chains of 1..6 steps; topk 2/4/8 x steps 2/4/6 x N 4/8/16; no speculation) end to end at each
   batch size on the same prompts and output length, and reports replayed tau against the tau measured for the
   same shape.
3. Rematch: one pass over 34 shapes makes the grid's best a winner's curse (its max of noisy single runs), so
   the tuned choice, the grid's top 3 and plain decoding run again `--trials` times in rotating order; the tuned
   choice as a fraction of the best median is the number to quote (`--rematch-only` redoes just this stage from
   the JSON of an earlier run).
Writes bench/results/tune.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import fastspec
from fastspec.models.embedded import DEFAULT_MODEL, embedded_head
from fastspec.prompts import load_prompts
from fastspec.sampling import SamplingParams
from fastspec.spec_config import SpecParams
from fastspec.speculative.tuned import read_tuned, tuned_path
from fastspec.tune.replay import record, replay_tau
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
    ap.add_argument("--trials", type=int, default=3, help="rematch runs per shape")
    ap.add_argument("--rematch-only", action="store_true", help="only the rematch, on the grid of --output")
    ap.add_argument("--retune", action="store_true", help="with --rematch-only: tune again first, rematch its choice")
    args = ap.parse_args()
    sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    cfg = TuneConfig(batch_sizes=sizes, max_new_tokens=args.max_new_tokens, budget=args.budget)
    llm = fastspec.LLM(speculative_algorithm="EAGLE3", draft_model=str(embedded_head(DEFAULT_MODEL)), tuned=False,
                       num_steps=cfg.max_steps, topk=max(cfg.topks), num_draft_tokens=cfg.max_draft_tokens,
                       max_running_requests=max(sizes))
    prompts = [llm.encode(t, chat=True) for t in load_prompts("all", "train")[::37][:args.num_prompts]]
    if args.rematch_only:
        out = json.loads(Path(args.output).read_text())
        chosen = {row["bs"]: row["chosen"] for row in out["per_batch_size"]}
        if args.retune:  # a changed tuner on the same head and prompts: the first-pass grid still holds
            start = time.perf_counter()
            result = tune(llm, prompts, cfg, say=print)
            out["retune"] = {"tune_seconds": round(time.perf_counter() - start, 1), "tiers": result.tiers(),
                             "confirmed": [c.row() for c in result.confirmed]}
            chosen = {bs: _shape(c.params) for bs, c in result.winners.items()}
        out["rematch"] = [_rematch(llm, prompts, row, chosen[row["bs"]], cfg, args.trials)
                          for row in out["per_batch_size"]]
        Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
        _print_rematch(out["rematch"])
        return
    if args.from_tuned:  # the tuned file `fastspec tune` wrote (same prompts and lengths by default)
        data = read_tuned(tuned_path(llm.engine.model_dir, embedded_head(DEFAULT_MODEL), llm.engine.config.dtype,
                                     llm.engine.config.device))
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
    out["rematch"] = [_rematch(llm, prompts, row, row["chosen"], cfg, args.trials) for row in rows]
    Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
    _print_rematch(out["rematch"])
    print(f"tuning took {tune_seconds} s; wrote {args.output}")


def _rematch(llm, prompts, row: dict, chosen: str, cfg: TuneConfig, trials: int) -> dict:
    """Median tok/s over `trials` rotating runs of the tuned shape, the grid's top 3 and plain at one batch size
    (`row`: the first pass at that batch size)."""
    bs = row["bs"]
    top = sorted((s for s in row["grid"] if s != "plain"), key=lambda s: -row["grid"][s][0])[:3]
    shapes = list(dict.fromkeys([chosen, *top, "plain"]))
    batch = [prompts[i % len(prompts)] for i in range(bs)]
    rates = {s: [] for s in shapes}
    for t in range(trials):
        for s in shapes[t % len(shapes):] + shapes[:t % len(shapes)]:
            rates[s].append(_run(llm, batch, Candidate(bs, _params(s), 0.0, 0.0), cfg.max_new_tokens)[0])
    median = {s: statistics.median(r) for s, r in rates.items()}
    best = max(median, key=median.get)
    return {"bs": bs, "chosen": chosen, "best": best, "chosen_vs_best": median[chosen] / median[best],
            "chosen_vs_plain": median[chosen] / median["plain"], "median_tok_s": median, "runs": rates}


def _print_rematch(rematch: list[dict]) -> None:
    for r in rematch:
        m = r["median_tok_s"]
        print(f"rematch bs {r['bs']}: tuned {r['chosen']} {m[r['chosen']]:.1f} tok/s = {r['chosen_vs_best']:.1%} of "
              f"best {r['best']} ({m[r['best']]:.1f}); {r['chosen_vs_plain']:.2f}x plain ({m['plain']:.1f})")


def _replayed(llm, prompts, cfg) -> dict:
    """Replayed tau of every grid shape (what `tune` computes first), for the replayed-vs-measured check."""
    engine = llm.engine
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=cfg.max_new_tokens, ignore_eos=True))
    recorded = [record(engine.model, engine.drafter.model, engine.drafter.hot_token_id, engine.feature,
                       o.prompt_ids, o.output_ids, GRID) for o in outs]
    return {p: emitted / rounds for p in GRID for rounds, emitted in [replay_tau(recorded, p)]}


def _shape(p: SpecParams | None) -> str:
    return "plain" if p is None else f"{p.num_steps}/{p.topk}/{p.num_draft_tokens}"


def _params(shape: str) -> SpecParams | None:
    return None if shape == "plain" else SpecParams(*map(int, shape.split("/")))


if __name__ == "__main__":
    main()
