"""GGUF -> Hugging Face directory conversion for llama-architecture models.

Owns: reading GGUF metadata and tensors (dequantized through `gguf.quants`), undoing llama.cpp's rope row
permutation of q/k, rebuilding the GPT-2 byte-level BPE tokenizer, and writing the directory atomically. Beside the
float weights it stores every tensor of a block format in its own blocks (BLOCKS_FILE: what --quantization gguf
runs, see gguf_packed) and each tensor's GGUF type.
Does not own: which GGUF to convert or where to cache it (embedded.py), nor loading the result (loader.py).
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import dequantize
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from fastspec.errors import FastspecError
from fastspec.models.gguf_blocks import BLOCKS_FILE, FORMATS, blocks_state, read_blocks
from fastspec.models.gguf_kquants import READERS

CONVERTER_VERSION = 4  # bump when the output layout changes, so cached conversions are redone
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
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values (gguf.TokenType)


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Convert a llama GGUF into a HF model directory at `out_dir` (replaced atomically); returns out_dir."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = _open_reader(gguf_path)
    arch = _meta(reader, "general.architecture")
    if arch != "llama":
        raise FastspecError(f"{gguf_path}: GGUF architecture '{arch}' is not supported (only 'llama')")
    tensors, blocks, kinds = _read_tensors(reader, gguf_path, dtype)
    config = _model_config(reader, tensors, dtype)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
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
        _write_json(tmp / "generation_config.json", _generation_config(reader, config))
        _write_tokenizer(reader, tmp)
        stat = gguf_path.stat()
        _write_json(tmp / SOURCE_MARKER, {"gguf": str(gguf_path.resolve()), "size": stat.st_size,
                                          "mtime_ns": stat.st_mtime_ns, "dtype": config["torch_dtype"],
                                          "converter_version": CONVERTER_VERSION})
        _swap_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def unpermute_rope_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:  # weight: [n_head * head_dim, in]
    """Undo llama.cpp's q/k row order: GGUF row 2j (2j+1) of a head is HF row j (j + head_dim/2).

    HF rotates (x_j, x_{j+d/2}) together (rotate_half); llama.cpp rotates adjacent pairs (x_2j, x_2j+1).
    E.g. head_dim 4: GGUF rows [a0, b0, a1, b1] -> HF rows [a0, a1, b0, b1].
    """
    rows, cols = weight.shape
    return weight.reshape(n_head, rows // n_head // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


# ---- reading ----

def _open_reader(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise FastspecError(f"{path}: GGUF file not found")
    try:
        reader = gguf.GGUFReader(path)
        for tensor in reader.tensors:  # a truncated data section shows up as a short tensor buffer
            if tensor.data.nbytes != tensor.n_bytes:
                raise ValueError(f"tensor {tensor.name} is truncated")
        return reader
    except (ValueError, KeyError, IndexError, TypeError, OverflowError) as e:
        raise FastspecError(f"{path}: not a valid GGUF file ({e})") from None


def _meta(reader, key: str, default=KeyError):
    field = reader.fields.get(key)
    if field is None:
        if default is KeyError:
            raise FastspecError(f"GGUF metadata is missing '{key}'")
        return default
    return field.contents()


def _special_id(reader, key: str) -> int | None:
    """Id of the bos / eos / pad / unk token, or None when the GGUF does not name one."""
    long_name = {"pad": "padding", "unk": "unknown"}.get(key, key)
    return _meta(reader, f"tokenizer.ggml.{long_name}_token_id", None)


def _f32(value: float) -> float:
    """GGUF stores floats as float32; keep the short decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    if name == "rope_freqs.weight":
        raise FastspecError("GGUF uses llama3 rope frequency scaling (rope_freqs), which is not supported")
    raise FastspecError(f"GGUF tensor '{name}' is not part of a llama model")


def _read_tensors(reader, path: Path, dtype: torch.dtype) -> tuple[dict, dict, dict]:
    """(HF name -> dequantised tensor in `dtype`, the block-format tensors' stored blocks (blocks_state), HF name ->
    GGUF type name); q / k rows in HF's rope order in both forms."""
    n_head = _meta(reader, "llama.attention.head_count")
    n_kv_head = _meta(reader, "llama.attention.head_count_kv", n_head)
    tensors, blocks, kinds = {}, {}, {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        try:
            array = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise FastspecError(f"{path}: tensor type {t.tensor_type.name} cannot be dequantized") from None
        heads = n_head if name.endswith("q_proj.weight") else n_kv_head if name.endswith("k_proj.weight") else None
        weight = torch.from_numpy(np.array(array, dtype=np.float32))  # a copy: F32 data is a read-only mmap
        tensors[name] = (weight if heads is None else unpermute_rope_rows(weight, heads)).to(dtype).contiguous()
        kinds[name] = t.tensor_type.name
        if kinds[name] in BLOCK_KINDS and t.data.ndim == 2:
            b = READERS.get(kinds[name], lambda data: read_blocks(data, kinds[name]))(t.data)
            b = b if heads is None else b.map_rows(lambda x: unpermute_rope_rows(x, heads))
            blocks.update(blocks_state(name, b))
    return tensors, blocks, kinds


# ---- config ----

def _model_config(reader, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict:
    def m(key: str, default=KeyError):
        return _meta(reader, f"llama.{key}", default)

    hidden, n_head = m("embedding_length"), m("attention.head_count")
    head_dim = m("attention.key_length", hidden // n_head)
    if m("rope.dimension_count", head_dim) != head_dim:
        raise FastspecError("GGUF uses partial rotary embeddings (rope.dimension_count != head_dim)")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": m("feed_forward_length"),
        "num_hidden_layers": m("block_count"), "num_attention_heads": n_head,
        "num_key_value_heads": m("attention.head_count_kv", n_head), "head_dim": head_dim,
        "rms_norm_eps": _f32(m("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(m("rope.freq_base", 10000.0)),
        "max_position_embeddings": m("context_length"),
        "vocab_size": tensors["model.embed_tokens.weight"].shape[0],
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "attention_bias": False, "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    scaling = m("rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": _f32(m("rope.scaling.factor"))}
    elif scaling != "none":
        raise FastspecError(f"GGUF rope scaling '{scaling}' is not supported")
    for key in ("bos", "eos", "pad"):
        config[f"{key}_token_id"] = _special_id(reader, key)
    return config


def _generation_config(reader, config: dict) -> dict:
    """bos / eos / pad for generate(); an end-of-turn token distinct from eos also stops generation."""
    eos, eot = config["eos_token_id"], _meta(reader, "tokenizer.ggml.eot_token_id", None)
    stop = [eos, eot] if eot is not None and eos is not None and eot != eos else eos
    return {"bos_token_id": config["bos_token_id"], "eos_token_id": stop, "pad_token_id": config["pad_token_id"]}


# ---- tokenizer ----

def _pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2"):
        return byte_level
    if pre == "smollm":  # digits split one by one, then the GPT-2 regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre == "llama-bpe":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise FastspecError(f"GGUF tokenizer pre-tokenizer '{pre}' is not supported "
                        "(supported: default, gpt2, smollm, llama-bpe)")


def _build_tokenizer(reader) -> Tokenizer:
    model = _meta(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise FastspecError(f"GGUF tokenizer model '{model}' is not supported (only gpt2 byte-level BPE)")
    tokens = _meta(reader, "tokenizer.ggml.tokens")
    types = _meta(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _meta(reader, "tokenizer.ggml.merges")]
    pre = _meta(reader, "tokenizer.ggml.pre", "default")
    bpe = models.BPE(vocab={tok: i for i, tok in enumerate(tokens)}, merges=merges,
                     ignore_merges=pre == "llama-bpe")
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens([AddedToken(tokens[i], special=types[i] == _CONTROL, normalized=False)
                          for i in range(len(tokens)) if types[i] in (_CONTROL, _USER_DEFINED)])
    tokenizer.post_processor = _post_processor(reader, tokens)
    return tokenizer


def _post_processor(reader, tokens: list[str]):
    """Prepend bos / append eos when the GGUF asks for it (e.g. "<s> $A" for add_bos_token)."""
    edges = {}
    for key in ("bos", "eos"):
        token_id = _special_id(reader, key)
        if _meta(reader, f"tokenizer.ggml.add_{key}_token", False) and token_id is not None:
            edges[key] = (tokens[token_id], token_id)
    if not edges:
        return processors.ByteLevel(trim_offsets=False)
    bos, eos = ([edges[k][0]] if k in edges else [] for k in ("bos", "eos"))
    single = bos + ["$A"] + eos
    pair = single + [f"{t}:1" for t in bos] + ["$B:1"] + [f"{t}:1" for t in eos]
    return processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair),
                                         special_tokens=list(set(edges.values())))


def _write_tokenizer(reader, out_dir: Path) -> None:
    _build_tokenizer(reader).save(str(out_dir / "tokenizer.json"))
    tokens = _meta(reader, "tokenizer.ggml.tokens")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "add_bos_token": bool(_meta(reader, "tokenizer.ggml.add_bos_token", False)),
              "add_eos_token": bool(_meta(reader, "tokenizer.ggml.add_eos_token", False)),
              "model_max_length": _meta(reader, "llama.context_length")}
    for key in ("bos", "eos", "pad", "unk"):
        token_id = _special_id(reader, key)
        if token_id is not None:
            config[f"{key}_token"] = tokens[token_id]
    template = _meta(reader, "tokenizer.chat_template", None)
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
