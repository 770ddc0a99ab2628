"""Tiny random Hugging Face models written to GGUF the way llama.cpp lays them out: llama (q / k rows paired for
its rope), qwen2 (q / k / v biases), qwen3 (q / k norms, a head_dim that is not hidden / heads), phi3 (fused QKV
and gate_up, as Phi-3's checkpoints and llama.cpp keep them; a sliding window), qwen3moe and Mixtral (llama.cpp's
`llama` with an expert_count: experts stacked [E, ...] as ffn_gate_exps / ffn_up_exps / ffn_down_exps, the router
ffn_gate_inp), with a byte-level
BPE vocabulary (any llama.cpp pre-tokenizer name) or a SentencePiece one, and Llama 3's rope factors or YaRN's keys.
transformers' own GGUF loader reads these files back as the same model (test_gguf_archs), which checks the layout."""

import gguf
import numpy as np
import torch
from tokenizers import pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "1 2", "l l"]
TOKENS = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe", "12", "ll", "<custom>"]
TYPES = [3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS) - 1) + [4]  # control, normal, user-defined
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
FUSED_NAMES = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}  # phi3's (its fused up: gate first)
FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM, {}), "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
            "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32}),
            "phi3": (Phi3Config, Phi3ForCausalLM, {"pad_token_id": None, "bos_token_id": 0, "eos_token_id": 0}),
            "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, {"head_dim": 32, "num_experts": 4,
                                                                "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                                                "norm_topk_prob": True}),
            "mixtral": (MixtralConfig, MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2})}
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}  # llama.cpp's general.architecture where not model_type
EXPERTS = {"gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"), "down_proj": ("ffn_down_exps",)}  # stacked [E, ...]


def tiny_model(arch: str = "llama", tied: bool = True, seed: int = 0, **config):
    """A 2-layer random model of `arch` over TOKENS, with large weights (and norms != 1, biases != 0) so that any
    mix-up changes the logits."""
    config_class, model_class, extra = FAMILIES[arch]
    base = dict(vocab_size=len(TOKENS), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                rope_theta=10000.0, tie_word_embeddings=tied)
    config = config_class(**{**base, **extra, **config})
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    return model


def tiny_llama(tied: bool, seed: int = 0) -> LlamaForCausalLM:
    return tiny_model("llama", tied, seed)


def llamacpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:  # w: [n_head * d, in], HF row order
    """HF rotates rows (j, j + d/2) together; llama.cpp wants them adjacent: GGUF row 2j+s = HF row j + s*d/2."""
    d = w.shape[0] // n_head
    order = [h * d + i // 2 + (i % 2) * (d // 2) for h in range(n_head) for i in range(d)]
    return w[order]


def gguf_tensors(model, one_per_expert: bool = False) -> dict[str, np.ndarray]:
    """`model`'s tensors under llama.cpp's names; experts stacked [E, ...], or one tensor per expert
    (blk.N.ffn_gate.E.weight, ...: llama.cpp's early Mixtral files) with `one_per_expert`."""
    cfg, out = model.config, {}
    llama = cfg.model_type in ("llama", "mixtral")  # qwen2 / qwen3 use NEOX rope in llama.cpp: rows stay in HF's order
    for name, p in model.state_dict().items():
        w = p.detach().clone()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if llama and name.endswith("q_proj.weight"):
            w = llamacpp_permute(w, cfg.num_attention_heads)
        if llama and name.endswith("k_proj.weight"):
            w = llamacpp_permute(w, cfg.num_key_value_heads)
        if name.startswith("model.layers.") and ".mlp.experts." in name:  # transformers' [E, ...]; gate_up: gate first
            layer, proj = name.removeprefix("model.layers.").split(".")[0], name.rsplit(".", 1)[1]
            for key, part in zip(EXPERTS[proj], w.chunk(len(EXPERTS[proj]), 1)):
                if one_per_expert:
                    out |= {f"blk.{layer}.{key.removesuffix('_exps')}.{e}.weight": part[e].numpy().astype(np.float32)
                            for e in range(part.shape[0])}
                else:
                    out[f"blk.{layer}.{key}.weight"] = part.numpy().astype(np.float32)
            continue
        if name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            module, kind = rest.rsplit(".", 1)
            key = f"blk.{layer}.{(LAYER_NAMES | FUSED_NAMES | {'mlp.gate': 'ffn_gate_inp'})[module]}.{kind}"
        else:
            key = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}[name]
        out[key] = w.numpy().astype(np.float32)
    return out


def bpe_vocab(pre: str = "smollm", add_bos: bool = True, add_eos: bool = False, extra: tuple[str, ...] = (),
              ids: dict | None = None):
    """The writer of a byte-level BPE vocabulary (TOKENS, MERGES, then the control tokens `extra`) with llama.cpp
    pre-tokenizer `pre`; ids: tokenizer.ggml.<key>_token_id -> id, beside bos / eos / pad / unk."""
    def write(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(TOKENS + list(extra))
        w.add_token_types(TYPES + [3] * len(extra))
        for key, token_id in (ids or {}).items():
            w.add_uint32(f"tokenizer.ggml.{key}_token_id", token_id)
        w.add_token_merges(MERGES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_pad_token_id(0)
        w.add_unk_token_id(0)
        w.add_add_bos_token(add_bos)
        w.add_add_eos_token(add_eos)
        w.add_chat_template(TEMPLATE)
    return write


# merges across the edges where llama.cpp's pre-tokenizers split differently: digits, punctuation, apostrophes, spaces
SPLIT_MERGES = [*MERGES, "3 4", "4 5", "12 3", "Ġ 6", "Ġ 1", "' t", "n '", ", ,", "Ġ ,", "Ġ '", "( (", "Ġ (",
                "! !", "Ġ !", "Ġ Ġ", "ĠĠ Ġ", "Ċ Ċ", "Ġ Ċ", "a b", "Ġ a", "Ġa b", ". .", "Ġ ."]
SPLIT_TOKENS = TOKENS + list(dict.fromkeys(m.replace(" ", "") for m in SPLIT_MERGES[len(MERGES):]))


def split_bpe_vocab(pre: str | None, add_bos: bool | None = None):
    """A byte-level BPE vocabulary (SPLIT_TOKENS, SPLIT_MERGES) whose tokens tell llama.cpp's pre-tokenizers apart;
    None leaves a key out."""
    def write(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        if pre is not None:
            w.add_tokenizer_pre(pre)
        w.add_token_list(SPLIT_TOKENS)
        w.add_token_types(TYPES + [1] * (len(SPLIT_TOKENS) - len(TOKENS)))
        w.add_token_merges(SPLIT_MERGES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        if add_bos is not None:
            w.add_add_bos_token(add_bos)
    return write


SPM_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "!", "a", "b", "▁h", "he", "ll", "▁he", "llo", "▁hello", "▁w",
              "or", "▁wor", "ld", "▁world", "ab", "▁ab", "▁▁", "é"]  # best first
SPM_TOKENS = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES + ["<tool>"]
SPM_TYPES = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES) + [4]  # unknown, control, byte, normal, user-defined


def spm_vocab(add_space_prefix: bool | None = None, add_bos: bool | None = None):
    """The writer of a SentencePiece vocabulary (SPM_TOKENS, scored best first, no merges); None leaves a key out."""
    def write(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("llama")
        w.add_token_list(SPM_TOKENS)
        w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))] + [0.0])
        w.add_token_types(SPM_TYPES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        if add_space_prefix is not None:
            w.add_add_space_prefix(add_space_prefix)
        if add_bos is not None:
            w.add_add_bos_token(add_bos)
    return write


def write_gguf(path, model, arch=None, qtype=gguf.GGMLQuantizationType.F32, add_bos=True, add_eos=False, vocab=None,
               rope_factors=None, yarn=None, extra_tensors=None, raw_kinds=None, per_layer=None,
               rope_attn_factor=None, value_length=None, extra_meta=None, one_per_expert=False):
    """`model` as a GGUF of general.architecture `arch` (its own by default) with `vocab` (a bpe_vocab / spm_vocab
    writer; bpe_vocab("smollm") by default), matrices in `qtype`; rope_factors: a rope_freqs tensor [head_dim / 2];
    yarn: (factor, original context length); rope_attn_factor: rope.scaling.attn_factor (llama.cpp's factor on the
    rope's cos / sin); the model config's sliding_window, where set; extra_tensors: name -> float32 array, written as
    they are; raw_kinds: name -> a GGML type the gguf package cannot quantise to, the tensor written as zero bytes of
    that type; per_layer: feed_forward_length / attention.head_count(_kv) -> one value per layer (an array, as
    llama.cpp reads them) instead of the model's; value_length: attention.value_length (with key_length) as given;
    extra_meta: metadata key -> an unsigned integer, written beside the others; one_per_expert: see gguf_tensors."""
    cfg = model.config
    arch = arch or GGUF_ARCH.get(cfg.model_type, cfg.model_type)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    per_layer = per_layer or {}
    w.add_feed_forward_length(per_layer.get("feed_forward_length", cfg.intermediate_size))
    w.add_head_count(per_layer.get("attention.head_count", cfg.num_attention_heads))
    w.add_head_count_kv(per_layer.get("attention.head_count_kv", cfg.num_key_value_heads))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head_dim != cfg.hidden_size // cfg.num_attention_heads or value_length is not None:
        w.add_key_length(head_dim)
        w.add_value_length(value_length or head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base((cfg.rope_parameters or {}).get("rope_theta", 10000.0))
    w.add_rope_dimension_count(head_dim)
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    if yarn is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(yarn[0])
        w.add_rope_scaling_orig_ctx_len(yarn[1])
    if rope_attn_factor is not None:
        w.add_float32(f"{arch}.rope.scaling.attn_factor", rope_attn_factor)
    w.add_vocab_size(cfg.vocab_size)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    for key, value in (extra_meta or {}).items():
        w.add_uint32(key, value)
    (vocab or bpe_vocab(add_bos=add_bos, add_eos=add_eos))(w)
    for name, array in gguf_tensors(model, one_per_expert).items():
        if name in (raw_kinds or {}):
            block, size = gguf.constants.GGML_QUANT_SIZES[raw_kinds[name]]
            raw = np.zeros((*array.shape[:-1], array.shape[-1] // block * size), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=raw_kinds[name])
        elif array.ndim >= 2 and qtype != gguf.GGMLQuantizationType.F32 and "ffn_gate_inp" not in name:  # (a router
            # stays F32, as llama-quantize leaves it)
            w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, array)
    if rope_factors is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_factors, dtype=np.float32))
    for name, array in (extra_tensors or {}).items():
        w.add_tensor(name, np.asarray(array, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

