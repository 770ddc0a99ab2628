"""The corpus of a target's answers: shards written whole or not at all, a growing corpus reused by later
train-draft runs, another target's corpus and a damaged shard refused in one line."""

from __future__ import annotations

import re
import shutil

import pytest
from test_train import chat_target, prompt_file, tiny_config  # noqa: F401  (fixtures)
from tiny_models import write_chat_target
from typer.testing import CliRunner

from fastspec.cli import app
from fastspec.errors import FastspecError
from fastspec.train.corpus import Corpus
from fastspec.train.trainer import train_draft

pytestmark = pytest.mark.commands  # a `fastspec` command: .ci/run runs these again over a hostile user cache

RECORDS = [{"prompt": "w3 w4", "sample": 0, "prompt_ids": [90, 3, 4, 91], "output_ids": [5, 6, 2]},
           {"prompt": "w9", "sample": 1, "prompt_ids": [90, 9, 91], "output_ids": []}]


def test_shards_round_trip_and_never_overwrite(chat_target, tmp_path):  # noqa: F811
    corpus = Corpus(tmp_path / "c", chat_target, {"command": "test"})
    first = corpus.append(RECORDS)
    second = corpus.append(RECORDS[:1])
    assert [p.name for p in corpus.shards()] == ["shard-00000.npz", "shard-00001.npz"] == [first.name, second.name]
    assert corpus.records() == RECORDS + RECORDS[:1]
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["corpus.json", first.name, second.name]
    assert Corpus(tmp_path / "c", chat_target, {}).records() == RECORDS + RECORDS[:1]  # reopened: the same


def test_another_targets_corpus_and_a_damaged_shard_are_refused(chat_target, tmp_path):  # noqa: F811
    Corpus(tmp_path / "c", chat_target, {}).append(RECORDS)
    (tmp_path / "elsewhere").mkdir()
    other = write_chat_target(tmp_path / "elsewhere" / chat_target.name, seed=1)  # a folder of the same name
    with pytest.raises(FastspecError, match="another target") as refused:
        Corpus(tmp_path / "c", other, {})
    theirs, ours = re.findall(r"weights (\w+)", str(refused.value))
    assert f"not of {other.resolve()} " in str(refused.value) and theirs != ours
    shard = tmp_path / "c" / "shard-00000.npz"
    shard.write_bytes(shard.read_bytes()[:40])
    with pytest.raises(FastspecError, match="shard-00000.npz is damaged"):
        Corpus(tmp_path / "c", chat_target, {}).records()


def test_train_draft_grows_the_corpus_and_reuses_it(chat_target, prompt_file, tmp_path, monkeypatch):  # noqa: F811
    from fastspec.train import corpus as corpus_module

    corpus = tmp_path / "corpus"
    events = []
    train_draft(tiny_config(tmp_path / "a", chat_target, prompt_file, epochs=1, max_prompts=6, corpus=corpus),
                events.append)
    assert len(Corpus(corpus, chat_target, {}).records()) == 6
    events.clear()
    reads, read_shard = [], corpus_module._read_shard
    monkeypatch.setattr(corpus_module, "_read_shard", lambda path: reads.append(path.name) or read_shard(path))
    train_draft(tiny_config(tmp_path / "b", chat_target, prompt_file, epochs=1, corpus=corpus), events.append)
    assert reads == ["shard-00000.npz"]  # read once (what is made, what to check), the run's own shard not again
    monkeypatch.undo()
    generated = [e for e in events if e.phase == "generate"]
    assert generated[0].done == 6 and generated[-1].done == 12  # the six answers already there are not made again
    assert len(Corpus(corpus, chat_target, {}).shards()) == 2 and not (tmp_path / "b" / "train" /
                                                                       "conversations.jsonl").exists()


def test_cli_refuses_another_targets_corpus_in_one_line_and_keeps_the_run(chat_target, prompt_file,  # noqa: F811
                                                                         tmp_path):
    corpus = tmp_path / "corpus"
    Corpus(corpus, write_chat_target(tmp_path / "other", seed=1), {}).append(RECORDS)
    out = tmp_path / "head"
    train_draft(tiny_config(out, chat_target, prompt_file, epochs=1))
    before = sorted(p.name for p in (out / "train").iterdir())
    result = CliRunner().invoke(app, ["train-draft", "--out", str(out), "--model", str(chat_target), "--prompts",
                                      str(prompt_file), "--corpus", str(corpus), "--overwrite"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "another target" in result.stderr
    assert sorted(p.name for p in (out / "train").iterdir()) == before  # --overwrite deleted nothing
    shutil.rmtree(corpus)
