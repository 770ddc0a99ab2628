"""A worker's memory: the target's (and the draft's) KV pools sharing one allocator, the request->slot table, a
hybrid target's recurrent state pool, and the prefix cache.

Owns their construction (sizing by a token budget or a fraction of free memory, symbolic pool dims for compiled
graphs, the checks that need the model: a state-save interval against the page size) and the pools' growth.
Does not decide when they grow (the engine, between steps) nor who holds which slot (the worker).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastspec.config import EngineConfig
from fastspec.engine.prefix_cache import PrefixCache
from fastspec.errors import OptionError
from fastspec.graphs import size_varies
from fastspec.memory.allocator import SlotAllocator, make_allocator
from fastspec.memory.kv_pool import KVPool
from fastspec.memory.req_table import ReqToTokenTable
from fastspec.memory.state_pool import StatePool
from fastspec.models.model_config import ModelConfig
from fastspec.spec_config import SpecConfig

CHECKPOINTS_PER_ROW = 8  # hybrid targets with the prefix cache: saved states per running-request row
INITIAL_KV_TOKENS = 256  # a growing pool's first capacity (whole pages): a short prompt and answer


@dataclass(frozen=True)
class WorkerMemory:
    pool: KVPool
    draft_pool: KVPool | None
    allocator: SlotAllocator
    table: ReqToTokenTable
    states: StatePool | None  # a hybrid target's recurrent states
    cache: PrefixCache | None  # --radix-cache
    ceiling: int  # the most tokens the pools may hold: admission and preemption plan with it (static: the capacity)
    compiled: bool  # graph_mode compile: the pools' slot dim is symbolic in the compiled graphs

    @property
    def room_to_grow(self) -> int:
        return self.ceiling - self.pool.capacity

    @property
    def pools(self) -> tuple[KVPool, ...]:
        return tuple(p for p in (self.pool, self.draft_pool) if p is not None)

    def grow(self, num_free: int) -> None:
        """Double the pools (and the allocator's slots with them) until `num_free` slots are free or they reach the
        ceiling. Only between steps: a round in flight, or an allocator backup, would hold the old pool."""
        capacity, short = self.pool.capacity, num_free - self.allocator.num_free()
        new = capacity
        while new - capacity < short and new < self.ceiling:
            new = min(2 * new, self.ceiling)
        if new == capacity:
            return
        for p in self.pools:
            p.grow(new)
        if self.compiled:
            _mark_sizes_vary(self.pools)
        self.allocator.grow(new)


def build_memory(c: ModelConfig, draft_shape: tuple | None, cfg: EngineConfig, spec: SpecConfig,
                 max_context_len: int, kv_scales: tuple | None = None) -> WorkerMemory:
    """draft_shape: the draft pool's (layers, heads, head dim, separate V), or None without a draft model.
    kv_scales: the target's checkpoint KV scales (fastspec.models.kv_scales), for its fp8 pool.

    The ceiling is --max-total-tokens, else kv_mem_fraction of the memory available now (target and draft pools
    together). With --max-total-tokens, or on CUDA (captured graphs hold the pools' addresses), the pools are
    static at the ceiling. Otherwise (CPU) they start at INITIAL_KV_TOKENS and double when the engine asks for
    more free slots than they have (`WorkerMemory.grow`), up to the ceiling."""
    # a hybrid target's states first: a KV pool sized from free memory then sizes from what they left
    states = _state_pool(c, cfg, spec)
    layers, heads, dim, separate_v = c.kv_layout
    kv_dtype = cfg.kv_torch_dtype
    per_token = KVPool.bytes_per_token(layers, heads, dim, kv_dtype, separate_v)
    if draft_shape is not None:  # the draft pool has the same slots, so it costs per token as well
        per_token += KVPool.bytes_per_token(*draft_shape[:3], kv_dtype, draft_shape[3])
    ceiling = KVPool.capacity_for(per_token, max_tokens=cfg.max_total_tokens,
                                  mem_fraction=None if cfg.max_total_tokens else cfg.kv_mem_fraction,
                                  device=cfg.device, page_size=cfg.page_size)
    grows = cfg.max_total_tokens is None and torch.device(cfg.device).type == "cpu"
    capacity = min(ceiling, -(-INITIAL_KV_TOKENS // cfg.page_size) * cfg.page_size) if grows else ceiling
    pool = KVPool(layers, heads, dim, capacity, cfg.page_size, kv_dtype, cfg.device, separate_v, kv_scales)
    allocator = make_allocator(pool.capacity, cfg.page_size, cfg.device)
    # a round's draft scratch or verify rows past the context, twice: under the overlap schedule a request that
    # finished runs one more round before the host knows
    margin = 2 * max(spec.topk * spec.num_steps, spec.num_draft_tokens) + cfg.page_size
    table = ReqToTokenTable(cfg.max_running_requests, max_context_len + margin, cfg.device)
    sinks = table.table.shape[0] if spec.algorithm == "STANDALONE" else 0  # its first-token key: a slot per row
    draft_pool = None if draft_shape is None else KVPool(*draft_shape[:3], capacity, cfg.page_size, kv_dtype,
                                                         cfg.device, draft_shape[3], row_slots=sinks)
    cache = PrefixCache(allocator, table, cfg.page_size, cfg.device, states) if cfg.radix_cache else None
    memory = WorkerMemory(pool, draft_pool, allocator, table, states, cache, ceiling, cfg.graph_mode == "compile")
    if memory.compiled:
        _mark_sizes_vary(memory.pools)
    return memory


def _mark_sizes_vary(pools) -> None:
    """Keep the pools' capacity (by free memory, and as they grow) out of the compiled graphs: one graph serves
    every size."""
    for p in pools:
        for kv in (t for t in (p.k, p.v) if t is not None):
            size_varies(kv, 1)


def _state_pool(c: ModelConfig, cfg: EngineConfig, spec: SpecConfig) -> StatePool | None:
    """A hybrid target's recurrent states: a row per running request, per-node track buffers for verify and,
    with the prefix cache, checkpoints saved every mamba_track_interval tokens."""
    if c.hybrid is None:
        return None
    if cfg.radix_cache and cfg.mamba_track_interval % cfg.page_size:
        raise OptionError("{mamba_track_interval=} is not a multiple of {page_size=}",
                          mamba_track_interval=cfg.mamba_track_interval, page_size=cfg.page_size)
    nodes = spec.num_draft_tokens if spec.enabled else 0
    checkpoints = CHECKPOINTS_PER_ROW * cfg.max_running_requests if cfg.radix_cache else 0
    return StatePool(c.hybrid, cfg.max_running_requests, nodes, cfg.torch_dtype, cfg.device, checkpoints)
