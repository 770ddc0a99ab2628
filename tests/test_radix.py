"""The radix prefix cache's tree: hand-worked examples, and random operations against a dictionary of every cached
prefix (the oracle: prefix -> the slot of its last token, set by the first insert that cached it)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastspec.memory.radix import RadixTree


def slots(*ids):
    return torch.tensor(ids, dtype=torch.int64)


def test_match_splits_and_insert_reports_what_was_cached():
    tree = RadixTree()
    assert tree.insert([1, 2, 3, 4], slots(10, 11, 12, 13)) == 0
    assert tree.insert([1, 2, 5], slots(20, 21, 22)) == 2  # 20, 21 are duplicates of 10, 11: the caller frees them
    assert tree.match([1, 2, 3, 9]).slots.tolist() == [10, 11, 12]
    assert tree.match([1, 2, 5, 6]).slots.tolist() == [10, 11, 22]
    assert tree.match([7, 1]).slots.tolist() == []
    assert tree.cached_tokens == 5  # 10, 11 shared; 12, 13 and 22 below them


def test_pages_cache_and_match_whole_pages_only():
    tree = RadixTree(page_size=4)
    assert tree.insert(list(range(10)), torch.arange(100, 110)) == 0
    assert tree.cached_tokens == 8  # the last two tokens fill no page
    assert tree.match(list(range(7))).slots.tolist() == [100, 101, 102, 103]
    assert tree.match([0, 1, 2, 3, 4, 5, 9, 9]).slots.tolist() == [100, 101, 102, 103]  # diverges inside page 2
    assert tree.insert([0, 1, 2, 3, 4, 5, 9, 9], torch.arange(200, 208)) == 4
    assert tree.match([0, 1, 2, 3, 4, 5, 9, 9]).slots.tolist() == [100, 101, 102, 103, 204, 205, 206, 207]


def test_eviction_is_least_recently_used_and_spares_locked_paths():
    tree = RadixTree()
    tree.insert([1, 2, 3], slots(1, 2, 3))
    tree.insert([4, 5], slots(4, 5))
    tree.insert([6], slots(6))
    tree.match([1, 2, 3])  # touched: now the most recently used
    assert sorted(tree.evict(2).tolist()) == [4, 5]  # the oldest leaf first, a whole node
    held = tree.match([6]).node
    tree.lock(held)
    assert tree.evictable_tokens == 3
    assert sorted(tree.evict(100).tolist()) == [1, 2, 3]  # everything unlocked, parents after their children
    assert tree.match([6]).slots.tolist() == [6]
    tree.unlock(held)
    assert tree.evict(1).tolist() == [6] and tree.cached_tokens == 0


def test_a_split_node_keeps_its_locks():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], slots(1, 2, 3, 4))
    whole = tree.match([1, 2, 3, 4]).node
    tree.lock(whole)
    tree.insert([1, 2, 7], slots(9, 9, 7))  # splits the locked edge after [1, 2]
    assert tree.locked_tokens == 4 and tree.evictable_tokens == 1
    assert tree.evict(10).tolist() == [7]  # [1, 2] is above a locked node: kept
    tree.unlock(whole)
    assert sorted(tree.evict(10).tolist()) == [1, 2, 3, 4]


def test_reclaim_state_takes_the_least_recently_used_and_frees_the_kv_no_state_covers():
    """States go back least recently used first, unlocked before locked, the deeper first on a tie (evict's order);
    a node left with no state at or below it frees its KV (a hybrid target resumes only on a state), unless locked
    or above a state. Found: the tree let states go only with their KV, so once it held every checkpoint no new
    request saved one."""
    dropped = []
    tree = RadixTree(drop_state=dropped.append)
    tree.insert([1, 2, 3, 4], slots(1, 2, 3, 4))
    tree.insert([1, 2, 5, 6], slots(1, 2, 7, 8))
    tree.insert([9, 9], slots(9, 10))
    for prefix, ckpt in (([1, 2], 0), ([1, 2, 3, 4], 1), ([1, 2, 5, 6], 2), ([9, 9], 3)):
        assert tree.set_state(prefix, ckpt)
    tree.match([9, 9])  # [9, 9] is now the most recently used, [1, 2, 3, 4] the least (set first)
    assert tree.reclaim_state().tolist() == [3, 4]  # state 1's node: its KV is past every state left
    assert dropped == [1] and tree.match_state([1, 2, 3, 4])[1] == 0
    held = tree.match([1, 2, 5, 6]).node
    tree.lock(held)  # a running request on [1, 2, 5, 6]: the unlocked [9, 9] goes first, then the locked path's
    assert tree.reclaim_state().tolist() == [9, 10] and dropped == [1, 3]
    assert tree.reclaim_state().tolist() == [] and dropped == [1, 3, 2]  # the deeper first; its KV is locked
    assert tree.reclaim_state().tolist() == [] and dropped == [1, 3, 2, 0]
    assert tree.reclaim_state() is None and tree.all_states() == []
    assert tree.cached_tokens == len(tree.all_slots()) == 4 and tree.locked_tokens == 4
    tree.unlock(held)
    assert sorted(tree.evict(10).tolist()) == [1, 2, 7, 8]


tokens = st.lists(st.integers(0, 3), min_size=0, max_size=12)
operations = st.lists(st.one_of(st.tuples(st.just("insert"), tokens), st.tuples(st.just("match"), tokens),
                                st.tuples(st.just("lock"), tokens), st.tuples(st.just("unlock"), st.integers(0, 3)),
                                st.tuples(st.just("evict"), st.integers(0, 10))), max_size=30)


@settings(max_examples=200, deadline=None)
@given(ops=operations, page_size=st.sampled_from([1, 2, 4]))
def test_random_operations_agree_with_a_dictionary_of_prefixes(ops, page_size):
    """The oracle caches whole pages: token i of `seq` is cached under (seq up to the end of i's page, i)."""
    tree, cached, next_slot, live, locks = RadixTree(page_size), {}, 1, set(), []
    key = lambda seq, i: (tuple(seq[: (i // page_size + 1) * page_size]), i)  # noqa: E731

    def cached_prefix(seq) -> int:
        n = 0
        while n + page_size <= len(seq) and key(seq, n) in cached:
            n += page_size
        return n

    for op, arg in ops:
        if op == "insert":
            new = torch.arange(next_slot, next_slot + len(arg))
            next_slot += len(arg)
            already = cached_prefix(arg)
            assert tree.insert(arg, new) == already
            for i in range(already, len(arg) - len(arg) % page_size):
                cached[key(arg, i)] = int(new[i])
                live.add(int(new[i]))
        elif op == "match":
            assert tree.match(arg).slots.tolist() == [cached[key(arg, i)] for i in range(cached_prefix(arg))]
        elif op == "lock":  # a request reusing the cached part of `arg`
            match = tree.match(arg)
            tree.lock(match.node)
            locks.append((match.node, set(match.slots.tolist())))
        elif op == "unlock":
            if locks:
                tree.unlock(locks.pop(arg % len(locks))[0])
        else:
            freed = tree.evict(arg).tolist()
            protected = set().union(*(held for _, held in locks))
            assert not protected & set(freed)
            assert len(freed) == len(set(freed)) and set(freed) <= live
            assert len(freed) >= min(arg, len(live) - len(protected))
            live -= set(freed)
            assert tree.locked_tokens == len(protected) and tree.evictable_tokens == len(live) - len(protected)
            cached = {k: v for k, v in cached.items() if v not in set(freed)}
        assert tree.cached_tokens == len(live) == len(cached)
    for node, _ in locks:
        tree.unlock(node)
    assert sorted(tree.evict(1 << 30).tolist()) == sorted(live) and tree.locked_tokens == 0
