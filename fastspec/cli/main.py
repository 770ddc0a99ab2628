"""The `fastspec` command: one typer app whose commands each live in a module of this package, parse flags into
frozen configs and delegate. Rich output lives only in this package and in fastspec.benchmark.

Every FastspecError becomes `error: <one line>` on stderr with exit code 2; Ctrl-C exits 130. No tracebacks.
"""

from __future__ import annotations

import typer

from fastspec.cli.bench import bench
from fastspec.cli.chat import chat
from fastspec.cli.common import user_errors
from fastspec.cli.export import export_draft
from fastspec.cli.generate import generate
from fastspec.cli.options import model_options
from fastspec.cli.serve import serve
from fastspec.cli.train import train_draft
from fastspec.cli.tune import tune

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
                  help="EAGLE / EAGLE-3 speculative decoding inference, CUDA-graph first, runs on CPU too.")


@app.callback()
def _root() -> None:
    """fastspec: lossless speculative decoding (EAGLE, EAGLE-3, STANDALONE, NGRAM)."""


for name, command, shared_flags in (("generate", generate, True), ("bench", bench, True), ("chat", chat, True),
                                    ("train-draft", train_draft, False), ("tune", tune, True),
                                    ("serve", serve, True), ("export-draft", export_draft, False)):
    app.command(name)(user_errors(model_options(command) if shared_flags else command))
