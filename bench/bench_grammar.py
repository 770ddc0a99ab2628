"""Structured output on the embedded model: tok/s of a JSON-schema-constrained answer with and without
speculation, next to the same prompts unconstrained.

    .venv/bin/python bench/bench_grammar.py [--batch-sizes 1,4] [--max-new-tokens 96] [--trials 2]

Arms (greedy, the tuned default ignored so every arm speculates as stated): NONE, EAGLE-3 with the shipped head
as a 3/1/4 chain and as SGLang's 5/4/8 tree, NGRAM. Each runs the prompts with the schema (`json`) and without
(`free`), alternating within every trial. Every constrained answer must parse as JSON and carry the schema's
keys, and each speculative arm must give the NONE arm's tokens (both checked). Reports the median tok/s, tau
(tokens per verify round) and each arm's ratio to NONE with the same constraint. Writes
bench/results/grammar.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import fastspec
from fastspec.sampling import SamplingParams

PROMPTS = ["Describe a fictional person as JSON: name, age, city and a short bio.",
           "Give me a JSON record for a used car for sale: make, model, year, price and a one-line description.",
           "Invent a book and describe it in JSON: title, author, year and a one-sentence summary.",
           "Describe a city you like in JSON with its name, country, population and why you like it."]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "category": {"type": "string"},
                                           "year": {"type": "integer"}, "tags": {"type": "array",
                                                                                 "items": {"type": "string"}},
                                           "summary": {"type": "string"}},
          "required": ["name", "category", "year", "tags", "summary"], "additionalProperties": False}
ARMS = {"NONE": {}, "EAGLE3 3/1/4": dict(speculative_algorithm="EAGLE3", num_steps=3, topk=1, num_draft_tokens=4),
        "EAGLE3 5/4/8": dict(speculative_algorithm="EAGLE3", num_steps=5, topk=4, num_draft_tokens=8),
        "NGRAM": dict(speculative_algorithm="NGRAM")}


def run(llm, ids, bs: int, params):
    start, tokens, outputs, rounds, emitted = time.perf_counter(), 0, [], 0, 0
    for i in range(0, len(ids), bs):
        for o in llm.engine.generate(ids[i:i + bs], [params] * len(ids[i:i + bs])):
            tokens += len(o.output_ids)
            outputs.append(o)
            rounds += o.metrics.verify_rounds
            emitted += o.metrics.emitted_tokens
    return tokens / (time.perf_counter() - start), outputs, emitted / rounds if rounds else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--trials", type=int, default=2)
    args = ap.parse_args()
    llms = {arm: fastspec.LLM(max_total_tokens=8192, tuned=False, speculative_fallback=False,
                              **({"speculative_algorithm": "NONE"} | extra)) for arm, extra in ARMS.items()}
    any_llm = llms["NONE"]
    ids = [any_llm.encode(p, chat=True) for p in PROMPTS]
    kinds = {"json": SamplingParams(max_new_tokens=args.max_new_tokens, json_schema=SCHEMA),
             "free": SamplingParams(max_new_tokens=args.max_new_tokens)}
    results = []
    for bs in map(int, args.batch_sizes.split(",")):
        batch = [ids[i % len(ids)] for i in range(max(len(ids), bs))]
        rates = {(arm, kind): [] for arm in ARMS for kind in kinds}
        outputs, tau = {}, {}
        for llm in llms.values():  # warm-up
            run(llm, batch[:bs], bs, SamplingParams(max_new_tokens=8, json_schema=SCHEMA))
        for _ in range(args.trials):
            for kind, params in kinds.items():
                for arm, llm in llms.items():
                    rate, outputs[arm, kind], tau[arm, kind] = run(llm, batch, bs, params)
                    rates[arm, kind].append(rate)
        for o in outputs["NONE", "json"]:
            if o.finish_reason == "stop":
                assert set(json.loads(any_llm.decode(o.output_ids))) == set(SCHEMA["properties"])
        for arm, kind in rates:
            assert [o.output_ids for o in outputs[arm, kind]] == [o.output_ids for o in outputs["NONE", kind]], arm
        median = {k: statistics.median(r) for k, r in rates.items()}
        for kind in kinds:
            row = {"batch_size": bs, "kind": kind, "tok_s": {arm: round(median[arm, kind], 2) for arm in ARMS},
                   "ratio_to_none": {arm: round(median[arm, kind] / median["NONE", kind], 3) for arm in ARMS},
                   "tau": {arm: tau[arm, kind] and round(tau[arm, kind], 2) for arm in ARMS},
                   "finished": sum(o.finish_reason == "stop" for o in outputs["NONE", kind])}
            results.append(row)
            print(json.dumps(row))
    out = Path(__file__).parent / "results" / "grammar.json"
    out.write_text(json.dumps({"max_new_tokens": args.max_new_tokens, "trials": args.trials, "schema": SCHEMA,
                               "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
