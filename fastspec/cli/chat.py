"""`fastspec chat`: a conversation in the terminal (rich prompt, streamed answers) or over piped lines, kept
on disk when it ends (fastspec.text.conversation owns the session; this file the two front ends and their loop)."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from typing import Annotated, Optional

import typer
from rich.markup import escape

from fastspec.cli.common import flag_names, refuse_lossy_thresholds, stdout_refusals, stop_on_ctrl_c
from fastspec.cli.options import ModelOptions, refusal_flags
from fastspec.errors import FastspecError


def chat(
    options: ModelOptions,
    max_new_tokens: Annotated[int, typer.Option(help="Maximum tokens per answer.")] = 256,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_k: int = -1,
    top_p: float = 1.0,
    seed: Optional[int] = None,
    system: Annotated[Optional[str], typer.Option(help="System prompt.")] = None,
):
    """Chat in the terminal: /reset, /system TEXT, /stats, /help, /exit (in any case; any other line is a message,
    and a leading // sends a message starting with /); Ctrl-C stops an answer. Without a terminal on stdin: one user
    message per line, plain answers on stdout. The conversation is saved in the cache's chats/."""
    from fastspec.cli.common import Notes, prepare_progress
    from fastspec.llm import LLM
    from fastspec.text.conversation import ChatSession
    from fastspec.utils.cache import cache_root

    params = sampling_params(temperature, top_k, top_p, seed, max_new_tokens)
    if params.greedy:
        refuse_lossy_thresholds(options, "fastspec chat decodes greedily here (--temperature 0 or --top-k 1)")
    notes = Notes()
    kwargs = options.llm_kwargs()
    kwargs["cuda_graph_bs"] = kwargs["cuda_graph_bs"] or (1,)  # a chat runs one request: its graphs, before the prompt
    kwargs["max_running_requests"] = 1  # (and a draft the schedule never uses at batch 1 is not loaded)
    session = ChatSession(LLM(**kwargs, on_prepare=prepare_progress(), say=notes), params, system)
    with _status("getting the first answer ready") if sys.stdin.isatty() else contextlib.nullcontext():
        session.warm_up()
    try:
        io = TerminalChatIO(session) if sys.stdin.isatty() else LinesChatIO()
        notes.show()
        exit_on_hangup()
        with stdout_refusals():  # (a full disk: one line; the conversation is saved below)
            run_chat(session, io)
        if session.refused and not sys.stdin.isatty():  # a script learns that a message got no answer
            raise typer.Exit(2)
    finally:  # (a reader that went away too: user_errors then ends the command quietly)
        save_chat(session, cache_root() / "chats")


def exit_on_hangup() -> None:
    """SIGTERM and SIGHUP (the terminal closed) end the chat as end of input does, through `finally` (the
    conversation saved, the answer cut where it was) rather than killing the process."""
    def leave(signum, _frame):
        raise SystemExit(128 + signum)
    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), leave)


def sampling_params(temperature, top_k, top_p, seed, max_new_tokens, **_):
    flags = set(locals())  # (the parameters, each a flag)
    from fastspec.sampling.params import SamplingParams

    with flag_names(flags):
        return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                              max_new_tokens=max_new_tokens)


def check_flags(**flags) -> None:
    """chat's own flags, checked with the shared ones (before torch is imported), and that it has an input."""
    if sys.stdin is None:  # (`fastspec chat <&-`)
        raise FastspecError("stdin is closed: chat reads its messages there (a terminal, or one message per line)")
    sampling_params(**flags)


chat.check_flags = check_flags


def _status(text: str):
    from rich.console import Console

    return Console(stderr=True).status(text)


def save_chat(session, directory) -> None:
    """Keep the conversation on disk; if the disk refuses, print it (one line) rather than lose it."""
    try:
        saved = session.save(directory)
    except OSError as e:
        typer.echo(f"error: cannot save the conversation in {directory} ({e.strerror or e}): "
                   f"{json.dumps(session.record(), ensure_ascii=False)}", err=True)
        return
    if saved is not None and sys.stdin.isatty():
        typer.echo(f"conversation saved to {saved}", err=True)


def run_chat(session, io) -> None:
    """One loop for both front ends: read a line, run a /command or stream an answer, show the turn's status."""
    from fastspec.text.conversation import is_command, message_text

    while (text := io.read()) is not None:
        if not text:
            continue
        if is_command(text):
            message = session.command(text)
            if message is None:
                return
            io.info(message)
            continue
        # (closing: an answer cut by a failed write still joins the history before the chat is saved)
        refused = len(session.refused)
        with stop_on_ctrl_c() as interrupted, contextlib.closing(
                session.respond(message_text(text), interrupted.is_set)) as answer:
            try:
                # (shown here, not by model_options' flag_names: a message too long names the length flags so)
                with flag_names(refusal_flags(chat)):
                    for delta in answer:
                        io.write(delta)
            except FastspecError as e:
                io.info(f"error: {e}")
                if len(session.refused) > refused:  # (recorded in the engine's words: saved as shown, the flags')
                    session.refused[-1]["error"] = str(e)
                continue
        io.end_answer(session.turns[-1].line())
        for note in session.take_notes():
            io.info(f"note: {note}")


class LinesChatIO:
    """stdin is not a terminal: one message per line; answers on stdout, everything else on stderr."""

    def read(self) -> str | None:
        line = sys.stdin.buffer.readline().decode("utf-8", "replace")  # (bytes that are not UTF-8: U+FFFD)
        return line.strip() if line else None

    def info(self, message: str) -> None:
        typer.echo(message, err=True)

    def write(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def end_answer(self, status: str) -> None:
        self.write("\n")
        self.info(status)


def _prompt(color: bool) -> str:
    """The `you>` prompt, read through readline where there is one: the line is then edited and kept by readline (no
    cap at the terminal's 4095-character line, a pasted paragraph one message, history), which must be handed the
    prompt to place the cursor, its colour codes marked as taking no columns."""
    try:
        import readline  # noqa: F401  (input() uses it once imported)
        hide = ("\001", "\002")
    except ImportError:  # (no readline: the terminal's own line editing)
        hide = ("", "")
    return f"{hide[0]}\x1b[1;32m{hide[1]}you>{hide[0]}\x1b[0m{hide[1]} " if color else "you> "


class TerminalChatIO:
    """A terminal: rich prompt, streamed answer wrapped at words to the terminal's width, dim status lines."""

    def __init__(self, session):
        import shutil

        from rich.console import Console

        from fastspec.text.conversation import HELP, decoding
        from fastspec.text.wrap import WordWrap

        self.console = Console(highlight=False)
        self.prompt = _prompt(self.console.color_system is not None and not self.console.no_color)
        self.wrap = WordWrap(lambda: shutil.get_terminal_size().columns)
        llm, engine = session.llm, session.llm.engine
        said = decoding(llm.planned_spec, engine.config.speculative_fallback, llm.tuned_schedule == ())
        self.console.print(f"[bold]fastspec chat[/bold] · {engine.model_dir.name} · {escape(said)}\n"
                           f"[dim]{HELP} · Ctrl-C stops an answer[/dim]")

    def read(self) -> str | None:
        try:
            return input(self.prompt).strip()
        except (EOFError, KeyboardInterrupt):
            self.console.print()
            return None

    def info(self, message: str) -> None:
        self._write(self.wrap.flush())  # an answer cut by an error keeps its last word
        self.console.print(f"[dim]{escape(message)}[/dim]")

    def write(self, text: str) -> None:
        self._write(self.wrap.feed(text))

    def end_answer(self, status: str) -> None:
        self._write(self.wrap.flush())
        self.wrap.reset()
        self.console.print(f"\n[dim]{escape(status)}[/dim]")

    def _write(self, text: str) -> None:  # as it is: rich would wrap each piece again, and mid-word
        if text:
            self.console.file.write(text)
            self.console.file.flush()
