"""`--threads`: an explicit count is applied, `auto` picks every core or one by timing (never anything else),
GPU runs keep torch's default, bad values are one-line errors."""

import pytest
import torch

from fastspec import threads
from fastspec.errors import FastspecError


@pytest.fixture(autouse=True)
def _restore():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_explicit_auto_and_gpu():
    assert threads.apply_threads(1, "cpu") == 1 and torch.get_num_threads() == 1
    assert threads.apply_threads(0, "cuda") == threads.ALL == torch.get_num_threads()
    assert threads.faster_thread_count(reps=5) in {threads.ALL, 1}
    assert threads.apply_threads(0, "cpu") == torch.get_num_threads() in {threads.ALL, 1}
    with pytest.raises(FastspecError, match="--threads must be >= 1, or 0 for auto"):
        threads.apply_threads(-2, "cpu")


def test_auto_picks_one_thread_when_every_core_is_slower(monkeypatch):
    """The choice follows the timing: a clock under which the multi-thread loop takes longer picks 1."""
    if threads.ALL == 1:
        pytest.skip("one core: nothing to choose")
    ticks = iter(range(10**6))
    slow = {"n": None}
    real_set = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (slow.update(n=n), real_set(n)))
    monkeypatch.setattr(threads.time, "perf_counter", lambda: next(ticks) * (10 if slow["n"] == threads.ALL else 1))
    assert threads.faster_thread_count(reps=2) == 1
    assert torch.get_num_threads() == threads.ALL  # measuring leaves torch's default in place


def test_cli_threads_flag(tiny_dirs):
    from typer.testing import CliRunner

    from fastspec.cli import app

    args = ["generate", "--model", str(tiny_dirs["llama"][0]), "--input-ids", "3,4", "--max-new-tokens", "2",
            "--max-total-tokens", "256"]
    assert CliRunner().invoke(app, args + ["--threads", "1"]).exit_code == 0
    assert torch.get_num_threads() == 1
    bad = CliRunner().invoke(app, args + ["--threads", "-1"])
    assert bad.exit_code == 2 and "--threads must be >= 1" in bad.stderr
