"""DeepSeek's mixture of experts: a router picking `top_k` routed experts per token, plus shared experts.

Routing follows DeepSeek-V2 (softmax scores; greedy or group-limited greedy) and V3 (sigmoid scores plus a
learned correction bias used only to choose; groups ranked by the sum of their two best experts; weights
renormalised), always in float32. The routed experts' weights are stacked [E, ...] (`stack_experts` turns a
checkpoint's per-expert keys into that layout).

Three ways to run the experts: eagerly, only the chosen experts on their tokens (a host sync per layer: token
counts); inside a compiled or captured graph (static shapes, no sync), where the graph's T rows make fewer (token,
choice) pairs than experts (T * top_k < E: a decode step), each pair through its own expert's weights gathered by
index (only the chosen experts' bytes read), else every expert on every token weighted by a dense [T, E] routing
matrix (E / top_k times the work, no more bytes than gathering). No fused MoE kernel. The three are tested against
each other, the eager one against transformers too. On the CPU every product is fastspec's row-invariant GEMM and a
token's experts are summed in expert order in every way, so a token computes bit for bit the same whatever tokens
share the call (a verify's rows and a decode step's).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fastspec.kernels.cpu_row_gemm import expert_linear, row_linear
from fastspec.models.layers import MLP, by_rows
from fastspec.models.model_config import ModelConfig, MoEConfig


def is_moe_layer(config: ModelConfig, layer_id: int) -> bool:
    """Whether decoder layer `layer_id` of this model has a MoE MLP (else a dense one)."""
    return config.moe is not None and config.moe.is_moe_layer(layer_id)


class Router(nn.Module):
    def __init__(self, hidden: int, m: MoEConfig):
        super().__init__()
        self.m = m
        self.weight = nn.Parameter(torch.zeros(m.num_experts, hidden))
        if m.scoring == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(m.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights float32 [T, top_k], expert ids int64 [T, top_k]) for x [T, H]."""
        m = self.m
        x, w = x.float(), self.weight.float()
        logits = row_linear(x, w, None) if x.device.type == "cpu" else F.linear(x, w)  # [T, E]
        if m.scoring == "sigmoid":
            scores = by_rows(torch.sigmoid, logits)
            choice = scores + self.e_score_correction_bias.float()  # the bias steers the choice, not the weights
            group_rank = choice.view(-1, m.n_group, m.num_experts // m.n_group).topk(2, dim=-1)[0].sum(-1)
            choice = choice.masked_fill(~self._group_mask(group_rank), float("-inf"))
        else:
            scores = choice = logits.softmax(-1)
            if m.topk_method == "group_limited_greedy":
                group_rank = scores.view(-1, m.n_group, m.num_experts // m.n_group).max(-1).values
                choice = scores.masked_fill(~self._group_mask(group_rank), 0.0)
        index = choice.topk(m.top_k, dim=-1)[1]
        weights = scores.gather(1, index)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * m.routed_scaling_factor, index

    def _group_mask(self, group_rank: torch.Tensor) -> torch.Tensor:
        """bool [T, E]: experts in each token's best topk_group groups."""
        m = self.m
        best = group_rank.topk(m.topk_group, dim=-1)[1]  # [T, topk_group]
        groups = torch.zeros_like(group_rank, dtype=torch.bool).scatter(1, best, True)
        return groups.repeat_interleave(m.num_experts // m.n_group, dim=1)


def sparse_experts(x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor, num_experts: int,
                   expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Each chosen expert on its own tokens, `expert(e, rows)` -> its outputs, added per expert in expert order
    (host sync: how many tokens each expert got). x [T, H]; weights float32 [T, k]; index [T, k] -> [T, H]."""
    k, out = index.shape[1], torch.zeros_like(x)
    order = index.flatten().argsort(stable=True)  # (token, choice) pairs grouped by expert
    counts = torch.bincount(index.flatten(), minlength=num_experts).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n:
            pairs = order[start:start + n]
            start += n
            tokens = pairs // k
            y = expert(e, x.index_select(0, tokens))
            out.index_add_(0, tokens, y * weights.flatten()[pairs, None].to(x.dtype))
    return out


def dense_experts(x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor, num_experts: int,
                  expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Every expert on every token, unchosen ones weighed 0 by a dense [T, E] routing matrix, added in expert order
    (static shapes, no sync: what a graph runs where gathering would read all E experts anyway)."""
    dense = torch.zeros(x.shape[0], num_experts, device=x.device).scatter(1, index, weights).to(x.dtype)
    return sum(expert(e, x) * dense[:, e, None] for e in range(num_experts))


def in_graph(x: torch.Tensor) -> bool:
    """Whether this call is traced by torch.compile or captured into a CUDA graph: static shapes, no host sync."""
    return torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing())


def expert_pairs(weights: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert [T * k], routing weight [T * k]) of each (token, choice) pair, pair p token p // k, a token's choices
    by expert id: the order sparse_experts adds them in."""
    index, order = index.sort(1)
    return index.flatten(), weights.gather(1, order).flatten()


def add_pairs(y: torch.Tensor, pair_weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Each token's pair outputs y [T * k, H] weighed and added from zeros in expert order -> [T, H] (sparse_experts'
    index_add_ per expert, bit for bit)."""
    T = x.shape[0]
    y = (y * pair_weights[:, None].to(x.dtype)).view(T, -1, y.shape[-1])
    out = torch.zeros_like(x)
    for j in range(y.shape[1]):
        out = out + y[:, j]
    return out


class Experts(nn.Module):
    """E gated MLPs stacked: gate_proj, up_proj [E, I, H]; down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, inter, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        # x [T, H]; weights float32 [T, k]; index [T, k] -> [T, H]
        if not in_graph(x):
            return self.forward_sparse(x, weights, index)
        if index.numel() < self.gate_proj.shape[0]:  # T * k < E (static per graph): fewer experts' bytes than all E
            return self.forward_gathered(x, weights, index)
        return self.forward_dense(x, weights, index)

    def forward_dense(self, x, weights, index) -> torch.Tensor:
        """Every expert on every token; unchosen experts weigh 0. Static shapes."""
        if x.device.type == "cpu":  # expert by expert, summed in expert order: what forward_sparse adds, bit for bit
            return dense_experts(x, weights, index, self.gate_proj.shape[0], self._expert)
        dense = torch.zeros(x.shape[0], self.gate_proj.shape[0], device=x.device).scatter(1, index, weights)
        h = F.silu(torch.einsum("th,eih->eti", x, self.gate_proj)) * torch.einsum("th,eih->eti", x, self.up_proj)
        y = torch.einsum("eti,ehi->eth", h, self.down_proj)  # [E, T, H]
        return torch.einsum("te,eth->th", dense.to(x.dtype), y)

    def forward_gathered(self, x, weights, index) -> torch.Tensor:
        """Each (token, choice) pair through its own expert's weights, gathered by index: static shapes, no sync, and
        only the chosen experts' weights read (T * k experts' bytes, where dense reads all E)."""
        if x.device.type != "cpu":
            return self.gathered_batched(x, weights, index)
        at, pair_weights = expert_pairs(weights, index)  # [T * k]
        xs = x.repeat_interleave(index.shape[1], 0)  # [T * k, H]: row p is token p // k
        h = by_rows(F.silu, expert_linear(xs, self.gate_proj, at)) * expert_linear(xs, self.up_proj, at)
        return add_pairs(expert_linear(h, self.down_proj, at), pair_weights, x)

    def gathered_batched(self, x, weights, index) -> torch.Tensor:
        """forward_gathered as batched products over the gathered weights [T, k, I, H] (the GPU's; on the CPU the
        BLAS's rounding, not row-invariant)."""
        gate, up, down = self.gate_proj[index], self.up_proj[index], self.down_proj[index]  # [T, k, I, H], [T, k, H, I]
        h = F.silu(torch.einsum("th,tkih->tki", x, gate)) * torch.einsum("th,tkih->tki", x, up)
        y = torch.einsum("tki,tkhi->tkh", h, down)  # [T, k, H]
        return torch.einsum("tk,tkh->th", weights.to(x.dtype), y)

    def forward_sparse(self, x, weights, index) -> torch.Tensor:
        return sparse_experts(x, weights, index, self.gate_proj.shape[0], self._expert)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:  # x [T, H] -> expert e's output [T, H]
        mm = (lambda a, w: row_linear(a, w, None)) if x.device.type == "cpu" else (lambda a, w: a @ w.T)
        return mm(by_rows(F.silu, mm(x, self.gate_proj[e])) * mm(x, self.up_proj[e]), self.down_proj[e])


class LinearExperts(nn.Module):
    """E gated MLPs as modules, one [gate | up] and one down linear each (a quantised checkpoint's experts, each
    linear in its stored form or bound to a kernel: fastspec.models.quant_layers): sparse eagerly, dense inside graphs
    (per-expert modules cannot be gathered by index). Where the experts share one byte code, on CUDA they are stacked
    instead (fastspec.models.byte_experts: gathered inside graphs)."""

    def __init__(self, gate_up: list[nn.Module], down: list[nn.Module]):
        super().__init__()
        self.gate_up, self.down = nn.ModuleList(gate_up), nn.ModuleList(down)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        if in_graph(x):
            return dense_experts(x, weights, index, len(self.down), self._expert)
        return sparse_experts(x, weights, index, len(self.down), self._expert)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up[e](x).chunk(2, -1)
        return self.down[e](by_rows(F.silu, gate) * up)


class MoE(nn.Module):
    def __init__(self, hidden: int, m: MoEConfig):
        super().__init__()
        self.gate = Router(hidden, m)
        self.experts = Experts(m.num_experts, hidden, m.intermediate_size)
        self.shared_experts = MLP(hidden, m.intermediate_size * m.num_shared_experts) if m.num_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, index = self.gate(x)
        y = self.experts(x, weights, index)
        return y + self.shared_experts(x) if self.shared_experts is not None else y


_EXPERT_KEY = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def stack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint keys `...experts.{e}.{proj}.weight` -> `...experts.{proj}` [E, ...] (others unchanged), in `state`,
    which it consumes and returns: each projection's expert tensors leave it as their stack is made, so a checkpoint's
    experts (most of a MoE model's bytes) are held twice one projection at a time, not all at once."""
    groups: dict[str, dict[int, str]] = {}
    for name in state:
        match = _EXPERT_KEY.match(name)
        if match is not None:
            prefix, e, proj = match.groups()
            groups.setdefault(f"{prefix}.{proj}", {})[int(e)] = name
    for stacked, names in groups.items():
        if sorted(names) == list(range(len(names))):  # a gap: the stacked key stays missing, so loading names it
            state[stacked] = torch.stack([state.pop(names[e]) for e in range(len(names))])
    return state
