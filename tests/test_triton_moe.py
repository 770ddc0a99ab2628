"""The expert-indexed byte GEMM (fastspec.kernels.triton_moe) in Triton's interpreter (TRITON_INTERPRET=1, set by
conftest; compiled on a GPU) against its torch twin and against a float64 product of each pair's expert dequantised
on its own; and the `gpu` checks that compile it for real."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from fastspec.kernels import triton_moe as tm  # noqa: E402
from fastspec.kernels import triton_quant as tq  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, interpreted on CPU


def stacked(fmt: int, E: int, n: int, k: int, cols: int, seed: int):
    """(w, scale, offset) of E experts [E, n, k] in `fmt` with a scale (and for the integer codes an offset) per
    row and `cols` inputs (the last scale column partial where cols does not divide k)."""
    gen = torch.Generator().manual_seed(seed)
    if fmt == tq.E4M3:
        w = (torch.randn(E, n, k, generator=gen) * 20).to(torch.float8_e4m3fn).view(torch.uint8)
    elif fmt == tq.INT8:
        w = torch.randint(-128, 128, (E, n, k), generator=gen, dtype=torch.int8).view(torch.uint8)
    else:
        w = torch.randint(0, 256, (E, n, k // 2), generator=gen, dtype=torch.uint8)
    groups = -(-k // cols)
    scale = torch.rand(E, n, groups, generator=gen)
    offset = None if fmt == tq.E4M3 else torch.randn(E, n, groups, generator=gen)
    return w, scale, offset


def dequantised(w, scale, offset, e: int, cols: int, fmt: int) -> torch.Tensor:
    """Expert e's weights [n, k] in float64, decoded value by value from the stored bytes."""
    b = w[e]
    if fmt == tq.E4M3:
        v = b.view(torch.float8_e4m3fn).double()
    elif fmt == tq.INT8:
        v = b.view(torch.int8).double()
    else:  # input 2j in the low nibble, 2j + 1 in the high one
        v = torch.empty(b.shape[0], 2 * b.shape[1], dtype=torch.float64)
        v[:, 0::2], v[:, 1::2] = (b & 15).double(), (b >> 4).double()
    col = torch.arange(v.shape[1]) // cols
    weight = v * scale[e].double()[:, col]
    return weight if offset is None else weight + offset[e].double()[:, col]


# pairs over 3 rows of 5 experts: expert 3 chosen by none, expert 4 twice for row 0, row 2 read by one pair
ROWS, EXPERTS = torch.tensor([0, 0, 1, 1, 2, 0]), torch.tensor([4, 4, 0, 1, 2, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fmt", [tq.E4M3, tq.INT8, tq.UINT4])
@pytest.mark.parametrize("n, k, cols", [(64, 128, 128), (72, 96, 32), (40, 96, 64), (17, 48, 16)])
def test_kernel_equals_its_twin_and_each_experts_own_product(fmt, n, k, cols, dtype):
    """Partial output tiles (N = 72, 40, 17 against tiles of 64), a partial last scale column (K = 96 over columns
    of 64), several scale columns, float16 activations (read as float32 in both)."""
    w, scale, offset = stacked(fmt, 5, n, k, cols, seed=n * k + fmt)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(n)).to(dtype)
    twin = tm.expert_matmul_twin(x, ROWS, EXPERTS, w, scale, offset, cols, fmt)
    args = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in (x, ROWS, EXPERTS, w, scale, offset)]
    got = tm.expert_matmul(*args, cols, fmt).cpu()
    want = torch.stack([dequantised(w, scale, offset, e, cols, fmt) @ x[r].double()
                        for r, e in zip(ROWS.tolist(), EXPERTS.tolist())])
    tol = dict(atol=1e-5 * want.abs().max().item(), rtol=1e-5)
    torch.testing.assert_close(twin.double(), want, **tol)
    torch.testing.assert_close(got.double(), want, **tol)
    assert torch.equal(got[0], got[1])  # the same expert twice for one row: the same outputs


@pytest.mark.parametrize("fmt", [tq.E4M3, tq.UINT4])
def test_an_unchosen_expert_is_never_read(fmt):
    """Expert 3 (chosen by no pair) poisoned with NaN scales and offsets: no output sees them."""
    w, scale, offset = stacked(fmt, 5, 40, 64, 32, seed=7)
    x = torch.randn(3, 64)
    clean = tm.expert_matmul(x, ROWS, EXPERTS, w, scale, offset, 32, fmt)
    scale[3] = float("nan")
    if offset is not None:
        offset[3] = float("nan")
    assert torch.equal(tm.expert_matmul(x, ROWS, EXPERTS, w, scale, offset, 32, fmt), clean)
    assert not tm.expert_matmul_twin(x, ROWS, EXPERTS, w, scale, offset, 32, fmt).isnan().any()


def test_no_pairs_is_an_empty_product():
    w, scale, offset = stacked(tq.INT8, 2, 16, 32, 16, seed=1)
    none = torch.zeros(0, dtype=torch.long)
    assert tm.expert_matmul(torch.randn(1, 32), none, none, w, scale, offset, 16, tq.INT8).shape == (0, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [tq.E4M3, tq.INT8, tq.UINT4])
def test_the_compiled_kernel_is_captured_in_a_cuda_graph(fmt):
    """Compiled on the GPU at a Qwen3-30B-A3B decode step's shape (128 experts, top 8, gate_up 1536 x 2048): a
    graph captured once and replayed with other experts chosen computes what the twin does for them."""
    E, n, k, cols = 128, 1536, 2048, 128
    w, scale, offset = (t if t is None else t.cuda() for t in stacked(fmt, E, n, k, cols, seed=fmt))
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    rows, experts = torch.zeros(8, dtype=torch.long, device="cuda"), torch.arange(8, device="cuda")
    call = lambda: torch.ops.fastspec.expert_byte_matmul(x, rows, experts, w, scale, offset, cols, fmt)  # noqa: E731
    call()  # compile before capturing
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = call()
    experts.copy_(torch.randperm(E, device="cuda")[:8])
    graph.replay()
    want = tm.expert_matmul_twin(x, rows, experts, w, scale, offset, cols, fmt)
    torch.testing.assert_close(y, want, atol=1e-4 * want.abs().max().item(), rtol=1e-4)
