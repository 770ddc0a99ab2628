"""The fused CPU attention kernel (fastspec.kernels.cpu_fused.attend) at the embedded model's head shapes: one layer's
decode attention, one layer's tree verify and one layer's prefill of as many tokens, over context lengths from a
short chat turn to a long one.

Each trial runs all `--layers` layers, each over KV caches of its own (the pool's layers, so the keys stream from
memory as in a real step rather than staying in cache), and reports microseconds per layer (median of trials),
with torch's SDPA over the same dense plan (the twin, TorchAttnBackend) beside it. The KV slots of a request are
its pool pages in shuffled order, as a pool serving several requests hands them out. `--kv-dtypes`: the kernel also
over caches stored in these dtypes (--kv-cache-dtype), the same values rounded.

    .venv/bin/python bench/bench_attention_cpu.py [--keys 64,300,1000,2000] [--heads 9,3,64] [--trials 7]
        [--kv-dtypes bfloat16,float16]

Writes bench/results/attention_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from fastspec.attention import TorchAttnBackend, decode_metadata, extend_metadata
from fastspec.attention.paged import PagedAttnBackend, paged_block_plan
from fastspec.kernels import cpu_fused

RESULTS = Path(__file__).parent / "results" / "attention_cpu.json"
TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)  # 4 tokens, 2 paths


def plans(keys: int, slots: torch.Tensor) -> dict:
    """A decode of one token seeing `keys` keys, a 4-token tree verify after `keys` - 1 committed ones, and a prompt of
    `keys` tokens prefilled at once (causal)."""
    table = slots[None].to(torch.int32)
    decode = TorchAttnBackend().plan(decode_metadata(table, torch.tensor([0]), torch.tensor([keys])))
    zero = torch.tensor([0])
    prefill = TorchAttnBackend().plan(extend_metadata(table, zero, zero, torch.tensor([keys])))
    prefix = keys - 1
    verify = PagedAttnBackend().dense(paged_block_plan(table, torch.tensor([0]), torch.tensor([prefix]),
                                                       slots[None, prefix:prefix + 4], TREE[None]))
    return {"decode": (decode, 1), "verify": (verify, 4), "prefill": (prefill, keys)}


def time_layers(fn, layers: int, trials: int) -> float:
    """Median over trials of one pass over every layer, in microseconds per layer."""
    fn(0)
    samples = []
    for _ in range(trials):
        start = time.perf_counter()
        for layer in range(layers):
            fn(layer)
        samples.append((time.perf_counter() - start) / layers * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", default="64,300,1000,2000")
    parser.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head dim (the embedded model's)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--kv-dtypes", default="", help="other cache dtypes to time the kernel over, e.g. bfloat16")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not cpu_fused.available():
        raise SystemExit("no C compiler: the fused CPU kernels are not built here")
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    others = [getattr(torch, name) for name in args.kv_dtypes.split(",") if name]
    g = torch.Generator().manual_seed(0)
    rows = []
    for keys in (int(x) for x in args.keys.split(",")):
        num_slots = keys + 8
        slots = torch.randperm(num_slots - 1, generator=g)[:keys + 3] + 1
        k = torch.randn(args.layers, num_slots, hkv, d, generator=g)
        v = torch.randn(args.layers, num_slots, hkv, d, generator=g)
        for name, (plan, tokens) in plans(keys, slots).items():
            q = torch.randn(tokens, hq, d, generator=g)
            fused = time_layers(lambda i: cpu_fused.attend(plan, q, k[i], v[i], d ** -0.5, torch.float32),
                                args.layers, args.trials)
            sdpa = time_layers(lambda i: TorchAttnBackend().run(plan, q, k[i], v[i], d ** -0.5), args.layers,
                               args.trials if tokens < 64 else 1)
            row = dict(keys=keys, step=name, tokens=tokens, fused_us=round(fused, 1), sdpa_us=round(sdpa, 1))
            line = f"{keys:6d} keys  {name:7s} ({tokens} tok)  fused {fused:8.1f} us/layer   torch SDPA {sdpa:8.1f}"
            for dtype in others:
                kd, vd = k.to(dtype), v.to(dtype)
                us = time_layers(lambda i: cpu_fused.attend(plan, q, kd[i], vd[i], d ** -0.5, torch.float32),
                                 args.layers, args.trials)
                row[f"fused_{str(dtype)[6:]}_us"] = round(us, 1)
                line += f"   {str(dtype)[6:]} cache {us:8.1f} ({fused / us:.2f}x)"
            rows.append(row)
            print(line)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(dict(heads=[hq, hkv, d], layers=args.layers, threads=torch.get_num_threads(),
                                           rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
