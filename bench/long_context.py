"""Long prompts: prefill and decode speed of fastspec against llama.cpp on the embedded model (SmolLM2-135M-Instruct,
its Q4_1 GGUF), batch 1, greedy, at a few prompt lengths: what a chat user pasting a document waits for.

    .venv/bin/python bench/long_context.py [--context 500,1000,2000] [--new-tokens 128] [--trials 2]
        [--fastspec NONE --fastspec "EAGLE3,speculative_fallback=True"] [--output PATH]

The prompt is this project's own documentation (README.md, then docs/*.md) as one user message, cut to the length in
tokens, chat-templated; llama.cpp is fed the same token ids. Prefill tok/s = prompt tokens / time to the first
token; decode tok/s = the other new tokens / their time (fastspec's both from one streamed answer). Every engine
pays every prefill (fastspec without its prefix cache, llama.cpp reset); trials alternate between engines; medians.
Writes bench/results/long_context.json. llama.cpp runs through llama-cpp-python as bench/peers.py loads it (its
crash probe included), its KV cache sized for the longest prompt and its new tokens (at least bench/peers.py's
4096).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from peers import MODEL, load_llama_cpp, parse_fastspec, probe_llama_cpp

import fastspec
from fastspec.models.embedded import find_embedded_gguf
from fastspec.models.sources import resolve_model_dir
from fastspec.sampling import SamplingParams
from fastspec.text.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "long_context.json"


def prompt_ids(tokenizer: Tokenizer, length: int) -> list[int]:
    """About `length` chat-templated tokens: the docs cut so that the templated prompt has that many."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    docs = "\n\n".join(p.read_text(encoding="utf-8") for p in files)
    head = tokenizer.encode_chat([{"role": "user", "content": ""}])
    body = tokenizer.encode(docs)[:max(0, length - len(head))]
    return tokenizer.encode_chat([{"role": "user", "content": tokenizer.decode(body)}])


def fastspec_timer(options: dict):
    llm = fastspec.LLM(model=MODEL, **{"radix_cache": False, **options})

    def run(ids: list[int], new_tokens: int) -> tuple[float, float]:
        start, first = time.perf_counter(), None
        for deltas in llm.stream([ids], SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)):
            if first is None and any(d.new_ids for d in deltas):  # the prefill's token (its last chunk's)
                first = time.perf_counter()
        return first - start, time.perf_counter() - first  # (prefill + one token, the other new_tokens - 1)
    return run


def llama_cpp_timer(gguf: Path, n_ctx: int):
    model = load_llama_cpp(gguf, probe_llama_cpp(gguf, True) is None, max(n_ctx, 4096))

    def run(ids: list[int], new_tokens: int) -> tuple[float, float]:
        model.reset()
        start = time.perf_counter()
        model.eval(ids)
        first = time.perf_counter()
        for n, _ in enumerate(model.generate([], temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                             reset=False), 1):
            if n == new_tokens:  # the first comes from the prefill's logits: new_tokens - 1 decode steps
                break
        return first - start, time.perf_counter() - first
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", default="500,1000,2000", help="prompt lengths in tokens")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--fastspec", action="append", help='"ALGO[,key=value...]" as bench/peers.py takes; '
                        "repeatable (default: NONE)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    tokenizer = Tokenizer(resolve_model_dir(MODEL))
    engines = {f"fastspec {spec}": fastspec_timer(parse_fastspec(spec)) for spec in args.fastspec or ["NONE"]}
    try:
        import llama_cpp  # noqa: F401
        longest = max(int(x) for x in args.context.split(","))
        engines["llama.cpp"] = llama_cpp_timer(find_embedded_gguf(MODEL), longest + args.new_tokens + 64)
    except ImportError:
        print("llama-cpp-python is not installed: fastspec alone")
    rows = []
    for length in (int(x) for x in args.context.split(",")):
        ids = prompt_ids(tokenizer, length)
        times = {name: [] for name in engines}
        for name, run in engines.items():  # warm-up at this length
            run(ids, 4)
        for _ in range(args.trials):
            for name, run in engines.items():
                times[name].append(run(ids, args.new_tokens))
        for name, samples in times.items():
            prefill = len(ids) / statistics.median(p for p, _ in samples)
            decode = (args.new_tokens - 1) / statistics.median(d for _, d in samples)
            rows.append(dict(engine=name, prompt_tokens=len(ids), prefill_tok_s=round(prefill, 1),
                             decode_tok_s=round(decode, 1)))
            print(f"{len(ids):5d} tokens  {name:40s} prefill {prefill:7.1f} tok/s   decode {decode:6.1f} tok/s")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(dict(new_tokens=args.new_tokens, trials=args.trials, rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
