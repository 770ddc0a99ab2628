"""Quantised MoE experts stacked as byte codes (fastspec.models.byte_experts): each of ByteExperts' three paths
against LinearExperts' eager sparse forward over the same stored forms (torch twins on CPU, and Triton's interpreter
on a tiny shape), which path a compiled call takes, which layers are stacked (and which are left, logged), and a
tiny quantised Qwen3-MoE / DeepSeek-V3 checkpoint whose compiled speculative rounds gather their experts giving
eager decoding's greedy tokens.

Tolerance: the paths share the stored weights and float32 sums but not the order of those sums (a tile GEMM, a
pair's dot product), so they agree to float32's rounding of the largest output (2e-6 of it here), and in bfloat16
activations to bfloat16's (one rounding of each expert's output: 2e-2 of the largest output).
"""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("triton")

import fastspec  # noqa: E402
from fastspec.models.byte_experts import ByteExperts, stack_bytes, stack_linear_experts  # noqa: E402
from fastspec.models.cuda_linears import ByteLinear  # noqa: E402
from fastspec.models.gguf_blocks import Blocks  # noqa: E402
from fastspec.models.moe import LinearExperts  # noqa: E402
from fastspec.models.quant_layers import QuantLinear  # noqa: E402
from fastspec.models.quant_weights import Fp8Weight, IntWeight  # noqa: E402
from fastspec.models.quantise import online_form  # noqa: E402
from fastspec.sampling import SamplingParams  # noqa: E402

H, INTER = 64, 32
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernels compiled on a GPU, interpreted on CPU


def form(kind: str, n: int, k: int, gen: torch.Generator):
    """A stored form [n, k] of `kind`, made on `gen`'s device."""
    at = dict(generator=gen, device=gen.device)
    w = torch.randn(n, k, **at)
    if kind == "fp8 block":  # a scale per row and 32 inputs
        return Fp8Weight(w.to(torch.float8_e4m3fn), torch.rand(n, k // 32, **at), 32)
    if kind == "int4 with zeros":  # 4-bit, a scale and an offset per 16 inputs
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, **at)
        return IntWeight(Blocks(q, torch.rand(n, k // 16, **at) / 8, -torch.rand(n, k // 16, **at), 4))
    return online_form(w, {"fp8 channel": "fp8", "int8": "int8", "int4": "int4"}[kind])


def linear_experts(kind: str, E: int, seed: int = 0) -> LinearExperts:
    gen = torch.Generator().manual_seed(seed)
    gate_up = [QuantLinear(form(kind, 2 * INTER, H, gen)) for _ in range(E)]
    return LinearExperts(gate_up, [QuantLinear(form(kind, H, INTER, gen)) for _ in range(E)])


def routing(T: int, k: int, E: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], index [T, k]): k distinct experts a token in a random order, the last token choosing
    the first's experts."""
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    index[-1] = index[0][torch.randperm(k, generator=g)]
    return torch.rand(T, k, generator=g), index


def assert_near(got, want, dtype):
    tol = (2e-6 if dtype == torch.float32 else 2e-2) * want.abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=0)


KINDS = ["fp8 channel", "fp8 block", "int8", "int4", "int4 with zeros"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_every_path_computes_the_linear_experts_sparse_forward(kind, dtype):
    """The torch twins on CPU: gathered (T * k < E), dense and sparse against LinearExperts' eager sparse forward
    over the dequantised stored forms; the sparse path against LinearExperts bound to ByteLinear bit for bit (the
    same byte GEMM on each expert's slice of the stack)."""
    module = linear_experts(kind, 8, seed=len(kind))
    stacked = stack_bytes(module)
    bound = LinearExperts([ByteLinear(m.form) for m in module.gate_up], [ByteLinear(m.form) for m in module.down])
    for T, k in ((1, 2), (3, 2), (2, 3), (6, 4)):
        x, (weights, index) = torch.randn(T, H).to(dtype), routing(T, k, 8, seed=T * 10 + k)
        want = module(x, weights, index)
        sparse = stacked.forward_sparse(x, weights, index)
        assert torch.equal(sparse, bound(x, weights, index))
        for path in (sparse, stacked.forward_gathered(x, weights, index), stacked.forward_dense(x, weights, index)):
            assert path.dtype == dtype
            assert_near(path, want, dtype)


@pytest.mark.parametrize("kind", ["fp8 block", "int4 with zeros"])
def test_the_gathered_path_through_the_triton_kernels(monkeypatch, kind):
    """FASTSPEC_TRITON_QUANT=1: both ops run Triton (interpreted on CPU, compiled on a GPU) on a tiny shape."""
    monkeypatch.setenv("FASTSPEC_TRITON_QUANT", "1")
    module = linear_experts(kind, 6, seed=3)
    stacked = stack_bytes(module).to(DEVICE)
    x, (weights, index) = torch.randn(2, H), routing(2, 2, 6, seed=5)
    want = module(x, weights, index)
    args = [t.to(DEVICE) for t in (x, weights, index)]
    assert_near(stacked.forward_gathered(*args).cpu(), want, torch.float32)
    assert_near(stacked.forward_sparse(*args).cpu(), want, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp8 block", "int8", "int4 with zeros"])
def test_a_captured_decode_step_gathers_and_computes_the_sparse_experts(kind):
    """On the GPU at Qwen3-30B-A3B's MoE shape (128 experts, top 8, hidden 2048, experts 768 wide), bfloat16: a
    CUDA graph of 4 rows (32 pairs: gathered) and one of 16 (128 pairs: dense), each replayed with another routing,
    against LinearExperts' eager sparse forward over the same stored forms."""
    E, k, hidden, inter = 128, 8, 2048, 768
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    make = lambda n, kk: QuantLinear(form(kind, n, kk, gen))  # noqa: E731
    module = LinearExperts([make(2 * inter, hidden) for _ in range(E)], [make(hidden, inter) for _ in range(E)])
    module = module.cuda()
    stacked = stack_bytes(module)
    for T in (4, 16):
        x = torch.randn(T, hidden, device="cuda", dtype=torch.bfloat16)
        weights, index = (t.cuda() for t in routing(T, k, E, seed=T))
        stacked.forward_gathered(x, weights, index)  # the kernels compiled before capturing
        stacked.forward_dense(x, weights, index)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = stacked(x, weights, index)
        new_weights, new_index = routing(T, k, E, seed=T + 1)
        weights.copy_(new_weights)
        index.copy_(new_index)
        graph.replay()
        assert_near(y, module(x, weights, index), torch.bfloat16)


def _refuse(self, *args):
    raise AssertionError("the other path")


@pytest.mark.parametrize("T, k, path", [(3, 2, "forward_gathered"), (4, 2, "forward_dense")])
def test_a_compiled_call_gathers_only_when_its_pairs_are_fewer_than_the_experts(monkeypatch, T, k, path):
    """8 experts: T * k < 8 gathers, else dense; eagerly neither (forward_sparse). Compiled fullgraph: the ops are
    opaque, no host sync."""
    torch._dynamo.reset()
    other = {"forward_gathered": "forward_dense", "forward_dense": "forward_gathered"}[path]
    monkeypatch.setattr(ByteExperts, other, _refuse)
    stacked = stack_bytes(linear_experts("int8", 8))
    x, (weights, index) = torch.randn(T, H), routing(T, k, 8, seed=0)
    compiled = torch.compile(stacked, backend="eager", fullgraph=True, dynamic=False)
    assert_near(compiled(x, weights, index), stacked.forward_sparse(x, weights, index), torch.float32)
    monkeypatch.setattr(ByteExperts, path, _refuse)
    stacked(x, weights, index)  # eager: forward_sparse
    torch._dynamo.reset()


def test_only_experts_sharing_one_code_are_stacked_and_only_where_wanted(monkeypatch, caplog):
    """On CPU nothing is stacked unless FASTSPEC_TRITON_QUANT says so; then a layer whose experts mix fp8 and int8,
    or one with a GPTQ input order, stays LinearExperts and is named in one warning."""
    mixed = linear_experts("int8", 4)
    mixed.down[2] = linear_experts("fp8 channel", 4).down[2]
    permuted = linear_experts("int4", 4)
    blocks = permuted.gate_up[0].form.blocks
    permuted.gate_up[0] = QuantLinear(IntWeight(blocks, torch.randperm(H)))
    model = torch.nn.ModuleDict(dict(same=linear_experts("int8", 4), mixed=mixed, permuted=permuted))
    monkeypatch.delenv("FASTSPEC_TRITON_QUANT", raising=False)
    assert stack_linear_experts(model) == 0 and isinstance(model["same"], LinearExperts)
    monkeypatch.setenv("FASTSPEC_TRITON_QUANT", "twin")
    with caplog.at_level(logging.WARNING, "fastspec.models.byte_experts"):
        assert stack_linear_experts(model) == 1
    assert isinstance(model["same"], ByteExperts)
    assert isinstance(model["mixed"], LinearExperts) and isinstance(model["permuted"], LinearExperts)
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["2 MoE layers' quantised experts do not share "
                                                                       "one byte code"]


def test_each_layers_linears_are_let_go_as_its_stack_replaces_them(monkeypatch):
    """Stacking holds one layer twice at a time, not the whole model: when the second layer is stacked, the first
    layer's per-expert linears are gone."""
    import gc
    import weakref

    from fastspec.models import byte_experts

    monkeypatch.setenv("FASTSPEC_TRITON_QUANT", "twin")
    model = torch.nn.ModuleList([linear_experts("int8", 4, seed=s) for s in range(3)])
    seen, stack = [], byte_experts.stack_bytes

    def spy(experts):
        gc.collect()
        assert all(ref() is None for ref in seen)  # every layer stacked before this one let go
        seen.append(weakref.ref(experts))
        return stack(experts)
    monkeypatch.setattr(byte_experts, "stack_bytes", spy)
    assert stack_linear_experts(model) == 3 and len(seen) == 3


@pytest.mark.parametrize("family, method", [("qwen3_moe", "fp8_block"), ("deepseek_v3", "gptq8"),
                                            ("qwen3_moe", "awq")])
def test_compiled_rounds_over_stacked_experts_give_eager_greedy_tokens(monkeypatch, tiny_dirs, tmp_path, family,
                                                                       method):
    """FASTSPEC_TRITON_QUANT=twin: a quantised checkpoint's experts stacked (e4m3, int8, uint4 codes; the twins on
    CPU), the target drafting for itself with rounds compiled fullgraph for batch 1: the draft steps (1 row) and the
    target's verify (3 rows: 6 pairs of Qwen3-MoE's 16 experts, of DeepSeek-V3's 8) gather; output equals eager
    target-only decoding's (sparse) token for token."""
    from conftest import make_hf_model
    from quant_writers import write_quantised

    monkeypatch.setenv("FASTSPEC_TRITON_QUANT", "twin")
    torch._dynamo.reset()
    hf = make_hf_model(family, num_experts=16) if family == "qwen3_moe" else tiny_dirs[family][1]
    write_quantised(hf, tmp_path / "m", method)
    gathered = []
    forward_gathered = ByteExperts.forward_gathered

    def spy(self, x, weights, index):
        gathered.append(x.shape[0])  # traced once per compiled graph
        return forward_gathered(self, x, weights, index)
    monkeypatch.setattr(ByteExperts, "forward_gathered", spy)
    target, params = str(tmp_path / "m"), SamplingParams(max_new_tokens=10, ignore_eos=True)
    prompts = [[5, 9, 13, 3, 40], [7, 7, 8, 60, 61, 62, 7, 7]]
    plain = fastspec.LLM(target, speculative_algorithm="NONE", max_total_tokens=512)
    layers = [m for m in plain.engine.worker.model.modules() if isinstance(m, (ByteExperts, LinearExperts))]
    assert layers and all(isinstance(m, ByteExperts) for m in layers)
    expected = [o.output_ids for o in plain.generate(prompts, params)]
    assert not gathered  # eager: the sparse path
    llm = fastspec.LLM(target, speculative_algorithm="STANDALONE", draft_model=target, num_steps=2, topk=1,
                       num_draft_tokens=3, max_total_tokens=512, tuned=False, graphs="compile", cuda_graph_bs=(1,))
    llm.engine.policy = None
    outputs = llm.generate(prompts, params)
    assert [o.output_ids for o in outputs] == expected and all(o.metrics.verify_rounds > 0 for o in outputs)
    assert 3 in gathered  # the target's verify gathered
    torch._dynamo.reset()
