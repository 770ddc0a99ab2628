"""KV memory: static per-model KV pool, slot allocators (page 1 and paged) with backup/restore, and the
request -> slot table. Nothing here knows about models, attention or speculative decoding."""

from fastspec.memory.allocator import PagedAllocator, SlotAllocator, TokenAllocator, make_allocator
from fastspec.memory.kv_pool import KVPool
from fastspec.memory.req_table import ReqToTokenTable

__all__ = ["KVPool", "TokenAllocator", "PagedAllocator", "SlotAllocator", "make_allocator", "ReqToTokenTable"]
