"""The step after fusing a target's projections (`quantise_target`): a float checkpoint's linears rounded at load
where the user asked for it (--quantization fp8 / int8 / int4: `quantise_online`), every stored-form linear bound to
its device's kernel (`bind_model`: quant_layers.bind; a MoE layer's experts stacked as byte codes on CUDA,
byte_experts), and on CPU beside packed kernels the lm_head refined (an approximate GEMM whose best tokens are
rescored exactly). Does not read checkpoints (quant_loader) nor own the modules (quant_layers,
packed_layers).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from fastspec.models.byte_experts import stack_linear_experts
from fastspec.models.gguf_blocks import BLOCK, Blocks, quantise_rows
from fastspec.models.moe import Experts, LinearExperts
from fastspec.models.packed_layers import TENSOR_LINEARS, RefinedHead, int4_linear
from fastspec.kernels.fp8_block import FP8, FP8_MAX
from fastspec.models.quant_layers import QuantLinear, bind_linears
from fastspec.models.quant_weights import Fp8Weight, IntWeight, QuantWeight

ONLINE = ("fp8", "int8", "int4")

log = logging.getLogger(__name__)


def quantise_target(model: nn.Module, method: str, activation: torch.dtype | None, online: bool) -> int:
    """A fused target's linears as `method` runs them: rounded at load where `online` (a float checkpoint and an
    online method), each bound to its device's module (quant_layers.bind; `activation` on CPU:
    activation_choice.fast_activation, None elsewhere), the lm_head refined beside packed kernels on CPU. Returns how
    many linears were rounded."""
    count = quantise_online(model, method) if online else 0
    bind_model(model, activation)
    refine_head(model, activation)
    return count


def bind_model(model: nn.Module, activation: torch.dtype | None) -> None:
    """`model`'s stored-form weights (in place) as they run on their device: MoE experts stacked as byte codes where
    wanted (byte_experts), then every QuantLinear left bound (quant_layers.bind)."""
    stack_linear_experts(model)
    bind_linears(model, activation)


def quantise_online(model: nn.Module, method: str) -> int:
    """Every float linear of the decoder layers (in place; not those a model reads as a tensor, e.g. MLA's
    kv_b_proj) as a QuantLinear, and stacked MoE experts as LinearExperts of them: fp8 e4m3 with a scale per output
    channel; int8 symmetric per output channel; int4 with a scale and an offset per 32 inputs (Q4_1's rounding;
    a linear whose inputs are not a multiple of 32 stays float). Returns how many linears were rounded."""
    count, left = 0, []  # left: names of the linears int4 leaves float
    for prefix, module in list(model.model.layers.named_modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Experts):
                rounded = _online_experts(child, method)
                setattr(module, name, rounded)
                count += 3 * child.gate_proj.shape[0] if rounded is not child else 0
                left += [f"{prefix}.{name}"] if rounded is child else []
            elif isinstance(child, nn.Linear) and name not in TENSOR_LINEARS:
                if method == "int4" and child.in_features % BLOCK:
                    left.append(f"{prefix}.{name}")
                    continue
                bias = None if child.bias is None else child.bias.detach()
                setattr(module, name, QuantLinear(online_form(child.weight.detach(), method), bias))
                count += 1
    if left:
        log.warning("--quantization int4: %d linears whose inputs are not a multiple of %d stay float (layers.%s, ...)",
                    len(left), BLOCK, left[0])
    return count


def _online_experts(experts: Experts, method: str) -> nn.Module:
    """Stacked experts as LinearExperts of rounded linears (int4: only where every expert's inputs tile by 32)."""
    if method == "int4" and (experts.gate_proj.shape[2] % BLOCK or experts.down_proj.shape[2] % BLOCK):
        return experts
    gate_up = [QuantLinear(online_form(torch.cat([g, u]).detach(), method))
               for g, u in zip(experts.gate_proj, experts.up_proj)]
    return LinearExperts(gate_up, [QuantLinear(online_form(d.detach(), method)) for d in experts.down_proj])


def online_form(weight: torch.Tensor, method: str) -> QuantWeight:
    """`weight` [N, K] rounded by `method` (see quantise_online)."""
    w = weight.float()
    if method == "fp8":
        scale = (w.abs().amax(1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)  # [N, 1]
        return Fp8Weight((w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale, w.shape[1])
    if method == "int8":
        scale = (w.abs().amax(1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)  # [N, 1]
        q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
        return IntWeight(Blocks(q, scale, torch.zeros_like(scale), 8))
    return IntWeight(quantise_rows(lambda ids: w[ids], w.shape[0]))


def refine_head(model: nn.Module, activation: torch.dtype | None) -> None:
    """On CPU beside packed projections, the model's float lm_head as a RefinedHead (packed_layers): a 4-bit
    approximation over the whole vocabulary on `activation`'s kernel, its best tokens rescored exactly from the float
    table (the embedding when tied). Float32 activations keep the exact linear (as fast)."""
    if activation in (None, torch.float32) or not isinstance(model.lm_head, nn.Linear):
        return
    tied = model.config.tie_word_embeddings
    table = model.model.embed_tokens if tied else nn.Embedding.from_pretrained(model.lm_head.weight.detach().float())
    if table.embedding_dim % BLOCK:
        return
    approx = int4_linear(quantise_rows(table, table.num_embeddings), activation)
    model.lm_head = RefinedHead(approx, table)
