"""The target family: Llama (incl. Llama-3 rope scaling), Qwen2 (qkv bias), Qwen3 (q/k norm), Mistral,
Qwen3-MoE and Mixtral (those layers with a sparse MoE MLP, fastspec.models.moe), DeepSeek-V2 / V3 (their MLA / MoE
decoder layers, fastspec.models.deepseek), Qwen3-Next (gated delta net layers beside gated attention,
fastspec.models.qwen3_next) and Bamba (Mamba2 mixers, fastspec.models.bamba).

One implementation, `CausalLM`, configured by `ModelConfig` (the architectures differ in flags and in the
decoder layer).
`forward` returns hidden states (and, when asked at construction, the EAGLE-3 auxiliary residual-stream
states); logits are a separate call. Parameter names equal Hugging Face's (the loader renames the few that differ:
Mixtral's experts, Bamba's final norm).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from fastspec.models.bamba import BambaDecoderLayer
from fastspec.models.deepseek import DeepseekDecoderLayer
from fastspec.models.fused_cpu import final_norm, fused_activation, fused_layers
from fastspec.models.layers import DecoderLayer, make_norm
from fastspec.models.model_config import ModelConfig
from fastspec.models.moe import MoE, is_moe_layer
from fastspec.models.qwen3_next import HybridDecoderLayer
from fastspec.models.rope import RotaryEmbedding


class TargetHidden(NamedTuple):
    final: torch.Tensor  # [T, H]  final-norm output: what lm_head sees and what an EAGLE-2 head is fed
    aux: torch.Tensor | None  # [T, k*H]  residual stream entering each capture layer (EAGLE-3), else None


def eagle3_capture_layers(num_layers: int, aux_layer_ids: tuple[int, ...] | None) -> tuple[int, ...]:
    """Layers whose INPUT is captured: [2, L//2, L-3] by default, or the draft config's ids + 1."""
    if aux_layer_ids is None:
        return (2, num_layers // 2, num_layers - 3)
    return tuple(i + 1 for i in aux_layer_ids)


def make_layer(config: ModelConfig, layer_id: int) -> nn.Module:
    if config.hybrid is not None:
        layer = BambaDecoderLayer if config.hybrid.mixer == "mamba2" else HybridDecoderLayer
        return layer(config, layer_id)
    if config.mla is not None:
        return DeepseekDecoderLayer(config, layer_id, is_moe_layer(config, layer_id))
    moe = MoE(config.hidden_size, config.moe) if is_moe_layer(config, layer_id) else None
    return DecoderLayer(config, layer_id, mlp=moe)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(make_layer(config, i) for i in range(config.num_layers))
        self.norm = make_norm(config)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, capture_layers: tuple[int, ...] = ()):
        super().__init__()
        self.config = config
        self.capture_layers = capture_layers
        self.model = DecoderModel(config)
        self.rope = RotaryEmbedding(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Llama-family layers (Qwen3-MoE's and Mixtral's too: a region is compiled again for each MLP kind it meets)
        # run as compile regions between attention ops (DecoderLayer); MLA and hybrid layers each run whole
        self.between_attention = all(type(layer) is DecoderLayer for layer in self.model.layers)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> TargetHidden:
        # input_ids, positions: [T]
        x = self.model.embed_tokens(input_ids)
        states = {}  # layer id -> residual stream entering it (id == num_layers: the last layer's output)
        act = fused_activation(self, x, attn)
        if act is not None:  # a packed stack on CPU: the fused kernels between its GEMMs
            x, states = fused_layers(self, x, positions, attn, act, self.capture_layers)
        elif self.between_attention:
            x, states = self._layers_between_attention(x, positions, attn)
        else:
            for i, layer in enumerate(self.model.layers):
                if i in self.capture_layers:
                    states[i] = x
                x = layer(positions, x, self.rope, attn)
        states[len(self.model.layers)] = x
        aux = torch.cat([states[i] for i in self.capture_layers], dim=-1) if self.capture_layers else None
        return TargetHidden(self.model.norm(x) if act is None else final_norm(self.model.norm, x), aux)

    def _layers_between_attention(self, x, positions, attn) -> tuple[torch.Tensor, dict]:
        """The DecoderLayer stack, cos / sin computed once: layer 0's norm + QKV, then per layer rope + KV write +
        attention, and the region up to the next layer's QKV (the same compiled code for every boundary).
        Returns the last layer's output and the residual stream entering each capture layer."""
        layers, cos_sin = self.model.layers, self.rope.cos_sin(positions, x.dtype)
        states = {0: x} if 0 in self.capture_layers else {}
        qkv = layers[0].enter(x)
        for i, layer in enumerate(layers[:-1]):
            x, qkv = layer.hand_over(x, layer.self_attn.attend(qkv, self.rope, cos_sin, attn), layers[i + 1])
            if i + 1 in self.capture_layers:
                states[i + 1] = x
        return layers[-1].leave(x, layers[-1].self_attn.attend(qkv, self.rope, cos_sin, attn)), states

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [T, V] float32
