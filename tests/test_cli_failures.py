"""The commands when the world refuses: stdout that cannot take the answer (a full disk), a cache that cannot be
written, a conversation grown past the context. Each is one line and a non-zero exit or a note, never a traceback,
and nothing typed or generated is lost."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.commands  # a `fastspec` command: .ci/run runs these again over a hostile user cache

FULL = Path("/dev/full")  # (Linux: every write fails with ENOSPC, as on a full disk)


def run_cli(*args, stdin="", stdout=subprocess.PIPE, env=None):
    return subprocess.run([sys.executable, "-m", "fastspec.cli", *args], input=stdin.encode(), stdout=stdout,
                          stderr=subprocess.PIPE, timeout=600, env={**os.environ, **(env or {})})


def one_error_line(stderr: bytes) -> str:
    err = stderr.decode()
    assert "Traceback" not in err and "Exception ignored" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.skipif(not FULL.is_char_device(), reason="needs /dev/full")
@pytest.mark.parametrize("as_json", [False, True])
def test_generate_into_a_full_disk_is_one_line_that_keeps_the_answers(as_json):
    args = ["generate", "--prompt", "Name a colour.", "--prompt", "Name a fruit.", "--chat", "--max-new-tokens", "6",
            "--max-total-tokens", "2048", *(["--json"] if as_json else [])]
    shown = run_cli(*args)
    assert shown.returncode == 0, shown.stderr
    with FULL.open("w") as full:
        refused = run_cli(*args, stdout=full)
    line = one_error_line(refused.stderr)
    assert refused.returncode == 2 and line.startswith("error: cannot write to stdout (No space left on device)")
    kept = json.loads(line.split(": ", 2)[2])  # the answers, in the line, rather than lost
    if as_json:
        assert kept == json.loads(shown.stdout)
    else:
        assert kept == shown.stdout.decode().split("\n")[1::2][:2]  # (the text under each `--- answer i of 2 ---`)


@pytest.mark.skipif(not FULL.is_char_device(), reason="needs /dev/full")
def test_chat_into_a_full_disk_is_one_line_and_the_conversation_is_saved(tmp_path):
    with FULL.open("w") as full:
        refused = run_cli("chat", "--max-new-tokens", "6", "--max-total-tokens", "2048", stdin="Say hi.\nSay bye.\n",
                          stdout=full, env={"FASTSPEC_CACHE": str(tmp_path)})
    line = one_error_line(refused.stderr)
    assert refused.returncode == 2 and line == "error: cannot write to stdout (No space left on device)"
    (saved,) = (tmp_path / "chats").iterdir()
    assert json.loads(saved.read_text())["messages"][0] == {"role": "user", "content": "Say hi."}


@pytest.mark.skipif(not FULL.is_char_device(), reason="needs /dev/full")
def test_bench_and_export_into_a_full_disk_are_one_line_that_keeps_what_they_made(tmp_path):
    """bench's figures go into its one error line; export-draft's head is written whatever stdout says (tune, the
    same way, saves its tuned file before it prints the table). They were tracebacks."""
    from fastspec.models.embedded import DEFAULT_MODEL, embedded_head

    with FULL.open("w") as full:
        bench = run_cli("bench", "--batch-sizes", "1", "--num-prompts", "1", "--max-new-tokens", "8", "--trials", "1",
                        "--warmup", "0", "--max-total-tokens", "2048", "--json", stdout=full)
        export = run_cli("export-draft", str(embedded_head(DEFAULT_MODEL)), str(tmp_path / "head"), "--format",
                         "sglang", stdout=full)
    line = one_error_line(bench.stderr)
    assert bench.returncode == 2 and line.startswith("error: cannot write to stdout (No space left on device): ")
    assert json.loads(line.split(": ", 2)[2])["results"][0]["batch_size"] == 1
    assert one_error_line(export.stderr) == ("error: cannot write to stdout (No space left on device): "
                                             f"{tmp_path / 'head'} is written")
    assert export.returncode == 2 and (tmp_path / "head" / "model.safetensors").is_file()


def test_a_cache_that_cannot_be_written_is_one_line(tmp_path):
    """The embedded model is converted into the cache on first use: a cache that cannot take it (here a file stands
    where its directory should be, as a read-only or full one refuses) is named in one line, not a traceback."""
    (tmp_path / "blocked").write_text("a file where the cache should be")
    result = run_cli("generate", "--prompt", "hi", "--max-new-tokens", "2", "--max-total-tokens", "512",
                     env={"FASTSPEC_MODEL_CACHE": str(tmp_path / "blocked" / "models")})
    line = one_error_line(result.stderr)
    assert result.returncode == 2 and str(tmp_path / "blocked") in line and "FASTSPEC_MODEL_CACHE" in line


@pytest.mark.slow
def test_a_conversation_past_the_context_leaves_out_its_oldest_turns():
    """A chat keeps going past the context: each answer is asked with the oldest turns left out (never a message of
    the latest turn), the fewest that leave a quarter of the context free beyond its max-new-tokens room once some
    must go (test_chat_session: the turns after reuse the cached prefix), the user is told once per change, and the
    history and the saved record keep every message. Before, every message past the limit was refused for good."""
    import fastspec
    from fastspec.sampling import SamplingParams
    from fastspec.text.conversation import ChatSession

    llm = fastspec.LLM(max_total_tokens=4096, max_context_len=160, speculative_algorithm="NONE")
    session = ChatSession(llm, SamplingParams(max_new_tokens=40, ignore_eos=True), system="Be brief.")
    questions = [f"Question {i}: name an animal that starts with the letter {c}." for i, c in enumerate("ABCDEF")]
    notes = []
    for q in questions:
        unseen = session.unseen
        answer = "".join(session.respond(q))
        assert answer and session.turns[-1].finish_reason == "length"
        notes += session.take_notes()
        seen = session.messages[session.unseen:-1]  # what the answer was asked with (its own reply aside)
        ids = llm.tokenizer.encode_chat([{"role": "system", "content": "Be brief."}, *seen])
        assert seen[-1]["content"] == q and seen[0]["role"] == "user"
        assert len(ids) + 40 <= (160 if session.unseen == unseen else 120)  # it fits; after a drop a quarter is free
        if session.unseen != unseen:  # and one turn more would not have left that quarter
            more = session.messages[session.unseen - 2:-1]
            assert len(llm.tokenizer.encode_chat([{"role": "system", "content": "Be brief."}, *more])) + 40 > 120
    assert session.unseen > 0 and [m["content"] for m in session.messages[::2]] == questions  # all kept
    assert notes and all("160-token context" in n and "/reset" in n for n in notes)
    assert session.command("/reset") == "conversation cleared" and session.unseen == 0
    assert "".join(session.respond("Hello.")) and session.take_notes() == []


class Terminal:
    """A stderr that is a terminal (what a user at one sees), its text kept."""

    def __init__(self):
        self.text = ""

    def isatty(self):
        return True

    def write(self, text):
        self.text += text

    def flush(self):
        pass


def test_a_first_run_says_what_it_is_doing_on_a_terminal(tmp_path, monkeypatch, request):
    """A first start converts the embedded model and builds the CPU kernels (~20 s on a 2-core machine, before
    anything else is shown): on a terminal each says so as it starts; on a pipe stderr stays as it was."""
    import logging

    from fastspec.cli.common import log_to_terminal
    from fastspec.kernels import cpu_library
    from fastspec.models.embedded import embedded_model_dir

    fastspec_log = logging.getLogger("fastspec")
    monkeypatch.setattr(fastspec_log, "handlers", [])
    request.addfinalizer(lambda level=fastspec_log.level: fastspec_log.setLevel(level))
    monkeypatch.setattr(sys, "stderr", Terminal())
    log_to_terminal()
    log_to_terminal()  # (once, however often a command asks)
    monkeypatch.setenv("FASTSPEC_MODEL_CACHE", str(tmp_path / "models"))
    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path / "cache"))
    embedded_model_dir()

    def no_compiler(path, flags=()):
        raise OSError("no cc")
    monkeypatch.setattr(cpu_library, "_build", no_compiler)
    assert cpu_library.library.__wrapped__() is None
    lines = sys.stderr.text.splitlines()
    assert lines[0] == f"converting the embedded model smollm2-135m-instruct into {tmp_path / 'models'} (once)"
    assert lines[1] == f"building fastspec's CPU kernels into {tmp_path / 'cache' / 'kernels'} (once)"
    assert lines[2].startswith("fused CPU kernels unavailable (no cc)") and len(lines) == 3


def test_chat_help_names_the_slash_commands_and_where_the_chat_is_kept():
    """What a terminal chat takes, and where it is saved, are in `fastspec chat --help`, not only once it runs."""
    from typer.testing import CliRunner

    from fastspec.cli import app

    shown = CliRunner().invoke(app, ["chat", "--help"], terminal_width=80).output
    assert all(c in shown for c in ("/reset", "/system TEXT", "/stats", "/exit", "Ctrl-C", "chats/"))


def test_chat_with_stdin_closed_is_one_line():
    """A chat started with no stdin at all (`fastspec chat <&-`, a daemon's child) says where its messages would
    come from, before loading the model; it was a traceback (sys.stdin is None)."""
    result = subprocess.run([sys.executable, "-m", "fastspec.cli", "chat"], preexec_fn=lambda: os.close(0),
                            capture_output=True, timeout=600)
    line = one_error_line(result.stderr)
    assert result.returncode == 2 and "stdin is closed" in line


@pytest.mark.parametrize("args", [["generate", "--prompt", "hi"], ["chat"], ["bench", "--json"], ["tune"],
                                  ["export-draft", "head", "out"]])
def test_a_closed_stdout_is_one_line_before_anything_is_loaded(args):
    """`fastspec generate >&-`: the answers have nowhere to go, so every command that writes them says so at once
    (exit 2), before reading a model; generate was a traceback after the whole run, bench and tune printed nothing."""
    result = subprocess.run([sys.executable, "-m", "fastspec.cli", *args], preexec_fn=lambda: os.close(1),
                            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=600)
    line = one_error_line(result.stderr)
    assert result.returncode == 2 and line == f"error: stdout is closed: fastspec {args[0]} writes its answers there"


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_reader_that_went_away_ends_the_command_quietly_with_sigpipes_code(command, tmp_path):
    """`fastspec ... | head -0`: the reader closed the pipe before the answer; the command ends with nothing on stderr
    and 141, as a process SIGPIPE ends (generate exited 1, chat 0). chat keeps the message and the answer begun."""
    args = ["--prompt", "Say hi."] if command == "generate" else []
    proc = subprocess.Popen([sys.executable, "-m", "fastspec.cli", command, *args, "--max-new-tokens", "6",
                             "--max-total-tokens", "2048"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "FASTSPEC_CACHE": str(tmp_path)})
    proc.stdout.close()
    _, err = proc.communicate(b"Say hi.\nSay bye.\n", timeout=600)
    assert proc.returncode == 141 and err == b""
    if command == "chat":
        (saved,) = (tmp_path / "chats").iterdir()
        messages = json.loads(saved.read_text())["messages"]
        assert messages[0] == {"role": "user", "content": "Say hi."} and messages[1]["role"] == "assistant"


def test_a_context_length_past_the_model_is_named_by_its_flag():
    refused = run_cli("generate", "--prompt", "hi", "--max-new-tokens", "4", "--context-length", "1000000000")
    assert refused.returncode == 2
    assert one_error_line(refused.stderr).startswith("error: --context-length 1000000000 exceeds the model's "
                                                     "max_position_embeddings 8192")
