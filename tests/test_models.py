"""Target family parity with transformers (the oracle) through the paged pool, plus config parsing."""

import json

import pytest
import torch
from conftest import FAMILIES, PoolRunner, make_hf_model

from fastspec.errors import FastspecError
from fastspec.models.causal_lm import eagle3_capture_layers
from fastspec.models.layers import MLP, fuse_projections
from fastspec.models.loader import load_target, read_config
from fastspec.models.model_config import ModelConfig
from fastspec.models.sources import resolve_sources
from fastspec.models.weights_fit import check_weights_fit

PROMPTS = [[5, 17, 3, 88, 41, 9, 60], [7, 7, 21], [90, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 40]]


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("page_size,fused", [(1, False), (16, False), (16, True)])
def test_prefill_and_decode_match_transformers(tiny_dirs, family, page_size, fused):
    """Batched prefill of mixed lengths, then step-by-step batched decode: every logit row equals HF's (also with
    the QKV and gate_up projections fused, as every engine runs them)."""
    directory, hf = tiny_dirs[family]
    model = load_target(directory, torch.float32)
    if fused:
        fuse_projections(model)
        assert not any(hasattr(m, "q_proj") and hasattr(m, "qkv_proj") for m in model.modules())
        mlps = [m for m in model.modules() if isinstance(m, MLP)]  # all but Mixtral have some (MoE: shared experts)
        assert (mlps or family == "mixtral") and all(
            m.gate_up_proj is not None and not hasattr(m, "gate_proj") and not hasattr(m, "up_proj") for m in mlps)
    runner = PoolRunner(model, page_size=page_size)
    n_decode = 3
    heads = [p[:-n_decode] for p in PROMPTS]
    out = runner.extend([0] * len(PROMPTS), heads)
    logits = model.compute_logits(out.final)
    offsets = torch.cumsum(torch.tensor([0] + [len(h) for h in heads]), 0)
    expected = [hf_logits(hf, p) for p in PROMPTS]
    for b, h in enumerate(heads):
        torch.testing.assert_close(logits[offsets[b]:offsets[b + 1]], expected[b][: len(h)], atol=2e-5, rtol=1e-4)
    for step in range(n_decode):
        lens = [len(h) + step for h in heads]
        out = runner.extend(lens, [[p[n]] for p, n in zip(PROMPTS, lens)])
        step_logits = model.compute_logits(out.final)
        for b, n in enumerate(lens):
            torch.testing.assert_close(step_logits[b], expected[b][n], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_float32(tiny_dirs, dtype):
    directory, hf = tiny_dirs["llama"]
    model = load_target(directory, dtype)
    assert next(model.parameters()).dtype == dtype
    logits = model.compute_logits(PoolRunner(model).extend([0], [PROMPTS[0]]).final)
    expected = hf_logits(hf, PROMPTS[0])
    assert logits.dtype == torch.float32
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() > 0.8
    torch.testing.assert_close(logits, expected, atol=0.15, rtol=0.05)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_aux_capture_equals_hf_hidden_states(tiny_dirs, family):
    """EAGLE-3 aux features = residual stream entering layers [2, L//2, L-3] = HF hidden_states[i]."""
    directory, hf = tiny_dirs[family]
    layers = eagle3_capture_layers(4, None)  # [2, L//2, L-3] for L = 4
    assert layers == (2, 2, 1)
    assert eagle3_capture_layers(4, (0, 3)) == (1, 4)  # draft config ids + 1; 4 = the last layer's output
    model = fuse_projections(load_target(directory, torch.float32, capture_layers=layers))
    out = PoolRunner(model).extend([0], [PROMPTS[2]])
    with torch.no_grad():
        states = hf(torch.tensor([PROMPTS[2]]), output_hidden_states=True).hidden_states
    expected = torch.cat([states[i][0] for i in layers], -1)  # HF hidden_states[i] = input of layer i
    torch.testing.assert_close(out.aux, expected, atol=2e-5, rtol=1e-4)
    logits = model.compute_logits(out.final)
    torch.testing.assert_close(logits, hf_logits(hf, PROMPTS[2]), atol=2e-5, rtol=1e-4)


def test_config_reads_old_and_new_rope_spellings():
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    old = ModelConfig.from_hf(base | {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    new = ModelConfig.from_hf(base | {"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}})
    assert old == new and old.rope_theta == 5e5 and old.rope_scaling.factor == 8.0
    assert old.num_kv_heads == 2 and old.head_dim == 4


def test_bad_configs_give_one_line_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(FastspecError, match="unsupported architecture 'GPT2LMHeadModel'"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(FastspecError, match="cannot read"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 3}))
    with pytest.raises(FastspecError, match="missing or malformed field 'hidden_size'"):
        read_config(tmp_path)
    llama = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
             "num_hidden_layers": 1, "num_attention_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(llama | {"num_attention_heads": None, "bos_token_id": None}))
    with pytest.raises(FastspecError, match=r"malformed field .*\(null fields: num_attention_heads, bos_token_id\)"):
        read_config(tmp_path)


def test_corrupt_safetensors_is_a_clear_error(tmp_path):
    hf = make_hf_model("llama")
    hf.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: 1000])
    with pytest.raises(FastspecError, match="corrupt or truncated"):
        load_target(tmp_path, torch.float32)
    # start-up's weights check reads the headers before any load: the same line (it was a SafetensorError traceback)
    sources = resolve_sources(str(tmp_path), None)
    with pytest.raises(FastspecError, match=r"model\.safetensors: corrupt or truncated weights file \(Error while"):
        check_weights_fit(sources, "float32", "cpu")


def test_sharded_checkpoint_loads(tmp_path, tiny_dirs):
    _, hf = tiny_dirs["qwen2"]
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model = load_target(tmp_path, torch.float32)
    logits = model.compute_logits(PoolRunner(model).extend([0], [PROMPTS[1]]).final)
    torch.testing.assert_close(logits, hf_logits(hf, PROMPTS[1]), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_attention_bias_is_read_as_transformers_reads_it(tmp_path, family):
    """attention_bias: true gives Llama's and Qwen3's q / k / v *and* o projections a bias (transformers' own
    models); Mistral's take none whatever the config says. A bias the config gives its layer none of is one line
    (it was dropped silently: other logits)."""
    from safetensors.torch import load_file, save_file

    hf = make_hf_model(family, attention_bias=True)
    assert (hf.model.layers[0].self_attn.o_proj.bias is not None) == (family != "mistral")
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 1 and p.abs().sum() == 0:  # (zero-initialised biases would hide a dropped one)
                p.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    model = load_target(tmp_path, torch.float32)
    logits = model.compute_logits(PoolRunner(model).extend([0], [PROMPTS[0]]).final)
    torch.testing.assert_close(logits, hf_logits(hf, PROMPTS[0]), atol=2e-5, rtol=1e-4)
    state = load_file(tmp_path / "model.safetensors")
    state["model.layers.1.mlp.down_proj.bias"] = torch.ones(hf.config.hidden_size)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(FastspecError, match="model.layers.1.mlp.down_proj.bias is a bias the config gives its layer "
                                            "none of"):
        load_target(tmp_path, torch.float32)


def test_a_zero_bias_the_config_gives_its_layer_none_of_loads(tmp_path):
    """GPTQ-for-LLaMa (and AutoGPTQ's early exports) saved a zero .bias beside every quantised linear of a Llama:
    the stray-bias refusal refused such a checkpoint dequantised (--quantization none), though a zero bias changes
    nothing (found loading a GPTQ Llama with its zero biases both ways). It loads, packed or dequantised, as the
    checkpoint without them; a non-zero one is still refused."""
    from quant_writers import write_quantised
    from safetensors.torch import load_file, save_file

    oracle = write_quantised(make_hf_model("llama"), tmp_path / "q", "gptq")
    state = load_file(tmp_path / "q" / "model.safetensors")
    for name in [n for n in state if n.endswith(".qweight")]:
        state[name.replace(".qweight", ".bias")] = torch.zeros(state[name].shape[1], dtype=torch.float16)
    save_file(state, tmp_path / "q" / "model.safetensors", metadata={"format": "pt"})
    for quantization in (None, "gptq"):
        model = load_target(tmp_path / "q", torch.float32, quantization=quantization)
        logits = model.compute_logits(PoolRunner(model).extend([0], [PROMPTS[0]]).final)
        torch.testing.assert_close(logits, hf_logits(oracle, PROMPTS[0]), atol=1e-3, rtol=1e-3)
    state["model.layers.0.self_attn.o_proj.bias"][3] = 0.5
    save_file(state, tmp_path / "q" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(FastspecError, match="model.layers.0.self_attn.o_proj.bias is a bias the config gives"):
        load_target(tmp_path / "q", torch.float32)


def test_a_sliding_window_caps_the_context_at_its_width(tmp_path):
    """fastspec attends to the whole context, which is what a sliding window of W keys sees while a context is at
    most W long: a windowed Mistral serves W tokens by default, greedy as transformers' own (window applied) within
    them, and a longer max_context_len is a one-line error before any weight loads. Qwen2's switched-off window
    (use_sliding_window false) caps nothing."""
    import fastspec
    from fastspec.sampling import SamplingParams

    model = make_hf_model("mistral", sliding_window=24)
    model.save_pretrained(tmp_path / "m")
    llm = fastspec.LLM(str(tmp_path / "m"), speculative_algorithm="NONE")
    assert llm.engine.worker.max_context_len == 24
    prompt = PROMPTS[2]  # 18 tokens, 6 more: the whole window
    ids = list(prompt)
    for _ in range(6):
        ids.append(int(hf_logits(model, ids)[-1].argmax()))
    out = llm.generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    assert out.output_ids == ids[len(prompt):]
    with pytest.raises(FastspecError, match="exceeds the context length 24"):
        llm.generate([prompt], SamplingParams(max_new_tokens=7, ignore_eos=True))
    with pytest.raises(FastspecError, match="sliding attention window of 24 tokens"):
        fastspec.LLM(str(tmp_path / "m"), speculative_algorithm="NONE", max_context_len=64)
    qwen = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 512}
    assert ModelConfig.from_hf(qwen | {"sliding_window": 64, "use_sliding_window": False}).context_limit == 512
    assert ModelConfig.from_hf(qwen | {"sliding_window": 64, "use_sliding_window": True}).context_limit == 64
    assert ModelConfig.from_hf(qwen).context_len(512) == 512


def test_a_context_past_the_trained_positions_is_one_line():
    """As SGLang and vLLM: a context length past max_position_embeddings is refused, not served on positions the
    model never saw."""
    qwen = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 512}
    with pytest.raises(FastspecError, match="max_context_len=513 exceeds the model's max_position_embeddings 512"):
        ModelConfig.from_hf(qwen).context_len(513)


def test_a_yarn_rope_serves_its_original_length_times_its_factor():
    """YaRN stretches the rope over original_max_position_embeddings x factor positions (vLLM's derived length):
    Qwen's documented YaRN (factor 4 over 32768, max_position_embeddings left at 40960) serves 131072 tokens, by
    default and when asked; it was refused past 40960 with a message asking for the rope_scaling it had (found
    reading context_len against Qwen3's and DeepSeek-V3's configs). Llama 3's rope_scaling does not lengthen
    max_position_embeddings (already the long one), nor does a YaRN whose product is below it."""
    base = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 40960}
    yarn = ModelConfig.from_hf(base | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 32768}})
    assert yarn.context_limit == 131072 and yarn.context_len(None) == yarn.context_len(131072) == 131072
    with pytest.raises(FastspecError, match="max_context_len=131073 exceeds the 131072 positions the model's YaRN "
                                            r"rope covers \(original_max_position_embeddings 32768 x factor 4\)"):
        yarn.context_len(131073)
    short = ModelConfig.from_hf(base | {"rope_scaling": {"type": "yarn", "factor": 1.0,
                                                          "original_max_position_embeddings": 4096}})
    assert short.context_limit == 40960
    llama3 = ModelConfig.from_hf(base | {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 131072,
                                         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 8192}})
    assert llama3.context_limit == 131072
    with pytest.raises(FastspecError, match="max_context_len=131073 exceeds the model's max_position_embeddings"):
        llama3.context_len(131073)


@pytest.mark.parametrize("top_level", [False, True])
def test_a_yarn_rope_without_its_original_length_takes_transformers_default(tmp_path, top_level):
    """A YaRN rope_scaling without original_max_position_embeddings stretches max_position_embeddings (or a
    top-level original_max_position_embeddings, Phi-3's spelling), as transformers reads it: fastspec took 8192,
    another rope (other logits) and, with the context derived from it, 8192 x factor positions (found checking
    the YaRN context length against transformers' rope parameters)."""
    hf = make_hf_model("qwen3", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(config.get(key), dict):
            config[key].pop("original_max_position_embeddings", None)
    if top_level:  # (transformers prefers it to max_position_embeddings)
        config["original_max_position_embeddings"], config["max_position_embeddings"] = 256, 1024
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_target(tmp_path, torch.float32)
    logits = model.compute_logits(PoolRunner(model).extend([0], [PROMPTS[0]]).final)
    torch.testing.assert_close(logits, hf_logits(hf, PROMPTS[0]), atol=2e-5, rtol=1e-4)
    assert read_config(tmp_path).context_limit == 1024


@pytest.mark.parametrize("head_dim, partial, scaling", [(64, 1.0, None), (80, 1.0, None), (128, 0.5, None),
                                                        (64, 1.0, "yarn")])
def test_rope_table_is_the_computed_cos_sin_bit_for_bit(head_dim, partial, scaling):
    """Eagerly on CPU cos / sin come from a table of every position so far: the same values as computing them for
    the positions asked (any batch, any order, past the table's end, as bfloat16), and computed past its cap."""
    from types import SimpleNamespace

    from fastspec.models import rope as rope_module
    from fastspec.models.model_config import RopeScaling

    yarn = RopeScaling("yarn", 4.0, original_max_position_embeddings=256, mscale=1.0, mscale_all_dim=0.5)
    rope = rope_module.RotaryEmbedding(SimpleNamespace(head_dim=head_dim, partial_rotary_factor=partial,
                                                       rope_theta=1e4, rope_scaling=yarn if scaling else None))
    g = torch.Generator().manual_seed(0)
    for n, top in ((1, 10), (3, 900), (5000, 1000), (2, 3000), (0, 1), (7, 70000)):
        positions = torch.randint(0, top, (n,), generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            for got, want in zip(rope.cos_sin(positions, dtype), rope._computed(positions, dtype)):
                assert got.dtype == dtype and torch.equal(got, want)
    assert rope._table[0].shape[0] == 1 << 17  # 70000 positions: the next power of two
    far = torch.tensor([5, rope_module.TABLE_POSITIONS + 3])
    assert all(torch.equal(a, b) for a, b in zip(rope.cos_sin(far, torch.float32), rope._computed(far, torch.float32)))
