"""Building blocks shared by the target family and the draft heads: RMSNorm, RoPE, gated MLP, attention.

Math only. Attention writes K/V and reads the cache through the `attn` argument (an AttentionContext built
outside the model); no layer allocates KV, samples, or knows about graphs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fastspec.models.model_config import ModelConfig, RopeScaling
from fastspec.models.quant_layers import QuantLinear


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


TABLE_POSITIONS = 1 << 17  # the most positions RotaryEmbedding's cos / sin table holds (rotary dim 128: 128 MB)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE; cos/sin computed from the positions (exact, no position cap): once per forward by a model
    that hands them to every layer (`cos_sin`, then `rotate`), or per call (`forward`). Eagerly on CPU they are read
    from a table of every position so far, computed by the same ops (two gathers instead of eight ops a forward)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.rotary_dim = int(config.head_dim * config.partial_rotary_factor)  # the rest passes unrotated
        # float32 on the model's device: a plain attribute, so a dtype cast of the model leaves it (see _apply)
        self.inv_freq = rope_inv_freq(self.rotary_dim, config.rope_theta, config.rope_scaling).to(
            torch.get_default_device())
        self.attention_factor = rope_attention_factor(config.rope_scaling)
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # float32 cos, sin [positions, 1, rotary_dim]

    def _apply(self, fn, recurse=True):
        self.inv_freq = self.inv_freq.to(fn(self.inv_freq).device)  # follows .to(device) / .cuda(), not dtypes
        self._table = None
        return super()._apply(fn, recurse)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos [T, 1, rotary_dim] and sin with its first half negated (`_rotate`), in `dtype`."""
        if positions.device.type == "cpu" and self.inv_freq.device.type == "cpu" and not torch.compiler.is_compiling():
            cos, sin = self._from_table(positions)
            return cos.to(dtype), sin.to(dtype)
        return self._computed(positions, dtype)

    def _from_table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos_sin gathered from the table, which grows (to a power of two past the positions seen, at most
        TABLE_POSITIONS) past its end; beyond that, computed. The values are _computed's bit for bit: each element is
        the same float product and the same cos / sin (tested)."""
        try:
            return self._table[0].index_select(0, positions), self._table[1].index_select(0, positions)
        except (TypeError, IndexError, RuntimeError):  # no table yet (None), or a position past its end
            needed = int(positions.max()) + 1 if positions.numel() else 1
            if needed > TABLE_POSITIONS:
                return self._computed(positions, torch.float32)
            self._table = self._computed(torch.arange(max(1024, 1 << (needed - 1).bit_length())), torch.float32)
            return self._table[0].index_select(0, positions), self._table[1].index_select(0, positions)

    def _computed(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None, None] * self.inv_freq[None, None, :]  # [T, 1, D/2]
        cos, sin = freqs.cos().repeat(1, 1, 2), torch.cat([-freqs.sin(), freqs.sin()], -1)
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # q [T, Hq, D]; k [T, Hkv, D]; cos, sin [T, 1, rotary_dim] (sin's first half negated)
        r = self.rotary_dim
        if r < q.shape[-1]:
            (q_rot, q_pass), (k_rot, k_pass) = q.split([r, q.shape[-1] - r], -1), k.split([r, k.shape[-1] - r], -1)
            q_rot, k_rot = self.rotate(q_rot, k_rot, cos, sin)
            return torch.cat([q_rot, q_pass], -1), torch.cat([k_rot, k_pass], -1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions [T]; q [T, Hq, D]; k [T, Hkv, D]
        return self.rotate(q, k, *self.cos_sin(positions, q.dtype))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, x * cos + cat(-x2, x1) * sin, as x * cos + roll(x, D/2) * cat(-sin, sin): a roll is an index
    shift to a compiler, so the whole rotation is one pointwise expression (no concatenated tensor materialised)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def by_rows(fn, x: torch.Tensor) -> torch.Tensor:  # an elementwise op (silu, sigmoid) of x [..., N]
    """fn(x) with each row's values whatever rows share the call. torch's CPU kernels run an elementwise op over the
    flat tensor as a vector loop and a scalar tail, which round exp otherwise, so where a row fell decided its bits
    (a router's 8 experts, a 12-wide expert); padded to 64 values a row, nothing falls in a tail (while torch runs
    the op on up to 2 threads, which split it at a multiple of 32)."""
    pad = -x.shape[-1] % 64
    if x.device.type != "cpu" or not pad:
        return fn(x)
    return fn(F.pad(x, (0, pad)))[..., : x.shape[-1]]


def merged_linear(*parts: nn.Module) -> nn.Module | None:
    """One linear whose output is the parts' outputs side by side (their weights concatenated: one GEMM); quantised
    parts merged in their stored form, or None where they cannot share one (the parts then stay separate)."""
    if all(isinstance(p, QuantLinear) for p in parts):
        return QuantLinear.merge(list(parts))
    if not all(isinstance(p, nn.Linear) for p in parts):
        return None
    merged = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=parts[0].bias is not None,
                       device="meta")
    merged.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]), requires_grad=False)
    if parts[0].bias is not None:
        merged.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
    return merged


def fuse_projections(model: nn.Module) -> nn.Module:
    """For inference, in place: every Attention's q / k / v projections and every MLP's gate / up projections become
    one GEMM each (checkpoints keep their names on disk; a fused model is not for training or saving)."""
    for module in list(model.modules()):
        if isinstance(module, (Attention, MLP)):
            module.fuse()
    return model


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.gate_up_proj: nn.Linear | None = None  # fuse(): [gate | up] as one linear

    def fuse(self, merged: nn.Module | None = None) -> None:
        """gate and up as one linear: theirs concatenated, or `merged` (a prebuilt one, e.g. packed)."""
        if self.gate_up_proj is not None:
            return
        merged = merged or merged_linear(self.gate_proj, self.up_proj)
        if merged is not None:
            self.gate_up_proj = merged
            del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up_proj(x).chunk(2, -1)
        return self.down_proj(by_rows(F.silu, gate) * up)


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
        self.qkv_proj: nn.Linear | None = None  # fuse(): [q | k | v] as one linear
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None

    def fuse(self, merged: nn.Module | None = None) -> None:
        """q, k and v as one linear: theirs concatenated, or `merged` (a prebuilt one, e.g. packed)."""
        if self.qkv_proj is not None:
            return
        merged = merged or merged_linear(self.q_proj, self.k_proj, self.v_proj)
        if merged is not None:
            self.qkv_proj = merged
            del self.q_proj, self.k_proj, self.v_proj

    def forward(self, positions, x, rope: RotaryEmbedding, attn) -> torch.Tensor:
        # positions [T]; x [T, in_features]
        q, k, v = self.project(positions, x, rope)
        return self.output(attn.attend(self.layer_id, q, k, v, self.scale))  # attend: [T, Hq, D]

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features] -> [T, (Hq + 2 Hkv) * D]: q | k | v side by side (one tensor: a compile region's
        outputs must not alias each other, so regions return this and `heads` splits it outside)."""
        if self.qkv_proj is None:
            return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)
        return self.qkv_proj(x)

    def heads(self, qkv: torch.Tensor):
        """[T, (Hq + 2 Hkv) * D] -> q [T, Hq, D], k, v [T, Hkv, D], before rope (q / k normed where the model
        norms them)."""
        T, D = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.num_heads * D, self.num_kv_heads * D, self.num_kv_heads * D], -1)
        q, k, v = q.view(T, self.num_heads, D), k.view(T, self.num_kv_heads, D), v.view(T, self.num_kv_heads, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def project(self, positions, x, rope: RotaryEmbedding):
        q, k, v = self.heads(self.qkv(x))
        q, k = rope(positions, q, k)
        return q, k, v

    def attend(self, qkv: torch.Tensor, rope: RotaryEmbedding, cos_sin, attn) -> torch.Tensor:
        """q / k norms, rope, then the KV write and attention: [T, Hq, D]. Outside the compile regions, so the
        compiler fuses norms and rope into the KV write."""
        q, k, v = self.heads(qkv)
        q, k = rope.rotate(q, k, *cos_sin)
        return attn.attend(self.layer_id, q, k, v, self.scale)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return self.o_proj(o.reshape(o.shape[0], self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm Llama block. `input_norm=False` gives the EAGLE-2 head's first layer (no input layernorm).

    Compiled as nested regions (each compiled once, reused by every layer) that end and start at the attention op:
    `enter` (norm + QKV GEMM), `hand_over` (this layer's o_proj, residual, MLP, then the next layer's norm + QKV:
    the residual add meets the next norm inside one region) and `leave` (the last layer's end). Rope, the KV write
    and attention run between them, in the graph that calls them."""

    def __init__(self, config: ModelConfig, layer_id: int, input_norm: bool = True):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps) if input_norm else None
        self.self_attn = Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(self, positions, x, rope, attn) -> torch.Tensor:
        """One layer whole (draft heads); a target runs its layers through `enter` / `hand_over` / `leave`."""
        return self.leave(x, self.self_attn.attend(self.enter(x), rope, rope.cos_sin(positions, x.dtype), attn))

    @torch.compiler.nested_compile_region
    def enter(self, x):
        return self._qkv(x)

    @torch.compiler.nested_compile_region
    def hand_over(self, x, o, following: "DecoderLayer"):
        x = self._finish(x, o)
        return x, following._qkv(x)

    @torch.compiler.nested_compile_region
    def leave(self, x, o):
        return self._finish(x, o)

    def _qkv(self, x):
        h = self.input_layernorm(x) if self.input_layernorm is not None else x
        return self.self_attn.qkv(h)

    def _finish(self, x, o):
        x = x + self.self_attn.output(o)
        return x + self.mlp(self.post_attention_layernorm(x))
