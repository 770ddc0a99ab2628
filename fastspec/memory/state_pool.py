"""Static pool of recurrent states for a hybrid target's linear-attention layers, beside the KV pool.

A request's states live at state row = its request->slot table row + 1 (preallocated for max_running_requests
rows, never resized; state row 0 is the dummy that padded graph rows read and write, as KV slot 0 is): the
short-convolution window [conv_dim, kernel-1] and the recurrent state (float32; a delta-rule [Hv, Dk, Dv] or a
Mamba2 [heads, head_dim, d_state]) of every recurrent layer. A verify forward writes each draft node's states into the `track_*` buffers (row, node)
instead, and the commit copies the accepted node's into the row, so a rejected branch leaves nothing behind.
Knows nothing about models or attention; `RecurrentView` tells a forward which rows it reads and writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class StateShapes(Protocol):
    """What the pool reads of a hybrid model's configuration (fastspec.models' HybridConfig is one)."""

    linear_layers: tuple[int, ...]  # the recurrent layers
    conv_dim: int
    conv_kernel: int
    state_shape: tuple[int, ...]  # one recurrent state per layer and row


class StatePool:
    def __init__(self, hybrid: StateShapes, max_rows: int, max_nodes: int, dtype=torch.float32, device="cpu",
                 max_checkpoints: int = 0):
        """`max_nodes`: draft-tree nodes a verify tracks per request (0: no speculation, no track buffers);
        `max_checkpoints`: saved states the prefix cache can resume from (0: none)."""
        L, h, rows = len(hybrid.linear_layers), hybrid, max_rows + 1
        conv, ssm = (h.conv_dim, h.conv_kernel - 1), h.state_shape
        self.conv = torch.zeros(L, rows, *conv, dtype=dtype, device=device)  # [L, rows, C, K-1]
        self.ssm = torch.zeros(L, rows, *ssm, dtype=torch.float32, device=device)  # [L, rows, *state_shape]
        self.track_conv = torch.zeros(L, rows, max_nodes, *conv, dtype=dtype, device=device)
        self.track_ssm = torch.zeros(L, rows, max_nodes, *ssm, dtype=torch.float32, device=device)
        self.ckpt_conv = torch.zeros(L, max_checkpoints, *conv, dtype=dtype, device=device)
        self.ckpt_ssm = torch.zeros(L, max_checkpoints, *ssm, dtype=torch.float32, device=device)
        self.free_checkpoints = list(range(max_checkpoints))

    def save(self, table_row: int, node: int | None = None) -> int | None:
        """Copy a request's state (its row's, or the one its last verify tracked at `node`) into a free
        checkpoint; its id, or None when every checkpoint is taken."""
        if not self.free_checkpoints:
            return None
        ckpt, row = self.free_checkpoints.pop(), self.state_rows(table_row)
        conv, ssm = (self.conv[:, row], self.ssm[:, row]) if node is None else (
            self.track_conv[:, row, node], self.track_ssm[:, row, node])
        self.ckpt_conv[:, ckpt], self.ckpt_ssm[:, ckpt] = conv, ssm
        return ckpt

    def restore(self, table_row: int, ckpt: int) -> None:
        """A request resumes from a checkpoint (which stays saved)."""
        row = self.state_rows(table_row)
        self.conv[:, row], self.ssm[:, row] = self.ckpt_conv[:, ckpt], self.ckpt_ssm[:, ckpt]

    def drop(self, ckpt: int) -> None:
        self.free_checkpoints.append(ckpt)

    @staticmethod
    def state_rows(table_rows):  # int or int64 tensor
        return table_rows + 1  # row 0 is the dummy

    def view(self, table_rows: torch.Tensor, lens: tuple[int, ...] | None = None,
             parents: torch.Tensor | None = None) -> RecurrentView:
        return RecurrentView(self, self.state_rows(table_rows), lens, parents)

    def reset(self, table_rows: torch.Tensor) -> None:
        """Zero the states of requests starting a sequence from its first token."""
        rows = self.state_rows(table_rows)
        self.conv[:, rows] = 0
        self.ssm[:, rows] = 0

    def keep_node(self, table_rows: torch.Tensor, nodes: torch.Tensor) -> None:
        """Commit: each request's state becomes the one its verify tracked at `nodes` (the last accepted token)."""
        # table_rows, nodes: [bs] int64
        rows = self.state_rows(table_rows)
        self.conv[:, rows] = self.track_conv[:, rows, nodes]
        self.ssm[:, rows] = self.track_ssm[:, rows, nodes]

    @staticmethod
    def write(buffer: torch.Tensor, layer: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        """buffer[layer, rows] = values, as an index_put_ on the pool tensor itself (an in-place write into a
        view of a compiled graph's input would make Inductor rebuild the whole pool)."""
        buffer.index_put_((torch.full_like(rows, layer), rows), values.to(buffer.dtype))


@dataclass(frozen=True)
class RecurrentView:
    """The recurrent states one forward uses: the pool, whose rows (one per request, in batch order), and how
    the forward's tokens relate: consecutive segments of `lens` tokens (prefill chunks, plain decode: read each
    row's state, advance it, write it back), or draft trees of `parents` (verify: per-node states into the
    track buffers, the rows' states untouched)."""

    pool: StatePool
    rows: torch.Tensor  # int64 [bs]  state rows (table rows + 1; 0 = the dummy)
    lens: tuple[int, ...] | None = None  # tokens per request, host ints
    parents: torch.Tensor | None = None  # int64 [bs, N]  parent node of node i, -1 for the root
