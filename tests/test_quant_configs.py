"""The quantisation a checkpoint declares, and every bad input one line: configs fastspec does not take (refused
before loading), tensors that do not match the config or that it does not declare, a missing bias, --quantization
contradicting the checkpoint; and the labels it names, GPTQ settings read from quantize_config.json."""

import json

import pytest
import torch

import fastspec
from fastspec.errors import FastspecError
from fastspec.models.loader import load_target
from quant_helpers import quantised  # noqa: F401  (fixture)


BAD_CONFIGS = [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "GPTQ with 3 bits is not supported"),
    ({"quant_method": "gptq", "bits": 4, "is_marlin_format": True}, "Marlin layout is not supported"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv' is not supported"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'.*not supported; supported: fp8"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight block size \[128\] is not two positive integers"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "group size 100 is not supported"),
    ({"quant_method": "gptq", "bits": 4, "dynamic": {"+:.*down.*": {"bits": 8}}}, r"per-module settings \(`dynamic`\)"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {"weights": {
        "num_bits": 8, "type": "int", "strategy": "channel"}, "input_activations": {"num_bits": 8, "type": "float"}}}},
     "int8 weights with float 8-bit activations are not supported"),
    ({"quant_method": "compressed-tensors", "format": "sparse-24-bitmask", "config_groups": {"g": {"weights": {
        "num_bits": 8, "type": "float", "strategy": "channel"}}}}, "format 'sparse-24-bitmask' with float 8-bit"),
]


@pytest.mark.commands
@pytest.mark.parametrize("quant, message", BAD_CONFIGS)
def test_unsupported_quantisation_is_one_line_before_loading(tiny_dirs, tmp_path, quant, message):
    from typer.testing import CliRunner

    from fastspec.cli.main import app

    config = json.loads((tiny_dirs["llama"][0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"quantization_config": quant}))
    with pytest.raises(FastspecError, match=message):
        fastspec.LLM(str(tmp_path), max_total_tokens=512)
    result = CliRunner().invoke(app, ["generate", "--model", str(tmp_path), "--prompt", "hi"])
    assert result.exit_code == 2 and "Traceback" not in result.output


def damaged_copy(model_dir, tmp_path, damage=None):
    """A copy of a checkpoint directory, `damage` applied to its state dict."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, tmp_path / "m")
    if damage is not None:
        state = load_file(tmp_path / "m" / "model.safetensors")
        damage(state)
        save_file(state, tmp_path / "m" / "model.safetensors")
    return tmp_path / "m"


@pytest.mark.parametrize("method, damage, message", [
    ("gptq", lambda s: s.pop("model.layers.0.self_attn.q_proj.scales"), r"q_proj\.scales is missing"),
    ("gptq", lambda s: s.update({"model.layers.1.mlp.up_proj.qzeros": s["model.layers.1.mlp.up_proj.qzeros"][:1]}),
     r"up_proj\.qzeros has shape \(1, 12\), expected \(2, 12\)"),
    ("gptq", lambda s: s.update({"model.layers.0.mlp.down_proj.g_idx": torch.zeros(96, dtype=torch.int32)}),
     r"down_proj\.g_idx: groups do not hold 32 inputs each"),
    ("gptq", lambda s: s.pop("model.layers.0.mlp.down_proj.g_idx"), r"down_proj\.g_idx is missing"),  # desc_act
    ("fp8_block", lambda s: s.pop("model.layers.0.self_attn.q_proj.weight_scale_inv"),
     r"q_proj\.weight_scale_inv is missing"),
    ("ct_int4_asym", lambda s: s.pop("model.layers.0.mlp.up_proj.weight_zero_point"),
     r"up_proj\.weight_zero_point is missing"),
    ("ct_int4_asym", lambda s: s.update({"model.layers.0.mlp.up_proj.weight_zero_point": torch.zeros(1, 3).int()}),
     r"up_proj\.weight_zero_point has shape \(1, 3\), expected \(12, 2\)"),
    ("modelopt_pb", lambda s: s.update({"model.layers.1.mlp.up_proj.weight_scale": torch.tensor(0.01)}),  # FP8_PB_WO:
     r"layers\.1\.mlp\.up_proj\.weight_scale has shape \(\), expected \(1, 1\)"),  # a table of 128 x 128 blocks
])
def test_quantised_tensors_that_do_not_match_are_one_line(quantised, tmp_path, method, damage, message):
    model_dir = damaged_copy(quantised(method)[0], tmp_path, damage)
    with pytest.raises(FastspecError, match=message):
        fastspec.LLM(str(model_dir), speculative_algorithm="NONE", max_total_tokens=512)


@pytest.mark.parametrize("method, edit, message", [
    ("ct_int4_asym", lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=True),
     r"weight_zero_point: zero points in a symmetric"),
    ("ct_w8a8", None, r"q_proj\.weight is stored in int8 but the checkpoint declares no quantisation"),
])
def test_tensors_the_config_does_not_declare_are_one_line(quantised, tmp_path, method, edit, message):
    """Zero points where the config says symmetric; int8 weights where it lost its quantization_config (they would
    load as floats without their scales)."""
    model_dir = damaged_copy(quantised(method)[0], tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    if edit is None:
        del config["quantization_config"]
    else:
        edit(config["quantization_config"])
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(FastspecError, match=message):
        load_target(model_dir, torch.float32)


def test_quantization_flags_that_contradict_the_checkpoint_are_one_line(quantised, tiny_dirs):
    model_dir, _ = quantised("awq")
    with pytest.raises(FastspecError, match=r"^quantization='fp8' contradicts .*awq int4 g32.*use auto, awq or none"):
        fastspec.LLM(str(model_dir), quantization="fp8", max_total_tokens=512)
    with pytest.raises(FastspecError, match="^quantization='gptq': .* is a float checkpoint"):
        fastspec.LLM(str(tiny_dirs["llama"][0]), quantization="gptq", max_total_tokens=512)


def test_quantisation_labels_name_each_word_once():
    from quant_writers import CONFIGS

    from fastspec.models.quant_config import read_scheme

    assert read_scheme({"quantization_config": CONFIGS["fp8_block"]}).label == "fp8 block 32x32"
    assert read_scheme({"quantization_config": {"quant_method": "fbgemm_fp8"}}).label == "fbgemm_fp8 fp8"


def test_gptq_settings_in_quantize_config_json_are_read(quantised, tmp_path):
    import shutil

    model_dir, _ = quantised("gptq8")
    shutil.copytree(model_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    quant = config.pop("quantization_config")
    quant.pop("quant_method")
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    (tmp_path / "m" / "quantize_config.json").write_text(json.dumps(quant))
    llm = fastspec.LLM(str(tmp_path / "m"), speculative_algorithm="NONE", max_total_tokens=512)
    assert llm.engine.worker.config.quantization == "gptq"


def test_a_quantised_linear_without_its_bias_is_one_line(quantised, tmp_path):
    """Qwen2's q / k / v have biases beside their packed weights: a missing one is named."""
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir, _ = quantised("awq", "qwen2")
    shutil.copytree(model_dir, tmp_path / "m")
    state = load_file(tmp_path / "m" / "model.safetensors")
    state.pop("model.layers.1.self_attn.k_proj.bias")
    save_file(state, tmp_path / "m" / "model.safetensors")
    with pytest.raises(FastspecError, match=r"missing weight model\.layers\.1\.self_attn\.k_proj\.bias"):
        fastspec.LLM(str(tmp_path / "m"), speculative_algorithm="NONE", max_total_tokens=512)
