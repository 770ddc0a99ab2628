"""MoE experts inside compiled rounds: with fewer (token, choice) pairs than experts (T * k < E), each pair runs
through its own expert's gathered weights (Experts.forward_gathered), else every expert on every token
(forward_dense). Here: the gathered path against the eager one (forward_sparse) bit for bit, eagerly and compiled
as the rounds compile, which path a compiled call takes, the GPU's batched form to rounding, and lossless
speculative output from a compiled 16-expert top-2 target whose small buckets take the gathered path.
"""

import itertools

import pytest
import torch
from conftest import make_hf_model

import fastspec
from fastspec.graphs.compile_backend import inductor_without_host_sync
from fastspec.kernels import cpu_library
from fastspec.models.moe import Experts
from fastspec.sampling import SamplingParams

needs_library = pytest.mark.skipif(not cpu_library.available(),
                                   reason="without the C kernels the products are the CPU BLAS's")


@pytest.fixture
def fresh_dynamo():
    """Dynamo's compiled code for Experts.forward forgotten (each case compiles new modules and shapes: past 8 of
    them the recompile limit refuses)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def experts(E: int, dtype: torch.dtype, H: int = 16, inter: int = 12, seed: int = 0) -> Experts:
    torch.manual_seed(seed)
    module = Experts(E, H, inter)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return module.to(dtype)


def routing(T: int, k: int, E: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], index [T, k]): k distinct experts a token in a random order, the last token choosing
    the first's experts (repeated experts across tokens)."""
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    index[-1] = index[0][torch.randperm(k, generator=g)]
    return torch.rand(T, k, generator=g), index


@needs_library
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_experts_compute_what_sparse_ones_compute_bit_for_bit(dtype):
    for E, k, T in itertools.product((4, 7, 16), (1, 2, 3, 4), range(1, 9)):
        module, x = experts(E, dtype, seed=E), torch.randn(T, 16, dtype=dtype)
        weights, index = routing(T, k, E, seed=T * 100 + k)
        sparse = module.forward_sparse(x, weights, index)
        assert torch.equal(module.forward_gathered(x, weights, index), sparse), (E, k, T)


@needs_library
@pytest.mark.parametrize("E, k, T, dtype", [(16, 2, 7, torch.float32), (16, 4, 3, torch.bfloat16),
                                            (9, 2, 4, torch.bfloat16), (8, 1, 1, torch.bfloat16),
                                            (4, 2, 7, torch.float32), (8, 4, 5, torch.bfloat16)])
def test_compiled_experts_are_the_sparse_ones_bit_for_bit(fresh_dynamo, E, k, T, dtype):
    """Compiled fullgraph with the rounds' backend, gathered (T * k < E) or dense, several routings per graph. (The
    dense path differed by an ulp here before: Inductor compiled the experts' silu with its own exp.)"""
    if dtype == torch.bfloat16 and torch.__version__ < "2.13":
        pytest.skip("torch 2.11's Inductor (checked; 2.13 rounds as eager) multiplies by the float32 routing weight, "
                    "not its bfloat16 rounding, with emulate_precision_casts on: dense and gathered alike")
    module = experts(E, dtype)
    compiled = torch.compile(module, backend=inductor_without_host_sync, fullgraph=True, dynamic=False)
    for seed in range(3):
        x, (weights, index) = torch.randn(T, 16, dtype=dtype), routing(T, k, E, seed)
        assert torch.equal(compiled(x, weights, index), module.forward_sparse(x, weights, index)), seed


def _refuse(self, *args):
    raise AssertionError("the other path")


@pytest.mark.parametrize("T, k, E, path", [(3, 2, 8, "forward_gathered"), (4, 2, 8, "forward_dense"),
                                           (1, 4, 4, "forward_dense")])
def test_a_compiled_call_gathers_only_when_its_pairs_are_fewer_than_the_experts(fresh_dynamo, monkeypatch, T, k, E,
                                                                                 path):
    """T * k < E gathers (fewer experts' bytes than all E), else dense; eagerly neither (forward_sparse)."""
    other = {"forward_gathered": "forward_dense", "forward_dense": "forward_gathered"}[path]
    monkeypatch.setattr(Experts, other, _refuse)
    module, x = experts(E, torch.float32), torch.randn(T, 16)
    weights, index = routing(T, k, E, seed=0)
    compiled = torch.compile(module, backend="eager", fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x, weights, index), module.forward_sparse(x, weights, index))
    monkeypatch.setattr(Experts, path, _refuse)
    module(x, weights, index)  # eager: forward_sparse, neither compiled path


@pytest.mark.parametrize("E, k, T", [(16, 2, 5), (8, 3, 2), (4, 1, 3)])
def test_batched_gathered_products_match_sparse_experts(E, k, T):
    """The GPU's gathered form (einsum over [T, k, I, H] weights), run here on the CPU: the same sums, to rounding."""
    module, x = experts(E, torch.float32), torch.randn(T, 16)
    weights, index = routing(T, k, E, seed=1)
    torch.testing.assert_close(module.gathered_batched(x, weights, index), module.forward_sparse(x, weights, index),
                               atol=1e-5, rtol=1e-4)


def test_compiled_speculation_with_gathered_experts_is_lossless(tmp_path, monkeypatch):
    """A 16-expert top-2 target drafting for itself, rounds compiled fullgraph for batch 1: its draft steps (2 rows)
    and verify (4 rows) gather (compiled dense rounds: test_moe_families); output equals eager target-only decoding."""
    make_hf_model("qwen3_moe", num_experts=16, num_experts_per_tok=2).save_pretrained(tmp_path / "target")
    target = str(tmp_path / "target")
    gathered_rows = []
    forward_gathered = Experts.forward_gathered

    def spy(self, x, weights, index):
        gathered_rows.append(x.shape[0])  # traced once per compiled graph
        return forward_gathered(self, x, weights, index)
    monkeypatch.setattr(Experts, "forward_gathered", spy)
    prompts = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26, 43], [3], [28, 84, 19, 71]]
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = fastspec.LLM(target, max_total_tokens=2048).engine
    spec = fastspec.LLM(target, speculative_algorithm="STANDALONE", draft_model=target, num_steps=2, topk=2,
                        num_draft_tokens=4, max_total_tokens=2048, graphs="compile", cuda_graph_bs=(1,)).engine
    for prompt in prompts:
        want = plain.generate([prompt], [greedy])[0].output_ids
        got = spec.generate([prompt], [greedy])[0]
        assert got.output_ids == want and got.metrics.verify_rounds > 0
    assert gathered_rows  # the compiled rounds took the gathered path
