"""The CPU host paths of a decode step, each against what it replaced, alternating answer by answer in one process
(this VM's speed moves too much between processes for two runs to compare):

  plain step    the decode step function run eagerly (a one-node verify over the paged plan, whose dense twin the
                fused layers build in one C call) against the target's forward over decode metadata and its plan
  round         the speculative round's tree build, greedy walk and dense attention plans in C (kernels/cpu_tree.c,
                cpu_fused.paged_dense_plan) against their torch twins (EAGLE-3 every round)

    .venv/bin/python bench/bench_cpu_host_paths.py [--trials 5] [--max-new-tokens 128]

Prints ms per token (plain) and per round (speculative) of each path and their ratio; writes
bench/results/cpu_host_paths.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from peers import DEFAULT_PROMPTS

import fastspec
from fastspec.attention.paged import twin_plan
from fastspec.kernels import cpu_fused, cpu_tree
from fastspec.sampling import SamplingParams


def alternate(llm, params: SamplingParams, paths: dict, trials: int, per) -> dict:
    """{path: ms per unit}: `paths` maps a name to a function that switches the engine to it; `per(output)` counts
    an answer's units (tokens or rounds)."""
    seconds, units = dict.fromkeys(paths, 0.0), dict.fromkeys(paths, 0)
    for _ in range(trials):
        for name, switch in paths.items():
            switch()
            for prompt in DEFAULT_PROMPTS:
                start = time.perf_counter()
                out = llm.generate([prompt], params, chat=True)[0]
                seconds[name] += time.perf_counter() - start
                units[name] += per(out)
    return {name: 1000 * seconds[name] / units[name] for name in paths}


def plain_paths(params: SamplingParams, trials: int) -> dict:
    llm = fastspec.LLM(speculative_algorithm="NONE")
    rounds = llm.engine.worker.plain_rounds
    step_fn = rounds.graphs
    llm.generate(DEFAULT_PROMPTS[:1], params, chat=True)  # warm-up
    return alternate(llm, params, {"decode metadata": lambda: setattr(rounds, "graphs", None),
                                   "step function": lambda: setattr(rounds, "graphs", step_fn)},
                     trials, lambda out: len(out.output_ids))


def round_paths(params: SamplingParams, trials: int) -> dict:
    llm = fastspec.LLM(speculative_algorithm="EAGLE3", tuned=False)
    llm.engine.policy = None  # every round speculates
    llm.generate(DEFAULT_PROMPTS[:1], params, chat=True)  # warm-up
    kernels = (cpu_tree.eagle_tree, cpu_tree.greedy_walk, cpu_fused.paged_dense_plan)
    twins = (lambda *args: None, lambda *args: None,  # None: the callers run the torch twins
             lambda p: twin_plan(p.table, p.rows, p.prefix_lens, p.block_slots, p.block_mask, p.self_visible))

    def use(fns):
        cpu_tree.eagle_tree, cpu_tree.greedy_walk, cpu_fused.paged_dense_plan = fns
    try:
        return alternate(llm, params, {"torch twins": lambda: use(twins), "C": lambda: use(kernels)}, trials,
                         lambda out: out.metrics.verify_rounds)
    finally:
        use(kernels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_host_paths.json"))
    args = parser.parse_args()
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    results = {"plain ms per token": plain_paths(params, args.trials),
               "round ms": round_paths(params, args.trials)}
    for what, paths in results.items():
        (old, a), (new, b) = paths.items()
        print(f"{what}: {old} {a:.2f}, {new} {b:.2f} ({a / b:.2f}x)")
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
