"""The byte-coded weight GEMM (fastspec.kernels.triton_quant) in Triton's interpreter (TRITON_INTERPRET=1, set by
conftest; compiled on a GPU) against its torch twin and against independent decoders: torch's own float8_e4m3fn
for every e4m3 code, the stored forms' dequantisation for ByteLinear, and plain decoding for a whole model."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from fastspec.kernels import triton_quant as tq  # noqa: E402
from fastspec.models.gguf_blocks import Blocks  # noqa: E402
from fastspec.models.quant_layers import ByteLinear, QuantLinear  # noqa: E402
from fastspec.models.quantise import online_form  # noqa: E402
from fastspec.models.quant_weights import Fp8Weight, IntWeight  # noqa: E402


def test_every_e4m3_code_decodes_as_torch_reads_it():
    """x = the identity: y = w.T, every code but the two NaNs (0x7f, 0xff) in a row of 256, scale 1."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(1, -1)[:, :240]  # 254 finite codes; K a multiple of 16
    w = codes.expand(16, -1).contiguous()
    eye = torch.eye(w.shape[1])
    y = tq.matmul(eye, w, torch.ones(16, 1), None, w.shape[1], tq.E4M3)
    assert torch.equal(y[:, 0], codes.view(torch.float8_e4m3fn).float()[0])


@pytest.mark.parametrize("fmt", [tq.E4M3, tq.INT8, tq.UINT4])
@pytest.mark.parametrize("m, n, k, cols", [(1, 64, 128, 128), (5, 72, 96, 32), (19, 200, 64, 16)])
def test_kernel_equals_its_twin(fmt, m, n, k, cols):
    """Partial row and column tiles, several scale columns, offsets where the format has them (float32 rounding:
    the kernel sums tile by tile)."""
    gen = torch.Generator().manual_seed(m * n + fmt)
    if fmt == tq.E4M3:
        w = (torch.randn(n, k, generator=gen) * 20).to(torch.float8_e4m3fn).view(torch.uint8)
    elif fmt == tq.INT8:
        w = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8).view(torch.uint8)
    else:
        w = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // cols, generator=gen)
    offset = None if fmt == tq.E4M3 else torch.randn(n, k // cols, generator=gen)
    x = torch.randn(m, k, generator=gen)
    want = tq.matmul_twin(x, w, scale, offset, cols, fmt)
    torch.testing.assert_close(tq.matmul(x, w, scale, offset, cols, fmt), want, atol=1e-4 * want.abs().max(),
                               rtol=1e-5)


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
    torch.testing.assert_close(ByteLinear(form, None)(x), want, atol=1e-4 * want.abs().max(), rtol=1e-5)


@pytest.mark.parametrize("method", ["fp8_block", "gptq8"])
def test_speculation_through_the_byte_kernel_is_lossless(monkeypatch, tiny_dirs, draft_dirs, tmp_path, method):
    """FASTSPEC_TRITON_QUANT=1: the quantised target's linears run the Triton kernel (interpreted) on CPU; EAGLE-3
    on it gives plain decoding's tokens on it."""
    import fastspec
    from fastspec.sampling import SamplingParams
    from quant_writers import write_quantised

    monkeypatch.setenv("FASTSPEC_TRITON_QUANT", "1")
    write_quantised(tiny_dirs["llama"][1], tmp_path / "m", method)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompts = [[5, 9, 13, 3, 40]]
    plain = fastspec.LLM(str(tmp_path / "m"), speculative_algorithm="NONE", max_total_tokens=512)
    assert isinstance(plain.engine.worker.model.model.layers[0].mlp.down_proj, ByteLinear)
    expected = [o.output_ids for o in plain.generate(prompts, params)]
    llm = fastspec.LLM(str(tmp_path / "m"), speculative_algorithm="EAGLE3", draft_model=str(draft_dirs["llama"]["eagle3"]),
                       max_total_tokens=512, tuned=False)
    llm.engine.policy = None
    assert [o.output_ids for o in llm.generate(prompts, params)] == expected
