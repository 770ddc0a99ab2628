"""Plain greedy decode, fastspec vs transformers `generate`, same model / prompts / dtype, one process.

    .venv/bin/python bench/bench_decode.py [--dtypes float32,bfloat16] [--max-new-tokens 64] [--trials 3]

Trials alternate between the two engines so machine noise hits both alike; the ratio is the number to quote.
Writes bench/results/decode.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import fastspec
from fastspec.config import parse_dtype
from fastspec.sampling import SamplingParams

PROMPTS = ["Explain how a bicycle stays upright.", "Write a short poem about autumn leaves.",
           "What are three tips for learning a new language?"]


def time_fastspec(llm, prompt_ids, new_tokens):
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    out = llm.engine.generate([prompt_ids], [params])[0]
    return len(out.output_ids), time.perf_counter() - start


def time_transformers(hf, prompt_ids, new_tokens, **generate_options):
    """(tokens, seconds) of one greedy `generate` on hf's device; `generate_options`: e.g. cache_implementation."""
    ids = torch.tensor([prompt_ids], device=hf.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, pad_token_id=2, **generate_options)
    if out.is_cuda:
        torch.cuda.synchronize(out.device)
    return out.shape[1] - ids.shape[1], time.perf_counter() - start


def bench_dtype(dtype: str, new_tokens: int, trials: int) -> dict:
    from fastspec.models.reference import transformers_model

    llm = fastspec.LLM(dtype=dtype, quantization=None, max_total_tokens=4096, speculative_algorithm="NONE")
    hf = transformers_model(llm.engine.model_dir, parse_dtype(dtype))
    prompts = [llm.encode(p, chat=True) for p in PROMPTS]
    time_fastspec(llm, prompts[0], 4), time_transformers(hf, prompts[0], 4)  # warm-up
    rates = {"fastspec": [], "transformers": []}
    for _ in range(trials):
        for ids in prompts:
            for name, fn, engine in (("fastspec", time_fastspec, llm), ("transformers", time_transformers, hf)):
                n, seconds = fn(engine, ids, new_tokens)
                rates[name].append(n / seconds)
    fs, tf = statistics.median(rates["fastspec"]), statistics.median(rates["transformers"])
    return {"dtype": dtype, "fastspec_tok_s": round(fs, 2), "transformers_tok_s": round(tf, 2),
            "ratio": round(fs / tf, 3), "max_new_tokens": new_tokens, "runs_per_engine": len(rates["fastspec"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--trials", type=int, default=2)
    args = parser.parse_args()
    results = [bench_dtype(d, args.max_new_tokens, args.trials) for d in args.dtypes.split(",")]
    print(f"{'dtype':10} {'fastspec tok/s':>15} {'transformers tok/s':>19} {'ratio':>7}")
    for r in results:
        print(f"{r['dtype']:10} {r['fastspec_tok_s']:15.2f} {r['transformers_tok_s']:19.2f} {r['ratio']:7.3f}")
    out = Path(__file__).parent / "results" / "decode.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"torch_threads": torch.get_num_threads(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
