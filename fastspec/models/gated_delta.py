"""The gated delta rule (Qwen3-Next's linear attention) and its short causal convolution, in plain torch.

Per value head, a state S [Dk, Dv] decays by a_t = exp(g_t) and takes a delta-rule write of token t:
    S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T,   o_t = S_t^T q_t.
Three ways to run it, equal up to rounding (tested against each other and against transformers):
  `recurrent`: token by token (decode; the reference);
  `chunked`:   C tokens at a time with one triangular solve per chunk (prefill);
  `tree`:      every node of a draft tree from its parent's state (speculative verify), keeping each node's
               state, so that accept can keep the state of the last accepted token and nothing else survives.
Shapes: q, k [B, T, H, Dk] (already one per value head), v [B, T, H, Dv], g, beta [B, T, H]; states float32
[B, H, Dk, Dv]. No KV, no pools: callers pass and keep states (fastspec.models.recurrent runs a layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastspec.models.recurrent import scan_tree


def _step(S, q, k, v, g, beta):
    # S [B, H, Dk, Dv]; q, k [B, H, Dk]; v [B, H, Dv]; g, beta [B, H]
    S = S * g.exp()[..., None, None]
    delta = beta[..., None] * (v - torch.einsum("bhkv,bhk->bhv", S, k))  # what the state fails to predict
    S = S + k[..., :, None] * delta[..., None, :]
    return S, torch.einsum("bhkv,bhk->bhv", S, q)


def recurrent(q, k, v, g, beta, state):
    """(o [B, T, H, Dv], final state)."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    out = []
    for t in range(q.shape[1]):
        state, o = _step(state, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        out.append(o)
    return torch.stack(out, 1), state


def chunked(q, k, v, g, beta, state, chunk: int = 64):
    """(o [B, T, H, Dv], final state), C = `chunk` tokens per step. Within a chunk from state S0, with
    gamma_t = prod_{s<=t} a_s, the delta-rule writes u_t solve (I + A) U = beta*V - beta*gamma*K S0, where
    A[t, s] = beta_t (gamma_t / gamma_s) k_t.k_s for s < t; then O = (gamma Q) S0 + (M o QK^T) U with
    M[t, s] = gamma_t / gamma_s for s <= t, and S_C = gamma_C S0 + sum_s (gamma_C / gamma_s) k_s u_s^T."""
    B, T, H, Dk = k.shape
    pad = -T % chunk  # padded tokens: a = 1, beta = 0, k = v = q = 0 -> they write nothing and read nothing
    q, k, v, g, beta = (F.pad(t.float().transpose(1, 2), (0, 0, 0, pad) if t.dim() == 4 else (0, pad))
                        for t in (q, k, v, g, beta))  # [B, H, T', D] / [B, H, T']
    n = q.shape[2] // chunk
    q, k, v = (t.reshape(B, H, n, chunk, -1) for t in (q, k, v))
    g, beta = g.reshape(B, H, n, chunk), beta.reshape(B, H, n, chunk)
    log_gamma = g.cumsum(-1)  # [B, H, n, C]
    ratio = log_gamma[..., :, None] - log_gamma[..., None, :]  # log(gamma_t / gamma_s)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    M = ratio.masked_fill(~lower, -torch.inf).exp()  # [B, H, n, C, C], zero above the diagonal
    strict = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril(-1)
    A = (beta[..., None] * M * (k @ k.transpose(-1, -2))).masked_fill(~strict, 0.0)
    eye = torch.eye(chunk, device=q.device)
    W = torch.linalg.solve_triangular(eye + A, beta[..., None] * v, upper=False, unitriangular=True)
    Kc = torch.linalg.solve_triangular(eye + A, (beta * log_gamma.exp())[..., None] * k, upper=False,
                                       unitriangular=True)
    scores = M * (q @ k.transpose(-1, -2))  # [B, H, n, C, C]
    to_end = (log_gamma[..., -1:] - log_gamma).exp()  # gamma_C / gamma_s
    out = []
    for i in range(n):
        U = W[:, :, i] - Kc[:, :, i] @ state
        out.append((q[:, :, i] * log_gamma[:, :, i, :, None].exp()) @ state + scores[:, :, i] @ U)
        decayed_k = k[:, :, i] * to_end[:, :, i, :, None]
        state = state * log_gamma[:, :, i, -1, None, None].exp() + decayed_k.transpose(-1, -2) @ U
    o = torch.cat(out, 2)[:, :, :T]  # [B, H, T, Dv]
    return o.transpose(1, 2), state


def tree(q, k, v, g, beta, state, parents):
    """Every node from its parent's state. parents [B, N]: the parent node of node i (< i), -1 for a root
    (which starts from `state`). Returns (o [B, N, H, Dv], node states [B, N, H, Dk, Dv])."""
    return scan_tree(_step, state, parents, *(t.float() for t in (q, k, v, g, beta)))
