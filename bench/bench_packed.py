"""Packed-weight GEMM kernels on this CPU at the embedded model's shapes: what one token's linears cost in each
weight format, so the packed-GGUF path picks its kernel and activation dtype by measurement (AMX, AVX-512 and
AVX2-only boxes rank them differently).

    .venv/bin/python bench/bench_packed.py [--rows 1,8] [--trials 7] [--threads N]
    .venv/bin/python bench/bench_packed.py --end-to-end [--trials 3]

Every variant runs the linears of all 30 layers (fused QKV, o, fused gate_up, down) and the lm_head, each layer
with weights of its own (~100-540 MB in all, so they stream from memory as in a real step, not from cache), over
`rows` activation rows (1: a plain decode step, 8: a verify). Each variant's error is checked against float32
on the same dequantised weights first. Variants:
  float32 / bfloat16      F.linear on dequantised weights (float32 is the default path)
  int8 (bf16 / f32 act.)  torch's _weight_int8pack_mm, one scale per output channel (Q8_0 re-quantised per row)
  int4 (bf16 / f32 act.)  the engine's Int4Linear (torch's _weight_int4pack_mm_for_cpu, group 32): Q4_0 / Q4_1
                          exactly (w = (q - 8) * scale + zero: Q4_1's d*q + m is scale d, zero m + 8d)
  int4 / int8 (int16 act.) fastspec's own kernels (BlockLinear, kernels/cpu_q4.c): the Q4_1 blocks as stored, and
                          the same values as 8-bit blocks of 16 (the layout of Q8_0 / Q6_K weights)
  dequant+linear          Q4_1 nibbles unpacked to float32 per call, then F.linear (eager; the exact fallback)
With --end-to-end: the embedded model as `fastspec generate` runs it at batch 1 (4 chat questions, 64 greedy
tokens each, trials alternating between the engines), plain and EAGLE-3 (every round speculating), each with
its projections dequantised (float32), kept packed (`quantization="gguf"`, the default) and rounded again to 4 bits
at load (`quantization="int4"`), each packed one on this machine's fastest kernel: median tok/s and each one's ratio
to dequantised plain decoding.
Writes bench/results/packed.json (packed_end_to_end.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fastspec.kernels import cpu_q4
from fastspec.models.gguf_blocks import BLOCK as GROUP
from fastspec.models.gguf_blocks import Blocks, as_8bit_16
from fastspec.models.packed_layers import BlockLinear, Int4Linear, int4_matmul

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49152  # SmolLM2-135M
Q_KV = 576 + 2 * 192  # 9 query heads, 3 KV heads of 64
SHAPES = [(Q_KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]  # [N, K] per layer


def q4_1(n: int, k: int, gen: torch.Generator) -> Blocks:
    """A random Q4_1 weight [n, k]: nibbles 0..15, per-32 scale d and min m."""
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
    d = torch.rand(n, k // GROUP, generator=gen) * 0.01
    m = -8 * d + torch.randn(n, k // GROUP, generator=gen) * 0.001
    return Blocks(q, d, m, 4)


def build(variant: str, blocks: Blocks):
    """(weight data, fn(x, data) -> y) of one linear in this format."""
    w = blocks.dequantise()
    if variant in ("float32", "bfloat16"):
        return w.to(getattr(torch, variant)), F.linear
    if variant.endswith("int16 act"):  # fastspec's own kernels (BlockLinear): 4-bit as stored, or as 8-bit values
        b = Blocks(blocks.q.to(torch.uint8), blocks.scale, blocks.offset, 4)
        linear = BlockLinear.from_blocks(b if variant.startswith("int4") else as_8bit_16(b))
        return (linear.packed, linear.scales), lambda x, data: cpu_q4.matmul(x, *data)
    if variant.startswith("int8"):
        scale = w.abs().amax(1) / 127
        w8 = torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8)
        dtype = torch.bfloat16 if "bf16" in variant else torch.float32
        return (w8, scale.to(dtype)), lambda x, data: torch.ops.aten._weight_int8pack_mm(x, *data)
    if variant.startswith("int4"):  # the engine's packed linear (--quantization gguf), its matmul called directly
        linear = Int4Linear.from_blocks(blocks, torch.bfloat16 if "bf16" in variant else torch.float32)
        return (linear.packed, linear.scale_zero), lambda x, data: int4_matmul(x, *data)
    if variant == "dequant+linear":
        q = blocks.q
        nibbles = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)  # two per byte, as 4-bit weights are kept

        def unpack_linear(x, data):
            b, d, m = data
            q_ = torch.stack([b & 15, b >> 4], -1).flatten(1)
            return F.linear(x, q_.float() * d.repeat_interleave(GROUP, 1) + m.repeat_interleave(GROUP, 1))
        return (nibbles, blocks.scale, blocks.offset), unpack_linear
    raise ValueError(variant)


VARIANTS = ["float32", "bfloat16", "int8 bf16 act", "int8 f32 act", "int4 bf16 act", "int4 f32 act",
            "int4 int16 act", "int8 int16 act", "dequant+linear"]


def activation_dtype(variant: str) -> torch.dtype:
    return torch.bfloat16 if variant == "bfloat16" or "bf16" in variant else torch.float32


def measure(variant: str, rows: int, trials: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    layers = [[build(variant, q4_1(n, k, gen)) for n, k in SHAPES] for _ in range(LAYERS)]
    head_q = q4_1(VOCAB, HIDDEN, gen)
    head = build(variant, head_q)
    dtype = activation_dtype(variant)
    xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in (HIDDEN, INTERMEDIATE)}
    # error against float32 on the same dequantised lm_head weights (the widest GEMM)
    ref = F.linear(xs[HIDDEN].float(), head_q.dequantise())
    error = float((head[1](xs[HIDDEN], head[0]).float() - ref).abs().max() / ref.abs().max())

    def token():
        for layer in layers:
            for (data, fn), (_, k) in zip(layer, SHAPES):
                fn(xs[k], data)
        head[1](xs[HIDDEN], head[0])

    token()  # first call: packing caches, allocator
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        token()
        times.append(time.perf_counter() - start)
    nbytes = sum(t.numel() * t.element_size() for layer in layers for data, _ in layer
                 for t in (data if isinstance(data, tuple) else (data,)))
    return {"variant": variant, "rows": rows, "ms_per_token": round(1000 * statistics.median(times), 2),
            "weight_mb": round(nbytes / 2**20, 1), "max_rel_error": round(error, 6)}


QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain recursion briefly.",
             "Give me three tips for sleeping well."]


def end_to_end(trials: int) -> list[dict]:
    import fastspec
    from fastspec.sampling import SamplingParams

    arms = {(algo, quant): fastspec.LLM(speculative_algorithm=algo, quantization=quant, max_total_tokens=4096,
                                        tuned=False) for algo in ("NONE", "EAGLE3") for quant in (None, "gguf", "int4")}
    params = SamplingParams(max_new_tokens=64)
    rates = {arm: [] for arm in arms}
    for llm in arms.values():
        llm.engine.policy = None  # every round speculates
        llm.generate(QUESTIONS[:1], SamplingParams(max_new_tokens=8), chat=True)  # first calls
    for _ in range(trials):
        for arm, llm in arms.items():
            tokens, seconds = 0, 0.0
            for q in QUESTIONS:
                start = time.perf_counter()
                [out] = llm.generate([q], params, chat=True)
                seconds += time.perf_counter() - start
                tokens += len(out.output_ids)
            rates[arm].append(tokens / seconds)
    base = statistics.median(rates[("NONE", None)])
    return [{"algorithm": algo, "weights": quant or "dequantised float32", "tok_s": round(statistics.median(r), 1),
             "vs_plain_float32": round(statistics.median(r) / base, 2)} for (algo, quant), r in rates.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--end-to-end", action="store_true", help="the embedded model's tok/s, packed vs not")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "packed.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.end_to_end:
        results = end_to_end(args.trials)
        for r in results:
            print(f"{r['algorithm']:7s} {r['weights']:21s} {r['tok_s']:7.1f} tok/s  {r['vs_plain_float32']:5.2f}x")
        out = Path(args.out).with_name("packed_end_to_end.json")
        out.write_text(json.dumps({"threads": torch.get_num_threads(), "torch": torch.__version__,
                                   "results": results}, indent=1) + "\n")
        return
    results = []
    with torch.inference_mode():
        for rows in map(int, args.rows.split(",")):
            base = None
            for variant in VARIANTS:
                r = measure(variant, rows, args.trials)
                base = base or r["ms_per_token"]
                r["vs_float32"] = round(base / r["ms_per_token"], 2)
                results.append(r)
                print(f"rows {rows:2d}  {variant:15s} {r['ms_per_token']:8.2f} ms  {r['vs_float32']:5.2f}x  "
                      f"layer weights {r['weight_mb']:7.1f} MB  rel. error {r['max_rel_error']:.1e}", flush=True)
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps({"threads": torch.get_num_threads(), "torch": torch.__version__,
                                          "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
