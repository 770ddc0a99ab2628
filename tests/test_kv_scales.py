"""A checkpoint's fp8 KV cache scales (fastspec.models.kv_scales) and ModelOpt's FP8 checkpoints: the scales read
under each tool's names into the target's fp8 pool (and only there), what they do to a model's logits against the
exact float32 cache, speculation over such a pool lossless, and every bad input one line."""

import json
import shutil

import pytest
import torch
from conftest import PoolRunner
from quant_writers import add_kv_scales, write_quantised

import fastspec
from fastspec.errors import FastspecError
from fastspec.models.kv_scales import read_kv_scales
from fastspec.models.loader import load_target, read_config
from fastspec.models.quant_config import read_scheme
from fastspec.sampling import SamplingParams

PROMPTS = [[5, 9, 13, 3, 40], [7, 7, 8, 60, 61, 62, 7, 7]]
SCALES = [(0.02, 0.5), (0.25, 0.003), (3.0, 0.125), (1.0, 40.0)]  # (k_scale, v_scale) of the tiny Llama's 4 layers


def copy_of(directory, tmp_path, name="m"):
    shutil.copytree(directory, tmp_path / name)
    return tmp_path / name


def as_stored(scales):
    """The floats a checkpoint's float32 scales read back as."""
    return tuple((float(torch.tensor(k)), float(torch.tensor(v))) for k, v in scales)


@pytest.fixture(scope="module")
def modelopt_dir(tiny_dirs, tmp_path_factory):
    """The tiny Llama as ModelOpt writes FP8 with an fp8 KV cache: e4m3 weights with 0-d weight / input scales,
    `k_proj.k_scale` / `v_proj.v_scale`, its settings in hf_quant_config.json."""
    d = tmp_path_factory.mktemp("modelopt-kv")
    write_quantised(tiny_dirs["llama"][1], d, "modelopt")
    config = json.loads((d / "hf_quant_config.json").read_text())
    config["quantization"]["kv_cache_quant_algo"] = "FP8"
    (d / "hf_quant_config.json").write_text(json.dumps(config))
    add_kv_scales(d, SCALES, "modelopt")
    return d


def test_modelopt_settings_are_read_from_config_json_or_their_own_file(modelopt_dir):
    scheme = read_scheme({}, modelopt_dir)
    assert (scheme.method, scheme.kind, scheme.fp8_activations) == ("modelopt", "fp8", True)
    inline = {"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}}
    assert read_scheme(inline).label == "modelopt fp8"
    kv_only = {"quantization_config": {"quant_method": "modelopt", "quant_algo": None, "kv_cache_quant_algo": "FP8"}}
    assert read_scheme(kv_only) is None  # float weights, an fp8 KV cache calibrated
    with pytest.raises(FastspecError, match="ModelOpt quant_algo 'NVFP4' is not supported; supported: .*ModelOpt FP8"):
        read_scheme({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}})


@pytest.mark.commands
def test_an_unsupported_modelopt_export_is_one_line_before_loading(tiny_dirs, tmp_path):
    from typer.testing import CliRunner

    from fastspec.cli.main import app

    d = copy_of(tiny_dirs["llama"][0], tmp_path)
    (d / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"},
                                                         "quantization": {"quant_algo": "NVFP4"}}))
    with pytest.raises(FastspecError, match=r"hf_quant_config\.json: ModelOpt quant_algo 'NVFP4' is not supported"):
        fastspec.LLM(str(d), max_total_tokens=512)
    result = CliRunner().invoke(app, ["generate", "--model", str(d), "--prompt", "hi"])
    assert result.exit_code == 2 and "NVFP4" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("style", ["modelopt", "compressed-tensors"])
def test_kv_scales_are_read_under_each_tools_names(tiny_dirs, tmp_path, style):
    d = copy_of(tiny_dirs["llama"][0], tmp_path)
    assert read_kv_scales(d, read_config(d)) is None
    add_kv_scales(d, SCALES, style)
    assert read_kv_scales(d, read_config(d)) == as_stored(SCALES)


def test_a_hybrid_models_scales_are_its_attention_layers_in_pool_order(tiny_dirs, tmp_path):
    """Qwen3-Next's tiny model: layers 0-2 are gated delta nets (no KV cache), layer 3 full attention, the KV pool's
    layer 0: its scales are that pool layer's, a decode runs over them, and a scale on a linear-attention layer is
    one line."""
    d = copy_of(tiny_dirs["qwen3_next"][0], tmp_path)
    config = read_config(d)
    assert config.hybrid.linear_layers == (0, 1, 2)
    from safetensors.torch import load_file, save_file

    state = load_file(d / "model.safetensors")
    state |= {"model.layers.3.self_attn.k_scale": torch.tensor(0.5),
              "model.layers.3.self_attn.v_scale": torch.tensor(4.0)}
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})
    assert read_kv_scales(d, config) == ((0.5, 4.0),)
    llm = fastspec.LLM(str(d), kv_cache_dtype="fp8_e4m3", max_total_tokens=512)
    assert llm.engine.worker.pool.scales == ((0.5, 4.0),)
    llm.generate(PROMPTS, SamplingParams(max_new_tokens=4, ignore_eos=True))
    state["model.layers.1.self_attn.k_scale"] = torch.tensor(0.5)
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(FastspecError, match=r"model\.layers\.1\.self_attn\.k_scale: layer 1 is a linear-attention "
                                            r"layer, with no KV cache"):
        read_kv_scales(d, config)


def test_the_scales_go_to_the_targets_fp8_pool_only(modelopt_dir, draft_dirs):
    expected = as_stored(SCALES)
    fp8 = fastspec.LLM(str(modelopt_dir), kv_cache_dtype="fp8_e4m3", speculative_algorithm="EAGLE3",
                       draft_model=str(draft_dirs["llama"]["eagle3"]), max_total_tokens=512)
    worker = fp8.engine.worker
    assert worker.config.quantization == "modelopt"
    assert worker.pool.scales == expected and worker.draft_pool.scales is None  # the head has none of its own
    for kv in ("auto", "bfloat16"):  # scales belong to an fp8 cache: another is stored as computed
        llm = fastspec.LLM(str(modelopt_dir), kv_cache_dtype=kv, max_total_tokens=512)
        assert llm.engine.worker.pool.scales is None


def relative_error(logits: torch.Tensor, reference: torch.Tensor) -> float:
    return float((logits - reference).norm() / reference.norm())


def test_scales_keep_large_values_that_scale_1_saturates(tiny_dirs, tmp_path):
    """V ~ 1000 in every layer (v_proj's rows scaled up): a scale-1 e4m3 cache saturates it at 448 and the logits
    move far from the float32 cache's; divided by the checkpoint's v_scale first they stay within fp8 rounding.
    Both through the fused C stack of a packed model and through the float layers' torch attention."""
    from safetensors.torch import load_file, save_file

    d = copy_of(tiny_dirs["llama"][0], tmp_path)
    state = load_file(d / "model.safetensors")
    layers = read_config(d).num_layers
    for i in range(layers):
        state[f"model.layers.{i}.self_attn.v_proj.weight"] *= 3000
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})
    add_kv_scales(d, [(1.0, 8.0)] * layers, "compressed-tensors")
    scales = read_kv_scales(d, read_config(d))
    ids = [PROMPTS[1]]
    for quantization in (None, "int4"):
        llm = fastspec.LLM(str(d), quantization=quantization, max_total_tokens=512)
        model = llm.engine.worker.model

        def logits(kv_dtype, kv_scales=None):
            with torch.inference_mode():
                out = PoolRunner(model, kv_dtype=kv_dtype, kv_scales=kv_scales).extend([0], ids)
                return model.compute_logits(out.final).float()

        reference = logits(torch.float32)
        assert logits(torch.float8_e4m3fn).sub(reference).abs().max() > 0  # (the cache is used)
        scaled, saturated = (relative_error(logits(torch.float8_e4m3fn, s), reference) for s in (scales, None))
        assert scaled < 0.1 < saturated, (quantization, scaled, saturated)


@pytest.mark.parametrize("algorithm", ["EAGLE3", "NGRAM"])
def test_speculation_over_a_scaled_fp8_cache_is_lossless(modelopt_dir, draft_dirs, algorithm):
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    common = dict(kv_cache_dtype="fp8_e4m3", max_total_tokens=1024)
    plain = fastspec.LLM(str(modelopt_dir), speculative_algorithm="NONE", **common)
    expected = [o.output_ids for o in plain.generate(PROMPTS, params)]
    draft = str(draft_dirs["llama"]["eagle3"]) if algorithm == "EAGLE3" else None
    llm = fastspec.LLM(str(modelopt_dir), speculative_algorithm=algorithm, draft_model=draft, tuned=False, **common)
    llm.engine.policy = None  # every round speculates
    outputs = llm.generate(PROMPTS, params)
    assert [o.output_ids for o in outputs] == expected and all(o.metrics.verify_rounds > 0 for o in outputs)
    assert llm.engine.worker.pool.scales is not None


@pytest.mark.parametrize("damage, message", [
    (lambda s: s.pop("model.layers.1.self_attn.v_proj.v_scale"), r"model\.layers\.1\.self_attn's v_scale is missing"),
    (lambda s: s.update({"model.layers.0.self_attn.k_proj.k_scale": torch.tensor([0.1, 0.2])}),
     r"k_proj\.k_scale has shape \(2,\): a KV scale is one number"),
    (lambda s: s.update({"model.layers.0.self_attn.k_proj.k_scale": torch.tensor(0.0)}),
     r"k_proj\.k_scale is 0\.0: a KV scale is a positive finite number"),
])
def test_bad_kv_scales_are_one_line_where_the_cache_is_fp8(modelopt_dir, tmp_path, damage, message):
    from safetensors.torch import load_file, save_file

    d = copy_of(modelopt_dir, tmp_path)
    state = load_file(d / "model.safetensors")
    damage(state)
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(FastspecError, match=message):
        fastspec.LLM(str(d), kv_cache_dtype="fp8_e4m3", max_total_tokens=512)
    fastspec.LLM(str(d), max_total_tokens=512)  # not read for a cache they do not apply to


def test_fp8_weights_in_a_checkpoint_that_declares_none_are_one_line(modelopt_dir, tmp_path):
    """A ModelOpt export without its hf_quant_config.json: its e4m3 weights would load without their scales."""
    d = copy_of(modelopt_dir, tmp_path)
    (d / "hf_quant_config.json").unlink()
    with pytest.raises(FastspecError, match=r"weight model\.layers\.0\.self_attn\.q_proj\.weight is stored in "
                                            r"float8_e4m3fn but the checkpoint declares no quantisation"):
        load_target(d, torch.float32)

