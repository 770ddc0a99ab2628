"""`fastspec train-draft` runs that stop and go on: an interrupted run resumes from its last checkpoint, and what
--out holds (another plan, target or answers, a damaged run, a directory that is not a run, a full disk) is
refused in one line before anything in it is touched. The tiny chat target and its prompts: test_train.
"""

from __future__ import annotations

import os
import shutil
import signal

import pytest
from test_train import chat_target, prompt_file, tiny_config  # noqa: F401  (fixtures)
from tiny_models import write_chat_target
from typer.testing import CliRunner

from fastspec.cli import app
from fastspec.errors import FastspecError
from fastspec.train.trainer import train_draft

pytestmark = pytest.mark.commands  # a `fastspec` command: .ci/run runs these again over a hostile user cache


def stop_at(step: int):
    """A progress callback that stops training at `step` as Ctrl-C would."""
    def interrupt(p):
        if p.phase == "train" and p.done == step:
            raise KeyboardInterrupt

    return interrupt


def test_an_interrupted_run_resumes_from_its_last_checkpoint(chat_target, prompt_file, tmp_path, monkeypatch):
    from fastspec.train.data import JsonlStore

    out = tmp_path / "head"
    cfg = tiny_config(out, chat_target, prompt_file, epochs=3)
    with pytest.raises(KeyboardInterrupt):
        train_draft(cfg, stop_at(6))
    with pytest.raises(FastspecError, match="--resume"):
        train_draft(cfg)
    events, reads, records = [], [], JsonlStore.records
    monkeypatch.setattr(JsonlStore, "records", lambda self: reads.append(self.path) or records(self))
    train_draft(tiny_config(out, chat_target, prompt_file, epochs=3, resume=True), events.append)
    steps = [e.done for e in events if e.phase == "train"]
    assert steps[0] == 5  # checkpoint at 4, steps 5 and 6 redone
    assert [e for e in events if e.phase == "generate"][-1].done == 12  # no conversation generated twice
    assert reads == [out / "train" / "conversations.jsonl"]  # the answers read once (what is made, what to check)


@pytest.mark.parametrize("flags, message", [
    (["--epochs", "4"], "with --epochs 3, not 4"), (["--lr", "1e-3"], "with --lr 0.003, not 0.001"),
    (["--seed", "1"], "with --seed 0, not 1"), (["--max-prompts", "5"], "on other prompts (--prompts / --max-prompts)"),
])
def test_resuming_with_another_training_plan_is_a_one_line_error(chat_target, prompt_file, tmp_path, flags, message):
    """A checkpoint is a step of one plan (shuffles, batches, lr schedule): other plan flags are refused before
    anything is generated or written, as the draft vocabulary is."""
    out = tmp_path / "head"
    with pytest.raises(KeyboardInterrupt):
        train_draft(tiny_config(out, chat_target, prompt_file, epochs=3), stop_at(5))
    before = {p.name: p.read_bytes() for p in (out / "train").iterdir()}
    args = ["train-draft", "--out", str(out), "--model", str(chat_target), "--prompts", str(prompt_file), "--resume",
            "--max-new-tokens", "24", "--draft-vocab-size", "40", "--ttt-steps", "3", "--epochs", "3",
            "--batch-tokens", "128", "--val-fraction", "0.2", "--lr", "3e-3", "--no-bf16"]
    result = CliRunner().invoke(app, args + flags)
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert message in result.stderr and "--overwrite" in result.stderr
    assert {p.name: p.read_bytes() for p in (out / "train").iterdir()} == before


def test_resuming_on_other_answers_is_refused(chat_target, prompt_file, tmp_path):
    """The plan flags fix the batches only over the same answers: a resume that takes them from a --corpus made
    with another --max-new-tokens would continue the checkpoint on batches it was not part of."""
    out = tmp_path / "head"
    with pytest.raises(KeyboardInterrupt):
        train_draft(tiny_config(out, chat_target, prompt_file, epochs=3), stop_at(5))
    before = (out / "train" / "checkpoint.pt").read_bytes()
    with pytest.raises(FastspecError, match="trained on other answers"):
        train_draft(tiny_config(out, chat_target, prompt_file, epochs=3, resume=True, corpus=tmp_path / "corpus",
                                max_new_tokens=16))
    assert (out / "train" / "checkpoint.pt").read_bytes() == before
    events = []  # the same answers (kept in the run, whatever --max-new-tokens says now) resume
    train_draft(tiny_config(out, chat_target, prompt_file, epochs=3, resume=True, max_new_tokens=16), events.append)
    assert [e.done for e in events if e.phase == "train"][0] == 5


def test_a_disk_that_refuses_a_write_is_one_line_and_the_run_resumes(chat_target, prompt_file, tmp_path,
                                                                    monkeypatch):
    """An --out that cannot be made, or a disk that fills up at the second checkpoint: one line, not a traceback,
    and the run so far (answers, features, first checkpoint) is whole and resumes."""
    import errno

    import fastspec.train.trainer as trainer

    args = ["train-draft", "--model", str(chat_target), "--prompts", str(prompt_file), "--max-new-tokens", "24",
            "--draft-vocab-size", "40", "--ttt-steps", "2", "--epochs", "3", "--batch-tokens", "128",
            "--checkpoint-every", "2", "--lr", "3e-3", "--val-fraction", "0.2", "--no-bf16"]
    result = CliRunner().invoke(app, [*args, "--out", str(prompt_file.parent / "prompts.jsonl" / "o")])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "Not a directory" in result.stderr
    saves, save = [], trainer.save_checkpoint

    def full_disk(*a):
        saves.append(a[-1])
        if len(saves) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        save(*a)

    monkeypatch.setattr(trainer, "save_checkpoint", full_disk)
    out = tmp_path / "head"
    result = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    last = result.stderr.splitlines()[-1]  # after the progress lines of a log
    assert last.startswith("error: ") and "No space left on device; what the run made so far is kept" in last
    saves.clear()

    def ctrl_c(*a):  # Ctrl-C at the second checkpoint: exit 130, saying how to go on (it said "interrupted")
        saves.append(a[-1])
        if len(saves) == 2:
            raise KeyboardInterrupt
        save(*a)

    monkeypatch.setattr(trainer, "save_checkpoint", ctrl_c)
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "stopped")])
    assert result.exit_code == 130 and "Traceback" not in result.output
    assert result.stderr.splitlines()[-1] == "interrupted; what the run made so far is kept: pass --resume to go on"
    saves.clear()

    def sigterm(*a):  # SIGTERM (a scheduler's stop) at the second checkpoint: the same hint, exit 128 + 15
        saves.append(a[-1])
        if len(saves) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        save(*a)

    def reached_pytest(*_):
        raise AssertionError("SIGTERM was not handled by train-draft")

    monkeypatch.setattr(trainer, "save_checkpoint", sigterm)
    outer = signal.signal(signal.SIGTERM, reached_pytest)  # (without train-draft's handler: this, not a killed pytest)
    try:
        result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "terminated")])
        assert signal.getsignal(signal.SIGTERM) is reached_pytest  # restored after the run
    finally:
        signal.signal(signal.SIGTERM, outer)
    assert result.exit_code == 143 and "Traceback" not in result.output, result.output
    assert result.stderr.splitlines()[-1] == "terminated; what the run made so far is kept: pass --resume to go on"
    monkeypatch.setattr(trainer, "save_checkpoint", save)
    events = []
    train_draft(tiny_config(out, chat_target, prompt_file, ttt_steps=2, epochs=3, checkpoint_every=2, resume=True),
                events.append)
    assert [e.done for e in events if e.phase == "train"][0] == 3  # from the first checkpoint (step 2)


@pytest.mark.parametrize("flag", ["--resume", "--overwrite"])
def test_a_directory_that_is_not_a_run_is_neither_resumed_into_nor_overwritten(chat_target, tmp_path, flag):
    """A model directory (or an exported head) as --out: its config.json and weights are the user's."""
    victim = shutil.copytree(chat_target, tmp_path / "victim")
    before = {p.name: p.read_bytes() for p in victim.iterdir()}
    result = CliRunner().invoke(app, ["train-draft", "--out", str(victim), "--model", str(victim), flag])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "not a train-draft directory" in result.stderr
    assert {p.name: p.read_bytes() for p in victim.iterdir()} == before


def test_resume_with_no_run_to_continue_is_a_one_line_error(chat_target, prompt_file, tmp_path):
    """--resume on an --out that holds no run (a mistyped path) started the whole run over, silently (found by the
    QA pass of train-draft); transformers' Trainer refuses alike. Nothing is created."""
    for out in (tmp_path / "typo", tmp_path / "empty"):
        if out.name == "empty":
            out.mkdir()
        result = CliRunner().invoke(app, ["train-draft", "--out", str(out), "--model", str(chat_target), "--prompts",
                                          str(prompt_file), "--resume"])
        assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
        assert "--resume: no train-draft run in" in result.stderr and "drop --resume" in result.stderr
        assert not (out / "train").exists()


def test_resuming_with_another_target_is_a_one_line_error(chat_target, prompt_file, tiny_dirs, tmp_path):
    """A run (its answers, features and head) belongs to the target it was made for."""
    out = tmp_path / "head"
    train_draft(tiny_config(out, chat_target, prompt_file, epochs=1))
    other = tmp_path / "other"
    shutil.copytree(tiny_dirs["qwen3"][0], other)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(chat_target / name, other / name)
    with pytest.raises(FastspecError, match="was made for the target"):
        train_draft(tiny_config(out, other, prompt_file, epochs=2, resume=True))


def test_resuming_with_a_target_of_the_same_config_and_other_weights_is_refused(chat_target, prompt_file,
                                                                              tmp_path):
    """A fine-tune (here: another seed) has the same config.json: resuming with it would train on the first
    target's answers and features under the second one's embedding. Refused before anything is written."""
    out = tmp_path / "head"
    train_draft(tiny_config(out, chat_target, prompt_file, epochs=1))
    tuned = write_chat_target(tmp_path / "fine-tuned", seed=1)
    assert (tuned / "config.json").read_bytes() == (chat_target / "config.json").read_bytes()
    before = {p.name: p.read_bytes() for p in (out / "train").iterdir()}
    with pytest.raises(FastspecError, match="was made for the target .* other weights"):
        train_draft(tiny_config(out, tuned, prompt_file, epochs=1, resume=True))
    assert {p.name: p.read_bytes() for p in (out / "train").iterdir()} == before


def test_a_damaged_run_is_refused_in_one_line_and_bad_input_costs_nothing(chat_target, prompt_file, tmp_path):
    out = tmp_path / "head"
    train_draft(tiny_config(out, chat_target, prompt_file, epochs=1))
    work = out / "train"
    saved = {p.name: p.read_bytes() for p in work.iterdir()}
    # a bad --model or --prompts with --overwrite is refused before the run in --out is touched
    for bad in (["--model", str(tmp_path / "nope")], ["--model", str(chat_target), "--prompts", str(tmp_path / "x")]):
        result = CliRunner().invoke(app, ["train-draft", "--out", str(out), *bad, "--overwrite"])
        assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
        assert {p.name: p.read_bytes() for p in work.iterdir()} == saved
    # features.pt is only a cache: a damaged one is computed again
    (work / "features.pt").write_bytes(b"not a tensor file")
    assert train_draft(tiny_config(out, chat_target, prompt_file, epochs=1, resume=True))["steps"] >= 1
    args = ["train-draft", "--out", str(out), "--model", str(chat_target), "--prompts", str(prompt_file), "--resume",
            "--max-new-tokens", "24", "--draft-vocab-size", "40", "--ttt-steps", "3", "--epochs", "1",
            "--batch-tokens", "128", "--val-fraction", "0.2", "--lr", "3e-3", "--no-bf16"]
    for name in ("checkpoint.pt", "vocab.pt", "target.json"):
        good = (work / name).read_bytes()
        for damage in (good[: len(good) // 2], b"\x00garbage"):  # truncated, then foreign
            (work / name).write_bytes(damage)
            result = CliRunner().invoke(app, args)
            assert result.exit_code == 2 and result.stderr.count("\n") == 1, (name, result.output)
            assert name in result.stderr and "--overwrite" in result.stderr and "Traceback" not in result.output
        (work / name).write_bytes(good)
    assert CliRunner().invoke(app, args).exit_code == 0
