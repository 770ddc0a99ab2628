"""Bamba blocks: Mamba2 mixers beside plain GQA attention layers (half of each head rotated), SwiGLU MLPs.

The target is fastspec.models.causal_lm's CausalLM with these layers (`make_layer` picks them by config). A Mamba2
mixer projects x to [gate z | conv input (x, B, C) | dt], convolves the conv input over a short causal window,
scans it with the selective state space rule (fastspec.models.ssd) and normalises the output gated by silu(z)
per group of heads; its states live in the state pool (fastspec.models.recurrent runs it over the forward's
segments or verify trees). Parameter names equal Hugging Face's (the final norm is renamed at load).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastspec.memory.state_pool import RecurrentView
from fastspec.models import ssd
from fastspec.models.layers import MLP, Attention, RMSNorm, by_rows
from fastspec.models.model_config import ModelConfig
from fastspec.models.recurrent import run_layer


class GroupedGatedRMSNorm(nn.Module):
    """x * silu(z), then RMS-normalised per group of channels (Mamba2's norm after the gate)."""

    def __init__(self, dim: int, groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.groups, self.eps = groups, eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = (x.float() * by_rows(F.silu, z.float())).unflatten(-1, (self.groups, -1))
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return self.weight * h.to(x.dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, config: ModelConfig, linear_id: int):
        super().__init__()
        h, H = config.hybrid, config.hidden_size
        self.linear_id = linear_id
        self.heads, self.head_dim, self.groups, self.d_state = h.num_v_heads, h.v_head_dim, h.num_k_heads, h.k_head_dim
        self.inner = self.heads * self.head_dim
        self.dt_limit = h.dt_limit
        self.in_proj = nn.Linear(H, self.inner + h.conv_dim + self.heads, bias=h.proj_bias)
        self.conv1d = nn.Conv1d(h.conv_dim, h.conv_dim, h.conv_kernel, groups=h.conv_dim, bias=h.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.D = nn.Parameter(torch.ones(self.heads))
        self.norm = GroupedGatedRMSNorm(self.inner, self.groups, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.inner, H, bias=h.proj_bias)

    def forward(self, x: torch.Tensor, states: RecurrentView) -> torch.Tensor:
        T = x.shape[0]
        z, conv_in, dt = self.in_proj(x).split([self.inner, self.in_proj.out_features - self.inner - self.heads,
                                                self.heads], -1)
        dt = by_rows(F.softplus, dt.float() + self.dt_bias.float()).clamp(*self.dt_limit)  # [T, H]
        A = -self.A_log.float().exp()

        def kernel(y, tokens, state, parents):
            bs, n = y.shape[:2]
            xs, Bm, Cm = y.split([self.inner, self.groups * self.d_state, self.groups * self.d_state], -1)
            xs = xs.unflatten(-1, (self.heads, self.head_dim))
            Bm, Cm = (t.unflatten(-1, (self.groups, self.d_state)).repeat_interleave(self.heads // self.groups, -2)
                      for t in (Bm, Cm))
            dt_ = dt[tokens].view(bs, n, self.heads)
            if parents is not None:
                return ssd.tree(xs, dt_, A, Bm, Cm, self.D, state, parents)
            run = ssd.recurrent if n <= 8 else ssd.chunked
            return run(xs, dt_, A, Bm, Cm, self.D, state)

        bias = self.conv1d.bias
        y = run_layer(states, self.linear_id, conv_in, self.conv1d.weight[:, 0], bias, kernel)  # [T, H, P]
        return self.out_proj(self.norm(y.reshape(T, self.inner).to(x.dtype), z))


class BambaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        types = config.hybrid.layer_types
        self.linear = types[layer_id] == "linear_attention"
        index = sum(t == types[layer_id] for t in types[:layer_id])  # among layers of its kind
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.linear:
            self.mamba = Mamba2Mixer(config, index)
        else:
            self.self_attn = Attention(config, index)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(self, positions, x, rope, attn) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.mamba(h, attn.states) if self.linear else self.self_attn(positions, h, rope, attn)
        x = x + h
        return x + self.feed_forward(self.pre_ff_layernorm(x))
