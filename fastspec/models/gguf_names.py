"""GGUF tensor names -> Hugging Face names, per architecture: the llama names every family shares, each family's
extra tensors (a MoE's experts with {e}: one GGUF tensor holds all E, or one per expert as llama.cpp's early Mixtral
files) and its fused tensors (phi3's QKV and gate_up rows).
Does not own: reading the tensors (gguf_read) nor the configs (gguf_config)."""

import re
from typing import NamedTuple

from fastspec.errors import FastspecError
from fastspec.models.gguf_config import meta

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


EXPERT_NAMES = {  # a MoE class's block and its experts' gate / up / down names, as transformers' checkpoints
    "Qwen3MoeForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "MixtralForCausalLM": ("block_sparse_moe", "w1", "w3", "w2")}


def _experts(hf_class: str) -> dict:  # blk.N's router and stacked experts -> HF names (expert e's with {e})
    block, gate, up, down = EXPERT_NAMES[hf_class]
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
    "qwen3moe": Arch("Qwen3MoeForCausalLM", "qwen3_moe", _QWEN3_NORMS | _experts("Qwen3MoeForCausalLM"), {}, False),
}
# a llama with experts (llama.cpp's name for Mixtral), written with transformers' Mixtral names
MIXTRAL = Arch("MixtralForCausalLM", "mixtral", _experts("MixtralForCausalLM"), {}, True)


def arch_spec(reader, arch: str) -> Arch:
    """How a GGUF of general.architecture `arch` converts: a llama with an expert_count is Mixtral."""
    return MIXTRAL if arch == "llama" and meta(reader, "llama.expert_count", 0) else ARCHITECTURES[arch]


_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_ONE_EXPERT = re.compile(r"ffn_(gate|up|down)\.(\d+)\.weight")  # blk.N's expert e alone (early Mixtral files)


def hf_name(name: str, arch: str, spec: Arch) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts, extra = name.split(".", 2), spec.extra
    if parts[0] == "blk" and len(parts) == 3 and (parts[2] in _LAYER_NAMES or parts[2] in extra):
        return f"model.layers.{parts[1]}.{_LAYER_NAMES.get(parts[2]) or extra[parts[2]]}"
    one = _ONE_EXPERT.fullmatch(parts[-1]) if parts[0] == "blk" and len(parts) == 3 else None
    if one and f"ffn_{one[1]}_exps.weight" in extra:
        return f"model.layers.{parts[1]}.{extra[f'ffn_{one[1]}_exps.weight'].format(e=int(one[2]))}"
    raise FastspecError(f"GGUF tensor '{name}' is not part of a {arch} model")
