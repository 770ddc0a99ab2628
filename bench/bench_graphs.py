"""Graphs: round time split (draft loop / verify / draft extend / host) eager vs compiled, and start-up: how long a
fresh process takes to its first decode round, cold (empty Inductor cache) and warm, per mode and model size.

    .venv/bin/python bench/bench_graphs.py [--batch-sizes 1,4] [--max-new-tokens 32] [--skip-rounds]
        [--skip-startup] [--models tiny,embedded] [--modes eager,compile]

Models: `tiny` is a random 2-layer, 64-token-vocabulary Llama with a random EAGLE head at 4/2/6;
`embedded` is SmolLM2-135M-Instruct with a random full-size EAGLE-3 head at 5/4/8 (acceptance is whatever a random
head gets, ~0: these are costs, not speedups). Start-up runs
the defaults a user gets: KV pool sized from free memory, graph buckets prepared lazily. `cuda` joins the modes
on a machine with a GPU. Writes bench/results/graphs.json. Phase times are wall time (on a GPU from a run that
synchronises at every phase boundary; tok/s from one that does not); `host` = round time outside the three graph
phases (packing, allocation, acceptance, commit); on a GPU also the device->host syncs per round.
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

import torch

import fastspec
from fastspec.models.heads import write_random_head
from fastspec.models.loader import read_config
from fastspec.models.sources import resolve_model_dir
from fastspec.sampling import SamplingParams

PROMPT = "Explain how a refrigerator keeps food cold."
STARTUP = """
import json, sys, time
began = time.perf_counter()
from torch._dynamo.utils import counters
import fastspec
from fastspec.sampling import SamplingParams
model, algorithm, head, (steps, topk, n), mode = json.loads(sys.argv[1])
imported = time.perf_counter()
llm = fastspec.LLM(model, quantization=None, speculative_algorithm=algorithm, draft_model=head, num_steps=steps,
                   topk=topk, num_draft_tokens=n, graphs=mode)
built = time.perf_counter()
marks = [time.perf_counter() for _ in llm.engine.stream([[2 + i % 60 for i in range(24)]],
                                                       [SamplingParams(max_new_tokens=16, ignore_eos=True)])]
print(json.dumps({"import_s": imported - began, "build_s": built - imported, "first_token_s": marks[0] - built,
                  "first_round_s": marks[1] - marks[0], "to_first_round_s": marks[1] - began,
                  "compiled_graphs": counters["inductor"]["fxgraph_cache_miss"],
                  "cached_graphs": counters["inductor"]["fxgraph_cache_hit"]}))
"""


def make_models(root: Path) -> dict[str, tuple]:
    """name -> (model, algorithm, random head directory, tree shape (steps, topk, draft tokens))."""
    import transformers

    c = read_config(resolve_model_dir("smollm2-135m-instruct"))
    embedded = write_random_head(root / "head-embedded", c.hidden_size, c.vocab_size, "eagle3", draft_vocab=4096,
                                 heads=c.num_heads, kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                                 inter=c.intermediate_size)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "tiny")
    tiny = write_random_head(root / "head-tiny", 64, 64, "eagle")
    return {"tiny": (str(root / "tiny"), "EAGLE", str(tiny), (4, 2, 6)),
            "embedded": ("smollm2-135m-instruct", "EAGLE3", str(embedded), (5, 4, 8))}


def round_split(llm, bs: int, new_tokens: int, prompt: str | list[int]) -> dict:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    chat = isinstance(prompt, str)
    llm.generate([prompt] * bs, SamplingParams(max_new_tokens=4, ignore_eos=True), chat=chat)  # warm-up
    syncs = count_syncs(lambda: llm.generate([prompt] * bs, params, chat=chat))
    start = time.perf_counter()
    outputs = llm.generate([prompt] * bs, params, chat=chat)  # tok/s without phase syncs
    wall = time.perf_counter() - start
    split = llm.engine.times.synced_split(lambda: llm.generate([prompt] * bs, params, chat=chat),
                                          llm.engine.config.device)  # phase times, not launch times
    rounds = max(o.metrics.verify_rounds for o in outputs)
    split = {k: round(v / rounds * 1000, 2) for k, v in split.items() if k != "prefill"}
    split["host_share"] = round(split["host"] / split["round"], 3)
    return {"batch_size": bs, "rounds": rounds, "ms_per_round": split,
            "tok_s": round(sum(len(o.output_ids) for o in outputs) / wall, 2),
            "host_syncs_per_round": None if syncs is None else round(syncs / rounds, 2)}


def count_syncs(run) -> int | None:
    """Device -> host synchronisations during `run()` (CUDA's sync debug mode; None without a GPU)."""
    if not torch.cuda.is_available():
        return None
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def rounds(setup: tuple, sizes: tuple[int, ...], new_tokens: int, modes: list[str], dtype: str) -> dict:
    """Per mode, per batch size: ms per round in each phase (buckets prepared ahead, outside the timing)."""
    model, algorithm, head, (steps, topk, n) = setup
    out = {}
    for mode in modes:
        llm = fastspec.LLM(model, quantization=None, speculative_algorithm=algorithm, draft_model=head,
                           num_steps=steps, topk=topk, num_draft_tokens=n, max_total_tokens=8192, graphs=mode, cuda_graph_bs=sizes,
                           max_running_requests=max(sizes), dtype=dtype)
        prompt = PROMPT if model == "smollm2-135m-instruct" else [2 + i % 60 for i in range(24)]  # tiny: no tokenizer
        out[mode] = [round_split(llm, bs, new_tokens, prompt) for bs in sizes]
        del llm
    return out


def startup(setup: tuple, mode: str, cache: Path) -> dict:
    """A fresh process: import, engine build, first token (prefill), first decode round (graphs prepared lazily)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-c", STARTUP, json.dumps([*setup, mode])], env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"start-up run failed ({setup[0]}, {mode}):\n{done.stderr[-2000:]}")
    return {k: round(v, 2) for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--skip-rounds", action="store_true")
    parser.add_argument("--skip-startup", action="store_true")
    parser.add_argument("--models", default="tiny,embedded", help="start-up and rounds: tiny, embedded or both")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "graphs.json"))
    parser.add_argument("--modes", default="eager,compile" + (",cuda" if torch.cuda.is_available() else ""))
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    models = make_models(tmp)
    out = Path(args.output)
    out.parent.mkdir(exist_ok=True)
    results = {"machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                           "cuda": torch.cuda.is_available() and torch.cuda.get_device_name()}, "dtype": args.dtype}
    if not args.skip_startup:
        results["startup"] = {}
        for name in args.models.split(","):
            for mode in args.modes.split(","):
                cache = tmp / f"inductor-{name}-{mode}"  # empty: the first run is cold, the second warm
                key = f"{name} {mode}"
                results["startup"][key] = {run: startup(models[name], mode, cache) for run in ("cold", "warm")}
                print(key, json.dumps(results["startup"][key]), flush=True)
                out.write_text(json.dumps(results, indent=2))  # what is measured so far survives a failure
    if not args.skip_rounds:
        sizes = tuple(int(b) for b in args.batch_sizes.split(","))
        results["rounds"] = {name: rounds(models[name], sizes, args.max_new_tokens, args.modes.split(","), args.dtype)
                             for name in args.models.split(",")}
    print(json.dumps(results, indent=2))
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
