"""The cost of logprobs and of sampling controls: tok/s with each on vs off, greedy, on the embedded model.

    .venv/bin/python bench/bench_logprobs.py [--batch-sizes 1,4] [--max-new-tokens 48] [--trials 3]

For plain decoding (NONE) and EAGLE-3 with the shipped head (the tuned default is ignored: a fixed 3/1/4 chain
so both arms speculate the same way), each batch size runs four arms, alternating within every trial:
`off`, `logprobs` (top-5), `controls` (repetition penalty 1.1 + presence penalty 0.2, which change the tokens,
so their tok/s is compared, not their output) and `both`. Reports the median tok/s and the ratio to `off`
(1.00 = free). `off` and `logprobs` must produce the same tokens (checked). Writes bench/results/logprobs.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import fastspec
from fastspec.sampling import SamplingParams

PROMPTS = ["Explain how a refrigerator keeps food cold.", "Write a haiku about autumn rain.",
           "List three uses of a paperclip.", "What is the capital of Australia, and why not Sydney?"]
CONTROLS = dict(repetition_penalty=1.1, presence_penalty=0.2)
ARMS = {"off": {}, "logprobs": dict(logprobs=5), "controls": CONTROLS, "both": dict(logprobs=5, **CONTROLS)}


def run(llm, ids, bs: int, params) -> tuple[float, int, list]:
    start, tokens, outputs = time.perf_counter(), 0, []
    for i in range(0, len(ids), bs):
        for o in llm.engine.generate(ids[i:i + bs], [params] * len(ids[i:i + bs])):
            tokens += len(o.output_ids)
            outputs.append(o.output_ids)
    return time.perf_counter() - start, tokens, outputs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    results = []
    for algorithm in ("NONE", "EAGLE3"):
        spec = {} if algorithm == "NONE" else dict(num_steps=3, topk=1, num_draft_tokens=4)
        llm = fastspec.LLM(speculative_algorithm=algorithm, max_total_tokens=4096, tuned=False, **spec)
        ids = [llm.encode(p, chat=True) for p in PROMPTS]
        for bs in map(int, args.batch_sizes.split(",")):
            batch = [ids[i % len(ids)] for i in range(max(len(ids), bs))]
            rates = {arm: [] for arm in ARMS}
            outputs = {}
            run(llm, batch[:bs], bs, SamplingParams(max_new_tokens=8, ignore_eos=True))  # warm-up
            for _ in range(args.trials):
                for arm, extra in ARMS.items():
                    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True, **extra)
                    seconds, tokens, outputs[arm] = run(llm, batch, bs, params)
                    rates[arm].append(tokens / seconds)
            assert outputs["off"] == outputs["logprobs"], "logprobs changed the tokens"
            median = {arm: statistics.median(r) for arm, r in rates.items()}
            row = {"algorithm": algorithm, "batch_size": bs, "tok_s": median,
                   "ratio_to_off": {arm: median[arm] / median["off"] for arm in ARMS}}
            results.append(row)
            print(json.dumps(row))
    out = Path(__file__).parent / "results" / "logprobs.json"
    out.write_text(json.dumps({"max_new_tokens": args.max_new_tokens, "trials": args.trials, "results": results},
                              indent=1) + "\n")


if __name__ == "__main__":
    main()
