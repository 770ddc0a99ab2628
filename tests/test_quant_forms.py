"""Quantised weights' stored forms and the linears over them, without a checkpoint: words in the published layouts
read by hand (AWQ, GPTQ, compressed-tensors int-quantized), compressed-tensors' own dequantiser of fp8 blocks, W8A8
fp8 against its twin, block fp8 compiled and through sgl_kernel's calling convention, desc_act forms left unfused,
bind's fallback, the CUDA kernels; and online fp8 / int8 quantisation of a float checkpoint (--quantization fp8 /
int8), close to its oracle and lossless under speculation."""

import pytest
import torch

import fastspec
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
from quant_helpers import PROMPTS, logits
from quant_writers import AWQ_ORDER, awq_pack


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
