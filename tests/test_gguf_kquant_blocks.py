"""The K-quants and IQ4_XS read as Blocks, checked against the `gguf` package's own dequantiser (the independent
oracle) on random super-blocks (the package cannot quantise to them), and the packed int4 linear over Q4_K against
a float32 linear over the oracle's weight. (test_gguf_kquants.py: the random rows and the oracle, and the tiny
GGUFs made of them.)"""

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_gguf_kquants import HEADS, oracle, random_rows

from fastspec.models.gguf_kquants import DEQUANTISED, read, read_q4_k, read_q6_k
from fastspec.models.gguf_read import unpermute_rope_rows
from fastspec.models.packed_layers import Int4Linear

VALUES = {"Q2_K": (0, 3), "Q3_K": (-4, 3), "Q5_K": (0, 31), "Q6_K": (-32, 31), "IQ4_XS": (-127, 113),
          "IQ4_NL": (-127, 113)}  # the int8 values each 8-bit type is read as


@pytest.mark.parametrize("n, k", [(16, 256), (24, 512), (8, 1024)])
def test_q4_k_dequantises_as_gguf_does(n, k):
    raw = random_rows("Q4_K", n, k, np.random.default_rng(n + k))
    blocks = read_q4_k(raw)
    assert blocks.bits == 4 and blocks.q.shape == (n, k) and blocks.scale.shape == blocks.offset.shape == (n, k // 32)
    assert blocks.q.dtype == torch.uint8 and 0 <= int(blocks.q.min()) and int(blocks.q.max()) <= 15
    assert torch.equal(blocks.dequantise(), oracle(raw, "Q4_K"))  # the same float32 arithmetic: bit for bit


@pytest.mark.parametrize("kind, group", [("Q2_K", 16), ("Q3_K", 16), ("Q5_K", 32), ("Q6_K", 16), ("IQ4_XS", 32),
                                         ("IQ4_NL", 32)])
@pytest.mark.parametrize("n, k", [(16, 256), (8, 768)])
def test_8bit_types_dequantise_as_gguf_does(kind, group, n, k):
    """Every value of its type's range is met (random bytes: the test sees each bit of the layout), and the
    dequantised weight is the oracle's bit for bit (the same float32 arithmetic). (IQ4_NL is a 32-value block
    format; the package cannot quantise to it either.)"""
    raw = random_rows(kind, n, k, np.random.default_rng(n + k))
    blocks = read(raw, kind)
    assert blocks.bits == 8 and blocks.group == group and blocks.q.dtype == torch.int8 and blocks.q.shape == (n, k)
    low, high = VALUES[kind]
    assert int(blocks.q.min()) == low and int(blocks.q.max()) == high
    assert blocks.offset.any() == (kind in ("Q2_K", "Q5_K"))  # a min per sub-block, or none
    assert torch.equal(blocks.dequantise(), oracle(raw, kind))


def test_q6_k_blocks_are_stored_and_looked_up_exactly():
    """Stored beside a conversion and read back (int8 values, a scale per 16), and as an embedding table (an untied
    Q6_K output is the head's rescoring table): the oracle's rows."""
    from fastspec.models.gguf_blocks import blocks_from_state, blocks_state
    from fastspec.models.packed_layers import BlockEmbedding

    raw = random_rows("Q6_K", 40, 256, np.random.default_rng(3))
    back = blocks_from_state(blocks_state("w", read_q6_k(raw)).__getitem__, "w")
    assert back.bits == 8 and back.group == 16 and torch.equal(back.dequantise(), oracle(raw, "Q6_K"))
    ids = torch.tensor([[3, 0, 39], [7, 7, 1]])
    assert torch.equal(BlockEmbedding(back)(ids), F.embedding(ids, oracle(raw, "Q6_K")))


def test_int4_linear_over_q4_k_equals_a_linear_over_the_oracle():
    """float32 activations: exact to float32 rounding (the kernel's zero = offset + 8 * scale is one rounding);
    bfloat16 (the fast kernel): within bfloat16's rounding of the activations and scales (~4e-3 relative here;
    2e-2 allowed)."""
    raw = random_rows("Q4_K", 48, 512, np.random.default_rng(3))  # N % 16: torch's int4 packing needs it
    weight = oracle(raw, "Q4_K")
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
    expected = F.linear(x, weight)
    torch.testing.assert_close(Int4Linear.from_blocks(read_q4_k(raw), torch.float32)(x), expected, atol=1e-4, rtol=1e-5)
    fast = Int4Linear.from_blocks(read_q4_k(raw), torch.bfloat16)(x)
    assert fast.dtype == torch.float32 and (fast - expected).abs().max() / expected.abs().max() < 2e-2


def test_rows_move_with_their_scales():
    """A row permutation and llama.cpp's rope row order undone on the blocks equal the same on the oracle."""
    raw = random_rows("Q4_K", 32, 256, np.random.default_rng(4))
    blocks, weight = read_q4_k(raw), oracle(raw, "Q4_K")
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(5))
    assert torch.equal(blocks.map_rows(lambda t: t[perm]).dequantise(), weight[perm])
    unrope = blocks.map_rows(lambda t: unpermute_rope_rows(t, HEADS))
    assert torch.equal(unrope.dequantise(), unpermute_rope_rows(weight, HEADS))


def test_malformed_q4_k_rows_are_refused():
    with pytest.raises(ValueError, match="whole super-blocks of 144 bytes .*got 145 bytes per row"):
        read_q4_k(np.zeros((2, 145), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"uint8 \[N, bytes per row\]; got int8 \[2, 144\]"):
        read_q4_k(np.zeros((2, 144), dtype=np.int8))


def test_the_dequantised_types_are_ones_the_converter_can_dequantise():
    """The packed path keeps these types' converted weights, which the gguf package's dequantiser makes."""
    assert "Q4_K" not in DEQUANTISED
    for kind in DEQUANTISED:
        qtype = gguf.GGMLQuantizationType[kind]
        values, size = gguf.GGML_QUANT_SIZES[qtype]
        assert oracle(np.zeros((2, 256 // values * size), dtype=np.uint8), kind).shape == (2, 256)
