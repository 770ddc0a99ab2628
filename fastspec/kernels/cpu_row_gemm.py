"""Row-invariant float linears on CPU: float32 / bfloat16 / float16 weights multiplied by fastspec's own GEMM
(cpu_row_gemm.c), in which a row's outputs are bit for bit the same alone and among any other rows.

Why: a speculative run reports exactly what target-only decoding reports only if a verify row computes what its
token's decode step computes, and a prompt token what it computes after a prefix-cache hit. The CPU BLAS's GEMMs
choose kernels by the row count: MKL's sgemm rounds 1 to 3 rows otherwise than the same rows among 4 or more (so
logprobs differed by ~1e-7 between plain and speculative runs, and a greedy near-tie could flip), oneDNN's bfloat16
GEMM rounds a row by the rows beside it on EPYC. Applied after loading, on CPU, to every float linear of the target
and the draft (`row_invariant_linears`); under torch.compile the GEMM is the custom op `fastspec::row_gemm`. Without
the C library the linears stay torch's.
"""

from __future__ import annotations

import torch
from torch import nn

from fastspec.kernels import cpu_library

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # cpu_rows.h's codes


def row_gemm(x: torch.Tensor,       # [M, K] in w's dtype
             w: torch.Tensor,       # [N, K] float32 | bfloat16 | float16
             ) -> torch.Tensor:     # float32 [M, N]
    """x @ w.T summed in float32, each output in one fixed order whatever M is (cpu_row_gemm.c); without the library
    the twin, torch's float32 product (not row-invariant)."""
    lib = cpu_library.library()
    if lib is None:
        return x.float() @ w.float().T
    x, w = x.contiguous(), w.contiguous()
    y = torch.empty(x.shape[0], w.shape[0])
    if x.shape[0]:
        cpu_library.call(lib.row_gemm, x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), w.shape[0],
                         DTYPE_CODES[w.dtype], y.data_ptr())
    return y


def row_dots(x: torch.Tensor,                 # [M, K]
             w: torch.Tensor,                 # [M, R, K] in x's dtype: each row's own R weight rows; with at, [E, R, K]
             at: torch.Tensor | None = None,  # int64 [M]: row m's weight rows are w[at[m]]
             ) -> torch.Tensor:               # float32 [M, R]
    """x[m] . w[m, r] (with `at`: x[m] . w[at[m], r]) for each row's own weight rows (candidate tokens of an lm_head,
    the expert a MoE token chose), each the dot product row_gemm computes for that row and weight row; without the
    library the twin, torch's batched product over the gathered weights."""
    lib = cpu_library.library()
    if lib is None:
        return torch.bmm((w if at is None else w[at]).float(), x.float()[:, :, None]).squeeze(-1)
    x, w = x.contiguous(), w.contiguous()
    at = None if at is None else at.to(torch.int64).contiguous()
    y = torch.empty(x.shape[0], w.shape[1])
    if y.numel():
        cpu_library.call(lib.row_dots, x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(),
                         None if at is None else at.data_ptr(), w.shape[1], DTYPE_CODES[w.dtype], y.data_ptr())
    return y


@torch.library.custom_op("fastspec::row_dots", mutates_args=())
def row_dots_op(x: torch.Tensor, w: torch.Tensor, at: torch.Tensor | None = None) -> torch.Tensor:
    """row_dots as an opaque op for torch.compile."""
    return row_dots(x, w, at)


@row_dots_op.register_fake
def _(x, w, at=None):
    return x.new_empty(x.shape[0], w.shape[1], dtype=torch.float32)


@torch.library.custom_op("fastspec::row_gemm", mutates_args=())
def row_gemm_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """row_gemm as an opaque op for torch.compile (Inductor would lower a matmul to the CPU BLAS)."""
    return row_gemm(x, w)


@row_gemm_op.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32)


class RowLinear(nn.Module):
    """y = x @ W.T (+ b) for a float weight through row_gemm: x is cast to W's dtype, the float32 sums (plus the
    bias) rounded to x's dtype, as F.linear rounds its own."""

    gemm_kernel = "fastspec row-invariant GEMM"

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # shared, not copied (a tied lm_head stays tied)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        return row_linear(x, self.weight, self.bias)


def row_linear(x: torch.Tensor,                # [..., K]
               weight: torch.Tensor,           # [N, K] float32 | bfloat16 | float16
               bias: torch.Tensor | None,      # [N]
               ) -> torch.Tensor:              # [..., N] in x's dtype
    """x @ weight.T (+ bias) through row_gemm: x cast to the weight's dtype, the float32 sums (plus the bias) rounded
    once to x's dtype."""
    flat = x.reshape(-1, weight.shape[1]).to(weight.dtype)
    gemm = row_gemm_op if torch.compiler.is_compiling() else row_gemm
    y = gemm(flat, weight.detach())
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def head_matmul(x: torch.Tensor,      # [T, H, K]
                w: torch.Tensor,      # [H, N, K]
                ) -> torch.Tensor:    # [T, H, N] in x's dtype
    """x[:, h] @ w[h].T for each head h through row_linear (MLA's absorbed products: a token's outputs whatever
    tokens share the call)."""
    return torch.stack([row_linear(x[:, h], w[h], None) for h in range(w.shape[0])], 1)


def expert_linear(x: torch.Tensor,     # [P, K]
                  w: torch.Tensor,     # [E, N, K] float32 | bfloat16 | float16: experts' stacked weights
                  at: torch.Tensor,    # int64 [P]: the expert of each row
                  ) -> torch.Tensor:   # [P, N] in x's dtype
    """x[p] @ w[at[p]].T for each row, row_linear's product for that row and expert (row_dots, reading only the
    chosen experts' weights: a MoE step's gathered experts)."""
    dots = row_dots_op if torch.compiler.is_compiling() else row_dots
    return dots(x.to(w.dtype), w.detach(), at).to(x.dtype)


def takes(weight: torch.Tensor) -> bool:
    """Whether row_gemm multiplies by `weight` where it lives: a CPU weight of a dtype the kernel reads."""
    return weight.device.type == "cpu" and weight.dtype in DTYPE_CODES


def row_invariant_linears(model: nn.Module) -> nn.Module:
    """Every float nn.Linear of `model` on the CPU, at any depth, as a RowLinear (in place) where the C library
    builds."""
    if cpu_library.available():
        _swap(model)
    return model


def _swap(model: nn.Module) -> None:
    for name, child in list(model.named_children()):
        if type(child) is nn.Linear and takes(child.weight):
            setattr(model, name, RowLinear(child))
        else:
            _swap(child)
