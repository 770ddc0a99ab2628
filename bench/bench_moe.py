"""A MoE layer's compiled decode step (router and routed experts, fastspec.models.moe, on CPU) with its experts run
dense (every expert on every token, what compiled rounds ran before) against gathered (each token's chosen experts'
weights only: what they run when batch x top_k < experts), at Qwen3-MoE-like routing (softmax top-k of E, no
shared expert) with narrow experts so that a 2-core machine runs it.

    .venv/bin/python bench/bench_moe.py [--configs 64x4,128x8] [--bs 1,4] [--hidden 512] [--inter 256]
                                        [--dtype bfloat16] [--trials 15]

Both compiled fullgraph with the rounds' backend; each checked to compute the eager (sparse) step's output bit for
bit first. Trials alternate between the two; medians, in microseconds, and dense / gathered. Writes
bench/results/moe.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from fastspec.graphs.compile_backend import inductor_without_host_sync
from fastspec.models.arch_config import MoEConfig
from fastspec.models.moe import MoE

RESULTS = Path(__file__).parent / "results" / "moe.json"


def moe_layer(E: int, k: int, hidden: int, inter: int, dtype: torch.dtype) -> MoE:
    m = MoEConfig(num_experts=E, num_shared_experts=0, intermediate_size=inter, top_k=k, n_group=1, topk_group=1,
                  scoring="softmax", topk_method="greedy", norm_topk_prob=True, routed_scaling_factor=1.0,
                  first_k_dense_replace=0)
    layer = MoE(hidden, m)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=hidden ** -0.5)
    return layer.to(dtype)


def step(layer: MoE, path: str):
    """The layer's step with its experts run by `path` (forward_dense or forward_gathered), compiled."""
    def fn(x):
        return getattr(layer.experts, path)(x, *layer.gate(x))
    return torch.compile(fn, backend=inductor_without_host_sync, fullgraph=True, dynamic=False)


def measure(layer: MoE, bs: int, hidden: int, dtype: torch.dtype, trials: int) -> dict:
    x = torch.randn(bs, hidden).to(dtype)
    steps = {path: step(layer, path) for path in ("forward_dense", "forward_gathered")}
    with torch.no_grad():
        eager = layer.experts.forward_sparse(x, *layer.gate(x))
        for path, fn in steps.items():
            if not torch.equal(fn(x), eager):
                raise SystemExit(f"{path} computed other bits than the eager step")
        times = {path: [] for path in steps}
        for _ in range(trials):
            for path, fn in steps.items():
                start = time.perf_counter()
                fn(x)
                times[path].append(time.perf_counter() - start)
    us = {path.removeprefix("forward_"): round(1e6 * statistics.median(t), 1) for path, t in times.items()}
    return dict(bs=bs, us=us, dense_over_gathered=round(us["dense"] / us["gathered"], 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="64x4,128x8", help="experts x top_k, comma-separated")
    parser.add_argument("--bs", default="1,4")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--inter", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    dtype, results = getattr(torch, args.dtype), []
    torch.manual_seed(0)
    for E, k in (tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")):
        layer = moe_layer(E, k, args.hidden, args.inter, dtype)
        for bs in (int(b) for b in args.bs.split(",")):
            if bs * k >= E:
                print(f"E {E} top {k} bs {bs}: bs x top_k >= E, compiled rounds run dense here; skipped")
                continue
            torch._dynamo.reset()
            results.append(dict(experts=E, top_k=k, **measure(layer, bs, args.hidden, dtype, args.trials)))
            r = results[-1]
            print(f"E {E:4d} top {k} bs {bs}: dense {r['us']['dense']:9.1f} us  gathered {r['us']['gathered']:8.1f} us"
                  f"  dense / gathered {r['dense_over_gathered']:.2f}x")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(dict(threads=torch.get_num_threads(), hidden=args.hidden, inter=args.inter,
                                           dtype=args.dtype, results=results), indent=1) + "\n")


if __name__ == "__main__":
    main()
