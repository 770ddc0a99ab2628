"""Tiny random models in the Hugging Face format, for tests and for `hostile_cache.py`: no fixtures, no side
effects, so a script can build the same models the tests use."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
            eos_token_id=2)

DEEPSEEK = dict(num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
                moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
                topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, tie_word_embeddings=False)

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=False, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False, head_dim=24)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=None)),
    # q / k norm and softmax-routed experts without renormalisation (transformers' default) in layers 0, 2, 3; layer
    # 1 dense (mlp_only_layers)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=24, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[1], tie_word_embeddings=False)),
    # Mistral attention, top-2 of 4 experts renormalised, in every layer
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=None,
        tie_word_embeddings=False)),
    # MLA (q LoRA, interleaved rope, YaRN with both mscales) and sigmoid-routed MoE with the correction bias
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        DEEPSEEK, q_lora_rank=48, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8})),
    # MLA without q LoRA, softmax-routed group-limited greedy MoE, plain rope
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        DEEPSEEK, q_lora_rank=None, topk_method="group_limited_greedy")),
    # gated delta net layers 0-2, gated attention layer 3 (partial rope), MoE with a gated shared expert
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=2,
        linear_num_value_heads=4, moe_intermediate_size=24, shared_expert_intermediate_size=32, num_experts_per_tok=2,
        num_experts=6, tie_word_embeddings=False)),
    # Mamba2 mixers (2 groups of 4 heads, conv bias) in layers 0, 1, 3; GQA attention with half-rotated heads in 2
    "bamba": ("BambaConfig", "BambaForCausalLM", dict(
        attn_layer_indices=[2], mamba_n_heads=8, mamba_d_head="auto", mamba_n_groups=2, mamba_d_state=16,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, tie_word_embeddings=False)),
}


def make_hf_model(family: str, seed: int = 0, **overrides):
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**(TINY | extra | overrides))
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # HF init is tiny (std 0.02); widen it so logits are far from uniform
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # the routing bias matters: make it non-zero
                b.copy_(torch.randn_like(b) * 0.1)
        if family.startswith("deepseek"):  # their logits come out flat (near-ties make greedy fragile): sharpen
            model.lm_head.weight.mul_(4)
    return model


def write_deepseek(directory: Path, family: str = "deepseek_v3", mtp: int = 1, seed: int = 0, **overrides):
    """A tiny DeepSeek target saved in `directory`, with `mtp` random MTP layers stored under DeepSeek's key
    names after the last decoder layer (each with its own embedding and shared head). Returns the HF model."""
    from safetensors.torch import load_file, save_file

    model = make_hf_model(family, seed=seed, **overrides)
    model.save_pretrained(directory)
    if not mtp:
        return model
    state = load_file(directory / "model.safetensors")
    L, H = model.config.num_hidden_layers, model.config.hidden_size
    gen = torch.Generator().manual_seed(seed + 1)
    rand = lambda *shape, scale=0.1: scale * torch.randn(*shape, generator=gen)  # noqa: E731
    last = f"model.layers.{L - 1}."
    for i in range(mtp):
        prefix = f"model.layers.{L + i}."
        for name, tensor in list(state.items()):  # the decoder layer: the last one's weights, perturbed
            if name.startswith(last):
                state[prefix + name[len(last):]] = tensor + rand(*tensor.shape, scale=0.02)
        state |= {prefix + "enorm.weight": 1 + rand(H), prefix + "hnorm.weight": 1 + rand(H),
                  prefix + "eh_proj.weight": rand(H, 2 * H), prefix + "shared_head.norm.weight": 1 + rand(H),
                  prefix + "embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
                  prefix + "shared_head.head.weight": state["lm_head.weight"].clone()}
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": mtp}))
    return model


WORDS = [f"w{i}" for i in range(3, 90)]


def write_chat_target(directory: Path, seed: int = 0, family: str = "llama") -> Path:
    """A tiny target (llama, or a DeepSeek family with its MTP layer) with a word-level tokenizer (ids 0..89) and
    a chat template, saved in `directory`."""
    if family.startswith("deepseek"):
        write_deepseek(directory, family, seed=seed)
    else:
        make_hf_model(family, seed=seed).save_pretrained(directory)
    return write_word_tokenizer(directory)


def write_word_tokenizer(directory: Path, template: str = "{% for m in messages %}<user> {{ m.content }} "
                                                          "{% endfor %}<bot>", words: list[str] = WORDS) -> Path:
    """A word-level tokenizer (<unk> <s> </s>, then `words` from id 3, then <user> <bot>; split at whitespace) with
    the chat `template`, saved in `directory`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {w: i for i, w in enumerate(words, start=3)}
    vocab |= {"<user>": len(vocab), "<bot>": len(vocab) + 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "</s>"}))
    return directory


def write_prompt_file(path: Path) -> Path:
    """Twelve JSONL prompts of tiny-target words."""
    gen = torch.Generator().manual_seed(0)
    lines = [json.dumps({"prompt": " ".join(WORDS[j] for j in torch.randint(0, len(WORDS), (n,), generator=gen))})
             for n in (3, 5, 8, 4, 6, 7, 3, 9, 5, 4, 6, 8)]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_qwen3_next_mtp(directory: Path, seed: int = 0):
    """A tiny Qwen3-Next target saved in `directory` with a random MTP layer under `mtp.` (its decoder layer: the
    full-attention layer's weights, perturbed). Returns the HF model."""
    from safetensors.torch import load_file, save_file

    model = make_hf_model("qwen3_next", seed=seed)
    model.save_pretrained(directory)
    state = load_file(directory / "model.safetensors")
    H = model.config.hidden_size
    gen = torch.Generator().manual_seed(seed + 1)
    rand = lambda *shape, scale=0.1: scale * torch.randn(*shape, generator=gen)  # noqa: E731
    attention = f"model.layers.{model.config.layer_types.index('full_attention')}."
    for name, tensor in list(state.items()):
        if name.startswith(attention):
            state["mtp.layers.0." + name[len(attention):]] = tensor + rand(*tensor.shape, scale=0.02)
    state |= {"mtp.fc.weight": rand(H, 2 * H), "mtp.pre_fc_norm_embedding.weight": rand(H),
              "mtp.pre_fc_norm_hidden.weight": rand(H), "mtp.norm.weight": rand(H)}
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    return model


def write_char_tokenizer(directory: Path) -> Path:
    """A byte-level tokenizer for the tiny vocabulary (97): <unk> <s> </s>, then one token per printable ASCII
    character '!'..'~' (ids 3..96; no space), so grammars over text have a real tokenizer to mask. Returns
    `directory`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {chr(c): c - 30 for c in range(33, 127)}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    return directory
