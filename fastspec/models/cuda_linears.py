"""The modules a quantised weight runs as on CUDA (quant_layers.bind chooses among them):

  Fp8Linear       W8A8: activations rounded to e4m3 per token at run time, torch._scaled_mm with row-wise scales
                  (CUDA with fp8 tensor cores; on CPU it is the same op's slow reference, used by the tests)
  Fp8BlockLinear  W8A8 for block fp8: activations rounded to e4m3 per token and block of inputs, sgl-kernel's or
                  fastspec's Triton block-scaled GEMM (CUDA with fp8 tensor cores)
  TinyGemmLinear  4-bit blocks through torch's tinygemm kernel (bfloat16 activations)
  ByteLinear      any form as bytes decoded inside a Triton GEMM (8-bit and other 4-bit blocks, block fp8 on a GPU
                  without fp8 tensor cores), its weight a ByteWeight (the codes; stacked for a MoE layer's experts:
                  fastspec.models.byte_experts)
Each names the kernel it runs (`gemm_kernel`, for bench --profile). The Triton ones run in Triton's interpreter on
CPU for the tests (FASTSPEC_TRITON_QUANT=1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fastspec.kernels import fp8_block
from fastspec.models.gguf_blocks import Blocks
from fastspec.models.quant_weights import Fp8Weight, QuantWeight


class Fp8Linear(nn.Module):
    """y = x @ w.T (+ b), W8A8: x rounded to e4m3 with a scale per token (max |x| / 448), multiplied in fp8 by
    torch._scaled_mm with the weight's scale per output channel."""

    gemm_kernel = "torch._scaled_mm, fp8 W8A8 per token"

    def __init__(self, form: Fp8Weight, bias: torch.Tensor | None = None):
        super().__init__()
        if not form.per_channel:
            raise ValueError("Fp8Linear takes one weight scale per output channel")
        self.out_features, self.in_features = form.shape
        self.register_buffer("weight", form.weight)  # e4m3 [N, K]
        self.register_buffer("scale", form.scale.reshape(1, -1).float().contiguous())  # [1, N]
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        xq, x_scale = fp8_block.quantise_groups(x.reshape(-1, self.in_features), self.in_features)  # x_scale [M, 1]
        out = torch.bfloat16 if x.is_cuda else x.dtype  # row-wise scales: bfloat16 output on CUDA
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=self.scale, out_dtype=out)
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Fp8BlockLinear(nn.Module):
    """y = x @ w.T (+ b), W8A8 for an fp8 weight with a scale per block of inputs (block fp8): x rounded to e4m3 per
    token and per block of inputs at run time, multiplied in fp8 (fastspec.kernels.fp8_block: sgl-kernel's CUTLASS
    GEMM, else fastspec's Triton one; the torch twin on CPU)."""

    NAMES = {"sgl_kernel": "sgl-kernel fp8_blockwise_scaled_mm", "triton": "fastspec Triton fp8 block GEMM",
             "torch": "fp8 block GEMM's torch twin"}

    def __init__(self, form: Fp8Weight, bias: torch.Tensor | None = None, kernel: str | None = None):
        super().__init__()
        self.out_features, self.in_features = n, k = form.shape
        self.group, scale = form.cols, form.scale.float()
        blocks = scale[::128] if n % 128 == 0 else None  # [N / 128, K / group]: one scale per 128 x 128 block
        square = blocks is not None and torch.equal(scale, blocks.repeat_interleave(128, 0))
        self.kernel = kernel or fp8_block.kernel_for(form.weight.device, n, k, self.group, square)
        self.register_buffer("weight", form.weight)  # e4m3 [N, K]
        self.register_buffer("scale", (blocks if self.kernel == "sgl_kernel" else scale).contiguous())
        self.register_buffer("bias", bias)

    @staticmethod
    def takes(form: Fp8Weight) -> bool:
        return not form.per_channel and form.cols % 32 == 0

    @property
    def gemm_kernel(self) -> str:
        return f"{self.NAMES[self.kernel]}, W8A8 per token and {self.group} inputs"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        xq, sx = fp8_block.quantise_groups(x.reshape(-1, self.in_features), self.group)
        y = torch.ops.fastspec.fp8_block_matmul(xq, sx, self.weight, self.scale, self.group, self.kernel, x.dtype)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class TinyGemmLinear(nn.Module):
    """y = x @ w.T (+ b) for a 4-bit weight on CUDA through torch's tinygemm kernel (bfloat16 activations; groups of
    32 to 256): w = (q - 8) * scale + zero per group, so zero = offset + 8 * scale holds any Blocks exactly."""

    GROUPS = (32, 64, 128, 256)
    gemm_kernel = "torch tinygemm int4 (_weight_int4pack_mm)"

    def __init__(self, blocks: Blocks, bias: torch.Tensor | None = None):
        super().__init__()
        n, k = blocks.q.shape
        self.out_features, self.in_features, self.group = n, k, blocks.group
        q = blocks.q.to(torch.int32)
        pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # [N, K/2]: the even input in the high nibble
        inner = 8 if k % (8 * 16) == 0 else 4 if k % (4 * 16) == 0 else 2
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack(pairs, inner))
        zero = blocks.offset + 8 * blocks.scale
        scale_zero = torch.stack([blocks.scale, zero], -1).transpose(0, 1).contiguous()  # [K/g, N, 2]
        self.register_buffer("scale_zero", scale_zero.to(torch.bfloat16))
        self.register_buffer("bias", bias)

    @classmethod
    def takes(cls, blocks: Blocks) -> bool:
        n, k = blocks.q.shape
        return blocks.bits == 4 and blocks.group in cls.GROUPS and k % 32 == 0 and n % 8 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm(flat, self.packed, self.group, self.scale_zero)
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


@dataclass(frozen=True)
class ByteWeight:
    """A stored form in the Triton byte GEMM's codes (fastspec.kernels.triton_quant): w[n, k] = v[n, k] *
    scale[n, k // cols] + offset[n, k // cols], v decoded from `w`'s bytes by `fmt`. Stacked (`stack`): one more
    leading dimension, the experts of a MoE layer."""

    w: torch.Tensor  # uint8 [N, K] (E4M3 / INT8) or [N, K / 2] (UINT4: input 2j in the low nibble)
    scale: torch.Tensor  # float32 [N, ceil(K / cols)]
    offset: torch.Tensor | None  # float32 like scale, None: no offset
    cols: int
    fmt: int

    @staticmethod
    def takes(form: QuantWeight) -> bool:
        """Whether the byte GEMM's K tiles (16, 32 or 64 inputs) fit `form`'s scale columns and inputs."""
        cols = form.cols if isinstance(form, Fp8Weight) else form.blocks.group
        return cols % 16 == 0 and form.shape[1] % 16 == 0

    @staticmethod
    def of(form: QuantWeight) -> ByteWeight:
        """`form`'s values in byte codes over its stored column order (an IntWeight's `perm` is the caller's:
        PermutedLinear), its bytes shared where they are codes already (e4m3, int8)."""
        from fastspec.kernels import triton_quant  # Triton: CUDA builds of torch, or the dev extra

        if isinstance(form, Fp8Weight):
            return ByteWeight(form.weight.view(torch.uint8).contiguous(), form.scale.float().contiguous(), None,
                              form.cols, triton_quant.E4M3)
        b = form.blocks
        w = b.q.view(torch.uint8) if b.bits == 8 else (b.q[:, 0::2] | b.q[:, 1::2] << 4)
        fmt = triton_quant.INT8 if b.bits == 8 else triton_quant.UINT4
        offset = None if not b.offset.any() else b.offset.float().contiguous()
        return ByteWeight(w.contiguous(), b.scale.float().contiguous(), offset, b.group, fmt)

    @staticmethod
    def stack(parts: list[ByteWeight]) -> ByteWeight | None:
        """The parts stacked [E, ...] (an absent offset as zeros where others have one), or None where their codes,
        scale widths or shapes differ."""
        if len({(p.fmt, p.cols, p.w.shape, p.scale.shape) for p in parts}) != 1:
            return None
        offsets = [p.offset for p in parts]
        offset = None if all(o is None for o in offsets) else torch.stack(
            [torch.zeros_like(p.scale) if o is None else o for p, o in zip(parts, offsets)])
        return ByteWeight(torch.stack([p.w for p in parts]), torch.stack([p.scale for p in parts]), offset,
                          parts[0].cols, parts[0].fmt)

    @property
    def code(self) -> str:
        return ("e4m3", "int8", "uint4")[self.fmt]


class ByteLinear(nn.Module):
    """y = x @ w.T (+ b) for a weight kept as bytes (ByteWeight: e4m3, int8 or two 4-bit values each) with a scale
    and an offset per row and `cols` inputs, decoded inside a Triton GEMM (fastspec.kernels.triton_quant; its torch
    twin where Triton does not run): the CUDA kernel for the 8- and 4-bit blocks tinygemm does not take, and for fp8
    on a GPU without fp8 tensor cores."""

    def __init__(self, form: QuantWeight, bias: torch.Tensor | None = None):
        super().__init__()
        from fastspec.kernels import triton_quant

        self.out_features, self.in_features = form.shape
        byte = ByteWeight.of(form)
        self.cols, self.fmt, self.code = byte.cols, byte.fmt, byte.code
        triton_quant.block_k(self.cols, self.in_features)  # refuses a shape no K tile fits
        self.register_buffer("w", byte.w)  # uint8 [N, K] or [N, K/2]
        self.register_buffer("scale", byte.scale)  # [N, K/cols]
        self.register_buffer("offset", byte.offset)
        self.register_buffer("bias", bias)

    @staticmethod
    def takes(form: QuantWeight) -> bool:
        return ByteWeight.takes(form)

    @property
    def gemm_kernel(self) -> str:
        from fastspec.kernels import triton_quant

        twin = "" if triton_quant.kernel_for(self.w.device) == "triton" else "'s torch twin"
        return f"fastspec Triton byte GEMM{twin} ({self.code} weights)"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        flat = x.reshape(-1, self.in_features)
        y = torch.ops.fastspec.byte_matmul(flat, self.w, self.scale, self.offset, self.cols, self.fmt)
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias
