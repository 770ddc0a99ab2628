"""The product surface on the embedded model: scripted chat over stdin, chat sessions interrupted and saved, stop
strings through the engine, generate and streams stopped midway, the public face, bad input without torch
(`fastspec bench`: test_product_bench.py). (Interactive terminal use is exercised by hand with tmux.)"""

import json
import os
import subprocess
import sys

import pytest
from conftest import all_slots_free

import fastspec
from fastspec.sampling import SamplingParams

pytestmark = pytest.mark.commands  # a `fastspec` command: .ci/run runs these again over a hostile user cache


def run_cli(*args, stdin="", env=None):
    return subprocess.run([sys.executable, "-m", "fastspec.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=600, env={**os.environ, **(env or {})})


def test_scripted_chat_two_turns():
    result = run_cli("chat", "--max-new-tokens", "24", "--max-total-tokens", "4096",
                     stdin="What is the capital of France?\n/stats\n\nAnd of Italy? Answer in one word.\n")
    assert result.returncode == 0, result.stderr
    answers = result.stdout.strip().splitlines()
    assert len(answers) == 2 and "Paris" in answers[0] and "Rome" in answers[1]
    assert "tok/s" in result.stderr and "1 answer ·" in result.stderr  # per-turn status lines and /stats
    assert "Traceback" not in result.stderr


def test_chat_session_keeps_an_interrupted_answer(tmp_path):
    from fastspec.text.conversation import ChatSession

    llm = fastspec.LLM(max_total_tokens=4096, speculative_algorithm="NGRAM")
    session = ChatSession(llm, SamplingParams(max_new_tokens=48))
    seen = []
    for delta in session.respond("Write a long story about a dragon.", should_stop=lambda: len(seen) >= 3):
        seen.append(delta)
    assert session.turns[-1].finish_reason == "interrupted" and session.turns[-1].tokens < 48
    assert session.messages[-1] == {"role": "assistant", "content": "".join(seen)}
    answer = "".join(session.respond("What is 2 + 2?"))  # the conversation is still usable
    assert answer and session.turns[-1].finish_reason in ("stop", "length") and len(session.messages) == 4
    assert all_slots_free(llm.engine)
    assert session.command("/reset") == "conversation cleared" and session.messages == []
    saved = json.loads(session.save(tmp_path).read_text())  # /reset clears the screen's history, not the record
    assert saved["messages"] == [] and saved["cleared"][0]["messages"][0]["content"].startswith("Write a long")


def test_a_chat_answer_interrupted_before_any_text_leaves_the_message_out_of_what_the_model_sees(tmp_path):
    """Ctrl-C before an answer shows any text (its first tokens held back, e.g. part of a character): the message and
    an empty answer would muddle the next one; the model no longer sees it, the saved record keeps it as unanswered."""
    from types import SimpleNamespace

    from fastspec.llm import TextDelta
    from fastspec.text.conversation import ChatSession
    from fastspec.utils.metrics import SpecMetrics

    aborted = []

    def stream(ids, params):  # a first token held back, then (as the engine ends an aborted request) the end
        yield [TextDelta(0, "", None, SpecMetrics(), [7], None)]
        yield [TextDelta(0, "", "abort", SpecMetrics(), [], 0)] if aborted else [
            TextDelta(0, "Hi", "stop", SpecMetrics(), [8], 2)]

    llm = SimpleNamespace(tokenizer=SimpleNamespace(encode_chat=lambda messages: [1] * len(messages)),
                          engine=SimpleNamespace(room_for=lambda n: 100), stream=stream, abort=aborted.append)
    session = ChatSession(llm, SamplingParams(max_new_tokens=8))
    assert list(session.respond("Tell me a story", should_stop=lambda: True)) == [] and aborted == [0]
    assert session.messages == [] and session.turns[-1].finish_reason == "interrupted"
    aborted.clear()
    assert "".join(session.respond("Hello?")) == "Hi"
    assert session.messages == [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hi"}]
    saved = json.loads(session.save(tmp_path).read_text())
    assert saved["refused"] == [{"content": "Tell me a story", "error": "interrupted before an answer"}]


def test_chat_saves_never_overwrite_and_an_unwritable_directory_prints_the_conversation(tmp_path, capsys):
    from fastspec.cli.chat import save_chat
    from fastspec.text.conversation import ChatSession

    session = ChatSession(None, SamplingParams())
    assert session.save(tmp_path) is None  # nothing said yet: nothing written
    session.messages = [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "hi"}]
    first, second = session.save(tmp_path), session.save(tmp_path)  # same second: two files
    assert first != second and json.loads(first.read_text()) == json.loads(second.read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, second.name])  # no temporary left
    (tmp_path / "blocked").write_text("a file where the directory should be")
    save_chat(session, tmp_path / "blocked")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: cannot save the conversation") and "héllo" in err


def test_stop_strings_trim_exactly():
    llm = fastspec.LLM(max_total_tokens=4096)
    plain = llm.generate(["Count from one to ten, in words."], SamplingParams(max_new_tokens=40), chat=True)[0]
    stop = plain.text[len(plain.text) // 2:][:3]  # 3 characters mid-answer: likely spans a token boundary
    cut = plain.text.index(stop)
    stopped = llm.generate(["Count from one to ten, in words."], SamplingParams(max_new_tokens=40, stop=(stop,)),
                           chat=True)[0]
    assert stopped.text == plain.text[:cut] and stopped.finish_reason == "stop"
    assert stopped.output_ids == plain.output_ids[: len(stopped.output_ids)]
    assert all_slots_free(llm.engine)


def test_chat_prompt_longer_than_the_context_keeps_going(tmp_path):
    """The long message gets one error line and the next is answered; the saved record keeps the refused message
    and the exit code tells a script that one got no answer."""
    long = "word " * 9000  # ~9000 tokens: past the 8192-token context
    result = run_cli("chat", "--max-new-tokens", "8", "--max-total-tokens", "20000",
                     stdin=f"{long}\nSay hi.\n", env={"FASTSPEC_CACHE": str(tmp_path)})
    assert result.returncode == 2
    assert "error:" in result.stderr and len(result.stdout.strip().splitlines()) == 1
    (saved,) = (tmp_path / "chats").iterdir()
    record = json.loads(saved.read_text())
    assert record["refused"][0]["content"] == long.strip() and len(record["messages"]) == 2


def test_piped_chat_takes_bytes_that_are_not_utf8_and_a_signal_saves_the_conversation(tmp_path):
    """A line with a Latin-1 byte is answered (the byte read as U+FFFD), not a traceback; SIGTERM (as SIGHUP,
    a closed terminal) ends the chat through its save, the conversation on disk."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "fastspec.cli", "chat", "--max-new-tokens", "6",
                             "--max-total-tokens", "4096"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "FASTSPEC_CACHE": str(tmp_path)})
    proc.stdin.write(b"Say caf\xe9 please\n")
    proc.stdin.flush()
    answer = proc.stdout.readline()  # the first answer is out: the chat waits for the next line
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert answer.strip() and b"Traceback" not in err and proc.returncode == 128 + signal.SIGTERM
    (saved,) = (tmp_path / "chats").iterdir()
    messages = json.loads(saved.read_text())["messages"]
    assert messages[0] == {"role": "user", "content": "Say caf\ufffd please"} and messages[1]["role"] == "assistant"


def test_generate_stopped_midway_keeps_what_each_answer_has():
    """LLM.generate's should_stop (the CLI's Ctrl-C): every request ends with the tokens it has, reason abort."""
    llm = fastspec.LLM(max_total_tokens=4096, speculative_algorithm="NONE")
    asked = []
    outputs = llm.generate(["Tell me a story.", "Count to fifty."], SamplingParams(max_new_tokens=64, ignore_eos=True),
                           chat=True, should_stop=lambda: asked.append(1) or len(asked) >= 4)
    assert [o.finish_reason for o in outputs] == ["abort", "abort"]
    assert all(0 < len(o.output_ids) < 64 and o.text for o in outputs)
    assert all_slots_free(llm.engine)


def test_abandoned_stream_returns_every_slot():
    llm = fastspec.LLM(max_total_tokens=4096, speculative_algorithm="NGRAM")
    stream = llm.engine.stream([[1, 2, 3], [4, 5]], [SamplingParams(max_new_tokens=30, ignore_eos=True)] * 2)
    next(stream), next(stream)  # prefill and one round, then the consumer walks away
    stream.close()
    assert all_slots_free(llm.engine)


def test_the_public_face_names_the_error_users_catch():
    """The package's top level holds LLM, SamplingParams and the error they raise (`except fastspec.FastspecError`),
    the error without importing torch."""
    code = """
import sys
import fastspec
from fastspec import FastspecError
from fastspec.errors import FastspecError as Original
assert FastspecError is Original is fastspec.FastspecError
assert "torch" not in sys.modules, "torch was imported"
try:
    fastspec.SamplingParams(max_new_tokens=0)
except fastspec.FastspecError as e:
    assert str(e).startswith("max_new_tokens must ")
"""
    subprocess.run([sys.executable, "-c", code], check=True, env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})


def test_help_and_flag_errors_import_no_torch():
    """Each command's `--help` shows every flag's name whole in 80 columns, each flag's help in a few lines (the detail
    is in docs/cli.md), and it and a bad flag (shared or a command's own, a negative token id) answer without
    importing torch (seconds on a CPU box): one line, exit 2."""
    code = """
import re
import sys
from typer.testing import CliRunner
from fastspec.cli import app
assert CliRunner().invoke(app, ["--help"]).exit_code == 0
import typer
for name, command in typer.main.get_command(app).commands.items():
    shown = CliRunner().invoke(app, [name, "--help"], terminal_width=80)
    assert shown.exit_code == 0 and "Usage:" in shown.output, (name, shown.output[-500:])
    for flag in (f for p in command.params for f in p.opts + p.secondary_opts):
        assert f" {flag}" in shown.output, (name, flag)  # whole, at 80 columns
    helps = re.split("\\n  (?=-)", shown.output.partition("Options:")[2])  # one flag's lines each
    assert max(len(h.splitlines()) for h in helps) <= 8, (name, max(helps, key=len))  # the detail: docs/cli.md
for args in (["chat", "--page-size", "3"], ["generate", "--prompt", "hi", "--dtype", "float64"],
             ["bench", "--model", "/no/such/model"], ["serve", "--tool-call-parser", "xml"],
             ["serve", "--max-queued-requests", "0"],
             ["chat", "--speculative-algorithm", "NGRAM", "--speculative-ngram-min-bfs-breadth", "0"],
             ["chat", "--temperature", "-1"], ["generate"], ["generate", "--prompt", ""],
             ["generate", "--input-ids", "1,x"], ["generate", "--input-ids", "-1"],
             ["generate", "--input-ids", "1", "--stop-token-ids", "2,-3"],
             ["generate", "--prompt", "hi", "--top-p", "2"],
             ["generate", "--prompt", "hi", "--json-schema", "[1]"]):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and result.stderr.startswith("error:"), (args, result.output)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
assert "torch" not in sys.modules, "torch was imported"
"""
    subprocess.run([sys.executable, "-c", code], check=True, env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})
