"""The worker's prefix cache: finished requests' KV kept in a radix tree of token prefixes for later reuse.

Owns the tree, evicts from it into the allocator when the worker needs room, starts a new request on its
longest cached prefix (writing the reused slots into its table row) and takes a released request's KV in. For a
hybrid target it also keeps recurrent-state checkpoints (fastspec.memory.state_checkpoints): a request resumes
only where a state was saved. Knows nothing about models or rounds.
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
        self.allocator, self.table, self.page_size, self.device, self.states = allocator, table, page_size, device, states
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

    def reuse(self, r: Request, shifted: bool) -> None:
        """Start `r` (its row just allocated) on the longest cached prefix of what it must prefill, leaving at
        least one token to prefill. `shifted` (a drafter that extends): less its last token, since an EAGLE
        draft's KV at position p was made with token p+1, which the cache's key does not hold (with pages, that
        costs up to a page). A hybrid target resumes on the deepest saved state of that prefix."""
        ids = r.prefill_ids
        matched = len(self.tree.match(ids).slots)
        reuse = max(min(matched - shifted, len(ids) - 1), 0)
        cut = ids[: reuse - reuse % self.page_size]
        match = resume(self.states, self.tree, r, cut) if self.states is not None else self.tree.match(cut)
        self.tree.lock(match.node)
        n = len(match.slots)
        if n:
            rows, start = to_device([r.row], self.device), torch.zeros(1, dtype=torch.int64, device=self.device)
            self.table.write(rows, start, to_device([n], self.device), match.slots)
        r.seq_len, r.cached_len, r.cached_node = n, n, match.node
        self.reused_tokens += n

    def take(self, r: Request, slots: torch.Tensor) -> None:
        """A released request's KV ([r.seq_len] slots): its tokens' whole pages go into the tree; what the tree
        already holds and what lies past the last page are freed."""
        known = min(r.seq_len, len(r.history))  # past a stop, an accepted run's KV has no tokens here
        already = self.tree.insert(r.history[:known], slots[:known])
        if self.states is not None:
            hand_over(self.states, self.tree, r, known)
        kept = known - known % self.page_size
        self.allocator.free(torch.cat([slots[r.cached_len:already], slots[kept:]]))
        self.tree.unlock(r.cached_node)
        r.cached_node, r.cached_len = None, 0

    def check(self, running) -> torch.Tensor:
        """The slots the tree holds (for the KV leak check), after checking the state checkpoints."""
        if self.states is not None:
            check_checkpoints(self.states, self.tree, running)
        return self.tree.all_slots()
