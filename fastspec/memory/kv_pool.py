"""KV pool: one model's K and V for every layer, allocated at start-up and grown only by `grow` (between steps).

Owns the K/V tensors, slot-indexed writes and moves, growth (larger tensors, the old slots copied over) and
sizing (bytes per token; capacity from a token budget or from a fraction of the device's available memory).
Does not decide which slots a token gets (allocator.py), which request owns them (req_table.py) nor when the
pool grows (fastspec.engine.pools); knows nothing about attention or models.
Slot 0 (the whole page 0 when paged) is the dummy slot that padded rows write to.
"""

import os

import torch

from fastspec.errors import FastspecError, OptionError

MEMINFO_PATH = "/proc/meminfo"
PROC_CGROUP_PATH = "/proc/self/cgroup"  # the cgroups this process is in
CGROUP_ROOT = "/sys/fs/cgroup"
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}  # a float8 cache's largest finite values


def as_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to a cache dtype; into float8 saturated at its largest finite value first (a cast would give NaN
    for e4m3fn or inf for e5m2 past it, and torch's casts do not agree on which)."""
    if dtype in FP8_MAX:
        x = x.clamp(-FP8_MAX[dtype], FP8_MAX[dtype])
    return x.to(dtype)


def store_rows(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """cache[slots] = x rounded to the cache's dtype, in place (a float8 cache through its bytes: torch has no float8
    index_copy_ on CPU)."""
    x = as_cache(x, cache.dtype)
    if cache.dtype in FP8_MAX:
        cache, x = cache.view(torch.uint8), x.view(torch.uint8)
    cache.index_copy_(0, slots, x)


def _extended(kv: torch.Tensor, num_slots: int, tail: int) -> torch.Tensor:
    """kv [L, S, H, D] -> [L, num_slots, H, D]: the first S - tail slots copied to the same index and the last tail
    to the new end, the rest zero; an inference tensor if kv was one (a compiled graph's guards then hold for the
    new tensor as they did for the old)."""
    with torch.inference_mode(kv.is_inference()):
        out = kv.new_zeros((kv.shape[0], num_slots, *kv.shape[2:]))
        head = kv.shape[1] - tail
        out[:, :head] = kv[:, :head]
        out[:, num_slots - tail:] = kv[:, head:]
    return out


def available_bytes(device="cpu") -> int:
    """Memory the device can still give us: CUDA free memory, or on CPU the host's MemAvailable, less where this
    process's memory cgroup (a container's limit) leaves less."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        raise FastspecError(f"cannot measure free memory on device {device}; size the KV pool with max_tokens")
    host = _mem_available()
    room = _cgroup_room()  # a container's limit (docker --memory) is below what the host has free
    return host if room is None else min(host, room)


def _mem_available() -> int:
    try:
        with open(MEMINFO_PATH) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts kB
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _cgroup_room() -> int | None:
    """What this process's memory cgroup still allows: its limit less what it uses beyond its file pages, active
    or inactive, which the kernel reclaims before it kills (as MemAvailable counts them; cgroup v2, or v1's memory
    controller); None where no limit is set or none can be read."""
    try:
        with open(PROC_CGROUP_PATH) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        v2 = controllers == ""
        if not v2 and "memory" not in controllers.split(","):
            continue
        mount = os.path.join(CGROUP_ROOT, "" if v2 else "memory")
        for where in (os.path.join(mount, path.lstrip("/")), mount):  # (a container sees its own cgroup at the root)
            room = _room_in(where, v2)
            if room != -1:
                return room
    return None


def _room_in(where: str, v2: bool) -> int | None:
    """The room one cgroup directory allows (None: no limit; -1: not readable)."""
    names = ("memory.max", "memory.current", "active_file", "inactive_file") if v2 else (
        "memory.limit_in_bytes", "memory.usage_in_bytes", "total_active_file", "total_inactive_file")
    try:
        with open(os.path.join(where, names[0])) as f:
            limit = f.read().strip()
        if limit == "max" or int(limit) >= 1 << 60:  # (v1 writes its "no limit" as a huge number)
            return None
        with open(os.path.join(where, names[1])) as f:
            used = int(f.read())
        with open(os.path.join(where, "memory.stat")) as f:
            stat = dict(line.split()[:2] for line in f if line.strip())
    except (OSError, ValueError):
        return -1
    return max(0, int(limit) - used + int(stat.get(names[2], 0)) + int(stat.get(names[3], 0)))


class KVPool:
    """One model's K/V for all layers. k, v: [num_layers, num_slots, num_kv_heads, head_dim] (NHD, page-size-1
    view). num_slots = capacity + page_size + row_slots: the first page (slot 0 when page_size == 1) is the reserved
    dummy. Slot s of page p is p * page_size + s % page_size, so k[l].view(-1, page_size, H, D) is the paged view.
    `row_slots` slots after the allocator's belong to no token but to a request-table row each (`row_slot`): a
    STANDALONE draft keeps its first-token key there.

    A latent pool (`separate_v=False`, MLA) stores only k: per token one compressed-KV | rope-key vector, whose
    leading dims serve as V; v is None.

    `scales` (an fp8 cache with a checkpoint's KV scales): per layer (k_scale, v_scale); K is stored as
    K * (1 / k_scale) and V alike, so readers use k_scale x their softmax scale and multiply the output by
    v_scale (AttentionContext.attend)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, page_size: int = 1,
                 dtype=torch.float32, device="cpu", separate_v: bool = True,
                 scales: tuple[tuple[float, float], ...] | None = None, row_slots: int = 0):
        if capacity < 1 or page_size < 1:
            raise ValueError(f"KVPool needs capacity >= 1 and page_size >= 1, got {capacity}, {page_size}")
        if scales is not None and (len(scales) != num_layers or not separate_v):
            raise ValueError(f"KV scales for {len(scales)} layers of a {num_layers}-layer K / V pool")
        self.scales = scales
        self.page_size = page_size
        self.capacity = -(-capacity // page_size) * page_size  # round up to whole pages
        self.row_slots = row_slots
        self.num_slots = self.capacity + page_size + row_slots
        shape = (num_layers, self.num_slots, num_kv_heads, head_dim)
        # zeros, not empty: padded rows may read unwritten slots, and 0 * NaN garbage would poison attention
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [num_layers, num_slots, num_kv_heads, head_dim]
        self.v = torch.zeros(shape, dtype=dtype, device=device) if separate_v else None  # like k

    def grow(self, capacity: int) -> None:
        """Hold `capacity` tokens (rounded up to whole pages): new, larger k / v with every old slot copied to the
        same index (slot ids keep their meaning; the row slots move to the new end) and the new slots zero. Whoever
        kept the old tensors keeps reading them: only between steps, with nothing in flight."""
        capacity = -(-capacity // self.page_size) * self.page_size
        if capacity < self.capacity:
            raise ValueError(f"a KV pool grows: capacity {capacity} < {self.capacity}")
        self.capacity, self.num_slots = capacity, capacity + self.page_size + self.row_slots
        self.k = _extended(self.k, self.num_slots, self.row_slots)
        self.v = None if self.v is None else _extended(self.v, self.num_slots, self.row_slots)

    def row_slot(self, rows: torch.Tensor) -> torch.Tensor:
        """The slot of each request-table row in `rows` (int64, any shape; no host read): valid until `grow`."""
        return rows + (self.capacity + self.page_size)

    def scale(self, layer: int) -> tuple[float, float]:
        """(k_scale, v_scale) of `layer`: (1, 1) but in a pool made with a checkpoint's scales."""
        return (1.0, 1.0) if self.scales is None else self.scales[layer]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Store K/V of T tokens of one layer in place (divided by the layer's scales). Several padded rows may all
        name the dummy slot 0; which of them lands there is unspecified, and nothing reads it as real data."""
        # slots: [T] int64; k, v: [T, num_kv_heads, head_dim]
        if self.scales is not None:
            k_scale, v_scale = self.scales[layer]
            k, v = k * (1 / k_scale), v * (1 / v_scale)
        if torch.compiler.is_compiling():
            # an in-place write into a VIEW of a graph input makes Inductor rebuild the whole base tensor each
            # call (a compiled verify then cost ~25x eager on a 65k-slot pool); index_put_ on the base tensor
            # itself is reinplaced into a scatter of the T rows
            index = (torch.full_like(slots, layer), slots)
            self.k.index_put_(index, as_cache(k, self.k.dtype))
            if self.v is not None:
                self.v.index_put_(index, as_cache(v, self.v.dtype))
            return
        store_rows(self.k[layer], slots, k)
        if self.v is not None:
            store_rows(self.v[layer], slots, v)

    def move(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy K and V of slots src[i] to slots dst[i], all layers. The right side is gathered into a new
        tensor before the scatter, so overlapping dst/src (even a swap) behave like a simultaneous copy."""
        # dst, src: [n] int64
        self.k[:, dst] = self.k[:, src]
        if self.v is not None:
            self.v[:, dst] = self.v[:, src]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype, separate_v: bool = True) -> int:
        """K and V (or the latent alone) of one token across all layers."""
        return (1 + separate_v) * num_layers * num_kv_heads * head_dim * dtype.itemsize

    @staticmethod
    def capacity_for(bytes_per_token: int, *, max_tokens: int | None = None, mem_fraction: float | None = None,
                     device="cpu", page_size: int = 1) -> int:
        """Allocatable tokens (a multiple of page_size) for pools costing bytes_per_token per token.

        Pools sharing one allocator (target + draft) pass the SUM of their bytes_per_token. With mem_fraction
        the whole pool, reserved dummy page included, fits in mem_fraction of the currently available memory.
        Both budgets round down to whole pages.
        """
        if (max_tokens is None) == (mem_fraction is None):
            raise FastspecError("size the KV pool with exactly one of max_tokens / mem_fraction")
        if bytes_per_token < 1 or page_size < 1:
            raise ValueError(f"bytes_per_token and page_size must be >= 1, got {bytes_per_token}, {page_size}")
        if mem_fraction is not None:
            if not 0 < mem_fraction <= 1:
                raise OptionError("{kv_mem_fraction} must be in (0, 1], got {kv_mem_fraction!s}",
                                  kv_mem_fraction=mem_fraction)
            budget = int(available_bytes(device) * mem_fraction)
            tokens = budget // bytes_per_token - page_size  # the dummy page costs memory too
            what = f"{mem_fraction} of {budget / mem_fraction / 2**30:.2f} GiB available memory"
        else:
            tokens = max_tokens
            what = f"max_tokens={max_tokens}"
            need, have = (max_tokens + page_size) * bytes_per_token, available_bytes(device)
            if need > have:  # (where it would fail to allocate, or on CPU be killed while zeroing)
                raise OptionError(f"a KV pool of {{max_total_tokens!s}} tokens needs {need / 2**30:.2f} GiB, more "
                                  f"than the {have / 2**30:.2f} GiB available: lower {{max_total_tokens}}",
                                  max_total_tokens=max_tokens)
        capacity = max(tokens, 0) // page_size * page_size
        if capacity < page_size:
            raise FastspecError(f"KV pool too small: {what} holds fewer than one page of {page_size} tokens")
        return capacity
