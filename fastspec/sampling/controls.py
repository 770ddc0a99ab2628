"""Sampling controls that reshape the target's logits before a token is chosen: repetition, frequency and
presence penalties, logit bias and min_p (SamplingParams).

Applied at every position with the state as of that position: a plain round sees the output so far; a verify
node sees the output so far plus the draft tokens on its own tree path (root excluded: it is the last output
token already), so a speculative run follows exactly the target-only distribution under the same controls, and
greedy speculation gives exactly the target-only tokens. Order: penalties and bias on the logits, then min_p
(tokens below min_p x the most likely one's probability at the request's temperature are dropped; a grammar's
mask comes before, so min_p is relative to the tokens it allows); temperature, top-k and top-p follow in the
sampler. Penalties count output tokens (frequency, presence) or prompt and output tokens (repetition: a positive
logit is divided by the penalty, a negative one multiplied), as vLLM does.
"""

from __future__ import annotations

import torch

from fastspec.utils.transfer import to_device


def active(params) -> bool:
    return (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
            or params.min_p > 0.0 or bool(params.logit_bias))


def apply_controls(logits: torch.Tensor,  # [bs * n, V]  n positions per request
                   reqs, tree_mask: torch.Tensor | None = None,  # bool [bs, n, n]  verify: ancestors + self
                   draft_tokens: torch.Tensor | None = None,  # int64 [bs, n]  verify: node tokens, root first
                   ) -> torch.Tensor:
    """The controlled logits (float32); requests without controls keep theirs unchanged."""
    bs, V = len(reqs), logits.shape[-1]
    n = logits.shape[0] // bs
    out = logits.float().view(bs, n, V).clone()
    device = logits.device
    path = None
    if tree_mask is not None:  # counts of the draft tokens on each node's path, the root excluded
        one_hot = torch.nn.functional.one_hot(draft_tokens[:, 1:], V).float()  # [bs, n-1, V]
        path = tree_mask[:, :, 1:].float() @ one_hot  # [bs, n, V]
    for b, r in enumerate(reqs):
        p = r.params
        if not active(p):
            continue
        counts = torch.bincount(to_device(r.produced, device), minlength=V).float()
        counts = counts[None].expand(n, V) + (path[b] if path is not None else 0)  # [n, V] output so far
        row = out[b]
        if p.repetition_penalty != 1.0:
            seen = (counts > 0) | _present(r.prompt_ids, V, device)[None]
            penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row = torch.where(seen, penalized, row)
        row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        if p.logit_bias:
            ids = to_device([t for t, _ in p.logit_bias], device)
            bias = to_device([v for _, v in p.logit_bias], device, torch.float32)
            row = row.index_add(1, ids, bias.expand(n, -1))
        if p.min_p > 0 and not p.greedy:
            probs = torch.softmax(row / p.temperature, -1)
            row = row.masked_fill(probs < p.min_p * probs.max(-1, keepdim=True).values, -torch.inf)
        out[b] = row
    return out.view(bs * n, V)


def _present(tokens: list[int], V: int, device) -> torch.Tensor:
    mask = torch.zeros(V, dtype=torch.bool, device=device)
    if tokens:
        mask[to_device(tokens, device)] = True
    return mask
