"""`fastspec train-draft`: flags -> TrainConfig -> fastspec.train.trainer, with a rich progress bar.

Registered on the app by fastspec.cli.main; errors become one line through user_errors like every other command.
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import Annotated, Optional

import typer

from fastspec.cli.common import flag_names
from fastspec.errors import FastspecError
from fastspec.train.job import DRAFT_VOCAB_SIZE, Progress, TrainConfig

# train-draft's flags that the target's engine is built from: its refusals name them so (not the shared LLM flags)
TARGET_FLAGS = {"model", "device", "max_new_tokens"}
SIZED_BY = {"max_total_tokens": "max_new_tokens"}  # the engine's KV pool: sized from --max-new-tokens (trainer.py)
PHASES = {"generate": "generating responses", "features": "target features", "train": "training"}


def train_draft(
    out: Annotated[Path, typer.Option(help="Output directory (the head + train/ with data and checkpoints).")],
    model: Annotated[str, typer.Option(help="Target: embedded name, HF directory or .gguf.")] = TrainConfig.model,
    prompts: Annotated[Optional[Path], typer.Option(help="JSONL prompts: {\"prompt\": ...} lines, or SpecForge / ShareGPT `conversations` or OpenAI `messages` lines (each one's first user message; the target answers it anew) (default: built-in train split).")] = None,
    max_prompts: Annotated[Optional[int], typer.Option(help="Use only the first N prompts.")] = None,
    samples_per_prompt: Annotated[int, typer.Option(help="Answers per prompt (first greedy).")] = 1,
    max_new_tokens: int = TrainConfig.max_new_tokens,
    corpus: Annotated[Optional[Path], typer.Option(
        help="Keep the target's answers in this corpus directory and reuse every answer already there "
             "(e.g. data/corpus/smollm2-135m-instruct).")] = None,
    generate_only: Annotated[bool, typer.Option(help="Only make the answers (grow --corpus), do not train.")]
    = False,
    draft_vocab_size: Annotated[Optional[int], typer.Option(
        help=f"Tokens the draft predicts, the target's most frequent (default: {DRAFT_VOCAB_SIZE}, or the target's "
             "whole vocabulary if smaller; above the target's vocabulary it is refused).")] = None,
    init: Annotated[str, typer.Option(help="random | target (the midlayer from the target's layer that reads the "
                                           "last feature; fc passing that feature through).")] = TrainConfig.init,
    soft_labels: Annotated[int, typer.Option(
        help="Train against the target's top-k next-token probabilities (k; 0 = its argmax only).")]
    = TrainConfig.soft_topk,
    ttt_steps: Annotated[int, typer.Option(help="Unrolled draft steps per position (training-time test).")]
    = TrainConfig.ttt_steps,
    epochs: int = TrainConfig.epochs,
    lr: float = TrainConfig.lr,
    batch_tokens: int = TrainConfig.batch_tokens,
    val_fraction: float = TrainConfig.val_fraction,
    checkpoint_every: Annotated[int, typer.Option(help="Steps between checkpoints.")] = TrainConfig.checkpoint_every,
    seed: int = 0,
    bf16: Annotated[Optional[bool], typer.Option(
        help="bf16 autocast (float32 master weights); default: only where bf16 is measured faster on this CPU.")
    ] = None,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda[:N]: where answers, features and training run "
                                           "(auto: cuda when torch sees a GPU).")]
    = TrainConfig.device,
    resume: Annotated[bool, typer.Option(help="Continue the run in --out.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Discard the run in --out and start over.")] = False,
):
    """Train an EAGLE-3 draft head for a target on the target's own answers (SGLang/SpecForge format)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
    from rich.progress import Progress as Bar

    with flag_names(TARGET_FLAGS):
        cfg = TrainConfig(out=out, model=model, prompts=prompts, corpus=corpus, generate_only=generate_only,
                          max_prompts=max_prompts, samples_per_prompt=samples_per_prompt,
                          max_new_tokens=max_new_tokens, draft_vocab_size=draft_vocab_size, init=init,
                          soft_topk=soft_labels, ttt_steps=ttt_steps, epochs=epochs, lr=lr, batch_tokens=batch_tokens,
                          val_fraction=val_fraction, checkpoint_every=checkpoint_every, seed=seed, bf16=bf16,
                          device=device, resume=resume, overwrite=overwrite)  # checked before the trainer (torch)
    from fastspec.train.trainer import train_draft as run

    console = Console(stderr=True)
    tasks, accept, logged = {}, "", {}
    # a live bar on a terminal; in a log, a line per tenth of each phase and per held-out evaluation instead
    with Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
             TextColumn("{task.fields[info]}"), console=console, disable=not console.is_terminal) as bar:
        def show(p: Progress) -> None:
            nonlocal accept
            if p.phase == "done":
                return
            if p.phase not in tasks:
                tasks[p.phase] = bar.add_task(PHASES[p.phase], total=p.total, info="")
            if "val_acceptance" in p.info:
                accept = "held-out acceptance " + " ".join(f"{a:.2f}" for a in p.info["val_acceptance"])
                if not console.is_terminal:
                    console.print(f"step {p.done}/{p.total} · loss {p.info['loss']:.3f} · {accept}")
            elif not console.is_terminal and p.total and logged.setdefault(p.phase, 10 * p.done // p.total) < (
                    tenth := 10 * p.done // p.total):  # from where the phase started (a resumed one may be done)
                logged[p.phase] = tenth
                console.print(f"{PHASES[p.phase]} {p.done}/{p.total}", highlight=False)
            info = f"loss {p.info['loss']:.3f} · {accept}" if "loss" in p.info else ""
            bar.update(tasks[p.phase], completed=p.done, total=p.total, info=info)

        try:
            with _sigterm_raises(), flag_names(TARGET_FLAGS, SIZED_BY):
                report = run(cfg, show)
        except OSError as e:  # a full disk, a directory that cannot be made: every file written so far is whole
            kept = (out / "train").is_dir()
            raise FastspecError(f"{e.filename or out}: {e.strerror or e}" + (
                "; what the run made so far is kept: pass --resume once that is fixed" if kept else "")) from None
        except (KeyboardInterrupt, Terminated) as e:  # every answer and checkpoint written so far is whole
            saved = "; what the run made so far is kept: pass --resume to go on" if (out / "train").is_dir() else ""
            stopped = isinstance(e, Terminated)
            typer.echo(f"{'terminated' if stopped else 'interrupted'}{saved}", err=True)
            raise typer.Exit(128 + signal.SIGTERM if stopped else 130) from None
    if generate_only:
        console.print(f"{report['conversations']} answers ({report['tokens']} tokens) in {corpus or out / 'train'}")
        return
    console.print(f"wrote {out}/config.json and model.safetensors · {held_out(report, val_fraction)}")


class Terminated(BaseException):
    """SIGTERM arrived (a job scheduler's stop, `kill`). A BaseException, as KeyboardInterrupt is, so that no
    `except Exception` on the way swallows it."""


@contextlib.contextmanager
def _sigterm_raises():
    """While the job runs, SIGTERM raises Terminated in the main thread, so the run ends as Ctrl-C ends it (saying
    how to go on, exit 143) rather than silently; the previous handler is restored after."""
    def stop(_signum, _frame):
        raise Terminated
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def held_out(report: dict, val_fraction: float) -> str:
    """The final evaluation in words; a run whose split held nothing out says so rather than printing nan."""
    if "val_chain_tau" not in report:
        return (f"no held-out conversations (--val-fraction {val_fraction:g} held out none of "
                f"{report['train_conversations']}): held-out tau not measured")
    return f"held-out chain tau {report['val_chain_tau']} · acceptance by depth {report['val_acceptance']}"
