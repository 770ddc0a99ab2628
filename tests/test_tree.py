"""fastspec.speculative.tree: top-k expansion and organisation by hand, the DraftTree builders, and
statistical tests that tree rejection sampling emits tokens distributed exactly as the target."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastspec.errors import FastspecError
from fastspec.speculative.tree import (
    build_tree,
    chain_tree,
    organize_draft_results,
    select_top_k,
    tree_from_parents,
    verify_greedy,
    verify_sampling,
)

# ---------------------------------------------------------------------------------------------------------
# Hand-worked drafting, bs = 1, topk = 2, S = 3 steps, hidden width 1 (the value names the draft row).
# step 0 (draft extend): p = [0.6, 0.35] tokens [5, 7]            -> candidates g0 (5), g1 (7)
# step 1: leaf g0 (row 0): p [0.5, 0.4] tok [8, 9]; leaf g1 (row 1): p [0.9, 0.1] tok [3, 4]
#   path probs: g2 = .6*.5 = .30, g3 = .6*.4 = .24, g4 = .35*.9 = .315, g5 = .35*.1 = .035
#   keep the top 2: g4 (flat 2, parent row 1), g2 (flat 0, parent row 0) -> parents entry [4, 2]
# step 2: leaf g4 (row 0): p [0.8, 0.2] tok [6, 0]; leaf g2 (row 1): p [0.6, 0.4] tok [1, 2]
#   g6 = .315*.8 = .252, g7 = .063, g8 = .30*.6 = .18, g9 = .12; keep g6 (flat 0), g8 (flat 2) -> [6, 8]
# organize, N = 6: best 5 = g0 .6, g1 .35, g4 .315, g2 .30, g6 .252 -> ids [0, 1, 2, 4, 6], tokens [5, 7, 8, 3, 6]
# parent_list = [-1, 0, 1] + [4, 2]; tree: root -> {1: 5, 2: 7}, 1 -> {3: 8}, 2 -> {4: 3}, 4 -> {5: 6}


def _hand_drafting():
    s0 = select_top_k(0, torch.tensor([[0.6, 0.35]]), torch.tensor([[5, 7]]), torch.tensor([[100.0]]), None, 2)
    s1 = select_top_k(1, torch.tensor([[0.5, 0.4], [0.9, 0.1]]), torch.tensor([[8, 9], [3, 4]]),
                      torch.tensor([[200.0], [201.0]]), s0.scores, 2)
    s2 = select_top_k(2, torch.tensor([[0.8, 0.2], [0.6, 0.4]]), torch.tensor([[6, 0], [1, 2]]),
                      torch.tensor([[300.0], [301.0]]), s1.scores, 2)
    return s0, s1, s2


def test_select_top_k_hand_worked():
    s0, s1, s2 = _hand_drafting()
    assert s0.input_ids.tolist() == [5, 7] and s0.hidden.tolist() == [[100.0], [100.0]]
    assert s0.parent_entry.tolist() == [[-1, 0, 1]] and s0.score_entry.shape == (1, 1, 2)
    assert s1.input_ids.tolist() == [3, 8]                 # g4 then g2 (descending path probability)
    assert s1.hidden.tolist() == [[201.0], [200.0]]        # each kept leaf carries its parent's draft row
    assert torch.allclose(s1.scores, torch.tensor([[0.315, 0.30]]))
    assert torch.allclose(s1.score_entry, torch.tensor([[[0.30, 0.24], [0.315, 0.035]]]))
    assert s1.token_entry.tolist() == [[8, 9, 3, 4]] and s1.parent_entry.tolist() == [[4, 2]]
    assert s2.input_ids.tolist() == [6, 1] and s2.hidden.tolist() == [[300.0], [301.0]]
    assert s2.parent_entry.tolist() == [[6, 8]]


def test_organize_hand_worked():
    steps = _hand_drafting()
    parent_list, top_scores_index, draft_tokens = organize_draft_results(
        [s.score_entry for s in steps], [s.token_entry for s in steps], [s.parent_entry for s in steps], 6)
    assert parent_list.tolist() == [[-1, 0, 1, 4, 2]]
    assert top_scores_index.tolist() == [[0, 1, 2, 4, 6]]
    assert draft_tokens.tolist() == [[5, 7, 8, 3, 6]]
    with pytest.raises(FastspecError, match="num_draft_tokens"):
        organize_draft_results([s.score_entry for s in steps], [s.token_entry for s in steps],
                               [s.parent_entry for s in steps], 12)  # only 10 candidates + root


def _hand_tree():
    steps = _hand_drafting()
    parent_list, top_scores_index, draft_tokens = organize_draft_results(
        [s.score_entry for s in steps], [s.token_entry for s in steps], [s.parent_entry for s in steps], 6)
    return build_tree(torch.tensor([42]), parent_list, top_scores_index, draft_tokens, torch.tensor([10]), 2, 3, 6)


def test_build_tree_from_drafting():
    tree = _hand_tree()
    assert tree.draft_tokens.tolist() == [[42, 5, 7, 8, 3, 6]] and tree.num_draft_tokens == 6
    assert tree.positions.tolist() == [10, 11, 11, 12, 12, 13]
    assert tree.retrieve_index.tolist() == [[0, 1, 2, 3, 4, 5]]
    assert tree.retrieve_next_token.tolist() == [[1, 3, 4, -1, 5, -1]]
    assert tree.retrieve_next_sibling.tolist() == [[-1, 2, -1, -1, -1, -1]]
    rows = ["100000", "110000", "101000", "110100", "101010", "101011"]
    assert tree.full_mask(torch.tensor([10]), 10).tolist() == [c == "1" for r in rows for c in "1" * 10 + r]
    assert tree.tree_mask.tolist() == [[[c == "1" for c in r] for r in rows]]
    # the same tree given by parent positions
    same = tree_from_parents(torch.tensor([42]), torch.tensor([[5, 7, 8, 3, 6]]), torch.tensor([[0, 0, 1, 2, 4]]),
                             torch.tensor([10]), 3, topk=2)
    for field in ("draft_tokens", "positions", "tree_mask", "retrieve_index", "retrieve_next_token",
                  "retrieve_next_sibling"):
        assert torch.equal(getattr(same, field), getattr(tree, field)), field
    with pytest.raises(ValueError, match="parent position"):
        tree_from_parents(torch.tensor([42]), torch.tensor([[5, 7]]), torch.tensor([[0, 2]]), torch.tensor([1]), 2)


def test_chain_tree():
    tree = chain_tree(torch.tensor([9, 8]), torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([2, 0]))
    assert (tree.topk, tree.num_steps, tree.num_draft_tokens) == (1, 3, 4)
    assert tree.positions.tolist() == [2, 3, 4, 5, 0, 1, 2, 3]
    assert tree.retrieve_next_token.tolist() == [[1, 2, 3, -1]] * 2
    assert tree.retrieve_next_sibling.tolist() == [[-1] * 4] * 2
    lower = ["1000", "1100", "1110", "1111"]
    full = tree.full_mask(torch.tensor([2, 0]), 2)
    assert full.tolist() == [c == "1" for r in ["11" + x for x in lower] + lower for c in r]


def _logits_with_argmax(argmax: list[int], vocab: int = 12) -> torch.Tensor:
    logits = torch.zeros(len(argmax), vocab)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 5.0
    return logits


def test_verify_greedy_on_hand_tree():
    tree = _hand_tree()  # root -> {1: 5, 2: 7}, 1 -> {3: 8}, 2 -> {4: 3}, 4 -> {5: 6}
    result = verify_greedy(tree, _logits_with_argmax([7, 0, 3, 0, 6, 11]))  # 7 -> 3 -> 6, then 11
    assert result.accept_index.tolist() == [[0, 2, 4, 5]] and result.accept_len.tolist() == [3]
    assert result.emitted.tolist() == [[7, 3, 6, 11]] and result.bonus_token.tolist() == [11]
    result = verify_greedy(tree, _logits_with_argmax([5, 9, 0, 0, 0, 0]))  # 5 accepted, 9 != 8: bonus 9
    assert result.accept_index.tolist() == [[0, 1, -1, -1]] and result.accept_len.tolist() == [1]
    assert result.emitted.tolist() == [[5, 9, -1, -1]] and result.bonus_token.tolist() == [9]


def test_temperature_zero_rows_sample_greedily():
    bs, n, vocab = 64, 6, 5
    parents = torch.tensor([[0, 0, 1, 1, 3]]).repeat(bs, 1)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (bs, n - 1), generator=gen)
    tree = tree_from_parents(torch.zeros(bs, dtype=torch.int64), tokens, parents, torch.full((bs,), 3), 3)
    logits = torch.randn(bs * n, vocab, generator=gen) * 3
    greedy = verify_greedy(tree, logits)
    temperature = torch.tensor([0.0, 1.0]).repeat(bs // 2)  # every other row samples
    sampled = verify_sampling(tree, logits, temperature, torch.full((bs,), -1), torch.full((bs,), 0.9),
                              torch.rand(bs, n, generator=gen))
    assert torch.equal(sampled.emitted[::2], greedy.emitted[::2])
    assert torch.equal(sampled.accept_len[::2], greedy.accept_len[::2])
    assert not torch.equal(sampled.emitted[1::2], greedy.emitted[1::2])  # the sampled rows do differ


# ---------------------------------------------------------------------------------------------------------
# Statistical: a large batch of identical requests; the first emitted token must follow the (processed)
# target row of the root, and (first, second) must follow P_root(t1) * P_child(t1)(t2) when t1 is a child's
# token (else the round ends after t1). Chi-square with p = 1e-3, seeded, so deterministic.

VOCAB, BATCH = 6, 20000
P = np.array([[0.30, 0.05, 0.25, 0.10, 0.20, 0.10],   # root
              [0.10, 0.35, 0.05, 0.15, 0.25, 0.10],   # node 1
              [0.20, 0.20, 0.20, 0.15, 0.15, 0.10],   # node 2
              [0.05, 0.10, 0.15, 0.20, 0.20, 0.30],   # node 3
              [0.40, 0.10, 0.10, 0.10, 0.20, 0.10],   # node 4
              [0.15, 0.15, 0.15, 0.15, 0.20, 0.20]])  # node 5
BRANCHING = ([0, 0, 1, 1, 3], [0, 2, 1, 4, 5])  # parents, tokens: root -> {1: 0, 2: 2}, 1 -> {3: 1, 4: 4}, 3 -> {5: 5}
CHAIN = [0, 1, 3]                               # root -> 0 -> 1 -> 3


def processed(row, temperature, top_k, top_p):
    """The target distribution after temperature, top-k and top-p, computed independently (numpy)."""
    w = row ** (1.0 / temperature)
    w = w / w.sum()
    order = np.argsort(-w, kind="stable")
    keep = np.zeros(len(w), dtype=bool)
    keep[order[: top_k if 0 < top_k < len(w) else len(w)]] = True
    w = np.where(keep, w, 0.0) / np.where(keep, w, 0.0).sum()
    if top_p < 1.0:
        mass_before = np.cumsum(w[order]) - w[order]
        keep_p = np.zeros(len(w), dtype=bool)
        keep_p[order[(mass_before < top_p) | (np.arange(len(w)) == 0)]] = True
        w = np.where(keep_p, w, 0.0) / np.where(keep_p, w, 0.0).sum()
    return w


def chi_square_pvalue(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    """Pearson chi-square; categories with expected 0 must be empty. p = Q(dof/2, stat/2)."""
    assert observed[expected_probs == 0].sum() == 0, "a zero-probability outcome was emitted"
    nonzero = expected_probs > 0
    expected = expected_probs[nonzero] * observed.sum()
    stat = float(((observed[nonzero] - expected) ** 2 / expected).sum())
    dof = int(nonzero.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


ROOT_CHILDREN = {"chain": {0: 1}, "branching": {0: 1, 2: 2}}  # token -> node, for the children of the root


def _sample_rounds(kind, temperature, top_k, top_p, seed):
    if kind == "chain":
        tree = chain_tree(torch.zeros(BATCH, dtype=torch.int64), torch.tensor([CHAIN]).repeat(BATCH, 1),
                          torch.full((BATCH,), 4))
        table = P[:4]
    else:
        parents, tokens = BRANCHING
        tree = tree_from_parents(torch.zeros(BATCH, dtype=torch.int64), torch.tensor([tokens]).repeat(BATCH, 1),
                                 torch.tensor([parents]).repeat(BATCH, 1), torch.full((BATCH,), 4), 3)
        table = P
    logits = torch.tensor(np.log(table), dtype=torch.float32).repeat(BATCH, 1)
    result = verify_sampling(tree, logits, torch.full((BATCH,), temperature), torch.full((BATCH,), top_k),
                             torch.full((BATCH,), top_p),
                             torch.rand(BATCH, tree.num_draft_tokens, generator=torch.Generator().manual_seed(seed)))
    assert (result.accept_len > 0).any() and (result.accept_len == 0).any()  # both paths exercised
    return table, result.emitted.numpy()


def _expected_pairs(kind, table, cfg):
    """[V, V+1]: P(first = a, second = b); column V = the round ended after a (a was the bonus)."""
    root, out = processed(table[0], *cfg), np.zeros((VOCAB, VOCAB + 1))
    for a in range(VOCAB):
        node = ROOT_CHILDREN[kind].get(a)
        if node is None:
            out[a, VOCAB] = root[a]
        else:
            out[a, :VOCAB] = root[a] * processed(table[node], *cfg)
    return out


def _perturbed(probs):
    """0.05 of mass moved from the likeliest outcome to the least likely one: a deviation the test must catch."""
    out = probs.copy()
    out[np.argmax(probs)] -= 0.05
    out[np.where(probs > 0, probs, np.inf).argmin()] += 0.05
    return out


CONFIGS = [(1.0, -1, 1.0), (1.0, 3, 1.0), (1.0, -1, 0.6), (0.7, 4, 0.8)]  # (temperature, top_k, top_p)


@pytest.mark.parametrize("kind", ["chain", "branching"])
@pytest.mark.parametrize("config_id", range(len(CONFIGS)), ids=["plain", "top_k", "top_p", "mixed"])
def test_emitted_tokens_follow_target(kind, config_id):
    cfg = CONFIGS[config_id]
    table, emitted = _sample_rounds(kind, *cfg, seed=1000 * config_id + len(kind))
    first = np.bincount(emitted[:, 0], minlength=VOCAB)
    expected_first = processed(table[0], *cfg)
    assert chi_square_pvalue(first, expected_first) > 1e-3
    assert chi_square_pvalue(first, _perturbed(expected_first)) < 1e-3  # the test has power
    second = np.where(emitted[:, 1] >= 0, emitted[:, 1], VOCAB)
    pairs = np.zeros((VOCAB, VOCAB + 1))
    np.add.at(pairs, (emitted[:, 0], second), 1)
    expected = _expected_pairs(kind, table, cfg).ravel()
    assert chi_square_pvalue(pairs.ravel(), expected) > 1e-3
    assert chi_square_pvalue(pairs.ravel(), _perturbed(expected)) < 1e-3
