"""The modules a quantised linear runs as, and the choice among them per device (`bind`):

  QuantLinear     the stored form (quant_weights: IntWeight / Fp8Weight), dequantised on each call: runs anywhere,
                  exact (the weights a dequantising reference computes), the slow twin of the others
  PermutedLinear  a GPTQ desc_act weight: the inputs gathered into its column order, then its linear
  on CUDA the modules of cuda_linears (fp8 W8A8 per channel or per block, tinygemm, the Triton byte GEMM), and on
  CPU the packed kernels of packed_layers: 4-bit blocks on fastspec's int16 kernel (BlockLinear) or torch's int4
  one (Int4Linear), 8-bit blocks and fp8 weights (re-rounded to 8 bits per 16 values) on BlockLinear, else a
  CastLinear over the dequantised weight. `gemm_kernels` names what each linear of a model runs.
Does not read checkpoints (quant_decode, loader).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from fastspec.kernels import cpu_q4, fp8_block
from fastspec.models.cuda_linears import ByteLinear, Fp8BlockLinear, Fp8Linear, TinyGemmLinear
from fastspec.models.gguf_blocks import BLOCK, Blocks, round_8bit
from fastspec.models.activation_choice import float_dtype
from fastspec.models.packed_layers import BlockLinear, CastLinear, int4_linear
from fastspec.models.quant_weights import Fp8Weight, IntWeight, QuantWeight, merge


class QuantLinear(nn.Module):
    """y = x @ w.T (+ b) with w dequantised from its stored form on every call (see the module docstring)."""

    gemm_kernel = "dequantised per call, F.linear"

    def __init__(self, form: QuantWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = form.shape
        self.kind = type(form)
        self.fields = {}  # non-tensor fields of the form (bits, cols)
        for name, value in _flat(form).items():
            if isinstance(value, torch.Tensor) or value is None:
                self.register_buffer(name, value)
            else:
                self.fields[name] = value
        self.register_buffer("bias", bias)

    @property
    def form(self) -> QuantWeight:
        values = {**{n: b for n, b in self._buffers.items() if n != "bias"}, **self.fields}
        if self.kind is IntWeight:
            return IntWeight(Blocks(values["q"], values["scale"], values["offset"], values["bits"]), values["perm"])
        return Fp8Weight(values["weight"], values["scale"], values["cols"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.form.dequantise(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    @staticmethod
    def merge(parts: list[QuantLinear]) -> QuantLinear | None:
        """The parts stacked by rows (fused QKV / gate_up), or None where their forms cannot be merged."""
        form = merge([p.form for p in parts])
        if form is None or any((p.bias is None) != (parts[0].bias is None) for p in parts):
            return None
        bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
        return QuantLinear(form, bias)


def _flat(form: QuantWeight) -> dict:
    if isinstance(form, IntWeight):
        b = form.blocks
        return dict(q=b.q, scale=b.scale, offset=b.offset, bits=b.bits, perm=form.perm)
    return dict(weight=form.weight, scale=form.scale, cols=form.cols)


class PermutedLinear(nn.Module):
    """y = inner(x[..., perm]): a weight whose groups run over its inputs in another order (GPTQ desc_act)."""

    def __init__(self, perm: torch.Tensor, inner: nn.Module):
        super().__init__()
        self.register_buffer("perm", perm.long().contiguous())  # int64 [K]
        self.inner = inner
        self.out_features, self.in_features = inner.out_features, inner.in_features

    @property
    def gemm_kernel(self) -> str:
        return gemm_kernel(self.inner) + ", inputs gathered"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.index_select(-1, self.perm))


def bind(linear: QuantLinear, activation: torch.dtype | None) -> nn.Module:
    """The module `linear` runs as where it lives: on CPU (`activation`: activation_choice.fast_activation) a packed
    kernel where one takes its shape; on CUDA where the GPU has fp8 tensor cores Fp8Linear for a per-channel fp8
    weight and Fp8BlockLinear for block fp8, TinyGemmLinear for 4-bit groups of 32 to 256, ByteLinear for the rest
    (8-bit, other 4-bit groups, fp8 without fp8 tensor cores); on CPU with FASTSPEC_TRITON_QUANT=1 (the Triton
    kernels' tests, interpreted) Fp8BlockLinear for block fp8 and ByteLinear for the rest; else `linear` itself
    (dequantised per call)."""
    form, bias = linear.form, linear.bias
    device = (bias if bias is not None else next(linear.buffers())).device
    if device.type == "cuda" or os.environ.get("FASTSPEC_TRITON_QUANT") == "1":
        cores = fp8_block.fp8_tensor_cores(device)
        if (isinstance(form, Fp8Weight) and form.per_channel and cores and form.shape[0] % 16 == 0
                and form.shape[1] % 16 == 0):
            return Fp8Linear(form, bias)
        if isinstance(form, Fp8Weight) and Fp8BlockLinear.takes(form) and (cores or device.type == "cpu"):
            return Fp8BlockLinear(form, bias)
        if isinstance(form, IntWeight) and device.type == "cuda" and TinyGemmLinear.takes(form.blocks):
            inner = TinyGemmLinear(form.blocks, bias)
        elif ByteLinear.takes(form):
            inner = ByteLinear(form, bias)
        else:
            return linear
        return inner if isinstance(form, Fp8Weight) or form.perm is None else PermutedLinear(form.perm, inner)
    if device.type != "cpu" or activation is None:
        return linear
    whole_groups = form.shape[1] % cpu_q4.GROUP == 0  # inputs the kernels take (any N: they pad it to their tile)
    if isinstance(form, Fp8Weight):
        if activation == torch.int16 and whole_groups:  # an 8-bit grid per 16 values over the e4m3 ones
            return BlockLinear.from_blocks(round_8bit(form.dequantise()), bias)
        return CastLinear(form.dequantise(float_dtype(activation)), bias)
    blocks, inner = form.blocks, None
    if whole_groups and blocks.bits == 4 and blocks.group % BLOCK == 0:
        inner = int4_linear(_regroup(blocks, BLOCK), activation, bias)
    elif whole_groups and activation == torch.int16 and blocks.group % 16 == 0:
        inner = BlockLinear.from_blocks(_regroup(blocks, 16) if blocks.bits == 8 else blocks, bias)
    if inner is None:
        return CastLinear(form.dequantise(float_dtype(activation)), bias)
    return inner if form.perm is None else PermutedLinear(form.perm, inner)


def _regroup(blocks: Blocks, group: int) -> Blocks:
    """The same weight with a scale and offset per `group` values (a divisor of its own group: repeated)."""
    repeat = blocks.group // group
    if repeat == 1:
        return blocks
    return Blocks(blocks.q, blocks.scale.repeat_interleave(repeat, -1), blocks.offset.repeat_interleave(repeat, -1),
                  blocks.bits)


def gemm_kernel(module: nn.Module) -> str | None:
    """The GEMM kernel a linear module runs (its `gemm_kernel`; F.linear for an nn.Linear), None for other modules."""
    if isinstance(module, nn.Linear):
        return f"F.linear {str(module.weight.dtype).removeprefix('torch.')}"
    return getattr(module, "gemm_kernel", None)


def gemm_kernels(model: nn.Module) -> dict[str, int]:
    """How many of `model`'s linears run each GEMM kernel (`fastspec bench --profile` names them), most used first;
    a linear's own inner modules are not counted again."""
    counts: dict[str, int] = {}

    def walk(module: nn.Module) -> None:
        name = gemm_kernel(module)
        if name is not None:
            counts[name] = counts.get(name, 0) + 1
            return
        for child in module.children():
            walk(child)

    walk(model)
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def bind_linears(model: nn.Module, activation: torch.dtype | None) -> int:
    """Every QuantLinear of `model` (in place) as `bind` chooses; returns how many were replaced by another module."""
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, QuantLinear):
                bound = bind(child, activation)
                replaced += bound is not child
                setattr(module, name, bound)
    return replaced
