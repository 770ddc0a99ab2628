"""Batch buckets: the default series, a --cuda-graph-bs list parsed, and the bucket a batch size runs in.
(test_graphs.py: a GraphRunner's own bucket_for, padding to the next bucket.)"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastspec.errors import FastspecError
from fastspec.graphs import bucket_for, default_buckets, parse_buckets


def test_default_buckets_hand_written():
    assert default_buckets(8) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert default_buckets(5) == [1, 2, 3, 4, 5]
    assert default_buckets(48) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32,
                                   40, 44, 48]
    big = default_buckets(300)
    assert big[:20] == default_buckets(32) and big[20:23] == [40, 44, 48]
    assert big[23:27] == [52, 56, 60, 64] and big[27:29] == [72, 80] and big[-6:] == [240, 248, 256, 272, 288, 300]
    assert len(big) == 8 + 12 + 7 + 24 + 3
    assert default_buckets(50)[-3:] == [44, 48, 50]  # max_bs appended when not in the series
    with pytest.raises(FastspecError):
        default_buckets(0)


def test_parse_buckets():
    assert parse_buckets("1,2,4,8") == [1, 2, 4, 8]
    assert parse_buckets(" 8, 1 ,4,4") == [1, 4, 8]
    for bad in ["", "1,,2", "1,x", "-1,2", "0,2", "1.5", "2;4"]:
        with pytest.raises(FastspecError, match="batch size"):
            parse_buckets(bad)


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(1, 300), min_size=1, max_size=20), st.integers(1, 320))
def test_bucket_for_is_smallest_bucket_at_least_bs(bucket_set, bs):
    buckets = sorted(bucket_set)
    fits = [b for b in buckets if b >= bs]
    if fits:
        assert bucket_for(buckets, bs) == min(fits)
    else:
        with pytest.raises(FastspecError, match=f"batch size {bs} exceeds"):
            bucket_for(buckets, bs)
