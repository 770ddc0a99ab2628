"""A GGUF model's 4-bit projections kept packed (`quantization="gguf"`): after the converted model is loaded and
its projections fused, every fused QKV, o, gate_up and down projection whose GGUF tensors are Q4_0 / Q4_1 becomes
an Int4Linear over the file's own blocks (llama.cpp's rope row order undone on them), and its float weight is
dropped. Embeddings, norms and the lm_head stay as converted (the embedded model's lm_head is its Q8_0 embedding).
The converted float32 model is the reference twin: the packed one multiplies bfloat16 activations by the same
weights (tests: teacher-forced agreement, lossless speculation on the packed target).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fastspec.errors import FastspecError
from fastspec.models.gguf import SOURCE_MARKER, unpermute_rope_rows
from fastspec.models.gguf_blocks import Int4Linear, merge_rows, read_blocks

FOUR_BIT = ("Q4_0", "Q4_1")


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted model directory was made from, or None (not a conversion)."""
    marker = Path(model_dir) / SOURCE_MARKER
    if not marker.is_file():
        return None
    return Path(json.loads(marker.read_text())["gguf"])


def pack_gguf_projections(model, model_dir: Path, activation: torch.dtype = torch.bfloat16) -> int:
    """Replace `model`'s fused projections (in place) by packed 4-bit ones read from its source GGUF; returns how
    many were packed. A projection whose tensors are of another type keeps its converted weight."""
    import gguf

    source = gguf_source(model_dir)
    if source is None or not source.is_file():
        raise FastspecError(f"{model_dir}: --quantization gguf needs a model converted from a .gguf file "
                            "(the embedded model or a .gguf path)")
    tensors = {t.name: t for t in gguf.GGUFReader(source).tensors}
    c = model.config

    def blocks(i: int, name: str, heads: int | None = None):
        t = tensors.get(f"blk.{i}.{name}.weight")
        if t is None or t.tensor_type.name not in FOUR_BIT:
            return None
        b = read_blocks(t.data, t.tensor_type.name)
        return b if heads is None else b.map_rows(lambda x: unpermute_rope_rows(x, heads))

    packed = 0
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is None or mlp.gate_up_proj is None:
            raise FastspecError("packing GGUF projections needs the fused model (fuse_projections first)")
        groups = {(attn, "qkv_proj"): [blocks(i, "attn_q", c.num_heads), blocks(i, "attn_k", c.num_kv_heads),
                                       blocks(i, "attn_v")],
                  (attn, "o_proj"): [blocks(i, "attn_output")],
                  (mlp, "gate_up_proj"): [blocks(i, "ffn_gate"), blocks(i, "ffn_up")],
                  (mlp, "down_proj"): [blocks(i, "ffn_down")]}
        for (module, name), parts in groups.items():
            linear = getattr(module, name)
            if all(p is not None for p in parts):
                merged = merge_rows(parts)
                if merged.q.shape != linear.weight.shape:
                    raise FastspecError(f"{source}: layer {i} {name}: packed shape {tuple(merged.q.shape)} does not "
                                        f"match the model's {tuple(linear.weight.shape)}")
                setattr(module, name, Int4Linear(merged, activation, linear.bias).to(linear.weight.device))
                packed += 1
    return packed
