"""The checkpoint's own multi-token-prediction layers as a draft (NEXTN): which checkpoints have one, where
their weights sit (DeepSeek's layers past the last decoder layer, Qwen3-Next's `mtp.`), and loading only those
tensors (the target's weights are not read a second time). A quantised checkpoint's MTP linears are kept in their
stored form (quant_loader, as a quantised target's are), or dequantised with --quantization none."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from torch import nn

from fastspec.errors import FastspecError
from fastspec.models.causal_lm import CausalLM
from fastspec.models.deepseek import DeepseekMTP, MTPStack
from fastspec.models.loader import (
    _keep_routers_float32,
    cast_own,
    load_into,
    read_config,
    read_state_dict,
    skip_init,
    weight_names,
)
from fastspec.models.model_config import ModelConfig
from fastspec.models.moe import stack_experts
from fastspec.models.quant_config import QuantScheme
from fastspec.models.quant_loader import build_quantised, split_quantised
from fastspec.models.qwen3_next import Qwen3NextMTP


def load_mtp(model_dir: Path, target: CausalLM, dtype: torch.dtype, device="cpu",
             config: ModelConfig | None = None, scheme: QuantScheme | None = None, keep: bool = False):
    """The checkpoint's own multi-token-prediction layers as a draft model (NEXTN): DeepSeek's (`model.layers.
    {num_hidden_layers + k}.`, one per draft step when there are several; each layer's embedding and head are the
    target's unless the checkpoint stores its own) or Qwen3-Next's (`mtp.`; the target's embedding and lm_head).
    `config`: the checkpoint's, as read (default: read here); `scheme`: its quantisation (None: float weights);
    `keep`: a quantised checkpoint's linears as stored (else dequantised to `dtype`)."""
    config = config or read_config(model_dir)
    prefix = mtp_prefix(config)
    weights = {} if prefix is None else read_state_dict(model_dir, partial(_is_mtp_weight, config))
    if not any(k.startswith(prefix) for k in weights):
        raise FastspecError(f"{model_dir}: NEXTN needs the checkpoint's MTP layer ({prefix or 'none'}*), and this "
                            f"{config.architecture} checkpoint has none; give an EAGLE head with --draft")
    build = partial(_built, dtype=dtype, device=device, scheme=scheme, keep=keep, source=str(model_dir), target=target)
    if config.mla is None:
        state = {k.removeprefix(prefix): v for k, v in weights.items() if k.startswith(prefix)}
        model = build(lambda: Qwen3NextMTP(config, target.model.embed_tokens, target.lm_head), state,
                      ("embed_tokens.", "lm_head."))
        return model.eval().requires_grad_(False)
    layers = []
    for k in range(max(config.num_nextn_predict_layers, 1)):
        layer_prefix = f"model.layers.{config.num_layers + k}."
        state = {n.removeprefix(layer_prefix): v for n, v in weights.items() if n.startswith(layer_prefix)}
        if not state:
            break  # fewer layers stored than config.json counts
        borrowed = [name for name in ("embed_tokens", "shared_head.head") if f"{name}.weight" not in state]
        layers.append(build(partial(_deepseek_mtp_layer, config, k, borrowed, target), state,
                            tuple(f"{name}." for name in borrowed)))
    return (layers[0] if len(layers) == 1 else MTPStack(layers)).eval().requires_grad_(False)


def _deepseek_mtp_layer(config: ModelConfig, k: int, borrowed: list[str], target: CausalLM) -> DeepseekMTP:
    """MTP layer k, its embedding and head the target's where the checkpoint stores none (`borrowed`)."""
    layer = DeepseekMTP(config, config.num_layers + k, attn_layer_id=k)
    if "embed_tokens" in borrowed:
        layer.embed_tokens = target.model.embed_tokens
    if "shared_head.head" in borrowed:
        layer.shared_head.head = target.lm_head
    return layer


def _built(make, state: dict, skip: tuple[str, ...], dtype, device, scheme: QuantScheme | None, keep: bool,
           source: str, target: CausalLM) -> nn.Module:
    """The module `make()` builds, its weights from `state`: a float one built on `device` in `dtype`; a quantised
    one's stored linears kept (`keep`) on a skeleton on the meta device, or all dequantised into `state`."""
    if scheme is None:
        with skip_init(), torch.device(device):
            module = _keep_routers_float32(cast_own(make(), dtype, target))  # (the borrowed modules as they are)
        load_into(module, stack_experts(state), skip, source)
        return module
    with skip_init(), torch.device("meta"):  # the target's borrowed modules stay as they are
        module = make()
    state, forms, experts = split_quantised(state, scheme, module, dtype, keep, source, strict=False)
    skip += build_quantised(module, state, forms, experts, dtype, device, source)
    load_into(_keep_routers_float32(module), stack_experts(state), skip, source)
    return module


def _is_mtp_weight(config: ModelConfig, name: str) -> bool:
    """An MTP layer's tensor: Qwen3-Next's `mtp.*`, DeepSeek's layers past the last decoder layer (the target's
    own weights are not read a second time)."""
    if config.mla is None:
        return name.startswith(mtp_prefix(config))
    parts = name.split(".")
    return name.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) >= config.num_layers


def mtp_prefix(config: ModelConfig) -> str | None:
    """Where a checkpoint keeps its MTP layer's weights (None: an architecture without one)."""
    if config.mla is not None:
        return f"model.layers.{config.num_layers}."
    return "mtp." if config.architecture == "Qwen3NextForCausalLM" else None


def drafts_with_mtp(algorithm: str, draft: ModelConfig) -> bool:
    """NEXTN: EAGLE whose draft is a checkpoint's MTP layer, not an EAGLE head (`algorithm`: canonical)."""
    return algorithm == "EAGLE" and mtp_prefix(draft) is not None


def has_mtp_layer(model_dir: Path, config: ModelConfig) -> bool:
    """Whether the checkpoint stores an MTP layer (config.json's count alone is not proof: transformers writes
    num_nextn_predict_layers = 1 into DeepSeek checkpoints without one)."""
    prefix = mtp_prefix(config)
    return prefix is not None and any(name.startswith(prefix) for name in weight_names(model_dir))


def mtp_draft(model: str, model_dir: Path, config: ModelConfig, algorithm: str | None, draft: str | None) -> str | None:
    """The draft of NEXTN / EAGLE without one on a DeepSeek target: the target checkpoint itself, whose MTP layer
    drafts (SGLang's default). NEXTN on a checkpoint without an MTP layer is an error."""
    algorithm = (algorithm or "").upper()
    if draft is not None or algorithm not in ("NEXTN", "EAGLE"):
        return draft
    if has_mtp_layer(model_dir, config):
        return model
    if algorithm == "NEXTN":
        where = f" ({mtp_prefix(config)}*)" if mtp_prefix(config) else ""
        raise FastspecError(f"{model_dir}: NEXTN drafts with the checkpoint's MTP layer, and this "
                            f"{config.architecture} checkpoint has none{where}")
    return draft


def check_mtp_fits(draft: ModelConfig, target: ModelConfig, source: str) -> None:
    """An MTP layer from another DeepSeek checkpoint must share the target's width and vocabulary."""
    for field in ("hidden_size", "vocab_size"):
        if getattr(draft, field) != getattr(target, field):
            raise FastspecError(f"{source}: the MTP draft's {field} {getattr(draft, field)} != the target's "
                                f"{getattr(target, field)}")
