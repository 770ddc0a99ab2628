"""NGRAM drafting (reference §8): no draft model; proposals come from a per-request trie of the n-grams of the
request's own prompt + output, expanded as a token tree that `tree.tree_from_parents` turns into a DraftTree.

Owns: NgramParams, the trie (NgramCache: incremental insertion, frequency/recency ranking, LRU-leaf eviction)
and the tree proposal (BFS or PROB). Does not own: building the DraftTree, verification, or deciding when
requests start and finish (the engine calls `update` / `release`). Runs on the host, once per round.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass
from itertools import count

import torch

from fastspec.errors import FastspecError

MATCH_TYPES = ("BFS", "PROB")


@dataclass(frozen=True)
class NgramParams:
    """SGLang's speculative_ngram_* flags. Windows are n-gram lengths matched against the context's tail;
    branch_length is the longest trie path (window + proposal); breadths bound children per tree level."""

    min_match_window_size: int = 1
    max_match_window_size: int = 12
    min_bfs_breadth: int = 1
    max_bfs_breadth: int = 10
    match_type: str = "BFS"     # "BFS": breadth-limited BFS | "PROB": best-first by path probability
    branch_length: int = 18
    capacity: int = 1_000_000   # max trie nodes per cache; least-recently-used leaves are evicted beyond it

    def __post_init__(self):
        checks = (
            (self.min_match_window_size >= 1, "ngram min_match_window_size must be >= 1"),
            (self.min_match_window_size <= self.max_match_window_size,
             "ngram min_match_window_size must be <= max_match_window_size"),
            (self.max_match_window_size < self.branch_length,
             "ngram max_match_window_size must be < branch_length (a matched window needs room to continue)"),
            (self.min_bfs_breadth >= 1, "ngram min_bfs_breadth must be >= 1"),
            (self.min_bfs_breadth <= self.max_bfs_breadth, "ngram min_bfs_breadth must be <= max_bfs_breadth"),
            (self.match_type in MATCH_TYPES, f"ngram match_type must be one of {', '.join(MATCH_TYPES)}"),
            (self.capacity >= self.branch_length, "ngram capacity must be >= branch_length"),
        )
        for ok, message in checks:
            if not ok:
                raise FastspecError(f"{message} (got {self})")

    @property
    def bfs_breadth_scale(self) -> float:  # breadth lost per window size below the max and per tree level
        windows = self.max_match_window_size - self.min_match_window_size + 1
        return (self.max_bfs_breadth - self.min_bfs_breadth) / windows


class _Node:
    """A trie node = the n-gram spelled by its root path. freq = its occurrences (suffix starts); start = the
    suffix start of its latest occurrence. A child never has a later start than its parent."""

    __slots__ = ("token", "parent", "children", "ranked", "freq", "start")

    def __init__(self, token: int, parent: _Node | None, start: int):
        self.token, self.parent, self.freq, self.start = token, parent, 1, start
        self.children: dict[int, _Node] = {}
        self.ranked: list[_Node] = []  # children, most frequent first, then latest start first


def _rank_key(node: _Node) -> tuple[int, int]:  # ascending = best first; unique among siblings, whose tokens
    return -node.freq, -node.start                # cannot sit at the same history position


class _Proposal:
    """The tree being proposed: node p (1-based) holds tokens[p-1] under parents[p-1]; 0 is the root.
    Identical tokens under one parent are merged, so parent position < own position always holds."""

    def __init__(self, size: int):
        self.size, self.tokens, self.parents = size, [], []
        self._next: list[dict[int, int]] = [{}]  # per position: token -> child position

    @property
    def full(self) -> bool:
        return len(self.tokens) >= self.size

    def add(self, parent: int, token: int) -> int | None:
        """Position of `token` under `parent` (existing or new); None when a new node does not fit."""
        pos = self._next[parent].get(token)
        if pos is None:
            if self.full:
                return None
            self.tokens.append(token)
            self.parents.append(parent)
            self._next.append({})
            pos = self._next[parent][token] = len(self.tokens)
        return pos


class NgramCache:
    """A trie of the paths tokens[i : i + branch_length] of every suffix start i (while i + min_window < len)
    of one growing token history; each n-gram occurrence is counted exactly once.

    Eviction is least-recently-occurred first: it frees the nodes whose latest occurrence starts earliest,
    deepest first, walking up from the oldest suffix's deepest node; those are always leaves."""

    def __init__(self, params: NgramParams):
        self.params = params
        self.root = _Node(-1, None, -1)
        self.num_nodes = 0   # trie nodes, root excluded
        self.num_tokens = 0  # length of the history inserted so far
        self._frontier: deque[_Node] = deque()  # deepest live node of suffix oldest, oldest + 1, ...
        self._oldest = 0
        self._oldest_cut = False  # suffix `oldest` lost its deepest nodes: never extend it

    def insert(self, tokens: list[int]) -> None:
        """Insert the history `tokens`, whose first num_tokens are the (unchanged) history of earlier calls:
        extends the suffixes cut short by the old end and adds the new ones. Work: O(new tokens * B)."""
        n, b, min_w = len(tokens), self.params.branch_length, self.params.min_match_window_size
        old = self.num_tokens
        if n < old:
            raise ValueError(f"ngram insert: the history shrank from {old} to {n} tokens")
        for i in range(max(0, old - b + 1), n - min_w):
            begin, end = (min(i + b, old) if i + min_w < old else i), min(i + b, n)
            if end > begin:
                self._reserve(end - begin)
                self._extend(tokens, i, begin, end)
        self.num_tokens = n

    def _extend(self, tokens: list[int], i: int, begin: int, end: int) -> None:
        """Add tokens[begin:end] to suffix i, whose path so far spells tokens[i:begin]."""
        if begin > i and (i < self._oldest or (i == self._oldest and self._oldest_cut)):
            return  # evicted (whole or its tail) while still growing: leave it out
        node = self._frontier[i - self._oldest] if begin > i else self.root
        for pos in range(begin, end):
            node = self._count(node, tokens[pos], i)
        if begin > i:
            self._frontier[i - self._oldest] = node
        else:
            self._frontier.append(node)

    def _count(self, parent: _Node, token: int, start: int) -> _Node:
        """Count an occurrence, starting at `start`, of parent's n-gram followed by `token`."""
        child = parent.children.get(token)
        if child is None:
            child = parent.children[token] = _Node(token, parent, start)
            self.num_nodes += 1
            if parent is not self.root:  # windows are >= 1 token: the root's children are never ranked
                insort(parent.ranked, child, key=_rank_key)
            return child
        ranked = parent.ranked
        old = bisect_left(ranked, _rank_key(child), key=_rank_key) if len(ranked) > 1 else 0
        child.freq += 1
        child.start = start
        if old:  # the key only grows: the child moves towards the front
            new = bisect_left(ranked, _rank_key(child), hi=old, key=_rank_key)
            if new != old:
                del ranked[old]
                ranked.insert(new, child)
        return child

    def _reserve(self, needed: int) -> None:
        """Evict until `needed` new nodes fit within the capacity."""
        while self.num_nodes + needed > self.params.capacity:
            node = self._frontier[0]
            while node.start == self._oldest and not node.children:  # deepest first: always a leaf
                if node.parent is not self.root:
                    node.parent.ranked.remove(node)
                del node.parent.children[node.token]
                self.num_nodes -= 1
                node = node.parent
                if self.num_nodes + needed <= self.params.capacity:
                    break
            if node.start == self._oldest and not node.children:
                self._frontier[0], self._oldest_cut = node, True  # stopped early: the rest stays
            else:
                self._frontier.popleft()  # node (if not the root) belongs to a later suffix
                self._oldest, self._oldest_cut = self._oldest + 1, False

    def match(self, context: list[int], num_draft_tokens: int) -> tuple[list[int], list[int]]:
        """Propose up to num_draft_tokens - 1 nodes continuing `context` (its last token is the root, not
        proposed). Windows w = max..min seed the expansion in turn; returns (tokens, parent positions)."""
        proposal = _Proposal(num_draft_tokens - 1)
        expand = self._expand_bfs if self.params.match_type == "BFS" else self._expand_prob
        for anchor, window in self._anchors(context):
            if proposal.full:
                break
            expand(proposal, anchor, window)
        return proposal.tokens, proposal.parents

    def _anchors(self, context: list[int]) -> list[tuple[_Node, int]]:
        """Trie nodes spelling the last w tokens of context, longest window first."""
        p = self.params
        anchors = []
        for window in range(min(len(context), p.max_match_window_size), p.min_match_window_size - 1, -1):
            node = self.root
            for token in context[len(context) - window:]:
                node = node.children.get(token)
                if node is None:
                    break
            if node is not None:
                anchors.append((node, window))
        return anchors

    def _expand_bfs(self, proposal: _Proposal, anchor: _Node, window: int) -> None:
        """Level order; a node at breadth b keeps its max(1, int(b)) best children, which get b - scale.
        Longer windows (more evidence) start narrower: b0 = (max_w - window) * scale + min_bfs_breadth."""
        p, scale = self.params, self.params.bfs_breadth_scale
        queue = deque([(0, (p.max_match_window_size - window) * scale + p.min_bfs_breadth, anchor)])
        while queue and not proposal.full:
            pos, breadth, node = queue.popleft()
            for child in node.ranked[:max(1, int(breadth))]:
                child_pos = proposal.add(pos, child.token)
                if child_pos is None:
                    return
                queue.append((child_pos, breadth - scale, child))

    def _expand_prob(self, proposal: _Proposal, anchor: _Node, window: int) -> None:
        """Best first by path probability: a child's probability is its frequency normalised over the top
        max_bfs_breadth children of its parent, times the parent's path probability."""
        heap, order = [], count()  # entries (-probability, push order, parent position, trie node)

        def push(pos: int, node: _Node, prob: float) -> None:
            top = node.ranked[:self.params.max_bfs_breadth]
            total = sum(child.freq for child in top)
            for child in top:
                heapq.heappush(heap, (-prob * child.freq / total, next(order), pos, child))

        push(0, anchor, 1.0)
        while heap and not proposal.full:
            neg_prob, _, pos, node = heapq.heappop(heap)
            child_pos = proposal.add(pos, node.token)
            if child_pos is not None:
                push(child_pos, node, -neg_prob)


class NgramDrafter:
    """Per-request caches keyed by request id; pads every proposal to exactly num_draft_tokens - 1 nodes."""

    def __init__(self, params: NgramParams, num_draft_tokens: int):
        if num_draft_tokens < 2:
            raise FastspecError(f"NGRAM needs num_draft_tokens >= 2, got {num_draft_tokens}")
        self.params, self.num_draft_tokens = params, num_draft_tokens
        self._caches: dict[int, NgramCache] = {}

    @property
    def num_steps(self) -> int:
        """Deepest possible proposal node: bounded by the tree size and by the trie depth below a window."""
        return min(self.num_draft_tokens - 1, self.params.branch_length - self.params.min_match_window_size)

    def update(self, rid: int, tokens: list[int]) -> None:
        """Insert what is new in the request's full token list (prompt + output); call after every round."""
        if rid not in self._caches:
            self._caches[rid] = NgramCache(self.params)
        self._caches[rid].insert(tokens)

    def release(self, rid: int) -> None:
        self._caches.pop(rid, None)

    def propose(self, rids: list[int], contexts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens int64 [bs, N-1], parents int64 [bs, N-1]); short proposals are padded with token 0 under the
        root: verification accepts a draft only if the target itself emits it, so a pad is harmless."""
        size = self.num_draft_tokens - 1
        tokens, parents = [], []
        for rid, context in zip(rids, contexts, strict=True):
            cache = self._caches.get(rid)
            if cache is None:
                raise ValueError(f"ngram propose: request {rid} has no cache (update it first)")
            row_tokens, row_parents = cache.match(context, self.num_draft_tokens)
            pad = size - len(row_tokens)
            tokens += row_tokens + [0] * pad
            parents += row_parents + [0] * pad
        shape = (len(rids), size)
        return (torch.tensor(tokens, dtype=torch.int64).view(shape),
                torch.tensor(parents, dtype=torch.int64).view(shape))
