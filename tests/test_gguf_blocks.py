"""GGUF block formats read without dequantising, checked against the `gguf` package's own dequantiser (the
independent oracle) on the embedded model's real tensors and on freshly quantised ones; the packed int4 linear
against a float32 linear over the same dequantised weight."""

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize, quantize

from fastspec.models.gguf import unpermute_rope_rows
from fastspec.models.gguf_blocks import Int4Linear, merge_rows, read_blocks


def quantised(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    data = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return quantize(data, gguf.GGMLQuantizationType[kind])


def oracle(raw: np.ndarray, kind: str) -> torch.Tensor:
    return torch.from_numpy(np.array(dequantize(raw, gguf.GGMLQuantizationType[kind]), dtype=np.float32))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_dequantise_as_gguf_does(kind):
    raw = quantised(kind, 24, 96)
    blocks = read_blocks(raw, kind)
    assert blocks.q.shape == (24, 96) and blocks.scale.shape == (24, 3)
    assert torch.equal(blocks.dequantise(), oracle(raw, kind))  # the same float32 arithmetic: bit for bit


def test_the_embedded_ggufs_tensors_read_exactly():
    from fastspec.models.embedded import DEFAULT_MODEL, find_embedded_gguf

    reader = gguf.GGUFReader(find_embedded_gguf(DEFAULT_MODEL))
    seen = set()
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind in seen or kind not in ("Q4_1", "Q8_0"):
            continue
        seen.add(kind)
        assert torch.equal(read_blocks(t.data, kind).dequantise(), oracle(t.data, kind)), t.name
    assert seen == {"Q4_1", "Q8_0"}  # the file's quantised types: every linear Q4_1, the tied embedding Q8_0


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_int4_linear_equals_a_linear_over_the_dequantised_weight(kind):
    """float32 activations: exact to float32 rounding; bfloat16 (the fast kernel): within bfloat16's rounding of
    the activations and scales (~3e-3 relative here; 2e-2 allowed)."""
    parts = [read_blocks(quantised(kind, n, 128, seed=n), kind) for n in (64, 32, 32)]  # a fused QKV's rows
    merged = merge_rows(parts)
    weight = torch.cat([p.dequantise() for p in parts])
    assert torch.equal(merged.dequantise(), weight)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    expected = F.linear(x, weight)
    exact = Int4Linear(merged, torch.float32)
    torch.testing.assert_close(exact(x), expected, atol=1e-4, rtol=1e-5)
    fast = Int4Linear(merged, torch.bfloat16)
    error = (fast(x) - expected).abs().max() / expected.abs().max()
    assert fast(x).dtype == torch.float32 and error < 2e-2


def test_rows_move_with_their_scales():
    """Undoing llama.cpp's rope row order on the blocks equals undoing it on the dequantised weight."""
    blocks = read_blocks(quantised("Q4_1", 32, 64), "Q4_1")
    moved = blocks.map_rows(lambda t: unpermute_rope_rows(t, 4))
    assert torch.equal(moved.dequantise(), unpermute_rope_rows(blocks.dequantise(), 4))


def test_a_format_or_shape_it_cannot_take_is_refused():
    with pytest.raises(ValueError, match="Q6_K is not a block format"):
        read_blocks(np.zeros((2, 210), dtype=np.uint8), "Q6_K")
    with pytest.raises(ValueError, match="N % 8 == 0"):
        Int4Linear(read_blocks(quantised("Q4_0", 6, 64), "Q4_0"))
    with pytest.raises(ValueError, match="4-bit"):
        Int4Linear(read_blocks(quantised("Q8_0", 8, 64), "Q8_0"))
