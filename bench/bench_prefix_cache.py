"""What the radix prefix cache saves a chat: time to first token of turn 5 of a scripted chat on the embedded
model, cache on vs off.

    .venv/bin/python bench/bench_prefix_cache.py [--trials 3] [--max-new-tokens 96]

A system prompt and five user messages; each turn sends the whole conversation (chat template) as `fastspec
chat` does, greedy answers. Arms: plain decoding (NONE) and EAGLE-3 with the shipped head (the tuned default
ignored: SGLang's 5/4/8), each with `--radix-cache` on and off, alternating within every trial; the cache is
flushed before each trial's turn 1 so every trial starts cold. Reports the median TTFT of turn 5 (prompt
submitted -> first token handed out), its prompt length and how much of it the cache supplied, the median time
of the whole chat, and the ratio off / on. The answers must be identical with the cache on and off (checked).
Writes bench/results/prefix_cache.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import fastspec
from fastspec.sampling import SamplingParams

SYSTEM = ("You are a concise, friendly assistant for a small bakery. Answer in two or three sentences, suggest "
          "one of our products when it fits, and never invent prices. Our products: sourdough loaf, rye bread, "
          "croissants, cinnamon rolls, lemon tart, carrot cake and seasonal fruit pies.")
TURNS = ["Hi! What would you recommend for a picnic?", "Which of those keeps best for two days?",
         "Do you have anything without wheat?", "What goes well with coffee in the morning?",
         "Great, can you summarise what you suggested today in one line?"]
ARMS = {"NONE": dict(speculative_algorithm="NONE"),
        "EAGLE3 5/4/8": dict(speculative_algorithm="EAGLE3", num_steps=5, topk=4, num_draft_tokens=8)}


def chat(llm, params) -> tuple[list[list[int]], float, int, int, float]:
    """(answers, turn-5 TTFT, turn-5 prompt tokens, turn-5 reused tokens, whole-chat seconds)."""
    messages, answers = [{"role": "system", "content": SYSTEM}], []
    start = time.perf_counter()
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        ids = llm.encode_chat(messages)
        reused = llm.engine.worker.reused_tokens
        sent, first, out = time.perf_counter(), None, []
        for step in llm.engine.stream([ids], [params]):
            for o in step:
                if o.new_ids and first is None:
                    first = time.perf_counter() - sent
                out += o.new_ids
        answers.append(out)
        messages.append({"role": "assistant", "content": llm.decode(out)})
    return answers, first, len(ids), llm.engine.worker.reused_tokens - reused, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    results = []
    for arm, extra in ARMS.items():
        llms = {cache: fastspec.LLM(max_total_tokens=8192, tuned=False, speculative_fallback=False,
                                    radix_cache=cache, **extra) for cache in (False, True)}
        chat(llms[False], SamplingParams(max_new_tokens=4))  # warm-up
        ttft, total, answers, prompt, reused = {c: [] for c in llms}, {c: [] for c in llms}, {}, 0, 0
        for _ in range(args.trials):
            for cache, llm in llms.items():
                llm.engine.flush_cache()
                answers[cache], first, prompt, got, seconds = chat(llm, params)
                ttft[cache].append(first)
                total[cache].append(seconds)
                reused = got if cache else reused
        assert answers[True] == answers[False], f"{arm}: the cache changed the answers"
        off, on = statistics.median(ttft[False]), statistics.median(ttft[True])
        row = {"arm": arm, "turn5_prompt_tokens": prompt, "turn5_reused_tokens": reused,
               "turn5_ttft_s": {"off": round(off, 3), "on": round(on, 3)}, "ttft_ratio_off_on": round(off / on, 2),
               "chat_s": {c and "on" or "off": round(statistics.median(t), 2) for c, t in total.items()}}
        results.append(row)
        print(json.dumps(row))
        del llms
    out = Path(__file__).parent / "results" / "prefix_cache.json"
    out.write_text(json.dumps({"trials": args.trials, "max_new_tokens": args.max_new_tokens, "results": results},
                              indent=1) + "\n")


if __name__ == "__main__":
    main()
