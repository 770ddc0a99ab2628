"""The modules a model kept on its quantised blocks runs: Int4Linear (torch's int4 CPU matmul), BlockEmbedding (rows
dequantised on lookup), RefinedHead (an lm_head whose best tokens are rescored exactly), CastLinear (a float weight
kept in the kernels' activation dtype), and the per-machine choice of that dtype. Math only: which weight becomes
which module is gguf_packed's.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F
from torch import nn

from fastspec.models.gguf_blocks import BLOCK, Blocks

ROW_TILE = 16  # torch's int4 CPU packing takes weights of a multiple of 16 rows


class Int4Linear(nn.Module):
    """y = x @ w.T for a 4-bit weight packed for torch's int4 CPU matmul (group 32; the packed layout is torch's own,
    so it is rebuilt from the blocks, see `from_blocks`, or read back from a cache made by the same torch).

    The kernel reads w = (q - 8) * scale + zero, so zero = offset + 8 * scale holds Q4_0 and Q4_1 exactly.
    `activation`: the dtype x is cast to for the kernel. With bfloat16 (scales in bfloat16 too) it is the fast
    one; with float32 it is exact to float32 rounding and many times slower (bench/bench_packed.py measures both).
    """

    def __init__(self, packed: torch.Tensor, scale_zero: torch.Tensor, activation: torch.dtype = torch.bfloat16,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = packed.shape[0], 2 * packed.shape[1]
        self.activation = activation
        self.register_buffer("packed", packed)  # uint8 [N, K/2]
        self.register_buffer("scale_zero", scale_zero.to(activation))  # [K/32, N, 2]
        self.register_buffer("bias", bias)

    @classmethod
    def from_blocks(cls, blocks: Blocks, activation: torch.dtype = torch.bfloat16,
                    bias: torch.Tensor | None = None) -> Int4Linear:
        return cls(*cls.pack(blocks), activation, bias)

    @staticmethod
    def pack(blocks: Blocks) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed uint8 [N, K/2], scale_zero float32 [K/32, N, 2]) of a 4-bit weight, in torch's int4 CPU layout."""
        if blocks.bits != 4:
            raise ValueError("Int4Linear takes a 4-bit weight")
        n, k = blocks.q.shape
        if k % BLOCK or n % ROW_TILE:
            raise ValueError(f"a packed int4 weight needs K % 32 == 0 and N % 16 == 0, got [{n}, {k}]")
        zero = blocks.offset + 8 * blocks.scale
        scale_zero = torch.stack([blocks.scale, zero], -1).transpose(0, 1).contiguous()
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.q.to(torch.int32), 2), scale_zero

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        flat = x.reshape(-1, self.in_features).to(self.activation)
        if torch.compiler.is_compiling():  # Inductor cannot lower torch's own op (see int4_matmul)
            y = int4_matmul(flat, self.packed, self.scale_zero)
        else:  # eager: the op itself (calling a custom op loads the compiler stack, ~150 MB resident)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, BLOCK, self.scale_zero)
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


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
        self.register_buffer("scale", blocks.scale)  # [V, H/32] float32
        self.register_buffer("offset", blocks.offset)  # [V, H/32] float32

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [...] -> [..., H]
        q = self.q[ids].float().unflatten(-1, (-1, BLOCK))  # [..., H/32, 32]
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., H] -> [..., V] float32
        flat = x.reshape(-1, x.shape[-1])  # [M, H]
        logits = self.approx(flat).float()[:, :self.table.num_embeddings]  # [M, V] (approx's rows may be padded)
        top = logits.topk(self.refine, -1).indices  # [M, refine]
        exact = torch.bmm(self.table(top).float(), flat.float()[:, :, None]).squeeze(-1)  # [M, refine]
        return logits.scatter(-1, top, exact).view(*x.shape[:-1], logits.shape[-1])  # (no -1: M may be 0)


class CastLinear(nn.Module):
    """y = x @ w.T (+ b) for a float weight kept in the packed kernels' activation dtype (bfloat16 halves the bytes a
    step reads): x is cast to it for the GEMM, y back to x's dtype. With float32 it is a plain linear."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)  # [N, K]
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
        return y if self.bias is None else y + self.bias


def cast_linears(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Every nn.Linear of `model` (in place) as a CastLinear with its weight in `dtype` (a bfloat16 draft head next
    to a packed target: its weights are stored in bfloat16 anyway, and no prepacked float32 copies)."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            bias = None if child.bias is None else child.bias.detach()
            setattr(model, name, CastLinear(child.weight.detach().to(dtype), bias))
        else:
            cast_linears(child, dtype)
    return model


@functools.cache
def fast_activation(reps: int = 16) -> torch.dtype:
    """The activation dtype of the faster int4 CPU matmul on this machine, measured once per process (~20 ms) on one
    token through a [1536, 576] weight, on one thread (a busy second core would stall a 2-thread call) and the
    fastest of `reps` calls: bfloat16 where the CPU has bf16 instructions (about 10x faster than float32 on an AMX
    Xeon), float32 where bf16 is emulated."""
    q = torch.randint(0, 16, (1536, 576), dtype=torch.uint8)
    blocks = Blocks(q, torch.full((1536, 18), 0.01), torch.zeros(1536, 18), 4)

    def seconds(dtype: torch.dtype) -> float:
        linear, x = Int4Linear.from_blocks(blocks, dtype), torch.randn(1, 576)
        linear(x)  # warm-up
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            linear(x)
            times.append(time.perf_counter() - start)
        return min(times)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return torch.bfloat16 if seconds(torch.bfloat16) < seconds(torch.float32) else torch.float32
    finally:
        torch.set_num_threads(threads)
