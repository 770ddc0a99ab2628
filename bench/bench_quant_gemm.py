"""The quantised-weight GEMMs of a CUDA step one by one, at a model's linear shapes: microseconds a call and the
weight bytes it streams against the device's copy bandwidth, so each format's kernel (and the Triton kernels' tile
width) is chosen by measurement.

    python3 bench/bench_quant_gemm.py [--shape llama-8b] [--rows 1,4,16,64] [--output bench/results/quant_gemm.json]

Kernels, each where the device runs it:
  bf16                 F.linear on bfloat16 weights (the float baseline, 2 bytes a weight)
  fp8 channel          Fp8Linear: torch._scaled_mm, W8A8 with row-wise scales (online --quantization fp8)
  fp8 block triton/N   Fp8BlockLinear's Triton GEMM, W8A8 over 128 x 128 blocks (Qwen3-FP8, DeepSeek-V3), tile
                       width N = 32 / 64 / 128 outputs
  fp8 block sgl        the same through sgl-kernel's fp8_blockwise_scaled_mm, where installed
  fp8 block cublas     torch's F.scaled_mm with BlockWise1x128 x BlockWise128x128 (not wired into the model: this
                       says whether it should be)
  fp8 bytes/N          ByteLinear over the block-fp8 weight (weight-only: GPUs without fp8 tensor cores)
  int8 bytes/N         ByteLinear over int8 per output channel (GPTQ int8)
  int4 tinygemm        TinyGemmLinear, 4 bits in groups of 128 (AWQ / GPTQ int4, online int4)
  int4 bytes/N         ByteLinear over the same 4-bit groups
Each kernel's output is first checked against its stored form dequantised (the largest error relative to the
output's largest value). Timing: CUDA graphs of `--calls` calls over distinct copies of the weight (more bytes
than the L2 cache holds), replayed `--trials` times; the best replay counts. On CPU (`--device cpu`, small
shapes; the Triton kernels too under TRITON_INTERPRET=1) the script runs through: a dry run, not a measurement.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_decode import copy_bandwidth, release

from fastspec.kernels import fp8_block
from fastspec.models.gguf_blocks import quantise_rows
from fastspec.models.cuda_linears import ByteLinear, Fp8BlockLinear, Fp8Linear, TinyGemmLinear
from fastspec.models.quant_layers import QuantLinear
from fastspec.models.quantise import online_form
from fastspec.models.quant_weights import Fp8Weight, IntWeight

SHAPES = {  # name -> {linear: (outputs N, inputs K)}
    "llama-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "qwen3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)},
    "small": {"qkv": (384, 256), "down": (256, 512)},
}
L2_BYTES = 4 * 60 * 2**20  # a few times the largest L2 cache of the GPUs fastspec runs on (60 MB)


def block_fp8(w: torch.Tensor) -> Fp8Weight:
    """`w` [N, K] as block fp8: a scale per 128 x 128 block (max |w| / 448), repeated on the block's rows."""
    n, k = w.shape
    blocks = w.float().view(n // 128, 128, k // 128, 128).abs().amax((1, 3)) / 448  # [N/128, K/128]
    scale = blocks.clamp_min(1e-12).repeat_interleave(128, 0)
    q = (w.float() / scale.repeat_interleave(128, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return Fp8Weight(q, scale, 128)


class ScaledMmBlock(torch.nn.Module):
    """torch's own block-scaled fp8 GEMM (cuBLAS): activations per token and 128 inputs, weights per 128 x 128."""

    def __init__(self, form: Fp8Weight):
        super().__init__()
        self.weight, self.blocks = form.weight, form.scale[::128].contiguous()  # [N / 128, K / 128]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, sx = fp8_block.quantise_groups(x, 128)
        return F.scaled_mm(xq, self.weight.t(), sx.t().contiguous().t(), F.ScalingType.BlockWise1x128,
                           self.blocks.t(), F.ScalingType.BlockWise128x128, output_dtype=x.dtype)


class Tiled(torch.nn.Module):
    """A ByteLinear / Fp8BlockLinear with another Triton tile width: its kernel called directly."""

    def __init__(self, inner: torch.nn.Module, block_n: int):
        super().__init__()
        self.inner, self.block_n = inner, block_n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.inner
        if isinstance(m, ByteLinear):
            from fastspec.kernels import triton_quant

            return triton_quant.matmul(x, m.w, m.scale, m.offset, m.cols, m.fmt, self.block_n)
        from fastspec.kernels import triton_fp8

        xq, sx = fp8_block.quantise_groups(x, m.group)
        return triton_fp8.matmul(xq, sx, m.weight, m.scale, m.group, x.dtype, self.block_n,
                                 native=fp8_block.fp8_tensor_cores(x.device))


def kernels(w: torch.Tensor, device: str) -> dict[str, tuple[torch.nn.Module, torch.nn.Module, int]]:
    """name -> (module, its stored form as a QuantLinear (the reference), weight bytes a call streams)."""
    cuda = device.startswith("cuda")
    n, k = w.shape
    fp8b, int8, int4 = block_fp8(w), online_form(w, "int8"), IntWeight(quantise_rows(lambda ids: w[ids], n, group=128))
    ref = {name: QuantLinear(form) for name, form in (("fp8b", fp8b), ("int8", int8), ("int4", int4))}
    fp8c = online_form(w, "fp8")
    b8, b4 = n * k + n * k // 32, n * k // 2 + n * k // 16  # e4m3 / int8 bytes + scales; nibbles + scales, offsets
    out = {"bf16": (torch.nn.Linear(k, n, bias=False).to(device, torch.bfloat16 if cuda else torch.float32), None,
                    2 * n * k)}
    out["bf16"][0].weight.data.copy_(w)
    cores = fp8_block.fp8_tensor_cores(torch.device(device))
    if cores:
        out["fp8 channel"] = (Fp8Linear(fp8c), QuantLinear(fp8c), n * k + 4 * n)
    block = Fp8BlockLinear(fp8b, None, "triton" if cuda else "torch")
    if not cuda:
        out["fp8 block torch"] = (block, ref["fp8b"], b8)
    if cuda or os.environ.get("TRITON_INTERPRET") == "1":  # Triton compiled, or interpreted for a dry run
        for bn in (32, 64, 128):
            out[f"fp8 block triton/{bn}"] = (Tiled(block, bn), ref["fp8b"], b8)
    if cuda:
        if fp8_block.kernel_for(torch.device(device), n, k, 128, True) == "sgl_kernel":
            out["fp8 block sgl"] = (Fp8BlockLinear(fp8b, None, "sgl_kernel"), ref["fp8b"], b8)
        if cores and hasattr(F, "scaled_mm"):
            out["fp8 block cublas"] = (ScaledMmBlock(fp8b), ref["fp8b"], b8)
    if cuda or os.environ.get("TRITON_INTERPRET") == "1":
        for name, form in (("fp8", fp8b), ("int8", int8), ("int4", int4)):
            for bn in (32, 64, 128):
                out[f"{name} bytes/{bn}"] = (Tiled(ByteLinear(form), bn), ref[{"fp8": "fp8b"}.get(name, name)],
                                             b4 if name == "int4" else b8)
    if cuda:
        out["int4 tinygemm"] = (TinyGemmLinear(int4.blocks), ref["int4"], b4)
    return out


def timed_us(module: torch.nn.Module, x: torch.Tensor, calls: int, trials: int, copies: int) -> float:
    """Microseconds a call: `calls` calls over `copies` copies of the module, captured in one CUDA graph (CPU:
    timed eagerly), the best of `trials` replays."""
    mods = [module] + [copy.deepcopy(module) for _ in range(copies - 1)]
    run = lambda: [mods[i % copies](x) for i in range(calls)]  # noqa: E731
    if x.is_cuda:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        best = float("inf")
        for _ in range(trials):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            graph.replay()
            end.record()
            end.synchronize()
            best = min(best, begin.elapsed_time(end) * 1e3 / calls)
        del graph
        return best
    run()
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        run()
        best = min(best, (time.perf_counter() - start) * 1e6 / calls)
    return best


def measure(args) -> dict:
    bandwidth = copy_bandwidth(args.device)
    report = {}
    for linear, (n, k) in SHAPES[args.shape].items():
        gen = torch.Generator(device=args.device).manual_seed(n + k)
        w = torch.randn(n, k, generator=gen, device=args.device) / k ** 0.5
        rows = report[f"{linear} {n}x{k}"] = {}
        for name, (module, reference, nbytes) in kernels(w, args.device).items():
            entry = rows[name] = {"weight_mb": round(nbytes / 1e6, 2)}
            try:
                x = torch.randn(max(args.rows), k, generator=gen, device=args.device).to(args.dtype)
                if reference is not None:
                    got, want = module(x).float(), reference.to(args.device)(x.float()).float()
                    entry["max_error"] = round(((got - want).abs().max() / want.abs().max()).item(), 5)
                copies = max(1, min(8, -(-L2_BYTES // nbytes))) if x.is_cuda else 1
                for m in args.rows:
                    us = timed_us(module, x[:m].contiguous(), args.calls, args.trials, copies)
                    entry[f"m{m}_us"] = round(us, 2)
                    if bandwidth:
                        entry[f"m{m}_fraction_of_limit"] = round(nbytes / (bandwidth * 1e3) / us, 3)
            except Exception as e:  # noqa: BLE001 - a kernel this device or build lacks: recorded, the rest go on
                entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            print(f"{linear:8s} {name:20s} " + " ".join(f"{key}={value}" for key, value in entry.items()), flush=True)
            release()
    return {"bandwidth_gb_s": bandwidth, "shapes": report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--shape", default="llama-8b" if cuda else "small", choices=list(SHAPES))
    parser.add_argument("--rows", default="1,4,16,64", help="activation rows (tokens) per call")
    parser.add_argument("--dtype", default=None, help="activations: default bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--calls", type=int, default=32, help="calls per timed graph")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "quant_gemm.json"))
    args = parser.parse_args()
    args.rows = sorted({int(r) for r in args.rows.split(",")})
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    torch.manual_seed(0)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    result = {"command": shlex.join([sys.executable, *sys.argv]), "device": device, "torch": torch.__version__,
              "shape": args.shape, "rows": args.rows} | measure(args)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
