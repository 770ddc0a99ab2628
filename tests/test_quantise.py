"""Online 4-bit quantisation (`--quantization int4`, CPU) of the tiny Llama-family targets, against an independent
oracle: the same model with every projection replaced by a float linear over its rounded weight."""

import pytest
import torch
import torch.nn.functional as F

from fastspec.kernels import cpu_library
from fastspec.models.gguf_blocks import quantise_rows
from fastspec.models.layers import fuse_projections
from fastspec.models.loader import load_target
from fastspec.models.packed_layers import Int4Linear, BlockLinear, RefinedHead
from fastspec.models.quantise import quantise_target
from fastspec.train.data import PackedCausalAttention

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        hidden = model(ids, torch.arange(len(ids)), PackedCausalAttention(torch.zeros(len(ids), dtype=torch.long)))
        return model.compute_logits(hidden.final)


def rounded_twin(model):
    """Every fused projection's weight replaced in place by its 4-bit rounding, dequantised: a float model."""
    for module in model.modules():
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            linear = getattr(module, name, None)
            if isinstance(linear, torch.nn.Linear):
                w = linear.weight.detach()
                linear.weight.data = quantise_rows(lambda ids: w[ids], w.shape[0]).dequantise()
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_int4_with_float32_activations_is_the_rounded_model(tiny_dirs, family):
    """float32 activations: every projection packed, logits those of the float model over the rounded weights
    (to float32 rounding); the rounding itself moves them (the test could fail)."""
    model_dir, _ = tiny_dirs[family]
    float_model = fuse_projections(load_target(model_dir, torch.float32))
    oracle = rounded_twin(fuse_projections(load_target(model_dir, torch.float32)))
    model = fuse_projections(load_target(model_dir, torch.float32))
    assert quantise_target(model, "int4", torch.float32, True) == 4 * model.config.num_layers
    assert not any(isinstance(m, torch.nn.Linear) for layer in model.model.layers for m in layer.modules())
    ids = torch.randint(3, 97, (24,), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(logits(model, ids), logits(oracle, ids), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(logits(float_model, ids), logits(oracle, ids), atol=1e-4)


@pytest.mark.parametrize("activation", [torch.bfloat16, pytest.param(
    torch.int16, marks=pytest.mark.skipif(not cpu_library.available(), reason="no C compiler"))])
def test_int4_with_fast_activations_rescores_the_head_exactly(tiny_dirs, activation):
    """bfloat16 or int16 activations (the fast kernels): the lm_head is refined, the rounded model's greedy choices
    kept teacher-forced at nearly every position (the activations are rounded)."""
    model_dir, _ = tiny_dirs["qwen2"]  # tied embeddings: the head rescores from the embedding table itself
    oracle = rounded_twin(fuse_projections(load_target(model_dir, torch.float32)))
    model = fuse_projections(load_target(model_dir, torch.float32))
    quantise_target(model, "int4", activation, True)
    assert isinstance(model.lm_head, RefinedHead) and model.lm_head.table is model.model.embed_tokens
    ids = torch.randint(3, 97, (64,), generator=torch.Generator().manual_seed(2))
    got, expected = logits(model, ids), logits(oracle, ids)
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
    top = got.topk(1, -1).indices
    torch.testing.assert_close(got.gather(-1, top), expected.gather(-1, top), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("algorithm", ["EAGLE3", "NGRAM"])
def test_speculation_on_an_int4_target_is_lossless(tiny_dirs, draft_dirs, algorithm):
    import fastspec
    from fastspec.sampling import SamplingParams

    model_dir = str(tiny_dirs["llama"][0])
    prompts = [[5, 9, 13, 2 + 1, 40], [7, 7, 8, 60, 61, 62, 7, 7]]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = fastspec.LLM(model_dir, speculative_algorithm="NONE", quantization="int4", max_total_tokens=1024)
    expected = [o.output_ids for o in plain.generate(prompts, params)]
    draft = str(draft_dirs["llama"]["eagle3"]) if algorithm == "EAGLE3" else None
    llm = fastspec.LLM(model_dir, speculative_algorithm=algorithm, draft_model=draft, quantization="int4",
                       max_total_tokens=1024, tuned=False)
    llm.engine.policy = None  # every round speculates
    outputs = llm.generate(prompts, params)
    assert [o.output_ids for o in outputs] == expected and all(o.metrics.verify_rounds > 0 for o in outputs)
    assert isinstance(llm.engine.worker.model.model.layers[0].mlp.down_proj, Int4Linear | BlockLinear)


@pytest.mark.parametrize("family, method", [("deepseek_v3", "int4"), ("qwen3_next", "fp8"), ("bamba", "int8")])
def test_online_rounding_takes_every_family(tiny_dirs, family, method):
    """MLA (its kv_b_proj stays float: read as a tensor), stacked MoE experts (as LinearExperts), gated delta net
    and Mamba2 projections: rounded at load, and NGRAM speculation on the rounded target equals plain decoding."""
    import fastspec
    from fastspec.models.moe import LinearExperts
    from fastspec.sampling import SamplingParams

    model_dir = str(tiny_dirs[family][0])
    prompts = [[7, 7, 8, 60, 61, 62, 7, 7, 8, 60]]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    plain = fastspec.LLM(model_dir, speculative_algorithm="NONE", quantization=method, max_total_tokens=512)
    model = plain.engine.worker.model
    left = [n for n, m in model.model.layers.named_modules() if isinstance(m, torch.nn.Linear)
            and n.rsplit(".", 1)[-1] != "kv_b_proj" and not (method == "int4" and m.in_features % 32)]
    assert not left  # (int4 leaves linears of inputs not a multiple of 32 float: MLA's q_b_proj takes 48 here)
    assert (family == "bamba") != any(isinstance(m, LinearExperts) for m in model.modules())
    expected = [o.output_ids for o in plain.generate(prompts, params)]
    llm = fastspec.LLM(model_dir, speculative_algorithm="NGRAM", quantization=method, max_total_tokens=512)
    llm.engine.policy = None
    assert [o.output_ids for o in llm.generate(prompts, params)] == expected


def test_the_rounding_is_what_int4_linear_computes():
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(3))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))
    blocks = quantise_rows(lambda ids: w[ids], 48)
    torch.testing.assert_close(Int4Linear.from_blocks(blocks, torch.float32)(x), F.linear(x, blocks.dequantise()),
                               atol=1e-4, rtol=1e-5)


@pytest.mark.gpu
def test_online_int4_rounds_on_the_weights_device():
    """--quantization int4 on a CUDA model: the 4-bit values, scales and offsets all on CUDA (the values were
    allocated on the CPU before, so the bound linear saw a CPU weight), each value within half a step of the weight."""
    from fastspec.models.quantise import online_form

    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(12))
    blocks = online_form(w.cuda(), "int4").blocks
    assert {t.device.type for t in (blocks.q, blocks.scale, blocks.offset)} == {"cuda"}
    half_step = blocks.scale.repeat_interleave(blocks.group, 1).cpu() / 2
    assert ((blocks.dequantise().cpu() - w).abs() <= half_step + 1e-6).all()
