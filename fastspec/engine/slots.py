"""KV slots for a batch of requests: allocate the positions a step appends, write them into the request->slot
table, and make room by evicting from the prefix cache. Lengths come from the host, so the allocator reads
nothing back from the device. Which slots a speculative round keeps is the round's commit (spec_rounds)."""

from __future__ import annotations

import torch

from fastspec.engine.prefix_cache import PrefixCache
from fastspec.engine.scheduler import Request
from fastspec.errors import FastspecError
from fastspec.memory import ReqToTokenTable, SlotAllocator
from fastspec.utils.transfer import to_device


class BatchSlots:
    def __init__(self, allocator: SlotAllocator, table: ReqToTokenTable, cache: PrefixCache | None, device):
        self.allocator, self.table, self.cache, self.device = allocator, table, cache, device

    def available(self) -> int:
        """Free KV slots, counting what the prefix cache would give back (its unlocked entries)."""
        return self.allocator.num_free() + (self.cache.evictable if self.cache is not None else 0)

    def make_room(self, num_tokens: int) -> None:
        """Evict from the prefix cache until `num_tokens` slots are free (the engine checked they can be), so
        nothing inside a step (drafting's scratch, verify, commit) ever needs to evict."""
        if self.cache is not None:
            self.cache.make_room(num_tokens)

    def extend(self, reqs: list[Request], lens: list[int]):
        """Allocate slots for lens[b] new tokens of each request; (rows, prefix, ext, positions), int64 on the
        device: [bs], [bs], [bs], [sum(lens)]."""
        rows = to_device([r.row for r in reqs], self.device)
        prefix = to_device([r.seq_len for r in reqs], self.device)
        ext = to_device(lens, self.device)
        starts = [r.seq_len for r in reqs]
        self.alloc(rows, prefix, prefix + ext, (starts, [s + n for s, n in zip(starts, lens)]))
        positions = to_device([p for s, n in zip(starts, lens) for p in range(s, s + n)], self.device)
        return rows, prefix, ext, positions

    def alloc(self, rows: torch.Tensor, prefix: torch.Tensor, seq_lens: torch.Tensor,
              host_lens: tuple[list[int], list[int]]) -> None:
        """Slots for positions prefix..seq_lens-1 of each row into the table; `host_lens` = the same two lengths
        on the host."""
        slots = self.allocator.alloc_extend(prefix, seq_lens, self.last_loc(rows, prefix), host_lens)
        if slots is None:
            raise FastspecError("KV pool exhausted")  # unreachable: a round's headroom is checked before it runs
        if all(end - start == 1 for start, end in zip(*host_lens)):  # a decode step: one position each
            self.table.write_next(rows, prefix, slots)
        else:
            self.table.write(rows, prefix, seq_lens - prefix, slots)

    def last_loc(self, rows: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor | None:
        """int64 [bs]: the slot of each row's position prefix-1 (-1 for an empty prefix); None at page size 1,
        whose allocator has no partial pages to continue (three launches a round saved)."""
        if self.allocator.page_size == 1:
            return None
        return torch.where(prefix > 0, self.table.table[rows, (prefix - 1).clamp(min=0)].long(), -1)
