"""Draft models: the EAGLE heads `LlamaForCausalLMEagle` (EAGLE-2) and `LlamaForCausalLMEagle3` (EAGLE-3), and
`StandaloneDraft` (a full small model behind the same interface).

Both map (token t_{p+1}, target feature h_p) at position p to a draft hidden state predicting t_{p+2}.
Shared embedding / lm_head tensors of the target are handed in at construction. Math only: the caller owns
KV, sampling and the mapping of draft-vocabulary ids to target ids (`hot_token_id`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from fastspec.models.fused_cpu import eagle3_fused, eagle3_midlayer
from fastspec.models.layers import MLP, Attention, DecoderLayer, RMSNorm
from fastspec.models.model_config import ModelConfig
from fastspec.models.rope import RotaryEmbedding


class DraftHidden(NamedTuple):
    normed: torch.Tensor  # [T, Hd]  what the draft lm_head sees
    carry: torch.Tensor  # [T, Hd]  what the next draft step is fed as its "hidden"


class LlamaForCausalLMEagle(nn.Module):
    """EAGLE-2: fc([embed, hidden]) 2H->H, Llama layers (the first without input norm), target's lm_head.

    With an FR-Spec token map the head's lm_head is the target's restricted to `hot_token_id` rows.
    """

    per_step_layers = 1  # one draft model for every step (fastspec.models.deepseek.MTPStack: one each)
    first_token_sink = False  # its rows pair t_{p+1} with the target's h_p, which has seen t_0 (StandaloneDraft)

    def __init__(self, config: ModelConfig, embed: nn.Embedding, lm_head_weight: torch.Tensor,
                 hot_token_id: torch.Tensor | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = embed
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(config, i, input_norm=i > 0) for i in range(config.num_layers))
        self.rope = RotaryEmbedding(config)
        head = lm_head_weight if hot_token_id is None else lm_head_weight[hot_token_id].clone()
        self.lm_head = nn.Linear(config.hidden_size, head.shape[0], bias=False)
        self.lm_head.weight = head if isinstance(head, nn.Parameter) else nn.Parameter(head, requires_grad=False)
        self.register_buffer("hot_token_id", hot_token_id, persistent=False)

    def hot_token_map(self) -> torch.Tensor | None:
        """[Vh] hot-vocabulary id -> target id (FR-Spec), or None for the identity."""
        return self.hot_token_id

    def forward(self, input_ids, positions, hidden, attn) -> DraftHidden:
        # input_ids, positions: [T]; hidden: [T, H] target feature (extend) or own carry (decode)
        embedded = self.embed_tokens(input_ids)
        x = self.fc(torch.cat([embedded, hidden.to(embedded.dtype)], dim=-1))
        for layer in self.layers:
            x = layer(positions, x, self.rope, attn)
        return DraftHidden(x, x)

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.lm_head(normed).float()  # [T, Vd] float32


class Eagle3Layer(nn.Module):
    """The EAGLE-3 midlayer: attention over cat([input_norm(embed), hidden_norm(hidden)]) (2H wide), added to the
    residual `hidden` (or to hidden_norm(hidden) where the head was trained with norm_before_residual)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.self_attn = Attention(config, 0, in_features=2 * H)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = MLP(H, config.intermediate_size, config.mlp_bias)

    def forward(self, positions, embeds, hidden, rope, attn) -> torch.Tensor:
        qkv = self._qkv(embeds, hidden)
        return self._finish(hidden, self.self_attn.attend(qkv, rope, rope.cos_sin(positions, qkv.dtype), attn))

    @torch.compiler.nested_compile_region
    def _qkv(self, embeds, hidden):  # rope and the KV write follow outside the region, fused by the compiler
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        return self.self_attn.qkv(x)

    @torch.compiler.nested_compile_region
    def _finish(self, hidden, o):
        residual = self.hidden_norm(hidden) if self.norm_before_residual else hidden
        h = residual + self.self_attn.output(o)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLMEagle3(nn.Module):
    """EAGLE-3: fc over three target features (3Ht->Hd), one midlayer, final norm, own lm_head over
    `draft_vocab_size` tokens with the d2t offsets (draft id i -> target id i + d2t[i])."""

    per_step_layers = 1  # one draft model for every step (fastspec.models.deepseek.MTPStack: one each)
    first_token_sink = False  # as LlamaForCausalLMEagle

    def __init__(self, config: ModelConfig, embed: nn.Embedding | None = None, lm_head: nn.Linear | None = None):
        super().__init__()
        c = config
        self.config = c
        self.embed_tokens = embed if embed is not None else nn.Embedding(c.vocab_size, c.hidden_size)
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=c.fc_bias)
        self.input_norm = RMSNorm(3 * c.target_hidden_size, c.rms_norm_eps) if c.fc_norm else None
        self.midlayer = Eagle3Layer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rope = RotaryEmbedding(c)
        self.lm_head = lm_head if lm_head is not None else nn.Linear(c.hidden_size, self.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))

    @property
    def draft_vocab_size(self) -> int:
        return self.config.draft_vocab_size or self.config.vocab_size

    def hot_token_map(self) -> torch.Tensor | None:
        """[Vd] draft id -> target id, or None for the identity. A host sync: call once at start-up."""
        if self.draft_vocab_size == self.config.vocab_size and not bool(self.d2t.any()):
            return None
        return self.d2t + torch.arange(self.draft_vocab_size, device=self.d2t.device)

    def forward(self, input_ids, positions, hidden, attn) -> DraftHidden:
        # hidden: [T, 3Ht] target aux features (extend) or [T, Hd] own carry (decode steps skip fc)
        hidden = hidden.to(self.norm.weight.dtype)
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = self.fc(hidden if self.input_norm is None else self.input_norm(hidden))
        embeds = self.embed_tokens(input_ids)
        if eagle3_fused(self.midlayer, self.rope, embeds, hidden, attn):  # a packed head on CPU: the fused kernels
            s, normed = eagle3_midlayer(self.midlayer, self.rope, self.norm, positions, embeds, hidden, attn)
            return DraftHidden(normed, s)
        s = self.midlayer(positions, embeds, hidden, self.rope, attn)
        return DraftHidden(self.norm(s), s)

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.lm_head(normed).float()  # [T, Vd] float32


class StandaloneDraft(torch.nn.Module):
    """A full small LM as the draft (STANDALONE): same interface as the EAGLE heads, features ignored.

    Draft position p holds token t_{p+1}, so the sequence's first token t_0 (BOS, most LMs' attention sink) is no
    draft row: its K/V sit in one extra key every draft row attends (`first_token_sink`), written by `sink`, and
    draft position p is the LM's position p + 1, so the LM sees t_0, t_1, ... at their true positions."""

    per_step_layers = 1  # one draft model for every step (fastspec.models.deepseek.MTPStack: one each)
    first_token_sink = True

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        self.config = lm.config

    def forward(self, input_ids, positions, hidden, attn) -> DraftHidden:
        h = self.lm(input_ids, positions + 1, attn).final
        return DraftHidden(h, h)

    def sink(self, first_ids: torch.Tensor, attn) -> None:
        """Write the K/V of each request's t_0 [n] at LM position 0 (it attends only itself) where `attn` says."""
        self.lm(first_ids, torch.zeros_like(first_ids), attn)

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.lm.compute_logits(normed)

    def hot_token_map(self) -> None:
        return None
