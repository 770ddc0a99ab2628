"""On-disk formats of a train-draft run: the exported head (SGLang / SpecForge EAGLE-3 config.json +
model.safetensors) and the resumable checkpoint, both written atomically. Also builds a fresh head.
Knows nothing about data or the training loop.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save

from fastspec.errors import FastspecError, first_line
from fastspec.models.causal_lm import eagle3_capture_layers
from fastspec.models.eagle import LlamaForCausalLMEagle3
from fastspec.models.model_config import ModelConfig
from fastspec.utils.files import read_or_refuse, write_atomic


def head_config(target_json: dict, draft_vocab_size: int, num_layers: int) -> dict:
    """SGLang / SpecForge EAGLE-3 config.json: one Llama layer as wide as the target, own draft lm_head."""
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "vocab_size",
            "hidden_act", "bos_token_id", "eos_token_id", "pad_token_id")  # rope_parameters: transformers >= 5
    config = {k: target_json[k] for k in keep if k in target_json}
    aux_ids = [i - 1 for i in eagle3_capture_layers(num_layers, None)]
    return config | {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
                     "tie_word_embeddings": False, "draft_vocab_size": draft_vocab_size,
                     "target_hidden_size": target_json["hidden_size"], "torch_dtype": "bfloat16",
                     "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": True}}


def init_head(config: ModelConfig, target, vocab: torch.Tensor, seed: int) -> LlamaForCausalLMEagle3:
    """Random layer (std 0.02, unit norms); lm_head = the target's output rows of the draft vocabulary,
    final norm = the target's; the embedding is the target's, shared and frozen."""
    torch.manual_seed(seed)
    head = LlamaForCausalLMEagle3(config, target.model.embed_tokens)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.startswith("embed_tokens."):
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
        head.lm_head.weight.copy_(target.lm_head.weight[vocab])
        head.norm.weight.copy_(target.model.norm.weight)
        head.d2t.copy_(vocab - torch.arange(len(vocab)))
    head.embed_tokens.requires_grad_(False)
    return head


def check_warm_start(config: ModelConfig) -> None:
    """--init target copies a Llama-family decoder layer with a dense MLP (warm_start): one line, before any
    answer is generated, for a target whose last capture layer is not one (MLA, a recurrent mixer, a MoE MLP)."""
    layer = eagle3_capture_layers(config.num_layers, None)[-1]
    moe = config.moe is not None and config.moe.is_moe_layer(layer)
    if config.mla is not None or config.hybrid is not None or moe:
        raise FastspecError(f"--init target copies target layer {layer} into the head, which needs a Llama-family "
                            f"layer with a dense MLP; {config.architecture}'s is not (use --init random)")


def warm_start(head: LlamaForCausalLMEagle3, target, capture_layers: tuple[int, ...]) -> None:
    """Start the head from what the target can give: fc passes the last captured feature through (the input of
    target layer L = capture_layers[-1]), and the midlayer is layer L, its hidden half (hidden_norm, the q/k/v
    columns that read the hidden state, o_proj, MLP, post-attention norm) copied; the columns that read the
    token embedding keep their random init. Needs the head as wide as the target (head_config makes it so)."""
    layer, m = target.model.layers[capture_layers[-1]], head.midlayer
    H = head.config.hidden_size
    if head.config.target_hidden_size != H or m.mlp.gate_proj.weight.shape != layer.mlp.gate_proj.weight.shape:
        raise FastspecError("--init target needs a head as wide as the target, with the same MLP")
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * H:].copy_(torch.eye(H))
        if head.fc.bias is not None:
            head.fc.bias.zero_()
        for name in ("q_proj", "k_proj", "v_proj"):
            ours, theirs = getattr(m.self_attn, name), getattr(layer.self_attn, name)
            ours.weight[:, H:].copy_(theirs.weight)
            if ours.bias is not None and theirs.bias is not None:
                ours.bias.copy_(theirs.bias)
        m.self_attn.o_proj.weight.copy_(layer.self_attn.o_proj.weight)
        m.hidden_norm.weight.copy_(layer.input_layernorm.weight)
        m.post_attention_layernorm.weight.copy_(layer.post_attention_layernorm.weight)
        m.mlp.load_state_dict(layer.mlp.state_dict())


def save_checkpoint(path: Path, head, opt, step: int) -> None:
    state = {k: v for k, v in head.state_dict().items() if not k.startswith("embed_tokens.")}
    atomic_save({"step": step, "head": state, "optimizer": opt.state_dict()}, path)


def load_checkpoint(path: Path, head, opt) -> int:
    """The step to continue from (0 without a checkpoint)."""
    if not path.exists():
        return 0
    saved = load_artifact(path, lambda p: torch.load(p, weights_only=True, map_location="cpu"))
    try:
        head.load_state_dict(saved["head"], strict=False)
        opt.load_state_dict(saved["optimizer"])
        step = int(saved["step"])
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
        raise FastspecError(f"{path} does not fit this run (another target or draft vocabulary?) "
                            f"({first_line(e)}); use --overwrite to start over") from None
    return step


def export_head(head, head_json: dict, vocab: torch.Tensor, out: Path) -> None:
    """config.json + model.safetensors (bf16 weights, int64 d2t, bool t2d), written atomically."""
    skip = ("embed_tokens.", "rope.")
    state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous().cpu()
             for k, v in head.state_dict().items() if not k.startswith(skip)}
    state["t2d"] = torch.zeros(head_json["vocab_size"], dtype=torch.bool).index_fill_(0, vocab.cpu(), True)
    write_atomic(out / "model.safetensors", lambda f: f.write(save(state)))
    write_atomic(out / "config.json", lambda f: f.write((json.dumps(head_json, indent=2) + "\n").encode()))


def load_artifact(path: Path, read):
    """read(path), or a one-line FastspecError naming the file when it is truncated, corrupt or not ours."""
    return read_or_refuse(path, read, "use --overwrite to start over")


def atomic_save(obj, path: Path) -> None:
    write_atomic(path, lambda f: torch.save(obj, f))


def atomic_json(obj, path: Path) -> None:
    """A run's small records (target, plan, report): a process killed while writing one leaves the old one whole."""
    text = json.dumps(obj, indent=1) + "\n"
    write_atomic(path, lambda f: f.write(text.encode()))
