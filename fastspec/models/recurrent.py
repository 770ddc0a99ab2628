"""What every recurrent layer of a hybrid target shares: the short causal convolution and the driver that runs a
layer's scan over one forward's token structure while keeping its states in the state pool.

The convolution is depthwise over the last `kernel` inputs, plus an optional bias, then SiLU; its state is the
window of the last kernel - 1 inputs. `run_layer` takes the forward's RecurrentView: consecutive per-request
segments (prefill chunks, plain decode; each row's state advances and is written back) or draft trees (verify;
each node starts from its parent's state, every node's state goes to the track buffers, the rows stay as they
were). The scan itself (gated delta rule, Mamba2 SSD) is the layer's `kernel` argument.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from fastspec.memory.state_pool import RecurrentView, StatePool
from fastspec.models.layers import by_rows

# kernel(y [B, n, C] conv output, tokens: slice of the forward's tokens, state [B, *S], parents [B, n] | None)
#   -> (o [B, n, ...], final state [B, *S], or per-node states [B, n, *S] when parents are given)
Kernel = Callable[[torch.Tensor, slice, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]


def conv(x, weight, bias, window):
    """Causal depthwise conv + SiLU over a sequence. x [B, T, C]; weight [C, K]; bias [C] | None; window [B, C, K-1]
    (the inputs before x, oldest first). Returns (y [B, T, C], the new window)."""
    K = weight.shape[1]
    full = torch.cat([window.to(x.dtype), x.transpose(1, 2)], -1)  # [B, C, K-1+T]
    b = None if bias is None else bias.to(x.dtype)
    y = F.conv1d(full, weight[:, None, :].to(x.dtype), b, groups=weight.shape[0])  # [B, C, T]
    return by_rows(F.silu, y.transpose(1, 2)), full[..., full.shape[-1] - (K - 1):]


def scan_tree(step, state, parents, *inputs):
    """Every node of draft trees from its parent's state: step(parent state [B, *S], *inputs at node i) ->
    (node state, node output). parents [B, N]: the parent node of node i (< i), -1 for a root (which starts from
    `state`). Returns (outputs [B, N, ...], node states [B, N, *S])."""
    B, N = parents.shape
    states = state.new_zeros(B, N + 1, *state.shape[1:])  # slot 0: the committed state, slot i + 1: node i
    states[:, 0] = state
    batch = torch.arange(B, device=parents.device)
    out = []
    for i in range(N):
        node_state, y = step(states[batch, parents[:, i] + 1], *(t[:, i] for t in inputs))
        states[:, i + 1] = node_state
        out.append(y)
    return torch.stack(out, 1), states[:, 1:]


def conv_tree(x, weight, bias, window, parents):
    """The convolution along each node's ancestor path. x [B, N, C]; window [B, C, K-1]; parents [B, N] (the parent
    node of node i, < i; -1 for a root, which continues `window`). Returns (y [B, N, C], node windows
    [B, N, C, K-1])."""
    def step(parent_window, xi):  # a decode step's own convolution, so a node rounds as that step does
        y, node_window = conv(xi[:, None], weight, bias, parent_window)
        return node_window, y[:, 0]

    return scan_tree(step, window, parents, x)


def tree_parents(tree_mask: torch.Tensor) -> torch.Tensor:
    """[B, N] parent of each node from an ancestor mask [B, N, N] (row i: i and its ancestors): the deepest
    ancestor, i.e. the largest j < i the row sees; -1 for the root."""
    N = tree_mask.shape[-1]
    cols = torch.arange(N, device=tree_mask.device)
    seen = tree_mask & (cols[None, :] < cols[:, None])  # strict ancestors
    return torch.where(seen, cols, -1).amax(-1)


def run_layer(states: RecurrentView, layer: int, conv_in: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None, kernel: Kernel) -> torch.Tensor:
    """conv + scan of recurrent layer `layer` over the forward's tokens. conv_in [T, C] -> o [T, ...]."""
    pool, rows, C = states.pool, states.rows, conv_in.shape[-1]
    if states.parents is not None:
        bs, n = states.parents.shape
        y, windows = conv_tree(conv_in.view(bs, n, C), weight, bias, pool.conv[layer, rows], states.parents)
        o, node_states = kernel(y, slice(0, bs * n), pool.ssm[layer, rows], states.parents)
        StatePool.write(pool.track_conv, layer, rows, windows)
        StatePool.write(pool.track_ssm, layer, rows, node_states)
        return o.flatten(0, 1)
    lens = states.lens
    if len(set(lens)) == 1:  # every request has as many tokens (plain decode): one batched run
        groups = [(rows, 0, lens[0], len(lens))]
    else:
        groups = [(rows[b:b + 1], sum(lens[:b]), n, 1) for b, n in enumerate(lens) if n]
    out = []
    for group_rows, start, n, bs in groups:
        tokens = slice(start, start + n * bs)
        y, window = conv(conv_in[tokens].view(bs, n, C), weight, bias, pool.conv[layer, group_rows])
        o, state = kernel(y, tokens, pool.ssm[layer, group_rows], None)
        StatePool.write(pool.conv, layer, group_rows, window)
        StatePool.write(pool.ssm, layer, group_rows, state)
        out.append(o.flatten(0, 1))
    return torch.cat(out) if len(out) > 1 else out[0]
