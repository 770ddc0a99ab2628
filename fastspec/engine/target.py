"""The target model as every step runs it: its weights, KV pool, attention backend, a hybrid target's recurrent
states, and which hidden states feed the drafter. A frozen value the worker builds once and hands to prefill
and the decode rounds (its backend: `make_target_backend`); it allocates no KV and advances no length."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastspec.attention import AttentionBackend, AttentionContext, make_backend
from fastspec.config import EngineConfig
from fastspec.kernels.cpu_attention import CpuTorchBackend
from fastspec.memory import KVPool
from fastspec.memory.state_pool import StatePool
from fastspec.models.causal_lm import CausalLM
from fastspec.models.mla import mla_softmax_scale


@dataclass(frozen=True)
class Target:
    model: CausalLM  # forward(ids, positions, ctx) -> hidden; compute_logits
    pool: KVPool
    backend: AttentionBackend  # plan on the host, run inside the graphs
    states: StatePool | None  # a hybrid target's recurrent states
    feature: str | None  # what the drafter reads: "aux" (EAGLE-3's captured layers), "final", or None

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta, rows: torch.Tensor, lens: list[int]):
        """ids / positions int64 [T] over `rows` (lens[b] tokens each) -> the model's hidden states."""
        states = None if self.states is None else self.states.view(rows, lens=tuple(lens))
        return self.model(ids, positions, AttentionContext.build(self.backend, meta, self.pool, states))

    def features(self, hidden) -> torch.Tensor:
        """[T, F] the drafter's input features of a forward's hidden states."""
        return hidden.aux if self.feature == "aux" else hidden.final

    @property
    def feature_width(self) -> int:
        c = self.model.config
        return c.hidden_size * (len(self.model.capture_layers) if self.feature == "aux" else 1)


def make_target_backend(c, cfg: EngineConfig) -> AttentionBackend:
    """The backend `cfg.attention_backend` names, for a target of config `c` (its KV layout; MLA's latent rank and
    softmax scale)."""
    _, heads, dim, _ = c.kv_layout
    mla = {} if c.mla is None else dict(kv_lora_rank=c.mla.kv_lora_rank, sm_scale=mla_softmax_scale(c))
    if cfg.attention_backend == "torch":  # the C kernel on CPU tensors, the torch reference elsewhere
        return CpuTorchBackend()
    return make_backend(cfg.attention_backend, num_qo_heads=c.num_heads, num_kv_heads=heads, head_dim=dim,
                        dtype=cfg.torch_dtype, kv_dtype=cfg.kv_torch_dtype, device=cfg.device, **mla)
