"""Host-side packing of a round's ragged batch into the dense dicts the static step functions take.

Pads every request to the same number of new rows (E for draft extend, N for verify) and the committed KV
to a common width `kv_width` (exact in eager mode, a bucket in graph modes). Padded rows write to dummy slot 0.
"""

from __future__ import annotations

import torch

from fastspec.graphs import StaticInput
from fastspec.speculative.batch import DecodeBatch, ExtendBatch
from fastspec.speculative.tree import DraftTree

KV_BUCKET = 256


def kv_width(max_len: int, bucketed: bool) -> int:
    """Committed-KV width of a batch: the longest prefix, rounded up to KV_BUCKET for static graphs."""
    return max(1, -(-max_len // KV_BUCKET) * KV_BUCKET if bucketed else max_len)


def prefix_specs(width: int) -> list[StaticInput]:
    """The committed-KV inputs every step function takes: slots and validity [width] per request (a dynamic dim:
    one compile serves every width)."""
    return [StaticInput("prefix_slots", (width,), torch.int64, dynamic=True),
            StaticInput("prefix_valid", (width,), torch.bool, dynamic=True)]


def prefix_view(table: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, width: int):
    """(slots int64 [bs, width], valid bool [bs, width]): each request's first `lens` KV slots, padded."""
    valid = torch.arange(width, device=rows.device)[None, :] < lens[:, None]
    cols = table[rows, :width].to(torch.int64) if width <= table.shape[1] else None
    if cols is None:
        cols = torch.nn.functional.pad(table[rows].to(torch.int64), (0, width - table.shape[1]))
    return torch.where(valid, cols, 0), valid


def pack_extend(batch: ExtendBatch, table: torch.Tensor, rows_per_request: int, width: int) -> dict:
    """An ExtendBatch (ragged, extend_lens[b] <= rows_per_request) as draft_extend's padded inputs."""
    bs, e = batch.rows.shape[0], rows_per_request
    lens = batch.extend_lens
    total = batch.input_ids.shape[0]  # real tokens, known on the host: no nonzero (a device sync) needed
    req = torch.repeat_interleave(torch.arange(bs, device=lens.device), lens, output_size=total)
    flat = req * e + torch.arange(total, device=lens.device) - (torch.cumsum(lens, 0) - lens)[req]  # padded row
    pad = lambda src, fill=0: torch.full((bs * e, *src.shape[1:]), fill, dtype=src.dtype,  # noqa: E731
                                         device=src.device).index_copy_(0, flat, src)
    return pack_extend_padded(batch.rows, batch.prefix_lens, lens, pad(batch.input_ids), pad(batch.positions),
                              pad(batch.features), table, e, width)


def pack_extend_padded(rows: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,  # [bs] each
                       input_ids: torch.Tensor, positions: torch.Tensor,  # int64 [bs*E], E rows per request
                       features: torch.Tensor,  # [bs*E, F]
                       table: torch.Tensor, e: int, width: int) -> dict:
    """Already padded rows (row b*E + j real while j < extend_lens[b]) as draft_extend's inputs; new slots are
    read from the table at positions prefix_lens[b] + j."""
    bs = rows.shape[0]
    valid = torch.arange(e, device=rows.device)[None, :] < extend_lens[:, None]  # [bs, E]
    cols = prefix_lens[:, None] + torch.arange(e, device=rows.device)[None, :]
    new_slots = torch.where(valid, table[rows[:, None], cols.clamp(max=table.shape[1] - 1)].to(torch.int64), 0)
    prefix_slots, prefix_valid = prefix_view(table, rows, prefix_lens, width)
    return {"input_ids": input_ids, "positions": positions, "features": features, "new_slots": new_slots,
            "new_valid": valid, "prefix_slots": prefix_slots, "prefix_valid": prefix_valid,
            "last_rows": torch.arange(bs, device=rows.device) * e + extend_lens - 1}


def pack_draft(batch: DecodeBatch, table: torch.Tensor, topk_p, topk_index, hidden, scratch: torch.Tensor | None,
               width: int, topk: int) -> dict:
    prefix_slots, prefix_valid = prefix_view(table, batch.rows, batch.seq_lens, width)
    if scratch is None:  # num_steps == 1: no draft forward runs
        scratch = torch.zeros(batch.size * topk, 1, dtype=torch.int64, device=batch.rows.device)
    return {"topk_p": topk_p, "topk_index": topk_index, "hidden": hidden, "seq_lens": batch.seq_lens,
            "prefix_slots": prefix_slots, "prefix_valid": prefix_valid, "scratch": scratch}


def pack_verify(batch: DecodeBatch, tree: DraftTree, table: torch.Tensor, width: int) -> dict:
    n = tree.num_draft_tokens
    cols = batch.seq_lens[:, None] + torch.arange(n, device=batch.rows.device)[None, :]
    prefix_slots, prefix_valid = prefix_view(table, batch.rows, batch.seq_lens, width)
    return {"input_ids": tree.draft_tokens.flatten(), "positions": tree.positions,
            "new_slots": table[batch.rows[:, None], cols].to(torch.int64), "tree_mask": tree.tree_mask,
            "prefix_slots": prefix_slots, "prefix_valid": prefix_valid}
