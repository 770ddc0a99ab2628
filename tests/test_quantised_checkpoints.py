"""Quantised Hugging Face checkpoints (AWQ, GPTQ with desc_act and 8 bits, compressed-tensors int4 with and without
zero points, W8A8 int8 and fp8, block fp8, fbgemm fp8, ModelOpt fp8), each method on the tiny models: loaded against
transformers over the exactly dequantised weights, run packed within a stated tolerance of that, lossless under
speculation (EAGLE-3, a quantised STANDALONE draft, a stored MTP layer, compiled rounds), and rounded as its kind
with dummy weights. (The stored forms and linears alone, online fp8 / int8: test_quant_forms.py; configs and
tensors that do not fit: test_quant_configs.py.)"""

import json

import pytest
import torch

import fastspec
from fastspec.models.layers import fuse_projections
from fastspec.models.loader import load_target
from fastspec.models.quant_config import read_scheme
from fastspec.models.quant_layers import QuantLinear
from fastspec.sampling import SamplingParams
from conftest import hf_greedy
from quant_helpers import PROMPTS, logits, quantised  # noqa: F401  (quantised: a fixture)
from quant_writers import write_quantised

METHODS = ["awq", "gptq", "gptq8", "ct_int4", "ct_int4_asym", "ct_w8a8", "fp8_block", "ct_fp8", "fbgemm_fp8",
           "modelopt", "modelopt_pb"]
# every method on Llama; the other families (qkv bias, q / k norms and another head_dim, MLA + MoE experts, gated
# delta net layers + MoE, Mamba2 mixers, Qwen3-MoE's and Mixtral's experts) with a few
CASES = [(m, "llama") for m in METHODS] + [
    ("awq", "qwen2"), ("gptq", "qwen3"), ("ct_int4", "mistral"), ("fp8_block", "deepseek_v3"),
    ("gptq8", "deepseek_v2"), ("ct_fp8", "qwen3_next"), ("fbgemm_fp8", "bamba"), ("awq", "qwen3_next"),
    ("ct_w8a8", "qwen2"), ("fp8_block", "qwen3_moe"), ("gptq", "qwen3_moe"), ("awq", "mixtral"), ("ct_fp8", "mixtral")]


@pytest.mark.parametrize("method, family", CASES)
def test_dequantised_load_is_transformers_over_the_dequantised_weights(quantised, method, family):
    """--quantization none: the exact reference. Logits equal transformers' over the same dequantised weights (float32,
    the same tolerance as the float models' test) and greedy tokens equal token for token."""
    model_dir, oracle = quantised(method, family)
    model = load_target(model_dir, torch.float32, quantization=None)
    ids = torch.tensor(PROMPTS[1])
    with torch.inference_mode():
        expected = oracle(ids[None]).logits[0]
    torch.testing.assert_close(logits(model, ids), expected, atol=2e-4, rtol=2e-4)
    llm = fastspec.LLM(str(model_dir), speculative_algorithm="NONE", quantization="none", max_total_tokens=512)
    got = llm.generate(PROMPTS, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert [o.output_ids for o in got] == [hf_greedy(oracle, p, 12) for p in PROMPTS]


@pytest.mark.parametrize("method, family", CASES)
def test_stored_form_dequantises_on_each_call_exactly(quantised, method, family):
    """The kept form (QuantLinear, any device) computes the dequantised reference's weights: logits equal to float32
    rounding. Fusing merges the stored forms by rows (desc_act GPTQ's q / k / v share their input order)."""
    model_dir, _ = quantised(method, family)
    reference = fuse_projections(load_target(model_dir, torch.float32, quantization=None))
    model = fuse_projections(load_target(model_dir, torch.float32, quantization="auto"))
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) >= model.config.num_layers
    if model.config.moe is not None and (method, family) != ("awq", "qwen3_next"):  # (there the experts' down_proj
        assert any(type(m).__name__ == "LinearExperts" for m in model.modules())  # has 24 inputs: left float)
    if family == "llama":
        attn = model.model.layers[0].self_attn
        assert isinstance(model.model.layers[0].mlp.down_proj, QuantLinear)
        assert isinstance(attn.qkv_proj, QuantLinear)
    ids = torch.tensor(PROMPTS[1])
    torch.testing.assert_close(logits(model, ids), logits(reference, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method, family", CASES)
def test_packed_kernels_are_close_to_the_exact_model(quantised, method, family):
    """The default on CPU: the fastest kernels measured here (int16 activations, re-rounded fp8, a refined head).
    The best 8 logits of each position (those the head rescores exactly; the tail keeps its 4-bit approximation)
    within 5 % of the largest (activations rounded; fp8 re-rounded to 8 bits per 16; not for MoE models) and the
    exact model's greedy choice kept at >= 90 % of teacher-forced positions."""
    model_dir, oracle = quantised(method, family)
    llm = fastspec.LLM(str(model_dir), speculative_algorithm="NONE", max_total_tokens=512)
    assert llm.engine.worker.config.quantization == read_scheme(json.loads((model_dir / "config.json").read_text()),
                                                                model_dir).method
    model = llm.engine.worker.model
    assert not any(isinstance(m, QuantLinear) for m in model.modules())  # every linear bound to a CPU kernel
    ids = torch.randint(3, 97, (64,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        expected = oracle(ids[None]).logits[0]
    got = logits(model, ids)
    top = got.topk(8, -1).indices
    if model.config.moe is None:  # MoE routing is discontinuous: a flipped expert moves a position's logits a lot
        assert (got.gather(-1, top) - expected.gather(-1, top)).abs().max() <= 0.05 * expected.abs().max()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("method, family, algorithm", [(m, "llama", "EAGLE3") for m in METHODS] + [
    ("awq", "qwen2", "EAGLE3"), ("gptq", "qwen3", "EAGLE"), ("ct_int4", "llama", "NGRAM"), ("gptq8", "llama", "NGRAM"),
    ("fp8_block", "deepseek_v3", "NGRAM"), ("awq", "qwen3_next", "NGRAM"), ("gptq", "qwen3_moe", "NGRAM"),
    ("awq", "mixtral", "NGRAM")])
def test_speculation_on_a_quantised_checkpoint_is_lossless(quantised, draft_dirs, method, family, algorithm):
    model_dir, _ = quantised(method, family)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = fastspec.LLM(str(model_dir), speculative_algorithm="NONE", max_total_tokens=1024)
    expected = [o.output_ids for o in plain.generate(PROMPTS, params)]
    draft = str(draft_dirs[family][algorithm.lower()]) if algorithm.startswith("EAGLE") else None
    llm = fastspec.LLM(str(model_dir), speculative_algorithm=algorithm, draft_model=draft, max_total_tokens=1024,
                       tuned=False)
    llm.engine.policy = None  # every round speculates
    outputs = llm.generate(PROMPTS, params)
    assert [o.output_ids for o in outputs] == expected and all(o.metrics.verify_rounds > 0 for o in outputs)


@pytest.mark.parametrize("target, quantization, four_bit", [("gptq", "auto", 4), ("float", "auto", 4),
                                                             ("gptq", None, 0)])
def test_a_quantised_standalone_draft_runs_as_stored_and_is_lossless(quantised, tiny_dirs, tmp_path, target,
                                                                     quantization, four_bit):
    """STANDALONE with an AWQ draft checkpoint, beside a GPTQ or a float target: the draft's layer runs its stored
    4-bit form on the device's kernels (dequantised it would run 8-bit or float), or dequantised with --quantization
    none; the output equals plain decoding either way."""
    from transformers import AutoModelForCausalLM

    from fastspec.models.quant_layers import gemm_kernels

    model_dir = quantised("gptq", "llama")[0] if target == "gptq" else tiny_dirs["llama"][0]
    hf_draft = AutoModelForCausalLM.from_pretrained(str(tiny_dirs["llama"][0]), dtype=torch.float32)
    hf_draft.model.layers = hf_draft.model.layers[:1]
    hf_draft.config.num_hidden_layers = 1
    write_quantised(hf_draft, tmp_path / "draft", "awq")
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    plain = fastspec.LLM(str(model_dir), speculative_algorithm="NONE", max_total_tokens=1024,
                         quantization=quantization)
    expected = [o.output_ids for o in plain.generate(PROMPTS, params)]
    llm = fastspec.LLM(str(model_dir), speculative_algorithm="STANDALONE", draft_model=str(tmp_path / "draft"),
                       num_steps=2, topk=2, num_draft_tokens=4, max_total_tokens=1024, tuned=False,
                       quantization=quantization)
    llm.engine.policy = None
    kernels = gemm_kernels(llm.engine.worker.draft_model)
    assert "dequantised per call, F.linear" not in kernels
    assert sum(kernels.values()) == 5  # fused QKV, o, fused gate_up, down (its one layer) and the lm_head
    assert sum(n for k, n in kernels.items() if "4-bit" in k or k.startswith("torch int4")) == four_bit
    outputs = llm.generate(PROMPTS, params)
    assert [o.output_ids for o in outputs] == expected and all(o.metrics.verify_rounds > 0 for o in outputs)


@pytest.mark.parametrize("method, family", [("gptq", "llama"), ("fp8_block", "llama"), ("ct_fp8", "deepseek_v3")])
def test_compiled_rounds_on_a_quantised_checkpoint_equal_plain_decoding(quantised, draft_dirs, method, family):
    """The draft loop and verify compiled fullgraph (the CPU proof of no host sync) over the bound modules (a
    desc_act GPTQ's gathered inputs, unfused QKV; quantised MoE experts run densely) give plain eager decoding's
    tokens."""
    model_dir, _ = quantised(method, family)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    plain = fastspec.LLM(str(model_dir), speculative_algorithm="NONE", max_total_tokens=1024)
    expected = [o.output_ids for o in plain.generate(PROMPTS, params)]
    spec = dict(speculative_algorithm="EAGLE3", draft_model=str(draft_dirs["llama"]["eagle3"])) if family == "llama" \
        else dict(speculative_algorithm="NGRAM")
    llm = fastspec.LLM(str(model_dir), **spec, graphs="compile", max_total_tokens=1024, tuned=False,
                       cuda_graph_bs=(1, 2))
    llm.engine.policy = None
    outputs = llm.generate(PROMPTS, params)
    assert [o.output_ids for o in outputs] == expected and all(o.metrics.verify_rounds > 0 for o in outputs)


@pytest.mark.parametrize("family, method, quantization", [
    ("deepseek_v3", "ct_fp8", "auto"), ("deepseek_v3", "awq", "auto"), ("deepseek_v3", "awq", None),
    ("qwen3_next", "awq", "auto"), ("deepseek_v3 with a float MTP layer", "awq", "auto")])
def test_nextn_drafts_with_the_stored_mtp_layer_of_a_quantised_checkpoint(tmp_path, family, method, quantization):
    """A quantised DeepSeek-V3 or Qwen3-Next checkpoint with its MTP layer quantised too: NEXTN drafts with that
    layer's linears (MoE experts included) in their stored form, bound to the device's kernels as the target's are
    (AWQ: on the 4-bit kernel; dequantised, they would be float or 8-bit), or all dequantised with --quantization
    none; the output equals plain decoding on the same target either way. An MTP layer stored in float beside
    quantised decoder layers loads as float."""
    from tiny_models import write_deepseek, write_qwen3_next_mtp

    from fastspec.models.quant_layers import gemm_kernels
    from quant_writers import quantise_dir

    if family == "qwen3_next":
        write_qwen3_next_mtp(tmp_path / "ds")
    else:
        write_deepseek(tmp_path / "ds", mtp=1)
    dequantised = quantise_dir(tmp_path / "ds", method)
    float_mtp = family.endswith("float MTP layer")
    if float_mtp:
        from safetensors.torch import load_file, save_file

        state, floats = load_file(tmp_path / "ds" / "model.safetensors"), load_file(dequantised / "model.safetensors")
        layers = json.loads((tmp_path / "ds" / "config.json").read_text())["num_hidden_layers"]
        mtp = f"model.layers.{layers}."  # the layer past the last decoder layer
        state = {k: v for k, v in state.items() if not k.startswith(mtp)} | {
            k: v for k, v in floats.items() if k.startswith(mtp)}
        save_file(state, tmp_path / "ds" / "model.safetensors", metadata={"format": "pt"})
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    plain = fastspec.LLM(str(tmp_path / "ds"), speculative_algorithm="NONE", max_total_tokens=1024,
                         quantization=quantization)
    expected = [o.output_ids for o in plain.generate(PROMPTS, params)]
    llm = fastspec.LLM(str(tmp_path / "ds"), speculative_algorithm="NEXTN", max_total_tokens=1024, tuned=False,
                       quantization=quantization)
    llm.engine.policy = None
    kernels = gemm_kernels(llm.engine.worker.draft_model)
    four_bit = sum(n for k, n in kernels.items() if "4-bit" in k or k.startswith("torch int4"))
    assert (four_bit > 2) == ((method, quantization) == ("awq", "auto") and not float_mtp)  # experts among them
    assert "dequantised per call, F.linear" not in kernels
    outputs = llm.generate(PROMPTS, params)
    assert [o.output_ids for o in outputs] == expected and all(o.metrics.verify_rounds > 0 for o in outputs)


@pytest.mark.parametrize("method, bits", [("awq", 4), ("fp8_block", 8)])
def test_dummy_weights_of_a_quantised_checkpoint_are_rounded_as_its_kind(quantised, method, bits):
    """--load-format dummy on a quantised checkpoint: random weights of its shapes, rounded at load as its kind (a
    benchmark of its shapes measures its kernels, not float GEMMs, as `bench --profile` showed they were)."""
    from fastspec.models.quant_layers import gemm_kernels

    llm = fastspec.LLM(str(quantised(method)[0]), load_format="dummy", speculative_algorithm="NONE",
                       max_total_tokens=512)
    kernels = gemm_kernels(llm.engine.worker.target.model)
    assert not any(name.startswith("F.linear") for name in kernels), kernels
    assert any(f"{bits}-bit" in name or "fp8" in name for name in kernels), kernels
