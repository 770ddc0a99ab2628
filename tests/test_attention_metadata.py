"""fastspec.attention's metadata builders worked by hand (extend, decode, draft decode, draft extend, verify with a
tree mask; table row r holds slots 10*(r+1) + j) and their refusals."""

from __future__ import annotations


import pytest
import torch

from attention_oracle import patterned_table, run_backend

from fastspec.attention import (AttnMode, decode_metadata, draft_decode_metadata, draft_extend_metadata,
                                extend_metadata, verify_metadata)


def as_list(t: torch.Tensor) -> list[int]:
    return t.tolist()


def test_extend_metadata_by_hand():
    meta = extend_metadata(patterned_table(), torch.tensor([1, 0]), torch.tensor([2, 0]), torch.tensor([1, 3]))
    assert meta.mode is AttnMode.EXTEND and meta.causal and meta.custom_mask is None
    assert as_list(meta.qo_indptr) == [0, 1, 4]
    assert as_list(meta.kv_indptr) == [0, 3, 6]
    assert as_list(meta.kv_indices) == [20, 21, 22, 10, 11, 12]
    assert as_list(meta.out_cache_loc) == [22, 10, 11, 12]
    assert meta.qo_indptr.dtype == meta.kv_indptr.dtype == meta.kv_indices.dtype == torch.int32
    assert meta.out_cache_loc.dtype == torch.int64
    assert (meta.batch_size, meta.num_tokens) == (2, 4)
    assert as_list(meta.qo_lens) == [1, 3] and as_list(meta.kv_lens) == [3, 3]


def test_decode_metadata_by_hand():
    meta = decode_metadata(patterned_table(), torch.tensor([0, 2]), torch.tensor([3, 1]))
    assert as_list(meta.qo_indptr) == [0, 1, 2]
    assert as_list(meta.kv_indptr) == [0, 3, 4]
    assert as_list(meta.kv_indices) == [10, 11, 12, 30]
    assert as_list(meta.out_cache_loc) == [12, 30]
    assert meta.qo_indptr.dtype == meta.kv_indptr.dtype == meta.kv_indices.dtype == torch.int32
    assert meta.out_cache_loc.dtype == torch.int64
    with pytest.raises(ValueError, match="table columns"):
        decode_metadata(patterned_table(), torch.tensor([0]), torch.tensor([patterned_table().shape[1] + 1]))


@pytest.mark.parametrize("step, kv_indices, out", [
    # request 0 = table row 1 (seq_len 2), request 1 = table row 0 (seq_len 1); scratch [k0: s0 s1 s2][k1: ...]
    (0, [20, 21, 22, 20, 21, 25, 10, 11, 10, 14], [22, 25, 11, 14]),
    (1, [20, 21, 22, 23, 20, 21, 25, 26, 10, 11, 12, 10, 14, 15], [23, 26, 12, 15]),
    (2, [20, 21, 22, 23, 24, 20, 21, 25, 26, 27, 10, 11, 12, 13, 10, 14, 15, 16], [24, 27, 13, 16]),
])
def test_draft_decode_metadata_by_hand(step, kv_indices, out):
    meta = draft_decode_metadata(patterned_table(), torch.tensor([1, 0]), torch.tensor([2, 1]),
                                 topk=2, num_steps=3, step=step)
    kv_len = [2 + step + 1] * 2 + [1 + step + 1] * 2
    assert as_list(meta.qo_indptr) == [0, 1, 2, 3, 4]
    assert as_list(meta.kv_indptr) == [sum(kv_len[:i]) for i in range(5)]
    assert as_list(meta.kv_indices) == kv_indices
    assert as_list(meta.out_cache_loc) == out


def test_draft_extend_metadata_by_hand():
    meta = draft_extend_metadata(patterned_table(), torch.tensor([0, 1]), torch.tensor([5, 3]),
                                 torch.tensor([2, 1]))
    assert as_list(meta.qo_indptr) == [0, 2, 3]
    assert as_list(meta.kv_indptr) == [0, 5, 8]
    assert as_list(meta.kv_indices) == [10, 11, 12, 13, 14, 20, 21, 22]
    assert as_list(meta.out_cache_loc) == [13, 14, 22]
    assert meta.causal and meta.custom_mask is None


# the hand-written 4-node tree: root 0 -> {1, 2}, 1 -> {3}; seq_len 2, FULL_MASK rows (2 prefix + 4 tree columns)
HAND_TREE_MASK = [
    [1, 1, 1, 0, 0, 0],
    [1, 1, 1, 1, 0, 0],
    [1, 1, 1, 0, 1, 0],
    [1, 1, 1, 1, 0, 1],
]


def test_verify_metadata_by_hand():
    mask = torch.tensor(HAND_TREE_MASK, dtype=torch.bool).flatten()
    meta = verify_metadata(patterned_table(), torch.tensor([2]), torch.tensor([2]), 4, mask)
    assert as_list(meta.qo_indptr) == [0, 4]
    assert as_list(meta.kv_indptr) == [0, 6]
    assert as_list(meta.kv_indices) == [30, 31, 32, 33, 34, 35]
    assert as_list(meta.out_cache_loc) == [32, 33, 34, 35]
    assert meta.custom_mask is mask


def test_verify_with_hand_tree_averages_visible_values():
    # q = 0 -> uniform attention over the visible keys; V of table column c is the one-hot e_c, so the
    # output of node t is the indicator of its mask row divided by the row's count.
    table = patterned_table()
    mask = torch.tensor(HAND_TREE_MASK, dtype=torch.bool)
    k_cache = torch.randn(64, 1, 6)
    v_cache = torch.zeros(64, 1, 6)
    v_cache[table[2, :6].long(), 0, torch.arange(6)] = 1.0
    meta = verify_metadata(table, torch.tensor([2]), torch.tensor([2]), 4, mask.flatten())
    out = run_backend(meta, torch.zeros(4, 2, 6), k_cache, v_cache, scale=0.5)
    expected = mask.float() / mask.float().sum(1, keepdim=True)
    torch.testing.assert_close(out[:, 0], expected)
    torch.testing.assert_close(out[:, 1], expected)


def test_verify_rejects_wrong_mask_length():
    with pytest.raises(ValueError, match="tree_mask"):
        verify_metadata(patterned_table(), torch.tensor([0]), torch.tensor([2]), 4,
                        torch.ones(23, dtype=torch.bool))


def test_builders_reject_table_overflow():
    with pytest.raises(ValueError, match="table columns"):
        decode_metadata(patterned_table(width=4), torch.tensor([0]), torch.tensor([5]))
    with pytest.raises(ValueError, match="table columns"):
        draft_decode_metadata(patterned_table(width=8), torch.tensor([0]), torch.tensor([3]), 2, 3, 0)

