"""Building blocks shared by the target family and the draft heads: RMSNorm, RoPE, gated MLP, attention.

Math only. Attention writes K/V and reads the cache through the `attn` argument (an AttentionContext built
outside the model); no layer allocates KV, samples, or knows about graphs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fastspec.models.config import ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # statistics in float32
        return self.weight * x.to(dtype)


class OffsetRMSNorm(RMSNorm):
    """Qwen3-Next's RMSNorm: scales by (1 + weight), in float32, then casts (weight 0 is the identity)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


def make_norm(config: ModelConfig, dim: int | None = None) -> RMSNorm:
    return (OffsetRMSNorm if config.norm_offset else RMSNorm)(dim or config.hidden_size, config.rms_norm_eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], float32, with Llama-3 or linear scaling applied."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend in between
    old_len = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = old_len / scaling.low_freq_factor, old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(middle, blended, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the pretrained context are interpolated
    (divided by `factor`), those turning more than beta_fast times are kept, with a linear ramp between."""
    def dim_at(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` times
        return dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_at(scaling.beta_fast), dim_at(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / max(high - low, 1e-3)).clamp(0, 1)
    return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """The multiplier YaRN puts on cos / sin (1 for every other rope)."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return yarn_mscale(scaling.factor)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE; cos/sin computed per call from the positions (cheap, exact, no position cap)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.rotary_dim = int(config.head_dim * config.partial_rotary_factor)  # the rest passes unrotated
        # float32 on the model's device: a plain attribute, so a dtype cast of the model leaves it (see _apply)
        self.inv_freq = rope_inv_freq(self.rotary_dim, config.rope_theta, config.rope_scaling).to(
            torch.get_default_device())
        self.attention_factor = rope_attention_factor(config.rope_scaling)

    def _apply(self, fn, recurse=True):
        self.inv_freq = self.inv_freq.to(fn(self.inv_freq).device)  # follows .to(device) / .cuda(), not dtypes
        return super()._apply(fn, recurse)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions [T]; q [T, Hq, D]; k [T, Hkv, D]
        r = self.rotary_dim
        if r < q.shape[-1]:
            (q_rot, q_pass), (k_rot, k_pass) = q.split([r, q.shape[-1] - r], -1), k.split([r, k.shape[-1] - r], -1)
            q_rot, k_rot = self.forward(positions, q_rot, k_rot)
            return torch.cat([q_rot, q_pass], -1), torch.cat([k_rot, k_pass], -1)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """GQA self-attention; `in_features` is 2H for the EAGLE-3 midlayer, H otherwise."""

    def __init__(self, config: ModelConfig, layer_id: int, in_features: int | None = None):
        super().__init__()
        c = config
        in_features = in_features or c.hidden_size
        self.layer_id, self.num_heads, self.num_kv_heads, self.head_dim = layer_id, c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.head_dim**-0.5
        self.q_proj = nn.Linear(in_features, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(in_features, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(in_features, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None

    def forward(self, positions, x, rope: RotaryEmbedding, attn) -> torch.Tensor:
        # positions [T]; x [T, in_features]
        q, k, v = self.project(positions, x, rope)
        return self.output(attn.attend(self.layer_id, q, k, v, self.scale))  # attend: [T, Hq, D]

    def project(self, positions, x, rope: RotaryEmbedding):
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        return q, k, v

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return self.o_proj(o.reshape(o.shape[0], self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm Llama block. `input_norm=False` gives the EAGLE-2 head's first layer (no input layernorm)."""

    def __init__(self, config: ModelConfig, layer_id: int, input_norm: bool = True):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps) if input_norm else None
        self.self_attn = Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(self, positions, x, rope, attn) -> torch.Tensor:
        q, k, v = self._project(positions, x, rope)
        a = self.self_attn
        return self._finish(x, attn.attend(a.layer_id, q, k, v, a.scale))

    @torch.compiler.nested_compile_region
    def _project(self, positions, x, rope):
        h = self.input_layernorm(x) if self.input_layernorm is not None else x
        return self.self_attn.project(positions, h, rope)

    @torch.compiler.nested_compile_region
    def _finish(self, x, o):
        x = x + self.self_attn.output(o)
        return x + self.mlp(self.post_attention_layernorm(x))
