"""Building blocks shared by the target family and the draft heads: RMSNorm, gated MLP, attention (RoPE: rope.py).

Math only. Attention writes K/V and reads the cache through the `attn` argument (an AttentionContext built
outside the model); no layer allocates KV, samples, or knows about graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastspec.models.model_config import ModelConfig
from fastspec.models.quant_layers import QuantLinear
from fastspec.models.rope import RotaryEmbedding


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


def by_rows(fn, x: torch.Tensor) -> torch.Tensor:  # an elementwise op (silu, sigmoid) of x [..., N]
    """fn(x) with each row's values whatever rows share the call. torch's CPU kernels run an elementwise op over the
    flat tensor as a vector loop and a scalar tail, which round exp otherwise, so where a row fell decided its bits
    (a router's 8 experts, a 12-wide expert); padded to 64 values a row, nothing falls in a tail (while torch runs
    the op on up to 2 threads, which split it at a multiple of 32). Under torch.compile silu and sigmoid stay torch's
    kernels (an opaque op): Inductor's own exp rounds otherwise, so a compiled step's expert or MLP computed other bits
    than the eager one's."""
    if x.device.type != "cpu":
        return fn(x)
    if torch.compiler.is_compiling() and fn in _ROW_FNS:
        return by_rows_op(x, _ROW_FNS[fn])
    return _padded(fn, x)


def _padded(fn, x: torch.Tensor) -> torch.Tensor:
    pad = -x.shape[-1] % 64
    return fn(F.pad(x, (0, pad)))[..., : x.shape[-1]] if pad else fn(x)


_ROW_FNS = {F.silu: "silu", torch.sigmoid: "sigmoid"}


@torch.library.custom_op("fastspec::by_rows", mutates_args=())
def by_rows_op(x: torch.Tensor, fn: str) -> torch.Tensor:
    """by_rows of a named elementwise op, opaque to torch.compile."""
    return _padded({name: f for f, name in _ROW_FNS.items()}[fn], x).contiguous()


@by_rows_op.register_fake
def _(x, fn):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


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
        self.layer_id, self.head_dim = layer_id, c.head_dim
        self.num_heads, self.num_kv_heads = c.num_heads, c.num_kv_heads
        self.scale = c.head_dim**-0.5
        self.q_proj = nn.Linear(in_features, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(in_features, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(in_features, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.qkv_proj: nn.Linear | None = None  # fuse(): [q | k | v] as one linear
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_proj_bias)
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
    """Pre-norm Llama block. `input_norm=False` gives the EAGLE-2 head's first layer (no input layernorm); `mlp`
    replaces the gated MLP (a sparse MoE: Qwen3-MoE, Mixtral).

    Compiled as nested regions (each compiled once, reused by every layer) that end and start at the attention op:
    `enter` (norm + QKV GEMM), `hand_over` (this layer's o_proj, residual, MLP, then the next layer's norm + QKV:
    the residual add meets the next norm inside one region) and `leave` (the last layer's end). Rope, the KV write
    and attention run between them, in the graph that calls them."""

    def __init__(self, config: ModelConfig, layer_id: int, input_norm: bool = True, mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps) if input_norm else None
        self.self_attn = Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp if mlp is not None else MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

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
