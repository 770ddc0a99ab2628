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


class ScriptedEngine:
    """An engine on the fake clock: each generate call runs `spec` speculative rounds of the batch (2 ms draft,
    12 ms verify, 1 ms host each; before the first, 6 ms of catch-up over the prompts) and `plain` plain rounds
    (10 ms each). The phase timer times them as the worker does."""

    def __init__(self, clock: list[float], device: str, spec: int, plain: int):
        from fastspec.spec_config import SpecConfig

        self.clock, self.rounds, self.plain = clock, spec, plain
        self.times, self.config, self.spec = metrics.PhaseTimes(), SimpleNamespace(device=device), SpecConfig()

    def flush_cache(self) -> None:
        pass

    def _spend(self, phase: str | None, seconds: float) -> None:
        if phase is None:
            self.clock[0] += seconds
            return
        with self.times(phase):
            self.clock[0] += seconds

    def generate(self, prompts, params):
        for _ in range(self.plain):
            self._spend("plain_round", 0.010)
        for n in range(self.rounds):
            with self.times("round"):
                if n == 0:
                    self._spend("catch_up", 0.006)
                self._spend("draft", 0.002)
                self._spend("verify", 0.012)
                self._spend(None, 0.001)
        out = metrics.SpecMetrics(self.rounds, self.rounds, 2 * self.rounds, (self.rounds,))
        return [SimpleNamespace(output_ids=[1] * (self.plain + 2 * self.rounds), metrics=out) for _ in prompts]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_bench_splits_a_round_over_the_rounds_it_timed_and_counts_plain_ones(monkeypatch, capsys, device):
    """bench's ms/round divides the split by the speculative rounds of the same runs (on a GPU the split is one more,
    synchronised run, not the trials whose tau it reports: dividing by theirs read 1 / trials of a round), the
    catch-up is a figure of its own, and where the measured fallback ran plain rounds too the table says how many
    of each a trial ran: tok/s counts both, the split only the speculative."""
    from fastspec.benchmark.offline import run_bench
    from fastspec.cli.bench import print_bench_table

    monkeypatch.setattr("torch.cuda.synchronize", lambda: None)  # (the "GPU" split's phase boundaries)
    clock = fake_clock(monkeypatch)
    baseline = SimpleNamespace(engine=ScriptedEngine(clock, device, 0, 9))
    spec = SimpleNamespace(engine=ScriptedEngine(clock, device, 3, 4))
    [result] = run_bench(baseline, spec, [[1], [2]], [2], max_new_tokens=6, trials=2, warmup=0)
    assert result.ms_per_round == {"draft": 2.0, "verify": 12.0, "draft_extend": 0.0, "catch_up": 2.0, "host": 1.0,
                                   "round": 17.0}
    assert result.rounds == {"speculative": 3.0, "plain": 4.0}  # a trial's
    print_bench_table({"algorithm": "EAGLE3", "num_steps": 3, "topk": 1, "num_draft_tokens": 4}, [result])
    out = " ".join(capsys.readouterr().out.split())
    assert "2.0·12.0·0.0·2.0·1.0" in out and "speculative + plain: bs 2: 3 + 4" in out
