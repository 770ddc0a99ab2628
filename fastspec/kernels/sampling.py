"""Probability renormalisation and top-k selection: pure-torch twins of sgl_kernel's `top_k_renorm_prob`,
`top_p_renorm_prob` and SGLang's `fast_topk`.

Owns: truncating probability rows to their top-k / top-p set and renormalising (sort-based, like SGLang's
native sampler; ties are broken by position, where the pivot-based CUDA kernels may keep all tied entries).
Does not own: temperature, softmax or drawing tokens (speculative/tree.py, kernels/verify.py, sampling.py).
"""

from __future__ import annotations

import torch


def _per_row(value, probs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # -> [batch, 1]
    """A scalar or a per-row tensor [batch] as a column on probs' device."""
    if isinstance(value, torch.Tensor):
        if value.numel() != probs.shape[0]:
            raise ValueError(f"per-row parameter has {value.numel()} entries for {probs.shape[0]} rows")
        return value.to(device=probs.device, dtype=dtype, non_blocking=True).reshape(-1, 1)  # no stream sync
    return torch.full((probs.shape[0], 1), value, dtype=dtype, device=probs.device)


def _keep_sorted(probs: torch.Tensor, keep_rule) -> torch.Tensor:
    """Zero every entry whose rank (descending, stable) fails keep_rule(sorted_probs) and renormalise."""
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, keep_rule(sorted_probs))
    kept = torch.where(keep, probs, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def top_k_renorm_prob(probs: torch.Tensor,  # float [batch, V]
                      top_k,                # int or int tensor [batch]
                      ) -> torch.Tensor:    # float32 [batch, V]  (a new tensor)
    """Keep the k largest probabilities of each row, zero the rest, renormalise. Rows with k >= V (SGLang's
    TOP_K_ALL = 1 << 30) or k <= 0 (disabled) are returned unchanged."""
    probs = probs.to(torch.float32)
    vocab = probs.shape[-1]
    k = _per_row(top_k, probs, torch.int64)
    rank = torch.arange(vocab, device=probs.device)
    renormed = _keep_sorted(probs, lambda sorted_probs: rank < k)
    return torch.where((k >= vocab) | (k <= 0), probs, renormed)


def top_p_renorm_prob(probs: torch.Tensor,  # float [batch, V]
                      top_p,                # float or float tensor [batch]
                      ) -> torch.Tensor:    # float32 [batch, V]  (a new tensor)
    """Keep the smallest set of largest probabilities whose mass reaches top_p (an entry stays iff the mass
    before it is < top_p; the largest always stays), zero the rest, renormalise. Rows with top_p >= 1 are
    returned unchanged (no rounding-driven loss of the tail), so callers may apply it unconditionally."""
    probs = probs.to(torch.float32)
    p = _per_row(top_p, probs, torch.float32)
    first = torch.arange(probs.shape[-1], device=probs.device) == 0
    renormed = _keep_sorted(probs, lambda sorted_probs: (sorted_probs.cumsum(-1) - sorted_probs < p) | first)
    return torch.where(p >= 1.0, probs, renormed)


def fast_topk(values: torch.Tensor, topk: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the topk largest along dim, sorted descending; torch.max for topk == 1."""
    if topk == 1:
        best, index = torch.max(values, dim=dim, keepdim=True)
        return best, index
    result = torch.topk(values, topk, dim=dim)
    return result.values, result.indices
