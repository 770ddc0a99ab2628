"""Which KV slots a verify round keeps, frees and moves (the worker applies it).

The N verify slots of a request sit at positions seq_len .. seq_len+N-1 (tree node i at slot column i).
After acceptance the kept nodes (root + accepted drafts, in path order) must end up at positions
seq_len .. seq_len+keep-1:
  page_size 1      : remap the table to the kept nodes' slots, free the rest (no KV copy).
  page_size P > 1  : slots are tied to page offsets, so copy the kept nodes' target KV into the first `keep`
                     verify slots (a no-op for chains, where node i == depth i) and free the whole pages past
                     the page holding position seq_len+keep-1.
E.g. P=1, N=4, kept nodes [0, 2] of slots [7, 9, 4, 5]: positions seq_len, seq_len+1 -> slots 7, 4; free 9, 5.

A round keeps and moves on the device (`plan_round_kv_on_device`: no host read, so the next round can be
launched first) and frees from the host once its accept result is read (`round_free_slots`). `plan_round_kv`
plans all three on the host: the slow twin the device plan is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastspec.utils.transfer import to_device


@dataclass(frozen=True)
class RoundKV:
    table_slots: torch.Tensor  # int64 [sum(keep)]  new slots for positions seq_len.. of each request, in order
    keep_lens: torch.Tensor  # int64 [bs]
    free_slots: torch.Tensor  # int64 [n]  slots (paged: any slot of each page) to free
    move_src: torch.Tensor  # int64 [m]  target-pool KV copies src -> dst (paged trees only)
    move_dst: torch.Tensor  # int64 [m]


def plan_round_kv(verify_slots: torch.Tensor,  # int64 [bs, N]
                  kept_nodes: list[list[int]],  # per request: tree node indices to keep, root first
                  seq_lens: list[int], page_size: int) -> RoundKV:
    """Every choice is made on the host from `kept_nodes` (already there); the slots are then read with one
    gather per output, so planning costs a few launches whatever the batch and never waits for the device."""
    table, free, src, dst = _plan_cells(verify_slots.shape[1], kept_nodes, seq_lens, page_size)
    keep_lens = to_device([len(k) for k in kept_nodes], verify_slots.device)
    return RoundKV(_take(verify_slots, table), keep_lens, _take(verify_slots, free), _take(verify_slots, src),
                   _take(verify_slots, dst))


def round_free_slots(verify_slots: torch.Tensor, kept_nodes: list[list[int]], seq_lens: list[int],
                     page_size: int) -> torch.Tensor:
    """plan_round_kv's free_slots alone (what the host frees once a round committed on the device is read)."""
    return _take(verify_slots, _plan_cells(verify_slots.shape[1], kept_nodes, seq_lens, page_size)[1])


def _take(verify_slots: torch.Tensor, cells: list[int]) -> torch.Tensor:  # flat (request, node) cells -> slots
    flat = verify_slots.flatten()
    return flat[to_device(cells, flat.device)] if cells else flat.new_zeros(0)


def _plan_cells(n: int, kept_nodes: list[list[int]], seq_lens: list[int], page_size: int):
    """(table, free, move src, move dst) as flat cells b*N + node of the verify slots."""
    table, free, src, dst = [], [], [], []
    for b, nodes in enumerate(kept_nodes):
        base = b * n
        if page_size == 1:
            table += [base + i for i in nodes]
            kept = set(nodes)
            free += [base + i for i in range(n) if i not in kept]
            continue
        table += range(base, base + len(nodes))
        moved = [j for j, node in enumerate(nodes) if node != j]  # node j's KV belongs at column j
        src += [base + nodes[j] for j in moved]
        dst += [base + j for j in moved]
        page_end = -(-(seq_lens[b] + len(nodes)) // page_size) * page_size  # first position past the last kept page
        free += range(base + max(page_end - seq_lens[b], 0), base + n)
    return table, free, src, dst


@dataclass(frozen=True)
class DeviceKV:
    """The same plan made on the device from the accept result, without the host knowing it (the overlap
    schedule launches the next round first). Fixed shapes: E = num_steps + 1 columns per request."""

    nodes: torch.Tensor  # int64 [bs, E]  kept tree node j of each request (position seq_len + j), -1 past keep
    table_slots: torch.Tensor  # int64 [bs, E]  slot of position seq_len + j (j < keep; past keep: unchanged)
    move_src: torch.Tensor | None  # int64 [bs*E]  paged trees: copy src -> dst (dst == src past keep: a no-op)
    move_dst: torch.Tensor | None
    keep_lens: torch.Tensor  # int64 [bs]


def plan_round_kv_on_device(verify_slots: torch.Tensor,  # int64 [bs, N]
                            accept_index: torch.Tensor,  # int64 [bs, E]  flat verify rows b*N + node, -1 pad
                            page_size: int, chain: bool) -> DeviceKV:
    """plan_round_kv's table and moves for every request at once, with no host read; the slots to free are
    only known on the host (round_free_slots, once the accept result is read), so the unused part of a worst-case
    reservation is returned after verify. Chains keep node j at column j: nothing to remap.
    E.g. P=1, kept nodes [0, 2] of slots [7, 9, 4, 5]: table_slots [7, 4, ...] (plan_round_kv's table)."""
    bs, n = verify_slots.shape
    accept_index = accept_index[:, :n]  # a path never holds more than the tree's N nodes
    kept = accept_index >= 0  # [bs, E]
    nodes = torch.where(kept, accept_index - torch.arange(bs, device=accept_index.device)[:, None] * n, -1)
    keep_lens = kept.sum(1)
    cols = torch.arange(nodes.shape[1], device=nodes.device).expand_as(nodes)
    if chain:
        return DeviceKV(nodes, verify_slots[:, : nodes.shape[1]], None, None, keep_lens)
    source = torch.where(kept, nodes, cols)  # past keep: the column itself
    if page_size == 1:  # remap the table: position seq_len + j -> the slot of kept node j
        return DeviceKV(nodes, verify_slots.gather(1, source), None, None, keep_lens)
    dst = verify_slots[:, : nodes.shape[1]]  # paged: node j's KV moves into column j's slot
    return DeviceKV(nodes, dst, verify_slots.gather(1, source).flatten(), dst.flatten(), keep_lens)
