"""The draft heads users download, in the formats their authors publish, each against a hand-built twin in the
SGLang / SpecForge format with the same weights: the same draft tokens, the same accepted lengths, the same output.
Bad heads are one line each, before any weight is read."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import fastspec
from fastspec.errors import FastspecError
from fastspec.models.heads import write_random_head
from fastspec.sampling import SamplingParams

PROMPTS = [[5, 9, 13, 3, 40], [7, 7, 8, 60, 61, 62, 7, 7]]
PARAMS = SamplingParams(max_new_tokens=24, ignore_eos=True)


def drafted(target, head, algorithm, **options):
    """(output ids, accepted tokens, verify rounds) per prompt, every round speculating."""
    llm = fastspec.LLM(str(target), speculative_algorithm=algorithm, draft_model=str(head), max_total_tokens=1024,
                       tuned=False, **options)
    llm.engine.policy = None
    outs = llm.generate(PROMPTS, PARAMS)
    return [(o.output_ids, o.metrics.accepted_tokens, o.metrics.verify_rounds) for o in outs]


def rewrite(head, out, config_changes=None, drop=(), rename=None):
    """A copy of `head` with its config changed, tensors dropped and keys renamed."""
    out.mkdir(parents=True)
    state = load_file(head / "model.safetensors")
    state = {(rename(k) if rename else k): v for k, v in state.items() if k not in drop}
    save_file(state, out / "model.safetensors")
    config = json.loads((head / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **(config_changes or {})}))
    return out


@pytest.fixture
def eagle_twins(tiny_dirs, tmp_path):
    """An EAGLE-2 head in SGLang's format with a zero fc bias, and the same weights as an EAGLE-1 repo publishes
    them: `LlamaForCausalLM`, `"bias": false`, no fc.bias."""
    h = tiny_dirs["llama"][1].config.hidden_size
    head = write_random_head(tmp_path / "sglang", h, 97, "eagle")
    state = load_file(head / "model.safetensors")
    state["fc.bias"] = torch.zeros_like(state["fc.bias"])
    save_file(state, head / "model.safetensors")
    eagle1 = rewrite(head, tmp_path / "eagle1", {"architectures": ["LlamaForCausalLM"], "bias": False},
                     drop=("fc.bias",))
    return head, eagle1


def test_an_eagle1_head_labelled_llama_drafts_as_its_sglang_twin(tiny_dirs, eagle_twins):
    target = tiny_dirs["llama"][0]
    sglang, eagle1 = eagle_twins
    expected = drafted(target, sglang, "EAGLE")
    assert drafted(target, eagle1, "EAGLE") == expected
    assert all(rounds > 0 for _, _, rounds in expected)
    assert torch.equal(head_logits(target, eagle1, "EAGLE"), head_logits(target, sglang, "EAGLE"))


def test_an_eagle3_head_labelled_llama_is_read_as_one(tiny_dirs, draft_dirs, tmp_path):
    target = tiny_dirs["llama"][0]
    head = draft_dirs["llama"]["eagle3"]
    relabelled = rewrite(head, tmp_path / "eagle3", {"architectures": ["LlamaForCausalLM"]})
    assert drafted(target, relabelled, "EAGLE3") == drafted(target, head, "EAGLE3")
    assert torch.equal(head_logits(target, relabelled), head_logits(target, head))


def test_a_head_whose_config_promises_an_fc_bias_it_lacks_is_one_line(tiny_dirs, eagle_twins, tmp_path):
    broken = rewrite(eagle_twins[0], tmp_path / "broken", drop=("fc.bias",))
    with pytest.raises(FastspecError, match="missing weight fc.bias"):
        drafted(tiny_dirs["llama"][0], broken, "EAGLE")


def test_a_full_model_as_an_eagle_head_says_what_to_pass_where_it_would_work(tiny_dirs, draft_dirs, tmp_path):
    """The same vocabulary: STANDALONE is suggested (and works); another vocabulary: no advice that would fail."""
    target = tiny_dirs["llama"][0]
    full = draft_dirs["llama"]["standalone"]
    with pytest.raises(FastspecError, match="is not an EAGLE draft head .*--speculative-algorithm STANDALONE"):
        drafted(target, full, "EAGLE")
    assert drafted(target, full, "STANDALONE")[0][0]
    other = tmp_path / "other-vocab"
    shutil.copytree(full, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"vocab_size": 120}))
    with pytest.raises(FastspecError) as e:
        drafted(target, other, "EAGLE")
    assert "STANDALONE" not in str(e.value)


def as_speculators(head, out, architecture="Eagle3DraftModel", **extra):
    """An SGLang-format EAGLE-3 head as vLLM's speculators library saves it: the geometry under
    transformer_layer_config, the aux ids in vLLM's convention (the layer whose input is captured: SGLang's + 1),
    the midlayer as layers.0, d2t / t2d kept, no embed_tokens."""
    config = json.loads((head / "config.json").read_text())
    layer = {k: v for k, v in config.items() if k not in ("architectures", "draft_vocab_size", "target_hidden_size",
                                                          "eagle_config")}
    ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    spec = {"architectures": [architecture], "speculators_model_type": "eagle3",
            "transformer_layer_config": layer | {"model_type": "llama"}, "draft_vocab_size": config["draft_vocab_size"],
            "target_hidden_size": None, "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids":
            [i + 1 for i in ids], "speculators_config": {"algorithm": "eagle3", "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": 3}], "verifier": {"name_or_path": "tiny"}}}
    out.mkdir(parents=True)
    state = {k.replace("midlayer.", "layers.0."): v for k, v in load_file(head / "model.safetensors").items()}
    save_file(state, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(spec | extra))
    return out


def head_logits(target_dir, head_dir, algorithm="EAGLE3") -> torch.Tensor:
    """The head's draft logits [T, Vd] over fixed tokens and target features (one causal forward, no KV pool)."""
    from fastspec.models.draft_loader import load_draft, read_draft_config
    from fastspec.models.loader import load_target
    from fastspec.train.data import PackedCausalAttention

    target = load_target(target_dir, torch.float32)
    config = read_draft_config(head_dir, algorithm)
    head = load_draft(head_dir, target, torch.float32, config=config)
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(3, 97, (12,), generator=gen)
    width = 3 * config.target_hidden_size if config.is_eagle3 else config.hidden_size
    features = torch.randn(12, width, generator=gen)
    with torch.inference_mode():
        out = head(ids, torch.arange(12), features, PackedCausalAttention(torch.zeros(12, dtype=torch.long)))
        return head.compute_logits(out.normed)


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_a_speculators_head_drafts_as_its_sglang_twin(tiny_dirs, draft_dirs, tmp_path, norm_before_residual):
    """Same weights, two formats: the same draft logits and the same engine runs; norm_before_residual read from
    either (and it matters: the logits move with it)."""
    target = tiny_dirs["llama"][0]
    sglang = rewrite(draft_dirs["llama"]["eagle3"], tmp_path / "sglang", {"norm_before_residual": norm_before_residual})
    speculators = as_speculators(draft_dirs["llama"]["eagle3"], tmp_path / "speculators",
                                 norm_before_residual=norm_before_residual)
    expected = head_logits(target, sglang)
    assert torch.equal(head_logits(target, speculators), expected)
    assert drafted(target, speculators, "EAGLE3") == drafted(target, sglang, "EAGLE3")
    moved = not torch.allclose(head_logits(target, draft_dirs["llama"]["eagle3"]), expected)
    assert moved == norm_before_residual


def test_norm_before_residual_adds_the_attention_to_the_normed_hidden_state(tiny_dirs, draft_dirs):
    """The midlayer's end, by hand: r = hidden_norm(h) + o_proj(o); r + mlp(post_norm(r))."""
    import torch.nn.functional as F

    from fastspec.models.eagle import Eagle3Layer
    from fastspec.models.loader import read_config

    config = read_config(draft_dirs["llama"]["eagle3"]).replace(norm_before_residual=True)
    layer = Eagle3Layer(config)
    for p in layer.parameters():
        torch.nn.init.normal_(p, 1.0, 0.3)
    h, o = torch.randn(3, config.hidden_size), torch.randn(3, config.num_heads * config.head_dim)

    def rms(x, w, eps=config.rms_norm_eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    r = rms(h, layer.hidden_norm.weight) + o @ layer.self_attn.o_proj.weight.t()
    x = rms(r, layer.post_attention_layernorm.weight)
    mlp = layer.mlp
    want = r + (F.silu(x @ mlp.gate_proj.weight.t()) * (x @ mlp.up_proj.weight.t())) @ mlp.down_proj.weight.t()
    torch.testing.assert_close(layer._finish(h, o), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("change, message", [
    (lambda c: c.pop("transformer_layer_config"), "speculators config without its transformer_layer_config"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 9, 40]), r"aux hidden state layers .* do not exist"),
    (lambda c: c["transformer_layer_config"].update(model_type="qwen3"), "with qwen3 layers is not supported"),
])
def test_bad_speculators_heads_are_one_line(tiny_dirs, draft_dirs, tmp_path, change, message):
    head = as_speculators(draft_dirs["llama"]["eagle3"], tmp_path / "h")
    config = json.loads((head / "config.json").read_text())
    change(config)
    (head / "config.json").write_text(json.dumps(config))
    with pytest.raises(FastspecError, match=message):
        drafted(tiny_dirs["llama"][0], head, "EAGLE3")


def test_a_d2t_of_the_wrong_length_is_one_line(tiny_dirs, draft_dirs, tmp_path):
    head = rewrite(draft_dirs["llama"]["eagle3"], tmp_path / "h")
    state = load_file(head / "model.safetensors")
    state["d2t"] = state["d2t"][:-3]
    save_file(state, head / "model.safetensors")
    with pytest.raises(FastspecError, match=r"weight d2t has shape \(45,\), expected \(48,\)"):
        drafted(tiny_dirs["llama"][0], head, "EAGLE3")


def test_a_pickled_object_as_bin_weights_is_refused(tiny_dirs, draft_dirs, tmp_path):
    """torch.load with weights_only refuses arbitrary objects: one line naming the file."""
    head = rewrite(draft_dirs["llama"]["eagle3"], tmp_path / "h")
    (head / "model.safetensors").unlink()
    torch.save({"fc.weight": FastspecError("not a tensor")}, head / "pytorch_model.bin")
    with pytest.raises(FastspecError, match=r"pytorch_model\.bin: corrupt or truncated weights file"):
        drafted(tiny_dirs["llama"][0], head, "EAGLE3")
    torch.save({"fc.weight": [1.0, 2.0]}, head / "pytorch_model.bin")  # allowed by weights_only, still no tensor
    with pytest.raises(FastspecError, match=r"pytorch_model\.bin: not a state dict of tensors \(fc\.weight\)"):
        drafted(tiny_dirs["llama"][0], head, "EAGLE3")


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "mistral"])
def test_eagle3_heads_with_the_targets_head_dim_and_rope_are_lossless(tiny_dirs, tmp_path, family):
    """Published Qwen / Mistral EAGLE-3 heads are Llama layers with the target's head_dim and rope_theta: EAGLE-3
    with such a head gives plain decoding's tokens."""
    hf = tiny_dirs[family][1].config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    head = write_random_head(tmp_path / "h", hf.hidden_size, hf.vocab_size, "eagle3", head_dim=head_dim)
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps(config | {"rope_theta": 1000000.0}))
    target = tiny_dirs[family][0]
    plain = fastspec.LLM(str(target), speculative_algorithm="NONE", max_total_tokens=1024)
    expected = [o.output_ids for o in plain.generate(PROMPTS, PARAMS)]
    assert [out for out, _, _ in drafted(target, head, "EAGLE3")] == expected
