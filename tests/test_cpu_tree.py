"""The C tree bookkeeping of eager CPU rounds (kernels/cpu_tree.c) against its torch twins: an EAGLE tree's verify
inputs (tree_build.build_tree_kernel_efficient, QLEN_ONLY) and the greedy walk (verify.verify_tree_greedy), on random
EAGLE trees, trees with orphans, arbitrary trees, and through the functions the rounds call."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_oracles import build_batch, eagle_batches, random_eagle_tree

from fastspec.kernels import cpu_tree, verify_tree_greedy
from fastspec.speculative import tree as tree_mod

pytestmark = pytest.mark.skipif(not cpu_tree.cpu_library.available(), reason="no C compiler for the CPU kernels")


def _c_tree(topk, n, trees, seq_lens):
    parent_list = torch.tensor([t[0] for t in trees], dtype=torch.int64).reshape(len(trees), -1)
    selected = torch.tensor([t[1] for t in trees], dtype=torch.int64)
    return cpu_tree.eagle_tree(parent_list, selected, torch.tensor(seq_lens), topk, n)


def _assert_c_tree_is_twins(topk, depth, n, trees, seq_lens):
    qlen, positions, retrieve = build_batch(topk, depth, n, trees, seq_lens)
    mask, c_positions, *c_retrieve = _c_tree(topk, n, trees, seq_lens)
    assert torch.equal(mask, qlen.view(-1, n, n))
    assert torch.equal(c_positions, positions)
    assert torch.equal(torch.stack(c_retrieve), retrieve)


def _twin_walk(candidates, retrieve, predict, num_steps):
    bs, n = candidates.shape
    predicts = torch.full((bs * n,), -7, dtype=torch.int32)
    accept_index = torch.full((bs, num_steps + 1), -1, dtype=torch.int32)
    accept_num = torch.zeros(bs, dtype=torch.int32)
    verify_tree_greedy(predicts, accept_index, accept_num, candidates, *retrieve, predict)
    emitted = torch.where(accept_index >= 0, predicts.long()[accept_index.clamp(min=0).long()], -1)
    return accept_index.long(), accept_num.long(), emitted


@settings(max_examples=80, deadline=None)
@given(eagle_batches())
def test_eagle_tree_equals_twin(batch):
    topk, depth, n, trees, seq_lens, _ = batch
    _assert_c_tree_is_twins(topk, depth, n, trees, seq_lens)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 3), st.integers(2, 4), st.integers(0, 2**31))
def test_eagle_tree_with_orphans_equals_twin(topk, depth, seed):
    """Selected ids drawn at random (not the best paths): a node whose parent candidate was not selected hangs under
    the root alone; ids past the parent list clamp to its last entry, as the twin's gather does."""
    rng = np.random.default_rng(seed)
    width = topk + (depth - 1) * topk * topk
    n = int(rng.integers(2, min(width, 12) + 2))
    trees = []
    for _ in range(int(rng.integers(1, 4))):
        parent_list = rng.integers(-1, width, topk * (depth - 1) + 1).tolist()
        trees.append((parent_list, sorted(rng.choice(width + 4, n - 1, replace=False).tolist())))
    _assert_c_tree_is_twins(topk, depth, n, trees, rng.integers(0, 9, len(trees)).tolist())


@settings(max_examples=80, deadline=None)
@given(eagle_batches())
def test_greedy_walk_equals_twin(batch):
    topk, depth, n, trees, seq_lens, rng = batch
    _, _, retrieve = build_batch(topk, depth, n, trees, seq_lens)
    bs = len(trees)
    candidates = torch.tensor(rng.integers(0, 3, (bs, n)))  # 3 tokens: matches and ties among siblings are frequent
    predict = torch.tensor(rng.integers(0, 3, (bs, n)))
    for num_steps in range(1, depth + 1):
        walked = cpu_tree.greedy_walk(candidates, *retrieve, predict, num_steps)
        for got, want in zip(walked, _twin_walk(candidates, retrieve, predict, num_steps)):
            assert torch.equal(got, want)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31))
def test_greedy_walk_on_arbitrary_trees(seed):
    """Trees given by parents (as NGRAM's), linked by reconstruct_indices_from_tree_mask, walked to their full depth."""
    rng = np.random.default_rng(seed)
    bs, n = int(rng.integers(1, 4)), int(rng.integers(2, 10))
    parents = torch.tensor([[int(rng.integers(0, p)) for p in range(1, n)] for _ in range(bs)])
    tokens = torch.tensor(rng.integers(0, 3, (bs, n - 1)))
    tree = tree_mod.tree_from_parents(torch.tensor(rng.integers(0, 3, bs)), tokens, parents,
                                      torch.tensor(rng.integers(0, 5, bs)), n - 1)
    retrieve = torch.stack([tree.retrieve_index, tree.retrieve_next_token, tree.retrieve_next_sibling])
    predict = torch.tensor(rng.integers(0, 3, (bs, n)))
    walked = cpu_tree.greedy_walk(tree.draft_tokens, *retrieve, predict, n - 1)
    for got, want in zip(walked, _twin_walk(tree.draft_tokens, retrieve, predict, n - 1)):
        assert torch.equal(got, want)


def test_rounds_take_the_kernels_and_match_the_twins(monkeypatch):
    """tree.build_tree and tree.verify_predicted (what eager CPU rounds call) give the same values with the kernels
    and with the library turned off (the twins)."""
    rng = np.random.default_rng(3)
    topk, depth, n, bs = 2, 3, 6, 3
    trees = [random_eagle_tree(rng, topk, depth, n) for _ in range(bs)]
    args = (torch.tensor(rng.integers(0, 9, bs)), torch.tensor([t[0] for t in trees]),
            torch.tensor([t[1] for t in trees]), torch.tensor(rng.integers(0, 9, (bs, n - 1))),
            torch.tensor(rng.integers(0, 20, bs)), topk, depth, n)
    predict = torch.tensor(rng.integers(0, 9, (bs, n)))
    fast = tree_mod.build_tree(*args, in_graph=True)
    fast_result = tree_mod.verify_predicted(fast, predict, in_graph=True)
    monkeypatch.setattr(cpu_tree.cpu_library, "library", lambda: None)
    assert cpu_tree.eagle_tree(args[1], args[2], args[4], topk, n) is None
    slow = tree_mod.build_tree(*args, in_graph=True)
    slow_result = tree_mod.verify_predicted(slow, predict, in_graph=True)
    for a, b in zip((*vars(fast).values(), *vars(fast_result).values()),
                    (*vars(slow).values(), *vars(slow_result).values())):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, (a, b)


def test_kernels_decline_what_they_cannot_take():
    x = torch.zeros(2, 3, dtype=torch.int64)
    assert cpu_tree.greedy_walk(x.int(), x, x, x, x, 1) is None  # int32 candidates
    assert cpu_tree.greedy_walk(x.t(), x.t(), x.t(), x.t(), x.t(), 1) is None  # not contiguous
