"""DeepSeek-V2 / V3 blocks: the decoder layer (MLA + dense MLP or MoE) and the MTP layer that drafts (NEXTN).

The target itself is fastspec.models.llama's CausalLM with these layers (`make_layer` picks them by config).
An MTP layer (DeepSeek-V3's multi-token prediction module, stored after the last decoder layer under
`model.layers.{num_hidden_layers + i}.`) maps (token t_{p+1}, the target's final hidden state h_p) to a hidden
state predicting t_{p+2}, like an EAGLE head: eh_proj([enorm(embed(t)), hnorm(h)]), one decoder layer, then
shared_head.norm and shared_head.head. Its own output, normed, is what the next draft step is fed.
Math only: KV through the `attn` argument, as everywhere.
"""

from __future__ import annotations

import torch
from torch import nn

from fastspec.models.config import ModelConfig
from fastspec.models.eagle import DraftHidden
from fastspec.models.layers import MLP, RMSNorm, RotaryEmbedding
from fastspec.models.mla import MLAttention
from fastspec.models.moe import MoE


class DeepseekDecoderLayer(nn.Module):
    """Pre-norm block: MLA, then a dense MLP (layers below first_k_dense_replace) or the MoE."""

    def __init__(self, config: ModelConfig, layer_id: int, moe: bool, attn_layer_id: int | None = None):
        """`layer_id` places the layer in the model (dense or MoE); `attn_layer_id` is its KV pool layer."""
        super().__init__()
        H = config.hidden_size
        self.input_layernorm = RMSNorm(H, config.rms_norm_eps)
        self.self_attn = MLAttention(config, layer_id if attn_layer_id is None else attn_layer_id)
        self.post_attention_layernorm = RMSNorm(H, config.rms_norm_eps)
        self.mlp = MoE(H, config.moe) if moe else MLP(H, config.intermediate_size)

    def forward(self, positions, x, rope, attn) -> torch.Tensor:
        q, latent = self._project(positions, x, rope)
        a = self.self_attn
        return self._finish(x, attn.attend_latent(a.layer_id, q, latent, a.kv_rank, a.scale))

    @torch.compiler.nested_compile_region
    def _project(self, positions, x, rope):
        return self.self_attn.project(positions, self.input_layernorm(x), rope)

    def _finish(self, x, o):  # not a nested region: the MoE layers' experts differ in how they run eagerly
        x = x + self.self_attn.output(o)
        return x + self.mlp(self.post_attention_layernorm(x))


def is_moe_layer(config: ModelConfig, layer_id: int) -> bool:
    return config.moe is not None and config.moe.is_moe_layer(layer_id)


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class DeepseekMTP(DeepseekDecoderLayer):
    """One MTP module as a draft model (the EAGLE drafter's interface). Its parameter names are the checkpoint's
    under `model.layers.{N}.`; `embed_tokens` and `shared_head.head` fall back to the target's when absent."""

    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__(config, layer_id, is_moe_layer(config, layer_id), attn_layer_id=0)
        H = config.hidden_size
        self.config = config.replace(num_layers=1)  # the draft KV pool holds one layer
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self.enorm = RMSNorm(H, config.rms_norm_eps)
        self.hnorm = RMSNorm(H, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.shared_head = SharedHead(config)
        self.rope = RotaryEmbedding(config)

    def forward(self, input_ids, positions, hidden, attn):
        # input_ids, positions [T]; hidden [T, H]: the target's final hidden state (extend) or own output (steps)
        e = self.enorm(self.embed_tokens(input_ids))
        x = self.eh_proj(torch.cat([e, self.hnorm(hidden.to(e.dtype))], dim=-1))
        x = super().forward(positions, x, self.rope, attn)
        normed = self.shared_head.norm(x)
        return DraftHidden(normed, normed)

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(normed).float()  # [T, V] float32

    def hot_token_map(self) -> None:
        return None
