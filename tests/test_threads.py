"""`--threads`: an explicit count is applied, auto leaves out the cores other processes keep busy (hand-worked
/proc/stat readings), bad values are one-line errors."""

import pytest
import torch

from fastspec.errors import FastspecError
from fastspec.utils import threads


@pytest.fixture(autouse=True)
def _restore():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_explicit_and_auto():
    assert threads.apply_threads(1) == 1 and torch.get_num_threads() == 1
    assert 1 <= threads.apply_threads(0) == torch.get_num_threads() <= threads.ALL  # auto: load-dependent
    with pytest.raises(FastspecError, match="--threads must be >= 1, or 0 for auto"):
        threads.apply_threads(-2)


@pytest.mark.commands
def test_cli_threads_flag(tiny_dirs):
    from typer.testing import CliRunner

    from fastspec.cli import app

    args = ["generate", "--model", str(tiny_dirs["llama"][0]), "--input-ids", "3,4", "--max-new-tokens", "2",
            "--max-total-tokens", "256"]
    assert CliRunner().invoke(app, args + ["--threads", "1"]).exit_code == 0
    assert torch.get_num_threads() == 1
    bad = CliRunner().invoke(app, args + ["--threads", "-1"])
    assert bad.exit_code == 2 and "--threads must be >= 1" in bad.stderr


def test_auto_leaves_out_the_cores_other_processes_keep_busy():
    # /proc/stat cpu lines 0.2 s apart on 2 cores (user nice system idle iowait irq softirq steal), in jiffies
    quiet = threads.busy_cores([100, 0, 50, 1000, 5, 0, 1, 0], [101, 0, 51, 1038, 5, 0, 1, 0], 2)
    spinning = threads.busy_cores([100, 0, 50, 1000, 5, 0, 1, 0], [120, 0, 50, 1019, 6, 0, 1, 0], 2)
    stolen = threads.busy_cores([0] * 8, [2, 0, 0, 20, 0, 0, 0, 18], 2)  # a hypervisor took most of a core
    assert quiet == pytest.approx(0.1) and spinning == pytest.approx(2 * 20 / 40)
    assert threads.threads_for_load(2, quiet) == 2 and threads.threads_for_load(2, spinning) == 1
    assert threads.threads_for_load(2, stolen) == 1 and threads.threads_for_load(2, 2.0) == 1
    assert threads.threads_for_load(16, 3.4) == 13
    assert threads.busy_cores([5] * 8, [5] * 8, 2) == 0.0  # no time passed: nothing measured, nothing busy
    assert 1 <= threads.auto_threads() <= threads.ALL


def test_llm_threads(tiny_dirs):
    import fastspec

    model = str(tiny_dirs["llama"][0])
    fastspec.LLM(model, speculative_algorithm="NONE", threads=1, max_total_tokens=256)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(threads.ALL)
    fastspec.LLM(model, speculative_algorithm="NONE", threads=None, max_total_tokens=256)
    assert torch.get_num_threads() == threads.ALL  # None: the caller's setting stands
    fastspec.LLM(model, speculative_algorithm="NONE", max_total_tokens=256)
    assert torch.get_num_threads() == threads.auto_threads()  # the default: auto, as the CLI's
    for bad in (-1, "2", 1.5, True):
        with pytest.raises(FastspecError, match="^threads must be >= 1, or 0 for auto, got"):
            fastspec.LLM(model, threads=bad)
