"""Host-side packing of a round's ragged batch into the dense dicts the static step functions take, and the static
inputs those functions declare (prefix_specs, verify_specs).

Pads every request to the same number of new rows (E for draft extend, N for verify); the committed KV is named
by table row and length, never gathered here. Padded rows write to dummy slot 0.
"""

from __future__ import annotations

import torch

from fastspec.graphs import StaticInput
from fastspec.speculative.batch import DecodeBatch, ExtendBatch
from fastspec.speculative.tree import DraftTree


def prefix_specs(pad_row: int) -> list[StaticInput]:
    """The committed-KV inputs every step function takes: each request's table row and committed length (the
    kernel reads the slots through the table: no KV width anywhere in a graph); padded rows name the table's
    pad row with nothing committed."""
    return [StaticInput("rows", (), torch.int64, pad_value=pad_row), StaticInput("prefix_lens", (), torch.int64)]


def pack_extend(batch: ExtendBatch, rows_per_request: int) -> dict:
    """An ExtendBatch (ragged, extend_lens[b] <= rows_per_request) as draft_extend's padded inputs."""
    bs, e = batch.rows.shape[0], rows_per_request
    lens = batch.extend_lens
    total = batch.input_ids.shape[0]  # real tokens, known on the host: no nonzero (a device sync) needed
    req = torch.repeat_interleave(torch.arange(bs, device=lens.device), lens, output_size=total)
    flat = req * e + torch.arange(total, device=lens.device) - (torch.cumsum(lens, 0) - lens)[req]  # padded row
    pad = lambda src, fill=0: torch.full((bs * e, *src.shape[1:]), fill, dtype=src.dtype,  # noqa: E731
                                         device=src.device).index_copy_(0, flat, src)
    return pack_extend_padded(batch.rows, batch.prefix_lens, lens, pad(batch.input_ids), pad(batch.positions),
                              pad(batch.features))


def pack_extend_padded(rows: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,  # [bs] each
                       input_ids: torch.Tensor, positions: torch.Tensor,  # int64 [bs*E], E rows per request
                       features: torch.Tensor,  # [bs*E, F]
                       ) -> dict:
    """Already padded rows (row b*E + j real while j < extend_lens[b]) as draft_extend's inputs (it reads the
    new tokens' slots from the table at positions prefix_lens[b] + j)."""
    return {"input_ids": input_ids, "positions": positions, "features": features, "rows": rows,
            "prefix_lens": prefix_lens, "extend_lens": extend_lens}


def pack_draft(batch: DecodeBatch, topk_p, topk_index, hidden, scratch: torch.Tensor | None, topk: int) -> dict:
    if scratch is None:  # num_steps == 1: no draft forward runs
        scratch = torch.zeros(batch.size * topk, 1, dtype=torch.int64, device=batch.rows.device)
    return {"topk_p": topk_p, "topk_index": topk_index, "hidden": hidden, "rows": batch.rows,
            "seq_lens": batch.seq_lens, "verified_id": batch.verified_id, "scratch": scratch}


def pack_verify(batch: DecodeBatch, tree: DraftTree, new_slots: torch.Tensor) -> dict:
    """new_slots int64 [bs, N]: the slots of positions seq_len .. seq_len+N-1 (verify writes them into the
    table)."""
    return {"input_ids": tree.draft_tokens.flatten(), "positions": tree.positions,
            "new_slots": new_slots, "tree_mask": tree.tree_mask,
            "rows": batch.rows, "prefix_lens": batch.seq_lens, "retrieve_index": tree.retrieve_index,
            "retrieve_next_token": tree.retrieve_next_token, "retrieve_next_sibling": tree.retrieve_next_sibling}


def verify_specs(n: int, hybrid: bool, pad_row: int, tree: bool = False) -> list[StaticInput]:
    """The verify graph's static inputs for trees of n tokens. A hybrid target's verify also takes each request's
    state row (padded rows: the dummy row 0); `tree`: the retrieve lists its greedy acceptance walks (padded rows:
    a lone root)."""
    links = [StaticInput("retrieve_index", (n,), torch.int64),
             StaticInput("retrieve_next_token", (n,), torch.int64, pad_value=-1),
             StaticInput("retrieve_next_sibling", (n,), torch.int64, pad_value=-1)] if tree else []
    return [StaticInput("input_ids", (), torch.int64, n), StaticInput("positions", (), torch.int64, n),
            StaticInput("new_slots", (n,), torch.int64), StaticInput("tree_mask", (n, n), torch.bool),
            *prefix_specs(pad_row), *([StaticInput("state_rows", (), torch.int64)] if hybrid else []), *links]
