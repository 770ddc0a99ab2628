"""Greedy speculative output against greedy plain output, token for token, per model dtype: the embedded model and
its EAGLE-3 head, every round speculating, over the held-out chat prompts (none of them used by the tests).

    .venv/bin/python bench/spec_agreement.py [--dtypes float32,bfloat16,float16] [--prompts 16] [--max-new-tokens 64]
        [--quantization none]   # the float weights: torch's GEMMs instead of fastspec's packed kernels

For each dtype: how many answers are identical, and where the others first differ (the token index). They should
all be (the suite tests it on tiny models): a verify row computes its token's decode-step logits bit for bit; a kernel
whose rounding depends on the rows around it (torch's SDPA over a padded verify block did, in 16 bits) shows here as
a greedy near-tie going either way.
Writes bench/results/spec_agreement.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import fastspec
from fastspec.prompts import load_prompts
from fastspec.sampling import SamplingParams


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where a and b differ (a length counts), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def agreement(dtype: str, prompts: list[str], params: SamplingParams, quantization: str | None = None) -> dict:
    plain = fastspec.LLM(speculative_algorithm="NONE", dtype=dtype, tuned=False, quantization=quantization)
    expected = [o.output_ids for o in plain.generate(prompts, params, chat=True)]
    del plain
    spec = fastspec.LLM(dtype=dtype, tuned=False, quantization=quantization)
    spec.engine.policy = None  # every round speculates
    outs = spec.generate(prompts, params, chat=True)
    firsts = [first_difference(o.output_ids, e) for o, e in zip(outs, expected)]
    return {"dtype": dtype, "answers": len(outs), "identical": sum(f is None for f in firsts),
            "first_difference": firsts, "verify_rounds": sum(o.metrics.verify_rounds for o in outs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--quantization", default=None, help="none: the float weights (default: the packed GGUF)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "spec_agreement.json"))
    args = parser.parse_args()
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    prompts = load_prompts("all", "heldout")
    prompts = prompts[::max(1, len(prompts) // args.prompts)][:args.prompts]  # spread over every set
    rows = []
    for dtype in args.dtypes.split(","):
        rows.append(agreement(dtype, prompts, params, args.quantization))
        r = rows[-1]
        print(f"{dtype:9s} {r['identical']} / {r['answers']} identical; first differences {r['first_difference']}")
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps({"max_new_tokens": args.max_new_tokens, "quantization": args.quantization,
                                          "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
