"""A speculative round's split into phases (draft, verify, draft_extend, catch_up, host), as bench's ms/round and
tune's host cost per round read it. Fake clocks, the phase timer's only: no timed assertion."""

from types import SimpleNamespace

import pytest

from test_policy import PlainFor
from test_speculative import PROMPTS, spec_llm

from fastspec.sampling import SamplingParams
from fastspec.utils import metrics


def fake_clock(monkeypatch) -> list[float]:
    """The phase timer's clock, [seconds], advanced by the test alone (every other clock runs as it does)."""
    clock = [0.0]
    monkeypatch.setattr(metrics, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    return clock


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_the_drafts_catch_up_is_a_phase_of_the_round_it_precedes(tiny_dirs, draft_dirs, monkeypatch, overlap):
    """The draft's catch-up over what prefill and plain rounds left it is a cost per prompt and plain-decoded token:
    its own phase of the speculative round it precedes, neither that round's draft extend nor host work, with the
    overlap schedule too (there it runs before the round's launch). Each round is counted once (the overlap schedule
    finishes one in a later call): tune's host cost and bench's ms/round divide by that count. A fake clock: each
    catch-up takes 1 s, nothing else takes any time."""
    clock = fake_clock(monkeypatch)
    llm = spec_llm(tiny_dirs, draft_dirs, "llama", "STANDALONE", "self", 4, 1, 5, 1, radix_cache=False,
                   overlap_schedule=overlap)
    llm.engine.policy = PlainFor(4)
    backlog = llm.engine.worker.backlog
    catch_up = backlog.catch_up

    def slow(*args):
        clock[0] += 1.0
        return catch_up(*args)

    monkeypatch.setattr(backlog, "catch_up", slow)
    llm.engine.times.reset()
    [out] = llm.engine.generate(PROMPTS[:1], [SamplingParams(max_new_tokens=16, ignore_eos=True)])
    times = llm.engine.times
    split = times.split()
    assert times.counts["round"] == out.metrics.verify_rounds > 1 and times.counts["plain_round"] == 4
    assert times.counts["catch_up"] == 1  # over the prompt and the 4 plain rounds, at once
    assert split["catch_up"] == split["round"] == 1.0 and split["draft_extend"] == split["host"] == 0.0
