"""Tests for fastspec.memory's KVPool: write / move, growth (every slot kept, new ones zeroed), and sizing (bytes
per token, capacity from --max-total-tokens or a memory fraction, the memory available to it)."""

import pytest
import torch

import fastspec.memory.kv_pool as kv_pool_module
from fastspec.errors import FastspecError
from fastspec.memory import KVPool


@pytest.mark.parametrize("page_size, separate_v", [(1, True), (4, False)])
def test_kv_pool_grow_keeps_every_slot_and_zeroes_the_new_ones(page_size, separate_v):
    pool = KVPool(num_layers=2, num_kv_heads=2, head_dim=3, capacity=4, page_size=page_size, separate_v=separate_v)
    slots = torch.arange(pool.num_slots)
    k, v = torch.randn(pool.num_slots, 2, 3), torch.randn(pool.num_slots, 2, 3)
    for layer in range(2):
        pool.write(layer, slots, k + layer, v - layer)
    old_slots = pool.num_slots
    pool.grow(9)  # rounds up to whole pages
    assert pool.capacity == -(-9 // page_size) * page_size and pool.num_slots == pool.capacity + page_size
    assert pool.k.shape == (2, pool.num_slots, 2, 3)
    for layer in range(2):
        assert torch.equal(pool.k[layer, :old_slots], k + layer)
        assert not pool.k[layer, old_slots:].any()
        if separate_v:
            assert torch.equal(pool.v[layer, :old_slots], v - layer) and not pool.v[layer, old_slots:].any()
    assert pool.v is None if not separate_v else pool.v.shape == pool.k.shape
    with pytest.raises(ValueError, match="grows"):
        pool.grow(1)


@pytest.mark.parametrize("page_size, separate_v", [(1, True), (4, False)])
def test_kv_pool_row_slots_follow_the_token_slots_and_keep_their_values_as_it_grows(page_size, separate_v):
    """A pool with a slot per request-table row (a STANDALONE draft's first-token keys): row r's slot lies past
    every slot the allocator hands out, and growing moves its K/V along with it."""
    pool = KVPool(2, 2, 3, capacity=4, page_size=page_size, separate_v=separate_v, row_slots=3)
    assert pool.num_slots == pool.capacity + page_size + 3
    rows = torch.tensor([2, 0, 1])
    assert pool.row_slot(rows).tolist() == [pool.capacity + page_size + r for r in (2, 0, 1)]
    tokens, k = torch.arange(1, pool.capacity + page_size), torch.randn(pool.num_slots, 2, 3)
    for layer in range(2):
        pool.write(layer, torch.arange(pool.num_slots), k + layer, k - layer)
    pool.grow(9)
    assert pool.num_slots == pool.capacity + page_size + 3 and pool.k.shape[1] == pool.num_slots
    for layer in range(2):
        for t in (pool.k, pool.v) if separate_v else (pool.k,):
            sign = 1 if t is pool.k else -1
            assert torch.equal(t[layer, pool.row_slot(rows)], k[-3:][rows] + sign * layer)
            assert torch.equal(t[layer, tokens], k[tokens] + sign * layer)
            assert not t[layer, tokens[-1] + 1:pool.row_slot(torch.tensor(0))].any()


def test_kv_pool_grown_in_inference_mode_stays_a_normal_tensor():
    pool = KVPool(1, 1, 2, capacity=4)
    with torch.inference_mode():
        pool.grow(8)
    assert not pool.k.is_inference() and not pool.v.is_inference()
    pool.k[0, 1] = 1.0  # writable outside inference mode, as before


def test_kv_pool_shape_rounds_capacity_up_to_pages():
    pool = KVPool(num_layers=3, num_kv_heads=2, head_dim=5, capacity=10, page_size=4, dtype=torch.float16)
    assert (pool.capacity, pool.num_slots) == (12, 16)
    assert pool.k.shape == pool.v.shape == (3, 16, 2, 5) and pool.k.dtype == torch.float16
    assert KVPool(1, 1, 1, capacity=7).num_slots == 8


def test_kv_pool_write_and_move_round_trip():
    torch.manual_seed(0)
    pool = KVPool(num_layers=2, num_kv_heads=2, head_dim=3, capacity=8)
    k, v = torch.randn(3, 2, 3), torch.randn(3, 2, 3)
    pool.write(1, torch.tensor([5, 2, 7]), k, v)
    assert torch.equal(pool.k[1, [5, 2, 7]], k) and torch.equal(pool.v[1, [5, 2, 7]], v)
    assert pool.k[0].abs().sum() == 0 and pool.k[1, [0, 1, 3, 4, 6, 8]].abs().sum() == 0
    k_before, v_before = pool.k.clone(), pool.v.clone()
    pool.move(dst=torch.tensor([2, 5, 1]), src=torch.tensor([5, 2, 7]))  # swap 2 <-> 5 and copy 7 -> 1, every layer
    for cache, before in ((pool.k, k_before), (pool.v, v_before)):
        expected = before.clone()
        expected[:, [2, 5, 1]] = before[:, [5, 2, 7]]
        assert torch.equal(cache, expected)
        assert torch.equal(cache[1, 1], before[1, 7]) and torch.equal(cache[1, 2], before[1, 5])


def test_kv_pool_write_casts_to_pool_dtype():
    pool = KVPool(1, 1, 2, capacity=4, dtype=torch.bfloat16)
    pool.write(0, torch.tensor([3]), torch.tensor([[[1.5, -2.0]]]), torch.tensor([[[0.25, 4.0]]]))
    assert pool.k[0, 3].tolist() == [[1.5, -2.0]] and pool.v[0, 3].tolist() == [[0.25, 4.0]]


def test_bytes_per_token():
    assert KVPool.bytes_per_token(2, 4, 8, torch.float16) == 2 * 2 * 4 * 8 * 2  # K and V
    assert KVPool.bytes_per_token(32, 8, 128, torch.float32) == 262144


def test_capacity_for_max_tokens():
    assert KVPool.capacity_for(256, max_tokens=100) == 100
    assert KVPool.capacity_for(256, max_tokens=100, page_size=16) == 96
    for past_memory in (10**12, 2**63 - 1):  # one line, not an allocation error (or on CPU, a kill while zeroing)
        with pytest.raises(FastspecError, match=r"needs .* GiB, more than the .* GiB available: lower "
                                                r"max_total_tokens$"):
            KVPool.capacity_for(256, max_tokens=past_memory)
    with pytest.raises(FastspecError, match="fewer than one page"):
        KVPool.capacity_for(256, max_tokens=15, page_size=16)


def test_capacity_for_mem_fraction(monkeypatch):
    monkeypatch.setattr(kv_pool_module, "available_bytes", lambda device="cpu": 1_000_000)
    # 500_000 // 256 = 1953 tokens, minus the 16-token dummy page = 1937, whole pages -> 1936
    assert KVPool.capacity_for(256, mem_fraction=0.5, page_size=16) == 1936
    assert KVPool.capacity_for(1000, mem_fraction=1.0) == 999
    with pytest.raises(FastspecError, match="fewer than one page"):
        KVPool.capacity_for(100_000, mem_fraction=1.0, page_size=8)
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(FastspecError, match="fraction"):
            KVPool.capacity_for(256, mem_fraction=bad)
    with pytest.raises(FastspecError, match="exactly one"):
        KVPool.capacity_for(256)
    with pytest.raises(FastspecError, match="exactly one"):
        KVPool.capacity_for(256, max_tokens=10, mem_fraction=0.5)


def test_capacity_for_real_cpu_memory():
    bpt = KVPool.bytes_per_token(2, 2, 64, torch.float32)
    capacity = KVPool.capacity_for(bpt, mem_fraction=0.01, page_size=16)
    assert capacity >= 16 and capacity % 16 == 0
    assert (capacity + 16) * bpt <= 0.01 * kv_pool_module.available_bytes("cpu") * 1.5  # memory drifts a bit


def test_available_bytes_reads_meminfo_then_falls_back(monkeypatch, tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       25000000 kB\nMemFree:   100 kB\nMemAvailable:   12345 kB\n")
    monkeypatch.setattr(kv_pool_module, "MEMINFO_PATH", str(meminfo))
    assert kv_pool_module.available_bytes("cpu") == 12345 * 1024
    monkeypatch.setattr(kv_pool_module, "MEMINFO_PATH", str(tmp_path / "missing"))
    sysconf = {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(kv_pool_module.os, "sysconf", sysconf.__getitem__)
    assert kv_pool_module.available_bytes(torch.device("cpu")) == 4096000


@pytest.mark.parametrize("version", ["v2", "v1", "v1 at the mount's root"])
def test_available_bytes_is_at_most_what_the_memory_cgroup_allows(monkeypatch, tmp_path, version):
    """A container's memory limit (docker --memory) below the host's MemAvailable: the room is the limit less the
    usage, file pages counted free, active ones too (the kernel reclaims them before it kills, and MemAvailable
    counts them: a checkpoint read by two earlier runs sits there as active pages charged to the container, and the
    third run of a model over half the limit was refused by the weights' check); no limit ('max', or v1's huge
    number) leaves MemAvailable."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:   20000000 kB\n")
    root, proc = tmp_path / "cgroup", tmp_path / "proc-cgroup"
    if version == "v2":
        proc.write_text("0::/box\n")
        where, files = root / "box", {"memory.max": "4000000000\n", "memory.current": "1500000000\n",
                                      "memory.stat": "anon 1000\nactive_file 250000000\ninactive_file 500000000\n"}
        unlimited = {"memory.max": "max\n"}
    else:
        proc.write_text("12:pids:/x\n4:memory:/docker/abc\n0::/\n")
        where = root / "memory" / ("docker/abc" if version == "v1" else "")
        files = {"memory.limit_in_bytes": "4000000000\n", "memory.usage_in_bytes": "1500000000\n",
                 "memory.stat": "cache 9\nactive_file 7\ntotal_active_file 250000000\ntotal_inactive_file 500000000\n"}
        unlimited = {"memory.limit_in_bytes": "9223372036854771712\n"}
    where.mkdir(parents=True)
    for name, text in files.items():
        (where / name).write_text(text)
    monkeypatch.setattr(kv_pool_module, "MEMINFO_PATH", str(meminfo))
    monkeypatch.setattr(kv_pool_module, "PROC_CGROUP_PATH", str(proc))
    monkeypatch.setattr(kv_pool_module, "CGROUP_ROOT", str(root))
    assert kv_pool_module.available_bytes("cpu") == 4000000000 - 1500000000 + 500000000 + 250000000
    for name, text in unlimited.items():
        (where / name).write_text(text)
    assert kv_pool_module.available_bytes("cpu") == 20000000 * 1024
    monkeypatch.setattr(kv_pool_module, "PROC_CGROUP_PATH", str(tmp_path / "missing"))
    assert kv_pool_module.available_bytes("cpu") == 20000000 * 1024

