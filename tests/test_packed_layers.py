"""The modules a model on its GGUF blocks runs, each against a float32 computation over the same dequantised weight
(the `gguf` package's dequantiser is the oracle for the blocks themselves: test_gguf_blocks.py)."""

import gguf
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import quantize

from fastspec.models.gguf_blocks import blocks_from_state, blocks_state, quantise_rows, read_blocks
from fastspec.models.packed_layers import BlockEmbedding, CastLinear, Int4Linear, RefinedHead, cast_linears


def blocks(kind: str, n: int, k: int, seed: int = 0):
    data = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).numpy()
    return read_blocks(quantize(data, gguf.GGMLQuantizationType[kind]), kind)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_stored_blocks_read_back_bit_for_bit(kind):
    b = blocks(kind, 16, 96)
    state = blocks_state("w", b)
    assert state["w.q"].dtype == (torch.uint8 if b.bits == 4 else torch.int8)
    assert state["w.q"].numel() == b.q.numel() // (2 if b.bits == 4 else 1)  # 4-bit: two values a byte
    back = blocks_from_state(state.__getitem__, "w")
    assert back.bits == b.bits and torch.equal(back.q, b.q) and torch.equal(back.dequantise(), b.dequantise())


def test_dequantise_in_row_chunks_is_the_same_arithmetic():
    b = blocks("Q8_0", 40, 64)
    assert torch.equal(b.dequantise(rows=7), b.dequantise())
    assert torch.equal(b.dequantise(torch.bfloat16, rows=7), b.dequantise().bfloat16())


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_block_embedding_equals_an_embedding_over_the_dequantised_table(kind):
    b = blocks(kind, 50, 64)
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    assert torch.equal(BlockEmbedding(b)(ids), F.embedding(ids, b.dequantise()))


def test_quantise_rows_is_within_half_a_step():
    """The 4-bit rounding of a float weight (the lm_head's approximation when its table is not 4-bit): every value
    within half its group's step, chunk by chunk the same as at once."""
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(3))
    b = quantise_rows(lambda ids: w[ids], 64, chunk=10)
    step = b.scale.repeat_interleave(32, -1)
    assert b.bits == 4 and int(b.q.max()) <= 15
    assert torch.all((b.dequantise() - w).abs() <= step / 2 + 1e-6)
    assert torch.equal(quantise_rows(lambda ids: w[ids], 64).q, b.q)


def test_refined_head_gives_the_exact_logits_of_its_best_tokens():
    """The approximation's top tokens of each row carry the exact float32 logits (hence greedy's argmax is the exact
    one), the rest the approximate ones; with `refine` = vocabulary size every logit is exact."""
    table = BlockEmbedding(blocks("Q8_0", 304, 64, seed=5))
    weight = table.q.float().unflatten(-1, (-1, 32)).mul(table.scale[..., None]).flatten(-2)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(6))
    exact = F.linear(x, weight)
    approx = Int4Linear.from_blocks(quantise_rows(table, 304))
    head = RefinedHead(approx, table, refine=16)
    logits, rough = head(x), approx(x).float()
    top = rough.topk(16, -1).indices
    torch.testing.assert_close(logits.gather(-1, top), exact.gather(-1, top), atol=1e-5, rtol=1e-5)
    rest = torch.ones_like(logits, dtype=torch.bool).scatter(-1, top, False)
    assert torch.equal(logits[rest], rough[rest])
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    torch.testing.assert_close(RefinedHead(approx, table, refine=304)(x), exact, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(approx(x).float(), exact, atol=1e-5)  # the approximation alone is not exact


def test_cast_linears_keeps_the_math_in_the_weight_dtype():
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8, bias=False))
    x = torch.randn(3, 32)
    expected = model(x)
    cast_linears(model, torch.bfloat16)
    assert [type(m) for m in model] == [CastLinear, torch.nn.ReLU, CastLinear]
    assert model[0].weight.dtype == torch.bfloat16 and model(x).dtype == torch.float32
    torch.testing.assert_close(model(x), expected, atol=3e-2, rtol=3e-2)


def test_packed_modules_compile_as_opaque_ops():
    """Inside a fullgraph compile (the compiled round functions) the int4 matmul is fastspec's opaque op, and the
    outputs (a linear, a refined head) equal the eager ones."""
    table = BlockEmbedding(blocks("Q8_0", 64, 64, seed=7))
    head = RefinedHead(Int4Linear.from_blocks(quantise_rows(table, 64)), table)
    for module in (Int4Linear.from_blocks(blocks("Q4_1", 16, 64)), head):
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
        compiled = torch.compile(module, fullgraph=True, dynamic=False)
        torch.testing.assert_close(compiled(x), module(x), atol=1e-5, rtol=1e-5)


def test_pack_linears_rounds_each_linear_to_4_bits_or_casts_it():
    """A draft head beside a target on fastspec's kernels: linears the kernel takes become 4-bit BlockLinears over
    their weight rounded as Q4_1 rounds (each value within half a step of its group's 15), with the bias (any rows:
    24 are padded to the kernel's 16-row tile inside), the rest (inputs not a multiple of 32) CastLinears."""
    from fastspec.kernels import cpu_q4
    from fastspec.models.packed_layers import BlockLinear, pack_linears

    g = torch.Generator().manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 24, bias=False),
                                torch.nn.Linear(24, 8))
    w, bias = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    x = torch.randn(3, 64, generator=g)
    expected = model(x)
    pack_linears(model, torch.float32, 4)
    assert [type(m) for m in model] == [BlockLinear, torch.nn.ReLU, BlockLinear, CastLinear]
    assert model[2].out_features == 24 and model[2].padded and model[2](x[:, :32]).shape == (3, 24)
    assert cpu_q4.bits(model[0].packed) == 4 and torch.equal(model[0].bias, bias)
    q, scale, offset = cpu_q4.unpack(model[0].packed, model[0].scales)
    rounded = (q.float().unflatten(-1, (-1, 32)) * scale[..., None] + offset[..., None]).flatten(-2)
    step = ((w.unflatten(-1, (-1, 32)).amax(-1) - w.unflatten(-1, (-1, 32)).amin(-1)) / 15).repeat_interleave(32, -1)
    assert torch.all((rounded - w).abs() <= step / 2 + 1e-4)  # (+ the float16 rounding of scales and offsets)
    torch.testing.assert_close(model(x), expected, atol=0.1, rtol=0.1)


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_a_packed_eagle3_head_runs_fused_and_gives_its_layers_states(tmp_path, monkeypatch, norm_before_residual):
    """An EAGLE-3 head on 4-bit BlockLinears (as beside a packed target): an extend over target features after a
    committed prefix, then a draft step over its own carry, through a paged KV pool, give the same carry, normed
    state and KV on cpu_fused's kernels as through Eagle3Layer's modules, and the fused path is what ran."""
    import dataclasses

    from fastspec.attention import AttentionContext
    from fastspec.attention.paged import PagedAttnBackend, paged_block_plan
    from fastspec.kernels import cpu_fused
    from fastspec.memory.kv_pool import KVPool
    from fastspec.models import eagle, fused_cpu
    from fastspec.models.heads import write_random_head
    from fastspec.models.layers import fuse_projections
    from fastspec.models.loader import read_config
    from fastspec.models.packed_layers import BlockLinear, pack_linears

    if not cpu_fused.available():
        pytest.skip("no C compiler for the fused CPU kernels")
    config = dataclasses.replace(read_config(write_random_head(tmp_path, 64, 97, "eagle3")),
                                 norm_before_residual=norm_before_residual)
    torch.manual_seed(0)
    head = pack_linears(fuse_projections(eagle.LlamaForCausalLMEagle3(config)), torch.float32, 4)
    for norm in (head.midlayer.input_layernorm, head.midlayer.hidden_norm, head.norm):
        norm.weight.data.uniform_(0.5, 1.5)
    assert type(head.midlayer.self_attn.qkv_proj) is BlockLinear
    g = torch.Generator().manual_seed(1)
    prefix = torch.randn(1, 5, 2, 16, generator=g)  # [layers, slots, Hkv, D]: a committed prefix of 5 tokens
    features, carry_ids = torch.randn(3, 3 * 64, generator=g), torch.tensor([7, 8])
    calls = []
    monkeypatch.setattr(eagle, "eagle3_midlayer", lambda *a: calls.append(1) or fused_cpu.eagle3_midlayer(*a))

    def run():
        pool, table = KVPool(1, 2, 16, 16), torch.arange(16, dtype=torch.int32)[None]
        pool.k[:, :5], pool.v[:, :5] = prefix, -prefix
        rows, outs = torch.zeros(1, dtype=torch.long), []
        extend = paged_block_plan(table, rows, torch.tensor([5]), torch.tensor([[5, 6, 7]]),
                                  torch.ones(3, 3, dtype=torch.bool).tril()[None])
        with torch.inference_mode():
            outs.append(head(torch.tensor([3, 1, 4]), torch.arange(5, 8), features,
                             AttentionContext(PagedAttnBackend(), extend, pool)))
            # two draft rows (topk 2) after the extend, each seeing the prefix, the extend and itself
            step = paged_block_plan(table, torch.zeros(2, dtype=torch.long), torch.tensor([8, 8]),
                                    torch.tensor([[9], [10]]), torch.ones(2, 1, 1, dtype=torch.bool))
            outs.append(head(carry_ids, torch.tensor([8, 8]), outs[0].carry[-1:].expand(2, -1),
                             AttentionContext(PagedAttnBackend(), step, pool)))
        return [t for out in outs for t in out] + [pool.k[0, :11], pool.v[0, :11]]

    fused = run()
    assert len(calls) == 2
    monkeypatch.setattr(eagle, "eagle3_fused", lambda *a: False)
    # a BlockLinear rounds its float32 input to int16 levels (2^-16 of a group's largest value): the two paths' float32
    # roundings can move a value across a level, which moves an output by ~1e-4
    for a, b in zip(fused, run()):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    assert len(calls) == 2
