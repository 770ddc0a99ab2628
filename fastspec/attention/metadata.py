"""Attention metadata: one frozen `AttnMetadata` per forward, built on the host from the request->slot table.

Owns the five builders (extend, decode, draft decode, draft extend, target verify) that turn lengths and
`req_to_token` rows into the FlashInfer plan() contract at page size 1 (indptrs, kv slot ids, the slots that
receive the new tokens' K/V, an optional tree mask). It knows nothing about models, pools or backends, and
never writes the table: callers put the new slots into `req_to_token` first.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class AttnMode(enum.Enum):
    EXTEND = "extend"                  # prefill (chunk) of the target or draft model, causal
    DECODE = "decode"                  # one new token per request
    DRAFT_DECODE = "draft_decode"      # draft forward i: bs*topk rows, per-branch scratch history
    DRAFT_EXTEND = "draft_extend"      # draft model over the accepted tokens after verify, causal
    TARGET_VERIFY = "target_verify"    # target over the N tree tokens, custom tree mask


@dataclass(frozen=True)
class AttnMetadata:
    """Token-level FlashInfer plan() inputs (page size 1: kv_indices are KV slot ids).

    Without a custom mask, `causal` means bottom-right aligned: query i of a request with qo_len q and
    kv_len n may see kv positions <= n - q + i. With a mask, `causal` is ignored (as in FlashInfer).
    """

    mode: AttnMode
    qo_indptr: torch.Tensor            # int32 [bs+1]
    kv_indptr: torch.Tensor            # int32 [bs+1]
    kv_indices: torch.Tensor           # int32 [kv_indptr[-1]]  slot ids, per request in position order
    out_cache_loc: torch.Tensor        # int64 [qo_indptr[-1]]  slots receiving the new tokens' K/V
    custom_mask: torch.Tensor | None   # bool [sum_b qo_len_b * kv_len_b], row-major per request, True = attend
    causal: bool

    @property
    def batch_size(self) -> int:
        return self.qo_indptr.numel() - 1

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    @property
    def qo_lens(self) -> torch.Tensor:  # int32 [bs]
        return self.qo_indptr[1:] - self.qo_indptr[:-1]

    @property
    def kv_lens(self) -> torch.Tensor:  # int32 [bs]
        return self.kv_indptr[1:] - self.kv_indptr[:-1]


# ----------------------------------------------------------------------------------------------------------
# vectorised helpers


def _indptr(lens: torch.Tensor) -> torch.Tensor:
    """[3, 1, 2] -> int32 [0, 3, 4, 6]."""
    zero = torch.zeros(1, dtype=torch.int64, device=lens.device)
    return torch.cat([zero, torch.cumsum(lens.to(torch.int64), 0)]).to(torch.int32)


def _segment_offsets(lens: torch.Tensor) -> torch.Tensor:
    """Offset of each element inside its segment: lens [2, 3] -> [0, 1, 0, 1, 2]."""
    lens = lens.to(torch.int64)
    starts = torch.cumsum(lens, 0) - lens
    total = int(lens.sum())
    return torch.arange(total, device=lens.device) - torch.repeat_interleave(starts, lens, output_size=total)


def _gather_table(req_to_token: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
                  lens: torch.Tensor) -> torch.Tensor:
    """Concatenate req_to_token[rows[b], starts[b] : starts[b] + lens[b]] over b -> int64 [sum(lens)]."""
    _check_fits(req_to_token, starts + lens)
    lens = lens.to(torch.int64)
    total = int(lens.sum())
    row = torch.repeat_interleave(rows.to(torch.int64), lens, output_size=total)
    col = torch.repeat_interleave(starts.to(torch.int64), lens, output_size=total) + _segment_offsets(lens)
    return req_to_token[row, col].to(torch.int64)


def _check_fits(req_to_token: torch.Tensor, ends: torch.Tensor) -> None:
    if ends.numel() and int(ends.max()) > req_to_token.shape[1]:
        raise ValueError(f"attention metadata needs {int(ends.max())} table columns, "
                         f"req_to_token has {req_to_token.shape[1]}")


def _check_lens(**named: torch.Tensor) -> None:
    for name, lens in named.items():
        if lens.numel() and int(lens.min()) < 0:
            raise ValueError(f"attention metadata: negative {name}")


def _draft_decode_columns(table_rows: torch.Tensor,  # int64 [R]  req_to_token row of each query row
                          prefix: torch.Tensor,      # int64 [R]  committed length
                          shift: torch.Tensor,       # int64 [R]  k * num_steps: scratch of earlier branches
                          kv_lens: torch.Tensor,     # int64 [R]
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Table (row, column) of every key: key j is column j in the prefix, j + shift after it."""
    total = int(kv_lens.sum())
    j = _segment_offsets(kv_lens)
    after_prefix = j >= torch.repeat_interleave(prefix, kv_lens, output_size=total)
    col = j + after_prefix.to(torch.int64) * torch.repeat_interleave(shift, kv_lens, output_size=total)
    return torch.repeat_interleave(table_rows, kv_lens, output_size=total), col


# ----------------------------------------------------------------------------------------------------------
# builders


def extend_metadata(req_to_token: torch.Tensor,  # int32 [max_requests, max_context_len]
                    rows: torch.Tensor,          # int64 [bs]
                    prefix_lens: torch.Tensor,   # int64 [bs]  tokens already in the cache
                    extend_lens: torch.Tensor,   # int64 [bs]  new tokens
                    ) -> AttnMetadata:
    """Prefill: qo = extend, kv = prefix + extend, causal; new K/V go to table[r, prefix : prefix + extend]."""
    _check_lens(prefix_lens=prefix_lens, extend_lens=extend_lens)
    kv_lens = prefix_lens + extend_lens
    return AttnMetadata(
        mode=AttnMode.EXTEND,
        qo_indptr=_indptr(extend_lens),
        kv_indptr=_indptr(kv_lens),
        kv_indices=_gather_table(req_to_token, rows, torch.zeros_like(kv_lens), kv_lens).to(torch.int32),
        out_cache_loc=_gather_table(req_to_token, rows, prefix_lens, extend_lens),
        custom_mask=None,
        causal=True,
    )


def decode_metadata(req_to_token: torch.Tensor,  # int32 [max_requests, max_context_len]
                    rows: torch.Tensor,          # int64 [bs]
                    seq_lens: torch.Tensor,      # int64 [bs]  INCLUDING the token being decoded
                    ) -> AttnMetadata:
    """One token per request: qo = 1, kv = seq_len; its K/V go to table[r, seq_len - 1]. (Every request's keys start
    at column 0: its table row's first seq_len columns, read as one [bs, max] block, in half _gather_table's ops.)"""
    _check_lens(seq_lens=seq_lens - 1)
    _check_fits(req_to_token, seq_lens)
    bs, rows = seq_lens.numel(), rows.to(torch.int64)
    width = int(seq_lens.max()) if bs else 0
    seen = torch.arange(width, device=seq_lens.device)[None, :] < seq_lens[:, None]  # [bs, width]
    return AttnMetadata(
        mode=AttnMode.DECODE,
        qo_indptr=torch.arange(bs + 1, dtype=torch.int32, device=seq_lens.device),
        kv_indptr=_indptr(seq_lens),
        kv_indices=req_to_token[rows, :width][seen].to(torch.int32),
        out_cache_loc=req_to_token[rows, seq_lens - 1].to(torch.int64),
        custom_mask=None,
        causal=True,
    )


def draft_decode_metadata(req_to_token: torch.Tensor,  # int32 [max_requests, max_context_len]
                          rows: torch.Tensor,          # int64 [bs]
                          seq_lens: torch.Tensor,      # int64 [bs]  committed lengths, no draft tokens
                          topk: int, num_steps: int, step: int) -> AttnMetadata:
    """Draft forward `step`: query row b*topk+k is branch k of request b (per-branch-slot history).

    Keys of row (b, k): table[r, 0:seq_len] then table[r, seq_len + k*num_steps + 0 .. step]; its K/V go to
    table[r, seq_len + k*num_steps + step]. E.g. seq_len 2, topk 2, num_steps 3, step 1: branch 0 reads
    columns [0, 1, 2, 3], branch 1 reads [0, 1, 5, 6] (scratch layout [k0: s0 s1 s2][k1: s0 s1 s2]).
    """
    if not 0 <= step < num_steps or topk < 1:
        raise ValueError(f"draft decode: need topk >= 1 and 0 <= step < num_steps, "
                         f"got {topk=} {num_steps=} {step=}")
    _check_lens(seq_lens=seq_lens)
    _check_fits(req_to_token, seq_lens + topk * num_steps)
    row_seq = seq_lens.to(torch.int64).repeat_interleave(topk)                    # [bs*topk]
    branch = torch.arange(topk, device=seq_lens.device).repeat(seq_lens.numel())   # [bs*topk]  k of each row
    table_rows = rows.to(torch.int64).repeat_interleave(topk)                      # [bs*topk]
    kv_lens = row_seq + step + 1
    row, col = _draft_decode_columns(table_rows, row_seq, branch * num_steps, kv_lens)
    return AttnMetadata(
        mode=AttnMode.DRAFT_DECODE,
        qo_indptr=_indptr(torch.ones_like(row_seq)),
        kv_indptr=_indptr(kv_lens),
        kv_indices=req_to_token[row, col].to(torch.int32),
        out_cache_loc=req_to_token[table_rows, row_seq + branch * num_steps + step].to(torch.int64),
        custom_mask=None,
        causal=True,
    )


def draft_extend_metadata(req_to_token: torch.Tensor,  # int32 [max_requests, max_context_len]
                          rows: torch.Tensor,          # int64 [bs]
                          seq_lens: torch.Tensor,      # int64 [bs]  lengths AFTER committing accepted tokens
                          extend_lens: torch.Tensor,   # int64 [bs]  accept_len + 1
                          ) -> AttnMetadata:
    """Draft extend after verify: qo = extend, kv = seq_len, causal (bottom-right); K/V to the last slots."""
    _check_lens(extend_lens=extend_lens, prefix_lens=seq_lens - extend_lens)
    return AttnMetadata(
        mode=AttnMode.DRAFT_EXTEND,
        qo_indptr=_indptr(extend_lens),
        kv_indptr=_indptr(seq_lens),
        kv_indices=_gather_table(req_to_token, rows, torch.zeros_like(seq_lens), seq_lens).to(torch.int32),
        out_cache_loc=_gather_table(req_to_token, rows, seq_lens - extend_lens, extend_lens),
        custom_mask=None,
        causal=True,
    )


def verify_metadata(req_to_token: torch.Tensor,  # int32 [max_requests, max_context_len]
                    rows: torch.Tensor,          # int64 [bs]
                    seq_lens: torch.Tensor,      # int64 [bs]  committed lengths
                    num_draft_tokens: int,
                    tree_mask: torch.Tensor,     # bool [sum_b N * (seq_len_b + N)]  FULL_MASK layout
                    ) -> AttnMetadata:
    """Target verify: qo = N tree tokens, kv = seq_len + N; K/V to table[r, seq_len : seq_len + N]."""
    _check_lens(seq_lens=seq_lens)
    n = num_draft_tokens
    expected = int((n * (seq_lens.to(torch.int64) + n)).sum())
    if tree_mask.dtype != torch.bool or tree_mask.dim() != 1 or tree_mask.numel() != expected:
        raise ValueError(f"verify: tree_mask must be a flat bool tensor of {expected} entries (FULL_MASK), "
                         f"got {tree_mask.dtype} {tuple(tree_mask.shape)}")
    n_lens = torch.full_like(seq_lens, n)
    kv_lens = seq_lens + n
    return AttnMetadata(
        mode=AttnMode.TARGET_VERIFY,
        qo_indptr=_indptr(n_lens),
        kv_indptr=_indptr(kv_lens),
        kv_indices=_gather_table(req_to_token, rows, torch.zeros_like(kv_lens), kv_lens).to(torch.int32),
        out_cache_loc=_gather_table(req_to_token, rows, seq_lens, n_lens),
        custom_mask=tree_mask,
        causal=True,
    )

