"""GGUF -> Hugging Face directory conversion for the llama, qwen2, qwen3, phi3 and qwen3moe architectures (phi3 as a
Llama: its fused QKV and gate_up rows split; a llama with an expert_count as Mixtral): a MoE's experts, stacked [E, ...]
in one GGUF tensor per projection (or one per expert, as llama.cpp's early Mixtral files), are written as
transformers' per-expert weights (each expert's blocks, where they are of a block type).

Owns: reading GGUF tensors, undoing llama.cpp's rope row permutation of a llama's q/k, and writing the directory
atomically (the tokenizer: gguf_tokenizer): every tensor of a block format as its blocks only (BLOCKS_FILE: what
--quantization gguf runs, see gguf_packed; a float load dequantises them, gguf_blocks.stored_floats), the others
dequantised (through `gguf.quants`) in model.safetensors, and each tensor's GGUF type.
Does not own: the configs its metadata maps to (gguf_config; the rope scaling a file describes: gguf_rope), which
GGUF to convert or where to cache it (embedded.py), nor loading the result (loader.py).
"""

import json
import os
import re
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np
import torch
from gguf.quants import dequantize
from safetensors.torch import save_file

from fastspec.errors import FastspecError
from fastspec.models.gguf_blocks import BLOCKS_FILE, FORMATS, blocks_state
from fastspec.models.gguf_kquants import READERS, read
from fastspec.models.gguf_config import arch_meta, generation_config, meta, model_config, reader_meta
from fastspec.models.gguf_rope import LONGROPE, ROPE_FACTORS
from fastspec.models.gguf_tokenizer import adds_bos, build_tokenizer, special_id

CONVERTER_VERSION = 8  # bump when the output layout changes, so cached conversions are redone
SOURCE_MARKER = "fastspec_source.json"
BLOCK_KINDS = (*FORMATS, *READERS)  # GGUF types also stored as blocks

_LAYER_NAMES = {  # GGUF tensor name inside blk.N -> HF name inside model.layers.N
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_QWEN2_BIASES = {f"attn_{p}.bias": f"self_attn.{p}_proj.bias" for p in "qkv"}
_QWEN3_NORMS = {f"attn_{p}_norm.weight": f"self_attn.{p}_norm.weight" for p in "qk"}
_PHI3_FUSED = {  # blk.N tensor -> the HF weights its rows stack, and their row counts (rows, heads, kv heads)
    "attn_qkv.weight": (("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                        lambda rows, h, kv: [n * rows // (h + 2 * kv) for n in (h, kv, kv)]),
    "ffn_up.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), lambda rows, h, kv: [rows // 2] * 2),
}


def _experts(block: str, gate: str, up: str, down: str) -> dict:  # blk.N's stacked experts -> HF names of expert {e}
    return {"ffn_gate_inp.weight": f"{block}.gate.weight", **{
        f"ffn_{part}_exps.weight": f"{block}.experts.{{e}}.{name}.weight"
        for part, name in (("gate", gate), ("up", up), ("down", down))}}


class Arch(NamedTuple):
    hf_class: str
    model_type: str
    extra: dict  # its blk.N tensors beyond llama's -> HF names (an expert's with {e}: one GGUF tensor holds all E)
    fused: dict  # its blk.N tensors that stack several HF weights by rows (_PHI3_FUSED's form)
    paired_rope_rows: bool  # llama.cpp pairs q / k rows for its rope (a llama); the others rotate halves, as HF


ARCHITECTURES = {  # general.architecture -> how it converts
    "llama": Arch("LlamaForCausalLM", "llama", {}, {}, True),
    "qwen2": Arch("Qwen2ForCausalLM", "qwen2", _QWEN2_BIASES, {}, False),
    "qwen3": Arch("Qwen3ForCausalLM", "qwen3", _QWEN3_NORMS, {}, False),
    "phi3": Arch("LlamaForCausalLM", "llama", {}, _PHI3_FUSED, False),
    "qwen3moe": Arch("Qwen3MoeForCausalLM", "qwen3_moe",
                     _QWEN3_NORMS | _experts("mlp", "gate_proj", "up_proj", "down_proj"), {}, False),
}
MIXTRAL = Arch("MixtralForCausalLM", "mixtral", _experts("block_sparse_moe", "w1", "w3", "w2"), {}, True)  # a llama
# with experts (llama.cpp's name for Mixtral), written with transformers' Mixtral names


def arch_spec(reader, arch: str) -> Arch:
    """How a GGUF of general.architecture `arch` converts: a llama with an expert_count is Mixtral."""
    return MIXTRAL if arch == "llama" and meta(reader, "llama.expert_count", 0) else ARCHITECTURES[arch]


_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Convert a llama / qwen2 / qwen3 / phi3 / qwen3moe GGUF into a HF model directory at `out_dir` (replaced
    atomically); returns out_dir."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = _open_reader(gguf_path)
    arch = meta(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise FastspecError(f"{gguf_path}: GGUF architecture '{arch}' is not supported "
                            f"(supported: {', '.join(ARCHITECTURES)})")
    tensors, blocks, kinds = _read_tensors(reader, gguf_path, dtype, arch)
    config = model_config(reader, dtype, arch, arch_spec(reader, arch), gguf_path)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    except OSError as e:
        raise _unwritable(out_dir, e) from None
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary model directory
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "model.safetensors").chmod(0o644)
        del tensors
        (tmp / BLOCKS_FILE).parent.mkdir(mode=0o755)
        save_file(blocks, str(tmp / BLOCKS_FILE), metadata={"format": "pt", "kinds": json.dumps(kinds)})
        (tmp / BLOCKS_FILE).chmod(0o644)
        del blocks
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", generation_config(reader, config))
        _write_tokenizer(reader, tmp)
        stat = gguf_path.stat()
        files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
        _write_json(tmp / SOURCE_MARKER, {"gguf": str(gguf_path.resolve()), "size": stat.st_size,
                                          "mtime_ns": stat.st_mtime_ns, "dtype": config["torch_dtype"],
                                          "converter_version": CONVERTER_VERSION, "files": files})
        _swap_into_place(tmp, out_dir)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):  # (a full disk)
            raise _unwritable(out_dir, e) from None
        raise
    return out_dir


def _unwritable(out_dir: Path, e: OSError) -> FastspecError:
    return FastspecError(f"cannot write the converted model into {out_dir.parent} ({e.strerror or e}); point "
                         "FASTSPEC_MODEL_CACHE (or FASTSPEC_CACHE) at a directory that can take it")


def unpermute_rope_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:  # weight: [n_head * head_dim, in]
    """Undo llama.cpp's q/k row order: GGUF row 2j (2j+1) of a head is HF row j (j + head_dim/2).

    HF rotates (x_j, x_{j+d/2}) together (rotate_half); llama.cpp rotates adjacent pairs (x_2j, x_2j+1).
    E.g. head_dim 4: GGUF rows [a0, b0, a1, b1] -> HF rows [a0, a1, b0, b1].
    """
    rows, cols = weight.shape
    return weight.reshape(n_head, rows // n_head // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


# ---- reading ----

class UnknownType(Exception):
    """A tensor type the gguf package cannot name (_Reader)."""


class _Reader(gguf.GGUFReader):
    """The gguf package's reader, refusing a tensor type the package does not know (one newer than it, such as
    llama.cpp's Q2_0) by the tensor's name and the type's id: its own error reads as a malformed file."""

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        known = {t.value for t in gguf.GGMLQuantizationType}
        for field in fields:  # parts: name length, name, n_dims, dims, type, offset
            kind = int(field.parts[4][0])
            if kind not in known:
                raise UnknownType(f"tensor {field.name} has GGML type {kind}, which gguf "
                                  f"{version('gguf')} does not know: not supported")
        super()._build_tensors(start_offs, fields)


def _open_reader(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise FastspecError(f"{path}: GGUF file not found")
    try:
        reader = _Reader(path)
        for tensor in reader.tensors:  # a truncated data section shows up as a short tensor buffer
            if tensor.data.nbytes != tensor.n_bytes:
                raise ValueError(f"tensor {tensor.name} is truncated")
        return reader
    except UnknownType as e:
        raise FastspecError(f"{path}: {e}") from None
    except (ValueError, KeyError, IndexError, TypeError, OverflowError) as e:
        raise FastspecError(f"{path}: not a valid GGUF file ({e})") from None


_ONE_EXPERT = re.compile(r"ffn_(gate|up|down)\.(\d+)\.weight")  # blk.N's expert e alone (early Mixtral files)


def _hf_name(name: str, arch: str, spec: Arch) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts, extra = name.split(".", 2), spec.extra
    if parts[0] == "blk" and len(parts) == 3 and (parts[2] in _LAYER_NAMES or parts[2] in extra):
        return f"model.layers.{parts[1]}.{_LAYER_NAMES.get(parts[2]) or extra[parts[2]]}"
    one = _ONE_EXPERT.fullmatch(parts[-1]) if parts[0] == "blk" and len(parts) == 3 else None
    if one and f"ffn_{one[1]}_exps.weight" in extra:
        return f"model.layers.{parts[1]}.{extra[f'ffn_{one[1]}_exps.weight'].format(e=int(one[2]))}"
    raise FastspecError(f"GGUF tensor '{name}' is not part of a {arch} model")


def _read_tensors(reader, path: Path, dtype: torch.dtype, arch: str) -> tuple[dict, dict, dict]:
    """(HF name -> dequantised tensor in `dtype` for every tensor not of a block format, the block-format tensors'
    blocks (blocks_state: loaders dequantise them, gguf_blocks.stored_floats), HF name -> GGUF type name); q / k rows
    in HF's rope order (llama.cpp pairs a llama's rows for its rope; the others rotate halves, as HF does), a fused
    tensor's rows split into the weights it stacks."""
    m = arch_meta(reader, arch, path)
    n_head = m("attention.head_count")
    n_kv_head = m("attention.head_count_kv", n_head)
    spec = arch_spec(reader, arch)
    tensors, blocks, kinds = {}, {}, {}
    for t in reader.tensors:
        if t.name == ROPE_FACTORS:
            continue
        if t.name in LONGROPE:
            raise FastspecError(f"{path}: LongRoPE ({t.name}: Phi-3 128k, Phi-3.5, Phi-4-mini) is not supported")
        layer, _, part = t.name.removeprefix("blk.").partition(".")
        if t.name.startswith("blk.") and part in spec.fused:
            names, sizes = spec.fused[part]
            edges = np.cumsum([0, *sizes(int(t.shape[-1]), n_head, n_kv_head)])
            pieces = [(f"model.layers.{layer}.{n}", lambda x, a=a, b=b: x[a:b].contiguous())
                      for n, a, b in zip(names, edges[:-1], edges[1:])]
        elif "{e}" in spec.extra.get(part, ""):  # [E, rows, columns]: expert e is t.data[e]
            _read_experts(t, f"model.layers.{layer}.{spec.extra[part]}", path, dtype, (tensors, blocks, kinds))
            continue
        else:
            name = _hf_name(t.name, arch, spec)
            heads = n_head if name.endswith("q_proj.weight") else n_kv_head if name.endswith("k_proj.weight") else None
            rows = (lambda x, h=heads: unpermute_rope_rows(x, h)) if heads and spec.paired_rope_rows else None
            pieces = [(name, rows)]
        kind = t.tensor_type.name
        if kind in BLOCK_KINDS and t.data.ndim == 2:
            b = read(t.data, kind)
            for name, rows in pieces:
                blocks.update(blocks_state(name, b if rows is None else b.map_rows(rows)))
                kinds[name] = kind
            continue
        weight = _dequantised(t, path)
        for name, rows in pieces:
            tensors[name] = (weight if rows is None else rows(weight)).to(dtype).contiguous()
            kinds[name] = kind
    return tensors, blocks, kinds


def _read_experts(t, template: str, path: Path, dtype: torch.dtype, into: tuple[dict, dict, dict]) -> None:
    """A stacked experts tensor [E, rows, columns] as expert e's weight `template.format(e=e)`: its blocks, or its
    floats in `dtype`, as any other weight's."""
    tensors, blocks, kinds = into
    kind = t.tensor_type.name
    floats = None if kind in BLOCK_KINDS else _dequantised(t, path)
    for e in range(t.data.shape[0]):
        name = template.format(e=e)
        if floats is None:
            blocks.update(blocks_state(name, read(t.data[e], kind)))
        else:
            tensors[name] = floats[e].to(dtype).contiguous()
        kinds[name] = kind


def _dequantised(t, path: Path) -> torch.Tensor:
    try:
        array = dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise FastspecError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, which gguf {version('gguf')} "
                            "cannot dequantise: not supported") from None
    return torch.from_numpy(np.array(array, dtype=np.float32))  # a copy: F32 data is a read-only mmap


def _write_tokenizer(reader, out_dir: Path) -> None:
    m = reader_meta(reader)
    build_tokenizer(m).save(str(out_dir / "tokenizer.json"))
    tokens = m("tokenizer.ggml.tokens")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "add_bos_token": adds_bos(m), "add_eos_token": bool(m("tokenizer.ggml.add_eos_token", False)),
              "model_max_length": m(f"{m('general.architecture')}.context_length"),
              "fastspec_chat_special_tokens": True}  # text.tokenizer.CHAT_SPECIAL_TOKENS: chat as llama.cpp frames it
    for key in ("bos", "eos", "pad", "unk"):
        token_id = special_id(m, key)
        if token_id is not None:
            config[f"{key}_token"] = tokens[token_id]
    template = m("tokenizer.chat_template", None)
    if template is not None:
        config["chat_template"] = template
    _write_json(out_dir / "tokenizer_config.json", config)


# ---- writing ----

def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _swap_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename the finished `tmp` to `out_dir`; an existing `out_dir` is moved aside first, then deleted."""
    old = None
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.old-"))
        os.replace(out_dir, old / "dir")
    os.replace(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
