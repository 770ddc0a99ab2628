"""Qwen3-Next blocks: gated delta net (linear attention) layers beside gated full-attention layers, MoE MLPs.

The target is fastspec.models.causal_lm's CausalLM with these layers (`make_layer` picks them by config). A
full-attention layer is GQA with per-head q / k norm, partial rope and an output gate (q_proj yields [q | gate]
per head; the attention output is scaled by sigmoid(gate)); its KV goes to the KV pool at its index among the
full-attention layers. A linear layer mixes tokens with the gated delta rule (fastspec.models.gated_delta)
after a short causal convolution; its states live in the state pool at the requests' rows (the forward's
`attn.states` says which rows and how the tokens relate). `Qwen3NextMTP` is the checkpoint's own draft layer.
Parameter names equal Hugging Face's (the MTP's, the checkpoint's under `mtp.`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from fastspec.memory.state_pool import RecurrentView
from fastspec.models import gated_delta
from fastspec.models.eagle import DraftHidden
from fastspec.models.layers import MLP, by_rows, make_norm
from fastspec.models.model_config import ModelConfig
from fastspec.models.moe import Experts, Router, is_moe_layer
from fastspec.models.recurrent import run_layer
from fastspec.models.rope import RotaryEmbedding


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig, kv_layer_id: int):
        super().__init__()
        c = config
        self.layer_id, self.head_dim = kv_layer_id, c.head_dim
        self.num_heads, self.num_kv_heads = c.num_heads, c.num_kv_heads
        self.scale = c.head_dim ** -0.5
        self.q_proj = nn.Linear(c.hidden_size, 2 * c.num_heads * c.head_dim, bias=c.attention_bias)  # [q | gate]
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_proj_bias)
        self.q_norm, self.k_norm = make_norm(c, c.head_dim), make_norm(c, c.head_dim)

    def forward(self, positions, x, rope, attn) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        q, gate = self.q_proj(x).view(T, self.num_heads, 2 * D).split([D, D], -1)
        k = self.k_norm(self.k_proj(x).view(T, self.num_kv_heads, D))
        q, k = rope(positions, self.q_norm(q), k)
        v = self.v_proj(x).view(T, self.num_kv_heads, D)
        o = attn.attend(self.layer_id, q, k, v, self.scale)  # [T, H, D]
        return self.o_proj((o * by_rows(torch.sigmoid, gate)).reshape(T, -1))


class GatedRMSNorm(nn.Module):
    """RMSNorm of the delta-rule output, then times silu(z)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * normed.to(x.dtype)) * by_rows(F.silu, z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, linear_id: int):
        super().__init__()
        h, H = config.hybrid, config.hidden_size
        self.linear_id = linear_id
        self.hk, self.hv, self.dk, self.dv = h.num_k_heads, h.num_v_heads, h.k_head_dim, h.v_head_dim
        self.in_proj_qkvz = nn.Linear(H, 2 * self.hk * self.dk + 2 * self.hv * self.dv, bias=False)
        self.in_proj_ba = nn.Linear(H, 2 * self.hv, bias=False)
        self.conv1d = nn.Conv1d(h.conv_dim, h.conv_dim, h.conv_kernel, groups=h.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.hv * self.dv, H, bias=False)

    def forward(self, x: torch.Tensor, states: RecurrentView) -> torch.Tensor:
        T, r = x.shape[0], self.hv // self.hk
        # per key head: [q (Dk) | k (Dk) | v (r*Dv) | z (r*Dv)] and [b (r) | a (r)]
        q, k, v, z = self.in_proj_qkvz(x).view(T, self.hk, -1).split([self.dk, self.dk, r * self.dv, r * self.dv], -1)
        b, a = self.in_proj_ba(x).view(T, self.hk, 2 * r).split([r, r], -1)
        mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], -1)  # [T, conv_dim]
        beta = by_rows(torch.sigmoid, b.reshape(T, self.hv))
        g = -self.A_log.float().exp() * by_rows(F.softplus, a.reshape(T, self.hv).float() + self.dt_bias.float())

        def kernel(y, tokens, state, parents):
            bs, n = y.shape[:2]
            q, k, v = self._heads(y)
            g_, beta_ = g[tokens].view(bs, n, self.hv), beta[tokens].view(bs, n, self.hv)
            if parents is not None:
                return gated_delta.tree(q, k, v, g_, beta_, state, parents)
            run = gated_delta.recurrent if n <= 8 else gated_delta.chunked
            return run(q, k, v, g_, beta_, state)

        o = run_layer(states, self.linear_id, mixed, self.conv1d.weight[:, 0], None, kernel)  # [T, Hv, Dv]
        o = self.norm(o.to(x.dtype), z.reshape(T, self.hv, self.dv))
        return self.out_proj(o.reshape(T, -1))

    def _heads(self, mixed: torch.Tensor):
        """[..., conv_dim] after the conv -> q, k [..., Hv, Dk] (l2-normalised, q scaled), v [..., Hv, Dv]."""
        lead, r = mixed.shape[:-1], self.hv // self.hk
        q, k, v = mixed.float().split([self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], -1)
        q, k = (t.view(*lead, self.hk, self.dk).repeat_interleave(r, -2) for t in (q, k))
        q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
        return q * self.dk ** -0.5, k, v.view(*lead, self.hv, self.dv)


class SparseMoeBlock(nn.Module):
    """Routed experts (softmax top-k) plus one shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        m, H = config.moe, config.hidden_size
        self.gate = Router(H, m)
        self.experts = Experts(m.num_experts, H, m.intermediate_size)
        self.shared_expert = MLP(H, m.shared_intermediate_size)
        self.shared_expert_gate = nn.Linear(H, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, index = self.gate(x)
        shared = by_rows(torch.sigmoid, self.shared_expert_gate(x)) * self.shared_expert(x)  # gate [T, 1]
        return self.experts(x, weights, index) + shared


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        types = config.hybrid.layer_types
        self.linear = types[layer_id] == "linear_attention"
        index = sum(t == types[layer_id] for t in types[:layer_id])  # among layers of its kind
        self.input_layernorm = make_norm(config)
        if self.linear:
            self.linear_attn = GatedDeltaNet(config, index)
        else:
            self.self_attn = GatedAttention(config, index)
        self.post_attention_layernorm = make_norm(config)
        moe = is_moe_layer(config, layer_id)
        self.mlp = SparseMoeBlock(config) if moe else MLP(config.hidden_size, config.intermediate_size)

    def forward(self, positions, x, rope, attn) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.linear_attn(h, attn.states) if self.linear else self.self_attn(positions, h, rope, attn)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3NextMTP(nn.Module):
    """Qwen3-Next's multi-token prediction layer as a draft model (NEXTN), stored under `mtp.` in the checkpoint:
    fc([pre_fc_norm_embedding(embed(t)), pre_fc_norm_hidden(h)]), one full-attention decoder layer (its own KV
    layer 0 in the draft pool; no recurrent state), a final norm, the target's embedding and lm_head."""

    per_step_layers = 1  # one draft model for every step (fastspec.models.deepseek.MTPStack: one each)
    first_token_sink = False  # fed the target's hidden states (fastspec.models.eagle.StandaloneDraft has one)

    def __init__(self, config: ModelConfig, embed: nn.Embedding, lm_head: nn.Linear):
        super().__init__()
        hybrid = dataclasses.replace(config.hybrid, layer_types=("full_attention",))
        self.config = config.replace(num_layers=1, hybrid=hybrid)  # the draft KV pool holds one layer
        c, H = self.config, config.hidden_size
        self.embed_tokens, self.lm_head = embed, lm_head
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden = make_norm(c), make_norm(c)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList([HybridDecoderLayer(c, 0)])
        self.norm = make_norm(c)
        self.rope = RotaryEmbedding(c)

    def forward(self, input_ids, positions, hidden, attn) -> DraftHidden:
        # hidden [T, H]: the target's final hidden state (extend) or this layer's own output (draft steps)
        e = self.pre_fc_norm_embedding(self.embed_tokens(input_ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden.to(e.dtype))], dim=-1))
        normed = self.norm(self.layers[0](positions, x, self.rope, attn))
        return DraftHidden(normed, normed)

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.lm_head(normed).float()  # [T, V] float32

    def hot_token_map(self) -> None:
        return None
