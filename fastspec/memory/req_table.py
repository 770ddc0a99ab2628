"""Request -> KV slot table: row r belongs to one running request, entry [r, j] = KV slot of its position j.

Owns the int32 table (the layout SGLang / flashinfer index with) and the free list of rows. Does not
allocate KV slots (allocator.py) and does not know sequence lengths: callers read only the positions they
have written. Freed rows keep stale entries; they are overwritten before anything reads them again.
"""

from collections import deque

import torch


class ReqToTokenTable:
    """Row r = one running request; entry [r, j] = KV slot of token position j (int32, as SGLang/flashinfer)."""

    def __init__(self, max_requests: int, max_context_len: int, device="cpu"):
        if max_requests < 1 or max_context_len < 1:
            raise ValueError(f"table needs >= 1 row and column, got {max_requests}, {max_context_len}")
        self.max_requests = max_requests
        self.pad_row = max_requests  # one more row, never handed out: a static graph's padded batch rows write it
        self.max_context_len = max_context_len
        # 0 = the dummy slot, so never-written entries are harmless to read
        self.table = torch.zeros((max_requests + 1, max_context_len), dtype=torch.int32, device=device)
        self._free_rows = deque(range(max_requests))
        self._row_is_free = [True] * max_requests

    def alloc(self) -> int | None:
        """A free row, or None if all rows are taken."""
        if not self._free_rows:
            return None
        row = self._free_rows.popleft()
        self._row_is_free[row] = False
        return row

    def free(self, row: int) -> None:
        if not 0 <= row < self.max_requests or self._row_is_free[row]:
            raise ValueError(f"request row {row} is not allocated")
        self._row_is_free[row] = True
        self._free_rows.append(row)

    def num_free(self) -> int:
        return len(self._free_rows)

    def write(self, rows: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor) -> None:
        """table[rows[b], starts[b] : starts[b]+lens[b]] = the next lens[b] entries of slots, for every b.

        E.g. rows [3, 0], starts [5, 2], lens [2, 1], slots [40, 41, 7]: table[3, 5:7] = [40, 41],
        table[0, 2] = 7. No host sync; lens must sum to slots.numel().
        """
        # rows, starts, lens: [bs] int64; slots: [sum(lens)] int64 or int32
        num_tokens = slots.numel()
        bs = rows.numel()
        req = torch.repeat_interleave(torch.arange(bs, device=rows.device), lens,
                                      output_size=num_tokens)  # [T] entry b of each slot
        first = torch.cumsum(lens, 0) - lens  # [bs] index in slots of each request's first entry
        cols = starts[req] + torch.arange(num_tokens, device=rows.device) - first[req]  # [T]
        self.table[rows[req], cols] = slots.to(torch.int32)

    def write_next(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        """table[rows[b], cols[b]] = slots[b]: write(rows, cols, ones, slots) for one new position per request (a
        decode step) in one indexed write instead of write's dozen ops."""
        # rows, cols: [bs] int64; slots: [bs] int64 or int32
        self.table[rows, cols] = slots.to(torch.int32)

    def slots(self, row: int, start: int, end: int) -> torch.Tensor:
        """int64 copy of table[row, start:end]."""
        return self.table[row, start:end].to(torch.int64)
