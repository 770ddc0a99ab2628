"""fastspec.speculative.ngram against a brute-force oracle that recounts n-gram continuations straight from the
history (hypothesis): proposals equal the oracle's, are valid trees of seen n-grams even under eviction, and feed
tree_from_parents in batches."""

from __future__ import annotations

import heapq
from collections import deque

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ngram_helpers import cache_of, node_depths, occurs, trie_ngrams

from fastspec.speculative.ngram import NgramCache, NgramDrafter, NgramParams
from fastspec.speculative.tree import tree_from_parents


# ---------------------------------------------------------------------------------------------------------
# Brute-force oracle: no trie, every count is recomputed from the history
# ---------------------------------------------------------------------------------------------------------

def oracle_children(history: list[int], gram: list[int], p: NgramParams) -> list[tuple[int, int]]:
    """(token, count) continuing `gram`, best first (count, then latest occurrence): one per suffix start i
    with i + min_window < len whose first len(gram) + 1 <= branch_length tokens are gram + [token]."""
    n, length = len(history), len(gram)
    stats: dict[int, tuple[int, int]] = {}
    if length + 1 > p.branch_length:
        return []
    for i in range(n - length):
        if i + p.min_match_window_size < n and history[i:i + length] == gram:
            freq, _ = stats.get(history[i + length], (0, -1))
            stats[history[i + length]] = (freq + 1, i)
    ranked = sorted(stats, key=lambda t: (-stats[t][0], -stats[t][1]))
    return [(t, stats[t][0]) for t in ranked]


class _OracleTree:
    def __init__(self, size: int):
        self.size, self.tokens, self.parents, self.index = size, [], [], {}

    def add(self, parent: int, token: int) -> int | None:
        if (parent, token) not in self.index:
            if len(self.tokens) == self.size:
                return None
            self.tokens.append(token)
            self.parents.append(parent)
            self.index[parent, token] = len(self.tokens)
        return self.index[parent, token]


def _oracle_bfs(history, tree, p, window: list[int]) -> None:
    scale = (p.max_bfs_breadth - p.min_bfs_breadth) / (p.max_match_window_size - p.min_match_window_size + 1)
    queue = deque([(0, (p.max_match_window_size - len(window)) * scale + p.min_bfs_breadth, window)])
    while queue:
        pos, breadth, gram = queue.popleft()
        for token, _ in oracle_children(history, gram, p)[:max(1, int(breadth))]:
            child = tree.add(pos, token)
            if child is None:
                return
            queue.append((child, breadth - scale, gram + [token]))


def _oracle_prob(history, tree, p, window: list[int]) -> None:
    heap, order = [], 0

    def push(pos, gram, prob):
        nonlocal order
        top = oracle_children(history, gram, p)[:p.max_bfs_breadth]
        total = sum(f for _, f in top)
        for token, f in top:
            heapq.heappush(heap, (-prob * f / total, order, pos, gram + [token]))
            order += 1

    push(0, window, 1.0)
    while heap:
        neg_prob, _, parent, gram = heapq.heappop(heap)
        pos = tree.add(parent, gram[-1])
        if pos is None:
            return
        push(pos, gram, -neg_prob)


def oracle_propose(history: list[int], context: list[int], p: NgramParams, num_draft_tokens: int):
    tree = _OracleTree(num_draft_tokens - 1)
    for w in range(min(len(context), p.max_match_window_size), p.min_match_window_size - 1, -1):
        if len(tree.tokens) == tree.size:
            break
        (_oracle_bfs if p.match_type == "BFS" else _oracle_prob)(history, tree, p, list(context[-w:]))
    return tree.tokens, tree.parents


@st.composite
def scenarios(draw, max_len=40):
    min_w = draw(st.integers(1, 3))
    max_w = min_w + draw(st.integers(0, 2))
    min_b = draw(st.integers(1, 3))
    params = NgramParams(min_match_window_size=min_w, max_match_window_size=max_w,
                         branch_length=max_w + draw(st.integers(1, 3)), min_bfs_breadth=min_b,
                         max_bfs_breadth=min_b + draw(st.integers(0, 3)),
                         match_type=draw(st.sampled_from(["BFS", "PROB"])))
    length = draw(st.integers(0, max_len))
    history = draw(st.lists(st.integers(0, 3), min_size=length, max_size=length))
    cuts = sorted(draw(st.lists(st.integers(0, len(history)), max_size=5)))
    extra = draw(st.lists(st.integers(0, 4), max_size=2))
    return params, history, cuts, extra, draw(st.integers(2, 10))


def _incremental(params: NgramParams, history: list[int], cuts: list[int]) -> NgramCache:
    cache = NgramCache(params)
    for end in cuts + [len(history)]:
        cache.insert(history[:end])
    return cache


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_proposals_match_the_bruteforce_oracle(scenario):
    params, history, cuts, extra, n = scenario
    caches = [cache_of(history, **params.__dict__), _incremental(params, history, cuts),
              _incremental(params, history, list(range(len(history))))]  # at once, in chunks, per token
    for context in (history, history + extra, history[:len(history) // 2]):
        expected = oracle_propose(history, context, params, n)
        assert [cache.match(context, n) for cache in caches] == [expected] * 3


@settings(max_examples=150, deadline=None)
@given(scenarios(max_len=80), st.integers(0, 30))
def test_proposals_are_valid_trees_of_seen_ngrams_even_under_eviction(scenario, spare):
    params, history, cuts, extra, n = scenario
    params = NgramParams(**(params.__dict__ | dict(capacity=params.branch_length + spare)))
    cache = NgramCache(params)
    for end in cuts + [len(history)]:
        cache.insert(history[:end])
        grams = trie_ngrams(cache)
        assert len(grams) == cache.num_nodes <= params.capacity
        assert all(occurs(gram, history[:end]) for gram in grams)
    context = history + extra
    row_tokens, row_parents = cache.match(context, n)
    assert len(row_tokens) == len(row_parents) <= n - 1
    paths = [[]]
    for pos, (token, parent) in enumerate(zip(row_tokens, row_parents), start=1):
        assert 0 <= parent < pos
        paths.append(paths[parent] + [token])
        assert occurs(context[-params.min_match_window_size:] + paths[pos], history)
        assert len(paths[pos]) <= NgramDrafter(params, n).num_steps
    assert len({(p, t) for t, p in zip(row_tokens, row_parents)}) == len(row_tokens)  # siblings merged


@settings(max_examples=25, deadline=None)
@given(scenarios(), st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), min_size=1, max_size=6))
def test_batched_proposals_feed_tree_from_parents(scenario, histories):
    params, _, _, _, n = scenario
    drafter = NgramDrafter(params, n)
    for rid, history in enumerate(histories):
        drafter.update(rid, history)
    tokens, parents = drafter.propose(list(range(len(histories))), histories)
    assert tokens.shape == parents.shape == (len(histories), n - 1)
    seq_lens = torch.tensor([len(h) - 1 for h in histories])
    tree = tree_from_parents(torch.tensor([h[-1] for h in histories]), tokens, parents, seq_lens,
                             drafter.num_steps)
    depths = [node_depths(row) for row in parents.tolist()]
    assert tree.positions.tolist() == [seq_lens[b].item() + d for b in range(len(histories)) for d in depths[b]]
    assert max(max(d) for d in depths) <= drafter.num_steps
