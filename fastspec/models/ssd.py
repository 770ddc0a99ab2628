"""Mamba2's selective state space scan (SSD), in plain torch.

Per head, a state S [P, N] (head_dim x d_state) decays by a_t = exp(dt_t * A) and takes the input's write:
    S_t = a_t S_{t-1} + dt_t x_t B_t^T,   y_t = S_t C_t + D x_t.
Three ways to run it, equal up to rounding (tested against each other and against transformers):
  `recurrent`: token by token (decode; the reference);
  `chunked`:   C tokens at a time (prefill): with log decays l_t = cumsum(dt * A) inside a chunk from S0,
               y_t = sum_{s<=t} exp(l_t - l_s) (C_t . B_s) dt_s x_s + exp(l_t) S0 C_t + D x_t and
               S_C = exp(l_C) S0 + sum_s exp(l_C - l_s) dt_s x_s B_s^T;
  `tree`:      every node of a draft tree from its parent's state, keeping each node's state.
Shapes: x [B, T, H, P]; dt [B, T, H] (after softplus and clamping); A [H] (negative); Bm, Cm [B, T, H, N]
(already one per head); D [H]; states float32 [B, H, P, N].
"""

from __future__ import annotations

import torch

from fastspec.models.recurrent import scan_tree


def _step(S, x, dt, A, Bm, Cm, D):
    # S [B, H, P, N]; x [B, H, P]; dt [B, H]; Bm, Cm [B, H, N]
    S = S * (dt * A).exp()[..., None, None] + (dt[..., None] * x)[..., None] * Bm[:, :, None, :]
    # y = S C: on the CPU as a batched matrix-vector product, which rounds a request alike in any batch (torch's
    # einsum contracts it another way at B = 1: a request's y rounded otherwise alone than batched, at N = 128)
    y = (S @ Cm[..., None])[..., 0] if S.device.type == "cpu" else torch.einsum("bhpn,bhn->bhp", S, Cm)
    return S, y + D[:, None] * x


def recurrent(x, dt, A, Bm, Cm, D, state):
    """(y [B, T, H, P], final state)."""
    x, dt, Bm, Cm = (t.float() for t in (x, dt, Bm, Cm))
    A, D = A.float(), D.float()
    out = []
    for t in range(x.shape[1]):
        state, y = _step(state, x[:, t], dt[:, t], A, Bm[:, t], Cm[:, t], D)
        out.append(y)
    return torch.stack(out, 1), state


def chunked(x, dt, A, Bm, Cm, D, state, chunk: int = 64):
    """(y [B, T, H, P], final state), `chunk` tokens per step (see the module docstring)."""
    x, dt, Bm, Cm = (t.float() for t in (x, dt, Bm, Cm))
    A, D = A.float(), D.float()
    out = []
    for start in range(0, x.shape[1], chunk):
        c = slice(start, start + chunk)
        xc, Bc, Cc = x[:, c], Bm[:, c], Cm[:, c]
        dx = dt[:, c, :, None] * xc  # [B, L, H, P]
        log_decay = (dt[:, c] * A).cumsum(1)  # [B, L, H]
        L = xc.shape[1]
        ratio = log_decay[:, :, None, :] - log_decay[:, None, :, :]  # [B, L(t), L(s), H]
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()[None, :, :, None]
        weights = ratio.masked_fill(~causal, -torch.inf).exp() * torch.einsum("bthn,bshn->btsh", Cc, Bc)
        y = torch.einsum("btsh,bshp->bthp", weights, dx)
        y = y + log_decay.exp()[..., None] * torch.einsum("bhpn,bthn->bthp", state, Cc) + D[:, None] * xc
        to_end = (log_decay[:, -1:] - log_decay).exp()  # [B, L, H]
        state = state * log_decay[:, -1].exp()[..., None, None] + torch.einsum("bsh,bshp,bshn->bhpn", to_end, dx, Bc)
        out.append(y)
    return torch.cat(out, 1), state


def tree(x, dt, A, Bm, Cm, D, state, parents):
    """Every node from its parent's state. parents [B, N]: parent node of node i (< i), -1 for a root (which starts
    from `state`). Returns (y [B, N, H, P], node states [B, N, H, P, N])."""
    A, D = A.float(), D.float()
    return scan_tree(lambda S, xi, dti, Bi, Ci: _step(S, xi, dti, A, Bi, Ci, D), state, parents,
                     *(t.float() for t in (x, dt, Bm, Cm)))
