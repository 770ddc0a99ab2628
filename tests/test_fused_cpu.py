"""The fused CPU kernels (fastspec.kernels.cpu_fused) against their torch twins, one by one and as a packed model's
layer stack (fastspec.models.fused_cpu) against its layers. Skipped where no C compiler builds them."""

import platform
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fastspec.attention import AttentionContext, TorchAttnBackend, decode_metadata, extend_metadata
from fastspec.attention.paged import PagedAttnBackend, paged_block_plan
from fastspec.kernels import cpu_fused, cpu_library
from fastspec.memory.kv_pool import KVPool, as_cache

pytestmark = pytest.mark.skipif(not cpu_fused.available(), reason="no C compiler for the fused CPU kernels")
HQ, HKV, D = 6, 2, 16


@pytest.fixture(scope="module")
def avx2_library(tmp_path_factory):
    """The kernels built for x86-64-v3 (AVX2: 8-float vectors where this CPU's own build may take 16), or a skip."""
    if platform.machine() != "x86_64" or "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("an x86-64 CPU with AVX2 runs the AVX2 build")
    return cpu_library.build_for("x86-64-v3", tmp_path_factory.mktemp("avx2") / "cpu_fused.so")


@pytest.fixture(params=["native", "avx2"])
def build(request, monkeypatch):
    """Each attention test on this CPU's own build and on the AVX2 one."""
    if request.param == "avx2":
        monkeypatch.setattr(cpu_library, "library", lambda: request.getfixturevalue("avx2_library"))
    return request.param


@pytest.fixture
def twin(monkeypatch):
    """Run a cpu_fused function as its torch twin: twin(fn, *args)."""
    def run(fn, *args):
        with monkeypatch.context() as m:
            m.setattr(cpu_library, "library", lambda: None)
            return fn(*args)
    return run


def close(actual, expected, dtype):
    """float32: to float32 rounding (sums in another order); 16 / 8 bits: within one step of each other."""
    tol = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=2 ** -7),
           torch.float16: dict(atol=1e-3, rtol=2 ** -10), torch.float8_e4m3fn: dict(atol=2 ** -9, rtol=2 ** -3),
           torch.float8_e5m2: dict(atol=2 ** -16, rtol=2 ** -2)}[dtype]
    assert actual.dtype == expected.dtype == dtype
    torch.testing.assert_close(actual.float(), expected.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_and_silu_mul_are_their_twins(twin, dtype):
    g = torch.Generator().manual_seed(0)
    x, y, w = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g).to(dtype), torch.rand(64, generator=g)
    for addend in (y, None):
        fused, expected = cpu_fused.add_rms_norm(x, addend, w, 1e-5, dtype), twin(cpu_fused.add_rms_norm, x, addend,
                                                                                 w, 1e-5, dtype)
        close(fused[0], expected[0], torch.float32)
        close(fused[1], expected[1], dtype)
    gate_up = (torch.randn(3, 2 * 40, generator=g) * 4).to(dtype)
    close(cpu_fused.silu_mul(gate_up, dtype), twin(cpu_fused.silu_mul, gate_up, dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_norms_norm_q_and_k_heads_and_leave_v(twin, dtype):
    """Qwen3's q / k norms: each q head by RMSNorm with q's weight, each k head with k's, v untouched, in place; and
    the same as the model's RMSNorm module over [T, heads, D]."""
    from fastspec.models.layers import RMSNorm

    g = torch.Generator().manual_seed(2)
    qkv = (torch.randn(3, (HQ + 2 * HKV) * D, generator=g) * 3).to(dtype)
    qw, kw = torch.rand(D, generator=g) + 0.5, torch.rand(D, generator=g) + 0.5
    fused, expected = qkv.clone(), qkv.clone()
    assert cpu_fused.head_norms(fused, qw, kw, HQ, HKV, 1e-6).data_ptr() == fused.data_ptr()
    twin(cpu_fused.head_norms, expected, qw, kw, HQ, HKV, 1e-6)
    close(fused, expected, dtype)
    assert torch.equal(fused[:, (HQ + HKV) * D:], qkv[:, (HQ + HKV) * D:])
    if dtype == torch.float32:
        norm = RMSNorm(D, 1e-6)
        with torch.no_grad():
            norm.weight.copy_(qw)
            close(fused[:, :HQ * D], norm(qkv[:, :HQ * D].view(3, HQ, D)).flatten(1), dtype)


@pytest.mark.parametrize("dtype, kv, mul", [(torch.float32, torch.float32, (1.0, 1.0)),
                                            (torch.bfloat16, torch.float32, (1.0, 1.0)),
                                            (torch.float32, torch.bfloat16, (1.0, 1.0)),
                                            (torch.float32, torch.float16, (1.0, 1.0)),
                                            (torch.float32, torch.float8_e4m3fn, (1.0, 1.0)),
                                            (torch.bfloat16, torch.float8_e5m2, (1.0, 1.0)),
                                            (torch.float32, torch.float8_e4m3fn, (1 / 0.003, 1 / 7.0))])
def test_rope_write_rotates_q_and_k_and_writes_only_the_named_slots(twin, dtype, kv, mul):
    """kv: the cache's dtype, which K and V are rounded to as they are written; mul: what they are multiplied by
    first (1 / a checkpoint's KV scales)."""
    from fastspec.models.rope import RotaryEmbedding

    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(4, (HQ + 2 * HKV) * D, generator=g).to(dtype)
    rope = RotaryEmbedding(SimpleNamespace(head_dim=D, partial_rotary_factor=1.0, rope_theta=1e4, rope_scaling=None))
    cos, sin = rope.cos_sin(torch.tensor([0, 5, 6, 40]), torch.float32)
    slots = torch.tensor([3, 9, 1, 7])
    caches = [[torch.zeros(12, HKV, D, dtype=kv), torch.zeros(12, HKV, D, dtype=kv)] for _ in range(2)]
    q = cpu_fused.rope_write(qkv, cos, sin, slots, *caches[0], HQ, mul)
    expected = twin(cpu_fused.rope_write, qkv, cos, sin, slots, *caches[1], HQ, mul)
    close(q, expected, torch.float32)
    assert torch.equal(caches[0][1].view(torch.uint8), caches[1][1].view(torch.uint8))  # V rounded the same way
    v = qkv[:, (HQ + HKV) * D:].float().view(4, HKV, D)
    assert torch.equal(caches[0][1][slots].view(torch.uint8), as_cache(v * mul[1], kv).view(torch.uint8))
    for fused, reference in zip(*caches):
        close(fused, reference, kv)
        assert fused[[0, 2, 4, 5, 6, 8, 10, 11]].float().abs().sum() == 0


def test_loading_the_kernels_keeps_subnormal_floats():
    """Built with -ffast-math but not linked with it: no flush-to-zero set for the whole process on load."""
    assert cpu_fused.available()
    assert torch.tensor([1e-38]).div(1e3).item() != 0.0


TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)  # node 3 skips node 1


def plans(long: bool = False):
    """Dense plans of every shape the engine hands attention: a decode (no mask), a prefill of two requests of
    different lengths after a cached prefix (causal, padded), and a paged tree verify's dense twin. `long`: contexts
    of several of the kernel's key chunks (a prefill past its token slab; a tree straddling a chunk's end)."""
    width = 320 if long else 32
    table = torch.arange(1, 2 * width + 1, dtype=torch.int32).view(2, width)
    rows = torch.tensor([0, 1])
    torch_backend = TorchAttnBackend()
    decode = torch_backend.plan(decode_metadata(table, rows, torch.tensor([300, 129] if long else [7, 12])))
    prefill = torch_backend.plan(extend_metadata(table, rows, torch.tensor([200, 0] if long else [2, 0]),
                                                 torch.tensor([40, 60] if long else [3, 5])))
    paged = paged_block_plan(table, rows, torch.tensor([126, 260] if long else [4, 9]),
                             table[rows, width - 12:width - 8].long(), TREE.expand(2, 4, 4))
    return {"decode": (decode, 2), "prefill": (prefill, 100 if long else 8),
            "tree verify": (PagedAttnBackend().dense(paged), 8)}


@pytest.mark.parametrize("name", ["decode", "prefill", "tree verify"])
@pytest.mark.parametrize("dtype, long, dim, kv, out_mul", [(torch.float32, False, D, torch.float32, 1.0),
                                                           (torch.bfloat16, False, D, torch.float32, 1.0),
                                                           (torch.float32, True, 64, torch.float32, 1.0),
                                                           (torch.float32, True, 72, torch.float32, 1.0),
                                                           (torch.float32, True, 72, torch.bfloat16, 1.0),
                                                           (torch.bfloat16, False, 64, torch.float16, 1.0),
                                                           (torch.float32, True, 64, torch.float8_e4m3fn, 1.0),
                                                           (torch.float32, False, 72, torch.float8_e5m2, 1.0),
                                                           (torch.float32, False, 64, torch.float8_e4m3fn, 0.03)])
def test_attend_is_the_torch_backends_attention(build, twin, name, dtype, long, dim, kv, out_mul):
    """Head dims 16 / 64 / 72: the kernel's 16- and 64-column paths and a tail of 8 columns; a float32, bfloat16,
    float16 or float8 KV cache (both sides read the same stored values, so float32 rounding of the output holds);
    out_mul: an fp8 cache's V scale."""
    plan, tokens = plans(long)[name]
    g = torch.Generator().manual_seed(2)
    slots = plan.kv_slots.max().item() + 1
    q, k, v = (torch.randn(n, h, dim, generator=g) for n, h in ((tokens, HQ), (slots, HKV), (slots, HKV)))
    k, v = as_cache(k, kv), as_cache(v, kv)
    close(cpu_fused.attend(plan, q, k, v, dim ** -0.5, dtype, out_mul),
          twin(cpu_fused.attend, plan, q, k, v, dim ** -0.5, dtype, out_mul), dtype)


@pytest.mark.parametrize("prefix, kv", [([4, 9], torch.float32), ([126, 260], torch.float32),
                                        ([126, 260], torch.bfloat16), ([126, 260], torch.float8_e4m3fn)])
def test_attend_is_batch_invariant(build, prefix, kv):
    """Each token of a tree verify gets, bit for bit, what a decode step of that token alone over the keys it sees
    (its prefix, then its tree ancestors and itself) gets: speculation then stays lossless on the packed target
    (the verify's logits are a plain step's, whatever the padding and the tree around a token). With a prefix of
    126 the tree straddles the kernel's first key chunk's end, and node 3 does not see node 1."""
    table = torch.arange(1, 2 * 320 + 1, dtype=torch.int32).view(2, 320)
    tree_slots = table[:, 300:304].long()
    plan = PagedAttnBackend().dense(paged_block_plan(table, torch.tensor([0, 1]), torch.tensor(prefix), tree_slots,
                                                     TREE.expand(2, 4, 4)))
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(n, HQ if n == 8 else HKV, 64, generator=g) for n in (8, 650, 650))
    k, v = as_cache(k, kv), as_cache(v, kv)
    verified = cpu_fused.attend(plan, q, k, v, 0.125, torch.float32)
    for t in range(8):
        b, i = divmod(t, 4)
        seen = torch.cat([table[b, :prefix[b]].long(), tree_slots[b][TREE[i]]]).to(torch.int32)
        alone = TorchAttnBackend().plan(decode_metadata(seen[None], torch.tensor([0]), torch.tensor([len(seen)])))
        assert torch.equal(verified[t], cpu_fused.attend(alone, q[t:t + 1], k, v, 0.125, torch.float32)[0]), t


def test_a_prefill_token_is_its_decode_step(build):
    """Tokens of a prefill that see the same keys in a chunk go through it together (their K / V loads shared): each
    still gets, bit for bit, what a decode step of it alone gets (a prefill of 9 tokens after 300 cached ones, tiles
    of 4 and a lone last token, every chunk but the diagonal one shared)."""
    table = torch.arange(1, 321, dtype=torch.int32)[None]
    plan = TorchAttnBackend().plan(extend_metadata(table, torch.tensor([0]), torch.tensor([300]), torch.tensor([9])))
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, HQ if n == 9 else HKV, 64, generator=g) for n in (9, 330, 330))
    prefilled = cpu_fused.attend(plan, q, k, v, 0.125, torch.float32)
    for t in range(9):
        alone = TorchAttnBackend().plan(decode_metadata(table[:, :301 + t], torch.tensor([0]), torch.tensor([301 + t])))
        assert torch.equal(prefilled[t], cpu_fused.attend(alone, q[t:t + 1], k, v, 0.125, torch.float32)[0]), t


@pytest.mark.parametrize("activation, layout", [(torch.float32, "q4_k_m_type"), (torch.int16, "q4_k_m_type"),
                                                (torch.int16, "every_type")])
def test_a_packed_stack_runs_fused_and_gives_its_layers_logits(tmp_path, monkeypatch, activation, layout):
    """A Q4_K_M model packed with float32 (torch's kernel; its Q6_K parts dequantised) or int16 activations
    (fastspec's kernels: every projection packed, the stack one C call), and one of every other packed type (8-bit
    blocks): a prefill and two decode steps through a KV pool give the same logits fused as through its layers and
    the torch twins, and the fused stack is what ran."""
    import test_gguf_kquants
    from test_gguf_kquants import write_k_quant_gguf

    from fastspec.models import causal_lm
    from fastspec.models.causal_lm import CausalLM
    from fastspec.models.gguf import convert_gguf
    from fastspec.models.gguf_packed import load_packed_target
    from fastspec.models.loader import read_config

    model_dir = convert_gguf(write_k_quant_gguf(tmp_path / "tiny.gguf", types=getattr(test_gguf_kquants, layout)),
                             tmp_path / "hf")
    with torch.device("meta"):
        skeleton = CausalLM(read_config(model_dir))
    model = load_packed_target(skeleton, model_dir, torch.float32, activation=activation)
    c = model.config
    calls = []
    monkeypatch.setattr(causal_lm, "fused_layers", lambda *a, f=causal_lm.fused_layers: calls.append(1) or f(*a))

    def run() -> list[torch.Tensor]:
        pool, table = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, 32), torch.arange(1, 33, dtype=torch.int32)[None]
        rows, ids, logits = torch.zeros(1, dtype=torch.long), torch.tensor([3, 1, 4, 1, 5, 9]), []
        meta = extend_metadata(table, rows, torch.zeros(1, dtype=torch.long), torch.tensor([len(ids)]))
        for step in range(3):
            positions = torch.arange(len(ids)) if step == 0 else torch.tensor([5 + step])
            with torch.inference_mode():
                hidden = model(ids, positions, AttentionContext.build(TorchAttnBackend(), meta, pool))
                logits.append(model.compute_logits(hidden.final)[-1])
            ids = logits[-1].argmax()[None]
            meta = decode_metadata(table, rows, torch.tensor([7 + step]))
        return logits

    fused = run()
    assert len(calls) == 3
    monkeypatch.setattr(cpu_library, "library", lambda: None)
    # int16: the two paths' float32 roundings can move an activation across a rounding level (a level is 2^-16 of
    # its group's largest value), which moves a logit by ~1e-4
    tol = 1e-4 if activation == torch.float32 else 2e-3
    for a, b in zip(fused, run()):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    assert len(calls) == 3  # the layers ran the second time


@pytest.mark.parametrize("family, kv, scaled", [("llama", torch.float32, False), ("qwen2", torch.float32, False),
                                                ("qwen3", torch.float32, False), ("llama", torch.bfloat16, False),
                                                ("qwen3", torch.float16, False), ("qwen2", torch.float8_e4m3fn, False),
                                                ("llama", torch.float8_e4m3fn, True)])
def test_the_one_call_stack_is_its_python_loop_bit_for_bit(tiny_dirs, monkeypatch, family, kv, scaled):
    """Every projection a BlockLinear (4-bit, one 6-bit, one 8-bit, two over inputs in another order: GPTQ desc_act's
    PermutedLinear; Qwen2's QKV with its bias, Qwen3's q / k head norms): the stack runs as one C call
    (cpu_fused.decoder_stack), which gives, bit for bit, the logits and the captured residual streams of the same
    kernels called layer by layer (fused_layers' loop), over a prefill of two requests and a decode step of both;
    and, to float32 rounding, those of the model's own layers over the same packed linears. kv: the KV pool's dtype
    (a 16- or 8-bit pool: K and V rounded as they are written, the same way on each path); `scaled`: with a
    checkpoint's KV scales, different in each layer."""
    from conftest import PoolRunner

    from fastspec.kernels import cpu_q4
    from fastspec.models import causal_lm, fused_cpu
    from fastspec.models.gguf_blocks import Blocks, as_8bit_16
    from fastspec.models.layers import fuse_projections
    from fastspec.models.loader import load_target
    from fastspec.models.packed_layers import BlockLinear
    from fastspec.models.quant_layers import PermutedLinear
    from fastspec.models.quantise import quantise_target

    model = fuse_projections(load_target(tiny_dirs[family][0], torch.float32))
    quantise_target(model, "int4", torch.int16, True)
    for i, bits in ((0, 6), (1, 8)):  # layer 0's down in 6 bits, layer 1's in 8: the stack takes every width
        mlp = model.model.layers[i].mlp
        q, scale, offset = cpu_q4.unpack(mlp.down_proj.packed, mlp.down_proj.scales)
        wide = as_8bit_16(Blocks(q.to(torch.uint8), scale, offset, 4))
        mlp.down_proj = BlockLinear(*cpu_q4.pack(wide.q.to(torch.uint8) if bits == 6 else wide.q, wide.scale,
                                                 wide.offset, bits))
        assert cpu_q4.bits(mlp.down_proj.packed) == bits
    gen = torch.Generator().manual_seed(4)
    for layer in model.model.layers[2:]:  # the same weights over their inputs reordered, as desc_act stores them
        layer.mlp.gate_up_proj = PermutedLinear(torch.randperm(64, generator=gen), layer.mlp.gate_up_proj)
    model.capture_layers = (0, 2, 3)
    calls = []
    monkeypatch.setattr(cpu_fused, "decoder_stack", lambda *a, f=cpu_fused.decoder_stack: calls.append(1) or f(*a))

    def run() -> list[torch.Tensor]:
        scales = tuple((0.05 * (i + 1), 0.3 / (i + 1)) for i in range(model.config.num_layers)) if scaled else None
        runner = PoolRunner(model, kv_dtype=kv, kv_scales=scales)
        first = runner.extend([0, 0], [[5, 9, 13, 2, 40], [7, 7, 8]])
        second = runner.extend([5, 3], [[11], [12]])
        return [t for out in (first, second) for t in (model.compute_logits(out.final), out.aux)]

    one_call = run()
    assert len(calls) == 2
    monkeypatch.setattr(fused_cpu, "_stack_table", lambda m: None)
    for a, b in zip(one_call, run()):
        assert torch.equal(a, b)
    assert len(calls) == 2  # the loop ran the second time
    monkeypatch.setattr(causal_lm, "fused_activation", lambda *a: None)  # the layers' own forward
    for a, b in zip(one_call, run()):  # (int16 roundings of slightly different activations: see above)
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)
