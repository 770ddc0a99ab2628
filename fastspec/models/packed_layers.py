"""The modules a model kept on its quantised blocks runs: Int4Linear (torch's int4 CPU matmul), BlockLinear
(fastspec's int16 x 4- to 8-bit CPU kernels), BlockEmbedding (rows dequantised on lookup), RefinedHead (an lm_head
whose best tokens are rescored exactly), CastLinear (a float weight kept in the fast float dtype). Math only: which
weight becomes which module is gguf_packed's; which activation dtype this machine runs them in, activation_choice's.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from fastspec.kernels import cpu_fused, cpu_library, cpu_q4, cpu_row_gemm
from fastspec.kernels.cpu_row_gemm import row_dots, row_dots_op, row_linear
from fastspec.models.gguf_blocks import BLOCK, Blocks, as_8bit_16, quantise_rows, round_8bit

ROW_TILE = 16  # torch's int4 CPU packing takes weights of a multiple of 16 rows (others are padded with zero rows)
TENSOR_LINEARS = ("kv_b_proj",)  # linears whose weight a model reads as a tensor (MLA absorbs it into q and o)


class Int4Linear(nn.Module):
    """y = x @ w.T for a 4-bit weight packed for torch's int4 CPU matmul (group 32; the packed layout is torch's own,
    so it is rebuilt from the blocks, see `from_blocks`, or read back from a cache made by the same torch).

    The kernel reads w = (q - 8) * scale + zero, so zero = offset + 8 * scale holds Q4_0 and Q4_1 exactly.
    `activation`: the dtype x is cast to for the kernel. With bfloat16 (scales in bfloat16 too) it is the fast
    one; with float32 it is exact to float32 rounding and many times slower (bench/bench_packed.py measures both).
    `out_features`: the weight's rows, where `packed` has zero rows after them (`pack` pads N to ROW_TILE).
    """

    def __init__(self, packed: torch.Tensor, scale_zero: torch.Tensor, activation: torch.dtype = torch.bfloat16,
                 bias: torch.Tensor | None = None, out_features: int | None = None):
        super().__init__()
        self.out_features, self.in_features = out_features or packed.shape[0], 2 * packed.shape[1]
        self.padded = self.out_features < packed.shape[0]  # the kernel's output has rows forward drops
        self.activation = activation
        self.register_buffer("packed", packed)  # uint8 [N', K/2]  (N' >= N: see pack)
        self.register_buffer("scale_zero", scale_zero.to(activation))  # [K/32, N', 2]
        self.register_buffer("bias", bias)

    @property
    def gemm_kernel(self) -> str:
        return f"torch int4 CPU kernel, {str(self.activation).removeprefix('torch.')} activations"

    @classmethod
    def from_blocks(cls, blocks: Blocks, activation: torch.dtype = torch.bfloat16,
                    bias: torch.Tensor | None = None) -> Int4Linear:
        return cls(*cls.pack(blocks), activation, bias, blocks.q.shape[0])

    @staticmethod
    def pack(blocks: Blocks) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed uint8 [N', K/2], scale_zero float32 [K/32, N', 2]) of a 4-bit weight, in torch's int4 CPU layout;
        N' = N rounded up to ROW_TILE (zero rows)."""
        if blocks.bits != 4:
            raise ValueError("Int4Linear takes a 4-bit weight")
        if blocks.q.shape[1] % BLOCK:
            raise ValueError(f"a packed int4 weight needs K % 32 == 0, got {list(blocks.q.shape)}")
        blocks = blocks.pad_rows(ROW_TILE)
        zero = blocks.offset + 8 * blocks.scale
        scale_zero = torch.stack([blocks.scale, zero], -1).transpose(0, 1).contiguous()
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.q.to(torch.int32), 2), scale_zero

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        flat = x.reshape(-1, self.in_features).to(self.activation)
        if torch.compiler.is_compiling():  # Inductor cannot lower torch's own op (see int4_matmul)
            y = int4_matmul(flat, self.packed, self.scale_zero)
        else:  # eager: the op itself (calling a custom op loads the compiler stack, ~150 MB resident)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, BLOCK, self.scale_zero)
        y = y[:, :self.out_features].contiguous() if self.padded else y  # [M, N]
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class BlockLinear(nn.Module):
    """y = x @ w.T for a 4-, 5-, 6- or 8-bit weight kept as its blocks (a scale and an offset per 32 or 16 values) in
    fastspec's own layout, run by the C kernels of fastspec.kernels.cpu_q4: x is rounded to int16 per group of 32
    inside them, scales and offsets are kept as float16. The fast path where it beats torch's kernel (fast_activation
    measures both); never the exact reference. `out_features` as Int4Linear's (`pack` pads N to cpu_q4.TILE)."""

    activation = torch.int16  # what x is rounded to (the module itself takes and returns float32, any float dtype)

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, levels: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, out_features: int | None = None):
        super().__init__()
        rows = packed.shape[0] * cpu_q4.TILE
        self.out_features, self.in_features = out_features or rows, cpu_q4.in_features(packed)
        self.padded = self.out_features < rows  # the kernel's output has rows forward drops
        self.register_buffer("packed", packed)  # uint8 [N'/16, K/32, 256 | 320 | 384] (4 / 5 / 6-bit); int8 (8-bit)
        self.register_buffer("scales", scales)  # float16 [N'/16, K/g, 2, 16]  (g: 32 at 4 bits, else 16 or 32)
        self.register_buffer("levels", levels)  # int8 [16]: the values a 4-bit weight's nibbles index, or None
        self.register_buffer("bias", bias)

    @property
    def gemm_kernel(self) -> str:
        indexed = "" if self.levels is None else " indexing 16 levels"
        bits = cpu_q4.bits(self.packed)
        tiles = ", AMX tiles from 16 rows" if bits == 4 and self.levels is None and cpu_q4.amx() else ""
        return f"fastspec CPU block kernel, {bits}-bit weights{indexed}, int16 activations{tiles}"

    @classmethod
    def from_blocks(cls, blocks: Blocks, bias: torch.Tensor | None = None) -> BlockLinear:
        return cls(*cls.pack(blocks), bias=bias, out_features=blocks.q.shape[0])

    @staticmethod
    def pack(blocks: Blocks) -> tuple[torch.Tensor, ...]:
        """(packed, scales[, levels]): 4-bit blocks of 32 as they are; 8-bit ones of 32 with at most 16 distinct
        values (IQ4_NL / IQ4_XS) as 4-bit indices into them (cpu_q4.as_levels), others of 32 in the fewest bits (5,
        6 or 8) they fit exactly with their scales per 32 (cpu_q4.narrow: Q5_0 / Q5_1 / Q5_K take 5, Q8_0 8); blocks
        of 16 as values with a scale per 16, in the fewest bits they fit (Q6_K, Q2_K / Q3_K and mixes with Q4_K take 5
        or 6). N is rounded up to cpu_q4.TILE with zero rows."""
        blocks = blocks.pad_rows(cpu_q4.TILE)
        if blocks.bits == 4 and blocks.group == 32:
            return cpu_q4.pack(blocks.q, blocks.scale, blocks.offset, 4)
        indexed = cpu_q4.as_levels(blocks.q) if blocks.group == 32 else None
        if indexed is not None:
            return *cpu_q4.pack(indexed[0], blocks.scale, blocks.offset, 4), indexed[1]
        if blocks.group == 32:
            return cpu_q4.pack(*cpu_q4.narrow(blocks.q, blocks.scale, blocks.offset))
        wide = as_8bit_16(blocks)
        return cpu_q4.pack(*cpu_q4.narrow(wide.q, wide.scale, wide.offset))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        flat = x.reshape(-1, self.in_features).float()
        if torch.compiler.is_compiling():
            y = block_matmul(flat, self.packed, self.scales, self.levels)
        else:
            y = cpu_q4.matmul(flat, self.packed, self.scales, self.levels)
        y = y[:, :self.out_features].contiguous() if self.padded else y  # [M, N]
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def int4_linear(blocks: Blocks, activation: torch.dtype, bias: torch.Tensor | None = None) -> nn.Module:
    """The 4-bit linear over `blocks` for activations in `activation`: torch.int16 fastspec's kernel, else torch's."""
    if activation == torch.int16:
        return BlockLinear.from_blocks(blocks, bias)
    return Int4Linear.from_blocks(blocks, activation, bias)


@torch.library.custom_op("fastspec::block_matmul", mutates_args=())
def block_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                 levels: torch.Tensor | None = None) -> torch.Tensor:
    """fastspec's int16 x 4- to 8-bit CPU matmul as an opaque op for torch.compile: x [M, K] float32 -> [M, N]."""
    return cpu_q4.matmul(x, packed, scales, levels)


@block_matmul.register_fake
def _(x, packed, scales, levels=None):
    return x.new_empty(x.shape[0], packed.shape[0] * cpu_q4.TILE)


@torch.library.custom_op("fastspec::int4_matmul", mutates_args=())
def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """torch's int4 CPU matmul, group 32, as an opaque op for torch.compile (Inductor's own lowering of it fails
    on torch 2.13: "group size must be a scalar"): x [M, K] @ w.T -> [M, N], packed [N, K/2]."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, BLOCK, scale_zero)


@int4_matmul.register_fake
def _(x, packed, scale_zero):
    return x.new_empty(x.shape[0], packed.shape[0])


class BlockEmbedding(nn.Module):
    """An embedding table kept as its blocks (one byte per value); the rows looked up are dequantised exactly as
    Blocks.dequantise does, so it equals nn.Embedding over the dequantised table."""

    def __init__(self, blocks: Blocks, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_embeddings, self.embedding_dim = blocks.q.shape
        self.dtype = dtype
        self.register_buffer("q", blocks.q)  # [V, H] a byte per value
        self.register_buffer("scale", blocks.scale)  # [V, H/g] float32
        self.register_buffer("offset", blocks.offset)  # [V, H/g] float32

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [...] -> [..., H]
        q = self.q[ids].float().unflatten(-1, (self.scale.shape[1], -1))  # [..., H/g, g]
        rows = q * self.scale[ids][..., None] + self.offset[ids][..., None]
        return rows.flatten(-2).to(self.dtype)


class RefinedHead(nn.Module):
    """logits = x @ table.T over a vocabulary table: one fast approximate GEMM over the whole vocabulary (`approx`, an
    Int4Linear on bfloat16 activations over the table's 4-bit blocks or a 4-bit rounding of it), then each row's
    `refine` best tokens rescored exactly in float32 from the table's own rows. Greedy's argmax and the top of the
    distribution are then the exact model's whenever its winner is among the approximate top `refine` (the
    approximation moves a logit by a few percent; the gap to the 16th token is far larger); the tail keeps the
    approximate logits.
    """

    def __init__(self, approx: nn.Module, table: nn.Module, refine: int = 16):
        super().__init__()
        self.approx, self.table, self.refine = approx, table, refine  # table: ids -> rows [..., H], shared

    @property
    def gemm_kernel(self) -> str:
        return f"{self.approx.gemm_kernel}, best {self.refine} rescored exactly"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., H] -> [..., V] float32
        flat = x.reshape(-1, x.shape[-1])  # [M, H]
        logits = self.approx(flat).float()  # [M, V]
        if torch.compiler.is_compiling():
            top = logits.topk(self.refine, -1).indices  # [M, refine]
        else:  # the set, unsorted: a third of torch's topk's time over a 49k vocabulary on CPU
            top = cpu_fused.top_k(logits, self.refine)
        exact = None
        if type(self.table) is BlockEmbedding and not torch.compiler.is_compiling():  # one C call
            exact = cpu_fused.rescore(self.table.q, self.table.scale, self.table.offset, top, flat.float())
        if exact is None:  # [M, refine], each row's sums in one order whatever the batch (row_dots: its twin without
            rescore = row_dots_op if torch.compiler.is_compiling() else row_dots  # the C library, torch.bmm)
            exact = rescore(flat.float(), self.table(top).float())
        # in place: `logits` is this call's own (a copy of [M, V] costs more than the GEMM's epilogue)
        return logits.contiguous().scatter_(-1, top, exact).view(*x.shape[:-1], logits.shape[-1])  # (M may be 0)


class CastLinear(nn.Module):
    """y = x @ w.T (+ b) for a float weight kept in the packed kernels' activation dtype (bfloat16 halves the bytes a
    step reads): x is cast to it for the GEMM, y back to x's dtype. On the CPU through fastspec's row-invariant GEMM
    where the C library builds (a target's linear must compute a row alike in a verify and in a decode step; the
    BLAS's do not), else F.linear. Decided at construction (dynamo cannot trace the library's build)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)  # [N, K]
        self.register_buffer("bias", bias)
        self.row_invariant = cpu_row_gemm.takes(weight) and cpu_library.available()

    @property
    def gemm_kernel(self) -> str:
        kernel = "fastspec row-invariant GEMM" if self.row_invariant else "F.linear"
        return f"{kernel} {str(self.weight.dtype).removeprefix('torch.')}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_invariant:
            return row_linear(x, self.weight, self.bias)
        y = F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
        return y if self.bias is None else y + self.bias


def cast_linears(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Every nn.Linear of `model` (in place) as a CastLinear with its weight in `dtype` (a bfloat16 draft head next
    to a packed target: its weights are stored in bfloat16 anyway, and no prepacked float32 copies)."""
    return _replace_linears(model, lambda weight, bias: CastLinear(weight.to(dtype), bias))


def pack_linears(model: nn.Module, dtype: torch.dtype, bits: int = 8) -> nn.Module:
    """Every nn.Linear of `model` (in place) as a BlockLinear over its weight rounded to `bits`: 4 per 32 values as
    Q4_1 rounds (gguf_blocks.quantise_rows), 8 per 16 (round_8bit); a draft beside a target on fastspec's kernels,
    which only proposes tokens: the output stays exact. Or as a CastLinear in `dtype` where the kernel cannot take
    its inputs (K % 32)."""
    def block(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        if weight.shape[1] % cpu_q4.GROUP:
            return CastLinear(weight.to(dtype), bias)
        rounded = quantise_rows(lambda ids: weight[ids], weight.shape[0]) if bits == 4 else round_8bit(weight)
        return BlockLinear.from_blocks(rounded, bias)
    return _replace_linears(model, block)


def _replace_linears(model: nn.Module, make) -> nn.Module:
    """Every nn.Linear of `model`, at any depth, replaced in place by make(weight, bias) (detached tensors), except
    those whose weight the model reads as a tensor (TENSOR_LINEARS)."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear) and name not in TENSOR_LINEARS:
            setattr(model, name, make(child.weight.detach(), None if child.bias is None else child.bias.detach()))
        else:
            _replace_linears(child, make)
    return model
