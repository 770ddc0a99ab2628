"""Tests for fastspec.memory's allocators (growth included) against a plain-Python free-set model, and alloc_extend
by hand and by page-layout invariants. The KV pool: test_kv_pool; the request->slot table: test_req_table."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastspec.memory import PagedAllocator, TokenAllocator, make_allocator


def _t(values):
    return torch.tensor(values, dtype=torch.int64)


def _held_tensor(held):
    return _t([s for chunk in held for s in chunk])


# ----------------------------------------------------------------------------------------------- allocators

@pytest.mark.parametrize("page_size", [1, 4, 16])
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_allocator_matches_free_set_model(page_size, data):
    P = page_size
    num_pages = data.draw(st.integers(1, 10))
    allocator = make_allocator(num_pages * P, P)
    assert isinstance(allocator, TokenAllocator if P == 1 else PagedAllocator)
    free_model = set(range(P, (num_pages + 1) * P))  # every slot except the reserved page 0
    held, backups = [], []  # held: list of allocations (lists of slots); backups: (state, free, held)
    for _ in range(data.draw(st.integers(1, 30))):
        op = data.draw(st.sampled_from(["alloc", "alloc", "free", "backup", "restore", "grow"]))
        if op == "alloc":
            n = data.draw(st.integers(0, num_pages + 1)) * P
            got = allocator.alloc(n)
            if n > len(free_model):
                assert got is None
            else:
                got = got.tolist()
                assert len(got) == n and len(set(got)) == n
                assert set(got) <= free_model  # never slot 0 / page 0, never a slot already handed out
                free_model -= set(got)
                held += [got] if got else []
        elif op == "free" and held:
            chunk = held.pop(data.draw(st.integers(0, len(held) - 1)))
            mask = data.draw(st.lists(st.booleans(), min_size=len(chunk), max_size=len(chunk)))
            picked = [s for s, m in zip(chunk, mask) if m]
            pages = {s // P for s in picked}  # freeing any slot of a page frees the whole page
            freed = [s for s in chunk if s // P in pages]
            allocator.free(_t(picked))
            free_model |= set(freed)
            kept = [s for s in chunk if s // P not in pages]
            held += [kept] if kept else []
        elif op == "backup":
            backups.append((allocator.backup_state(), set(free_model), list(held)))
        elif op == "restore" and backups:
            state, free_snapshot, held_snapshot = backups[data.draw(st.integers(0, len(backups) - 1))]
            allocator.restore_state(state)
            free_model, held = set(free_snapshot), list(held_snapshot)
        elif op == "grow":  # the new pages join the free set; a backup from before can no longer be restored
            more = data.draw(st.integers(0, 4))
            allocator.grow((num_pages + more) * P)
            free_model |= set(range((num_pages + 1) * P, (num_pages + more + 1) * P))
            num_pages += more
            if more and backups:
                with pytest.raises(RuntimeError, match="backed up at capacity"):
                    allocator.restore_state(backups[0][0])
            backups = [] if more else backups
        assert allocator.num_free() == len(free_model)
        allocator.check(_held_tensor(held))  # free + held == all slots, disjoint, no duplicates


@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_none_leaves_state_unchanged(page_size):
    allocator = make_allocator(3 * page_size, page_size)
    first = allocator.alloc(page_size)
    assert allocator.alloc(3 * page_size) is None
    assert allocator.num_free() == 2 * page_size
    allocator.check(first)
    assert allocator.alloc(2 * page_size).tolist() == list(range(2 * page_size, 4 * page_size))


def test_alloc_is_a_copy_that_callers_may_mutate():
    allocator = TokenAllocator(8)
    state = allocator.backup_state()
    allocator.alloc(3).add_(100)
    allocator.restore_state(state)
    assert allocator.alloc(3).tolist() == [1, 2, 3]


def test_check_names_the_problem():
    allocator = TokenAllocator(20)
    held = allocator.alloc(20)
    allocator.free(held[16:17])  # slot 17
    with pytest.raises(AssertionError, match="slot 17 is both free and held"):
        allocator.check(held)
    with pytest.raises(AssertionError, match="slot 3 is neither free nor held"):
        allocator.check(torch.cat([held[:2], held[3:16], held[17:]]))
    with pytest.raises(AssertionError, match="slot 5 is held twice"):
        allocator.check(torch.cat([held[:16], held[17:], _t([5])]))
    allocator.free(_t([17]))
    with pytest.raises(AssertionError, match="slot 17 is free twice"):
        allocator.check(torch.cat([held[:16], held[17:]]))
    with pytest.raises(AssertionError, match="slot 0 is held"):
        TokenAllocator(2).check(_t([0]))
    paged = PagedAllocator(8, 4)
    slots = paged.alloc(8)
    with pytest.raises(AssertionError, match="page 2 is neither free nor held"):
        paged.check(slots[:4])
    paged.free(slots[1:2])
    with pytest.raises(AssertionError, match="page 1 is both free and held"):
        paged.check(slots)


# ----------------------------------------------------------------------------------------------- alloc_extend

def test_alloc_extend_by_hand():
    allocator = PagedAllocator(8 * 4, 4)  # free pages 1..8, handed out in that order
    # one request 0 -> 6: fresh pages 1, 2 -> slots 4..9
    assert allocator.alloc_extend(_t([0]), _t([6]), _t([-1])).tolist() == [4, 5, 6, 7, 8, 9]
    # extend 6 -> 11, last_loc = slot of position 5 = 9: positions 6, 7 -> 10, 11; 8..10 -> fresh page 3
    assert allocator.alloc_extend(_t([6]), _t([11]), _t([9])).tolist() == [10, 11, 12, 13, 14]
    assert allocator.num_free() == 5 * 4


def test_alloc_extend_several_requests_by_hand():
    allocator = PagedAllocator(8 * 4, 4)
    # A: 0 -> 5 (pages 1, 2), B: 0 -> 3 (page 3)
    got = allocator.alloc_extend(_t([0, 0]), _t([5, 3]), _t([-1, -1]))
    assert got.tolist() == [4, 5, 6, 7, 8, 12, 13, 14]
    c_page = allocator.alloc(4)  # C owns page 4 = slots 16..19 for positions 0..3
    assert c_page.tolist() == [16, 17, 18, 19]
    # A 5 -> 9 (last_loc 8): 5, 6, 7 -> 9, 10, 11; 8 -> fresh page 5
    # B 3 -> 4 (last_loc 14): 3 -> 15, no fresh page;  D 2 -> 2 (last_loc 13 is unused): nothing
    # C 4 -> 6, prefix a multiple of P (last_loc -1): 4, 5 -> fresh page 6
    got = allocator.alloc_extend(_t([5, 3, 2, 4]), _t([9, 4, 2, 6]), _t([8, 14, 13, -1]))
    assert got.tolist() == [9, 10, 11, 20, 15, 24, 25]
    assert allocator.num_free() == 2 * 4


def test_alloc_extend_not_enough_pages_leaves_state_unchanged():
    allocator = PagedAllocator(2 * 4, 4)
    allocator.alloc_extend(_t([0]), _t([3]), _t([-1]))  # page 1
    assert allocator.alloc_extend(_t([3, 0]), _t([4, 8]), _t([6, -1])) is None  # needs 2 pages, 1 free
    assert allocator.num_free() == 4
    assert allocator.alloc(4).tolist() == [8, 9, 10, 11]


def test_alloc_extend_rejects_bad_last_loc():
    allocator = PagedAllocator(4 * 4, 4)
    with pytest.raises(ValueError):
        allocator.alloc_extend(_t([6]), _t([8]), _t([-1]))  # position 6 continues a partial page
    with pytest.raises(ValueError):
        allocator.alloc_extend(_t([6]), _t([5]), _t([9]))  # shrinking


@pytest.mark.parametrize("page_size", [1, 4, 16])
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_alloc_extend_keeps_page_layout(page_size, data):
    P = page_size
    allocator = PagedAllocator(data.draw(st.integers(1, 12)) * P, P)
    reqs = [[] for _ in range(data.draw(st.integers(1, 4)))]  # reqs[i][j] = slot of position j
    for _ in range(data.draw(st.integers(1, 8))):
        if data.draw(st.booleans()) and any(reqs):
            i = data.draw(st.sampled_from([i for i, r in enumerate(reqs) if r]))
            allocator.free(_t(reqs[i]))
            reqs[i] = []
        order = data.draw(st.permutations(range(len(reqs))))
        batch = order[:data.draw(st.integers(1, len(reqs)))]
        ext = [data.draw(st.integers(0, 2 * P + 1)) for _ in batch]
        prefix = [len(reqs[i]) for i in batch]
        last_loc = [reqs[i][-1] if len(reqs[i]) % P else -1 for i in batch]
        need = sum(-(-(p + e) // P) - -(-p // P) for p, e in zip(prefix, ext)) * P
        free_before = allocator.num_free()
        got = allocator.alloc_extend(_t(prefix), _t([p + e for p, e in zip(prefix, ext)]), _t(last_loc))
        if need > free_before:
            assert got is None and allocator.num_free() == free_before
            continue
        got = got.tolist()
        assert len(got) == sum(ext) and allocator.num_free() == free_before - need
        for i, e in zip(batch, ext):
            reqs[i] += got[:e]
            got = got[e:]
        pages = [{s // P for s in r} for r in reqs]
        assert sum(map(len, pages)) == len(set().union(*pages))  # no page shared between requests
        for r in reqs:
            assert all(s >= P and s % P == j % P and s // P == r[j - j % P] // P for j, s in enumerate(r))
        allocator.check(_held_tensor(reqs))


def test_token_allocator_alloc_extend_takes_total_length():
    allocator = TokenAllocator(10)
    assert allocator.alloc_extend(_t([2, 0]), _t([5, 1]), _t([7, -1])).tolist() == [1, 2, 3, 4]
    assert allocator.alloc_extend(_t([0]), _t([7]), _t([-1])) is None
