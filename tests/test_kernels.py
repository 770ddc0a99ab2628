"""fastspec.kernels against hand-worked trees and literal Python transcriptions of the sgl_kernel loops."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastspec.kernels import (
    TreeMaskMode,
    build_tree_kernel_efficient,
    fast_topk,
    reconstruct_indices_from_tree_mask,
    top_k_renorm_prob,
    top_p_renorm_prob,
    tree_links,
    tree_speculative_sampling_target_only,
    verify_tree_greedy,
)

# ---------------------------------------------------------------------------------------------------------
# Hand-worked EAGLE trees, topk = 2, depth = 3, N = 6. Candidate ids: step 0 -> 0, 1 (children of the root);
# step 1 -> 2 + 2r + c (child c of leaf r, leaves = 0, 1); step 1 keeps leaves 2 and 4, so step 2 -> 6 + 2r + c
# (children of 2: 6, 7; children of 4: 8, 9). parent_list = [-1, 0, 1, 2, 4]: parent of g is parent_list[g // 2].
#
# Tree 1: selected [0, 1, 2, 3, 6], seq_len 3      Tree 2: selected [0, 1, 2, 4, 8], seq_len 2
#   pos 0 root                                       pos 0 root
#   pos 1 g0 (parent root)   pos 2 g1 (root)         pos 1 g0 (root)    pos 2 g1 (root)
#   pos 3 g2 (parent g0 = pos 1)                     pos 3 g2 (g0 = pos 1)
#   pos 4 g3 (3 // 2 = 1 -> g0 = pos 1)              pos 4 g4 (4 // 2 = 2 -> g1 = pos 2)
#   pos 5 g6 (6 // 2 = 3 -> g2 = pos 3)              pos 5 g8 (8 // 2 = 4 -> g4 = pos 4)
#        0                                                0
#      /   \                                            /   \
#     1     2                                          1     2
#    / \                                               |     |
#   3   4                                              3     4
#   |                                                        |
#   5                                                        5
PARENT_LIST = [[-1, 0, 1, 2, 4], [-1, 0, 1, 2, 4]]
SELECTED = [[0, 1, 2, 3, 6], [0, 1, 2, 4, 8]]
SEQ_LENS = [3, 2]
TREE_ROWS = [["100000", "110000", "101000", "110100", "110010", "110101"],   # root + ancestors + self
             ["100000", "110000", "101000", "110100", "101010", "101011"]]
POSITIONS = [3, 4, 4, 5, 5, 6, 2, 3, 3, 4, 4, 5]  # seq_len + depth
RETRIEVE_INDEX = [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
NEXT_TOKEN = [[1, 3, -1, 5, -1, -1], [1, 3, 4, -1, 5, -1]]  # smallest child position
NEXT_SIBLING = [[-1, 2, -1, 4, -1, -1], [-1, 2, -1, -1, -1, -1]]  # next larger sibling position
BITPACKED = [1, 3, 5, 11, 19, 43, 1, 3, 5, 11, 21, 53]  # bit j of row t = column j, e.g. "110101" -> 43


def _bits(rows: list[str]) -> list[bool]:
    return [c == "1" for row in rows for c in row]


def _build(mode: TreeMaskMode, tree_mask: torch.Tensor, parent_list=PARENT_LIST, selected=SELECTED,
           seq_lens=SEQ_LENS, topk=2, depth=3, n=6):
    bs = len(seq_lens)
    positions = torch.empty(bs * n, dtype=torch.int64)
    retrieve = torch.full((3, bs, n), -1, dtype=torch.int64)
    build_tree_kernel_efficient(torch.tensor(parent_list), torch.tensor(selected), torch.tensor(seq_lens),
                                tree_mask, positions, retrieve[0], retrieve[1], retrieve[2], topk, depth, n,
                                int(mode))
    return positions.tolist(), retrieve.tolist()


def test_build_tree_full_mask_hand_worked():
    tree_mask = torch.ones(sum(SEQ_LENS) * 6 + 2 * 36, dtype=torch.bool)  # caller pre-fills True
    positions, retrieve = _build(TreeMaskMode.FULL_MASK, tree_mask)
    # request 0: 6 rows of 3 prefix + 6 tree columns; request 1 starts at 36*1 + 6*3 = 54: rows of 2 + 6
    expected = _bits(["111" + r for r in TREE_ROWS[0]] + ["11" + r for r in TREE_ROWS[1]])
    assert tree_mask.tolist() == expected
    assert positions == POSITIONS
    assert retrieve == [RETRIEVE_INDEX, NEXT_TOKEN, NEXT_SIBLING]


def test_build_tree_qlen_and_bitpacked_masks():
    qlen = torch.zeros(2 * 36, dtype=torch.bool)
    positions, retrieve = _build(TreeMaskMode.QLEN_ONLY, qlen)
    assert qlen.tolist() == _bits(TREE_ROWS[0] + TREE_ROWS[1])
    assert (positions, retrieve) == (POSITIONS, [RETRIEVE_INDEX, NEXT_TOKEN, NEXT_SIBLING])
    packed = torch.zeros(12, dtype=torch.uint8)
    _build(TreeMaskMode.QLEN_ONLY_BITPACKING, packed)
    assert packed.tolist() == BITPACKED


def test_build_tree_chain_topk1():
    # S = 3, N = 4: candidate ids 0, 1, 2; parent_list = [-1, 0, 1] -> a chain 0-1-2-3
    tree_mask = torch.ones(5 * 4 + 16, dtype=torch.bool)
    positions, retrieve = _build(TreeMaskMode.FULL_MASK, tree_mask, [[-1, 0, 1]], [[0, 1, 2]], [5], 1, 3, 4)
    assert tree_mask.tolist() == _bits(["111111000", "111111100", "111111110", "111111111"])
    assert positions == [5, 6, 7, 8]
    assert retrieve == [[[0, 1, 2, 3]], [[1, 2, 3, -1]], [[-1, -1, -1, -1]]]


def test_bitpacked_two_bytes_per_row():
    # chain of N = 10: row t has bits 0..t set -> 2**(t+1) - 1, stored little-endian in 16-bit rows
    n = 10
    packed = torch.zeros(n, dtype=torch.uint16)
    _build(TreeMaskMode.QLEN_ONLY_BITPACKING, packed, [list(range(-1, 8))], [list(range(9))], [0], 1, 9, n)
    assert packed.to(torch.int64).tolist() == [1, 3, 7, 15, 31, 63, 127, 255, 511, 1023]
    with pytest.raises(ValueError, match="bytes per row"):
        _build(TreeMaskMode.QLEN_ONLY_BITPACKING, torch.zeros(n, dtype=torch.uint8),
               [list(range(-1, 8))], [list(range(9))], [0], 1, 9, n)


def test_reconstruct_from_hand_mask():
    positions = torch.empty(12, dtype=torch.int64)
    retrieve = torch.full((3, 2, 6), -1, dtype=torch.int64)
    mask = torch.tensor(_bits(TREE_ROWS[0] + TREE_ROWS[1]))
    reconstruct_indices_from_tree_mask(mask, torch.tensor(SEQ_LENS), positions, retrieve[0], retrieve[1],
                                       retrieve[2], 2, 6)
    assert positions.tolist() == POSITIONS
    assert retrieve.tolist() == [RETRIEVE_INDEX, NEXT_TOKEN, NEXT_SIBLING]


# ---------------------------------------------------------------------------------------------------------
# Literal Python transcriptions of the sgl_kernel loops (reference §2.3-2.5): the oracles.

def oracle_build(parent_list, selected, seq_len, topk, n, b):
    next_token, next_sibling = [-1] * n, [-1] * n
    for i in range(n - 1, 0, -1):
        pidx = selected[i - 1] // topk
        pp = 0 if pidx == 0 else 1 + selected.index(parent_list[pidx])
        if next_token[pp] == -1:
            next_token[pp] = i
        else:
            next_sibling[i], next_token[pp] = next_token[pp], i
    mask = [[j == 0 for j in range(n)] for _ in range(n)]
    positions = [seq_len] + [0] * (n - 1)
    for t in range(1, n):
        cur, depth = t - 1, 0
        while True:
            depth += 1
            mask[t][cur + 1] = True
            pidx = selected[cur] // topk
            if pidx == 0:
                break
            cur = selected.index(parent_list[pidx])
        positions[t] = seq_len + depth
    return positions, [b * n + i for i in range(n)], next_token, next_sibling, mask


def _walk(ri, nt, ns, num_steps, b, accept_child):
    """Shared skeleton of §2.4/§2.5: accept_child(last_row, child) -> bool; returns the accepted verify rows."""
    accept, cur = [ri[b][0]], 0
    for _ in range(num_steps):
        cur = nt[b][cur]
        while cur != -1:
            if accept_child(accept[-1], cur):
                accept.append(ri[b][cur])
                break
            cur = ns[b][cur]
        if cur == -1:
            break
    return accept


def oracle_greedy(candidates, ri, nt, ns, target_flat, num_steps):
    results = []
    for b in range(len(candidates)):
        predicts = {}

        def accept_child(last, cur):
            if candidates[b][cur] == target_flat[last]:
                predicts[last] = candidates[b][cur]
                return True
            return False
        path = _walk(ri, nt, ns, num_steps, b, accept_child)
        predicts[path[-1]] = target_flat[path[-1]]
        results.append((path, predicts))
    return results


def oracle_sampling(candidates, ri, nt, ns, u, u_final, target, draft, num_steps, th_single, th_acc):
    """target/draft: float32 numpy [bs, N, V] (draft is updated); float32 arithmetic as on the GPU."""
    results, f32 = [], np.float32
    for b in range(len(candidates)):
        state = {"row": 0, "acc": f32(0), "coin": f32(u[b][0])}
        predicts = {}

        def accept_child(last, cur):
            tok = candidates[b][cur]
            q = target[b, state["row"], tok]
            state["acc"] = f32(state["acc"] + q)
            if state["coin"] <= f32(state["acc"] / f32(max(th_acc, 1e-9))) or q >= f32(th_single):
                state.update(acc=f32(0), row=cur, coin=f32(u[b][cur]))
                predicts[last] = tok
                return True
            draft[b, state["row"], tok] = q
            return False
        path = _walk(ri, nt, ns, num_steps, b, accept_child)
        k, row = len(path) - 1, state["row"]
        r = np.maximum(target[b, row] - (draft[b, row] if k != num_steps else 0), 0).astype(f32)
        total, acc, pick = f32(r.sum(dtype=f32)), f32(0), r.shape[0] - 1
        for i, w in enumerate(r):
            acc = f32(acc + w)
            if acc > f32(u_final[b]) * total:
                pick = i
                break
        predicts[path[-1]] = pick
        results.append((path, predicts))
    return results


# ---------------------------------------------------------------------------------------------------------
# Random EAGLE trees: the id scheme of select_top_k with random path scores (strictly decreasing along paths).

def random_eagle_tree(rng, topk, depth, n):
    score = {g: rng.uniform(0.05, 1.0) for g in range(topk)}
    leaves, parents_list = list(range(topk)), [[-1] + list(range(topk))]
    for i in range(1, depth):
        cands = [topk + topk * topk * (i - 1) + r * topk + c for r in range(len(leaves)) for c in range(topk)]
        for g in cands:
            score[g] = score[leaves[(g - topk - topk * topk * (i - 1)) // topk]] * rng.uniform(0.05, 0.99)
        leaves = sorted(cands, key=lambda g: -score[g])[:topk]
        parents_list.append(leaves)
    parent_list = [g for entry in parents_list[:-1] for g in entry]
    selected = sorted(sorted(score, key=lambda g: -score[g])[: n - 1])
    return parent_list, selected


@st.composite
def eagle_batches(draw):
    topk, depth = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    n = draw(st.integers(2, min(topk + (depth - 1) * topk * topk, 12) + 1))
    bs, seed = draw(st.integers(1, 4)), draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    trees = [random_eagle_tree(rng, topk, depth, n) for _ in range(bs)]
    seq_lens = rng.integers(0, 7, bs).tolist()
    return topk, depth, n, trees, seq_lens, rng


def _build_batch(topk, depth, n, trees, seq_lens):
    bs = len(trees)
    parent_list = torch.tensor([t[0] for t in trees], dtype=torch.int64).reshape(bs, -1)  # [bs, 0] at depth 1
    qlen = torch.zeros(bs * n * n, dtype=torch.bool)
    positions, retrieve = torch.empty(bs * n, dtype=torch.int64), torch.full((3, bs, n), -1, dtype=torch.int64)
    build_tree_kernel_efficient(parent_list, torch.tensor([t[1] for t in trees]), torch.tensor(seq_lens), qlen,
                                positions, retrieve[0], retrieve[1], retrieve[2], topk, depth, n,
                                int(TreeMaskMode.QLEN_ONLY))
    return qlen, positions, retrieve


@settings(max_examples=60, deadline=None)
@given(eagle_batches())
def test_build_tree_matches_oracle_and_reconstruct(batch):
    topk, depth, n, trees, seq_lens, _ = batch
    qlen, positions, retrieve = _build_batch(topk, depth, n, trees, seq_lens)
    for b, (parent_list, selected) in enumerate(trees):
        pos, ri, nt, ns, mask = oracle_build(parent_list, selected, seq_lens[b], topk, n, b)
        assert positions[b * n:(b + 1) * n].tolist() == pos
        assert [retrieve[0, b].tolist(), retrieve[1, b].tolist(), retrieve[2, b].tolist()] == [ri, nt, ns]
        assert qlen.view(-1, n, n)[b].tolist() == mask
    # reconstruct_indices_from_tree_mask reproduces build_tree's outputs from the mask alone
    positions2, retrieve2 = torch.empty_like(positions), torch.full_like(retrieve, -1)
    reconstruct_indices_from_tree_mask(qlen, torch.tensor(seq_lens), positions2, retrieve2[0], retrieve2[1],
                                       retrieve2[2], len(trees), n)
    assert torch.equal(positions2, positions) and torch.equal(retrieve2, retrieve)


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
    _, _, retrieve = _build_batch(topk, depth, n, trees, seq_lens)
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


# ---------------------------------------------------------------------------------------------------------
# Renormalisation against a straightforward sorted reference (numpy, row by row)

def ref_top_k(row, k):
    if k <= 0 or k >= len(row):
        return row
    order = np.argsort(-row, kind="stable")
    out = np.zeros_like(row)
    out[order[:k]] = row[order[:k]]
    return out / out.sum()


def ref_top_p(row, p):
    if p >= 1:
        return row
    order = np.argsort(-row, kind="stable")
    out, mass = np.zeros_like(row), 0.0
    for i in order:  # take the largest until the mass reaches p
        out[i] = row[i]
        mass += row[i]
        if mass >= p:
            break
    return out / out.sum()


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(2, 12), st.integers(0, 2**31))
def test_renorm_matches_sorted_reference(rows, vocab, seed):
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.full(vocab, 0.7), rows).astype(np.float64)
    ks = rng.integers(-1, vocab + 2, rows)
    ps = rng.choice([0.05, 0.3, 0.55, 0.8, 0.95, 1.0], rows)
    got_k = top_k_renorm_prob(torch.tensor(probs), torch.tensor(ks)).numpy()
    got_p = top_p_renorm_prob(torch.tensor(probs), torch.tensor(ps)).numpy()
    for r in range(rows):
        np.testing.assert_allclose(got_k[r], ref_top_k(probs[r], ks[r]), atol=1e-6)
        np.testing.assert_allclose(got_p[r], ref_top_p(probs[r], ps[r]), atol=1e-6)
    k0, p0 = int(ks[0]), float(ps[0])  # scalar parameters broadcast to every row
    np.testing.assert_allclose(top_k_renorm_prob(torch.tensor(probs), k0).numpy(),
                               np.stack([ref_top_k(row, k0) for row in probs]), atol=1e-6)
    np.testing.assert_allclose(top_p_renorm_prob(torch.tensor(probs), p0).numpy(),
                               np.stack([ref_top_p(row, p0) for row in probs]), atol=1e-6)


def test_renorm_hand_case():
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.25, 0.25, 0.25, 0.25]])
    assert torch.allclose(top_k_renorm_prob(probs, torch.tensor([2, 3])),
                          torch.tensor([[0, 4 / 7, 0, 3 / 7], [1 / 3, 1 / 3, 1 / 3, 0]]))
    # top_p 0.6: 0.4 alone < 0.6, 0.4 + 0.3 reaches it -> keep {1, 3}; top_p 0.5 on uniform: the smallest
    # set reaching 0.5 has 2 tokens (ties by position); top_p 0 keeps the largest only
    assert torch.allclose(top_p_renorm_prob(probs, torch.tensor([0.6, 0.5])),
                          torch.tensor([[0, 4 / 7, 0, 3 / 7], [0.5, 0.5, 0, 0]]))
    assert top_p_renorm_prob(probs, 0.0).tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]
    assert top_k_renorm_prob(probs.half(), 1).dtype == torch.float32


def test_fast_topk():
    values = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.3, 0.9]])
    best, index = fast_topk(values, 1, -1)
    assert best.tolist() == [[0.699999988079071], [0.8999999761581421]] and index.tolist() == [[1], [2]]
    best, index = fast_topk(values, 2, -1)
    assert index.tolist() == [[1, 2], [2, 0]] and best.shape == (2, 2)
