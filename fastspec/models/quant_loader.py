"""A quantised Hugging Face checkpoint loaded as a target (the config's scheme: quant_config; its tensors:
quant_decode): each quantised linear kept in its stored form (QuantLinear, built on a skeleton on the meta device so
no float copy of it is ever made), everything else loaded as stored; or, with `--quantization none`, every
quantised weight dequantised to the model's dtype (the exact reference). Weights the model reads as tensors rather
than through a linear (stacked MoE experts, MLA's kv_b_proj, an lm_head) are dequantised either way. Which kernel
a kept linear runs on is chosen after fusing (quantise.quantise_target). Does not read files itself (loader).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from torch import nn

from fastspec.errors import FastspecError
from fastspec.models.gguf_blocks import Blocks
from fastspec.models.moe import Experts, LinearExperts
from fastspec.models.packed_layers import TENSOR_LINEARS
from fastspec.models.quant_config import QuantScheme, read_scheme
from fastspec.models.quant_decode import decode_state
from fastspec.models.quant_layers import QuantLinear
from fastspec.models.quant_weights import QuantWeight
from fastspec.models.rope import RotaryEmbedding

log = logging.getLogger(__name__)

FLOAT_LINEARS = ("lm_head", *TENSOR_LINEARS)  # linears kept float: the head, those a model reads as a tensor


def checkpoint_scheme(model_dir: Path) -> QuantScheme | None:
    """The QuantScheme of the checkpoint at `model_dir` (None: float weights, or no config.json to read)."""
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return read_scheme(raw, Path(model_dir), str(Path(model_dir) / "config.json")) if isinstance(raw, dict) else None


def split_quantised(state: dict[str, torch.Tensor], scheme: QuantScheme, skeleton: nn.Module, dtype: torch.dtype,
                    keep: bool, source: str, strict: bool = True
                    ) -> tuple[dict[str, torch.Tensor], dict[str, QuantWeight], dict]:
    """(float state, {linear name: stored form}, {MoE experts name: LinearExperts' stored linears}): with `keep`,
    the quantised weights of `skeleton`'s linears and of its MoE layers whose every expert is quantised kept in
    their form; every other quantised weight (all of them without `keep`) dequantised into the state as
    `name.weight` in `dtype`. `strict`: a state without a quantised tensor is an error (a checkpoint's MTP layers,
    not strict, may be stored in float beside quantised decoder layers)."""
    floats, forms = decode_state(state, scheme, source)
    if not forms and strict:
        raise FastspecError(f"{source}: quantization_config says {scheme.label} but no tensor is quantised")
    linears = {name for name, m in skeleton.named_modules() if isinstance(m, nn.Linear)
               and not name.endswith(FLOAT_LINEARS)}
    kept = {name: form for name, form in forms.items() if keep and name in linears}
    experts = _kept_experts(forms, skeleton) if keep else {}
    for name, form in forms.items():
        match = _EXPERT.match(name)
        if name not in kept and not (match and match[1] in experts):
            floats[f"{name}.weight"] = form.dequantise(dtype)
    left = len(forms) - len(kept) - 3 * sum(len(d) for _, d in experts.values())
    if keep and left:
        log.info("%s: %d quantised weights read as tensors by the model are dequantised to %s", source, left,
                 str(dtype).removeprefix("torch."))
    return floats, kept, experts


_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)$")


def _kept_experts(forms: dict[str, QuantWeight], skeleton: nn.Module) -> dict[str, tuple[list, list]]:
    """{experts module name: ([E merged gate | up QuantLinears], [E down QuantLinears])} for every MoE layer of
    `skeleton` whose experts are all quantised and whose gate / up forms merge."""
    out = {}
    for name, module in skeleton.named_modules():
        if not isinstance(module, Experts):
            continue
        count = module.gate_proj.shape[0]
        parts = [[forms.get(f"{name}.{e}.{p}") for p in ("gate_proj", "up_proj", "down_proj")] for e in range(count)]
        if any(f is None for p in parts for f in p):
            continue
        gate_up = [QuantLinear.merge([QuantLinear(g), QuantLinear(u)]) for g, u, _ in parts]
        if all(m is not None for m in gate_up):
            out[name] = (gate_up, [QuantLinear(d) for _, _, d in parts])
    return out


def build_quantised(model: nn.Module, state: dict[str, torch.Tensor], forms: dict[str, QuantWeight],
                    experts: dict, dtype: torch.dtype, device, source: str) -> tuple[str, ...]:
    """`model` (a skeleton on the meta device: a CausalLM or an MTP draft, whose modules borrowed from a target are
    real already), in place: `forms`' linears as QuantLinears and `experts`' MoE layers as LinearExperts on
    `device` (biases taken from `state`), its rotary table built on `device`, every other meta tensor allocated on
    `device` in `dtype` for the float loader to fill. Returns the name prefixes of what was built here (the loader's
    skip list)."""
    for name, (gate_up, down) in experts.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, LinearExperts(gate_up, down).to(device))
    for name, form in forms.items():
        parent, _, attr = name.rpartition(".")
        bias = None
        if model.get_submodule(name).bias is not None:
            if f"{name}.bias" not in state:
                raise FastspecError(f"{source}: missing weight {name}.bias")
            bias = state.pop(f"{name}.bias")
        moved = type(form)(**{k: _to(v, device) for k, v in vars(form).items()})
        setattr(model.get_submodule(parent), attr, QuantLinear(moved, None if bias is None else bias.to(device, dtype)))
    with torch.device(device):
        model.rope = RotaryEmbedding(model.config)
    for module in model.modules():
        for group in (module._parameters, module._buffers):
            for attr, tensor in group.items():
                if tensor is not None and tensor.is_meta:
                    kind = dtype if tensor.is_floating_point() else tensor.dtype
                    empty = torch.empty(tensor.shape, dtype=kind, device=device)
                    group[attr] = nn.Parameter(empty, requires_grad=False) if group is module._parameters else empty
    return tuple(f"{name}." for name in (*forms, *experts))


def _to(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, Blocks):
        return type(value)(value.q.to(device), value.scale.to(device), value.offset.to(device), value.bits)
    return value
