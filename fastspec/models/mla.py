"""Multi-head latent attention (DeepSeek-V2 / V3), computed with weight absorption over a latent KV pool.

Per token the KV pool holds one vector [c_kv (kv_lora_rank) | k_rope (qk_rope_head_dim)]: the normalised
compressed KV and the shared, rotated rope key. With kv_b_proj split per head into W_UK (c_kv -> k_nope) and
W_UV (c_kv -> v), q_nope . k_nope = (q_nope W_UK) . c_kv and softmax . v = (softmax . c_kv) W_UV, so attention
runs as multi-query attention with one KV "head" of width C+R whose first C dims are V, and nothing is ever
expanded per head in the cache. `expand_kv` is the naive (expanded) twin, for tests. On the CPU the absorbed
products run fastspec's row-invariant GEMM (torch's batched ones round a token by the tokens beside it).
Parameter names equal Hugging Face's (DeepSeek's) so checkpoints load without renaming.
"""

from __future__ import annotations

import torch
from torch import nn

from fastspec.kernels.cpu_row_gemm import head_matmul
from fastspec.models.layers import RMSNorm
from fastspec.models.model_config import ModelConfig
from fastspec.models.rope import RotaryEmbedding, yarn_mscale

LORA_NORM_EPS = 1e-6  # DeepSeek's q_a / kv_a layernorms use the default eps, not rms_norm_eps


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        m, H, hidden = config.mla, config.num_heads, config.hidden_size
        self.layer_id, self.num_heads = layer_id, H
        self.nope_dim, self.rope_dim, self.v_dim, self.kv_rank = (m.qk_nope_head_dim, m.qk_rope_head_dim,
                                                                  m.v_head_dim, m.kv_lora_rank)
        self.interleaved, self.q_lora = m.rope_interleave, m.q_lora_rank is not None
        qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim  # per head: [nope | rope]
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, H * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, m.q_lora_rank, bias=config.attention_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, H * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, m.latent_dim, bias=config.attention_bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * m.v_head_dim, hidden, bias=config.attention_bias)
        self.scale = mla_softmax_scale(config)

    def _split_kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, C], W_UV [H, v, C]): kv_b_proj's rows per head are [k_nope rows | v rows]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim:]

    def project(self, positions, x, rope: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [T, H, C+R] with q_nope absorbed into the latent space, latent [T, 1, C+R] to cache)."""
        q_nope, q_rope, c_kv, k_rope = self._qkv(positions, x, rope)
        w_uk, _ = self._split_kv_b()
        if x.device.type == "cpu":
            q_latent = head_matmul(q_nope, w_uk.transpose(1, 2))  # (W_UK's transpose copied per call)
        else:
            q_latent = torch.einsum("thn,hnc->thc", q_nope, w_uk)
        return torch.cat([q_latent, q_rope], -1), torch.cat([c_kv[:, None], k_rope], -1)

    def output(self, o_latent: torch.Tensor) -> torch.Tensor:
        # o_latent: [T, H, C], attention-weighted c_kv per head
        _, w_uv = self._split_kv_b()
        cpu = o_latent.device.type == "cpu"
        o = head_matmul(o_latent, w_uv) if cpu else torch.einsum("thc,hvc->thv", o_latent, w_uv)
        return self.o_proj(o.reshape(o.shape[0], self.num_heads * self.v_dim))

    def _qkv(self, positions, x, rope: RotaryEmbedding):
        T = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_rope = q.view(T, self.num_heads, -1).split([self.nope_dim, self.rope_dim], -1)
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope_dim], -1)
        k_rope = k_rope[:, None]  # [T, 1, R]: one rope key shared by every head
        if self.interleaved:  # pairs (x0, x1), (x2, x3), ... -> rotate-half layout [x0, x2, ... | x1, x3, ...]
            q_rope, k_rope = _deinterleave(q_rope), _deinterleave(k_rope)
        q_rope, k_rope = rope(positions, q_rope, k_rope)
        return q_nope, q_rope, self.kv_a_layernorm(c_kv), k_rope

    def expand_kv(self, positions, x, rope: RotaryEmbedding):
        """The naive twin: per-head (q [T, H, nope+R], k [T, H, nope+R], v [T, H, v]) for plain attention."""
        q_nope, q_rope, c_kv, k_rope = self._qkv(positions, x, rope)
        w_uk, w_uv = self._split_kv_b()
        k_nope = torch.einsum("tc,hnc->thn", c_kv, w_uk)
        v = torch.einsum("tc,hvc->thv", c_kv, w_uv)
        k = torch.cat([k_nope, k_rope.expand(-1, self.num_heads, -1)], -1)
        return torch.cat([q_nope, q_rope], -1), k, v


def mla_softmax_scale(config: ModelConfig) -> float:
    """1/sqrt(qk head dim), times YaRN's mscale squared (it sharpens the softmax as well as the rope)."""
    m, s = config.mla, config.rope_scaling
    scale = (m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5
    if s is not None and s.rope_type == "yarn" and s.mscale_all_dim:
        scale *= yarn_mscale(s.factor, s.mscale_all_dim) ** 2
    return scale


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x[..., 0::2], x[..., 1::2]], -1)
