"""Quantised Hugging Face checkpoints (AWQ, GPTQ with desc_act and 8 bits, compressed-tensors int4 with and without
zero points, W8A8 int8 and fp8, block fp8, fbgemm fp8, ModelOpt fp8) and online fp8 / int8: read against hand-worked
words in the published layouts, loaded against transformers over the exactly dequantised weights, run packed within
a stated tolerance of that, lossless under speculation, and every bad input one line."""

import json

import pytest
import torch

import fastspec
from fastspec.errors import FastspecError
from fastspec.models.gguf_blocks import Blocks
from fastspec.models.layers import fuse_projections
from fastspec.models.loader import load_target
from fastspec.models.quant_config import read_scheme
from fastspec.models.cuda_linears import Fp8Linear
from fastspec.models.quant_layers import QuantLinear, bind
from fastspec.models.quantise import online_form
from fastspec.models.quant_decode import unpack_int32
from fastspec.models.quant_weights import Fp8Weight, IntWeight
from fastspec.sampling import SamplingParams
from quant_writers import AWQ_ORDER, awq_pack, write_quantised

METHODS = ["awq", "gptq", "gptq8", "ct_int4", "ct_int4_asym", "ct_w8a8", "fp8_block", "ct_fp8", "fbgemm_fp8",
           "modelopt", "modelopt_pb"]
# every method on Llama; the other families (qkv bias, q / k norms and another head_dim, MLA + MoE experts, gated
# delta net layers + MoE, Mamba2 mixers, Qwen3-MoE's and Mixtral's experts) with a few
CASES = [(m, "llama") for m in METHODS] + [
    ("awq", "qwen2"), ("gptq", "qwen3"), ("ct_int4", "mistral"), ("fp8_block", "deepseek_v3"),
    ("gptq8", "deepseek_v2"), ("ct_fp8", "qwen3_next"), ("fbgemm_fp8", "bamba"), ("awq", "qwen3_next"),
    ("ct_w8a8", "qwen2"), ("fp8_block", "qwen3_moe"), ("gptq", "qwen3_moe"), ("awq", "mixtral"), ("ct_fp8", "mixtral")]
PROMPTS = [[5, 9, 13, 3, 40], [7, 7, 8, 60, 61, 62, 7, 7]]


def needs(method):
    if method.startswith("ct_"):
        pytest.importorskip("compressed_tensors")


@pytest.fixture(scope="module")
def quantised(tiny_dirs, tmp_path_factory):
    """method -> (directory, transformers oracle over the dequantised weights), made on first use."""
    made = {}

    def get(method, family="llama"):
        if (method, family) not in made:
            needs(method)
            d = tmp_path_factory.mktemp(f"{method}-{family}")
            made[method, family] = d, write_quantised(tiny_dirs[family][1], d, method)
        return made[method, family]
    return get


def logits(model, ids):
    """A prefill's logits [T, V] through a KV pool (and the recurrent states of a hybrid model)."""
    from conftest import PoolRunner

    with torch.inference_mode():
        return model.compute_logits(PoolRunner(model).extend([0], [ids.tolist()]).final)


def hf_greedy(hf, prompt, new):
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(new):
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[0, len(prompt):].tolist()


def test_an_awq_word_holds_its_columns_in_autoawqs_order():
    """Columns 0..7 holding 0..7: nibble i (bits 4i..) holds column ORDER[i] = 0 2 4 6 1 3 5 7, so the word reads
    0x75316420 from its high nibble down."""
    word = awq_pack(torch.arange(8).view(1, 8))
    assert word.item() == 0x75316420
    scheme = read_scheme({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 32}})
    from fastspec.models.quant_decode import decode_state

    k = 32
    qweight = awq_pack(torch.arange(8).repeat(k, 1))  # [32, 1]: every input row the same word
    _, forms = decode_state({"a.qweight": qweight, "a.qzeros": awq_pack(torch.full((1, 8), 3)),
                             "a.scales": torch.full((1, 8), 0.5, dtype=torch.float16)}, scheme, "t")
    assert torch.equal(forms["a"].dequantise(), ((torch.arange(8.0) - 3) * 0.5)[:, None].expand(8, k))
    assert AWQ_ORDER[1] == 2


def test_a_gptq_word_holds_inputs_low_bits_first():
    """qweight row r holds inputs 8r..8r+7 of its column, input 8r+i in bits 4i..; 0x76543210 is inputs 0..7 = 0..7."""
    assert unpack_int32(torch.tensor([[0x76543210]], dtype=torch.int32), 4, 0).flatten().tolist() == list(range(8))
    assert unpack_int32(torch.tensor([[-1]], dtype=torch.int32), 8, 1).flatten().tolist() == [255] * 4


@pytest.mark.parametrize("strategy, scale", [
    ("tensor", torch.tensor([0.25])), ("channel", torch.tensor([[0.5], [2.0]])),
    ("group", torch.tensor([[1.0, 3.0], [0.5, 0.25]]))])
@pytest.mark.parametrize("symmetric", [True, False])
def test_an_int_quantized_weight_is_its_int8_values_times_their_scale(strategy, scale, symmetric):
    """compressed-tensors' int-quantized (W8A8 int8) stores the int8 values as they are: w = (q - zero) * scale, a
    scale (and where asymmetric an int8 zero point) per tensor, per output channel or per group of inputs (here 16)."""
    from fastspec.models.quant_decode import decode_state

    weights = {"num_bits": 8, "type": "int", "symmetric": symmetric, "strategy": strategy, "group_size": 16}
    scheme = read_scheme({"quantization_config": {"quant_method": "compressed-tensors", "format": "int-quantized",
                                                  "config_groups": {"g": {"weights": weights}}}})
    q = torch.arange(-32, 32, dtype=torch.int8).view(2, 32)
    zero = (torch.arange(scale.numel(), dtype=torch.int8) * 3 - 2).view(scale.shape)
    stored = {"a.weight": q, "a.weight_scale": scale, "a.input_scale": torch.tensor([0.1])}
    _, forms = decode_state(stored | ({} if symmetric else {"a.weight_zero_point": zero}), scheme, "t")

    def full(x):  # [2, 32]: each weight's value of a per-tensor / channel / group table
        return x.repeat_interleave(16, 1) if strategy == "group" else x.reshape(-1, 1).expand(2, 32)
    expected = (q.float() - (0 if symmetric else full(zero).float())) * full(scale)
    assert torch.equal(forms["a"].dequantise(), expected)


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


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_online_quantisation_is_lossless_and_close(tiny_dirs, draft_dirs, method):
    """--quantization fp8 / int8 on a float checkpoint: each projection rounded per output channel; logits close
    to those of the float model over the rounded weights (the oracle: online_form's dequantisation, which the
    rounding itself moves away from the float model) and EAGLE-3 on it equals plain decoding on it."""
    model_dir = str(tiny_dirs["llama"][0])
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = fastspec.LLM(model_dir, speculative_algorithm="NONE", quantization=method, max_total_tokens=1024)
    expected = [o.output_ids for o in plain.generate(PROMPTS, params)]
    llm = fastspec.LLM(model_dir, speculative_algorithm="EAGLE3", draft_model=str(draft_dirs["llama"]["eagle3"]),
                       quantization=method, max_total_tokens=1024, tuned=False)
    llm.engine.policy = None
    assert [o.output_ids for o in llm.generate(PROMPTS, params)] == expected
    ids = torch.randint(3, 97, (32,), generator=torch.Generator().manual_seed(3))
    reference = fuse_projections(load_target(tiny_dirs["llama"][0], torch.float32))
    original = logits(reference, ids)
    for layer in reference.model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            linear.weight.data = online_form(linear.weight.detach(), method).dequantise()
    got, want = logits(plain.engine.worker.model, ids), logits(reference, ids)
    top = got.topk(8, -1).indices  # those the head rescores exactly (see test_packed_kernels_are_close...)
    assert (got.gather(-1, top) - want.gather(-1, top)).abs().max() <= 0.05 * want.abs().max()
    assert not torch.allclose(want, original, atol=1e-3)


def test_w8a8_fp8_is_scaled_mm_over_activations_rounded_per_token():
    """Fp8Linear (the CUDA path; torch runs the same op on CPU) against its twin: x rounded to e4m3 per token,
    multiplied by the dequantised weight in float32 (tolerance: the op's own summation order)."""
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(48, 64, generator=gen), torch.randn(5, 64, generator=gen)
    form = online_form(w, "fp8")
    try:
        got = Fp8Linear(form)(x)
    except RuntimeError as e:  # torch 2.11's CPU _scaled_mm: per-tensor scales only (CUDA runs row-wise ones)
        pytest.skip(f"this torch's CPU _scaled_mm takes no row-wise scales ({str(e)[:60]}...)")
    x_scale = x.abs().amax(-1, keepdim=True) / 448
    twin = ((x / x_scale).to(torch.float8_e4m3fn).float() * x_scale) @ form.dequantise().t()
    torch.testing.assert_close(got, twin, atol=1e-4, rtol=1e-4)
    assert (twin - x @ w.t()).abs().max() < 0.1 * (x @ w.t()).abs().max()


def test_block_fp8_w8a8_compiles_fullgraph_as_it_runs_eagerly():
    """Fp8BlockLinear's op (its torch twin here: no Triton needed) traced fullgraph with the activations' rounding
    around it, on this torch (the floor's too): the CPU proof the W8A8 module holds no host sync; same output."""
    from fastspec.models.cuda_linears import Fp8BlockLinear

    gen = torch.Generator().manual_seed(10)
    form = Fp8Weight((torch.randn(96, 128, generator=gen) * 40).to(torch.float8_e4m3fn),
                     torch.rand(96, 1, generator=gen).expand(96, 4).contiguous(), 32)
    module = Fp8BlockLinear(form, torch.randn(96, generator=gen), "torch")
    x = torch.randn(3, 5, 128, generator=gen)
    torch.testing.assert_close(torch.compile(module, fullgraph=True, dynamic=False)(x), module(x), atol=1e-4,
                               rtol=1e-5)


def test_block_fp8_calls_sgl_kernel_as_sglang_does(monkeypatch):
    """The sgl_kernel path's calling convention, against a stand-in for sgl_kernel.fp8_blockwise_scaled_mm that
    checks the layouts SGLang passes (a row-major e4m3 [M, K], the weight as a column-major [K, N] view, the
    activation scales [M, K / 128] column-major, the block scales [K / 128, N / 128]) and computes the product from
    them: the same output as the torch twin, in bfloat16."""
    from fastspec.kernels import fp8_block
    from fastspec.models.cuda_linears import Fp8BlockLinear

    def fake(a, b, scales_a, scales_b, out_dtype):
        m, k = a.shape
        n = b.shape[1]
        assert a.dtype == b.dtype == torch.float8_e4m3fn and a.is_contiguous() and b.stride() == (1, k)
        assert scales_a.shape == (m, k // 128) and scales_a.stride(0) == 1 and scales_b.shape == (k // 128, n // 128)
        assert out_dtype in (torch.bfloat16, torch.float16)
        x = a.float() * scales_a.repeat_interleave(128, 1)
        return (x @ (b.float() * scales_b.repeat_interleave(128, 0).repeat_interleave(128, 1))).to(out_dtype)

    monkeypatch.setattr(fp8_block, "sgl_kernel_op", lambda name, device: fake)
    gen = torch.Generator().manual_seed(11)
    scale = torch.rand(2, 3, generator=gen).repeat_interleave(128, 0)
    form = Fp8Weight((torch.randn(256, 384, generator=gen) * 40).to(torch.float8_e4m3fn), scale, 128)
    x = torch.randn(5, 384, generator=gen)
    sgl = Fp8BlockLinear(form, None, "sgl_kernel")
    assert sgl.scale.shape == (2, 3)  # one scale per 128 x 128 block
    twin = Fp8BlockLinear(form, None, "torch")(x)
    got = sgl(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, twin.bfloat16().float(), atol=1e-2 * twin.abs().max().item(), rtol=1e-2)


def test_weights_over_inputs_in_different_orders_stay_separate():
    """desc_act GPTQ linears whose g_idx orders differ cannot share one form: fusing leaves them as they are."""
    from fastspec.models.layers import merged_linear

    q = torch.randint(0, 16, (32, 64), dtype=torch.uint8)
    blocks = Blocks(q, torch.full((32, 2), 0.1), torch.zeros(32, 2), 4)
    a, b = (QuantLinear(IntWeight(blocks, torch.randperm(64, generator=torch.Generator().manual_seed(s))))
            for s in (1, 2))
    assert merged_linear(a, b) is None and merged_linear(a, a).out_features == 64


def test_bind_keeps_the_stored_form_where_no_kernel_takes_the_shape():
    """A 40 x 48 int4 weight (rows not a multiple of 16): a CastLinear over its exact dequantisation on CPU (in
    float32 beside float32 activations)."""
    q = torch.randint(0, 16, (40, 48), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    form = IntWeight(Blocks(q, torch.full((40, 3), 0.1), torch.full((40, 3), -0.8), 4))
    bound = bind(QuantLinear(form), torch.float32)
    assert type(bound).__name__ == "CastLinear"
    x = torch.randn(3, 48)
    torch.testing.assert_close(bound(x), x @ form.dequantise().t())
    fp8 = Fp8Weight(torch.randn(32, 64).to(torch.float8_e4m3fn), torch.rand(32, 2), 32)
    assert torch.equal(QuantLinear(fp8).form.scale, fp8.scale)


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
    with pytest.raises(FastspecError, match=r"--quantization fp8 contradicts .*awq int4 g32.*use auto, awq or none"):
        fastspec.LLM(str(model_dir), quantization="fp8", max_total_tokens=512)
    with pytest.raises(FastspecError, match="--quantization gptq: .* is a float checkpoint"):
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


def test_compressed_tensors_dequantises_fp8_blocks_as_fastspec_does():
    """The independent dequantiser: compressed-tensors' own, over a 2 x 2 grid of 32 x 32 blocks."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    from fastspec.models.quant_decode import decode_state

    gen = torch.Generator().manual_seed(7)
    q = (torch.randn(64, 64, generator=gen) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 2, generator=gen) + 0.01
    args = QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=[32, 32])
    scheme = read_scheme({"quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]}})
    _, forms = decode_state({"x.weight": q, "x.weight_scale_inv": scale}, scheme, "t")
    torch.testing.assert_close(forms["x"].dequantise(), dequantize(q, scale, args=args, dtype=torch.float32),
                               atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["int4", "fp8", "fp8_block"])
def test_cuda_kernels_compute_the_stored_forms_weights(kind):
    """On CUDA: bind chooses tinygemm for 4-bit groups of 128, W8A8 _scaled_mm for per-channel fp8 and the W8A8
    block GEMM for 128 x 128 fp8 blocks; each within its activations' rounding (bfloat16 / e4m3 per token or per
    token and block) of the stored form dequantised per call."""
    from fastspec.models.cuda_linears import Fp8BlockLinear, TinyGemmLinear

    gen = torch.Generator().manual_seed(8)
    w, x = torch.randn(256, 512, generator=gen), torch.randn(4, 512, generator=gen)
    if kind == "int4":
        q, zero, scale = (torch.randint(0, 16, (256, 512), generator=gen, dtype=torch.uint8),
                          torch.randint(0, 16, (256, 4), generator=gen).float(), torch.rand(256, 4, generator=gen) / 8)
        form = IntWeight(Blocks(q, scale, -zero * scale, 4))
    elif kind == "fp8":
        form = online_form(w, "fp8")
    else:
        scale = torch.rand(2, 4, generator=gen).repeat_interleave(128, 0) / 16
        form = Fp8Weight((w * 16).to(torch.float8_e4m3fn), scale, 128)
    stored = QuantLinear(form).cuda()
    bound = bind(stored, None)
    assert isinstance(bound, {"int4": TinyGemmLinear, "fp8": Fp8Linear, "fp8_block": Fp8BlockLinear}[kind])
    xc = x.cuda()
    want, got = stored(xc), bound(xc).float()
    torch.testing.assert_close(got, want, atol=0.05 * want.abs().max().item(), rtol=0.03)
    if kind == "fp8_block":  # the same W8A8 product as its torch twin, but for the order of float32 sums
        twin = Fp8BlockLinear(form, None, "torch").cuda()(xc)
        torch.testing.assert_close(got, twin, atol=1e-4 * twin.abs().max().item(), rtol=1e-4)


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
