"""Where a speculative round's time goes, against a plain step: the embedded model at batch 1, every round
speculating, the wall time of each phase of SpecRounds (draft, verify, draft extend) and of a whole round, and the
plain step of a NONE engine, over the same chat prompts.

    .venv/bin/python bench/round_split.py [--algorithm EAGLE3] [--max-new-tokens 128] [--out PATH]

A round pays when (round ms) / tau < (plain step ms); the report says what tau that takes. Phases are timed by
wrapping SpecRounds' methods (perf_counter around each call, no profiler), after one warm-up answer per engine.
Also the target's layer stack (the one C call of cpu_fused.decoder_stack) per number of rows it ran: a plain step's
1 row against a verify's N, i.e. what the verify's extra rows cost in the kernels alone, host time aside.
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
from fastspec.kernels import cpu_fused
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


def stack_timer() -> dict:
    """Wrap cpu_fused.decoder_stack: {rows: [seconds, calls]} of every call from now on."""
    times, inner = collections.defaultdict(lambda: [0.0, 0]), cpu_fused.decoder_stack

    def timed(layers, k, v, x, *args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(layers, k, v, x, *args, **kwargs)
        finally:
            times[x.shape[0]][0] += time.perf_counter() - start
            times[x.shape[0]][1] += 1
    cpu_fused.decoder_stack = timed
    return times


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
    stacks = stack_timer()
    phases, tau = timed_phases(args.algorithm, params)
    plain = plain_step_ms(params)
    for label in ("draft", "verify", "extend", "round"):
        print(f"{label:7s} {phases[label]:7.2f} ms")
    print(f"plain step (NONE, prefill included) {plain:.2f} ms per token; tau {tau:.2f}: "
          f"{phases['round'] / tau:.2f} ms per token speculating; pays from tau {phases['round'] / plain:.2f}")
    stack_ms = {rows: 1000 * seconds / calls for rows, (seconds, calls) in sorted(stacks.items()) if calls >= 20}
    if 1 in stack_ms:  # (prefills are rarer than 20 calls of one length)
        print("target layer stack (C), ms by rows: " + ", ".join(
            f"{rows}: {ms:.2f} ({ms / stack_ms[1]:.2f}x)" for rows, ms in stack_ms.items()))
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps({"algorithm": args.algorithm, "phases_ms": phases, "tau": tau,
                                          "plain_ms_per_token": plain, "stack_ms_by_rows": stack_ms},
                                         indent=1) + "\n")


if __name__ == "__main__":
    main()
