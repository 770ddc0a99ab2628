"""Online 4-bit quantisation (`quantization="int4"`, CPU): a float checkpoint's fused projections rounded at load to
4 bits per weight with a scale and an offset per group of 32 (Q4_1's rounding, gguf_blocks.quantise_rows) and run
through a 4-bit kernel (packed_layers.int4_linear); the lm_head becomes a RefinedHead over its float table (the
embedding when tied), so its best tokens are scored exactly. Embeddings, norms and a projection whose shape the
kernel cannot take stay as loaded. Llama-family targets (Llama, Qwen2, Qwen3, Mistral). Does not own the kernels
(packed_layers) nor loading (loader).
"""

from __future__ import annotations

import torch
from torch import nn

from fastspec.errors import FastspecError
from fastspec.models.gguf_blocks import BLOCK, quantise_rows
from fastspec.models.layers import MLP, Attention
from fastspec.models.llama import LlamaForCausalLM
from fastspec.models.packed_layers import ROW_TILE, RefinedHead, int4_linear

PROJECTIONS = {Attention: ("qkv_proj", "o_proj"), MLP: ("gate_up_proj", "down_proj")}


def quantise_int4(model: LlamaForCausalLM, activation: torch.dtype) -> int:
    """Round `model`'s fused projections (in place) to 4 bits for `activation` (packed_layers.int4_linear) and,
    unless that is float32 (exact), its lm_head to a refined 4-bit one; returns how many projections were rounded."""
    if not model.between_attention:
        raise FastspecError(f"--quantization int4 takes Llama-family targets (Llama, Qwen2, Qwen3, Mistral), not "
                            f"{model.config.architecture}")
    rounded = 0
    for module in list(model.modules()):
        for name in PROJECTIONS.get(type(module), ()):
            linear = getattr(module, name)
            if linear is None:
                raise FastspecError("--quantization int4 needs the fused model (fuse_projections first)")
            n, k = linear.weight.shape
            if k % BLOCK == 0 and n % ROW_TILE == 0:
                weight = linear.weight.detach().float()
                blocks = quantise_rows(lambda ids, w=weight: w[ids], n)
                setattr(module, name, int4_linear(blocks, activation, linear.bias))
                rounded += 1
    if activation != torch.float32:  # float32 activations: the float lm_head is as fast and exact
        tied = model.config.tie_word_embeddings
        table = model.model.embed_tokens if tied else nn.Embedding.from_pretrained(model.lm_head.weight.detach())
        approx = int4_linear(quantise_rows(table, table.num_embeddings).pad_rows(ROW_TILE), activation)
        model.lm_head = RefinedHead(approx, table)
    return rounded
