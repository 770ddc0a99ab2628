"""Recurrent-state checkpoints for the prefix cache of a hybrid target (SGLang's mamba_track_interval).

The KV of a cached prefix can be reused at any page boundary, a recurrent state only where one was saved. So
while a request runs, its state is saved every `interval` tokens (prefill chunks are cut to end on those
boundaries; a decode round that crosses one saves the state its verify tracked at that token), kept with the
request, and handed to the radix tree with its KV at release; a new request resumes from the deepest saved
state on its cached prefix (fastspec.memory.radix.RadixTree.match_state). Checkpoints nobody can use are dropped
back into the state pool's free list; when a request needs one and none is free, the tree gives back its least
recently used (RadixTree.reclaim_state), so the checkpoints follow what was used last. Knows nothing about
models; the worker calls these at the right moments.
"""

from __future__ import annotations

from collections.abc import Callable

from fastspec.memory.radix import RadixTree
from fastspec.memory.state_pool import StatePool


def prefill_budget(seq_len: int, interval: int) -> int:
    """How far a prefill chunk may go: to the next multiple of `interval` (where a state is saved)."""
    return interval - seq_len % interval


def save_crossed(pool: StatePool, r, old_len: int, nodes: list[int] | None, interval: int,
                 reclaim: Callable[[], bool]) -> None:
    """A request advanced from old_len to r.seq_len tokens: save its state at each multiple of `interval` it
    reached. `nodes`: the verify nodes kept, in order (node i leaves the state after old_len + i + 1 tokens);
    None: the row itself (a prefill chunk or a plain round, which end at most on one boundary: r.seq_len).
    With every checkpoint taken, `reclaim()` has the tree give its least recently used one back (False: it holds
    none)."""
    first = old_len - old_len % interval + interval
    for length in range(first, r.seq_len + 1, interval):
        if nodes is None and length != r.seq_len:
            continue  # the row holds only the state after all of its tokens
        if not pool.free_checkpoints and not reclaim():
            return  # the running requests hold every checkpoint: this request caches less
        ckpt = pool.save(r.row, None if nodes is None else nodes[length - old_len - 1])
        r.checkpoints.append((length, ckpt))


def hand_over(pool: StatePool, tree: RadixTree, r, keys: list) -> None:
    """At release, after the tree cached `keys` (one per position of r's history): attach each checkpoint at a
    cached length to its node (the tree drops it at eviction); drop the others."""
    for length, ckpt in r.checkpoints:
        if length > len(keys) or not tree.set_state(keys[:length], ckpt):
            pool.drop(ckpt)
    r.checkpoints = []


def resume(pool: StatePool, tree: RadixTree, r, keys: list):
    """The longest prefix of `keys` cached with a saved state; that state is copied into r's row. Returns the
    match (its slots and node), as RadixTree.match does."""
    match, ckpt = tree.match_state(keys)
    if ckpt is not None:
        pool.restore(r.row, ckpt)
    return match


def check(pool: StatePool, tree: RadixTree | None, running) -> None:
    """Leak check: free checkpoints + the tree's + the running requests' = all of them, each once."""
    held = [c for r in running for _, c in r.checkpoints] + (tree.all_states() if tree is not None else [])
    every = sorted(pool.free_checkpoints + held)
    assert every == list(range(pool.ckpt_ssm.shape[1])), f"state checkpoints leaked or doubled: {every}"
