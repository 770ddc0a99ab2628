"""sgl-kernel dispatch: on CPU it falls back to the torch twins and calls sgl_kernel's ops positionally (fake ops
of both signatures); on CUDA (marked `gpu`) the real sgl_kernel against the twins on random EAGLE rounds."""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from fastspec.kernels import dispatch
from fastspec.kernels import sampling as sampling_twins
from fastspec.kernels import tree_build as tree_twins
from fastspec.kernels import verify as verify_twins
from fastspec.kernels.tree_build import TreeMaskMode
from fastspec.speculative.tree import organize_draft_results, select_top_k

I32 = torch.int32

def random_eagle_round(bs=3, topk=2, num_steps=3, n=6, vocab=11, seed=0, device="cpu"):
    """A real drafting round's select/organize outputs with random draft distributions."""
    gen = torch.Generator().manual_seed(seed)
    hidden, scores = torch.zeros(bs, 1), None
    score_list, token_list, parents_list = [], [], []
    for step in range(num_steps):
        rows = bs if step == 0 else bs * topk
        probs = torch.rand(rows, vocab, generator=gen).softmax(-1)
        topk_p, topk_index = probs.topk(topk, -1)
        sel = select_top_k(step, topk_p, topk_index, hidden, scores, topk)
        score_list.append(sel.score_entry), token_list.append(sel.token_entry), parents_list.append(sel.parent_entry)
        hidden, scores = sel.hidden, sel.scores
    parent_list, selected, tokens = organize_draft_results(score_list, token_list, parents_list, n)
    seq_lens = torch.randint(1, 9, (bs,), generator=gen)
    to = lambda *xs: [x.to(device) for x in xs]  # noqa: E731
    return (*to(parent_list, selected, tokens, seq_lens), topk, num_steps, n)


def build_tree(op, parent_list, selected, seq_lens, topk, steps, n, mode=TreeMaskMode.FULL_MASK):
    bs, dev = seq_lens.numel(), seq_lens.device
    if mode == TreeMaskMode.FULL_MASK:
        mask = torch.ones(int(seq_lens.sum()) * n + bs * n * n, dtype=torch.bool, device=dev)
    elif mode == TreeMaskMode.QLEN_ONLY:
        mask = torch.zeros(bs * n * n, dtype=torch.bool, device=dev)
    else:
        mask = torch.zeros(bs * n, dtype=torch.uint8, device=dev)  # N <= 8: one byte per row
    positions = torch.empty(bs * n, dtype=torch.int64, device=dev)
    retrieve = torch.full((3, bs, n), -1, dtype=torch.int64, device=dev)
    op(parent_list, selected, seq_lens, mask, positions, *retrieve, topk, steps, n, int(mode))
    return mask, positions, retrieve


def verify_inputs(retrieve, n, steps, vocab, seed, device):
    gen = torch.Generator().manual_seed(seed)
    bs = retrieve.shape[1]
    candidates = torch.randint(0, 4, (bs, n), generator=gen).to(device)
    target = (torch.randn(bs, n, vocab, generator=gen) * 3).softmax(-1).to(device)
    out = lambda: (torch.zeros(bs * n, dtype=I32, device=device),  # noqa: E731
                   torch.full((bs, steps + 1), -1, dtype=I32, device=device), torch.zeros(bs, dtype=I32, device=device))
    u = torch.rand(bs, n, generator=gen).to(device), torch.rand(bs, generator=gen).to(device)
    return candidates, target, out, u


def run_all_ops(ops, device="cpu", seed=0):
    """Every dispatched op on one random round; returns all outputs (for comparing two op sets)."""
    parent_list, selected, _, seq_lens, topk, steps, n = random_eagle_round(seed=seed, device=device)
    outs = [build_tree(ops.build_tree_kernel_efficient, parent_list, selected, seq_lens, topk, steps, n, mode)
            for mode in TreeMaskMode]
    _, _, retrieve = outs[0]
    qlen = outs[1][0]
    rec = [torch.empty_like(outs[0][1]), *torch.full_like(retrieve, -1)]
    ops.reconstruct_indices_from_tree_mask(qlen, seq_lens, *rec, seq_lens.numel(), n)
    candidates, target, out, (u, u_final) = verify_inputs(retrieve, n, steps, 7, seed, device)
    greedy = out()
    ops.verify_tree_greedy(*greedy, candidates, *retrieve, target.argmax(-1))
    sampled = out()
    ops.tree_speculative_sampling_target_only(*sampled, candidates, *retrieve, u, u_final, target,
                                              torch.zeros_like(target), 1.0, 1.0, True)
    probs = target.view(-1, 7)
    renorm = [ops.top_k_renorm_prob(probs, 3), ops.top_p_renorm_prob(probs, 0.7)]
    return [t for group in (*outs, rec, greedy, sampled, renorm) for t in group]


TWINS = types.SimpleNamespace(
    build_tree_kernel_efficient=tree_twins.build_tree_kernel_efficient,
    reconstruct_indices_from_tree_mask=tree_twins.reconstruct_indices_from_tree_mask,
    verify_tree_greedy=verify_twins.verify_tree_greedy,
    tree_speculative_sampling_target_only=verify_twins.tree_speculative_sampling_target_only,
    top_k_renorm_prob=sampling_twins.top_k_renorm_prob, top_p_renorm_prob=sampling_twins.top_p_renorm_prob)


def test_dispatch_falls_back_to_the_twins_on_cpu(monkeypatch):
    def no_import():
        raise AssertionError("sgl_kernel must not be imported for CPU tensors")

    monkeypatch.setattr(dispatch, "_sgl_kernel", no_import)
    for seed in range(3):
        for got, want in zip(run_all_ops(dispatch, seed=seed), run_all_ops(TWINS, seed=seed)):
            assert torch.equal(got, want)
    assert dispatch.kernels_backend("cpu") == "torch"
    import fastspec.kernels as kernels

    assert kernels.verify_tree_greedy is dispatch.verify_tree_greedy


def new_style_sampling(predicts, accept_index, accept_token_num, candidates, retrieve_index, retrieve_next_token,
                       retrieve_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
                       threshold_single=1.0, threshold_acc=1.0, deterministic=True):
    """sgl-kernel after SGLang PR #28581: no draft_probs argument (allocated inside)."""
    assert isinstance(threshold_single, float) and isinstance(deterministic, bool)
    verify_twins.tree_speculative_sampling_target_only(
        predicts, accept_index, accept_token_num, candidates, retrieve_index, retrieve_next_token,
        retrieve_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
        torch.zeros_like(target_probs), threshold_single, threshold_acc, deterministic)


@pytest.mark.parametrize("sampling_op", [verify_twins.tree_speculative_sampling_target_only, new_style_sampling])
def test_dispatch_calls_sgl_kernel_positionally(monkeypatch, sampling_op):
    calls = []

    def recording(fn):
        def op(*args, **kwargs):
            assert not kwargs, "sgl_kernel must be called positionally"
            calls.append((fn.__name__, len(args)))
            return fn(*args)
        op.__signature__ = inspect.signature(fn)
        return op

    fakes = {name: recording(getattr(TWINS, name)) for name in vars(TWINS)}
    fakes["tree_speculative_sampling_target_only"] = recording(sampling_op)
    monkeypatch.setattr(dispatch, "_kernel", lambda name, tensor: fakes[name])
    for got, want in zip(run_all_ops(dispatch), run_all_ops(TWINS)):
        assert torch.equal(got, want)
    arity = dict(calls)
    assert arity["build_tree_kernel_efficient"] == 12 and arity["verify_tree_greedy"] == 8
    assert arity["reconstruct_indices_from_tree_mask"] == 8 and arity["top_k_renorm_prob"] == 2
    assert arity[sampling_op.__name__] == (14 if sampling_op is not new_style_sampling else 13)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(5))
def test_sgl_kernel_matches_twins_on_random_eagle_trees(seed):
    pytest.importorskip("sgl_kernel")
    assert dispatch.kernels_backend("cuda") == "sgl_kernel"
    for got, want in zip(run_all_ops(dispatch, "cuda", seed), run_all_ops(TWINS, "cuda", seed)):
        if got.is_floating_point():
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        else:
            assert torch.equal(got, want)
