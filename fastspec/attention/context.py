"""What a model's forward receives for attention: backend + plan + KV pool, passed explicitly (never a global).

Owns the per-layer step "write the new tokens' K/V into the pool at the planned slots, then attend". It does
not build metadata (metadata.py), does not allocate slots (memory/) and knows nothing about the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fastspec.attention.metadata import AttnMetadata


class KVPoolLike(Protocol):
    """The slice of the KV pool attention uses (fastspec.memory's pool satisfies it)."""

    k: torch.Tensor  # [num_layers, num_slots, Hkv, D]
    v: torch.Tensor | None  # [num_layers, num_slots, Hkv, D]; None for a latent (MLA) pool

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None: ...

    def scale(self, layer: int) -> tuple[float, float]: ...  # (k_scale, v_scale): K is stored as K / k_scale


class AttentionBackend(Protocol):
    """An attention backend (the torch reference, flashinfer, flashinfer MLA): `plan` on the host, once per forward;
    `run` inside the graphs, once per layer."""

    def plan(self, meta: AttnMetadata) -> Any: ...

    def run(self, plan: Any,
            q: torch.Tensor,        # [T, Hq, D]
            k_cache: torch.Tensor,  # [num_slots, Hkv, D]  one layer's pool
            v_cache: torch.Tensor,  # [num_slots, Hkv, Dv]
            scale: float) -> torch.Tensor: ...  # [T, Hq, Dv]


@dataclass(frozen=True)
class AttentionContext:
    backend: AttentionBackend
    plan: Any  # what backend.plan returned (TorchAttnPlan for the reference backend)
    pool: KVPoolLike
    states: object = None  # fastspec.memory.state_pool.RecurrentView for a hybrid target's linear layers

    @classmethod
    def build(cls, backend: AttentionBackend, meta: AttnMetadata, pool: KVPoolLike, states=None
              ) -> "AttentionContext":
        """Plan once per forward; the returned context is reused by every layer."""
        return cls(backend=backend, plan=backend.plan(meta), pool=pool, states=states)

    def attend(self, layer: int,
               q: torch.Tensor,  # [T, Hq, D]
               k: torch.Tensor,  # [T, Hkv, D]  K of the new tokens
               v: torch.Tensor,  # [T, Hkv, D]
               scale: float) -> torch.Tensor:  # [T, Hq, D]
        self.pool.write(layer, self.plan.out_cache_loc, k, v)
        k_scale, v_scale = self.pool.scale(layer)  # q . K = k_scale (q . K stored); p V = v_scale (p V stored)
        o = self.backend.run(self.plan, q, self.pool.k[layer], self.pool.v[layer], scale * k_scale)
        return o if v_scale == 1 else o * v_scale

    def attend_latent(self, layer: int,
                      q: torch.Tensor,       # [T, Hq, C+R]  absorbed q_nope | q_rope
                      latent: torch.Tensor,  # [T, 1, C+R]   compressed KV | rope key of the new tokens
                      v_dim: int,            # C: V is the first C dims of the latent
                      scale: float) -> torch.Tensor:  # [T, Hq, C]
        """MLA as multi-query attention over the latent pool (weight absorption: K = latent, V = latent[:C])."""
        self.pool.write(layer, self.plan.out_cache_loc, latent, None)
        cache = self.pool.k[layer]
        return self.backend.run(self.plan, q, cache, cache[..., :v_dim], scale)
