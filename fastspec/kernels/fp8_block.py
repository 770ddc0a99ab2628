"""W8A8 GEMM for an fp8 weight with a scale per block of input columns (DeepSeek-V3's and Qwen3-FP8's 128 x 128
blocks): the activations rounded to e4m3 per token and per `group` inputs at run time (`quantise_groups`: scale =
max |x| / 448 over the group, as SGLang and vLLM round them), then

    y[m, n] = sum over groups g of  sx[m, g] * sw[n, g] * sum over k in g of  xq[m, k] * wq[n, k]

with the inner sums in float32 (a product of two e4m3 values is exact in float32). The weight's scale is kept per row
(a 128 x 128 block's scale repeated on its 128 rows), so any row blocking multiplies the same way. Three
implementations of the one product (`fp8_block_matmul`, an opaque op inside compiled and captured rounds), chosen
per weight by `kernel_for`:

  sgl_kernel  sgl_kernel.fp8_blockwise_scaled_mm (CUTLASS; sm90; N and K multiples of 128, 128 x 128 weight blocks)
  triton      fastspec's kernel: fp8 tensor-core dots on a GPU that has them (sm89+); elsewhere (Triton's
              interpreter on CPU, the tests) both operands' codes decoded to float32 and dotted in float32, since
              the interpreter's own fp8 dot is not exact
  torch       the twin: both operands dequantised, one float32 GEMM
Knows nothing about checkpoints (fastspec.models.quant_decode reads the weights).
"""

from __future__ import annotations

import os

import torch

from fastspec.kernels.dispatch import sgl_kernel_op

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest e4m3 value


def quantise_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, ceil(K / group)]): each token's inputs rounded per `group` of
    them (group = K: per token) to x / scale, scale = max |x| / 448 over the group (a group of zeros: a tiny
    scale, zero codes)."""
    m, k = x.shape
    pad = -k % group
    g = torch.nn.functional.pad(x.float(), (0, pad)).view(m, -1, group)
    scale = g.abs().amax(-1).clamp_min(1e-12) / FP8_MAX
    q = (g / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(m, -1)
    return q[:, :k], scale


def matmul_twin(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, group: int) -> torch.Tensor:
    """The product in torch (float32 [M, N]): both operands dequantised per (row, group), one float32 GEMM."""
    k = xq.shape[1]
    x = xq.float() * sx.repeat_interleave(group, 1)[:, :k]
    return x @ (w.float() * sw.repeat_interleave(group, 1)[:, :k]).t()


def fp8_tensor_cores(device: torch.device) -> bool:
    """A CUDA device that multiplies e4m3 on tensor cores (sm89+)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def kernel_for(device: torch.device, n: int, k: int, group: int, square_blocks: bool) -> str:
    """The implementation a weight [n, k] with a scale per `group` inputs runs on `device`: sgl_kernel where it
    imports and takes the shape (`square_blocks`: the scales repeat over 128-row blocks), else triton on CUDA (or
    with FASTSPEC_TRITON_QUANT=1, e.g. the interpreter on CPU), else torch."""
    device = torch.device(device)
    if device.type == "cuda":
        if (sgl_kernel_op("fp8_blockwise_scaled_mm", device) is not None and group == 128 and square_blocks
                and n % 128 == 0 and k % 128 == 0 and torch.cuda.get_device_capability(device) >= (9, 0)):
            return "sgl_kernel"
        return "triton"
    return "triton" if os.environ.get("FASTSPEC_TRITON_QUANT") == "1" else "torch"


@torch.library.custom_op("fastspec::fp8_block_matmul", mutates_args=())
def fp8_block_matmul(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, group: int, kernel: str,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """xq e4m3 [M, K], sx float32 [M, K / group], w e4m3 [N, K], sw float32 scales (sgl_kernel: [N / 128, K / 128],
    else [N, K / group]) -> out_dtype [M, N]."""
    if kernel == "sgl_kernel":
        dtype = out_dtype if out_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        op = sgl_kernel_op("fp8_blockwise_scaled_mm", xq.device)
        y = op(xq, w.t(), sx.t().contiguous().t(), sw.t(), dtype)  # column-major activation scales
        return y.to(out_dtype)
    if kernel == "triton":
        from fastspec.kernels import triton_fp8

        return triton_fp8.matmul(xq, sx, w, sw, group, out_dtype, native=fp8_tensor_cores(xq.device))
    return matmul_twin(xq, sx, w, sw, group).to(out_dtype)


@fp8_block_matmul.register_fake
def _(xq, sx, w, sw, group, kernel, out_dtype):
    return xq.new_empty(xq.shape[0], w.shape[0], dtype=out_dtype)
