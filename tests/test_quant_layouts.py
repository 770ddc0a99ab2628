"""Quantised checkpoints as their producers lay them out, beyond the per-method oracles of
test_quantised_checkpoints: compressed-tensors checkpoints written by compressed-tensors' own ModelCompressor (the
config.json llm-compressor saves, `re:` ignore entries) against transformers' own decompressed load; AutoAWQ's
quant_config.json; a fused QKV of rows not a multiple of the CPU kernels' tile; and the inputs that must be one line:
packed words of another dtype, AWQ tensors that disagree, packed weights without a config, int4 rounding a hidden size
that does not take its groups."""

import json
import logging
import shutil

import pytest
import torch

import fastspec
from fastspec.errors import FastspecError
from fastspec.kernels import cpu_library
from fastspec.sampling import SamplingParams
from quant_writers import write_quantised
from conftest import hf_greedy

PROMPTS = [[5, 9, 13, 3, 40], [7, 7, 8, 60, 61, 62, 7, 7]]


def tokens(model_dir, new=12, **kw):
    llm = fastspec.LLM(str(model_dir), speculative_algorithm="NONE", max_total_tokens=512, **kw)
    return [o.output_ids for o in llm.generate(PROMPTS, SamplingParams(max_new_tokens=new, ignore_eos=True))], llm


def compress(model, directory, weights, inputs, ignore):
    """`model` saved as llm-compressor saves it: a scheme applied, each weight's scale (and zero point) from its
    min / max by compressed-tensors' calculate_qparams, compressed by ModelCompressor, config.json updated by it."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 QuantizationStatus, apply_quantization_config)
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights),
                                input_activations=None if inputs is None else QuantizationArgs(**inputs))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore,
                                                        quantization_status=QuantizationStatus.INITIALIZED))
    with torch.no_grad():
        for module in model.modules():
            args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if args is None:
                continue
            w = module.weight.float()
            if args.strategy == "channel":
                low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
            elif args.strategy == "group":
                low, high = (f(w.unflatten(-1, (-1, args.group_size)), -1) for f in (torch.amin, torch.amax))
            else:  # block
                rows, cols = args.block_structure
                blocks = w.view(w.shape[0] // rows, rows, w.shape[1] // cols, cols)
                low, high = blocks.amin((1, 3)), blocks.amax((1, 3))
            scale, zero = calculate_qparams(low, high, args)
            module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype).reshape(
                    module.weight_zero_point.shape)
            module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(directory)


FP8 = dict(num_bits=8, type="float", symmetric=True)
SCHEMES = {  # name: (weights, input activations, ignore)
    "fp8_dynamic": (FP8 | dict(strategy="channel"), FP8 | dict(strategy="token", dynamic=True),
                    ["lm_head", "re:.*mlp.down_proj$", "re:.*layers.1.self_attn.*"]),
    "fp8_block": (FP8 | dict(strategy="block", block_structure=[32, 32]),
                  FP8 | dict(strategy="group", group_size=32, dynamic=True), ["lm_head"]),
    "w4a16_asym": (dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32), None, ["lm_head"]),
}


@pytest.mark.parametrize("name", list(SCHEMES))
def test_a_model_compressor_checkpoint_gives_transformers_tokens(tmp_path, name):
    """--quantization none in float32: the greedy tokens of transformers' own load of the same checkpoint,
    decompressed by compressed-tensors (its dequantiser, not fastspec's; the decompressed weights put into a plain
    model, so activations are not rounded). The ignored linears stay float in the checkpoint and in fastspec."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from tiny_models import make_hf_model

    weights, inputs, ignore = SCHEMES[name]
    compress(make_hf_model("llama"), tmp_path / "m", weights, inputs, ignore)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.float32,
                                                  quantization_config=CompressedTensorsConfig(run_compressed=False))
    oracle = make_hf_model("llama")
    assert not oracle.load_state_dict(loaded.state_dict(), strict=False).missing_keys
    assert torch.equal(oracle.model.layers[0].mlp.up_proj.weight, loaded.model.layers[0].mlp.up_proj.weight)
    got, llm = tokens(tmp_path / "m", quantization="none", dtype="float32")
    assert got == [hf_greedy(oracle, p, 12) for p in PROMPTS]
    assert tokens(tmp_path / "m")[1].engine.worker.config.quantization == "compressed-tensors"


@pytest.fixture(scope="module")
def awq_dir(tiny_dirs, tmp_path_factory):
    d = tmp_path_factory.mktemp("awq")
    write_quantised(tiny_dirs["llama"][1], d / "m", "awq")
    return d / "m"


def edited_copy(src, tmp_path, state=None, config=None):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, tmp_path / "m")
    if state is not None:
        tensors = load_file(tmp_path / "m" / "model.safetensors")
        state(tensors)
        save_file(tensors, tmp_path / "m" / "model.safetensors")
    if config is not None:
        raw = json.loads((tmp_path / "m" / "config.json").read_text())
        config(raw)
        (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    return tmp_path / "m"


Q = "model.layers.0.self_attn.q_proj."


@pytest.mark.parametrize("state, config, message", [
    # the same shape in int16: the high nibbles of each word were lost (it loaded and ran)
    (lambda s: s.update({Q + "qweight": s[Q + "qweight"].to(torch.int16)}), None,
     r"q_proj\.qweight is stored as int16; packed weights are read as int32 words"),
    (None, lambda c: c["quantization_config"].update(quant_method="gptq", pack_dtype="int16"),
     r"GPTQ packed into int16 words \(pack_dtype\) is not supported"),
    # scales for 32 outputs: the message blamed qweight, which is right
    (lambda s: s.update({Q + "scales": s[Q + "scales"][:, :32].contiguous()}), None,
     r"q_proj: qweight \(64, 8\) holds 64 output columns, scales \(2, 32\) does not"),
    # a packed checkpoint that lost its quantization_config: "missing weight ...q_proj.weight" named no cause
    (None, lambda c: c.pop("quantization_config"),
     r"q_proj\.qweight is a packed quantised weight but the checkpoint declares no quantisation"),
])
def test_packed_tensors_that_cannot_be_read_are_one_line(awq_dir, tmp_path, state, config, message):
    model_dir = edited_copy(awq_dir, tmp_path, state, config)
    with pytest.raises(FastspecError, match=message):
        fastspec.LLM(str(model_dir), speculative_algorithm="NONE", max_total_tokens=512)


def test_autoawqs_quant_config_json_is_read(awq_dir, tmp_path):
    """AutoAWQ exports keep their settings in quant_config.json (w_bit, q_group_size, version "GEMM"): read as the
    same checkpoint, the same tokens; a quant_config.json of another shape is not AWQ's and is not read."""
    model_dir = edited_copy(awq_dir, tmp_path, config=lambda c: c.pop("quantization_config"))
    (model_dir / "quant_config.json").write_text(json.dumps({"zero_point": True, "q_group_size": 32, "w_bit": 4,
                                                             "version": "GEMM"}))
    got, llm = tokens(model_dir)
    assert llm.engine.worker.config.quantization == "awq"
    assert got == tokens(awq_dir)[0]
    (model_dir / "quant_config.json").write_text(json.dumps({"something": "else"}))
    with pytest.raises(FastspecError, match="declares no quantisation"):
        tokens(model_dir)


@pytest.mark.commands
def test_int4_rounding_of_a_hidden_size_its_groups_do_not_take_is_one_line(tmp_path):
    """Hidden size 48 (groups of 32): every projection reading the hidden state would have stayed float and the
    model run unrounded, silently. One line before any weight is read, exit 2."""
    from typer.testing import CliRunner

    from fastspec.cli.main import app
    from tiny_models import make_hf_model

    make_hf_model("llama", hidden_size=48, intermediate_size=96).save_pretrained(tmp_path / "m")
    with pytest.raises(FastspecError, match="hidden size 48 is not a multiple of 32; use int8 or fp8"):
        fastspec.LLM(str(tmp_path / "m"), quantization="int4", max_total_tokens=512)
    result = CliRunner().invoke(app, ["generate", "--model", str(tmp_path / "m"), "--input-ids", "5,6",
                                      "--quantization", "int4"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert tokens(tmp_path / "m", quantization="int8")[0]  # per channel: any width


def test_int4_rounding_names_the_linears_it_leaves_float(tiny_dirs, caplog):
    """MLA's q_b_proj takes 48 inputs (q_lora_rank) here: left float, said once; the experts are rounded and
    counted."""
    from fastspec.models.layers import fuse_projections
    from fastspec.models.loader import load_target
    from fastspec.models.quantise import quantise_online

    model = fuse_projections(load_target(tiny_dirs["deepseek_v3"][0], torch.float32))
    with caplog.at_level(logging.WARNING, logger="fastspec.models.quantise"):
        count = quantise_online(model, "int4")
    assert "4 linears whose inputs are not a multiple of 32 stay float (layers.0.self_attn.q_b_proj" in caplog.text
    assert count > 3 * 8 * 3  # three MoE layers of 8 experts, each gate / up / down


def test_the_weights_check_counts_a_dequantised_checkpoint_unpacked(awq_dir, tiny_dirs, tmp_path, monkeypatch):
    """`--quantization none` unpacks an AWQ / GPTQ checkpoint into float: the weights' check counted its packed bytes
    (8 int4 values a word), so a load 8x past memory was let through to be killed midway (found reading
    check_weights_fit's callers). A float checkpoint whose config.json names another dtype than its tensors' is
    counted from the tensors."""
    import fastspec.memory.kv_pool as kv_pool
    from fastspec.models.sources import resolve_sources
    from fastspec.models.weights_fit import check_weights_fit

    float_bytes = (tiny_dirs["llama"][0] / "model.safetensors").stat().st_size  # the same model, float32
    packed = (awq_dir / "model.safetensors").stat().st_size
    assert packed < float_bytes // 2
    monkeypatch.setattr(kv_pool, "available_bytes", lambda device: float_bytes // 2)
    check_weights_fit(resolve_sources(str(awq_dir), "NONE"), "float32", "cpu")  # as stored: fits
    with pytest.raises(FastspecError, match="the weights need .* as float32"):
        check_weights_fit(resolve_sources(str(awq_dir), "NONE", quantization=None), "float32", "cpu")
    monkeypatch.setattr(kv_pool, "available_bytes", lambda device: float_bytes * 11 // 10)  # (+ unpacked zeros)
    check_weights_fit(resolve_sources(str(awq_dir), "NONE", quantization=None), "float32", "cpu")

    fp16 = edited_copy(tiny_dirs["llama"][0], tmp_path, state=lambda s: s.update({k: v.half() for k, v in s.items()}),
                       config=lambda c: c.update(torch_dtype="float32"))
    monkeypatch.setattr(kv_pool, "available_bytes", lambda device: float_bytes * 3 // 8)
    with pytest.raises(FastspecError, match="as bfloat16"):  # half of float32's bytes: was counted as a quarter
        check_weights_fit(resolve_sources(str(fp16), "NONE"), "bfloat16", "cpu")
    monkeypatch.setattr(kv_pool, "available_bytes", lambda device: float_bytes * 5 // 8)
    check_weights_fit(resolve_sources(str(fp16), "NONE"), "bfloat16", "cpu")


@pytest.mark.parametrize("method", ["gptq", "awq", "int4"])
@pytest.mark.parametrize("activation", [torch.float32, torch.bfloat16, pytest.param(
    torch.int16, marks=pytest.mark.skipif(not cpu_library.available(), reason="no C compiler"))])
def test_a_packed_qkv_of_rows_not_a_multiple_of_16_is_packed(tmp_path, monkeypatch, method, activation):
    """3 heads and 1 KV head of 24 (a fused QKV of 120 rows): the CPU kernels pad it to their 16-row tile inside (it
    ran as a dequantised float linear before, when they took only multiples of 16); the logits are the vocabulary
    wide (265), and the greedy tokens those of transformers over the exactly dequantised checkpoint (GPTQ / AWQ) on
    float32 activations, nearly always on the fast ones (teacher-forced)."""
    from gguf_writers import tiny_model

    from fastspec.models import activation_choice
    from fastspec.models.quant_layers import gemm_kernel

    monkeypatch.setattr(activation_choice, "fast_activation", lambda: activation)
    hf = tiny_model("qwen3", tied=False, head_dim=24, num_attention_heads=3, num_key_value_heads=1)
    if method == "int4":  # online rounding: its oracle is the rounded model (test_quantise); shapes only here
        hf.save_pretrained(tmp_path / "m")
        oracle = None
    else:
        oracle = write_quantised(hf, tmp_path / "m", method)
    got, llm = tokens(tmp_path / "m", new=8, quantization=method, kv_cache_dtype="float32")
    model = llm.engine.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.out_features == 120 and gemm_kernel(qkv).startswith(("torch int4", "fastspec CPU block"))
    assert model.lm_head(torch.zeros(1, 64)).shape == (1, 265)
    if oracle is None:
        return
    if activation == torch.float32:
        assert got == [hf_greedy(oracle, p, 8) for p in PROMPTS]
    with torch.inference_mode():
        same = sum(int((oracle(torch.tensor([p + g])).logits[0, len(p) - 1:-1].argmax(-1) == torch.tensor(g)).sum())
                   for p, g in zip(PROMPTS, got))
    assert same >= 0.9 * 8 * len(PROMPTS)
