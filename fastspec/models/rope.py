"""Rotary position embeddings: the inverse frequencies (Llama-3, linear and YaRN scaling), YaRN's attention factor
and `RotaryEmbedding`, which turns positions into cos / sin and rotates q and k (rotate-half layout; GGUF's
interleaved one is gguf_rope's). Math only."""

from __future__ import annotations

import math

import torch
from torch import nn

from fastspec.models.model_config import ModelConfig, RopeScaling


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
        ratio = scaling.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(ratio) / (2 * math.log(theta))

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
