"""A GGUF whose vocabulary (TOKENS: 265) is not a multiple of the packed kernels' 16-row tile, its lm_head (tied to
the embedding or its own) packed on every CPU path: torch's int4 kernel on float32 or bfloat16 activations, fastspec's
on int16 ones, with the C library and without it (the torch twins). The packing pads the rows inside; the logits are
vocab_size wide on each path.

Oracle: transformers' model of the converted directory (float32, the file's weights dequantised): float32 activations
give its logits to float32 rounding and its greedy tokens; the fast kernels its greedy tokens, teacher-forced, nearly
always (test_gguf_kquants.assert_close_to_reference's bar)."""

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import quantize
from gguf_writers import TOKENS, tiny_model, write_gguf
from test_gguf_archs import PROMPTS, hf_greedy
from test_gguf_kquants import (
    assert_speculation_is_lossless,
    oracle,
    packed_and_reference,
    random_rows,
    write_k_quant_gguf,
)

import fastspec
from fastspec.kernels import cpu_library, cpu_q4
from fastspec.models import activation_choice, packed_layers
from fastspec.models.gguf import convert_gguf
from fastspec.models.gguf_blocks import read_blocks
from fastspec.models.gguf_kquants import read
from fastspec.models.packed_layers import BlockLinear, CastLinear, Int4Linear
from fastspec.models.reference import transformers_model
from fastspec.sampling import SamplingParams

Q = gguf.GGMLQuantizationType
VOCAB = len(TOKENS)
ACTIVATIONS = (torch.bfloat16, torch.int16, torch.float32)  # float32 last: it reads the head bfloat16's load cached
LIBRARY = [pytest.param(True, marks=pytest.mark.skipif(not cpu_library.available(), reason="no C compiler")), False]
FEW_KV_HEADS = {"head_dim": 12, "num_attention_heads": 8, "num_key_value_heads": 1}  # a fused QKV of 8 * 12 + 2 * 12


def odd_vocabulary_file(path, arch: str, qtype: str, tied: bool, **config):
    assert VOCAB % packed_layers.ROW_TILE
    if qtype == "Q4_K":  # every matrix Q4_K (the package cannot quantise to it: random super-blocks)
        return write_k_quant_gguf(path, types=lambda name, array: "Q4_K" if array.ndim == 2 else None)
    return write_gguf(path, tiny_model(arch, tied=tied, **config), qtype=Q[qtype])


def packed_logits(model, x: torch.Tensor) -> torch.Tensor:  # x [T] -> [T, V]
    from fastspec.train.data import PackedCausalAttention

    with torch.inference_mode():
        hidden = model(x, torch.arange(len(x)), PackedCausalAttention(torch.zeros(len(x), dtype=torch.long))).final
        return model.compute_logits(hidden)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q6_K", "IQ4_NL"])
@pytest.mark.parametrize("library", LIBRARY)
def test_a_packed_linear_of_any_rows_equals_a_linear_over_its_weight(monkeypatch, kind, library):
    """21 rows (the kernels' tile is 16): Int4Linear (4-bit) on float32 activations to float32 rounding, BlockLinear
    (any width; int16 activations) to 1e-3 of the outputs' scale, both [M, 21]; the padding adds no value to the
    packing (IQ4_NL stays 4-bit indices into its 16 levels, Q6_K stays 6-bit)."""
    if not library:
        monkeypatch.setattr(cpu_library, "library", lambda: None)
    rng = np.random.default_rng(0)
    if kind in ("Q6_K", "IQ4_NL"):  # random super-blocks (the package cannot quantise to them)
        raw = random_rows(kind, 21, 256, rng)
        blocks, weight = read(raw, kind), oracle(raw, kind)
    else:
        raw = quantize(rng.standard_normal((21, 256)).astype(np.float32), Q[kind])
        blocks, weight = read_blocks(raw, kind), oracle(raw, kind)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    expected = F.linear(x, weight)
    if blocks.bits == 4:
        exact = Int4Linear.from_blocks(blocks, torch.float32)
        torch.testing.assert_close(exact(x), expected, atol=1e-4, rtol=1e-5)
        assert exact.out_features == 21 and exact.padded and exact.packed.shape[0] == 32
    fast = BlockLinear.from_blocks(blocks)
    assert fast.out_features == 21 and fast.padded and fast(x[:, None]).shape == (5, 1, 21)
    assert cpu_q4.bits(fast.packed) == {"Q6_K": 6, "Q8_0": 8}.get(kind, 4)
    assert (fast.levels is not None) == (kind == "IQ4_NL")
    torch.testing.assert_close(fast(x), expected, atol=1e-3 * float(expected.abs().max()), rtol=0)


@pytest.mark.parametrize("arch, qtype, tied, config", [
    ("llama", "Q4_0", False, {}), ("llama", "Q4_1", True, {}), ("mixtral", "Q4_0", True, {}),
    ("llama", "Q8_0", False, {}), ("llama", "Q4_K", False, {}), ("qwen3", "Q4_0", True, FEW_KV_HEADS),
    ("qwen3", "Q8_0", False, FEW_KV_HEADS)])
@pytest.mark.parametrize("library", LIBRARY)
def test_packed_weights_of_any_rows_give_outputs_as_wide_as_them(tmp_path, monkeypatch, arch, qtype, tied, config,
                                                                  library):
    """Each activation in turn on one converted directory (the later ones read the packed weights the earlier ones
    cached): logits [T, 265]; float32 ones equal the oracle's to 1e-4 of their scale (a padded row or a shifted one
    would move them by whole units), the fast kernels' argmax is the oracle's at 90 % of positions or more. Also a
    fused QKV of 120 rows (FEW_KV_HEADS), packed likewise."""
    if not library:
        monkeypatch.setattr(cpu_library, "library", lambda: None)
    path = odd_vocabulary_file(tmp_path / "m.gguf", arch, qtype, tied, **config)
    model_dir = convert_gguf(path, tmp_path / "hf")
    x = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = transformers_model(model_dir)(x[None]).logits[0]
    for activation in ACTIVATIONS:
        model = packed_and_reference(model_dir, activation)[0]
        qkv = model.model.layers[0].self_attn.qkv_proj
        assert not config or qkv.out_features == 120 and (type(qkv) is CastLinear or qkv.padded)
        logits = packed_logits(model, x)
        assert logits.shape == (len(x), VOCAB), activation
        if activation == torch.float32:
            torch.testing.assert_close(logits, expected, atol=1e-4 * float(expected.abs().max()), rtol=1e-4)
        else:
            assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9, activation


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("library", LIBRARY)
@pytest.mark.parametrize("arch, config", [("llama", {}), ("qwen3", FEW_KV_HEADS)])
def test_greedy_tokens_and_logprobs_of_a_packed_odd_vocabulary(tmp_path, monkeypatch, activation, library, arch,
                                                               config):
    """fastspec.LLM on an untied Q4_0 file (and one of FEW_KV_HEADS: its QKV padded too, so the fused CPU layers
    call its module, not its kernel) with the activation fast_activation would pick: every token and logprob
    alternative is a vocabulary id, and the oracle, teacher-forced on the output, picks the same token at 90 % of
    positions or more; with float32 activations the greedy tokens are the oracle's and each token's logprob its
    log-softmax over the 265 logits (to 1e-3: padded logits would take a share of the softmax)."""
    if not library:
        monkeypatch.setattr(cpu_library, "library", lambda: None)
    monkeypatch.setattr(activation_choice, "fast_activation", lambda: activation)
    path = odd_vocabulary_file(tmp_path / "m.gguf", arch, "Q4_0", tied=False, **config)
    llm = fastspec.LLM(str(path), speculative_algorithm="NONE", quantization="gguf", max_total_tokens=512,
                       kv_cache_dtype="float32")  # (auto: bfloat16 beside packed weights)
    outputs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=3))
    assert llm.engine.model.lm_head(torch.zeros(1, 64)).shape == (1, VOCAB)
    for output in outputs:
        assert all(0 <= t < VOCAB for t in output.output_ids)
        assert all(0 <= t < VOCAB for step in output.logprobs for t, _ in step.top)
    reference = transformers_model(convert_gguf(path, tmp_path / "hf"))
    if activation == torch.float32:
        assert [o.output_ids for o in outputs] == [hf_greedy(reference, p, 8) for p in PROMPTS]
    same = 0
    for prompt, output in zip(PROMPTS, outputs):
        with torch.no_grad():  # the oracle teacher-forced on fastspec's tokens
            logits = reference(torch.tensor([prompt + output.output_ids])).logits[0, len(prompt) - 1:-1]
        ids = torch.tensor(output.output_ids)
        same += int((logits.argmax(-1) == ids).sum())
        if activation == torch.float32:
            got = torch.tensor([step.logprob for step in output.logprobs])
            torch.testing.assert_close(got, logits.log_softmax(-1).gather(1, ids[:, None])[:, 0], atol=1e-3, rtol=0)
    assert same >= 0.9 * 8 * len(PROMPTS)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_speculation_on_padded_packed_weights_is_lossless(tmp_path, monkeypatch, activation):
    """NGRAM, every round speculating, on the FEW_KV_HEADS Q4_0 file (QKV and lm_head padded): plain greedy's tokens."""
    monkeypatch.setattr(activation_choice, "fast_activation", lambda: activation)
    path = odd_vocabulary_file(tmp_path / "m.gguf", "qwen3", "Q4_0", tied=False, **FEW_KV_HEADS)
    assert_speculation_is_lossless(path, "NGRAM", 64, tmp_path / "head")
