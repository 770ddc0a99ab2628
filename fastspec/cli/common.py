"""What every command shares: one-line user errors, notes shown once input is accepted, the graph-preparation
progress line, answers written to a stdout that may refuse them, and the parsers of comma-separated flags."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import threading

import typer

from fastspec import spec_config
from fastspec.errors import BadField, FastspecError, OptionError


# LLM's keywords whose flag is not the keyword in dashes (--max-total-tokens): the rest name them so in messages
FLAGS = {"max_context_len": "--context-length", **spec_config.CLI_FLAGS}
READER_GONE = 128 + 13  # the exit code of a process SIGPIPE ends (`yes | head -1`): a reader that went away


def user_errors(fn, answers: bool = False):
    """Turn user-fixable failures into one line on stderr and a non-zero exit. `answers`: the command writes its
    answers on stdout, so a closed stdout (`>&-`) is refused before it starts (one line, exit 2), and a reader that
    goes away (a closed pipe: `| head -1`) ends it quietly with exit 141, as SIGPIPE ends other tools."""

    name = fn.__name__.replace("_", "-")

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        log_to_terminal()
        try:
            if answers and sys.stdout is None:
                raise FastspecError(f"stdout is closed: fastspec {name} writes its answers there")
            return fn(*args, **kwargs)
        except FastspecError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130) from None
        except BrokenPipeError:
            stdout_to_devnull()
            raise typer.Exit(READER_GONE) from None

    return wrapper


def stdout_to_devnull() -> None:
    """stdout refused a write: what is still buffered goes nowhere, so the interpreter's last flush cannot fail
    again (`Exception ignored ... BrokenPipeError`)."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (AttributeError, OSError, ValueError):  # (no file descriptor: a test's stdout)
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115


class _Stderr(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        sys.stderr.write(self.format(record) + "\n")  # (sys.stderr as it is now: rich's status redirects it)
        sys.stderr.flush()


def log_to_terminal() -> None:
    """On a terminal, fastspec's info lines too, as they happen: what a slow first start is doing (converting the
    embedded model, building the CPU kernels), kernels unavailable. On a pipe only warnings, as Python shows them."""
    logger = logging.getLogger("fastspec")
    if sys.stderr is None or not sys.stderr.isatty() or any(isinstance(h, _Stderr) for h in logger.handlers):
        return
    logger.addHandler(_Stderr(logging.INFO))
    logger.setLevel(logging.INFO)


class Notes:
    """Notes from building an LLM (a tuned file that is there but not used, or measured under other settings),
    shown once the command has accepted its input: a rejected command prints its one error line and nothing else."""

    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, message: str) -> None:
        self.lines.append(message)

    def show(self) -> None:
        for line in self.lines:
            typer.echo(line, err=True)
        self.lines.clear()


def prepare_progress():
    """on_prepare callback: one stderr line per graph bucket being captured / compiled."""
    from rich.console import Console

    console = Console(stderr=True)
    return lambda name, bs: console.print(f"[dim]preparing graph {name}: batch bucket {bs}[/dim]")


def given(context: typer.Context, name: str) -> bool:
    """Whether the command line (or an environment variable) set the parameter `name` of the command `context`
    runs, also to its default value: `--radix-cache` typed is given, left out is not."""
    source = context.get_parameter_source(name)  # (typer may carry its own click: its enum, compared by name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


def refuse_lossy_thresholds(options, why: str) -> None:
    """One line naming the lossy acceptance thresholds set (ModelOptions `options`) where the command decodes
    greedily: `why` says so (spec_config.refuse_lossy_thresholds)."""
    spec_config.refuse_lossy_thresholds(options.speculative_accept_threshold_single,
                                        options.speculative_accept_threshold_acc, why)


def parse_ids(text: str, flag: str = "--input-ids") -> list[int]:
    """"1, 4,8" -> [1, 4, 8]; an empty list or an empty entry ("1,,2", "1,2,") is a one-line error."""
    items = text.replace(" ", "").split(",")
    if items == [""]:
        raise FastspecError(f"{flag} is empty")
    try:
        return [int(t) for t in items]
    except ValueError:
        raise FastspecError(f"{flag} must be comma-separated integers, got {text!r}") from None


def parse_token_ids(text: str, flag: str = "--input-ids") -> list[int]:
    """parse_ids for token ids: each >= 0 too (whether each is in the vocabulary is known once the model is read)."""
    ids = parse_ids(text, flag)
    if min(ids) < 0:
        raise FastspecError(f"{flag} takes token ids >= 0, got {min(ids)}")
    return ids


def parse_bias(text: str | None) -> tuple[tuple[int, float], ...]:
    """"5:2.5,17:-100" -> ((5, 2.5), (17, -100.0)); a malformed pair is a one-line error."""
    if not text:
        return ()
    try:
        return tuple((int(t), float(v)) for t, v in (pair.split(":") for pair in text.split(",")))
    except ValueError:
        raise FastspecError(f"--logit-bias must be comma-separated id:bias pairs, got {text!r}") from None


@contextlib.contextmanager
def flag_names(flags, renamed: dict[str, str] | None = None):
    """Around a library check of a command's flags (SamplingParams', an engine option's, a request's BadField): its
    message's subject is the field as the API and the server take it ("top_p must be in (0, 1]"); here the flag
    typed names it ("--top-p must be in (0, 1]"), as every other flag's check does. `flags`: the parameter names
    to name so; `renamed`: a field or option given by a flag of another name (generate's prompt ids: {"prompt":
    "input_ids"}). A BadField is renamed only when its subject is its field (its words then speak of that field).
    An OptionError (a RequestTooLong too) names each option by its flag (FLAGS', or the keyword in dashes) where
    `flags` has it, else as LLM names it (its `keyword`); one naming none of `flags` passes through, for an enclosing
    flag_names."""
    renamed = renamed or {}

    def typed(name: str) -> str | None:
        flag = renamed.get(name, name)
        return FLAGS.get(flag, f"--{flag.replace('_', '-')}") if flag in flags else None

    try:
        yield
    except OptionError as e:
        if all(typed(name) is None for name in e.values):
            raise
        keyword = e.keyword
        raise FastspecError(e.told(lambda name: typed(name) or keyword(name))) from None
    except FastspecError as e:
        subject, must, rest = str(e).partition(" must ")
        if must and renamed.get(subject, subject) in flags and not (isinstance(e, BadField) and e.field != subject):
            raise FastspecError(f"{typed(subject)} must {rest}") from None
        raise


@contextlib.contextmanager
def stop_on_ctrl_c():
    """While generating, Ctrl-C sets an event (checked between rounds) instead of raising mid-step."""
    event = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: event.set())
    try:
        yield event
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def stdout_refusals(unsaved=lambda: None):
    """Around writing answers to stdout: stdout refusing them (a full disk) becomes one line, the text `unsaved()`
    returns appended so that it is not lost, and stdout /dev/null (the interpreter's last flush cannot fail again).
    A closed pipe (BrokenPipeError: the reader went away) passes through, for user_errors to end quietly."""
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as e:
        stdout_to_devnull()
        kept = unsaved()
        raise FastspecError(f"cannot write to stdout ({e.strerror or e})" + (f": {kept}" if kept else "")) from None
