"""A GGUF model run on its own blocks (`quantization="gguf"`), built straight from what the conversion stored: no
float copy of a packed weight is ever read.

Each fused projection (QKV, o, gate_up, down) becomes a packed linear over the file's blocks: fastspec's own kernels
(BlockLinear, int16 activations) take every block format (Q4_0 / Q4_1 / Q4_K as 4-bit, IQ4 as 4-bit indices into
its levels; Q5, Q8_0, the other K-quants and mixes of widths in 5, 6 or 8 bits), torch's int4 kernel (Int4Linear,
bfloat16 / float32 activations) only all-4-bit ones; an embedding of a block format stays as its blocks
(BlockEmbedding, exact); the lm_head is a fast approximate GEMM whose best tokens are rescored exactly from the same
table (RefinedHead); every other weight (an F16 or codebook projection, or one torch's kernel cannot take) is read
dequantised and kept in the fast float dtype (CastLinear), with one note naming the types. Norms load as converted.
A MoE layer's experts (Qwen3-MoE, Mixtral) are each such a pair of projections (gate_up, down), run as LinearExperts;
its router is float32.
The first packed load also stores the packed weights beside the blocks, per torch version (PackedCache; torch's int4
layout is its own): later starts read them as they are; another torch version's no start has read for UNUSED_S go.
The converted float32 model is the reference twin: with float32 activations the packed model computes the same
weights to float32 rounding; int16 or bfloat16 ones are the fast kernels (tests: logits, teacher-forced agreement,
lossless speculation on the packed target).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from fastspec.errors import FastspecError
from fastspec.kernels.cpu_linear import trim_host_heap
from fastspec.models.activation_choice import float_dtype
from fastspec.models.causal_lm import CausalLM
from fastspec.models.gguf_blocks import BLOCKS_FILE, blocks_from_state, merge_rows, quantise_rows
from fastspec.utils.shared_dirs import held_temp, locked, sweep
from fastspec.models.gguf_names import EXPERT_NAMES
from fastspec.models.moe import LinearExperts, MoE, is_moe_layer
from fastspec.models.rope import RotaryEmbedding
from fastspec.models.packed_layers import (
    BlockEmbedding,
    BlockLinear,
    CastLinear,
    Int4Linear,
    RefinedHead,
)

log = logging.getLogger(__name__)

PROJECTIONS = {  # each layer's linears -> the checkpoint weights each stacks, inside model.layers.N
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


class StoredWeights:
    """A converted GGUF directory's weights, read one tensor at a time: the stored blocks, the dequantised floats."""

    def __init__(self, model_dir: Path):
        if not (model_dir / BLOCKS_FILE).is_file():  # only a conversion of a .gguf file stores its blocks
            raise FastspecError(f"{model_dir}: --quantization gguf needs a model converted from a .gguf file "
                                "(the embedded model or a .gguf path)")
        self.blocks = safe_open(str(model_dir / BLOCKS_FILE), "pt")
        self.floats = safe_open(str(model_dir / "model.safetensors"), "pt")
        self.kinds: dict[str, str] = json.loads(self.blocks.metadata()["kinds"])  # HF name -> GGUF type
        self.stored = {k.rsplit(".", 1)[0] for k in self.blocks.keys()}  # names kept as blocks
        self.dequantised: set[str] = set()  # GGUF types read as floats where blocks were wanted

    def bits(self, name: str) -> int | None:
        if name not in self.stored:
            return None
        return 4 if self.blocks.get_slice(f"{name}.q").get_dtype() == "U8" else 8

    def rows(self, name: str) -> int:
        """The rows of the weight `name` stored as blocks (read from its header, not its data)."""
        return self.blocks.get_slice(f"{name}.q").get_shape()[0]

    def get_blocks(self, name: str):
        return blocks_from_state(self.blocks.get_tensor, name)

    def bias(self, parts: list[str], dtype: torch.dtype) -> torch.Tensor | None:
        """The biases of the weights `parts` stacked (Qwen2's q / k / v), or None when they have none."""
        names = [p.removesuffix("weight") + "bias" for p in parts]
        if not any(n in self.kinds for n in names):
            return None
        return torch.cat([self.get_float(n, dtype) for n in names])

    def get_float(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight `name` dequantised (from its blocks where stored) in `dtype`; notes its GGUF type unless it
        is a float type."""
        if self.kinds[name] not in ("F32", "F16", "BF16"):
            self.dequantised.add(self.kinds[name])
        if name in self.stored:
            return self.get_blocks(name).dequantise(dtype)
        return self.floats.get_tensor(name).to(dtype)


PACKED_LAYOUT = 2  # raised whenever BlockLinear.pack lays a weight out otherwise: older caches are packed again
UNUSED_S = 14 * 24 * 3600  # another torch version's packed cache no start has read for this long is removed
_PACKED = re.compile(r"int4-cpu-torch-.+\.safetensors")  # every torch version's and layout's
_PACKED_TEMP = re.compile(r"\.int4-.+\.tmp")  # one being written (shared_dirs.held_temp)


class PackedCache:
    """The packed weights of one converted model for this torch version and PACKED_LAYOUT (torch's int4 layout is its
    own; the int16 kernels' is fastspec's): read when stored (its time touched: the last use), else collected while
    packing and written once at the end (atomically; a read-only cache is left as it is). Every start removes the temp
    files of writers that are gone (shared_dirs.sweep), whether it writes or not."""

    def __init__(self, model_dir: Path):
        self.prefix = f"int4-cpu-torch-{torch.__version__}"
        self.path = model_dir / Path(BLOCKS_FILE).parent / f"{self.prefix}-layout{PACKED_LAYOUT}.safetensors"
        with contextlib.suppress(OSError), locked(self.path.parent):  # (a read-only cache: left as it is)
            sweep(self.path.parent, _PACKED_TEMP)
        self.stored, self.names = None, set()
        try:
            self.stored = safe_open(str(self.path), "pt")
            self.names = set(self.stored.keys())
        except Exception:  # none yet, or damaged (safetensors' errors have no common base): packed and written anew
            self.stored = None
        if self.stored is not None:
            with contextlib.suppress(OSError):
                os.utime(self.path)
        self.new: dict[str, torch.Tensor] = {}

    def linear(self, name: str, blocks, rows: int, activation: torch.dtype,
               bias: torch.Tensor | None = None) -> nn.Module:
        """The packed linear `name` of `rows` outputs for `activation` (packed_layers.int4_linear): from the cache,
        else packed from `blocks()` (its Blocks: 4-bit, or with int16 activations any width; the packing pads its rows
        to the kernel's tile, which the module drops); `bias` as given (not cached)."""
        ours = activation == torch.int16
        keys = [f"{name}.blocks_packed", f"{name}.blocks_scales"] if ours else [f"{name}.packed", f"{name}.scale_zero"]
        if all(k in self.names for k in keys):
            keys += [f"{name}.blocks_levels"] if f"{name}.blocks_levels" in self.names else []
            tensors = [self.stored.get_tensor(k) for k in keys]
        else:
            keys += [f"{name}.blocks_levels"] if ours else []  # (a BlockLinear's third tensor, where it has one)
            tensors = (BlockLinear if ours else Int4Linear).pack(blocks())
            self.new.update(zip(keys, tensors))
        return (BlockLinear(*tensors, bias=bias, out_features=rows) if ours
                else Int4Linear(*tensors, activation, bias, out_features=rows))

    def save(self) -> None:
        """Write the packed weights packed now beside the stored ones (one file, atomically), then remove the packed
        caches no start reads: this torch's other layouts, and other torch versions' unused for UNUSED_S (a cache
        that is not writable: the next start packs again)."""
        if self.new:
            kept = {k: self.stored.get_tensor(k) for k in self.names}
            try:
                with held_temp(self.path.parent, ".int4-", _PACKED_TEMP) as tmp:
                    save_file(kept | self.new, str(tmp))
                    os.chmod(tmp, 0o644)
                    os.replace(tmp, self.path)
            except OSError:
                return
        now, ours = time.time(), re.compile(re.escape(self.prefix) + r"(-layout\d+)?\.safetensors")
        for entry in self.path.parent.iterdir():
            if entry == self.path or not _PACKED.fullmatch(entry.name):
                continue
            with contextlib.suppress(OSError):  # (gone already, or not ours to remove)
                if ours.fullmatch(entry.name) or now - entry.stat().st_mtime > UNUSED_S:
                    entry.unlink()


def load_packed_target(model: CausalLM, model_dir: Path, dtype: torch.dtype, device="cpu",
                       activation: torch.dtype = torch.bfloat16) -> CausalLM:
    """The converted GGUF model at `model_dir` built into `model` (a skeleton on the meta device), fused, on its
    blocks (see the module docstring): the residual stream, norms and KV in `dtype`, the 4-bit kernels on
    `activation` (float32: exact; bfloat16: torch's fast one; int16: fastspec's, see packed_layers.int4_linear)."""
    weights, cache, config = StoredWeights(model_dir), PackedCache(model_dir), model.config
    with torch.device(device):
        model.rope = RotaryEmbedding(config)
    for i, layer in enumerate(model.model.layers):
        moe = is_moe_layer(config, i)
        linears = {name: _projection(weights, cache, f"model.layers.{i}.{name}",
                                     [f"model.layers.{i}.{p}.weight" for p in parts], activation, dtype).to(device)
                   for name, parts in PROJECTIONS.items() if not (moe and name.startswith("mlp."))}
        layer.self_attn.fuse(linears["self_attn.qkv_proj"])
        layer.self_attn.o_proj = linears["self_attn.o_proj"]
        if moe:
            _build_moe(layer.mlp, weights, cache, f"model.layers.{i}", config, activation, dtype, device)
        else:
            layer.mlp.fuse(linears["mlp.gate_up_proj"])
            layer.mlp.down_proj = linears["mlp.down_proj"]
        norms = {"input_layernorm": layer.input_layernorm, "post_attention_layernorm": layer.post_attention_layernorm}
        if layer.self_attn.q_norm is not None:  # Qwen3's per-head norms of q and k
            norms |= {"self_attn.q_norm": layer.self_attn.q_norm, "self_attn.k_norm": layer.self_attn.k_norm}
        for name, norm in norms.items():
            norm.weight = _parameter(weights.get_float(f"model.layers.{i}.{name}.weight"), dtype, device)
    model.model.norm.weight = _parameter(weights.get_float("model.norm.weight"), dtype, device)
    model.model.embed_tokens = _table(weights, "model.embed_tokens.weight", dtype).to(device)
    model.lm_head = _head(weights, cache, model, activation, dtype).to(device)
    cache.save()
    trim_host_heap()  # the transients of building it go back to the OS before the next allocations
    if weights.dequantised:
        log.warning("--quantization gguf: %s tensors have no packed kernel here and run dequantised to %s",
                    " / ".join(sorted(weights.dequantised)), str(float_dtype(activation)).removeprefix("torch."))
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise FastspecError(f"{model_dir}: weights not built for --quantization gguf: {', '.join(left[:4])}")
    return model.eval().requires_grad_(False)


def _projection(weights: StoredWeights, cache: PackedCache, name: str, parts: list[str], activation: torch.dtype,
                dtype: torch.dtype = torch.float32) -> nn.Module:
    """The linear `name` stacking `parts` by rows: packed when every part is 4-bit blocks, or is stored as blocks at
    all where fastspec's kernels run (int16 activations: 8-bit ones too, as BlockLinear's 8-bit layout), else their
    dequantised floats; their biases, where they have them, in the residual `dtype`."""
    bits, bias = [weights.bits(n) for n in parts], weights.bias(parts, dtype)
    if all(b == 4 for b in bits) or (activation == torch.int16 and all(bits)):
        return cache.linear(name, lambda: merge_rows([weights.get_blocks(n) for n in parts]),
                            sum(weights.rows(n) for n in parts), activation, bias)
    floats = [weights.get_float(n, float_dtype(activation)) for n in parts]
    return CastLinear(floats[0] if len(floats) == 1 else torch.cat(floats), bias)


def _build_moe(moe: MoE, weights: StoredWeights, cache: PackedCache, layer: str, config, activation: torch.dtype,
               dtype: torch.dtype, device) -> None:
    """A MoE layer's router (float32, as every router) and experts: each expert's gate_up and down a projection as
    any other (packed where its blocks allow), run as LinearExperts."""
    block, gate, up, down = EXPERT_NAMES[config.architecture]
    moe.gate.weight = _parameter(weights.get_float(f"{layer}.{block}.gate.weight"), torch.float32, device)
    expert = [f"{layer}.{block}.experts.{e}" for e in range(config.moe.num_experts)]
    gate_up = [_projection(weights, cache, f"{p}.gate_up_proj", [f"{p}.{gate}.weight", f"{p}.{up}.weight"],
                           activation, dtype).to(device) for p in expert]
    downs = [_projection(weights, cache, f"{p}.down_proj", [f"{p}.{down}.weight"], activation, dtype).to(device)
             for p in expert]
    moe.experts = LinearExperts(gate_up, downs)


def _table(weights: StoredWeights, name: str, dtype: torch.dtype) -> nn.Module:
    """A vocabulary table (ids -> rows in `dtype`): its blocks where stored, else its dequantised floats."""
    if weights.bits(name):
        return BlockEmbedding(weights.get_blocks(name), dtype)
    return nn.Embedding.from_pretrained(weights.get_float(name, dtype))


def _head(weights: StoredWeights, cache: PackedCache, model: CausalLM, activation: torch.dtype,
          dtype: torch.dtype) -> nn.Module:
    """The lm_head: with float32 activations the exact linear; else a RefinedHead over the table (the embedding
    when tied): packed int4 over its blocks when they are 4-bit, else over a 4-bit rounding of it (cached like the
    projections; 4-bit blocks are the same packed weight as the exact linear's), with the best tokens rescored
    exactly. Either way [..., V] logits, V the table's rows."""
    tied = model.config.tie_word_embeddings
    name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    if activation == torch.float32:
        return _projection(weights, cache, "lm_head", [name], activation)
    table = model.model.embed_tokens if tied else _table(weights, name, dtype)
    four_bit = weights.bits(name) == 4
    rows = table.num_embeddings
    blocks = (lambda: weights.get_blocks(name)) if four_bit else (lambda: quantise_rows(table, rows))
    return RefinedHead(cache.linear("lm_head", blocks, rows, activation), table)


def _parameter(tensor: torch.Tensor, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False)
