"""NGRAM drafting: no draft model; proposals come from a per-request trie of the n-grams of the
request's own prompt + output, expanded as a token tree that `tree.tree_from_parents` turns into a DraftTree.

Owns: the trie (NgramCache: incremental insertion, frequency/recency ranking, eviction) and the
tree proposal (BFS or PROB). Does not own: building the DraftTree, verification, or deciding when requests
start and finish (the engine calls `update` / `release`). Runs on the host, once per round.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections import deque
from itertools import count

import torch

from fastspec.errors import FastspecError
from fastspec.spec_config import NgramParams
from fastspec.speculative.batch import DecodeBatch, ExtendBatch
from fastspec.speculative.tree import DraftTree, tree_from_parents

_TOKEN_BITS = 32  # edge key = parent node << 32 | token; token ids must lie in [0, 2**32)


class _Proposal:
    """The tree being proposed: node p (1-based) holds tokens[p-1] under parents[p-1]; 0 is the root.
    Identical tokens under one parent are merged, so parent position < own position always holds."""

    def __init__(self, size: int):
        self.size, self.tokens, self.parents = size, [], []
        self._next: list[dict[int, int]] = [{}]  # per position: token -> child position

    def add(self, parent: int, token: int) -> int | None:
        """Position of `token` under `parent` (existing or new); None when a new node does not fit."""
        pos = self._next[parent].get(token)
        if pos is None:
            if len(self.tokens) >= self.size:
                return None
            self.tokens.append(token)
            self.parents.append(parent)
            self._next.append({})
            pos = self._next[parent][token] = len(self.tokens)
        return pos


class NgramCache:
    """A trie of the paths tokens[i : i + branch_length] of every suffix start i (while i + min_window < len)
    of one growing token history; each n-gram occurrence is counted exactly once.

    Nodes are ints indexing flat lists (node 0 = root; edges in one int-keyed dict; ranked children as int
    tuples), which keeps a large trie out of Python's cyclic GC. Per node: freq = occurrences of its n-gram,
    start = suffix start of the latest one. A child's start never exceeds its parent's, so eviction, which
    frees the nodes with the earliest start deepest first (walking up from the oldest suffix's deepest
    node), only ever frees leaves."""

    def __init__(self, params: NgramParams):
        self.params = params
        self.num_nodes = 0   # trie nodes, root excluded
        self.num_tokens = 0  # length of the history inserted so far
        self._edges: dict[int, int] = {}  # parent << 32 | token -> child
        self._token, self._parent, self._freq, self._start = [-1], [-1], [0], [-1]
        self._ranked: list[tuple[int, ...]] = [()]  # children, most frequent then latest first (root: unused)
        self._free: list[int] = []
        self._frontier: deque[int] = deque()  # deepest live node of suffix oldest, oldest + 1, ...
        self._oldest = 0
        self._oldest_cut = False  # suffix `oldest` lost its deepest nodes: never extend it again

    def insert(self, tokens: list[int]) -> None:
        """Insert the history `tokens`, whose first num_tokens are the (unchanged) history of earlier calls:
        extends the suffixes cut short by the old end and adds the new ones. Work: O(new tokens * B)."""
        n, b, min_w = len(tokens), self.params.branch_length, self.params.min_match_window_size
        old = self.num_tokens
        if n < old:
            raise ValueError(f"ngram insert: the history shrank from {old} to {n} tokens")
        if n > old and not 0 <= min(tokens[old:]) <= max(tokens[old:]) < 1 << _TOKEN_BITS:
            raise ValueError("ngram insert: token ids must lie in [0, 2**32)")
        for i in range(max(0, old - b + 1), n - min_w):
            begin, end = (min(i + b, old) if i + min_w < old else i), min(i + b, n)
            if end > begin:
                self._reserve(end - begin)
                self._extend(tokens, i, begin, end)
        self.num_tokens = n

    def _extend(self, tokens: list[int], i: int, begin: int, end: int) -> None:
        """Count tokens[begin:end] on suffix i, whose path so far spells tokens[i:begin]."""
        grow = begin > i
        if grow and (i < self._oldest or (i == self._oldest and self._oldest_cut)):
            return  # evicted (whole or its tail) while still growing: leave it out
        node = self._frontier[i - self._oldest] if grow else 0
        for pos in range(begin, end):
            node = self._count(node, tokens[pos], i)
        if grow:
            self._frontier[i - self._oldest] = node
        else:
            self._frontier.append(node)

    def _count(self, parent: int, token: int, start: int) -> int:
        """Count an occurrence, starting at `start`, of parent's n-gram followed by `token`."""
        key = parent << _TOKEN_BITS | token
        child = self._edges.get(key)
        if child is None:
            child = self._edges[key] = self._new_node(parent, token, start)
            if parent:  # windows are >= 1 token: the root's children are never ranked
                self._rank(parent, child, self._ranked[parent] + (child,))
        else:
            self._freq[child] += 1
            self._start[child] = start
            if parent:
                self._rank(parent, child, self._ranked[parent])
        return child

    def _rank(self, parent: int, child: int, ranked: tuple[int, ...]) -> None:
        """Store parent's children with `child`, whose key just grew (or which is new), moved forward."""
        if len(ranked) > 1:
            old = ranked.index(child)
            new = bisect_left(ranked, self._rank_key(child), 0, old, key=self._rank_key)
            if new != old:
                ranked = ranked[:new] + (child,) + ranked[new:old] + ranked[old + 1:]
        self._ranked[parent] = ranked

    def _rank_key(self, node: int) -> int:  # ascending = best first; unique among siblings (their tokens
        return -(self._freq[node] << 40 | self._start[node])  # cannot sit at one history position)

    def _new_node(self, parent: int, token: int, start: int) -> int:
        self.num_nodes += 1
        if self._free:
            node = self._free.pop()
            self._token[node], self._parent[node], self._freq[node], self._start[node] = token, parent, 1, start
            self._ranked[node] = ()
            return node
        self._token.append(token)
        self._parent.append(parent)
        self._freq.append(1)
        self._start.append(start)
        self._ranked.append(())
        return len(self._token) - 1

    def _reserve(self, needed: int) -> None:
        """Evict until `needed` new nodes fit within the capacity."""
        while self.num_nodes + needed > self.params.capacity:
            node = self._frontier[0]
            while self._start[node] == self._oldest and not self._ranked[node]:  # deepest first: a leaf
                parent = self._parent[node]
                self._delete(node)
                node = parent
                if self.num_nodes + needed <= self.params.capacity:
                    break
            if self._start[node] == self._oldest and not self._ranked[node]:
                self._frontier[0], self._oldest_cut = node, True  # stopped early: the rest stays
            else:
                self._frontier.popleft()  # node (if not the root) belongs to a later suffix
                self._oldest, self._oldest_cut = self._oldest + 1, False

    def _delete(self, leaf: int) -> None:
        parent = self._parent[leaf]
        del self._edges[parent << _TOKEN_BITS | self._token[leaf]]
        if parent:
            ranked = self._ranked[parent]
            index = ranked.index(leaf)
            self._ranked[parent] = ranked[:index] + ranked[index + 1:]
        self._free.append(leaf)
        self.num_nodes -= 1

    def match(self, context: list[int], num_draft_tokens: int) -> tuple[list[int], list[int]]:
        """Propose up to num_draft_tokens - 1 nodes continuing `context` (its last token is the root, not
        proposed). Windows w = max..min seed the expansion in turn; returns (tokens, parent positions)."""
        proposal = _Proposal(num_draft_tokens - 1)
        expand = self._expand_bfs if self.params.match_type == "BFS" else self._expand_prob
        for anchor, window in self._anchors(context):
            if len(proposal.tokens) >= proposal.size:
                break
            expand(proposal, anchor, window)
        return proposal.tokens, proposal.parents

    def _anchors(self, context: list[int]) -> list[tuple[int, int]]:
        """(trie node spelling the last w tokens of context, w), longest window first. Walks the windows
        shortest first and stops at the first miss: a longer window can then only match the context's own
        tail at the very end of the history, a node without children. Negative tokens never match."""
        p, edges = self.params, self._edges
        anchors = []
        for window in range(p.min_match_window_size, min(len(context), p.max_match_window_size) + 1):
            node = 0
            for token in context[len(context) - window:]:
                node = edges.get(node << _TOKEN_BITS | token)
                if node is None:
                    return anchors[::-1]
            anchors.append((node, window))
        return anchors[::-1]

    def _expand_bfs(self, proposal: _Proposal, anchor: int, window: int) -> None:
        """Level order; a node at breadth b keeps its max(1, int(b)) best children, which get b - scale.
        Longer windows (more evidence) start narrower: b0 = (max_w - window) * scale + min_bfs_breadth."""
        p, scale, ranked, token = self.params, self.params.bfs_breadth_scale, self._ranked, self._token
        queue = deque([(0, (p.max_match_window_size - window) * scale + p.min_bfs_breadth, anchor)])
        while queue:
            pos, breadth, node = queue.popleft()
            for child in ranked[node][:max(1, int(breadth))]:
                child_pos = proposal.add(pos, token[child])
                if child_pos is None:
                    return
                queue.append((child_pos, breadth - scale, child))

    def _expand_prob(self, proposal: _Proposal, anchor: int, window: int) -> None:
        """Best first by path probability: a child's probability is its frequency normalised over the top
        max_bfs_breadth children of its parent, times the parent's path probability."""
        heap, order, freq = [], count(), self._freq  # heap entries (-probability, push order, parent pos, node)

        def push(pos: int, node: int, prob: float) -> None:
            top = self._ranked[node][:self.params.max_bfs_breadth]
            total = sum(freq[child] for child in top)
            for child in top:
                heapq.heappush(heap, (-prob * freq[child] / total, next(order), pos, child))

        push(0, anchor, 1.0)
        while heap:
            neg_prob, _, pos, node = heapq.heappop(heap)
            child_pos = proposal.add(pos, self._token[node])
            if child_pos is None:
                return
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


class NgramTreeDrafter:
    """NGRAM as a Drafter: per-request tries over prompt + output; no draft model, no draft KV. The tries are
    updated from each request's tokens when it drafts, so there is nothing to extend."""

    uses_extend = False
    uses_scratch = False

    def __init__(self, params: NgramParams, num_steps: int, num_draft_tokens: int):
        self.ngram = NgramDrafter(params, num_draft_tokens)
        self.num_steps = num_steps

    def draft(self, batch: DecodeBatch) -> DraftTree:  # host-side trie walk: counted as host time
        for rid, history in zip(batch.rids, batch.histories):
            self.ngram.update(rid, history)
        tokens, parents = self.ngram.propose(list(batch.rids), list(batch.histories))  # host tensors
        return tree_from_parents(batch.verified_id, tokens, parents, batch.seq_lens, self.num_steps)

    def extend(self, batch: ExtendBatch, decode_round: bool) -> None:
        pass  # the tries read tokens at draft time

    def extend_round(self, rids, rows, prefix_lens, keep_lens, input_ids, positions, features) -> None:
        pass

    def release(self, rid: int) -> None:
        self.ngram.release(rid)
