"""Where a speculative round's time goes, against a plain step: the embedded model at batch 1, every round
speculating, the wall time of each phase of SpecRounds (draft, verify, draft extend) and of a whole round, and the
plain step of a NONE engine, over the same chat prompts.

    .venv/bin/python bench/round_split.py [--algorithm EAGLE3] [--max-new-tokens 128] [--out PATH]

A round pays when (round ms) / tau < (plain step ms); the report says what tau that takes. Phases are timed by
wrapping SpecRounds' methods (perf_counter around each call, no profiler), after one warm-up answer per engine.
Writes bench/results/round_split.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

from peers import DEFAULT_PROMPTS

import fastspec
from fastspec.engine import spec_rounds
from fastspec.sampling import SamplingParams

PHASES = {"_verify": "verify", "_extend": "extend", "launch": "round"}  # SpecRounds method -> label


def timed_phases(algorithm: str, params: SamplingParams) -> tuple[dict, float]:
    """({phase: mean ms}, tau) of `algorithm`'s rounds, every round speculating."""
    seconds, calls = collections.defaultdict(float), collections.Counter()

    def wrap(owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - start
                calls[label] += 1
        setattr(owner, name, timed)

    llm = fastspec.LLM(speculative_algorithm=algorithm, tuned=False)
    llm.engine.policy = None  # every round speculates
    for name, label in PHASES.items():
        wrap(spec_rounds.SpecRounds, name, label)
    for drafter in {type(d) for d in llm.engine.worker.spec_rounds.drafters.values()}:
        wrap(drafter, "draft", "draft")
    llm.generate(DEFAULT_PROMPTS[:1], params, chat=True)  # warm-up
    seconds.clear(), calls.clear()
    outs = [llm.generate([p], params, chat=True)[0] for p in DEFAULT_PROMPTS]
    tau = sum(o.metrics.emitted_tokens for o in outs) / sum(o.metrics.verify_rounds for o in outs)
    return {label: 1000 * seconds[label] / calls[label] for label in seconds}, tau


def plain_step_ms(params: SamplingParams) -> float:
    llm = fastspec.LLM(speculative_algorithm="NONE")
    llm.generate(DEFAULT_PROMPTS[:1], params, chat=True)  # warm-up
    start, tokens = time.perf_counter(), 0
    for p in DEFAULT_PROMPTS:
        tokens += len(llm.generate([p], params, chat=True)[0].output_ids)
    return 1000 * (time.perf_counter() - start) / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", default="EAGLE3")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "round_split.json"))
    args = parser.parse_args()
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    phases, tau = timed_phases(args.algorithm, params)
    plain = plain_step_ms(params)
    for label in ("draft", "verify", "extend", "round"):
        print(f"{label:7s} {phases[label]:7.2f} ms")
    print(f"plain step (NONE, prefill included) {plain:.2f} ms per token; tau {tau:.2f}: "
          f"{phases['round'] / tau:.2f} ms per token speculating; pays from tau {phases['round'] / plain:.2f}")
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps({"algorithm": args.algorithm, "phases_ms": phases, "tau": tau,
                                          "plain_ms_per_token": plain}, indent=1) + "\n")


if __name__ == "__main__":
    main()
