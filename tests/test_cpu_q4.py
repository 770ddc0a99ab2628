"""The int16 x 4- / 5- / 6- / 8-bit CPU GEMMs (fastspec.kernels.cpu_q4, BlockLinear): the C kernels against their
torch twin, the twin against the exact product over the `gguf` package's dequantised weights (within the
activations' int16 rounding), the layouts against the values they hold, each instruction-set path of the C source
built explicitly, and the module in a model."""

import ctypes
import functools
import platform
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from test_gguf_kquants import random_rows

from fastspec.kernels import cpu_library, cpu_q4
from fastspec.models.gguf_blocks import Blocks, as_8bit_16, merge_rows, read_blocks
from fastspec.models.gguf_kquants import READERS, read, read_q6_k
from fastspec.models.activation_choice import fast_activation
from fastspec.models.packed_layers import BlockLinear, int4_linear

needs_library = pytest.mark.skipif(not cpu_library.available(), reason="no C compiler for the CPU kernels")


def q4_blocks(kind: str, n: int, k: int, seed: int = 0):
    """(Blocks of a random weight quantised by the gguf package as `kind`, its raw rows)."""
    data = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).numpy()
    raw = quantize(data, gguf.GGMLQuantizationType[kind])
    return read_blocks(raw, kind), raw


WIDTHS = [(4, 32), (5, 16), (5, 32), (6, 16), (6, 32), (8, 16), (8, 32)]  # (bits, values per scale) the kernels take


def blocks_of(bits: int, n: int, k: int, seed: int = 0, group: int = 16) -> Blocks:
    """A weight the `bits`-bit kernel takes: 4 a Q4_1 one; 5 / 6 random values of that width with random scales and
    offsets per `group`; 8 per 16 a Q4_1 one as int8 values per 16 (as_8bit_16), per 32 random int8 values (the full
    range) with random scales and offsets."""
    if bits in (5, 6) or (bits, group) == (8, 32):
        gen = torch.Generator().manual_seed(seed)
        low, high = (-128, 128) if bits == 8 else (0, 1 << bits)
        q = torch.randint(low, high, (n, k), dtype=torch.int8 if bits == 8 else torch.uint8, generator=gen)
        return Blocks(q, torch.rand(n, k // group, generator=gen) * 0.01,
                      torch.randn(n, k // group, generator=gen) * 0.01, bits)
    blocks = q4_blocks("Q4_1", n, k, seed)[0]
    return blocks if bits == 4 else as_8bit_16(blocks)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_the_twin_is_the_exact_product_within_the_activations_rounding(kind):
    """Against ggml's own dequantised weight (the gguf package): y = x16 @ (q scale).T + x @ offset.T, x16 x rounded
    to the nearest of 65535 levels spanning +-max |x| of its group (numpy: x * (32767 / max |x|) rounded in float32,
    as the kernel does), so within half a level of each group's inputs of the exact x @ w.T (the offset's term takes
    the unrounded x), and that rounding shows."""
    blocks, raw = q4_blocks(kind, 32, 128, seed=1)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2))
    weight = torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType[kind])).double()  # [N, K]
    offset = blocks.offset.double().repeat_interleave(32, -1)  # [N, K]
    groups = x.numpy().reshape(5, 4, 32)
    amax = np.abs(groups).max(-1, keepdims=True)  # float32 [5, 4, 1]
    levels = np.rint(groups * (np.float32(32767) / amax)).astype(np.float64)
    step = amax.astype(np.float64) / 32767
    rounded = torch.from_numpy((levels * step).reshape(5, 128))
    expected = rounded @ (weight - offset).T + x.double() @ offset.T
    got = cpu_q4.matmul_twin(x, *cpu_q4.pack(blocks.q, blocks.scale, blocks.offset)).double()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)
    exact = x.double() @ weight.T
    bound = (weight - offset).abs() @ torch.from_numpy(np.repeat(step / 2, 32, -1).reshape(5, 128)).T  # [N, 5]
    assert ((got - exact).abs() <= bound.T + 1e-4).all()
    assert (got - exact).abs().max() > 1e-6  # the rounding of x shows (the test could fail)


def test_the_8bit_twin_is_the_exact_product_within_the_activations_rounding():
    """8-bit blocks with a scale and an offset per 16 (random Q6_K rows: int8 values, offset 0; merged with 4-bit
    Q4_1 rows, whose groups become two of 16): the twin is x16 @ (q scale).T + x @ offset.T against the dequantised
    weight (its scales in float16, as the kernels keep them), as for 4-bit."""
    q6 = read_q6_k(random_rows("Q6_K", 16, 256, np.random.default_rng(7)))
    merged = merge_rows([q6, q4_blocks("Q4_1", 16, 256, seed=8)[0]])
    assert merged.bits == 8 and merged.group == 16
    # the kernels keep scales and offsets as float16 (Q6_K's d * sc is not always one: a rounding of 2^-11 at most)
    half = Blocks(merged.q, merged.scale.half().float(), merged.offset.half().float(), 8)
    weight, offset = half.dequantise().double(), half.offset.double().repeat_interleave(16, -1)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(9))
    groups = x.numpy().reshape(3, 8, 32)
    amax = np.abs(groups).max(-1, keepdims=True)
    levels = np.rint(groups * (np.float32(32767) / amax)).astype(np.float64)
    rounded = torch.from_numpy((levels * (amax.astype(np.float64) / 32767)).reshape(3, 256))
    expected = rounded @ (weight - offset).T + x.double() @ offset.T
    got = cpu_q4.matmul_twin(x, *cpu_q4.pack(merged.q, merged.scale, merged.offset, 8))
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("bits, group", [w for w in WIDTHS if w[0] in (5, 6) or w == (8, 32)])
def test_the_plane_layout_holds_the_values_and_the_twin_their_product(bits, group):
    """A 5- / 6-bit weight packed (low nibbles, then bit planes) with scales per 16 or 32, and an 8-bit one with
    scales per 32 (its bytes laid out per 16 inputs as ever), unpacks to its values, scales and offsets (as
    float16), and the twin is the exact product over them within the activations' int16 rounding (4e-4 here)."""
    blocks = blocks_of(bits, 48, 256, seed=bits, group=group)
    packed, scales = cpu_q4.pack(blocks.q, blocks.scale, blocks.offset, bits)
    assert cpu_q4.bits(packed) == bits
    assert packed.shape == ((3, 16, 256) if bits == 8 else (3, 8, 256 + 64 * (bits - 4)))
    assert cpu_q4.weight_group(packed, scales) == group
    q, scale, offset = cpu_q4.unpack(packed, scales)
    assert torch.equal(q, blocks.q.float()) and torch.equal(scale, blocks.scale.half().float())
    assert torch.equal(offset, blocks.offset.half().float())
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    exact = x @ Blocks(blocks.q, scale, offset, bits).dequantise().T
    torch.testing.assert_close(cpu_q4.matmul_twin(x, packed, scales), exact, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("kind, bits", [("Q5_0", 5), ("Q5_1", 5), ("Q5_K", 5), ("Q3_K", 5), ("Q2_K", 5), ("Q6_K", 6),
                                        ("Q8_0", 8), ("IQ4_XS", 8)])
@pytest.mark.parametrize("per_16", [True, False])
def test_narrow_takes_the_fewest_bits_and_keeps_the_weight(kind, bits, per_16):
    """Each 8-bit GGUF type, with its own scale groups or as groups of 16, as the fewest bits its values need (a
    signed group lifted by 2^(bits-1), its zero offset lowered by as much times its scale: exact), the dequantised
    weight unchanged bit for bit; BlockLinear packs the 5-bit types of 32 (Q5_0 / Q5_1 / Q5_K) with their scales
    per 32, and Q8_0 as 8 bits per 32."""
    raw = random_rows(kind, 16, 256, np.random.default_rng(0))
    blocks = as_8bit_16(read(raw, kind)) if per_16 else read(raw, kind)
    q, scale, offset, width = cpu_q4.narrow(blocks.q, blocks.scale, blocks.offset)
    assert width == bits and q.dtype == (torch.int8 if bits == 8 else torch.uint8)
    assert torch.equal(Blocks(q, scale, offset, width).dequantise(), blocks.dequantise())
    if not per_16 and (kind.startswith("Q5") or kind == "Q8_0"):
        packed, scales = BlockLinear.pack(blocks)
        assert cpu_q4.bits(packed) == bits and cpu_q4.weight_group(packed, scales) == 32


def test_a_q4_k_group_beside_q6_k_ones_keeps_its_offset():
    """A fused QKV of Q4_K and Q6_K rows needs 6 bits; the Q4_K groups (no negative values) are not lifted."""
    rng = np.random.default_rng(1)
    mixed = merge_rows([READERS[kind](random_rows(kind, 16, 256, rng)) for kind in ("Q4_K", "Q6_K")])
    q, scale, offset, width = cpu_q4.narrow(mixed.q, mixed.scale, mixed.offset)
    assert width == 6 and torch.equal(offset[:16], mixed.offset[:16])
    assert torch.equal(Blocks(q, scale, offset, width).dequantise()[:16], mixed.dequantise()[:16])


@needs_library
@pytest.mark.parametrize("bits, group", WIDTHS)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 20])
def test_the_kernel_is_its_twin(rows, bits, group):
    """Every row count (the kernels unroll up to 8 rows a pass), tiles split between threads or not, every width and
    scale group: the twin's numbers to float32 rounding (the integer sums are exact; the per-group float sums run in
    another order)."""
    blocks = blocks_of(bits, 96, 576, seed=rows, group=group)
    packed = cpu_q4.pack(blocks.q, blocks.scale, blocks.offset, bits)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(3)) * 3
    torch.testing.assert_close(cpu_q4.matmul(x, *packed), cpu_q4.matmul_twin(x, *packed), atol=1e-4, rtol=1e-5)
    assert torch.equal(cpu_q4.matmul(torch.zeros(rows, 576), *packed), torch.zeros(rows, 96))


@needs_library
@pytest.mark.parametrize("bits, group", WIDTHS)
def test_a_row_gets_what_it_gets_alone_on_either_side_of_a_row_block(bits, group):
    """Rows go through every tile 256 at a time (their int16 copy stays in cache); each row's product is still, bit
    for bit, the one it gets alone (a 300-token prefill's rows are its decode steps' ones)."""
    blocks = blocks_of(bits, 48, 256, seed=5, group=group)
    packed = cpu_q4.pack(blocks.q, blocks.scale, blocks.offset, bits)
    x = torch.randn(300, 256, generator=torch.Generator().manual_seed(6))
    y = cpu_q4.matmul(x, *packed)
    for r in (0, 255, 256, 299):
        assert torch.equal(y[r], cpu_q4.matmul(x[r:r + 1], *packed)[0]), r


@pytest.fixture
def amx():
    """The AMX kernel turned on (skipped without AMX tiles), back to its default after the test."""
    lib = cpu_library.library()
    if not lib.amx_q4_enable(1):
        pytest.skip("no AMX tiles on this CPU (or the kernel refused them)")
    yield lib
    lib.amx_q4_enable(1)


@needs_library
@pytest.mark.parametrize("rows", [16, 40, 64, 300])
def test_amx_tiles_give_the_vnni_kernel_bit_for_bit(amx, rows):
    """From 16 rows the 4-bit product runs on AMX tiles (int16 activations as two exact bfloat16 halves, the same
    float epilogue): the same numbers as the VNNI kernel, so a row's output still does not depend on the row count
    (test_the_kernel_is_its_twin's 20 rows hold the twin against it)."""
    blocks = blocks_of(4, 96, 1536, seed=rows)
    packed = cpu_q4.pack(blocks.q, blocks.scale, blocks.offset, 4)
    x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(rows)) * 5
    x[rows // 2, :64] = 0  # a group of zeros, a row of others with one huge value
    x[-1, 100] = 1e4
    on = cpu_q4.matmul(x, *packed)
    assert cpu_q4.amx() and "AMX tiles" in BlockLinear(*packed).gemm_kernel  # what bench --profile names
    amx.amx_q4_enable(0)
    assert torch.equal(on, cpu_q4.matmul(x, *packed))
    assert "AMX" not in BlockLinear(*packed).gemm_kernel


@pytest.fixture(scope="module")
def build_path(tmp_path_factory):
    """build_path(march): the kernels built for `march` (an instruction-set level below this CPU's own), once."""
    @functools.cache
    def build(march: str) -> ctypes.CDLL:
        return cpu_library.build_for(march, tmp_path_factory.mktemp(march) / "kernels.so")
    return build


@needs_library
@pytest.mark.skipif(platform.machine() != "x86_64" or "avx2" not in Path("/proc/cpuinfo").read_text(),
                    reason="an x86-64 CPU with AVX2 runs both lower paths")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])  # the AVX2 path, the portable C one
@pytest.mark.parametrize("bits, group", WIDTHS)
def test_each_instruction_set_path_is_the_twin(build_path, march, bits, group):
    lib = build_path(march)
    blocks = blocks_of(bits, 48, 96, seed=4, group=group)
    packed, scales = cpu_q4.pack(blocks.q, blocks.scale, blocks.offset, bits)
    for rows in (1, 5, 11):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
        y = torch.empty(rows, 48)
        assert lib.block_gemm(x.data_ptr(), rows, 96, packed.data_ptr(), scales.data_ptr(), 48, y.data_ptr(), bits,
                              group, None) == 0
        torch.testing.assert_close(y, cpu_q4.matmul_twin(x, packed, scales), atol=1e-4, rtol=1e-5)


def iq4_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(packed, scales, levels) of random IQ4_NL rows as BlockLinear packs them: 4-bit indices into 16 levels."""
    blocks = read_blocks(random_rows("IQ4_NL", n, k, np.random.default_rng(seed)), "IQ4_NL")
    packed = BlockLinear.pack(blocks)
    assert len(packed) == 3 and cpu_q4.bits(packed[0]) == 4
    return packed


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_indexed_levels_are_the_weight_and_the_kernel_is_its_twin(rows):
    """IQ4_NL's 16 int8 levels, indexed by nibbles: unpacked, the weight itself; the kernel (where built) its twin."""
    packed = iq4_weight(48, 256, seed=rows)
    blocks = read_blocks(random_rows("IQ4_NL", 48, 256, np.random.default_rng(rows)), "IQ4_NL")
    q, scale, offset = cpu_q4.unpack(*packed)
    assert torch.equal(q, blocks.q.float()) and not offset.any()
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    torch.testing.assert_close(cpu_q4.matmul(x, *packed), cpu_q4.matmul_twin(x, *packed), atol=1e-4, rtol=1e-5)


@needs_library
@pytest.mark.skipif(platform.machine() != "x86_64" or "avx2" not in Path("/proc/cpuinfo").read_text(),
                    reason="an x86-64 CPU with AVX2 runs both lower paths")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_each_instruction_set_path_indexes_levels_as_the_twin(build_path, march):
    lib = build_path(march)
    packed, scales, levels = iq4_weight(48, 96, seed=4)
    for rows in (1, 5, 11):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
        y = torch.empty(rows, 48)
        assert lib.block_gemm(x.data_ptr(), rows, 96, packed.data_ptr(), scales.data_ptr(), 48, y.data_ptr(), 4, 32,
                              levels.data_ptr()) == 0
        torch.testing.assert_close(y, cpu_q4.matmul_twin(x, packed, scales, levels), atol=1e-4, rtol=1e-5)


def test_pack_refuses_what_the_kernel_cannot_take():
    blocks, _ = q4_blocks("Q4_1", 24, 64)
    with pytest.raises(ValueError, match="N % 16 == 0"):
        cpu_q4.pack(blocks.q, blocks.scale, blocks.offset)
    blocks, _ = q4_blocks("Q4_1", 16, 64)
    with pytest.raises(ValueError, match="float16"):
        cpu_q4.pack(blocks.q, blocks.scale * 1e6, blocks.offset)


def test_q4_linear_keeps_the_input_dtype_and_compiles_as_an_opaque_op():
    blocks, _ = q4_blocks("Q4_1", 32, 64, seed=5)
    linear = int4_linear(blocks, torch.int16)
    assert isinstance(linear, BlockLinear) and (linear.out_features, linear.in_features) == (32, 64)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(6))
    y = linear(x)
    assert y.shape == (2, 3, 32) and y.dtype == torch.float32
    assert linear(x.bfloat16()).dtype == torch.bfloat16
    compiled = torch.compile(linear, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x), y, atol=1e-5, rtol=1e-5)


def test_the_fast_activation_is_one_the_kernels_take():
    assert fast_activation() in ((torch.int16, torch.bfloat16, torch.float32) if cpu_library.available()
                                 else (torch.bfloat16, torch.float32))
