"""fastspec's row-invariant float GEMM (fastspec.kernels.cpu_row_gemm): it is the dot products to float32 rounding; a
row's outputs are bit for bit the same alone and among any others, on this CPU's build and on each lower
instruction-set level's; RowLinear eager, compiled and F.linear agree; the swap takes the float linears and keeps
a tied weight tied. Skipped where no C compiler builds the kernels."""

import functools
import platform
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastspec.kernels import cpu_library
from fastspec.kernels.cpu_row_gemm import DTYPE_CODES, RowLinear, row_gemm, row_invariant_linears

pytestmark = pytest.mark.skipif(not cpu_library.available(), reason="no C compiler builds the CPU kernels")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(96, 1536), (50, 37), (17, 100), (33, 64)]  # [N, K]: whole vectors, and tails of both N and K


def operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", SHAPES)
def test_it_is_the_dot_products_to_float32_rounding(dtype, n, k):
    x, w = operands(9, n, k, dtype)
    exact = x.double() @ w.double().T
    bound = (x.double().abs() @ w.double().abs().T) * k * 2.0 ** -23  # float32 sums of k exact products
    assert ((row_gemm(x, w).double() - exact).abs() <= bound).all()
    assert row_gemm(x[:0], w).shape == (0, n)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """build(march): the kernels built for `march`, once; None: this CPU's own build."""
    @functools.cache
    def make(march: str | None):
        if march is None:
            return cpu_library.library()
        return cpu_library.build_for(march, tmp_path_factory.mktemp(march) / "kernels.so")
    return make


def run(lib, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = torch.empty(x.shape[0], w.shape[0])
    lib.row_gemm(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), w.shape[0], DTYPE_CODES[w.dtype], y.data_ptr())
    return y


def flags() -> str:
    return Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""


MARCHES = [None]
if platform.machine() == "x86_64" and " avx2" in flags():
    MARCHES += ["x86-64-v3", "x86-64"]  # AVX2 + FMA, portable C
if platform.machine() == "x86_64" and " avx512bf16" in flags():
    MARCHES += ["x86-64-v4"]  # AVX-512 widening bfloat16 to float32 (this CPU's build takes VDPBF16PS)


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", [(96, 1536), (17, 100)])
def test_a_row_is_the_same_alone_and_among_others(build, march, dtype, n, k):
    """Every row of 1 to 40 rows at any offset: what the row computes alone, bit for bit (torch's float32 GEMM fails
    this for 1 to 3 rows, its bfloat16 one at [576, 1536] on EPYC: bench/bench_row_gemm.py)."""
    lib = build(march)
    x, w = operands(40, n, k, dtype, seed=n)
    whole = run(lib, x, w)
    torch.testing.assert_close(whole, row_gemm(x, w), atol=1e-3 * k ** 0.5, rtol=1e-3)  # each build is the product
    alone = torch.cat([run(lib, x[i:i + 1], w) for i in range(40)])
    assert torch.equal(whole, alone)
    for m in (2, 3, 5, 7, 13, 17, 30):
        for start in (0, 3, 40 - m):
            assert torch.equal(run(lib, x[start:start + m], w), alone[start:start + m])


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_linear_eager_compiled_and_f_linear_agree(dtype):
    linear = nn.Linear(100, 50, bias=True).to(dtype)
    module = RowLinear(linear)
    x = torch.randn(2, 7, 100).to(dtype)
    eager = module(x)
    assert eager.dtype == dtype and eager.shape == (2, 7, 50)
    assert torch.equal(torch.compile(module, fullgraph=True, dynamic=False)(x), eager)
    torch.testing.assert_close(eager, F.linear(x, linear.weight, linear.bias), atol=0.05, rtol=0.02)  # two roundings


def test_the_swap_takes_the_float_linears_and_keeps_a_tied_weight_tied():
    model = nn.ModuleDict({"a": nn.Linear(8, 16), "inner": nn.ModuleDict({"b": nn.Linear(16, 8)}),
                           "wide": nn.Linear(8, 8), "table": nn.Embedding(16, 8)}).to(torch.bfloat16)
    model["wide"].float()
    model["head"] = nn.Linear(8, 16, bias=False).to(torch.bfloat16)
    model["head"].weight = model["table"].weight
    model["fp8"] = nn.Linear(8, 8).to(torch.float8_e4m3fn)
    row_invariant_linears(model)
    assert type(model["a"]) is type(model["inner"]["b"]) is type(model["head"]) is type(model["wide"]) is RowLinear
    assert type(model["fp8"]) is nn.Linear  # no float the kernel reads
    assert model["head"].weight is model["table"].weight


def test_without_the_library_each_is_its_twin(monkeypatch):
    from fastspec.kernels.cpu_row_gemm import row_dots

    x, w = operands(5, 17, 100, torch.float32)
    rows = torch.randn(5, 3, 100, generator=torch.Generator().manual_seed(1))
    fast, fast_dots = row_gemm(x, w), row_dots(x, rows)
    assert torch.equal(fast_dots, torch.stack([row_gemm(x[i:i + 1], rows[i])[0] for i in range(5)]))  # row_gemm's sums
    monkeypatch.setattr(cpu_library, "library", lambda: None)
    torch.testing.assert_close(row_gemm(x, w), fast, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(row_dots(x, rows), fast_dots, atol=1e-4, rtol=1e-5)


def test_bf16_dot_is_read_from_the_cpus_flags(monkeypatch):
    """--dtype auto's rule on the CPU (a bfloat16 checkpoint stays bfloat16 where the CPU has AVX512-BF16): the
    flags line of /proc/cpuinfo, and only with the library built."""
    monkeypatch.setattr(cpu_library, "_cpu_signature", lambda: "x86_64model name : X\nflags : fpu avx2 avx512_bf16 x")
    assert cpu_library.has_bf16_dot() == cpu_library.available()
    monkeypatch.setattr(cpu_library, "_cpu_signature", lambda: "x86_64model name : avx512_bf16\nflags : fpu avx2")
    assert not cpu_library.has_bf16_dot()
