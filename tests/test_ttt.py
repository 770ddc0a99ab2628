"""The draft-training objective and data as pure functions: TTT attention against a per-row oracle, the batch
layout of a hand-worked conversation, the draft vocabulary, the packing schedule, soft labels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastspec.train.data import Features, choose_draft_vocab, pack
from fastspec.train.trainer import TrainConfig, schedule
from fastspec.train.ttt import NO_LABEL, TTTAttention, make_batch, soft_cross_entropy


def test_ttt_attention_equals_a_per_row_oracle():
    """Step k at p attends step-0 keys at q <= p of its own sequence, then its own keys of steps 1..k at p."""
    torch.manual_seed(0)
    T, Hq, Hkv, D, S = 7, 4, 2, 8, 3
    doc = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    attn = TTTAttention(doc)
    qs, ks, vs = torch.randn(S, T, Hq, D), torch.randn(S, T, Hkv, D), torch.randn(S, T, Hkv, D)
    outs = [attn.attend(0, qs[k], ks[k], vs[k], 0.3) for k in range(S)]
    for k in range(S):
        for p in range(T):
            prefix = [q for q in range(T) if doc[q] == doc[p] and q <= p]
            keys = torch.cat([ks[0, prefix], ks[1:k + 1, p]])  # [n, Hkv, D]
            values = torch.cat([vs[0, prefix], vs[1:k + 1, p]])
            for h in range(Hq):
                g = h // (Hq // Hkv)
                w = torch.softmax(keys[:, g] @ qs[k, p, h] * 0.3, dim=0)
                torch.testing.assert_close(outs[k][p, h], w @ values[:, g])


def test_batch_layout_on_a_hand_worked_conversation():
    # one conversation: prompt [10, 11], response [12, 13, 14]; the target's greedy labels: 11 12 13 99 15
    features = Features(tokens=torch.tensor([10, 11, 12, 13, 14]), aux=torch.zeros(5, 6),
                        labels=torch.tensor([11, 12, 13, 99, 15]), offsets=torch.tensor([0, 5]),
                        prompt_lens=torch.tensor([2]))
    t2d = torch.full((100,), -1)
    t2d[[12, 13, 15]] = torch.tensor([0, 1, 2])  # 99 is outside the draft vocabulary
    batch = make_batch(features, [0], t2d, steps=2)
    # step 0 at p is fed token p+1 and predicts token p+2 (label at p+1): responses start at position 2
    assert batch.inputs[0].tolist() == [11, 12, 13, 14, 0]
    assert batch.labels[0].tolist() == [0, 1, 3, NO_LABEL, NO_LABEL]  # 3 = Vd: a label the head cannot hit
    assert batch.inputs[1].tolist() == [12, 13, 14, 0, 0]
    assert batch.labels[1].tolist() == [1, 3, NO_LABEL, NO_LABEL, NO_LABEL]


def test_draft_vocab_is_the_most_frequent_labels_and_packing_keeps_order():
    labels = torch.tensor([5, 5, 5, 7, 7, 2, 9, 9, 9, 9, 3, 3])
    assert choose_draft_vocab(labels, 10, 3).tolist() == [3, 5, 9]  # 9x4, 5x3, then 3 and 7 tie: lower id
    assert pack([5, 3, 4, 10, 1], 8) == [[0, 1], [2], [3], [4]]


def test_the_schedule_covers_every_conversation_once_an_epoch_however_each_shuffle_packs(tmp_path):
    lengths = [300, 200, 260, 250, 40, 500, 120, 330, 90, 410, 210, 60]  # shuffles pack into 5 to 7 batches
    offsets = torch.tensor([0] + lengths).cumsum(0)
    features = Features(torch.zeros(0), torch.zeros(0), torch.zeros(0), offsets, torch.zeros(len(lengths)))
    ids = [0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11]  # 6 held out
    cfg = TrainConfig(out=tmp_path, epochs=6, batch_tokens=512, bf16=False)
    plan = schedule(features, ids, cfg)
    assert len({sum(1 for e, _ in plan if e == epoch) for epoch in range(6)}) > 1  # the case that once crashed
    for epoch in range(6):
        batches = [group for e, group in plan if e == epoch]
        assert sorted(c for group in batches for c in group) == ids
        assert all(len(group) == 1 or sum(lengths[c] for c in group) <= 512 for group in batches)
    assert [e for e, _ in plan] == sorted(e for e, _ in plan)
    assert plan == schedule(features, ids, cfg)  # a resumed run follows the same plan


def test_soft_cross_entropy_is_hard_cross_entropy_for_a_one_hot_target_and_differs_otherwise():
    torch.manual_seed(0)
    logits, labels = torch.randn(5, 7), torch.tensor([0, 3, 6, 2, 2])
    ids = torch.stack([labels, (labels + 1) % 7, torch.full_like(labels, -1)], dim=1)  # [5, 3]; -1: outside Vd
    one_hot = torch.tensor([[1.0, 0.0, 0.0]]).expand(5, 3)
    torch.testing.assert_close(soft_cross_entropy(logits, ids, one_hot), F.cross_entropy(logits, labels))
    spread = torch.tensor([[0.7, 0.3, 0.0]]).expand(5, 3)
    by_hand = -(0.7 * logits.log_softmax(-1).gather(1, labels[:, None]) +
                0.3 * logits.log_softmax(-1).gather(1, ids[:, 1:2])).mean()
    torch.testing.assert_close(soft_cross_entropy(logits, ids, spread), by_hand)
    assert not torch.isclose(by_hand, F.cross_entropy(logits, labels))


def test_soft_labels_are_renormalised_over_the_draft_vocabulary():
    features = Features(tokens=torch.tensor([10, 11, 12, 13]), aux=torch.zeros(4, 6),
                        labels=torch.tensor([11, 12, 13, 14]), offsets=torch.tensor([0, 4]),
                        prompt_lens=torch.tensor([1]),
                        soft_ids=torch.tensor([[11, 50, 12]] * 4), soft_probs=torch.tensor([[0.5, 0.3, 0.2]] * 4,
                                                                                       dtype=torch.float16))
    t2d = torch.full((100,), -1)
    t2d[[11, 12, 13]] = torch.tensor([0, 1, 2])  # 50 is outside the draft vocabulary
    batch = make_batch(features, [0], t2d, steps=1)
    assert batch.soft_ids[0, 0].tolist() == [0, -1, 1]
    torch.testing.assert_close(batch.soft_probs[0, 0], torch.tensor([0.5 / 0.7, 0.0, 0.2 / 0.7]), atol=1e-3, rtol=0)  # fp16
