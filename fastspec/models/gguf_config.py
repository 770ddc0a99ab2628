"""GGUF metadata -> the Hugging Face configs a converted directory holds (config.json, generation_config.json): the
architecture's keys in HF's names (a MoE's expert keys too), its rope scaling (gguf_rope) and special tokens
(gguf_tokenizer).
Does not own: the tensors (gguf_read, gguf_names), the tokenizer files (gguf_tokenizer), nor writing anything."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fastspec.errors import FastspecError
from fastspec.models.gguf_rope import ROPE_FACTORS, f32, rope_scaling
from fastspec.models.gguf_tokenizer import special_id

END_TEXTS = {"<|endoftext|>", "<|im_end|>", "<|end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<end_of_turn>",
             "<EOT>", "_<EOT>", "[EOT]", "</s>", "<eos>", "[EOS]", "<end_of_utterance>", "<｜end▁of▁sentence｜>",
             "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<turn|>", "<|tool_response>", "[e~["}  # llama.cpp's
# llama.cpp's exceptions, read off the end set it has built: a text ends nothing once a pair of its texts is in the set
NOT_END_BESIDE = {"<|end|>": (("<|return|>", "<|call|>"), ("<|return|>", "<|calls|>"), ("<|call|>", "<|flush|>"),
                              ("<|calls|>", "<|flush|>")),  # gpt-oss's and Solar Open's tool calls
                  "</s>": (("<|tool_response>",), ("<|plamo:eos|>",))}  # Gemma 4's and PLaMo's </s>: a normal token
FIM_ENDS = {  # llama.cpp also ends on the FIM pad / repo / separator token: tokenizer.ggml key -> the texts it guesses
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",)}
PER_LAYER = ("feed_forward_length", "attention.head_count", "attention.head_count_kv")  # one value or one per layer


def meta(reader, key: str, default=KeyError):
    field = reader.fields.get(key)
    if field is None:
        if default is KeyError:
            raise FastspecError(f"GGUF metadata is missing '{key}'")
        return default
    return field.contents()


def reader_meta(reader):
    """`meta(key, default)` over one reader: what gguf_tokenizer reads keys through."""
    return lambda key, default=KeyError: meta(reader, key, default)


def arch_meta(reader, arch: str, path: Path):
    """`m(key, default)` over one reader's `{arch}.` keys; a per-layer array (PER_LAYER) of one value reads as it."""
    def m(key: str, default=KeyError):
        value = meta(reader, f"{arch}.{key}", default)
        if key in PER_LAYER and isinstance(value, list):
            if len(set(value)) != 1:
                raise FastspecError(f"{path}: {arch}.{key} differs between layers ({value}): not supported")
            value = value[0]
        return value
    return m


def model_config(reader, dtype: torch.dtype, arch: str, spec, path: Path) -> dict:
    """config.json of an `arch` GGUF (at `path`) converting as `spec` (gguf_names.Arch): its metadata in HF's names."""
    m = arch_meta(reader, arch, path)
    hidden, n_head = m("embedding_length"), m("attention.head_count")
    head_dim = m("attention.key_length", hidden // n_head)
    value_dim = m("attention.value_length", head_dim)
    if value_dim != head_dim:
        raise FastspecError(f"{path}: {arch}.attention.value_length {value_dim} differs from key_length {head_dim}: "
                            "not supported")
    if m("rope.dimension_count", head_dim) != head_dim:
        raise FastspecError("GGUF uses partial rotary embeddings (rope.dimension_count != head_dim)")
    theta = f32(m("rope.freq_base", 10000.0))
    shapes = {t.name: t.shape for t in reader.tensors}  # GGUF order: [columns, rows]
    config = {
        "architectures": [spec.hf_class], "model_type": spec.model_type, "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": m("feed_forward_length", None) or m("expert_feed_forward_length"),
        "num_hidden_layers": m("block_count"), "num_attention_heads": n_head,
        "num_key_value_heads": m("attention.head_count_kv", n_head), "head_dim": head_dim,
        "rms_norm_eps": f32(m("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta, "rope_scaling": rope_scaling(m, rope_factors(reader), head_dim, theta),
        "max_position_embeddings": m("context_length"),
        "vocab_size": int(shapes["token_embd.weight"][-1]),
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": arch == "qwen2", "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if m("expert_count", 0):
        config |= moe_fields(m, spec.model_type, path)
    window = m("attention.sliding_window", None)
    if window:  # (Phi-3 mini 4k's 2047): the context is capped at it, see ModelConfig.context_limit
        config["sliding_window"] = int(window)
    for key in ("bos", "eos", "pad"):
        config[f"{key}_token_id"] = special_id(reader_meta(reader), key)
    return config


def moe_fields(m, model_type: str, path: Path) -> dict:
    """config.json's MoE fields of a qwen3moe or Mixtral GGUF (metadata `m`): softmax routing over expert_count experts
    of which expert_used_count are used, their weights renormalised (llama.cpp renormalises both), every layer MoE; no
    shared experts and no other gating (a file that asks for them is refused)."""
    shared, gating = m("expert_shared_count", 0), m("expert_gating_func", 1)  # (llama.cpp's 1: softmax)
    if shared or gating != 1 or f32(m("expert_weights_scale", 1.0)) != 1.0:
        raise FastspecError(f"{path}: GGUF experts with shared experts ({shared}), gating function {gating} or a "
                            "weights scale are not supported")
    if model_type == "mixtral":  # its experts are intermediate_size wide, their weights always renormalised
        expert_width = m("expert_feed_forward_length", None) or m("feed_forward_length")
        return {"num_local_experts": m("expert_count"), "num_experts_per_tok": m("expert_used_count"),
                "intermediate_size": expert_width}
    return {"num_experts": m("expert_count"), "num_experts_per_tok": m("expert_used_count"), "norm_topk_prob": True,
            "moe_intermediate_size": m("expert_feed_forward_length"), "decoder_sparse_step": 1, "mlp_only_layers": []}


def rope_factors(reader) -> torch.Tensor | None:
    factors = next((t for t in reader.tensors if t.name == ROPE_FACTORS), None)
    return None if factors is None else torch.from_numpy(np.array(factors.data, dtype=np.float32)).flatten()


def generation_config(reader, config: dict) -> dict:
    """bos / eos / pad for generate(); eos_token_id lists every token llama.cpp ends generation on (end_ids)."""
    stop = end_ids(reader_meta(reader), config["eos_token_id"])
    return {"bos_token_id": config["bos_token_id"], "eos_token_id": stop[0] if len(stop) == 1 else stop or None,
            "pad_token_id": config["pad_token_id"]}


def end_ids(m, eos: int | None) -> list[int]:
    """llama.cpp's end-of-generation set over metadata `m(key, default)`: eos, the file's eot / eom / FIM pad / repo /
    separator tokens (a FIM one the file does not name: the first token whose text llama.cpp takes for it), and every
    token whose text ends a turn or a text (END_TEXTS); less NOT_END_BESIDE's texts, named or not."""
    tokens = m("tokenizer.ggml.tokens")
    named = [eos, *(m(f"tokenizer.ggml.{k}_token_id", None) for k in ("eot", "eom"))]
    for key, texts in FIM_ENDS.items():
        named.append(m(f"tokenizer.ggml.{key}_token_id", None))
        if named[-1] is None:  # llama.cpp takes the first candidate in its std::unordered_map's order (text -> id),
            # which the C++ library decides and no rule reproduces; a file with several: the lowest id, deterministic
            named[-1] = next((i for i, token in enumerate(tokens) if token in texts), None)
    ends = list(dict.fromkeys([i for i in named if i is not None]
                              + [i for i, token in enumerate(tokens) if token in END_TEXTS]))
    text = {i: tokens[i] for i in ends if 0 <= i < len(tokens)}  # (an id past the vocabulary has no text)
    dropped = {t for t, pairs in NOT_END_BESIDE.items() if any(set(pair) <= set(text.values()) for pair in pairs)}
    return [i for i in ends if text.get(i) not in dropped]
