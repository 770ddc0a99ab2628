"""The `fastspec` command: one typer app whose commands each live in a module of this package, parse flags into
frozen configs and delegate. Rich output lives only in this package and in fastspec.benchmark.

Every FastspecError, and every usage error (a flag's value of the wrong type, a missing or unknown flag), becomes
`error: <one line>` on stderr with exit code 2; Ctrl-C exits 130; a reader that went away (a closed pipe) 141, quietly.
No tracebacks.
"""

from __future__ import annotations

import sys

import typer
from typer.core import TyperGroup

try:
    from typer._click import exceptions as click_errors  # (typer vendors click since 0.22)
except ImportError:  # pragma: no cover
    from click import exceptions as click_errors

from fastspec.cli.bench import bench
from fastspec.cli.chat import chat
from fastspec.cli.common import user_errors
from fastspec.cli.export import export_draft
from fastspec.cli.generate import generate
from fastspec.cli.options import model_options
from fastspec.cli.serve import serve
from fastspec.cli.train import train_draft
from fastspec.cli.tune import tune



_ONE_GPU = "fastspec runs on one GPU (--device cuda:N picks it)"
_KV_SIZE = "the KV pool's size is --max-total-tokens (in tokens)"
# SGLang's and vLLM's flags that fastspec spells otherwise or does not take: the hint replaces click's suggestions
FOREIGN_FLAGS = {
    **dict.fromkeys(("--tp-size", "--tp", "--tensor-parallel-size", "--dp-size", "--dp", "--data-parallel-size",
                     "--pp-size", "--pipeline-parallel-size", "--ep-size", "--nnodes"), _ONE_GPU),
    "--mem-fraction-static": _KV_SIZE, "--gpu-memory-utilization": _KV_SIZE,
    "--max-model-len": "use --context-length", "--max-num-seqs": "use --max-running-requests",
    "--max-num-batched-tokens": "use --chunked-prefill-size",
    "--enable-prefix-caching": "the prefix cache is on by default (--disable-radix-cache turns it off)",
    "--no-enable-prefix-caching": "use --disable-radix-cache", "--enforce-eager": "use --disable-cuda-graph",
    "--trust-remote-code": "not needed: fastspec runs its own code for each architecture, never a checkpoint's",
    "--random-seed": "seeds are per request: --seed (generate, chat), a request's seed (serve)",
    "--log-level": "fastspec has no log levels", "--log-level-http": "fastspec has no log levels",
    "--chat-template": "fastspec uses the model's own chat template",
    "--speculative-config": "use --speculative-algorithm, --speculative-draft-model-path, --speculative-num-steps, ...",
    "--speculative-model": "use --speculative-draft-model-path",
    "--num-speculative-tokens": "use --speculative-num-steps (the draft depth)",
    "--grammar-backend": "fastspec's grammars always run on llguidance",
}


def usage_message(error: click_errors.UsageError) -> str:
    """click's message, or for a flag of SGLang's or vLLM's that a shared-flag command lacks, what fastspec has."""
    command = error.ctx.command if error.ctx is not None else None
    shared = command is not None and any(p.name == "speculative_algorithm" for p in command.params)
    if isinstance(error, click_errors.NoSuchOption) and shared and error.option_name in FOREIGN_FLAGS:
        return f"No such option: {error.option_name}; {FOREIGN_FLAGS[error.option_name]}"
    return error.format_message().rstrip(".")


class OneLineErrors(TyperGroup):
    """The command group, with click's usage errors as one line (`error: ...`) where typer draws a box."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click_errors.NoArgsIsHelpError:  # `fastspec` alone: the help, as typer shows it
            return super().main(args, prog_name, complete_var, standalone_mode=True, **extra)
        except click_errors.UsageError as e:
            hint = f" (see {e.ctx.command_path} --help)" if e.ctx is not None else ""
            typer.echo(f"error: {usage_message(e)}{hint}", err=True)
            sys.exit(e.exit_code)
        except click_errors.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except typer.Abort:
            typer.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


# rich_markup_mode None: click's plain help, every flag's name whole at any width (rich's tables cut names such as
# --speculative-draft-model-path below ~160 columns) and help texts taken as they are written, not as markup
app = typer.Typer(cls=OneLineErrors, add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
                  rich_markup_mode=None,
                  help="Lossless speculative decoding (EAGLE, EAGLE-3, STANDALONE, NGRAM), CUDA-graph first, runs "
                       "on CPU too.")


@app.callback()
def _root() -> None:
    """fastspec: lossless speculative decoding (EAGLE, EAGLE-3, STANDALONE, NGRAM)."""


COMMANDS = (  # (name, function, takes the shared model flags, writes answers on stdout, its line in `fastspec --help`)
    ("generate", generate, True, True, "One completion per --prompt or --input-ids, text or --json."),
    ("bench", bench, True, True, "Speculative vs plain tok/s; --url measures a running server."),
    ("chat", chat, True, True, "Chat in the terminal; piped, one message per line."),
    ("train-draft", train_draft, False, False, "Train an EAGLE-3 draft head for a target."),
    ("tune", tune, True, True, "Choose the draft tree per batch size (the others load it)."),
    ("serve", serve, True, False, "Serve the model over the OpenAI HTTP API."),
    ("export-draft", export_draft, False, True, "Write a draft head in the SGLang or vLLM speculators format."))
for name, command, shared_flags, answers, line in COMMANDS:
    app.command(name, short_help=line)(user_errors(model_options(command) if shared_flags else command, answers))
