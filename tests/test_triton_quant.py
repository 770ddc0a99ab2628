"""The byte-coded weight GEMM (fastspec.kernels.triton_quant) and the block-fp8 W8A8 GEMM (triton_fp8) in Triton's
interpreter (TRITON_INTERPRET=1, set by conftest; compiled on a GPU) against their torch twins and against
independent decoders: torch's own float8_e4m3fn for every e4m3 code, the stored forms' dequantisation for
ByteLinear, activations rounded group by group for Fp8BlockLinear, and plain decoding for a whole model."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from fastspec.kernels import fp8_block, triton_fp8  # noqa: E402
from fastspec.kernels import triton_quant as tq  # noqa: E402
from fastspec.models.gguf_blocks import Blocks  # noqa: E402
from fastspec.models.cuda_linears import ByteLinear, Fp8BlockLinear  # noqa: E402
from fastspec.models.quant_layers import QuantLinear, bind  # noqa: E402
from fastspec.models.quantise import online_form  # noqa: E402
from fastspec.models.quant_weights import Fp8Weight, IntWeight  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, interpreted on CPU


def on_device(*args):
    return [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]


def test_every_e4m3_code_decodes_as_torch_reads_it():
    """x = the identity: y = w.T, every code but the two NaNs (0x7f, 0xff) in a row of 256, scale 1."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(1, -1)[:, :240]  # 254 finite codes; K a multiple of 16
    w = codes.expand(16, -1).contiguous()
    eye = torch.eye(w.shape[1])
    y = tq.matmul(*on_device(eye, w, torch.ones(16, 1), None, w.shape[1], tq.E4M3)).cpu()
    assert torch.equal(y[:, 0], codes.view(torch.float8_e4m3fn).float()[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fmt", [tq.E4M3, tq.INT8, tq.UINT4])
@pytest.mark.parametrize("m, n, k, cols", [(1, 64, 128, 128), (5, 72, 96, 32), (19, 200, 64, 16)])
def test_kernel_equals_its_twin(fmt, m, n, k, cols, dtype):
    """Partial row and column tiles, several scale columns, offsets where the format has them (float32 rounding:
    the kernel sums tile by tile; float16 activations are dotted in float16 with float32 sums, every code being
    exact in float16)."""
    gen = torch.Generator().manual_seed(m * n + fmt)
    if fmt == tq.E4M3:
        w = (torch.randn(n, k, generator=gen) * 20).to(torch.float8_e4m3fn).view(torch.uint8)
    elif fmt == tq.INT8:
        w = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8).view(torch.uint8)
    else:
        w = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // cols, generator=gen)
    offset = None if fmt == tq.E4M3 else torch.randn(n, k // cols, generator=gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    want = tq.matmul_twin(x, w, scale, offset, cols, fmt)
    got = tq.matmul(*on_device(x, w, scale, offset, cols, fmt)).cpu()
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max(), rtol=1e-5)


def forms():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=gen)
    fp8_block = Fp8Weight(w.to(torch.float8_e4m3fn), torch.rand(48, 2, generator=gen), 32)
    q4 = torch.randint(0, 16, (48, 64), generator=gen, dtype=torch.uint8)
    awq_like = IntWeight(Blocks(q4, torch.rand(48, 2, generator=gen), -torch.rand(48, 2, generator=gen), 4))
    return {"fp8 block": fp8_block, "fp8 channel": online_form(w, "fp8"), "int8": online_form(w, "int8"),
            "int4 with zeros": awq_like}


@pytest.mark.parametrize("name", list(forms()))
def test_byte_linear_computes_the_stored_forms_weights(monkeypatch, name):
    monkeypatch.setenv("FASTSPEC_TRITON_QUANT", "1")
    form = forms()[name]
    x = torch.randn(3, 64)
    want = QuantLinear(form)(x)
    got = ByteLinear(form, None).to(DEVICE)(x.to(DEVICE)).cpu()
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max(), rtol=1e-5)


def test_activations_are_rounded_per_token_and_group():
    """Each group of a token's inputs: its largest magnitude becomes +-448 exactly, every value within e4m3's
    rounding (3 mantissa bits: 1/16 relative, or the subnormal step) of x / scale; a group of zeros stays zero."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 96, generator=gen) * torch.tensor([1e-3, 1.0, 300.0]).repeat_interleave(32)
    x[2, 32:64] = 0
    xq, sx = fp8_block.quantise_groups(x, 32)
    assert xq.dtype == torch.float8_e4m3fn and sx.shape == (3, 3)
    for m in range(3):
        for g in range(3):
            part, q, s = x[m, 32 * g:32 * (g + 1)], xq[m, 32 * g:32 * (g + 1)].float(), sx[m, g].item()
            if not part.any():
                assert not q.any()
                continue
            assert s == pytest.approx(part.abs().max().item() / 448, rel=1e-6)
            assert q.abs().max().item() == 448
            assert ((q - part / s).abs() <= torch.maximum((part / s).abs() / 16, torch.tensor(2.0 ** -9))).all()


@pytest.mark.parametrize("m, n, k, group", [(1, 64, 128, 128), (5, 72, 96, 32), (19, 200, 256, 64),
                                            (3, 130, 320, 128)])
def test_fp8_block_kernel_equals_its_twin(m, n, k, group):
    """Partial row, column and group tiles (K = 320: a last group of 64 in a group of 128)."""
    gen = torch.Generator().manual_seed(m * n)
    xq, sx = fp8_block.quantise_groups(torch.randn(m, k, generator=gen) * 3, group)
    w = (torch.randn(n, k, generator=gen) * 20).to(torch.float8_e4m3fn)
    sw = torch.rand(n, -(-k // group), generator=gen)
    want = fp8_block.matmul_twin(xq, sx, w, sw, group)
    args = on_device(xq, sx, w, sw, group, torch.float32)
    got = triton_fp8.matmul(*args, native=fp8_block.fp8_tensor_cores(DEVICE)).cpu()  # fp8 tensor cores on sm89+
    torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max(), rtol=1e-5)


@pytest.mark.parametrize("kernel", ["triton", "torch"])
def test_fp8_block_linear_is_w8a8_over_the_stored_form(monkeypatch, kernel):
    """Fp8BlockLinear against a reference built group by group: x rounded by torch's e4m3 cast per token and 32
    inputs, times the stored form dequantised (64 x 32 blocks: scales repeated over 64 rows)."""
    monkeypatch.setenv("FASTSPEC_TRITON_QUANT", "1")
    gen = torch.Generator().manual_seed(6)
    scale = torch.rand(2, 3, generator=gen).repeat_interleave(64, 0)
    form = Fp8Weight((torch.randn(128, 96, generator=gen) * 30).to(torch.float8_e4m3fn), scale, 32)
    bias, x = torch.randn(128, generator=gen), torch.randn(2, 4, 96, generator=gen)
    rows = []
    for token in x.reshape(-1, 96):
        groups = token.view(3, 32)
        s = groups.abs().amax(-1, keepdim=True) / 448
        rows.append(((groups / s).to(torch.float8_e4m3fn).float() * s).reshape(96))
    want = (torch.stack(rows) @ form.dequantise().t() + bias).view(2, 4, 128)
    bound = bind(QuantLinear(form, bias).to(DEVICE), None)
    assert isinstance(bound, Fp8BlockLinear) and bound.kernel in ("triton", "sgl_kernel")
    got = Fp8BlockLinear(form, bias, kernel).to(DEVICE)(x.to(DEVICE)).cpu()
    torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max(), rtol=1e-5)
    exact = x @ form.dequantise().t() + bias
    assert 0 < (got - exact).abs().max() < 0.1 * exact.abs().max()  # W8A8: the activations' rounding, no more


def test_gemm_kernels_name_what_each_linear_runs(monkeypatch):
    """bench --profile's names: a stored form left as it is, the Triton kernels bind chooses (a GPTQ desc_act
    weight's inputs gathered first), a float linear; counted per kernel, inner modules not again."""
    from fastspec.models.quant_layers import gemm_kernels

    gen = torch.Generator().manual_seed(9)
    fp8 = forms()["fp8 block"]
    perm = torch.randperm(64, generator=gen)
    gptq = IntWeight(forms()["int4 with zeros"].blocks, perm)
    model = torch.nn.ModuleList([QuantLinear(fp8), QuantLinear(gptq), torch.nn.Linear(4, 4)])
    assert gemm_kernels(model) == {"dequantised per call, F.linear": 2, "F.linear float32": 1}
    monkeypatch.setenv("FASTSPEC_TRITON_QUANT", "1")
    model = torch.nn.ModuleList([bind(QuantLinear(fp8), None), bind(QuantLinear(fp8), None),
                                 bind(QuantLinear(gptq), None)])
    assert gemm_kernels(model) == {"fastspec Triton fp8 block GEMM, W8A8 per token and 32 inputs": 2,
                                   "fastspec Triton byte GEMM (uint4 weights), inputs gathered": 1}


@pytest.mark.parametrize("method, family, algorithm, graphs, kernel", [
    ("fp8_block", "llama", "EAGLE3", "eager", "fastspec Triton fp8 block GEMM"),
    ("fp8_block", "llama", "EAGLE3", "compile", "fastspec Triton fp8 block GEMM"),
    ("fp8_block", "deepseek_v3", "NGRAM", "eager", "fastspec Triton fp8 block GEMM"),
    ("gptq8", "llama", "EAGLE3", "eager", "fastspec Triton byte GEMM")])
def test_speculation_through_the_triton_kernels_is_lossless(monkeypatch, tiny_dirs, draft_dirs, tmp_path, method,
                                                             family, algorithm, graphs, kernel):
    """FASTSPEC_TRITON_QUANT=1: the quantised target's linears run the Triton kernels (interpreted) on CPU: block fp8
    W8A8 (DeepSeek-V3's MLA and MoE experts too), 8-bit GPTQ as bytes; speculation on it, eager or compiled
    fullgraph (the ops are opaque to the compiler, the activations' rounding is traced), gives plain decoding's
    tokens on it."""
    import fastspec
    from fastspec.models.quant_layers import gemm_kernels
    from fastspec.sampling import SamplingParams
    from quant_writers import write_quantised

    monkeypatch.setenv("FASTSPEC_TRITON_QUANT", "1")
    write_quantised(tiny_dirs[family][1], tmp_path / "m", method)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompts = [[5, 9, 13, 3, 40], [7, 7, 8, 7, 7, 8, 7]]
    plain = fastspec.LLM(str(tmp_path / "m"), speculative_algorithm="NONE", max_total_tokens=512)
    assert any(name.startswith(kernel) for name in gemm_kernels(plain.engine.worker.model))
    expected = [o.output_ids for o in plain.generate(prompts, params)]
    draft = str(draft_dirs[family]["eagle3"]) if algorithm == "EAGLE3" else None
    llm = fastspec.LLM(str(tmp_path / "m"), speculative_algorithm=algorithm, draft_model=draft, max_total_tokens=512,
                       tuned=False, graphs=graphs, cuda_graph_bs=(1, 2))
    llm.engine.policy = None
    outputs = llm.generate(prompts, params)
    assert [o.output_ids for o in outputs] == expected and all(o.metrics.verify_rounds > 0 for o in outputs)
