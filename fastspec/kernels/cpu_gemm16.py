"""Row-invariant 16-bit float linears on CPU: bfloat16 / float16 weights multiplied by fastspec's own GEMM
(cpu_gemm16.c), in which a row's outputs are bit for bit the same alone and among any other rows.

Why: losslessness rests on a verify row computing what its token's decode step computes, and a prefill token what
it computes after a prefix-cache hit. torch's CPU bfloat16 GEMM (oneDNN) rounds a row by the rows beside it on some
CPUs (EPYC: row M-1 of an M-row product differs from the row alone at M = 3, 13, 17, ...), so a 16-bit float target
could flip a greedy near-tie by the batch it ran in. Applied after loading, on CPU, to the linears of a 16-bit target
and draft (`row_invariant_linears`); under torch.compile the GEMM is the custom op `fastspec::gemm16`. Without the C
library the linears stay torch's.
"""

from __future__ import annotations

import torch
from torch import nn

from fastspec.kernels import cpu_library

DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2}  # cpu_rows.h's codes


def gemm16(x: torch.Tensor,       # [M, K] in w's dtype
           w: torch.Tensor,       # [N, K] bfloat16 | float16
           ) -> torch.Tensor:     # float32 [M, N]
    """x @ w.T summed in float32, each output in one fixed order whatever M is (cpu_gemm16.c)."""
    lib = cpu_library.library()
    x, w = x.contiguous(), w.contiguous()
    y = torch.empty(x.shape[0], w.shape[0])
    if x.shape[0]:
        cpu_library.call(lib.gemm16, x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), w.shape[0],
                         DTYPE_CODES[w.dtype], y.data_ptr())
    return y


@torch.library.custom_op("fastspec::gemm16", mutates_args=())
def gemm16_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """gemm16 as an opaque op for torch.compile (Inductor would lower a matmul to the CPU BLAS)."""
    return gemm16(x, w)


@gemm16_op.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32)


class Linear16(nn.Module):
    """y = x @ W.T (+ b) for a bfloat16 / float16 weight through gemm16: x is cast to W's dtype, the float32 sums
    (plus the bias) rounded to x's dtype, as F.linear rounds its own."""

    gemm_kernel = "fastspec row-invariant 16-bit GEMM"

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # shared, not copied (a tied lm_head stays tied)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        flat = x.reshape(-1, self.in_features).to(self.weight.dtype)
        gemm = gemm16_op if torch.compiler.is_compiling() else gemm16
        y = gemm(flat, self.weight.detach())
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


def row_invariant_linears(model: nn.Module) -> nn.Module:
    """Every 16-bit nn.Linear of `model`, at any depth, as a Linear16 (in place) where the C library builds."""
    if cpu_library.available():
        _swap(model)
    return model


def _swap(model: nn.Module) -> None:
    for name, child in list(model.named_children()):
        if type(child) is nn.Linear and child.weight.dtype in DTYPE_CODES and child.weight.device.type == "cpu":
            setattr(model, name, Linear16(child))
        else:
            _swap(child)
