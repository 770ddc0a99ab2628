"""Falling back to plain decoding where speculation is slower: the choice follows measured rates, and switching
modes mid-generation keeps the output exact (the draft keeps extending during plain rounds)."""

import random

import pytest
from conftest import all_slots_free
from test_speculative import PROMPTS, reference, spec_llm

from fastspec.sampling import SamplingParams
from fastspec.speculative.policy import SpecPolicy


def test_policy_picks_the_faster_mode_and_probes_the_other():
    policy = SpecPolicy(probe_every=10, warmup_rounds=2)
    choices = []
    for _ in range(40):
        spec = policy.speculate(4)
        choices.append(spec)
        # speculation: 2 tokens per request in 0.3 s; plain: 1 token in 0.1 s -> plain is faster
        policy.record(4, spec, 2.0 if spec else 1.0, 0.3 if spec else 0.1)
    assert choices[:2] == [True, True] and choices[2] is False  # warm-up, then the first plain probe
    assert sum(choices[3:]) == sum(1 for n in range(4, 41) if n % 10 == 0)  # only the periodic probes speculate
    spec_rate, plain_rate = policy.rates(4)
    assert plain_rate == pytest.approx(10.0) and spec_rate == pytest.approx(2 / 0.3)
    assert policy.speculate(1)  # other batch sizes are measured separately


def test_policy_keeps_speculating_when_it_pays():
    policy = SpecPolicy(probe_every=8)
    choices = []
    for _ in range(30):
        spec = policy.speculate(1)
        choices.append(spec)
        policy.record(1, spec, 3.0 if spec else 1.0, 0.1)
    assert sum(not c for c in choices) <= 1 + 30 // 8


class Alternating:
    def __init__(self, seed):
        self.rng = random.Random(seed)

    def speculate(self, bs):
        return self.rng.random() < 0.5

    def record(self, *args):
        pass


@pytest.mark.parametrize("algorithm, draft, steps, topk, n", [("EAGLE3", "eagle3", 3, 2, 5),
                                                              ("STANDALONE", "self", 4, 1, 5),
                                                              ("NGRAM", None, None, None, 6)])
def test_switching_modes_mid_generation_is_lossless(tiny_dirs, draft_dirs, algorithm, draft, steps, topk, n):
    params = SamplingParams(max_new_tokens=21, ignore_eos=True)
    llm = spec_llm(tiny_dirs, draft_dirs, "llama", algorithm, draft, steps, topk, n, 1)
    llm.engine.policy = Alternating(0)
    outputs = llm.engine.generate(PROMPTS, [params] * len(PROMPTS))
    assert [o.output_ids for o in outputs] == reference(tiny_dirs, "llama", 1, PROMPTS, params)
    assert all_slots_free(llm.engine)
    if draft == "self":  # after plain rounds the draft state is exact: speculation still accepts runs
        assert any(len(o.metrics.depth_counts) >= 2 for o in outputs)
