"""FlashInfer's plan arguments (fastspec.attention.flashinfer_plan), hand-worked on CPU: prefill / decode plan
arguments per attention mode, wrapper keys and the tensor-core rule, scale keywords, padding a graph bucket.
The whole backend against the torch one: test_gpu_backends."""

import pytest
import torch

from fastspec.attention import (
    decode_metadata,
    draft_decode_metadata,
    draft_extend_metadata,
    extend_metadata,
    verify_metadata,
)
from fastspec.attention.flashinfer_plan import (
    AttnShape,
    GraphBucket,
    decode_plan_args,
    decode_use_tensor_cores,
    pad_to_bucket,
    prefill_plan_args,
    scale_kwargs,
    wrapper_key,
)
from fastspec.attention.metadata import AttnMetadata, AttnMode

SHAPE = AttnShape(8, 2, 16, torch.bfloat16, torch.bfloat16, 0.25)
I32 = torch.int32


def t32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=I32)


def patterned_table(num_rows: int = 3, width: int = 12) -> torch.Tensor:
    """Row r holds slots 10*(r+1) + j."""
    return torch.tensor([[10 * (r + 1) + j for j in range(width)] for r in range(num_rows)], dtype=I32)


def test_prefill_args_extend_and_draft_extend():
    table = patterned_table()
    meta = extend_metadata(table, torch.tensor([0, 1]), torch.tensor([2, 0]), torch.tensor([3, 2]))
    args = prefill_plan_args(meta, SHAPE)
    assert torch.equal(args["qo_indptr"], t32([0, 3, 5]))
    assert torch.equal(args["paged_kv_indptr"], t32([0, 5, 7]))
    assert torch.equal(args["paged_kv_indices"], t32([10, 11, 12, 13, 14, 20, 21]))
    assert torch.equal(args["paged_kv_last_page_len"], t32([1, 1]))
    for name in ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"):
        assert args[name].dtype == I32
    assert (args["page_size"], args["causal"], args["custom_mask"]) == (1, True, None)
    assert (args["num_qo_heads"], args["num_kv_heads"], args["head_dim_qk"], args["sm_scale"]) == (8, 2, 16, 0.25)
    assert args["q_data_type"] == args["kv_data_type"] == torch.bfloat16
    meta = draft_extend_metadata(table, torch.tensor([0, 1]), torch.tensor([4, 2]), torch.tensor([2, 1]))
    args = prefill_plan_args(meta, SHAPE)
    assert torch.equal(args["qo_indptr"], t32([0, 2, 3])) and torch.equal(args["paged_kv_indptr"], t32([0, 4, 6]))
    assert args["causal"] is True and args["custom_mask"] is None


def test_prefill_args_verify_pass_the_flat_tree_mask_and_no_causal():
    table = patterned_table()
    # request 0: seq 2, N 2 -> 2 x 4 block; request 1: seq 1 -> 2 x 3 block (FULL_MASK, row-major per request)
    mask = torch.tensor([1, 1, 1, 0, 1, 1, 1, 1] + [1, 1, 0, 1, 1, 1], dtype=torch.bool)
    meta = verify_metadata(table, torch.tensor([0, 1]), torch.tensor([2, 1]), 2, mask)
    args = prefill_plan_args(meta, SHAPE)
    assert torch.equal(args["qo_indptr"], t32([0, 2, 4])) and torch.equal(args["paged_kv_indptr"], t32([0, 4, 7]))
    assert torch.equal(args["paged_kv_indices"], t32([10, 11, 12, 13, 20, 21, 22]))
    assert torch.equal(args["custom_mask"], mask) and args["causal"] is False


def test_decode_args_decode_and_draft_decode():
    table = patterned_table()
    args = decode_plan_args(decode_metadata(table, torch.tensor([0, 1]), torch.tensor([3, 2])), SHAPE)
    assert torch.equal(args["indptr"], t32([0, 3, 5])) and torch.equal(args["indices"], t32([10, 11, 12, 20, 21]))
    assert torch.equal(args["last_page_len"], t32([1, 1])) and args["page_size"] == 1
    assert "causal" not in args and "custom_mask" not in args
    # seq 2, topk 2, num_steps 2, step 1: branch 0 reads columns [0, 1, 2, 3], branch 1 reads [0, 1, 4, 5]
    meta = draft_decode_metadata(table, torch.tensor([0]), torch.tensor([2]), topk=2, num_steps=2, step=1)
    args = decode_plan_args(meta, SHAPE)
    assert torch.equal(args["indptr"], t32([0, 4, 8]))
    assert torch.equal(args["indices"], t32([10, 11, 12, 13, 10, 11, 14, 15]))
    with pytest.raises(ValueError, match="one query row"):
        decode_plan_args(extend_metadata(table, torch.tensor([0]), torch.tensor([0]), torch.tensor([2])), SHAPE)


def test_wrapper_keys_and_tensor_core_rule():
    keys = {wrapper_key(AttnMode.DRAFT_DECODE, step) for step in range(4)}
    assert len(keys) == 4 and {k.step for k in keys} == {0, 1, 2, 3}
    assert wrapper_key(AttnMode.DECODE) != wrapper_key(AttnMode.DRAFT_DECODE)
    assert wrapper_key(AttnMode.TARGET_VERIFY, graph=GraphBucket(4, 16)).graph_bs == 4
    with pytest.raises(ValueError):
        wrapper_key(AttnMode.TARGET_VERIFY, 1)
    assert decode_use_tensor_cores(32, 8, torch.bfloat16) and not decode_use_tensor_cores(32, 16, torch.float16)
    assert decode_use_tensor_cores(8, 8, torch.float8_e4m3fn)


def test_scale_kwargs():
    assert scale_kwargs(0.25, 0.25) == {}
    assert scale_kwargs(0.5, 0.25) == {"q_scale": 2.0}


def test_pad_to_bucket_hand_worked():
    mask = torch.rand(24) > 0.5  # one verify request: 4 rows x 6 keys
    meta = AttnMetadata(AttnMode.TARGET_VERIFY, t32([0, 4]), t32([0, 6]), t32([7, 8, 9, 3, 4, 5]),
                        torch.tensor([3, 4, 5, 6]), mask, True)
    padded = pad_to_bucket(meta, GraphBucket(3, 12))  # dummy requests: 1 row x 1 key, 7 rows x 7 keys
    assert torch.equal(padded.qo_indptr, t32([0, 4, 5, 12])) and torch.equal(padded.kv_indptr, t32([0, 6, 7, 14]))
    assert torch.equal(padded.kv_indices, t32([7, 8, 9, 3, 4, 5] + [0] * 8))
    assert torch.equal(padded.out_cache_loc, torch.tensor([3, 4, 5, 6] + [0] * 8))
    assert torch.equal(padded.custom_mask[:24], mask) and bool(padded.custom_mask[24:].all())
    assert padded.custom_mask.numel() == 24 + 1 + 49
    decode = AttnMetadata(AttnMode.DECODE, t32([0, 1]), t32([0, 2]), t32([5, 6]), torch.tensor([6]), None, True)
    padded = pad_to_bucket(decode, GraphBucket(3, 3))
    assert torch.equal(padded.qo_indptr, t32([0, 1, 2, 3])) and torch.equal(padded.kv_indices, t32([5, 6, 0, 0]))
    with pytest.raises(ValueError):
        pad_to_bucket(meta, GraphBucket(3, 5))  # 2 dummy requests need 2 spare rows
    with pytest.raises(ValueError):
        pad_to_bucket(padded, GraphBucket(2, 2))
