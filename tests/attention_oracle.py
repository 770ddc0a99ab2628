"""Attention test helpers: request->slot tables (patterned and random), random trees and their masks, and a dense
float64 oracle that never looks at AttnMetadata: it reads the table with Python slicing, builds each request's
dense K/V in position order and its explicit boolean mask, and runs softmax(QK^T*scale + mask)V."""

from __future__ import annotations

import math

import torch

from fastspec.attention import TorchAttnBackend


# ---------------------------------------------------------------------------------------------------------
# fixtures: tables, caches, trees, the oracle


def patterned_table(num_rows: int = 3, width: int = 12) -> torch.Tensor:
    """Row r holds slots 10*(r+1) + j, so hand-worked expectations are easy to read."""
    return torch.tensor([[10 * (r + 1) + j for j in range(width)] for r in range(num_rows)], dtype=torch.int32)


def random_table(gen: torch.Generator, num_rows: int, width: int) -> tuple[torch.Tensor, int]:
    """Distinct, non-contiguous slots (slot 0 never used, a third of the pool left free)."""
    num_slots = num_rows * width * 3 // 2 + 1
    perm = torch.randperm(num_slots - 1, generator=gen)[: num_rows * width] + 1
    return perm.view(num_rows, width).to(torch.int32), num_slots


def random_rows(gen: torch.Generator, bs: int, num_rows: int) -> torch.Tensor:
    return torch.randperm(num_rows, generator=gen)[:bs].to(torch.int64)


def random_parents(gen: torch.Generator, n: int) -> list[int]:
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[N, N] bool: row i is True on i and its ancestors (root included)."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            mask[i, j] = True
            j = parents[j]
    return mask


def full_tree_mask(seq_lens: list[int], parents_per_req: list[list[int]]) -> list[torch.Tensor]:
    """Per request the FULL_MASK block N x (seq_len + N): prefix columns True, tree part = ancestors."""
    return [torch.cat([torch.ones(len(p), s, dtype=torch.bool), ancestor_mask(p)], 1)
            for s, p in zip(seq_lens, parents_per_req)]


def causal_mask(qo: int, kv: int) -> torch.Tensor:
    """Bottom-right aligned: query i sees key j iff j <= kv - qo + i."""
    return torch.tensor([[j <= kv - qo + i for j in range(kv)] for i in range(qo)], dtype=torch.bool)


def oracle(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
           specs: list[tuple[list[int], torch.Tensor]]) -> torch.Tensor:
    """specs: per request (kv slots in position order, bool mask [qo, kv]); q rows in request order."""
    out, row = [], 0
    group = q.shape[1] // k_cache.shape[1]
    for slots, mask in specs:
        qo = mask.shape[0]
        qb = q[row: row + qo].double()                                          # [qo, Hq, D]
        kb = k_cache[slots].double().repeat_interleave(group, 1)               # [kv, Hq, D]
        vb = v_cache[slots].double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", qb, kb) * scale
        scores = scores.masked_fill(~mask[None], -math.inf)
        out.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), vb))
        row += qo
    return torch.cat(out)


def run_backend(meta, q, k_cache, v_cache, scale):
    backend = TorchAttnBackend()
    return backend.run(backend.plan(meta), q, k_cache, v_cache, scale)
