"""The GPU speed check, in one process: the embedded SmolLM2-135M under transformers' static-cache
`generate` (its built-in torch.compile on CUDA) and under fastspec plain / EAGLE-3 (ratios in one run, greedy
tokens compared), start-up to the first token, kernels per decode step, and an 8B-class figure: a
Llama-3.1-8B-shaped target with random weights built on the device (`load_format="dummy"`) against the
memory-bandwidth limit, plus one EAGLE-3 round at SGLang's shape with a random head (fp8 / int4 weights: parts
8b_fp8 / 8b_int4); 8b_long_kv: its decode after a 4096-token prompt over a bf16 and an fp8 KV cache.

    python bench/gpu_decode.py [--parts startup,transformers,fastspec,kernels,8b] [--max-new-tokens 256]
        [--batch-sizes 1,16] [--trials 1] [--output bench/results/gpu_decode.json]
    .venv/bin/python bench/gpu_decode.py --device cpu --max-new-tokens 8 --batch-sizes 1,2 --small   # CPU smoke

A part that fails or runs past --part-timeout records its error and the next one runs; the JSON is rewritten after
every measurement. On CPU (float32, eager) the numbers mean nothing. bench/README.md says what each part measures.
Owns measuring only: it drives fastspec through `fastspec.LLM`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from unittest.mock import patch

import torch
from bench_decode import time_transformers
from peers import MODEL, first_divergence, versions

import fastspec
from fastspec.benchmark.profile import profile_step
from fastspec.config import parse_dtype
from fastspec.models.embedded import embedded_head
from fastspec.models.sources import resolve_model_dir
from fastspec.sampling import SamplingParams
from fastspec.utils.metrics import SpecMetrics

# run in this order: start-up first, while cold
PARTS = ("startup", "transformers", "fastspec", "kernels", "8b", "8b_fp8", "8b_int4", "8b_long_kv")
LONG_PROMPT = 4096  # 8b_long_kv: prompt tokens before the timed decode (--small: 512)
EAGLE_SHAPES = {"eagle3 5/4/8": (5, 4, 8), "eagle3 chain 3/1/4": (3, 1, 4)}  # (num_steps, topk, num_draft_tokens)
SGLANG_8B_SHAPE = (5, 8, 32)  # SGLang docs' EAGLE-3 launch example for Llama-3.1-8B-Instruct
SMOLLM2_SHAPE = dict(architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152, rms_norm_eps=1e-5,
                     rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True, eos_token_id=2)
LLAMA31_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, eos_token_id=[128001, 128008, 128009])
LLAMA31_TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=2, vocab_size=2048, eos_token_id=[2])  # --small: the same config, tiny
LLAMA31_ROPE = dict(rope_theta=500000.0, rope_scaling={
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192})


@dataclass(frozen=True)
class Run:
    seconds: float  # wall time, prefill included
    outputs: list[list[int]]  # [bs] generated ids
    metrics: SpecMetrics  # summed over the requests
    marks: list[tuple[float, int]]  # (seconds since start, tokens handed out so far) after every engine step

    @property
    def tok_s(self) -> float:
        return sum(map(len, self.outputs)) / self.seconds

    @property
    def ms_per_step(self) -> float:
        """Decode steps only: from the first step's hand-out (the prefill's token, after its last chunk) to the last."""
        first = next((i for i, (_, tokens) in enumerate(self.marks) if tokens), 0)
        return (self.marks[-1][0] - self.marks[first][0]) * 1000 / max(len(self.marks) - 1 - first, 1)


def run(llm, prompts: list[list[int]], new_tokens: int) -> Run:
    """One batch of `prompts` to `new_tokens` each (EOS ignored, greedy) on an empty prefix cache."""
    params = [SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)] * len(prompts)
    llm.engine.flush_cache()
    outputs, metrics, marks = [[] for _ in prompts], SpecMetrics(), []
    start = time.perf_counter()
    for step in llm.engine.stream(prompts, params):
        for out in step:
            outputs[out.index].extend(out.new_ids)
            metrics = metrics + out.metrics if out.finish_reason is not None else metrics
        marks.append((time.perf_counter() - start, sum(map(len, outputs))))
    return Run(marks[-1][0], outputs, metrics, marks)


class Setup:
    """The model the embedded parts run, the LLM options they share and held-out prompt ids (made on first use)."""

    def __init__(self, args):
        self.args = args
        self.model, self.extra = MODEL, {}
        if args.dummy_embedded:
            self.model, self.extra = write_config(Path(tempfile.mkdtemp()) / "smollm2-shape", SMOLLM2_SHAPE), \
                {"load_format": "dummy"}

    @cached_property
    def prompts(self) -> list[list[int]]:
        from fastspec.prompts import load_prompts
        from fastspec.text.tokenizer import Tokenizer

        n, model_dir = max(self.args.batch_sizes), resolve_model_dir(self.model)
        if not (model_dir / "tokenizer.json").is_file():  # random weights of the shape: no tokenizer either
            return [[1] + [100 + (7 * i + 13 * j) % 900 for j in range(40)] for i in range(n)]
        texts, tokenizer = load_prompts("all"), Tokenizer(model_dir)  # held-out, spread over every set
        texts = [texts[i * len(texts) // n] for i in range(n)]
        return [tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]

    def llm(self, **options):
        a, n = self.args, max(self.args.batch_sizes)
        base = dict(dtype=a.dtype, device=a.device, graphs=a.graphs, overlap_schedule=a.overlap_schedule,
                    tuned=False, max_running_requests=n, cuda_graph_bs=tuple(a.batch_sizes),
                    max_total_tokens=n * (512 + a.max_new_tokens + 64))
        return fastspec.LLM(self.model, **(base | self.extra | options))


def eagle3(shape: tuple[int, int, int], head: Path | str | None = None) -> dict:
    steps, topk, n = shape
    return dict(speculative_algorithm="EAGLE3", draft_model=str(head or embedded_head(MODEL)), num_steps=steps,
                topk=topk, num_draft_tokens=n)


def write_config(directory: Path, config: dict) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def llama31_config(shape: dict) -> dict:
    """A Llama-3.1 config.json of `shape` (LLAMA31_8B, or --small's LLAMA31_TINY): llama3 rope scaling, untied, bf16."""
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", **shape, **LLAMA31_ROPE, rms_norm_eps=1e-5,
                max_position_embeddings=131072, tie_word_embeddings=False, torch_dtype="bfloat16",
                initializer_range=0.02)


# ---- parts: each fills `out` and calls `save()` after every measurement ---------------------------------------

def part_startup(setup: Setup, out: dict, save) -> None:
    """Cold (the first part of this process; model conversion included): EAGLE-3 5/4/8 as a user builds it, lazy
    graph buckets, seconds from LLM construction to the engine built, to the first token and to the first round."""
    start = time.perf_counter()
    llm = setup.llm(**eagle3(EAGLE_SHAPES["eagle3 5/4/8"]), cuda_graph_bs=None)
    out["build_s"] = round(time.perf_counter() - start, 2)
    marks = run(llm, setup.prompts[:1], 4).marks
    out["first_token_s"] = round(out["build_s"] + marks[0][0], 2)
    out["first_round_s"] = round(out["build_s"] + marks[min(1, len(marks) - 1)][0], 2)


def part_transformers(setup: Setup, out: dict, save) -> None:
    """transformers `generate` at batch 1 on the same model and prompt: static cache (compiled on CUDA), eager."""
    import transformers

    a, dtype = setup.args, parse_dtype(setup.args.dtype)
    if setup.extra:  # random weights of the shape (others than fastspec's: speed only)
        config = transformers.LlamaConfig(**{k: v for k, v in SMOLLM2_SHAPE.items() if k != "architectures"})
        with torch.device(a.device):
            hf = transformers.LlamaForCausalLM(config).to(dtype).eval()
    else:
        from fastspec.models.reference import transformers_model

        hf = transformers_model(resolve_model_dir(MODEL), dtype).to(a.device)
    out["version"] = transformers.__version__
    for name, options in (("static", {"cache_implementation": "static"}), ("eager", {})):
        time_transformers(hf, setup.prompts[0], a.max_new_tokens, **options)  # warm-up (static: compiles here)
        rates = [n / s for n, s in (time_transformers(hf, setup.prompts[0], a.max_new_tokens, **options)
                                    for _ in range(a.trials))]
        out[name] = {"tok_s": round(statistics.median(rates), 2),
                     "compiled": name == "static" and hf.device.type == "cuda"}
        save()


def part_fastspec(setup: Setup, out: dict, save) -> None:
    """Plain and EAGLE-3 (tuned shape, chain) per batch size: tok/s, tau, greedy tokens against plain, and how many
    graphs were prepared while timing (after a full-length warm-up: should be 0)."""
    a, plain = setup.args, {}
    configs = {"plain": {"speculative_algorithm": "NONE"}} | {k: eagle3(shape) for k, shape in EAGLE_SHAPES.items()}
    for name, options in configs.items():
        prepared, out[name] = [], {}

        def preparing(*key, seen=prepared, entry=out[name]):  # saved as it starts: a timeout shows what was running
            seen.append(key)
            entry["preparing_last"] = list(key)
            save()
        llm = setup.llm(**options, on_prepare=preparing)
        out[name]["overlap"] = llm.engine.overlap
        for bs in a.batch_sizes:
            prompts = setup.prompts[:bs]
            run(llm, prompts, a.max_new_tokens)  # warm-up: every graph this run needs
            before = len(prepared)
            runs = [run(llm, prompts, a.max_new_tokens) for _ in range(a.trials)]
            result = {"tok_s": round(statistics.median(r.tok_s for r in runs), 2),
                      "prepared_while_timed": len(prepared) - before}
            if name == "plain":
                plain[bs] = runs[0].outputs
            else:
                first = [first_divergence(tuple(p), tuple(s)) for p, s in zip(plain.get(bs, []), runs[0].outputs)]
                metrics = sum((r.metrics for r in runs), SpecMetrics())
                result |= {"tau": round(metrics.tau, 3), "same_tokens": bool(plain.get(bs)) and first == [None] * bs,
                           "first_divergence": first}
            out[name][f"bs{bs}"] = result
            out[name]["prepare_s"] = prepare_seconds(llm)
            save()
        for bs in a.batch_sizes if name != "eagle3 chain 3/1/4" else ():  # where a step's time goes
            out[name][f"profile_bs{bs}"] = profile_step(llm, setup.prompts[0], bs).as_dict()
            save()
        del llm
        release()


def prepare_seconds(llm) -> dict[str, dict[int, float]]:
    """Seconds each round function took to compile and capture, per batch bucket."""
    w = llm.engine.worker
    graphs = [w.decode_graphs, *w.verify_graphs.values(), getattr(w.drafter, "loop_graphs", None),
              getattr(w.drafter, "extend_graphs", None)]
    return {g.name: {bs: round(t, 2) for bs, t in g.runner.prepare_seconds.items()}
            for g in graphs if g is not None and g.runner is not None}


def part_kernels(setup: Setup, out: dict, save) -> None:
    """Device kernels per plain decode step from torch.profiler: (events of a 12-token run - a 4-token run) / 8, so
    prefill and start-up cancel; CUDA graphs of Inductor-fused code, of the eager kernels (FASTSPEC_FUSE=0), and
    eagerly. On CPU it counts CPU ops instead."""
    from torch.profiler import ProfilerActivity, profile

    a = setup.args
    activity = ProfilerActivity.CUDA if a.device.startswith("cuda") else ProfilerActivity.CPU
    with profile(activities=[activity]):  # CUPTI up before this part captures a graph (else replays may hide kernels)
        torch.ones(1, device=a.device).add_(1)
    modes = {"cuda": ("cuda", "1"), "cuda unfused": ("cuda", "0")} if a.graphs == "cuda" else {}
    for label, (graphs, fuse) in (modes | {"eager": ("eager", "1")}).items():
        with patch.dict(os.environ, FASTSPEC_FUSE=fuse):  # read as the graph runners are built
            llm = setup.llm(speculative_algorithm="NONE", graphs=graphs, cuda_graph_bs=(1,), max_running_requests=1)
        run(llm, setup.prompts[:1], 12)  # warm-up
        counts = [profiled(llm, setup.prompts[:1], n, activity) for n in (4, 12)]
        out[label] = {k + "_per_step": round((counts[1][k] - counts[0][k]) / 8, 1) for k in counts[0]}
        out[label]["profiled_events"] = counts
        save()
        del llm
        release()


def profiled(llm, prompts, new_tokens: int, activity) -> dict[str, int]:
    """One run's profiler events by trace category (the exported trace: stable across torch versions)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[activity]) as prof:
        run(llm, prompts, new_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(str(Path(tmp) / "trace.json"))
        events = json.loads((Path(tmp) / "trace.json").read_text())["traceEvents"]
    counts = Counter(e.get("cat") for e in events)
    if activity != ProfilerActivity.CUDA:
        return {"cpu_ops": counts["cpu_op"]}
    return {"kernels": counts["kernel"], "memcpy_memset": counts["gpu_memcpy"] + counts["gpu_memset"],
            "graph_launches": sum(e.get("name") == "cudaGraphLaunch" for e in events)}


def part_8b(setup: Setup, out: dict, save, quantization: str | None = None) -> None:
    """A Llama-3.1-8B-shaped target, random weights (load_format dummy), batch 1: decode ms/token against
    streamed weight bytes / measured copy bandwidth; then one EAGLE-3 round at SGLang's shape, random head.
    `quantization` fp8 / int4: its projections rounded at load (the bytes a step streams are the packed ones)."""
    a = setup.args
    shape = LLAMA31_TINY if a.small else LLAMA31_8B
    config = llama31_config(shape)
    root = Path(tempfile.mkdtemp(prefix="llama31-8b-shape-"))
    target = write_config(root / "target", config)
    out |= {"config": {k: shape[k] for k in shape if k != "eos_token_id"}, "bandwidth_gb_s": copy_bandwidth(a.device)}
    save()
    options = dict(load_format="dummy", dtype=a.dtype, device=a.device, graphs=a.graphs, tuned=False,
                   max_running_requests=1, cuda_graph_bs=(1,), max_total_tokens=1024 + a.max_new_tokens,
                   max_context_len=4096, quantization=quantization or "none")
    prompt = [[1] + [100 + (7 * j) % 1900 for j in range(31)]]
    llm = fastspec.LLM(target, speculative_algorithm="NONE", **options)
    model = llm.engine.model
    streamed = sum(p.numel() * p.element_size() for n, p in (*model.named_parameters(), *model.named_buffers())
                   if "embed_tokens" not in n and "rope" not in n)  # untied: the embedding table is gathered
    out["linears"] = dict(Counter(type(m).__name__ for m in model.modules() if hasattr(m, "out_features")))
    run(llm, prompt, a.max_new_tokens)  # warm-up
    timed = run(llm, prompt, a.max_new_tokens)
    out["plain"] = {"tok_s": round(timed.tok_s, 2), "ms_per_token": round(timed.ms_per_step, 3),
                    "streamed_weight_gb": round(streamed / 1e9, 3), "overlap": llm.engine.overlap,
                    "prepare_s": prepare_seconds(llm)}
    if out["bandwidth_gb_s"]:
        limit_ms = streamed / (out["bandwidth_gb_s"] * 1e9) * 1000
        out["plain"] |= {"limit_ms_per_token": round(limit_ms, 3),
                         "fraction_of_limit": round(limit_ms / timed.ms_per_step, 3)}
    save()
    out["plain"]["profile"] = profile_step(llm, prompt[0], 1).as_dict()
    save()
    del llm
    release()
    head = dict(config, architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
                target_hidden_size=shape["hidden_size"], draft_vocab_size=512 if a.small else 32000)
    llm = fastspec.LLM(target, **eagle3(SGLANG_8B_SHAPE, write_config(root / "head", head)), **options)
    new = min(a.max_new_tokens, 64)  # a random head accepts ~nothing: the cost of a round is the figure
    run(llm, prompt, new)  # warm-up
    timed = run(llm, prompt, new)
    out["eagle3_round"] = {"shape": "/".join(map(str, SGLANG_8B_SHAPE)), "ms_per_round": round(timed.ms_per_step, 3),
                           "tau": round(timed.metrics.tau, 3),
                           "plain_steps_per_round": round(timed.ms_per_step / out["plain"]["ms_per_token"], 2),
                           "prepare_s": prepare_seconds(llm)}
    save()
    out["eagle3_round"]["profile"] = profile_step(llm, prompt[0], 1).as_dict()
    del llm
    release()


def part_8b_long_kv(setup: Setup, out: dict, save) -> None:
    """The 8B-shaped target (dummy weights, batch 1) decoding after a long prompt, over a KV cache in the model's
    dtype and in fp8 e4m3 (--kv-cache-dtype): ms/token of each, the cache's bytes read a step beside them."""
    a = setup.args
    config = llama31_config(LLAMA31_TINY if a.small else LLAMA31_8B)
    target = write_config(Path(tempfile.mkdtemp(prefix="llama31-8b-long-")) / "target", config)
    length = 512 if a.small else LONG_PROMPT
    prompt = [[1] + [100 + (7 * j) % 1900 for j in range(length - 1)]]
    new = min(a.max_new_tokens, 64)
    for kv in ("auto", "fp8_e4m3"):
        llm = fastspec.LLM(target, speculative_algorithm="NONE", load_format="dummy", dtype=a.dtype, device=a.device,
                           graphs=a.graphs, tuned=False, max_running_requests=1, cuda_graph_bs=(1,),
                           max_total_tokens=length + 2 * new, max_context_len=length + 2 * new, quantization="none",
                           kv_cache_dtype=kv, radix_cache=False)
        pool = llm.engine.worker.memory.pools[0]
        run(llm, prompt, 4)  # warm-up
        decode_ms = run(llm, prompt, new).ms_per_step  # (the prefill's chunks left out)
        out[kv] = {"prompt_tokens": length, "decode_ms_per_token": round(decode_ms, 3),
                   "kv_mb_read_per_token": round(2 * pool.k[:, :length].numel() * pool.k.element_size() / 1e6, 1)}
        save()
        del llm, pool
        release()
    out["fp8 / auto decode speed"] = _ratio(out["auto"]["decode_ms_per_token"], out["fp8_e4m3"]["decode_ms_per_token"])


PART_FUNCTIONS = {"startup": part_startup, "transformers": part_transformers, "fastspec": part_fastspec,
                  "kernels": part_kernels, "8b": part_8b,
                  "8b_fp8": lambda *a: part_8b(*a, quantization="fp8"),
                  "8b_int4": lambda *a: part_8b(*a, quantization="int4"), "8b_long_kv": part_8b_long_kv}


def copy_bandwidth(device: str, gib: float = 2.0, repeats: int = 5) -> float | None:
    """GB/s of a device-to-device copy of a `gib` GiB tensor (bytes read + written); None off CUDA."""
    if not device.startswith("cuda"):
        return None
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    end.synchronize()
    gb_s = 2 * src.numel() * repeats / (begin.elapsed_time(end) / 1000) / 1e9
    del src, dst
    release()
    return round(gb_s, 1)


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- the run -------------------------------------------------------------------------------------------------

def summary(parts: dict) -> dict[str, float | bool | None]:
    """The figures the issue's targets name, with the ratios between them."""
    get = lambda *keys: _dig(parts, keys)  # noqa: E731
    rows = {"transformers static tok/s (bs1)": get("transformers", "static", "tok_s"),
            "start-up: first token s (cold)": get("startup", "first_token_s")}
    for name in ("plain", *EAGLE_SHAPES):
        for bs in (1, 16):
            rows[f"{name} tok/s (bs{bs})"] = get("fastspec", name, f"bs{bs}", "tok_s")
            if name != "plain":
                rows[f"{name} / plain (bs{bs})"] = _ratio(rows[f"{name} tok/s (bs{bs})"], rows[f"plain tok/s (bs{bs})"])
                rows[f"{name} tau (bs{bs})"] = get("fastspec", name, f"bs{bs}", "tau")
                rows[f"{name} same tokens (bs{bs})"] = get("fastspec", name, f"bs{bs}", "same_tokens")
    rows["plain / transformers static (bs1)"] = _ratio(rows["plain tok/s (bs1)"],
                                                       rows["transformers static tok/s (bs1)"])
    for mode in ("cuda", "cuda unfused", "eager"):
        rows[f"kernels per decode step ({mode})"] = get("kernels", mode, "kernels_per_step")
    for part, label in (("8b", "8B"), ("8b_fp8", "8B fp8"), ("8b_int4", "8B int4")):
        rows |= {f"{label} plain ms/token": get(part, "plain", "ms_per_token"),
                 f"{label} fraction of bandwidth limit": get(part, "plain", "fraction_of_limit"),
                 f"{label} EAGLE-3 round ms": get(part, "eagle3_round", "ms_per_round")}
    rows["8B after 4k tokens: fp8 KV / bf16 KV decode speed"] = get("8b_long_kv", "fp8 / auto decode speed")
    return {k: v for k, v in rows.items() if v is not None}


def _dig(tree: dict, keys: tuple):
    for key in keys:
        tree = tree.get(key) if isinstance(tree, dict) else None
    return tree


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if a and b else None


def _cut_off(signum, frame):
    raise TimeoutError("cut off by --part-timeout")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--trials", type=int, default=1, help="timed runs per configuration and batch size (median)")
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--graphs", default=None, help="default: cuda on CUDA, eager on CPU")
    parser.add_argument("--overlap-schedule", default="auto")
    parser.add_argument("--part-timeout", type=int, default=150, help="seconds a part may run before it is cut off")
    parser.add_argument("--small", action="store_true", help="the 8B part on a tiny config of the same kind")
    parser.add_argument("--dummy-embedded", action="store_true", help="random weights of the embedded model's shape")
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "gpu_decode.json"))
    args = parser.parse_args()
    on_gpu = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    args.graphs = args.graphs or ("cuda" if on_gpu else "eager")
    args.batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    args.parts = [p.strip() for p in args.parts.split(",")]
    unknown = set(args.parts) - set(PARTS)
    if unknown or args.max_new_tokens < 2 or args.trials < 1 or min(args.batch_sizes) < 1:
        parser.error(f"unknown parts {sorted(unknown)}" if unknown
                     else "--max-new-tokens must be >= 2, --trials and batch sizes >= 1")
    return args


def main() -> None:
    args = parse_args()
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    report = {"command": shlex.join([sys.executable, *sys.argv]), "device": device, "versions": versions(),
              "settings": {k: getattr(args, k) for k in ("max_new_tokens", "batch_sizes", "trials", "dtype", "graphs",
                                                         "overlap_schedule", "small", "dummy_embedded")},
              "parts": {}}

    def save() -> None:
        out_path.write_text(json.dumps(report | {"summary": summary(report["parts"])}, indent=2))

    setup = Setup(args)
    signal.signal(signal.SIGALRM, _cut_off)
    for name in (p for p in PARTS if p in args.parts):
        out = report["parts"][name] = {}
        started = time.perf_counter()
        signal.alarm(args.part_timeout)
        try:
            PART_FUNCTIONS[name](setup, out, save)
        except Exception as e:  # a part that fails or hangs must not cost the others their numbers
            traceback.print_exc()
            out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        finally:
            signal.alarm(0)
        out["part_s"] = round(time.perf_counter() - started, 1)
        release()
        save()
        print(f"== {name} ({out['part_s']} s){' error: ' + out['error'] if 'error' in out else ''}", flush=True)
    print(f"\n{device}, {args.dtype}, graphs {args.graphs}, {args.max_new_tokens} new tokens -> {out_path}")
    for key, value in summary(report["parts"]).items():
        print(f"  {key:42} {value}")


if __name__ == "__main__":
    main()
