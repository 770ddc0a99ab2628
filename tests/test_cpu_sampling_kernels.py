"""The C library's sampling-side kernels (fastspec.kernels.cpu_fused: top_k, argmax, the lm_head's exact rescoring)
against torch. Skipped where no C compiler builds them."""

import pytest
import torch

from fastspec.kernels import cpu_fused

pytestmark = pytest.mark.skipif(not cpu_fused.available(), reason="no C compiler for the fused CPU kernels")


def test_top_k_is_the_set_torch_topk_picks():
    """Per row the set of torch.topk's indices (distinct values: no ties to break), over a whole vocabulary, a row
    slice of a wider tensor and k = the row length; NaNs are never taken while numbers are left."""
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(3, 49200, generator=g)
    for x, k in ((wide[:, :49152], 16), (wide[:1, :40], 40), (torch.randn(4, 100, generator=g), 7)):
        got = cpu_fused.top_k(x, k)
        assert got.shape == (x.shape[0], k)
        assert all(set(a.tolist()) == set(b.tolist()) for a, b in zip(got, x.topk(k, -1).indices))
    x = torch.tensor([[0.5, float("nan"), 2.0, -1.0, 3.0]])
    assert set(cpu_fused.top_k(x, 3)[0].tolist()) == {0, 2, 4}
    assert set(cpu_fused.top_k(x, 5)[0].tolist()) == {0, 1, 2, 3, 4}


def test_top_k_passes_over_runs_of_smaller_values_but_not_a_larger_one():
    """Once its heap is full the kernel passes over runs of 16 values none of which beats the smallest kept: a
    rising row (every run holds a larger value), one larger value deep in a run, NaNs in runs, and ties (the lower
    index kept)."""
    rising = torch.arange(1000, dtype=torch.float32)[None]
    assert set(cpu_fused.top_k(rising, 16)[0].tolist()) == set(range(984, 1000))
    x = torch.zeros(2, 1000)
    x[0, 735], x[0, 100:116], x[1, 500:] = 5.0, float("nan"), 1.0  # 735: the last value of a run
    assert set(cpu_fused.top_k(x[:1], 1)[0].tolist()) == {735}
    assert set(cpu_fused.top_k(x[1:], 16)[0].tolist()) == set(range(500, 516))


def test_argmax_is_torch_argmax():
    """The first of equal maxima, the first NaN where a row has one (as torch's), -inf rows, row slices of a wider
    tensor."""
    g = torch.Generator().manual_seed(6)
    wide = torch.randn(5, 49200, generator=g)
    wide[1, 7] = wide[1, 40000] = 9.0  # a tie: the first
    wide[2, 30000], wide[2, 40000] = float("nan"), float("nan")
    wide[3] = float("-inf")
    wide[4, :100] = float("-inf")
    for x in (wide, wide[:, :49152], wide[:, 5:], torch.tensor([[1.0]])):
        assert torch.equal(cpu_fused.argmax(x), x.argmax(-1))


def test_rescore_dots_the_dequantised_table_rows():
    g = torch.Generator().manual_seed(7)
    q = torch.randint(-128, 128, (50, 64), dtype=torch.int8, generator=g)
    scale, offset = torch.rand(50, 2, generator=g) * 0.1, torch.randn(50, 2, generator=g) * 0.1
    ids, x = torch.randint(0, 50, (3, 16), generator=g), torch.randn(3, 64, generator=g)
    got = cpu_fused.rescore(q, scale, offset, ids, x)
    if got is None:
        pytest.skip("no C compiler for the CPU kernels")
    rows = (q.float().view(50, 2, 32) * scale[..., None] + offset[..., None]).view(50, 64)
    torch.testing.assert_close(got, torch.einsum("mkh,mh->mk", rows[ids], x), atol=1e-4, rtol=1e-5)
