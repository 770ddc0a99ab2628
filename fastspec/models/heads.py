"""Random (untrained) EAGLE-2 / EAGLE-3 heads written in the SGLang / SpecForge checkpoint format.

Used by the tests and benchmarks until a trained head exists: a random head keeps decoding lossless (verify
decides every token) and exercises the whole draft path, it just accepts little.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_random_head(directory: Path, hidden_size: int, vocab_size: int, kind: str, seed: int = 0,
                      draft_vocab: int = 48, max_positions: int = 8192, heads: int = 4, kv_heads: int = 2,
                      head_dim: int = 16, inter: int = 96) -> Path:
    """A random EAGLE-2 (`eagle`) or EAGLE-3 (`eagle3`) head for a target of this width / vocabulary."""
    H, V = hidden_size, vocab_size
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 0.1  # noqa: E731
    attn_in = 2 * H if kind == "eagle3" else H
    prefix = "midlayer." if kind == "eagle3" else "layers.0."
    w = {f"{prefix}self_attn.q_proj.weight": rand(heads * head_dim, attn_in),
         f"{prefix}self_attn.k_proj.weight": rand(kv_heads * head_dim, attn_in),
         f"{prefix}self_attn.v_proj.weight": rand(kv_heads * head_dim, attn_in),
         f"{prefix}self_attn.o_proj.weight": rand(H, heads * head_dim),
         f"{prefix}mlp.gate_proj.weight": rand(inter, H), f"{prefix}mlp.up_proj.weight": rand(inter, H),
         f"{prefix}mlp.down_proj.weight": rand(H, inter),
         f"{prefix}post_attention_layernorm.weight": 1 + rand(H)}
    config = {"hidden_size": H, "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": V, "rms_norm_eps": 1e-6,
              "max_position_embeddings": max_positions, "tie_word_embeddings": False}
    if kind == "eagle3":
        hot = torch.sort(torch.randperm(V, generator=gen)[:draft_vocab]).values
        w |= {"fc.weight": rand(H, 3 * H), "midlayer.input_layernorm.weight": 1 + rand(H),
              "midlayer.hidden_norm.weight": 1 + rand(H), "norm.weight": 1 + rand(H),
              "lm_head.weight": rand(draft_vocab, H) * 10, "d2t": hot - torch.arange(draft_vocab),
              "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, hot, True)}
        config |= {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab,
                   "target_hidden_size": H, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}
    else:
        w |= {"fc.weight": rand(H, 2 * H), "fc.bias": rand(H)}
        config |= {"architectures": ["LlamaForCausalLMEagle"]}
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    return directory
