"""DeepSeek-V2 / V3 blocks: the decoder layer (MLA + dense MLP or MoE) and the MTP layer that drafts (NEXTN).

The target itself is fastspec.models.causal_lm's CausalLM with these layers (`make_layer` picks them by config).
An MTP layer (DeepSeek-V3's multi-token prediction module, stored after the last decoder layer under
`model.layers.{num_hidden_layers + i}.`) maps (token t_{p+1}, the target's final hidden state h_p) to a hidden
state predicting t_{p+2}, like an EAGLE head: eh_proj([enorm(embed(t)), hnorm(h)]), one decoder layer, then
shared_head.norm and shared_head.head. Its own output, normed, is what the next draft step is fed.
Math only: KV through the `attn` argument, as everywhere.
"""

from __future__ import annotations

import torch
from torch import nn

from fastspec.models.eagle import DraftHidden
from fastspec.models.layers import MLP, RMSNorm
from fastspec.models.mla import MLAttention
from fastspec.models.model_config import ModelConfig
from fastspec.models.moe import MoE, is_moe_layer
from fastspec.models.rope import RotaryEmbedding


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


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class DeepseekMTP(DeepseekDecoderLayer):
    """One MTP module as a draft model (the EAGLE drafter's interface). Its parameter names are the checkpoint's
    under `model.layers.{N}.`; `embed_tokens` and `shared_head.head` fall back to the target's when absent."""

    per_step_layers = 1  # one layer drafts every step
    first_token_sink = False  # fed the target's hidden states (fastspec.models.eagle.StandaloneDraft has one)

    def __init__(self, config: ModelConfig, layer_id: int, attn_layer_id: int = 0):
        super().__init__(config, layer_id, is_moe_layer(config, layer_id), attn_layer_id=attn_layer_id)
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


class MTPStack(nn.Module):
    """Several MTP layers, one per draft step (step s uses layer s mod D), in the EAGLE frame: layer k at position
    j reads token t_{j+1} and layer k-1's output at position j-1 (layer 1: the target's hidden state at j). That is
    DeepSeek's module k at position j-k+1, with each layer's positions shifted by a constant (its attention sees
    relative positions only). Each layer has its own KV layer k in the draft pool; a draft step attends only its
    own layer's committed KV (the draft positions before it were made by other layers). The heads of DeepSeek's
    MTP layers are the target's lm_head: the first layer's scores every step."""

    first_token_sink = False  # as DeepseekMTP

    def __init__(self, layers: list[DeepseekMTP]):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.per_step_layers = len(layers)
        self.config = layers[0].config.replace(num_layers=len(layers))  # the draft pool: a KV layer each

    def forward(self, input_ids, positions, hidden, attn, step: int = 0) -> DraftHidden:
        return self.layers[step % self.per_step_layers](input_ids, positions, hidden, attn)

    def extend(self, input_ids, positions, features, prev: torch.Tensor, attn, rows_per_request: int):
        """Every layer over E = rows_per_request rows per request (consecutive positions, padding last).
        prev [bs, D-1, H]: layers 1..D-1's outputs at the position before the first row (from the last extend).
        Returns (the first layer's DraftHidden [bs*E], layers 1..D-1's outputs [bs*E, D-1, H])."""
        bs = prev.shape[0]
        first = self.layers[0](input_ids, positions, features, attn)
        outputs, h = [first.carry], first.carry
        for k in range(1, self.per_step_layers):
            before = torch.cat([prev[:, k - 1:k].to(h.dtype), h.view(bs, rows_per_request, -1)[:, :-1]], 1)
            h = self.layers[k](input_ids, positions, before.flatten(0, 1), attn).carry
            outputs.append(h)
        return first, torch.stack(outputs[:-1], 1)

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.layers[0].compute_logits(normed)

    def hot_token_map(self) -> None:
        return None
