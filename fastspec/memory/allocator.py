"""KV slot allocators: which slots of the KV pool are free. TokenAllocator (page size 1) and PagedAllocator.

Owns the free list, its O(1) backup_state / restore_state and `grow` (new slots past the old capacity join the
free list): the free list is a 1-D int64 tensor that is only ever replaced (sliced or concatenated), never written
in place, so a snapshot is just a reference (with the capacity: one taken before a grow cannot be restored).
Slot 0 (the whole page 0 when paged) is the dummy slot padded rows write to and is never handed out.
Does not own the K/V tensors (kv_pool.py) or request rows (req_table.py). Frees are not validated in the
hot path; `check` is the leak / double-allocation audit for tests and debug runs.
"""

from typing import Protocol

import torch

from fastspec.utils.transfer import to_device


class SlotAllocator(Protocol):
    """What the rest of fastspec asks of an allocator (TokenAllocator and PagedAllocator implement it)."""

    capacity: int  # allocatable slots 1..capacity (0 is the dummy)
    page_size: int

    def num_free(self) -> int: ...

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free slots (int64 [n]), or None with the state unchanged."""

    def alloc_extend(self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor | None,
                     host_lens: tuple[list[int], list[int]] | None = None) -> torch.Tensor | None:
        """Slots for each request growing from prefix_lens to seq_lens ([bs] int64), in request order."""

    def reserve_extend(self, prefix_lens: torch.Tensor, n: int, last_loc: torch.Tensor | None):
        """n slots per request when only the device knows prefix_lens: (slots [bs*n], what to give back later)."""

    def free(self, slots: torch.Tensor) -> None: ...

    def grow(self, capacity: int) -> None: ...

    def backup_state(self) -> object:
        """An O(1) snapshot of the free list (drafting allocates scratch slots under it)."""

    def restore_state(self, state) -> None: ...

    def check(self, held: torch.Tensor) -> None:
        """AssertionError unless the free slots and `held` partition 1..capacity."""


def check_ids(free: torch.Tensor, held: torch.Tensor, num_ids: int, unit: str) -> None:
    """Assert free and held ids partition 1..num_ids exactly; the message names the first offending id."""
    free = free.detach().to("cpu", torch.int64).flatten()
    held = held.detach().to("cpu", torch.int64).flatten()
    for state, ids in (("free", free), ("held", held)):
        outside = ids[(ids < 1) | (ids > num_ids)]
        if outside.numel():
            raise AssertionError(f"{unit} {int(outside[0])} is {state} but outside the allocatable range "
                                 f"1..{num_ids} (0 is the reserved dummy)")
    free_count = torch.bincount(free, minlength=num_ids + 1)[1:]  # [num_ids], index i -> id i + 1
    held_count = torch.bincount(held, minlength=num_ids + 1)[1:]
    problems = ((free_count > 1, "is free twice (double free)"),
                (held_count > 1, "is held twice (double allocation)"),
                ((free_count > 0) & (held_count > 0), "is both free and held"),
                (free_count + held_count == 0, "is neither free nor held (leaked)"))
    for bad, what in problems:
        ids = torch.nonzero(bad).flatten()
        if ids.numel():
            raise AssertionError(f"{unit} {int(ids[0]) + 1} {what}")


def restorable(state: tuple[int, torch.Tensor], capacity: int) -> torch.Tensor:
    """The free list of a backup_state taken at `capacity` (RuntimeError if the allocator grew since: restoring it
    would lose the new slots)."""
    taken_at, free = state
    if taken_at != capacity:
        raise RuntimeError(f"allocator state backed up at capacity {taken_at} restored at capacity {capacity}")
    return free


class TokenAllocator:
    """Page size 1: any free slot will do. Free slots start as 1..capacity."""

    page_size = 1

    def __init__(self, capacity: int, device="cpu"):
        if capacity < 1:
            raise ValueError(f"allocator capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._free = torch.arange(1, capacity + 1, dtype=torch.int64, device=device)  # [num_free]

    def num_free(self) -> int:
        return self._free.numel()

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free slots (int64 [n]), or None with the state unchanged if fewer than n are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self._free.numel():
            return None
        slots = self._free[:n].clone()  # a copy: callers may write into it without touching a snapshot
        self._free = self._free[n:]
        return slots

    def alloc_extend(self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor | None,
                     host_lens: tuple[list[int], list[int]] | None = None) -> torch.Tensor | None:
        """Page-size-1 twin of PagedAllocator.alloc_extend: no partial pages, so last_loc is unused (None will do)."""
        # prefix_lens, seq_lens, last_loc: [bs] int64
        if host_lens is not None:  # the same lengths on the host: no device read
            return self.alloc(sum(host_lens[1]) - sum(host_lens[0]))
        return self.alloc(int((seq_lens - prefix_lens).sum()))

    def reserve_extend(self, prefix_lens: torch.Tensor, n: int, last_loc: torch.Tensor | None):
        """n slots per request when only the device knows prefix_lens: (slots [bs*n], None); nothing to give back."""
        return self.alloc(prefix_lens.numel() * n), None

    def free(self, slots: torch.Tensor) -> None:
        # slots: [n] int64 (int32 accepted)
        if slots.numel():
            self._free = torch.cat([self._free, slots.flatten().to(torch.int64)])

    def grow(self, capacity: int) -> None:
        """Slots capacity_before+1 .. capacity become free (after the ones free now)."""
        if capacity < self.capacity:
            raise ValueError(f"an allocator grows: capacity {capacity} < {self.capacity}")
        new = torch.arange(self.capacity + 1, capacity + 1, dtype=torch.int64, device=self._free.device)
        self._free = torch.cat([self._free, new])
        self.capacity = capacity

    def backup_state(self) -> object:
        return self.capacity, self._free

    def restore_state(self, state) -> None:
        self._free = restorable(state, self.capacity)

    def check(self, held: torch.Tensor) -> None:
        """held: [n] every slot the caller owns. AssertionError unless free and held partition 1..capacity."""
        check_ids(self._free, held, self.capacity, "slot")


class PagedAllocator:
    """Whole pages 1..num_pages (page 0 is reserved); page p holds slots p*P .. p*P + P-1."""

    def __init__(self, capacity: int, page_size: int, device="cpu"):
        if page_size < 1 or capacity < page_size or capacity % page_size:
            raise ValueError(f"capacity {capacity} must be a positive multiple of page_size {page_size}")
        self.page_size = page_size
        self.capacity = capacity
        self.num_pages = capacity // page_size
        self._free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=device)  # [num_free]
        self._offsets = torch.arange(page_size, dtype=torch.int64, device=device)  # [P]

    def num_free(self) -> int:
        """Free tokens (= free pages * page_size)."""
        return self._free_pages.numel() * self.page_size

    def _take_pages(self, num_pages: int) -> torch.Tensor | None:
        if num_pages > self._free_pages.numel():
            return None
        pages = self._free_pages[:num_pages]  # only read, never written: no copy needed
        self._free_pages = self._free_pages[num_pages:]
        return pages

    def alloc(self, n: int) -> torch.Tensor | None:
        """All slots of n // P fresh pages (int64 [n]); None with the state unchanged if too few pages."""
        if n < 0 or n % self.page_size:
            raise ValueError(f"paged alloc needs a non-negative multiple of {self.page_size}, got {n}")
        pages = self._take_pages(n // self.page_size)
        return None if pages is None else (pages[:, None] * self.page_size + self._offsets).flatten()

    def alloc_extend(self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor,
                     host_lens: tuple[list[int], list[int]] | None = None) -> torch.Tensor | None:
        """Slots for positions prefix_lens[b] .. seq_lens[b]-1 of every request b, concatenated in order.

        Positions in the request's partial last page continue at last_loc[b]+1, last_loc[b]+2, ...
        (last_loc = slot of position prefix_lens[b]-1; ignored, pass -1, when prefix_lens[b] % P == 0); the
        rest take fresh pages. None, with the state unchanged, if there are not enough free pages.
        `host_lens` = (prefix_lens, seq_lens) as host lists, when the caller has them: the counts are taken from
        those with no device read (and the inputs are not checked: the caller's lengths are its own).
        """
        # prefix_lens, seq_lens, last_loc: [bs] int64
        P = self.page_size
        if prefix_lens.numel() == 0:
            return self._offsets.new_empty(0)
        extend_lens = seq_lens - prefix_lens  # [bs]
        owned_end = (prefix_lens + P - 1) // P * P  # [bs] first position not covered by the request's pages
        new_pages = ((seq_lens + P - 1) // P * P - owned_end).clamp_min(0) // P  # [bs]
        if host_lens is not None:
            pre, seq = host_lens
            num_tokens = sum(seq) - sum(pre)
            num_new_pages = sum(self._new_pages(p, s) for p, s in zip(pre, seq))
        else:
            partial = (prefix_lens % P != 0) & (extend_lens > 0)  # [bs] will continue a partial page
            bad_tail = partial & ((last_loc + 1) % P != prefix_lens % P)  # last_loc not at position prefix-1
            stats = torch.stack([extend_lens.sum(), new_pages.sum(), extend_lens.min(), bad_tail.sum()])
            num_tokens, num_new_pages, min_len, num_bad = stats.tolist()  # the one host sync
            if min_len < 0 or num_bad:
                raise ValueError("alloc_extend needs seq_lens >= prefix_lens and last_loc on position prefix_len-1")
        pages = self._take_pages(num_new_pages)
        if pages is None:
            return None
        first_page = torch.cumsum(new_pages, 0) - new_pages  # [bs] index of each request's first fresh page
        return self._extend_slots(prefix_lens, extend_lens, last_loc, owned_end, first_page, pages, num_tokens)

    def reserve_extend(self, prefix_lens: torch.Tensor, n: int, last_loc: torch.Tensor | None):
        """alloc_extend of n positions per request when only the device knows prefix_lens (the overlap schedule):
        each request takes the most fresh pages n positions can need, W = ceil(n / P), and uses the first ones.
        Returns (slots [bs*n], pages int64 [bs, W]), or None with the state unchanged; `unused_pages` names the
        pages to give back once the host knows prefix_lens."""
        P, bs = self.page_size, prefix_lens.numel()
        w = -(-n // P)
        pages = self._take_pages(bs * w)
        if pages is None:
            return None
        owned_end = (prefix_lens + P - 1) // P * P
        first_page = torch.arange(bs, device=pages.device) * w
        slots = self._extend_slots(prefix_lens, torch.full_like(prefix_lens, n), last_loc, owned_end, first_page,
                                   pages, bs * n)
        return slots, pages.view(bs, w)

    def unused_pages(self, pages: torch.Tensor, prefix_lens: list[int], n: int) -> torch.Tensor:
        """Slots naming the pages of a reserve_extend(prefix_lens, n) that its positions did not reach."""
        cells = [b * pages.shape[1] + j for b, p in enumerate(prefix_lens)
                 for j in range(self._new_pages(p, p + n), pages.shape[1])]
        flat = pages.flatten()
        return flat[to_device(cells, flat.device)] * self.page_size if cells else flat[:0]

    def _new_pages(self, prefix_len: int, seq_len: int) -> int:
        """Fresh pages positions prefix_len .. seq_len-1 take (host lengths; the first continue a partial page)."""
        P = self.page_size
        return max(0, -(-seq_len // P) - -(-prefix_len // P))

    def _extend_slots(self, prefix_lens, extend_lens, last_loc, owned_end, first_page, pages, num_tokens):
        """Vectorised slot assignment; pages are this call's fresh pages, request b's from first_page[b] on.

        E.g. P=4, one request with prefix 6, last_loc 9, seq 11, fresh page 3: positions 6, 7 -> slots 10, 11
        (tail of the partial page 2), positions 8, 9, 10 -> slots 12, 13, 14 (page 3).
        """
        P = self.page_size
        bs = prefix_lens.numel()
        req = torch.repeat_interleave(torch.arange(bs, device=pages.device), extend_lens,
                                      output_size=num_tokens)  # [T] request of each output token
        first_out = torch.cumsum(extend_lens, 0) - extend_lens  # [bs] output index of each request's first token
        pos = prefix_lens[req] + torch.arange(num_tokens, device=pages.device) - first_out[req]  # [T]
        in_tail = pos < owned_end[req]  # [T] inside the request's current partial page
        tail_slot = last_loc[req] + (pos - prefix_lens[req]) + 1
        page_idx = (first_page[req] + (pos - owned_end[req]) // P).clamp(0, pages.numel())  # tail rows clamp
        padded = torch.cat([pages, pages.new_zeros(1)])  # a pad entry keeps the clamped tail rows in range
        fresh_slot = padded[page_idx] * P + pos % P
        return torch.where(in_tail, tail_slot, fresh_slot)

    def free(self, slots: torch.Tensor) -> None:
        """Free the WHOLE pages unique(slots // P)."""
        # slots: [n] int64 (int32 accepted)
        if slots.numel():
            pages = torch.unique(slots.flatten().to(torch.int64) // self.page_size)
            self._free_pages = torch.cat([self._free_pages, pages])

    def grow(self, capacity: int) -> None:
        """Pages num_pages_before+1 .. capacity // P become free (after the ones free now); capacity: whole pages."""
        if capacity < self.capacity or capacity % self.page_size:
            raise ValueError(f"an allocator grows by whole pages: capacity {capacity}, was {self.capacity}, "
                             f"page size {self.page_size}")
        num_pages = capacity // self.page_size
        new = torch.arange(self.num_pages + 1, num_pages + 1, dtype=torch.int64, device=self._free_pages.device)
        self._free_pages = torch.cat([self._free_pages, new])
        self.num_pages, self.capacity = num_pages, capacity

    def backup_state(self) -> object:
        return self.capacity, self._free_pages

    def restore_state(self, state) -> None:
        self._free_pages = restorable(state, self.capacity)

    def check(self, held: torch.Tensor) -> None:
        """held: [n] slots the caller owns (each held page named by at least one slot). AssertionError unless
        no slot is held twice and free and held pages partition 1..num_pages."""
        held = held.detach().to("cpu", torch.int64).flatten()
        num_slots = (self.num_pages + 1) * self.page_size
        outside = held[(held < 0) | (held >= num_slots)]
        if outside.numel():
            raise AssertionError(f"slot {int(outside[0])} is held but outside the pool 0..{num_slots - 1}")
        twice = torch.nonzero(torch.bincount(held, minlength=num_slots) > 1).flatten()
        if twice.numel():
            raise AssertionError(f"slot {int(twice[0])} is held twice (double allocation)")
        check_ids(self._free_pages, torch.unique(held // self.page_size), self.num_pages, "page")


def make_allocator(capacity: int, page_size: int, device="cpu") -> TokenAllocator | PagedAllocator:
    if page_size == 1:
        return TokenAllocator(capacity, device)
    return PagedAllocator(capacity, page_size, device)
