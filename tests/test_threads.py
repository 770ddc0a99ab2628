"""`--threads`: an explicit count is applied, auto is torch's default (every core), bad values are one-line
errors."""

import pytest
import torch

from fastspec import threads
from fastspec.errors import FastspecError


@pytest.fixture(autouse=True)
def _restore():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_explicit_and_auto():
    assert threads.apply_threads(1, "cpu") == 1 and torch.get_num_threads() == 1
    assert threads.apply_threads(0, "cpu") == threads.ALL == torch.get_num_threads()
    assert threads.apply_threads(0, "cuda") == threads.ALL
    with pytest.raises(FastspecError, match="--threads must be >= 1, or 0 for auto"):
        threads.apply_threads(-2, "cpu")


def test_cli_threads_flag(tiny_dirs):
    from typer.testing import CliRunner

    from fastspec.cli import app

    args = ["generate", "--model", str(tiny_dirs["llama"][0]), "--input-ids", "3,4", "--max-new-tokens", "2",
            "--max-total-tokens", "256"]
    assert CliRunner().invoke(app, args + ["--threads", "1"]).exit_code == 0
    assert torch.get_num_threads() == 1
    bad = CliRunner().invoke(app, args + ["--threads", "-1"])
    assert bad.exit_code == 2 and "--threads must be >= 1" in bad.stderr
