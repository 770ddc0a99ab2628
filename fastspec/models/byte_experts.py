"""A quantised MoE layer's experts stacked as byte codes (cuda_linears.ByteWeight [E, ...]), so that inside a
captured or compiled graph a decode step reads only its chosen experts' bytes: LinearExperts (one module an expert)
can only run every expert there.

ByteExperts runs the experts three ways, as moe.Experts does: eagerly each chosen expert on its tokens (a host sync:
token counts), through the Triton byte GEMM on that expert's slice of the stack; inside a graph whose T rows make
fewer (token, choice) pairs than experts (T * top_k < E: a decode step, a small verify), each MLP projection one
expert-indexed call over all pairs (fastspec.kernels.triton_moe: pair p reads only w[expert of p]); else every expert
on every token, weighed by a dense [T, E] routing matrix. The three share the byte GEMM's weights and float32 sums
and add a token's experts in expert order from zeros, so they agree to the sums' rounding (tests/test_moe_bytes.py).

`stack_linear_experts` swaps a model's LinearExperts for ByteExperts where the stack is wanted (CUDA; on CPU only with
FASTSPEC_TRITON_QUANT=1, Triton's interpreter, or =twin, the torch twins: the tests' ways to run this path) and every
expert's gate_up and down share one code, scale width and shape; other layers keep LinearExperts (logged once).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from fastspec.models.cuda_linears import ByteWeight
from fastspec.models.layers import by_rows
from fastspec.models.moe import LinearExperts, add_pairs, dense_experts, expert_pairs, in_graph, sparse_experts
from fastspec.models.quant_layers import QuantLinear

log = logging.getLogger(__name__)

PARTS = ("gate_up", "down")


class ByteExperts(nn.Module):
    """E gated MLPs, gate_up [E, 2I, H] and down [E, H, I] as stacked ByteWeights (see the module docstring)."""

    def __init__(self, gate_up: ByteWeight, down: ByteWeight):
        super().__init__()
        from fastspec.kernels import triton_moe  # noqa: F401  (the ops; Triton: CUDA builds of torch, or the dev extra)

        self.codes = {}  # part -> (cols, fmt)
        for part, byte in zip(PARTS, (gate_up, down)):
            self.register_buffer(f"{part}_w", byte.w)  # uint8 [E, N, K] or [E, N, K / 2]
            self.register_buffer(f"{part}_scale", byte.scale)  # float32 [E, N, K / cols]
            self.register_buffer(f"{part}_offset", byte.offset)  # like scale, or None
            self.codes[part] = (byte.cols, byte.fmt)
        self.num_experts = gate_up.w.shape[0]
        self.gemm_kernel = f"fastspec Triton byte GEMM, experts stacked ({gate_up.code} / {down.code} weights)"

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        # x [T, H]; weights float32 [T, k]; index [T, k] -> [T, H]
        if not in_graph(x):
            return self.forward_sparse(x, weights, index)
        if index.numel() < self.num_experts:  # T * k < E (static per graph): fewer experts' bytes than all E
            return self.forward_gathered(x, weights, index)
        return self.forward_dense(x, weights, index)

    def forward_sparse(self, x, weights, index) -> torch.Tensor:
        return sparse_experts(x, weights, index, self.num_experts, self._expert)

    def forward_dense(self, x, weights, index) -> torch.Tensor:
        """Every expert on every token; unchosen experts weigh 0. Static shapes."""
        return dense_experts(x, weights, index, self.num_experts, self._expert)

    def forward_gathered(self, x, weights, index) -> torch.Tensor:
        """Each (token, choice) pair through its own expert's bytes: one expert-indexed call per projection, static
        shapes, no sync. E.g. T = 2, k = 2, index [[5, 1], [3, 5]]: pairs (rows 0 0 1 1, experts 1 5 3 5)."""
        T, k = index.shape
        experts, pair_weights = expert_pairs(weights, index)  # [T * k]
        rows = torch.arange(T, device=x.device).repeat_interleave(k)  # pair p is token p // k
        gate, up = self._gathered("gate_up", x, rows, experts).chunk(2, -1)  # [T * k, I] each
        h = by_rows(F.silu, gate) * up
        return add_pairs(self._gathered("down", h, torch.arange(T * k, device=x.device), experts), pair_weights, x)

    def _gathered(self, part: str, x, rows, experts) -> torch.Tensor:  # -> [P, N] in x's dtype
        w, scale, offset = (getattr(self, f"{part}_{name}") for name in ("w", "scale", "offset"))
        cols, fmt = self.codes[part]
        return torch.ops.fastspec.expert_byte_matmul(x, rows, experts, w, scale, offset, cols, fmt).to(x.dtype)

    def _linear(self, part: str, e: int, x: torch.Tensor) -> torch.Tensor:  # x [T, K] -> expert e's [T, N]
        w, scale, offset = (getattr(self, f"{part}_{name}") for name in ("w", "scale", "offset"))
        cols, fmt = self.codes[part]
        offset = None if offset is None else offset[e]
        return torch.ops.fastspec.byte_matmul(x, w[e], scale[e], offset, cols, fmt).to(x.dtype)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:  # x [T, H] -> expert e's output [T, H]
        gate, up = self._linear("gate_up", e, x).chunk(2, -1)
        return self._linear("down", e, by_rows(F.silu, gate) * up)


def stack_bytes(experts: LinearExperts) -> ByteExperts | None:
    """`experts` (its linears still QuantLinears) as ByteExperts, or None where a linear has a bias or an input
    order of its own, no byte GEMM tile fits it, or the experts' codes, scale widths or shapes differ."""
    stacks = []
    for linears in (experts.gate_up, experts.down):
        forms = [m.form for m in linears if isinstance(m, QuantLinear) and m.bias is None]
        if len(forms) != len(linears) or not all(ByteWeight.takes(f) and getattr(f, "perm", None) is None
                                                 for f in forms):
            return None
        stacks.append(ByteWeight.stack([ByteWeight.of(f) for f in forms]))
    return None if None in stacks else ByteExperts(*stacks)


def stack_wanted(device: torch.device) -> bool:
    """Whether a MoE layer's experts on `device` are stacked (see the module docstring)."""
    return torch.device(device).type == "cuda" or os.environ.get("FASTSPEC_TRITON_QUANT") in ("1", "twin")


def stack_linear_experts(model: nn.Module) -> int:
    """`model`'s LinearExperts (in place) as ByteExperts where stack_wanted and stack_bytes say so; returns how many
    were stacked. A layer left as it is runs every expert inside graphs: logged once. One layer at a time: each
    layer's per-expert linears are let go as its stack replaces them (not all held until the last is stacked)."""
    names = [name for name, m in model.named_modules()
             if isinstance(m, LinearExperts) and stack_wanted(next(m.buffers()).device)]
    left = []
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        byte = stack_bytes(getattr(parent, attr))
        if byte is None:
            left.append(name)
        else:
            setattr(parent, attr, byte)
    if left:
        log.warning("%d MoE layers' quantised experts do not share one byte code (%s, ...): inside graphs they run "
                    "every expert on every token", len(left), left[0])
    return len(names) - len(left)
