"""The suite and the CLI do not depend on what a user's cache holds: the suite runs in a cache of its own, and
every command, over a cache full of foreign and damaged entries (hostile_cache.py), rejects bad input with the
same one line and exit code as over an empty cache, and does the same work for good input (a damaged tuned file
it would have used costs one note on stderr, nothing else)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SUITE_CACHE, USER_CACHE
from hostile_cache import damage_compiled, fill
from tiny_models import write_chat_target
from typer.testing import CliRunner

from fastspec.cli import app
from fastspec.models.embedded import cache_root, models_root
from fastspec.models.heads import write_random_head

pytestmark = pytest.mark.commands  # a `fastspec` command: .ci/run runs these again over a hostile user cache


def test_the_suite_runs_in_a_cache_of_its_own():
    assert cache_root().is_relative_to(SUITE_CACHE) and not cache_root().is_relative_to(USER_CACHE)
    assert Path(os.environ["XDG_CACHE_HOME"]) == SUITE_CACHE
    for shared in (models_root(), Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])):  # the explicit switch, or ours
        assert shared.is_relative_to(os.environ.get("FASTSPEC_TEST_SHARED_CACHE") or SUITE_CACHE)
        assert not shared.is_relative_to(USER_CACHE)


@pytest.fixture(scope="module")
def target_and_head(tmp_path_factory):
    root = tmp_path_factory.mktemp("hermetic")
    target = write_chat_target(root / "target")
    return target, write_random_head(root / "head", 64, 97, "eagle3", draft_vocab=40)


@pytest.fixture(scope="module")
def caches(target_and_head, tmp_path_factory):
    """name -> a $FASTSPEC_CACHE directory: "empty", and "hostile" filled for the tiny target and its head."""
    empty, hostile = tmp_path_factory.mktemp("empty-cache"), tmp_path_factory.mktemp("hostile-cache")
    fill(hostile, *target_and_head)
    return {"empty": empty, "hostile": hostile}


def run(cache: Path, args: list[str], monkeypatch) -> tuple[int, str, list[str]]:
    """(exit code, stdout, stderr lines) of `fastspec *args` with $FASTSPEC_CACHE = cache."""
    with monkeypatch.context() as mp:
        mp.setenv("FASTSPEC_CACHE", str(cache))
        result = CliRunner().invoke(app, args)
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result.exit_code, result.stdout, result.stderr.splitlines()


BAD_GENERATE = [
    (["--dtype", "int8"], "unknown dtype"),
    (["--page-size", "3"], "--page-size must be a power of two"),
    (["--speculative-num-steps", "1", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"],
     "infeasible"),
    (["--speculative-eagle-topk", "0"], "--speculative-eagle-topk must be in [1, 64]"),
    (["--speculative-num-steps", "9223372036854775808"], "--speculative-num-steps must be in [1, 64]"),
    (["--speculative-accept-threshold-single", "2"], "must be in [0, 1]"),
    (["--graphs", "warp"], "--graphs must be one of"),
    (["--device", "tpu"], "--device must be auto, cpu or cuda[:N]"),
    (["--cuda-graph-bs", "0,x"], "graph batch sizes"),
    (["--speculative-token-map", "/no/such/map.json"], "--speculative-token-map does not apply to"),  # EAGLE3
    (["--draft", "/no/such/head"], "--speculative-draft-model-path '/no/such/head' is neither"),
    (["--input-ids", "1,999"], "--input-ids must be token ids in"),  # needs the model: after the tuned file is read
    (["--max-new-tokens", "99999"], "exceeds the context length"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
]


@pytest.mark.parametrize("extra, message", BAD_GENERATE, ids=[m for _, m in BAD_GENERATE])
def test_bad_generate_input_is_the_same_one_line_whatever_the_cache(extra, message, target_and_head, caches,
                                                                     monkeypatch):
    target, head = target_and_head
    args = ["generate", "--model", str(target), "--speculative-algorithm", "EAGLE3", "--draft", str(head),
            "--input-ids", "1,5,9", *extra]
    outcomes = {name: run(cache, args, monkeypatch) for name, cache in caches.items()}
    assert outcomes["hostile"] == outcomes["empty"]
    code, stdout, stderr = outcomes["empty"]
    assert code == 2 and stdout == "" and len(stderr) == 1 and message in stderr[0], stderr


BAD_OTHER = [
    (["bench", "--batch-sizes", "0"], "--batch-sizes must be >= 1, got 0"),
    (["bench", "--trials", "0"], "--trials must be >= 1, got 0"),
    (["bench", "--dtype", "fp8"], "unknown dtype"),
    (["bench", "--kv-cache-dtype", "int8"], "--kv-cache-dtype must be one of"),
    (["chat", "--page-size", "0"], "--page-size must be"),
    (["chat", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),  # (SamplingParams' check: the flag named)
    (["tune", "--batch-sizes", "1,x"], "comma-separated integers"),
    (["tune", "--emit", "vllm"], "--emit supports sglang"),
    (["tune", "--speculative-num-draft-tokens", "1"], "must be in [2, 1024]"),
    (["tune", "--plot", "/no/such/dir/tune.png"], "no such directory"),
    (["tune", "--from-tuned"], "only goes with --emit"),
]


@pytest.mark.parametrize("args, message", BAD_OTHER, ids=[m for _, m in BAD_OTHER])
def test_bad_input_to_every_command_is_the_same_one_line_whatever_the_cache(args, message, target_and_head, caches,
                                                                            monkeypatch):
    target, head = target_and_head
    model = ["--model", str(target), "--speculative-algorithm", "EAGLE3", "--draft", str(head)]
    outcomes = {name: run(cache, [*args, *model], monkeypatch) for name, cache in caches.items()}
    assert outcomes["hostile"] == outcomes["empty"]
    code, _, stderr = outcomes["empty"]
    assert code == 2 and len(stderr) == 1 and message in stderr[0], stderr


def test_a_draft_without_an_algorithm_is_refused_not_ignored(target_and_head, caches, monkeypatch):
    target, head = target_and_head
    code, stdout, stderr = run(caches["empty"], ["bench", "--model", str(target), "--draft", str(head)], monkeypatch)
    assert code == 2 and stdout == "" and len(stderr) == 1 and "needs --speculative-algorithm" in stderr[0], stderr


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_good_input_does_the_same_work_over_a_hostile_cache(dtype, target_and_head, caches, monkeypatch):
    """float32: the tuned file is cut short (one note, then the default tree); bfloat16: a float32 file under the
    bfloat16 name, naming an impossible tree (one note). The old layout and other devices' files are not read."""
    target, head = target_and_head
    args = ["generate", "--model", str(target), "--speculative-algorithm", "EAGLE3", "--draft", str(head),
            "--input-ids", "1,5,9,13", "--max-new-tokens", "12", "--ignore-eos", "--dtype", dtype, "--json",
            "--no-speculative-fallback"]  # the fallback decides by timing: rounds would differ with the load
    empty, hostile = (run(caches[name], args, monkeypatch) for name in ("empty", "hostile"))
    assert empty[:2] == hostile[:2] and empty[0] == 0 and '"verify_rounds"' in empty[1]
    assert empty[2] == [] and len(hostile[2]) == 1 and hostile[2][0].startswith("ignoring tuned file"), hostile[2]


def test_a_damaged_tuned_file_asked_for_is_refused_in_one_line(target_and_head, caches, monkeypatch):
    target, head = target_and_head
    args = ["tune", "--model", str(target), "--speculative-algorithm", "EAGLE3", "--draft", str(head), "--emit",
            "sglang", "--from-tuned"]
    code, stdout, stderr = run(caches["hostile"], args, monkeypatch)
    assert code == 2 and stdout == "" and len(stderr) == 1 and "unreadable" in stderr[0]
    code, _, stderr = run(caches["empty"], args, monkeypatch)
    assert code == 2 and len(stderr) == 1 and "run fastspec tune first" in stderr[0]


def test_damaged_compiled_graphs_are_compiled_again(target_and_head, tmp_path):
    """`--graphs compile` over Inductor entries cut in half (the very keys this run looks up): one note, the same
    output, and fastspec's own compiled-graph directory is clean for the next run."""
    target, head = target_and_head
    args = [sys.executable, "-m", "fastspec.cli", "generate", "--model", str(target), "--speculative-algorithm",
            "EAGLE3", "--draft", str(head), "--input-ids", "1,5,9,13", "--max-new-tokens", "10", "--ignore-eos",
            "--json", "--graphs", "compile", "--speculative-num-steps", "1", "--speculative-eagle-topk", "1",
            "--cuda-graph-bs", "1", "--max-running-requests", "1", "--no-speculative-fallback"]
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"} | {
        "FASTSPEC_CACHE": str(tmp_path)}  # compiled graphs go to fastspec's own place: $FASTSPEC_CACHE/inductor
    cold = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert cold.returncode == 0 and any((tmp_path / "inductor").rglob("*.py")), cold.stderr
    damage_compiled(tmp_path / "inductor")
    damaged = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert damaged.returncode == 0 and damaged.stdout == cold.stdout, damaged.stderr
    notes = [line for line in damaged.stderr.splitlines() if not line.startswith("preparing graph")]
    assert len(notes) == 1 and "damaged entry" in notes[0] and "Traceback" not in damaged.stderr, notes
