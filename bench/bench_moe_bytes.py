"""One quantised MoE layer's experts inside a CUDA graph, as a decode step runs them: microseconds a call and the
expert bytes it must read against the device's copy bandwidth, per format and token rows.

    python3 bench/bench_moe_bytes.py [--shape qwen3-30b-a3b] [--rows 1,4,16] [--output bench/results/moe_bytes.json]

Ways, each over the same stored forms (fp8 128 x 128 blocks as Qwen3-30B-A3B-FP8; int4 groups of 128 with offsets
as AWQ; int8 per output channel as GPTQ int8):
  linear dense     LinearExperts with each expert bound as a model binds it (W8A8 fp8 block GEMM, tinygemm, the byte
                   GEMM): every expert on every token, what graphs ran before experts were stacked
  stacked          ByteExperts as the model runs it in a graph: gathered where rows * top_k < experts, else dense
  stacked dense    ByteExperts' dense path at every row count (the gathered path's reference cost)
Each way's output is first checked against LinearExperts' eager sparse forward (the largest error relative to the
output's largest value). "limit_us" is the bytes the chosen experts hold (each distinct expert once) over the copy
bandwidth. On CPU (`--device cpu`, the small shape; TRITON_INTERPRET=1 FASTSPEC_TRITON_QUANT=1 for the kernels) the
script runs through: a dry run, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch
from bench_quant_gemm import block_fp8, timed_us
from gpu_decode import copy_bandwidth, release

from fastspec.models.byte_experts import stack_bytes
from fastspec.models.gguf_blocks import quantise_rows
from fastspec.models.moe import LinearExperts
from fastspec.models.quant_layers import QuantLinear, bind
from fastspec.models.quantise import online_form
from fastspec.models.quant_weights import IntWeight

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "small": (16, 2, 256, 128)}  # experts, top_k, hidden, expert width


def stored(w: torch.Tensor, kind: str):
    if kind == "fp8 block":
        return block_fp8(w)
    if kind == "int4":
        return IntWeight(quantise_rows(lambda ids: w[ids], w.shape[0], group=128))
    return online_form(w, "int8")


def experts(kind: str, E: int, hidden: int, inter: int, device: str) -> LinearExperts:
    gen = torch.Generator(device=device).manual_seed(0)
    rand = lambda n, k: torch.randn(n, k, generator=gen, device=device) / k ** 0.5  # noqa: E731
    return LinearExperts([QuantLinear(stored(rand(2 * inter, hidden), kind)) for _ in range(E)],
                         [QuantLinear(stored(rand(hidden, inter), kind)) for _ in range(E)])


class Call(torch.nn.Module):
    """module(x, weights, index) with the routing fixed: what timed_us captures."""

    def __init__(self, fn, weights, index):
        super().__init__()
        self.fn, self.weights, self.index = fn, weights, index

    def forward(self, x):
        return self.fn(x, self.weights, self.index)


def measure(args) -> dict:
    E, k, hidden, inter = SHAPES[args.shape]
    bandwidth = copy_bandwidth(args.device)
    report = {}
    for kind in ("fp8 block", "int4", "int8"):
        linear = experts(kind, E, hidden, inter, args.device)
        stacked = stack_bytes(linear)
        per_expert = sum(t.numel() * t.element_size() for t in stacked.buffers()) / E
        bound = LinearExperts([bind(m, None) for m in linear.gate_up], [bind(m, None) for m in linear.down])
        ways = {"linear dense": bound, "stacked": stacked, "stacked dense": stacked.forward_dense}
        rows = report[kind] = {}
        for T in args.rows:
            gen = torch.Generator().manual_seed(T)
            index = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(args.device)
            weights = torch.rand(T, k, generator=gen).to(args.device)
            x = torch.randn(T, hidden, generator=gen).to(args.device, args.dtype)
            want = linear(x, weights, index).float()
            entry = rows[f"rows {T}"] = {"limit_us": None}
            if bandwidth:
                entry["limit_us"] = round(per_expert * index.unique().numel() / (bandwidth * 1e3), 2)
            for name, module in ways.items():
                try:
                    fn = module  # eagerly what the graph runs: its kernels compiled before capturing
                    if name == "stacked":
                        fn = module.forward_gathered if T * k < E else module.forward_dense
                    got = fn(x, weights, index).float()
                    error = ((got - want).abs().max() / want.abs().max()).item()
                    us = timed_us(Call(module, weights, index), x, args.calls, args.trials, copies=1)
                    entry[name] = {"us": round(us, 2), "max_error": round(error, 5)}
                except Exception as e:  # noqa: BLE001 - a kernel this device or build lacks: recorded, the rest go on
                    entry[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(f"{kind:10s} rows {T:3d} {json.dumps(entry)}", flush=True)
        del linear, stacked, bound, ways
        release()
    return {"bandwidth_gb_s": bandwidth, "report": report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--shape", default="qwen3-30b-a3b" if cuda else "small", choices=list(SHAPES))
    parser.add_argument("--rows", default="1,4,16", help="token rows per call")
    parser.add_argument("--dtype", default=None, help="activations: default bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--calls", type=int, default=8, help="calls per timed graph")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "moe_bytes.json"))
    args = parser.parse_args()
    args.rows = sorted({int(r) for r in args.rows.split(",")})
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    result = {"command": shlex.join([sys.executable, *sys.argv]), "device": device, "torch": torch.__version__,
              "shape": args.shape, "rows": args.rows} | measure(args)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
