"""The twins of sgl-kernel's verify_tree_greedy and tree_speculative_sampling_target_only against hand-worked trees
and the literal transcriptions of their loops (kernel_oracles)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_oracles import (NEXT_SIBLING, NEXT_TOKEN, RETRIEVE_INDEX, build_batch, eagle_batches, oracle_greedy,
                            oracle_sampling)

from fastspec.kernels import tree_links, tree_speculative_sampling_target_only, verify_tree_greedy

# ---------------------------------------------------------------------------------------------------------
# verify_tree_greedy on tree 1 (tokens 10 + position, so node p carries token 10 + p)

def _tree1(bs):
    ri = torch.tensor([RETRIEVE_INDEX[0]]) + 6 * torch.arange(bs)[:, None]
    return (torch.tensor([[10, 11, 12, 13, 14, 15]]).repeat(bs, 1), ri,
            torch.tensor([NEXT_TOKEN[0]]).repeat(bs, 1), torch.tensor([NEXT_SIBLING[0]]).repeat(bs, 1))


def _greedy(candidates, ri, nt, ns, target, num_steps=3, dtype=torch.int32):
    bs = candidates.shape[0]
    predicts = torch.full((bs * 6,), -7, dtype=dtype)  # -7: untouched
    accept_index = torch.full((bs, num_steps + 1), -1, dtype=dtype)
    accept_num = torch.zeros(bs, dtype=dtype)
    verify_tree_greedy(predicts, accept_index, accept_num, candidates, ri, nt, ns, torch.tensor(target))
    return predicts.tolist(), accept_index.tolist(), accept_num.tolist()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_greedy_hand_cases(dtype):
    target = [[12, 14, 0, 0, 7, 0],    # root -> 12: node 1 (11) no, node 2 (12) yes; node 2 is a leaf: bonus 0
              [11, 14, 9, 9, 7, 9],    # 11 -> node 1; 14: node 3 (13) no, node 4 (14) yes; leaf: bonus 7
              [11, 13, 9, 15, 9, 9],   # 11 -> 1, 13 -> 3, 15 -> 5 (full depth); bonus 9 after node 5
              [99, 9, 9, 9, 9, 9]]     # nothing matches: bonus 99 after the root
    predicts, accept_index, accept_num = _greedy(*_tree1(4), target, dtype=dtype)
    u = -7
    assert accept_index == [[0, 2, -1, -1], [6, 7, 10, -1], [12, 13, 15, 17], [18, -1, -1, -1]]
    assert accept_num == [1, 2, 3, 0]
    assert predicts == [12, u, 0, u, u, u,  11, 14, u, u, 7, u,  11, 13, u, 15, u, 9,  99, u, u, u, u, u]


def test_greedy_follows_sibling_links_not_positions():
    candidates, ri, nt, ns = _tree1(2)
    candidates[:, 4] = 13  # nodes 3 and 4 both carry 13: the first one in sibling order wins
    nt[1, 1], ns[1, 4], ns[1, 3] = 4, 3, -1  # row 1 links node 1's children as 4 -> 3 instead of 3 -> 4
    target = [[11, 13, 0, 8, 6, 0], [11, 13, 0, 8, 6, 0]]
    predicts, accept_index, accept_num = _greedy(candidates, ri, nt, ns, target)
    # row 0: 11 -> node 1; 13 -> node 3 (first sibling); node 5 carries 15, target says 8: stop, bonus 8
    # row 1: 11 -> node 1; 13 -> node 4 (first in its list); node 4 is a leaf: bonus 6
    assert accept_index == [[0, 1, 3, -1], [6, 7, 10, -1]]
    assert accept_num == [2, 2]
    assert (predicts[0], predicts[1], predicts[3], predicts[6], predicts[7], predicts[10]) == (11, 13, 8, 11, 13, 6)


def test_tree_links_parent_and_rank():
    _, _, nt, ns = _tree1(1)
    parent, rank = tree_links(nt, ns)
    assert parent.tolist() == [[-1, 0, 0, 1, 1, 3]]
    assert rank.tolist() == [[0, 0, 1, 0, 1, 0]]


# ---------------------------------------------------------------------------------------------------------
# tree_speculative_sampling_target_only on tree 1 with candidates = positions (node p carries token p), V = 8

Q = [1 / 8, 1 / 4, 1 / 4, 1 / 8, 1 / 8, 1 / 8, 0, 0]  # dyadic: exact in float32


def _onehot(tok):
    return [1.0 if i == tok else 0.0 for i in range(8)]


def _sample(target_rows, coins, u_final, th_single=1.0, th_acc=1.0, draft=None):
    """target_rows: {node: row} (other rows uniform); coins: {node: u}; one request, S = 3."""
    target = torch.full((1, 6, 8), 1 / 8)
    for node, row in target_rows.items():
        target[0, node] = torch.tensor(row)
    uniforms = torch.full((1, 6), 0.5)
    for node, u in coins.items():
        uniforms[0, node] = u
    draft = torch.zeros(1, 6, 8) if draft is None else draft
    predicts, accept_index, accept_num = torch.full((6,), -7, dtype=torch.int32), \
        torch.full((1, 4), -1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    _, ri, nt, ns = _tree1(1)
    tree_speculative_sampling_target_only(predicts, accept_index, accept_num, torch.arange(6)[None], ri, nt, ns,
                                          uniforms, torch.tensor([u_final]), target, draft, th_single, th_acc)
    return predicts.tolist(), accept_index[0].tolist(), int(accept_num[0]), draft


def test_sampling_one_hot_targets_are_deterministic():
    # root wants 2: node 1 (q = 0) rejected, node 2 (q = 1) accepted; node 2 is a leaf -> bonus 6
    predicts, accept_index, k, draft = _sample({0: _onehot(2), 2: _onehot(6)}, {}, 0.5)
    assert (accept_index, k, predicts[0], predicts[2]) == ([0, 2, -1, -1], 1, 2, 6)
    assert draft[0, 0].tolist() == [0.0] * 8  # the rejected child had q = 0
    # chain 1 -> 3 -> 5 to full depth; the bonus comes from the target row of node 5 WITHOUT subtracting the
    # draft row (pre-filled to cancel token 6: subtracting would leave zeros and pick V-1 = 7)
    draft = torch.zeros(1, 6, 8)
    draft[0, 5, 6] = 1.0
    rows = {0: _onehot(1), 1: _onehot(3), 3: _onehot(5), 5: _onehot(6)}
    predicts, accept_index, k, _ = _sample(rows, {}, 0.5, draft=draft)
    assert (accept_index, k) == ([0, 1, 3, 5], 3)
    assert (predicts[0], predicts[1], predicts[3], predicts[5]) == (1, 3, 5, 6)


def test_sampling_all_children_rejected_bonus_excludes_them():
    # coin 0.75 > q(1) = 0.25 and > q(1) + q(2) = 0.5: both rejected, their q is written to draft row 0
    # residual = [1/8, 0, 0, 1/8, 1/8, 1/8, 0, 0] (sum 1/2); u_final 0.6 -> 0.3: cumsum .125 .125 .125 .25 .375
    predicts, accept_index, k, draft = _sample({0: Q}, {0: 0.75}, 0.6)
    assert (accept_index, k, predicts[0]) == ([0, -1, -1, -1], 0, 4)
    assert draft[0, 0].tolist() == [0, 0.25, 0.25, 0, 0, 0, 0, 0]
    assert _sample({0: Q}, {0: 0.75}, 0.1)[0][0] == 0   # 0.05 -> token 0
    assert _sample({0: Q}, {0: 0.75}, 0.99)[0][0] == 5  # 0.495 -> token 5, never the rejected 1 or 2


def test_sampling_second_sibling_uses_running_sum():
    # coin 0.45: node 1 running sum 0.25 < 0.45 rejected, node 2 running sum 0.5 >= 0.45 accepted
    predicts, accept_index, k, draft = _sample({0: Q, 2: _onehot(7)}, {0: 0.45}, 0.5)
    assert (accept_index, k, predicts[0], predicts[2]) == ([0, 2, -1, -1], 1, 2, 7)
    assert draft[0, 0].tolist() == [0, 0.25, 0, 0, 0, 0, 0, 0]


def test_sampling_thresholds():
    # threshold_single 0.25: node 1 (q = 0.25) is accepted although coin 0.99 > 0.25;
    # at node 1 the target is one-hot on 4: node 3 rejected, node 4 accepted; leaf -> bonus from row 4 (0)
    rows = {0: Q, 1: _onehot(4), 4: _onehot(0)}
    predicts, accept_index, k, _ = _sample(rows, {0: 0.99}, 0.5, th_single=0.25)
    assert (accept_index, k, predicts[0], predicts[1], predicts[4]) == ([0, 1, 4, -1], 2, 1, 4, 0)
    assert _sample(rows, {0: 0.99}, 0.5)[1] == [0, -1, -1, -1]  # default thresholds: both rejected
    # threshold_acc 0.5: running sums are doubled, node 2 passes with 0.5 / 0.5 = 1 >= 0.75 (node 1: 0.5 < 0.75)
    _, accept_index, k, _ = _sample({0: Q}, {0: 0.75}, 0.5, th_acc=0.5)
    assert (accept_index, k) == ([0, 2, -1, -1], 1)
    with pytest.raises(ValueError, match="thresholds"):
        _sample({0: Q}, {}, 0.5, th_single=1.5)


# ---------------------------------------------------------------------------------------------------------
# Random trees and targets: the vectorised kernels equal the literal loops


def _random_verify_inputs(batch, vocab):
    topk, depth, n, trees, seq_lens, rng = batch
    _, _, retrieve = build_batch(topk, depth, n, trees, seq_lens)
    bs = len(trees)
    candidates = torch.tensor(rng.integers(0, vocab, (bs, n)))
    return candidates, retrieve, depth, rng, bs, n


@settings(max_examples=60, deadline=None)
@given(eagle_batches())
def test_greedy_matches_oracle(batch):
    candidates, retrieve, depth, rng, bs, n = _random_verify_inputs(batch, 4)
    target = torch.tensor(rng.integers(0, 4, (bs, n)))  # 4 tokens: matches are frequent
    predicts = torch.full((bs * n,), -7, dtype=torch.int32)
    accept_index = torch.full((bs, depth + 1), -1, dtype=torch.int32)
    accept_num = torch.zeros(bs, dtype=torch.int32)
    verify_tree_greedy(predicts, accept_index, accept_num, candidates, *retrieve, target)
    expected = oracle_greedy(candidates.tolist(), *retrieve.tolist(), target.flatten().tolist(), depth)
    for b, (path, written) in enumerate(expected):
        assert accept_index[b].tolist() == path + [-1] * (depth + 1 - len(path))
        assert int(accept_num[b]) == len(path) - 1
        assert {i: v for i, v in enumerate(predicts.tolist()) if v != -7 and i // n == b} == written


@settings(max_examples=60, deadline=None)
@given(eagle_batches(), st.sampled_from([(1.0, 1.0), (0.5, 1.0), (1.0, 0.5), (0.25, 0.75)]))
def test_sampling_matches_oracle(batch, thresholds):
    vocab = 6
    candidates, retrieve, depth, rng, bs, n = _random_verify_inputs(batch, vocab)
    target = rng.dirichlet(np.full(vocab, 0.5), (bs, n)).astype(np.float32)
    u, u_final = rng.random((bs, n), dtype=np.float32), rng.random(bs, dtype=np.float32)
    predicts = torch.full((bs * n,), -7, dtype=torch.int32)
    accept_index = torch.full((bs, depth + 1), -1, dtype=torch.int32)
    accept_num = torch.zeros(bs, dtype=torch.int32)
    draft = torch.zeros(bs, n, vocab)
    tree_speculative_sampling_target_only(predicts, accept_index, accept_num, candidates, *retrieve,
                                          torch.tensor(u), torch.tensor(u_final), torch.tensor(target), draft,
                                          *thresholds)
    draft_oracle = np.zeros_like(target)
    expected = oracle_sampling(candidates.tolist(), *retrieve.tolist(), u, u_final, target, draft_oracle, depth,
                               *thresholds)
    np.testing.assert_array_equal(draft.numpy(), draft_oracle)
    for b, (path, written) in enumerate(expected):
        assert accept_index[b].tolist() == path + [-1] * (depth + 1 - len(path))
        assert int(accept_num[b]) == len(path) - 1
        assert {i: v for i, v in enumerate(predicts.tolist()) if v != -7 and i // n == b} == written
