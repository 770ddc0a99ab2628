"""The request -> slot table: rows handed out and back, writes by hand and against a loop."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastspec.memory import ReqToTokenTable


def _t(values):
    return torch.tensor(values, dtype=torch.int64)


def test_req_table_alloc_free():
    table = ReqToTokenTable(max_requests=3, max_context_len=4)
    assert table.table.dtype == torch.int32 and table.table.shape == (4, 4) and table.table.abs().sum() == 0
    assert table.pad_row == 3  # the row past the handed-out ones: graphs' padded batch rows write there
    rows = [table.alloc() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2] and table.alloc() is None and table.num_free() == 0
    table.free(rows[1])
    assert table.num_free() == 1 and table.alloc() == rows[1]
    table.free(rows[0])
    with pytest.raises(ValueError, match="not allocated"):
        table.free(rows[0])
    with pytest.raises(ValueError, match="not allocated"):
        table.free(3)


def test_req_table_write_by_hand_and_slots_copy():
    table = ReqToTokenTable(max_requests=4, max_context_len=8)
    table.write(_t([3, 0]), _t([5, 2]), _t([2, 1]), torch.tensor([40, 41, 7], dtype=torch.int32))
    assert table.table[3].tolist() == [0, 0, 0, 0, 0, 40, 41, 0]
    assert table.table[0].tolist() == [0, 0, 7, 0, 0, 0, 0, 0]
    got = table.slots(3, 4, 7)
    assert got.dtype == torch.int64 and got.tolist() == [0, 40, 41]
    got[1] = 99
    assert table.table[3, 5] == 40


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_req_table_write_matches_loop(data):
    max_requests, ctx = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 12))
    rows = data.draw(st.permutations(range(max_requests)))[:data.draw(st.integers(0, max_requests))]
    starts = [data.draw(st.integers(0, ctx)) for _ in rows]
    lens = [data.draw(st.integers(0, ctx - s)) for s in starts]
    slots = data.draw(st.lists(st.integers(0, 10_000), min_size=sum(lens), max_size=sum(lens)))
    table = ReqToTokenTable(max_requests, ctx)
    table.table.random_(0, 50)  # stale entries must survive outside the written ranges
    expected = table.table.clone()
    it = iter(slots)
    for r, s, n in zip(rows, starts, lens):
        for j in range(s, s + n):
            expected[r, j] = next(it)
    table.write(_t(rows), _t(starts), _t(lens), _t(slots))
    assert torch.equal(table.table, expected)


def test_write_next_is_write_with_one_position_each():
    g = torch.Generator().manual_seed(4)
    a, b = ReqToTokenTable(5, 9), ReqToTokenTable(5, 9)
    a.table.random_(0, 50, generator=g)
    b.table.copy_(a.table)
    rows, cols, slots = _t([4, 0, 2]), _t([8, 0, 3]), torch.tensor([7, 900, 31], dtype=torch.int32)
    a.write(rows, cols, _t([1, 1, 1]), slots)
    b.write_next(rows, cols, slots)
    assert torch.equal(a.table, b.table) and b.table[4, 8] == 7 and b.table[0, 0] == 900
