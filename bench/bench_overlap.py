"""Overlap schedule: tok/s with the next round launched ahead (`--overlap-schedule on`) vs serial (`off`), and how
much of the host work outside the worker's steps the overlap hides.

    .venv/bin/python bench/bench_overlap.py [--batch-sizes 1,4,8,16] [--max-new-tokens 48] [--trials 2]
        [--gpu-ms 4] [--skip-real] [--skip-simulated]

Two parts. **Real**: the embedded model with EAGLE-3 (the shipped head) and with NGRAM, on this machine, through
`fastspec.LLM.generate` with a stop string (so the incremental detokenizer runs between steps, as in a chat),
fallback off. **Simulated GPU**: a 2-layer random Llama (STANDALONE drafting for itself, and NGRAM) whose every
speculative round also occupies a virtual device for `--gpu-ms` after its launch (queued behind the round before,
as on a stream); the round's one read sleeps until then, the core free meanwhile, to see what overlap hides when
rounds are a few ms: under overlap the worker launches round K+1 before reading round K. Trials alternate the two
modes; medians. Real: `host` = wall time per step outside the worker's step (the engine's hand-out, the caller's
detokenizing), `hidden` = wall time saved per step / serial host. Simulated: `hidden` = wall time saved per step /
the most overlap could save (the smaller of the device's time and the host's). Both modes must hand
out the same tokens (checked). Writes bench/results/overlap.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import fastspec
from fastspec.sampling import SamplingParams

PROMPTS = ["Explain how a refrigerator keeps food cold.", "Write a haiku about autumn rain.",
           "List three uses of a paperclip.", "What is the capital of Australia, and why not Sydney?"]


def timed_worker(llm, gpu_ms: float) -> dict:
    """Count the time inside the worker's steps (in whichever thread runs them). With gpu_ms, a simulated GPU:
    every speculative round launched keeps a virtual device busy for gpu_ms after the device is free, and the
    round's one read (its finish) sleeps until then, so the core is free meanwhile, as while a GPU runs the
    round's kernels; a round launched ahead of the last one's read queues behind it, as on a stream."""
    worker, busy = llm.engine.worker, {"s": 0.0, "steps": 0}
    step, launch, finish = worker.step, worker.spec_rounds.launch, worker.spec_rounds.finish
    device = {"free_at": 0.0, "done_at": {}}

    def timed(reqs, prefill):
        start = time.perf_counter()
        result = step(reqs, prefill)
        busy["steps"] += bool(reqs)
        busy["s"] += time.perf_counter() - start
        return result

    def launched(reqs, params, before):
        p = launch(reqs, params, before)
        done = max(time.perf_counter(), device["free_at"]) + gpu_ms / 1000
        device["free_at"] = device["done_at"][id(p)] = done
        return p

    def finished(p):
        time.sleep(max(0.0, device["done_at"].pop(id(p)) - time.perf_counter()))
        return finish(p)

    worker.step = timed
    if gpu_ms:
        worker.spec_rounds.launch, worker.spec_rounds.finish = launched, finished
    return busy


def run(llm, busy, prompts, bs: int, params) -> tuple[float, float, int, list]:
    """(wall seconds, seconds inside worker steps, steps, outputs) for all prompts in batches of bs."""
    busy["s"], busy["steps"], outputs = 0.0, 0, []
    start = time.perf_counter()
    for i in range(0, len(prompts), bs):
        chunk = prompts[i:i + bs]  # with a stop string through the text API (detokenizing), else token ids only
        done = llm.generate(chunk, params) if params.stop else llm.engine.generate(chunk, [params] * len(chunk))
        outputs += [o.output_ids for o in done]
    return time.perf_counter() - start, busy["s"], busy["steps"], outputs


def compare(make, prompts, batch_sizes, params, trials: int, gpu_ms: float = 0.0) -> list[dict]:
    llms = {mode: make(mode) for mode in ("off", "on")}
    busy = {mode: timed_worker(llm, gpu_ms) for mode, llm in llms.items()}
    rows = []
    for bs in batch_sizes:
        batch = [prompts[i % len(prompts)] for i in range(max(bs, len(prompts)))]
        for mode in llms:  # warm-up (graphs, allocator, caches)
            run(llms[mode], busy[mode], batch[:bs], bs, params)
        seen = {m: {"wall": [], "busy": [], "steps": [], "tokens": 0, "out": None} for m in llms}
        for _ in range(trials):
            for mode in llms:
                wall, inside, steps, outs = run(llms[mode], busy[mode], batch, bs, params)
                s = seen[mode]
                s["wall"].append(wall), s["busy"].append(inside), s["steps"].append(steps)
                s["tokens"], s["out"] = sum(map(len, outs)), outs
        med = {m: {k: statistics.median(seen[m][k]) for k in ("wall", "busy", "steps")} for m in llms}
        off, on = med["off"], med["on"]
        # hideable per step: the host work outside the worker's steps; with a simulated GPU, the smaller of the
        # device time and the host time (serial wall per step less the device's)
        host_off = (off["wall"] - off["busy"]) / off["steps"]
        if gpu_ms:
            host_off = min(off["wall"] / off["steps"] - gpu_ms / 1000, gpu_ms / 1000)
        saved = off["wall"] / off["steps"] - on["wall"] / on["steps"]  # per step
        rows.append({"batch_size": bs, "tok_s_off": round(seen["off"]["tokens"] / off["wall"], 2),
                     "tok_s_on": round(seen["on"]["tokens"] / on["wall"], 2),
                     "speedup": round(off["wall"] / on["wall"], 3),
                     "step_ms_off": round(off["busy"] / off["steps"] * 1000, 2),
                     "host_ms_per_step_off": round(host_off * 1000, 2),
                     "wall_ms_per_step_off": round(off["wall"] / off["steps"] * 1000, 2),
                     "wall_ms_per_step_on": round(on["wall"] / on["steps"] * 1000, 2),
                     "hidden": round(saved / host_off, 2) if host_off > 0 else None,
                     "same_tokens": seen["off"]["out"] == seen["on"]["out"]})
        print(json.dumps({k: v for k, v in rows[-1].items()}), file=sys.stderr)
    return rows


def tiny_model(root: Path) -> str:
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "tiny")
    return str(root / "tiny")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,4,8,16")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--gpu-ms", type=float, default=4.0)
    parser.add_argument("--skip-real", action="store_true")
    parser.add_argument("--skip-simulated", action="store_true")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "overlap.json"))
    args = parser.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True, stop=("<never printed>",))
    results = {"machine": {"cpus": torch.get_num_threads(), "cuda": torch.cuda.is_available() and
                           torch.cuda.get_device_name()}, "gpu_ms": args.gpu_ms, "dtype": args.dtype}
    if not args.skip_real:
        base = fastspec.LLM(speculative_algorithm="NONE")
        prompts = [base.encode(p, chat=True) for p in PROMPTS]
        del base
        for algorithm in ("EAGLE3", "NGRAM"):
            print(f"real: {algorithm}", file=sys.stderr)
            results[f"real {algorithm}"] = compare(
                lambda mode, a=algorithm: fastspec.LLM(speculative_algorithm=a, overlap_schedule=mode,
                                                       speculative_fallback=False, max_total_tokens=16384,
                                                       dtype=args.dtype),
                prompts, sizes, params, args.trials)
    if not args.skip_simulated:
        with tempfile.TemporaryDirectory() as tmp:
            model = tiny_model(Path(tmp))
            prompts = [[1 + (7 * i + j) % 60 for j in range(12 + i)] for i in range(4)]
            print(f"simulated GPU: {args.gpu_ms} ms per round", file=sys.stderr)
            for algorithm in ("STANDALONE", "NGRAM"):  # STANDALONE: the model drafts for itself (3 steps, chain)
                shape = dict(draft_model=model, num_steps=3, topk=1, num_draft_tokens=4) if algorithm == "STANDALONE" \
                    else {}
                make = lambda mode, a=algorithm, d=shape: fastspec.LLM(  # noqa: E731
                    model, speculative_algorithm=a, overlap_schedule=mode, speculative_fallback=False,
                    max_total_tokens=8192, **d)
                results[f"simulated {algorithm}"] = compare(
                    make, prompts, sizes, SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True),
                    args.trials, gpu_ms=args.gpu_ms)
    Path(args.output).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
