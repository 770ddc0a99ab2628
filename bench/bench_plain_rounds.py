"""What a draft costs while it is not used: plain decoding in an EAGLE-3 engine whose schedule never speculates,
against an engine without a draft (`--speculative-algorithm NONE`), same prompts, greedy, batch 1.

    .venv/bin/python bench/bench_plain_rounds.py [--max-new-tokens 96] [--trials 3]

Before the draft's backlog (fastspec.speculative.backlog) every plain round also ran a draft extend; now the draft
runs only before a speculative round, so the ratio should be ~1.00x. The engines are measured alternately in one
process (ratios within the run); tok/s = output tokens / wall time of the generation, prefill included; per engine
the median over trials x prompts. Run it on an older checkout (PYTHONPATH) for the before figure.
"""

from __future__ import annotations

import argparse
import statistics
import time

import fastspec
from fastspec.prompts import load_prompts
from fastspec.sampling import SamplingParams


class NeverSpeculate:
    """A fallback policy that always decodes plainly (a tuned schedule with plain at this batch size, measured
    without a tuned file)."""

    def speculate(self, bs: int) -> bool:
        return False

    def record(self, *args) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=4)
    args = parser.parse_args()
    engines = {"NONE": fastspec.LLM(speculative_algorithm="NONE", max_total_tokens=4096),
               "EAGLE3, plain rounds": fastspec.LLM(speculative_algorithm="EAGLE3", max_total_tokens=4096,
                                                    speculative_fallback=True)}
    engines["EAGLE3, plain rounds"].engine.policy = NeverSpeculate()
    prompts = [engines["NONE"].encode(p, chat=True) for p in load_prompts("chat", "heldout")[: args.num_prompts]]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    for llm in engines.values():  # warm-up
        llm.generate([prompts[0]], SamplingParams(max_new_tokens=8))
    rates = {name: [] for name in engines}
    outputs = {}
    for _ in range(args.trials):
        for name, llm in engines.items():
            for i, ids in enumerate(prompts):
                start = time.perf_counter()
                out = llm.generate([ids], params)[0]
                rates[name].append(len(out.output_ids) / (time.perf_counter() - start))
                outputs.setdefault((name, i), out.output_ids)
                assert out.metrics.verify_rounds == 0 or name == "NONE"
    same = all(outputs[("NONE", i)] == outputs[("EAGLE3, plain rounds", i)] for i in range(len(prompts)))
    base = statistics.median(rates["NONE"])
    print(f"| engine | tok/s (median of {len(rates['NONE'])}) | vs NONE |\n|---|---:|---:|")
    for name, values in rates.items():
        print(f"| {name} | {statistics.median(values):.1f} | {statistics.median(values) / base:.2f}x |")
    print(f"\nsame tokens: {same}")


if __name__ == "__main__":
    main()
