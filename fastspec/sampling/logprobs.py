"""The target's log-probabilities of the tokens a request produced (SamplingParams.logprobs).

Always the target's raw distribution (log_softmax of its logits, before the controls, a grammar's mask and
temperature / top-k / top-p), at the position that produced each token: under speculation the verify row of the
accepted node before it, so a speculative run reports exactly what target-only decoding reports. Never the draft's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastspec.utils.transfer import to_device

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the `logprobs` most likely tokens (id, logprob), most likely first


def token_logprobs(logits: torch.Tensor,  # [n, V]  the rows that produced `tokens`
                   tokens: list[int], top: int) -> tuple[TokenLogprob, ...]:
    logp = torch.log_softmax(logits.float(), -1)
    chosen = logp.gather(1, to_device(tokens, logp.device)[:, None])[:, 0].tolist()
    values, ids = logp.topk(top, -1) if top else (logp[:, :0], logp[:, :0].long())
    return tuple(TokenLogprob(t, lp, tuple(zip(i, v))) for t, lp, i, v in
                 zip(tokens, chosen, ids.tolist(), values.tolist()))
