"""NGRAM drafting (reference §8): no draft model; proposals come from a per-request trie of the n-grams of the
request's own prompt + output, expanded as a token tree that `tree.tree_from_parents` turns into a DraftTree.

Owns: NgramParams, the trie (NgramCache: incremental insertion, frequency/recency ranking, LRU-leaf eviction)
and the tree proposal (BFS or PROB). Does not own: building the DraftTree, verification, or deciding when
requests start and finish (the engine calls `update` / `release`). Runs on the host, once per round.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections import OrderedDict, deque
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
    """A trie node = the n-gram spelled by its root path. freq = occurrences (suffix starts) of that n-gram;
    stamp = history position of its last token in the latest occurrence (recency, unique among siblings)."""

    __slots__ = ("token", "parent", "children", "ranked", "freq", "stamp")

    def __init__(self, token: int, parent: _Node | None):
        self.token, self.parent = token, parent
        self.children: dict[int, _Node] = {}
        self.ranked: list[_Node] = []  # children sorted by _rank_key: most frequent first, then most recent
        self.freq, self.stamp = 0, -1


def _rank_key(node: _Node) -> tuple[int, int]:
    return -node.freq, -node.stamp


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
    """A trie of the paths tokens[i : i + branch_length] for every suffix start i of one token history.

    Recency for eviction is an LRU over nodes in which every node is more recent than its children (a path is
    touched deepest first), so the least recent node is always a leaf."""

    def __init__(self, params: NgramParams):
        self.params = params
        self.root = _Node(-1, None)
        self._lru: OrderedDict[_Node, None] = OrderedDict()  # every node but the root, least recent first

    @property
    def num_nodes(self) -> int:
        return len(self._lru)

    def insert(self, tokens: list[int], start: int = 0) -> None:
        """Add the history `tokens` to the trie, given that tokens[:start] (unchanged) were added by an earlier
        call. Suffix i (kept while i + min_window < len) owns the path tokens[i : i + branch_length]; a path
        cut short by the old end is extended, its old part only walked, so every n-gram occurrence is counted
        exactly once and the result equals one call with start = 0. Work: O((new tokens + B) * B)."""
        n, b, min_w = len(tokens), self.params.branch_length, self.params.min_match_window_size
        if not 0 <= start <= n:
            raise ValueError(f"ngram insert: start={start} outside [0, {n}]")
        for i in range(max(0, start - b + 1), n - min_w):
            done = min(i + b, start) if i + min_w < start else i  # end of what the earlier call inserted
            end = min(i + b, n)
            if end > done:
                self._insert_path(tokens, i, done, end)

    def _insert_path(self, tokens: list[int], i: int, done: int, end: int) -> None:
        self._reserve(end - i)
        node, path = self.root, []
        for pos in range(i, end):
            node = self._child(node, tokens[pos], pos, count_it=pos >= done)
            path.append(node)
        for node in reversed(path):  # ancestors end up more recent than their descendants
            self._lru.move_to_end(node)

    def _child(self, parent: _Node, token: int, pos: int, count_it: bool) -> _Node:
        """The child `token` of `parent`, created if missing; counts the occurrence ending at `pos`."""
        child = parent.children.get(token)
        if child is None:
            child = parent.children[token] = _Node(token, parent)
            self._lru[child] = None
        elif not count_it:
            return child
        else:
            _unrank(parent, child)
        child.freq += 1
        child.stamp = max(child.stamp, pos)
        insort(parent.ranked, child, key=_rank_key)
        return child

    def _reserve(self, count_needed: int) -> None:
        """Evict least-recently-used leaves until `count_needed` new nodes fit within the capacity."""
        while self._lru and len(self._lru) + count_needed > self.params.capacity:
            leaf, _ = self._lru.popitem(last=False)
            if leaf.children:
                raise RuntimeError("ngram cache: LRU order broken, least recent node has children")
            _unrank(leaf.parent, leaf)
            del leaf.parent.children[leaf.token]

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


def _unrank(parent: _Node, child: _Node) -> None:
    """Remove `child` from parent.ranked (keys are unique: siblings never share a stamp)."""
    index = bisect_left(parent.ranked, _rank_key(child), key=_rank_key)
    del parent.ranked[index]


class NgramDrafter:
    """Per-request caches keyed by request id; pads every proposal to exactly num_draft_tokens - 1 nodes."""

    def __init__(self, params: NgramParams, num_draft_tokens: int):
        if num_draft_tokens < 2:
            raise FastspecError(f"NGRAM needs num_draft_tokens >= 2, got {num_draft_tokens}")
        self.params, self.num_draft_tokens = params, num_draft_tokens
        self._caches: dict[int, NgramCache] = {}
        self._inserted: dict[int, int] = {}  # rid -> how many leading tokens the cache already holds

    @property
    def num_steps(self) -> int:
        """Deepest possible proposal node: bounded by the tree size and by the trie depth below a window."""
        return min(self.num_draft_tokens - 1, self.params.branch_length - self.params.min_match_window_size)

    def update(self, rid: int, tokens: list[int]) -> None:
        """Insert what is new in the request's full token list (prompt + output); call after every round."""
        done = self._inserted.get(rid, 0)
        if len(tokens) < done:
            raise ValueError(f"ngram update: request {rid} shrank from {done} to {len(tokens)} tokens")
        if rid not in self._caches:
            self._caches[rid] = NgramCache(self.params)
        self._caches[rid].insert(tokens, done)
        self._inserted[rid] = len(tokens)

    def release(self, rid: int) -> None:
        self._caches.pop(rid, None)
        self._inserted.pop(rid, None)

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
