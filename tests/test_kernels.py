"""fastspec.kernels' tree building, renormalisation and top-k against hand-worked trees and literal Python
transcriptions of the sgl_kernel loops (kernel_oracles); verification: test_verify_kernels.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_oracles import (BITPACKED, NEXT_SIBLING, NEXT_TOKEN, POSITIONS, RETRIEVE_INDEX, SEQ_LENS, TREE_ROWS, bits,
                            build_batch, build_hand_tree, eagle_batches, oracle_build)

from fastspec.kernels import (TreeMaskMode, fast_topk, reconstruct_indices_from_tree_mask, top_k_renorm_prob,
                              top_p_renorm_prob)


def test_build_tree_full_mask_hand_worked():
    tree_mask = torch.ones(sum(SEQ_LENS) * 6 + 2 * 36, dtype=torch.bool)  # caller pre-fills True
    positions, retrieve = build_hand_tree(TreeMaskMode.FULL_MASK, tree_mask)
    # request 0: 6 rows of 3 prefix + 6 tree columns; request 1 starts at 36*1 + 6*3 = 54: rows of 2 + 6
    expected = bits(["111" + r for r in TREE_ROWS[0]] + ["11" + r for r in TREE_ROWS[1]])
    assert tree_mask.tolist() == expected
    assert positions == POSITIONS
    assert retrieve == [RETRIEVE_INDEX, NEXT_TOKEN, NEXT_SIBLING]


def test_build_tree_qlen_and_bitpacked_masks():
    qlen = torch.zeros(2 * 36, dtype=torch.bool)
    positions, retrieve = build_hand_tree(TreeMaskMode.QLEN_ONLY, qlen)
    assert qlen.tolist() == bits(TREE_ROWS[0] + TREE_ROWS[1])
    assert (positions, retrieve) == (POSITIONS, [RETRIEVE_INDEX, NEXT_TOKEN, NEXT_SIBLING])
    packed = torch.zeros(12, dtype=torch.uint8)
    build_hand_tree(TreeMaskMode.QLEN_ONLY_BITPACKING, packed)
    assert packed.tolist() == BITPACKED


def test_build_tree_chain_topk1():
    # S = 3, N = 4: candidate ids 0, 1, 2; parent_list = [-1, 0, 1] -> a chain 0-1-2-3
    tree_mask = torch.ones(5 * 4 + 16, dtype=torch.bool)
    positions, retrieve = build_hand_tree(TreeMaskMode.FULL_MASK, tree_mask, [[-1, 0, 1]], [[0, 1, 2]], [5], 1, 3, 4)
    assert tree_mask.tolist() == bits(["111111000", "111111100", "111111110", "111111111"])
    assert positions == [5, 6, 7, 8]
    assert retrieve == [[[0, 1, 2, 3]], [[1, 2, 3, -1]], [[-1, -1, -1, -1]]]


def test_bitpacked_two_bytes_per_row():
    # chain of N = 10: row t has bits 0..t set -> 2**(t+1) - 1, stored little-endian in 16-bit rows
    n = 10
    packed = torch.zeros(n, dtype=torch.uint16)
    build_hand_tree(TreeMaskMode.QLEN_ONLY_BITPACKING, packed, [list(range(-1, 8))], [list(range(9))], [0], 1, 9, n)
    assert packed.to(torch.int64).tolist() == [1, 3, 7, 15, 31, 63, 127, 255, 511, 1023]
    with pytest.raises(ValueError, match="bytes per row"):
        build_hand_tree(TreeMaskMode.QLEN_ONLY_BITPACKING, torch.zeros(n, dtype=torch.uint8),
               [list(range(-1, 8))], [list(range(9))], [0], 1, 9, n)


def test_reconstruct_from_hand_mask():
    positions = torch.empty(12, dtype=torch.int64)
    retrieve = torch.full((3, 2, 6), -1, dtype=torch.int64)
    mask = torch.tensor(bits(TREE_ROWS[0] + TREE_ROWS[1]))
    reconstruct_indices_from_tree_mask(mask, torch.tensor(SEQ_LENS), positions, retrieve[0], retrieve[1],
                                       retrieve[2], 2, 6)
    assert positions.tolist() == POSITIONS
    assert retrieve.tolist() == [RETRIEVE_INDEX, NEXT_TOKEN, NEXT_SIBLING]


@settings(max_examples=60, deadline=None)
@given(eagle_batches())
def test_build_tree_matches_oracle_and_reconstruct(batch):
    topk, depth, n, trees, seq_lens, _ = batch
    qlen, positions, retrieve = build_batch(topk, depth, n, trees, seq_lens)
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
