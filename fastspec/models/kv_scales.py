"""A checkpoint's fp8 KV cache scales: per attention layer one K and one V scale, K being stored in an fp8 cache as
K / k_scale and read back times it. Named as llm-compressor writes them (`self_attn.k_scale`, `self_attn.v_scale`), as
ModelOpt does (`self_attn.k_proj.k_scale`, `self_attn.v_proj.v_scale`) or as older exports did (one
`self_attn.kv_scale` for both). Read and checked here; the KV pool applies them (fastspec.memory.kv_pool). Reads no
other tensor and builds nothing.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

from fastspec.errors import FastspecError
from fastspec.models.loader import read_state_dict
from fastspec.models.model_config import ModelConfig

log = logging.getLogger(__name__)
_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale|k_proj\.k_scale|v_proj\.v_scale)")


def is_kv_scale(name: str) -> bool:
    return _NAME.fullmatch(name) is not None


def read_kv_scales(model_dir: Path, config: ModelConfig) -> tuple[tuple[float, float], ...] | None:
    """Per layer of the KV pool (a hybrid model's attention layers, in order) its (k_scale, v_scale), or None where
    the checkpoint has none (or caches MLA latents: not applied there, as logged). Scales of layers past the
    decoder's (an MTP layer's) are left out. One line for a scale that is not one positive finite number, or a layer
    without both."""
    state = read_state_dict(model_dir, keep=is_kv_scale)
    if not state:
        log.info("%s has no KV scales: its fp8 KV cache stores K and V at scale 1", model_dir)
        return None
    if config.mla is not None:
        log.warning("%s: the KV scales are not applied to an MLA latent cache (stored at scale 1)", model_dir)
        return None
    linear = set(config.hybrid.linear_layers) if config.hybrid else set()
    attention = [i for i in range(config.num_layers) if i not in linear]  # KV pool layer j is attention[j]
    found: dict[int, list[float | None]] = {}
    for name, t in sorted(state.items()):
        match = _NAME.fullmatch(name)
        layer, kind = int(match[1]), match[2]
        if t.numel() != 1:
            raise FastspecError(f"{model_dir}: {name} has shape {tuple(t.shape)}: a KV scale is one number")
        value = float(t.float().reshape(()))
        if not (math.isfinite(value) and value > 0):
            raise FastspecError(f"{model_dir}: {name} is {value}: a KV scale is a positive finite number")
        if layer >= config.num_layers:
            continue
        if layer in linear:
            raise FastspecError(f"{model_dir}: {name}: layer {layer} is a linear-attention layer, with no KV cache")
        pair = found.setdefault(layer, [None, None])
        for which in (0, 1) if kind == "kv_scale" else (0,) if kind.startswith("k") else (1,):
            pair[which] = value
    for layer in attention:
        pair = found.get(layer, [None, None])
        if None in pair:
            what = "k_scale" if pair[0] is None else "v_scale"
            raise FastspecError(f"{model_dir}: model.layers.{layer}.self_attn's {what} is missing (the checkpoint "
                                "has KV scales for other layers)")
    return tuple((found[i][0], found[i][1]) for i in attention)
