"""The EAGLE-3 training-time test (TTT): the head is unrolled `steps` times over packed conversations, each
step fed the head's own hidden output of the step before, so training sees what drafting `steps` deep sees.

Glossary (index p of a conversation, step k = draft depth k + 1):
  input token   step k at p is fed the data token at p + 1 + k and (k = 0) the target's aux feature at p, or
                (k > 0) the head's own carry from step k - 1 at p;
  label         the target's greedy token after position p + 1 + k, as a draft-vocabulary id; with soft labels
                the loss is against the target's whole distribution there (its top k, renormalised over the
                draft vocabulary), the label still deciding which rows count and what is "correct";
  attention     step k at p sees step-0 keys at positions <= p (the draft extend's KV at inference) and its own
                keys of steps 1..k at p (its chain of draft ancestors): `TTTAttention`.
Owns the batch layout and the loss; knows nothing about data generation, optimisers or checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

from fastspec.train.data import Features

NO_LABEL = -1  # out of the sequence or not a response token: no loss, not counted


@dataclass(frozen=True)
class TTTBatch:
    aux: torch.Tensor  # [T, 3H] target features
    positions: torch.Tensor  # [T] position inside its conversation
    doc_ids: torch.Tensor  # [T] which conversation of the batch
    inputs: torch.Tensor  # [S, T] token fed at step k
    labels: torch.Tensor  # [S, T] draft id; NO_LABEL; or Vd for a label outside the draft vocabulary (a miss)
    soft_ids: torch.Tensor | None = None  # [S, T, k] draft ids of the target's likeliest tokens, -1 outside Vd
    soft_probs: torch.Tensor | None = None  # [S, T, k] float32 their target probabilities, renormalised over Vd

    def to(self, device: str | torch.device) -> TTTBatch:
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if getattr(self, f.name) is not None})


@dataclass(frozen=True)
class TTTStats:
    loss: torch.Tensor  # [] weighted mean cross-entropy (differentiable)
    correct: torch.Tensor  # [S] draft top-1 == label, counted over labelled rows
    chain_correct: torch.Tensor  # [S] steps 0..k all right for this root
    count: torch.Tensor  # [S] labelled rows


def make_batch(features: Features, conversations: list[int], t2d: torch.Tensor, steps: int) -> TTTBatch:
    """Pack `conversations` (indices into `features`) into one row; `t2d` [V] maps target -> draft id or -1."""
    Vd = int((t2d >= 0).sum())
    spans = [(int(features.offsets[c]), int(features.offsets[c + 1]), int(features.prompt_lens[c]))
             for c in conversations]
    rows = torch.cat([torch.arange(s, e) for s, e, _ in spans])  # [T] rows of `features`
    positions = torch.cat([torch.arange(e - s) for s, e, _ in spans])
    lengths = torch.cat([torch.full((e - s,), e - s) for s, e, _ in spans])
    prompt_lens = torch.cat([torch.full((e - s,), plen) for s, e, plen in spans])
    doc_ids = torch.cat([torch.full((e - s,), j) for j, (s, e, _) in enumerate(spans)])
    inputs, labels, soft_ids, soft_probs = [], [], [], []
    for k in range(steps):
        # step k at p: input token p + 1 + k; label predicts token p + 2 + k, which must be a response token
        has_input = positions + 1 + k < lengths
        src = torch.where(has_input, rows + 1 + k, rows)
        inputs.append(torch.where(has_input, features.tokens[src], 0))
        target_pos = positions + 2 + k
        labelled = (target_pos < lengths) & (target_pos >= prompt_lens)
        draft_id = t2d[features.labels[src]]
        labels.append(torch.where(labelled, torch.where(draft_id >= 0, draft_id, Vd), NO_LABEL))
        if features.soft_ids is not None:  # the distribution the label was drawn from, restricted to Vd
            ids = t2d[features.soft_ids[src].long()]  # [T, k]
            probs = features.soft_probs[src].float() * (ids >= 0)
            soft_ids.append(ids)
            soft_probs.append(probs / probs.sum(-1, keepdim=True).clamp(min=1e-12))
    soft = (torch.stack(soft_ids), torch.stack(soft_probs)) if soft_ids else (None, None)
    return TTTBatch(features.aux[rows], positions, doc_ids, torch.stack(inputs), torch.stack(labels), *soft)


def soft_cross_entropy(logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Mean over rows of -sum_j probs[j] * log softmax(logits)[ids[j]]: cross-entropy against the target's
    distribution (kept as its top k; ids < 0 carry probability 0). One-hot probs give F.cross_entropy exactly.

    logits [M, Vd] float32; ids [M, k] int64; probs [M, k] float32, rows summing to 1 (or 0: no loss)."""
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids.clamp(min=0))  # [M, k]
    return -(probs * logp).sum(-1).mean()


class TTTAttention:
    """`attend` for the unrolled head: call k of the one layer is step k (see the module docstring).
    Sequences are packed in one row; step-0 scores are computed per sequence (block-diagonal), the rest per row."""

    def __init__(self, doc_ids: torch.Tensor):  # [T], equal ids contiguous
        self.lengths = torch.unique_consecutive(doc_ids, return_counts=True)[1].tolist()
        self.keys: list[torch.Tensor] = []  # per step [Hkv, 1, T, D]
        self.values: list[torch.Tensor] = []

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        # q [T, Hq, D]; k, v [T, Hkv, D] -> [T, Hq, D]
        T, Hq, D = q.shape
        Hkv = k.shape[1]
        self.keys.append(k.permute(1, 0, 2)[:, None])
        self.values.append(v.permute(1, 0, 2)[:, None])
        qh = q.view(T, Hkv, Hq // Hkv, D).permute(1, 2, 0, 3)  # [Hkv, rep, T, D]
        own = [((qh * key).sum(-1).float() * scale)[..., None] for key in self.keys[1:]]  # [Hkv, rep, T, 1] each
        outs, start = [], 0
        for n in self.lengths:
            rows = slice(start, start + n)
            prefix = (qh[:, :, rows] @ self.keys[0][:, :, rows].transpose(-1, -2)).float() * scale  # [.., n, n]
            causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            prefix = prefix.masked_fill(~causal, float("-inf"))
            probs = torch.softmax(torch.cat([prefix, *(o[:, :, rows] for o in own)], dim=-1), dim=-1).to(q.dtype)
            o = probs[..., :n] @ self.values[0][:, :, rows]
            for j, value in enumerate(self.values[1:]):
                o = o + probs[..., n + j, None] * value[:, :, rows]
            outs.append(o)
            start += n
        return torch.cat(outs, dim=2).permute(2, 0, 1, 3).reshape(T, Hq, D)


def ttt_loss(head, batch: TTTBatch, step_weight: float = 0.8) -> TTTStats:
    """Unroll `head` (a LlamaForCausalLMEagle3) over the batch; loss = sum_k w^k * mean CE at step k."""
    attn = TTTAttention(batch.doc_ids)
    hidden = batch.aux
    Vd = head.draft_vocab_size
    loss = batch.aux.new_zeros((), dtype=torch.float32)
    correct, chain, count = [], [], []
    chain_ok = torch.ones_like(batch.positions, dtype=torch.bool)
    for k in range(batch.inputs.shape[0]):
        out = head(batch.inputs[k], batch.positions + k, hidden, attn)
        logits = head.compute_logits(out.normed)  # [T, Vd] float32
        labels = batch.labels[k]
        trainable = (labels >= 0) & (labels < Vd)
        if trainable.any():
            if batch.soft_ids is None:
                ce = F.cross_entropy(logits[trainable], labels[trainable])
            else:
                ce = soft_cross_entropy(logits[trainable], batch.soft_ids[k][trainable], batch.soft_probs[k][trainable])
            loss = loss + step_weight**k * ce
        labelled = labels >= 0
        hit = (logits.argmax(-1) == labels) & labelled
        chain_ok = chain_ok & (hit | ~labelled)  # a root's steps before its first response token don't count
        correct.append(hit.sum())
        chain.append((chain_ok & labelled).sum())
        count.append(labelled.sum())
        hidden = out.carry
    return TTTStats(loss, torch.stack(correct), torch.stack(chain), torch.stack(count))
