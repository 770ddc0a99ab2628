"""The worker's prefix cache: finished requests' KV kept in a radix tree of token prefixes for later reuse.

Owns the tree, evicts from it into the allocator when the worker needs room, starts a new request on its
longest cached prefix (writing the reused slots into its table row) and takes a released request's KV in. The
tree is keyed by token pairs (`cache_keys`), so the draft KV it keeps is exact for every request reusing it.
For a hybrid target it also keeps recurrent-state checkpoints (fastspec.memory.state_checkpoints): a request
resumes only where a state was saved. Knows nothing about models or rounds.
"""

from __future__ import annotations

import torch

from fastspec.engine.scheduler import Request
from fastspec.memory.radix import RadixTree
from fastspec.memory.state_checkpoints import check as check_checkpoints
from fastspec.memory.state_checkpoints import hand_over, resume
from fastspec.utils.transfer import to_device


class PrefixCache:
    def __init__(self, allocator, table, page_size: int, device, states=None):
        """`states`: a hybrid target's StatePool (with checkpoints), else None."""
        self.allocator, self.table, self.page_size = allocator, table, page_size
        self.device, self.states = device, states
        self.tree = RadixTree(page_size, device, states.drop if states is not None else None)
        self.reused_tokens = 0  # prompt tokens whose KV came from the cache instead of a prefill

    @property
    def evictable(self) -> int:
        return self.tree.evictable_tokens

    def flush(self) -> None:
        """Hand every unlocked entry back to the allocator."""
        self.allocator.free(self.tree.evict(self.tree.cached_tokens))

    def make_room(self, num_tokens: int) -> None:
        """Evict until `num_tokens` slots are free (or nothing unlocked is left)."""
        short = num_tokens - self.allocator.num_free()
        if short > 0:
            self.allocator.free(self.tree.evict(short))

    def reclaim_state(self) -> bool:
        """A running request needs a state checkpoint and none is free: the tree's least recently used one goes
        back to the state pool, and the KV only it made resumable back to the allocator. False: the tree holds
        none."""
        freed = self.tree.reclaim_state()
        if freed is None:
            return False
        self.allocator.free(freed)
        return True

    def reuse(self, r: Request) -> None:
        """Start `r` (its row just allocated) on the longest cached prefix of what it must prefill (its keys leave
        the last token to prefill). A hybrid target resumes on the deepest saved state of that prefix. A request
        asking for prompt logprobs starts on none (a cached position has no logits to report)."""
        keys = [] if r.params.prompt_logprobs is not None else cache_keys(r.prefill_ids)
        match = resume(self.states, self.tree, r, keys) if self.states is not None else self.tree.match(keys)
        self.tree.lock(match.node)
        n = len(match.slots)
        if n:
            rows, start = to_device([r.row], self.device), torch.zeros(1, dtype=torch.int64, device=self.device)
            self.table.write(rows, start, to_device([n], self.device), match.slots)
        r.seq_len, r.cached_len, r.cached_node = n, n, match.node
        self.reused_tokens += n

    def take(self, r: Request, slots: torch.Tensor) -> None:
        """A released request's KV ([r.seq_len] slots): the whole pages of the positions whose next token it knows
        go into the tree; what the tree already holds and what lies past the last page are freed."""
        history = r.history
        known = min(r.seq_len, len(history))  # past a stop, an accepted run's KV has no tokens here
        keys = cache_keys(history[:known + 1])
        already = self.tree.insert(keys, slots[:len(keys)])
        if self.states is not None:
            hand_over(self.states, self.tree, r, keys)
        kept = len(keys) - len(keys) % self.page_size
        self.allocator.free(torch.cat([slots[r.cached_len:already], slots[kept:]]))
        self.tree.unlock(r.cached_node)
        r.cached_node, r.cached_len = None, 0

    def check(self, running) -> torch.Tensor:
        """The slots the tree holds (for the KV leak check), after checking the state checkpoints."""
        if self.states is not None:
            check_checkpoints(self.states, self.tree, running)
        return self.tree.all_slots()


def cache_keys(tokens: list[int]) -> list[tuple[int, int]]:
    """The tree's key of a token sequence: (token p, token p+1) for each position p but the last.

    A slot holds the target's KV of position p, made from tokens 0..p, and an EAGLE draft's KV of position p,
    made from the target's feature at p and token p+1. Keyed by pairs, two sequences share a slot only where
    both agree, so a request reusing a prefix finds the draft KV its own next tokens would have made (keyed by
    tokens alone, a slot at a branch of the tree would hold the draft KV of the sequence that wrote it)."""
    return list(zip(tokens, tokens[1:]))
