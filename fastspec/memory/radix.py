"""The radix prefix cache's tree: which KV slots already hold which token prefixes.

A compressed trie keyed by one hashable item per position (token ids; the prefix cache's are token pairs,
fastspec.engine.prefix_cache.cache_keys); each node holds the KV slots of the positions on its edge. Requests
`lock` the path they reuse or wrote (a reference count per node), so a locked node is never evicted; `evict` frees
the least recently used unlocked leaves first, whole nodes, until enough slots came back. A hybrid target's
nodes may hold a recurrent-state checkpoint; `reclaim_state` takes the least recently used one back when a running
request needs one. With pages larger than one token, only whole pages are cached (a key is cut to a multiple of
the page size), so a matched prefix always ends on a page boundary and a request continues on pages of its own.

Knows nothing about requests, models or the allocator: it returns the slots it lets go and the caller frees
them. Slot tensors are 1-D int64 on the pool's device; keys are Python tuples.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import torch

_clock = itertools.count()  # last-access stamps: a counter, not wall time (deterministic, no ties)


@dataclass(eq=False)
class RadixNode:
    key: tuple[int, ...] = ()  # the tokens on the edge from the parent
    slots: torch.Tensor | None = None  # [len(key)] their KV slots
    parent: RadixNode | None = None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)  # first page of the key -> child
    locks: int = 0  # requests using this node (and so its whole path)
    last_use: int = 0
    state: int | None = None  # hybrid targets: the checkpoint holding the recurrent state after this node's key


@dataclass(frozen=True)
class Match:
    slots: torch.Tensor  # [n] KV slots of the longest cached prefix (n a multiple of the page size)
    node: RadixNode  # its last node: lock / unlock it to protect the path


class RadixTree:
    def __init__(self, page_size: int = 1, device: str | torch.device = "cpu", drop_state=None):
        """`drop_state(checkpoint)` is called for the state checkpoint of every node evicted."""
        self.page_size, self.device, self.drop_state = page_size, device, drop_state
        self.root = RadixNode(slots=torch.zeros(0, dtype=torch.int64, device=device), locks=1)  # never evicted
        self.cached_tokens = 0  # slots held by the tree
        self.locked_tokens = 0  # of those, on a locked path

    def _page_key(self, tokens) -> tuple[int, ...]:
        """The first page of `tokens`: how a child is found among its siblings."""
        return tuple(tokens[: self.page_size])

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def match(self, tokens: list[int] | tuple[int, ...]) -> Match:
        """The longest cached page-aligned prefix of `tokens`; a node ending inside it is split there."""
        tokens = tuple(tokens[: self._aligned(len(tokens))])
        node, found, pos = self.root, [], 0
        stamp = next(_clock)
        node.last_use = stamp
        while pos < len(tokens):
            child = node.children.get(self._page_key(tokens[pos:]))
            if child is None:
                break
            common = self._common(child.key, tokens[pos:])
            if common < len(child.key):
                child = self._split(child, common)
            child.last_use = stamp
            found.append(child.slots)
            node, pos = child, pos + common
        slots = torch.cat(found) if found else self.root.slots
        return Match(slots, node)

    def insert(self, tokens: list[int] | tuple[int, ...], slots: torch.Tensor) -> int:
        """Cache `slots` ([len(tokens)]) as the KV of `tokens` (cut to whole pages). Returns how many leading
        tokens were already cached: the caller's own slots for those are duplicates it should free (the tree
        keeps the first copy). Slots past the cut are not taken either."""
        n = self._aligned(len(tokens))
        tokens, slots = tuple(tokens[:n]), slots[:n]
        node, pos, stamp = self.root, 0, next(_clock)
        while pos < n:
            node.last_use = stamp
            child = node.children.get(self._page_key(tokens[pos:]))
            if child is None:
                leaf = RadixNode(tokens[pos:], slots[pos:].clone(), node, last_use=stamp)
                node.children[self._page_key(leaf.key)] = leaf
                self.cached_tokens += len(leaf.key)
                return pos
            common = self._common(child.key, tokens[pos:])
            if common < len(child.key):
                child = self._split(child, common)
            node, pos = child, pos + common
        node.last_use = stamp
        return pos

    def match_state(self, tokens: list[int] | tuple[int, ...]) -> tuple[Match, int | None]:
        """The longest cached prefix of `tokens` that ends on a state checkpoint (hybrid targets resume there),
        and that checkpoint; (the root's empty match, None) when no node on the path has one."""
        match = self.match(tokens)
        node, depth = match.node, len(match.slots)
        while node is not self.root and node.state is None:
            node, depth = node.parent, depth - len(node.key)
        return Match(match.slots[:depth], node), node.state

    def set_state(self, tokens: list[int] | tuple[int, ...], checkpoint: int) -> bool:
        """Attach a state checkpoint to the cached prefix `tokens` (page-aligned, fully cached). False when the
        prefix is not cached whole or already has one: the caller keeps (and drops) its checkpoint."""
        match = self.match(tokens)
        if len(match.slots) != len(tokens) or match.node is self.root or match.node.state is not None:
            return False
        match.node.state = checkpoint
        return True

    def lock(self, node: RadixNode) -> None:
        """Protect `node` and every node above it from eviction (one request more uses them)."""
        while node is not self.root:
            if node.locks == 0:
                self.locked_tokens += len(node.key)
            node.locks += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not self.root:
            node.locks -= 1
            assert node.locks >= 0, "unlocked more often than locked"
            if node.locks == 0:
                self.locked_tokens -= len(node.key)
            node = node.parent

    @property
    def evictable_tokens(self) -> int:
        return self.cached_tokens - self.locked_tokens

    def evict(self, num_tokens: int) -> torch.Tensor:
        """Let go of at least `num_tokens` slots (or all that are unlocked), least recently used leaves first,
        a parent once it has become a leaf; returns the slots, which the caller frees."""
        heap = [(leaf.last_use, id(leaf), leaf) for leaf in self._leaves() if leaf.locks == 0]
        heapq.heapify(heap)
        freed, count = [], 0
        while heap and count < num_tokens:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[self._page_key(leaf.key)]
            freed.append(leaf.slots)
            if leaf.state is not None:
                self.drop_state(leaf.state)
            count += len(leaf.key)
            self.cached_tokens -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.locks == 0:
                heapq.heappush(heap, (parent.last_use, id(parent), parent))
        return torch.cat(freed) if freed else self.root.slots

    def reclaim_state(self) -> torch.Tensor | None:
        """A running request needs a state checkpoint and the tree holds them all: drop the state of the least
        recently used node, unlocked nodes first, on a tie the deepest (evict's order: leaves before parents).
        A locked node's state may go too: the request that locked it copied it into its row when it resumed and
        nothing else reads it (without this a long chat, whose path its own running turn locks, would never
        save a state past the 8th). KV at and below a node no state lies at or below is KV no request can
        resume into (a hybrid target recomputes from the deepest state), so that stretch, unlocked, goes too.
        Returns the slots let go, which the caller frees; None when the tree holds no state."""
        best, stack = None, [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            if node.state is not None and (best is None or (node.locks > 0, node.last_use, -depth) < best[0]):
                best = ((node.locks > 0, node.last_use, -depth), node)
            stack.extend((child, depth + len(child.key)) for child in node.children.values())
        if best is None:
            return None
        node = best[1]
        self.drop_state(node.state)
        node.state = None
        return self._prune(node)

    def _prune(self, node: RadixNode) -> torch.Tensor:
        """Let go of `node` with its subtree, then of each parent left a childless leaf, while the node is unlocked
        and no state lies at or below it; returns the slots."""
        freed = []
        while node is not self.root and node.locks == 0 and not self._holds_state(node):
            parent = node.parent
            del parent.children[self._page_key(node.key)]
            stack = [node]
            while stack:
                gone = stack.pop()
                freed.append(gone.slots)
                self.cached_tokens -= len(gone.key)
                stack.extend(gone.children.values())
            if parent.children:
                break
            node = parent
        return torch.cat(freed) if freed else self.root.slots

    @staticmethod
    def _holds_state(node: RadixNode) -> bool:
        """Whether a state lies in `node`'s subtree."""
        stack = [node]
        while stack:
            node = stack.pop()
            if node.state is not None:
                return True
            stack.extend(node.children.values())
        return False

    def all_slots(self) -> torch.Tensor:
        """Every slot the tree holds (for leak checks)."""
        stack, found = [self.root], []
        while stack:
            node = stack.pop()
            found.append(node.slots)
            stack.extend(node.children.values())
        return torch.cat(found)

    def all_states(self) -> list[int]:
        """Every state checkpoint the tree holds (for leak checks)."""
        stack, found = [self.root], []
        while stack:
            node = stack.pop()
            found += [] if node.state is None else [node.state]
            stack.extend(node.children.values())
        return found

    def _leaves(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root and not node.children:
                yield node
            stack.extend(node.children.values())

    def _common(self, key: tuple[int, ...], tokens: tuple[int, ...]) -> int:
        """Length of the common prefix of `key` and `tokens`, cut to whole pages."""
        n = 0
        for a, b in zip(key, tokens):
            if a != b:
                break
            n += 1
        return self._aligned(n)

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        """Cut `child`'s edge after `at` tokens (a page boundary): a new node holds the first part."""
        parent = child.parent
        head = RadixNode(child.key[:at], child.slots[:at], parent, {}, child.locks, child.last_use)  # no state:
        # a checkpoint holds the state after the child's whole key, which stays the child's
        parent.children[self._page_key(head.key)] = head
        child.key, child.slots, child.parent = child.key[at:], child.slots[at:], head
        head.children[self._page_key(child.key)] = child
        return head
