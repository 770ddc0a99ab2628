"""Round time split (draft loop / verify / draft extend / host) eager vs compiled graphs, and compile start-up
cold vs warm cache, on the embedded SmolLM2-135M-Instruct with an untrained full-size EAGLE-3 head.

    .venv/bin/python bench/bench_graphs.py [--batch-sizes 1,4] [--max-new-tokens 32] [--skip-startup]

Writes bench/results/graphs.json. Phase times are wall time; `host` = round time outside the three graph
phases (packing, allocation, acceptance, commit). Acceptance is whatever a random head gets (~0).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fastspec
from fastspec.models.heads import write_random_head
from fastspec.models.loader import read_config, resolve_model_dir
from fastspec.sampling import SamplingParams

PROMPT = "Explain how a refrigerator keeps food cold."


def make_head(directory: Path) -> Path:
    c = read_config(resolve_model_dir("smollm2-135m-instruct"))
    return write_random_head(directory, c.hidden_size, c.vocab_size, "eagle3", draft_vocab=4096,
                             heads=c.num_heads, kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                             inter=c.intermediate_size)


def llm_for(head: Path, mode: str, buckets: tuple[int, ...]):
    return fastspec.LLM(speculative_algorithm="EAGLE3", draft_model=str(head), num_steps=5, topk=4,
                        num_draft_tokens=8, max_total_tokens=8192, graphs=mode, cuda_graph_bs=buckets,
                        max_running_requests=max(buckets))


def round_split(llm, bs: int, new_tokens: int) -> dict:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    llm.generate([PROMPT] * bs, SamplingParams(max_new_tokens=4, ignore_eos=True), chat=True)  # warm-up
    llm.engine.times.reset()
    start = time.perf_counter()
    outputs = llm.generate([PROMPT] * bs, params, chat=True)
    wall = time.perf_counter() - start
    rounds = max(o.metrics.verify_rounds for o in outputs)
    split = {k: round(v / rounds * 1000, 2) for k, v in llm.engine.times.split().items() if k != "prefill"}
    split["host_share"] = round(split["host"] / split["round"], 3)
    return {"batch_size": bs, "rounds": rounds, "ms_per_round": split,
            "tok_s": round(sum(len(o.output_ids) for o in outputs) / wall, 2)}


def startup(head: Path, cache: Path, buckets: str) -> float:
    """Seconds for a fresh process to build a compiled engine and emit its first token."""
    code = ("import time, sys, fastspec; t = time.perf_counter(); "
            f"llm = fastspec.LLM(speculative_algorithm='EAGLE3', draft_model={str(head)!r}, num_steps=5, topk=4, "
            f"num_draft_tokens=8, max_total_tokens=8192, graphs='compile', cuda_graph_bs=({buckets},), "
            f"max_running_requests={buckets.split(',')[-1]}); "
            f"llm.generate([{PROMPT!r}], fastspec.SamplingParams(max_new_tokens=2), chat=True); "
            "print(time.perf_counter() - t)")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return round(float(out.stdout.strip().splitlines()[-1]), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--skip-startup", action="store_true")
    args = parser.parse_args()
    sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    tmp = Path(tempfile.mkdtemp())
    head = make_head(tmp / "head")
    results = {"modes": {}}
    for mode in ("eager", "compile"):
        llm = llm_for(head, mode, sizes)
        results["modes"][mode] = [round_split(llm, bs, args.max_new_tokens) for bs in sizes]
        del llm
    if not args.skip_startup:
        cache = tmp / "inductor"
        results["startup_s"] = {"cold": startup(head, cache, args.batch_sizes),
                                "warm": startup(head, cache, args.batch_sizes)}
    print(json.dumps(results, indent=2))
    out = Path(__file__).parent / "results" / "graphs.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
