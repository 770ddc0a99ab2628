"""The `fastspec` command: parses flags into frozen configs and delegates. Rich output lives only here.

Every FastspecError becomes `error: <one line>` on stderr with exit code 2; Ctrl-C exits 130. No tracebacks.
"""

from __future__ import annotations

import functools
import json
from typing import Annotated, Optional

import typer

from fastspec.cli_options import ModelOptions, model_options
from fastspec.errors import FastspecError

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
                  help="EAGLE / EAGLE-3 speculative decoding inference, CUDA-graph first, runs on CPU too.")


@app.callback()
def _root() -> None:
    """fastspec: lossless speculative decoding (EAGLE, EAGLE-3, STANDALONE, NGRAM)."""


def user_errors(fn):
    """Turn user-fixable failures into one line on stderr and a non-zero exit."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except FastspecError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130) from None

    return wrapper


class Notes:
    """Notes from building an LLM (a tuned file that is there but not used), shown once the command has accepted
    its input: a rejected command prints its one error line and nothing else."""

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


def parse_ids(text: str, flag: str = "--input-ids") -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise FastspecError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise FastspecError(f"{flag} is empty")
    return ids


def parse_bias(text: str | None) -> tuple[tuple[int, float], ...]:
    """"5:2.5,17:-100" -> ((5, 2.5), (17, -100.0)); a malformed pair is a one-line error."""
    if not text:
        return ()
    try:
        return tuple((int(t), float(v)) for t, v in (pair.split(":") for pair in text.split(",")))
    except ValueError:
        raise FastspecError(f"--logit-bias must be comma-separated id:bias pairs, got {text!r}") from None


@app.command()
@user_errors
@model_options
def generate(
    options: ModelOptions,
    prompt: Annotated[Optional[list[str]], typer.Option(help="Prompt text (repeat for a batch).")] = None,
    input_ids: Annotated[Optional[str], typer.Option(help="Prompt as comma-separated token ids.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Maximum tokens to generate per prompt.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="-1 = off.")] = -1,
    top_p: float = 1.0,
    seed: Optional[int] = None,
    ignore_eos: bool = False,
    stop: Annotated[Optional[list[str]], typer.Option(help="Stop string (repeatable); trimmed from the text.")] = None,
    stop_token_ids: Annotated[Optional[str], typer.Option(help="Comma-separated token ids that end generation.")] = None,
    chat: Annotated[bool, typer.Option(help="Apply the model's chat template to --prompt.")] = False,
    logprobs: Annotated[Optional[int], typer.Option(help="With --json: the target's logprob of each output token and of its N most likely alternatives (0-20).")] = None,
    repetition_penalty: Annotated[float, typer.Option(help="> 1 discourages prompt and output tokens (1 = off).")] = 1.0,
    frequency_penalty: Annotated[float, typer.Option(help="Subtracted per occurrence in the output, in [-2, 2].")] = 0.0,
    presence_penalty: Annotated[float, typer.Option(help="Subtracted once per token in the output, in [-2, 2].")] = 0.0,
    min_p: Annotated[float, typer.Option(help="Drop tokens below min-p x the most likely one's probability.")] = 0.0,
    logit_bias: Annotated[Optional[str], typer.Option(help="Comma-separated id:bias pairs added to the logits, e.g. 5:2.5,17:-100.")] = None,
    json_schema: Annotated[Optional[str], typer.Option(help="Structured output: the answer is JSON valid under this schema (the schema, or a file holding it).")] = None,
    regex: Annotated[Optional[str], typer.Option(help="Structured output: the answer matches this regular expression (or a file's).")] = None,
    ebnf: Annotated[Optional[str], typer.Option(help="Structured output: the answer follows this GBNF grammar, root ::= ... (or a file's).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
):
    """Generate a completion (or several, with repeated --prompt)."""
    from fastspec.grammar import read_grammar_arg
    from fastspec.llm import LLM
    from fastspec.sampling import SamplingParams

    if (prompt is None) == (input_ids is None):
        raise FastspecError("give exactly one of --prompt or --input-ids")
    if chat and input_ids is not None:
        raise FastspecError("--chat applies to --prompt, not to --input-ids")
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                            max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, stop=tuple(stop or ()), logprobs=logprobs,
                            repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                            presence_penalty=presence_penalty, min_p=min_p, logit_bias=parse_bias(logit_bias),
                            stop_token_ids=tuple(parse_ids(stop_token_ids, "--stop-token-ids")) if stop_token_ids else (),
                            json_schema=read_grammar_arg(json_schema), regex=read_grammar_arg(regex),
                            ebnf=read_grammar_arg(ebnf))
    prompts = [parse_ids(input_ids)] if input_ids is not None else list(prompt)
    if any(p == "" for p in prompts):
        raise FastspecError("empty prompt")
    notes = Notes()
    llm = LLM(**options.llm_kwargs(), on_prepare=prepare_progress(), say=notes)
    outputs = llm.generate(prompts, params, chat=chat)
    notes.show()
    if as_json:
        records = [{"output_ids": o.output_ids, "text": o.text, "finish_reason": o.finish_reason,
                    "num_prompt_tokens": len(o.prompt_ids), **o.metrics.as_dict(),
                    **({} if o.logprobs is None else {"logprobs": [
                        {"token": t.token, "logprob": t.logprob, "top": [[i, v] for i, v in t.top]}
                        for t in o.logprobs]})} for o in outputs]
        result = records[0] if len(records) == 1 else {"outputs": records}
        typer.echo(json.dumps(result))
    else:
        for o in outputs:
            typer.echo(o.text if o.text is not None else ",".join(map(str, o.output_ids)))


@app.command()
@user_errors
@model_options
def bench(
    options: ModelOptions,
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "1,4,8",
    max_new_tokens: Annotated[int, typer.Option(help="Tokens generated per request (EOS ignored).")] = 128,
    num_prompts: Annotated[int, typer.Option(help="Prompts per batch size (cycled up to the batch size).")] = 8,
    prompts: Annotated[Optional[str], typer.Option(help="JSONL file, one {\"prompt\": ...} per line.")] = None,
    prompt_set: Annotated[str, typer.Option(help="Built-in held-out prompts: a set name or all (evenly sampled).")]
    = "all",
    trials: Annotated[int, typer.Option(help="Timed trials per configuration (median reported).")] = 2,
    warmup: Annotated[int, typer.Option(help="Warm-up runs per configuration and batch size.")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    url: Annotated[Optional[str], typer.Option(help="Measure a running server instead (http://HOST:PORT): TTFT, "
                                                    "inter-token latency, throughput; no model is loaded.")] = None,
    request_rate: Annotated[float, typer.Option(help="--url: requests per second, Poisson (inf: all at once).")]
    = float("inf"),
    max_concurrency: Annotated[int, typer.Option(help="--url: most requests in flight.")] = 16,
):
    """Throughput of the speculative configuration against no speculation, in the same process and run; with
    --url, a running OpenAI-compatible server under load."""
    from fastspec.prompts import load_prompts, read_jsonl_prompts

    sizes = parse_ids(batch_sizes, "--batch-sizes")
    if min(sizes) < 1 or num_prompts < 1 or trials < 1 or warmup < 0 or max_new_tokens < 1:
        raise FastspecError("batch sizes, --num-prompts, --trials and --max-new-tokens must be >= 1")
    texts = read_jsonl_prompts(prompts) if prompts else load_prompts(prompt_set)
    if not prompts:  # spread the first num_prompts over every set
        texts = texts[::max(1, len(texts) // num_prompts)]
    if url is not None:
        from fastspec.cli_bench import bench_url

        return bench_url(url, [texts[i % len(texts)] for i in range(num_prompts)], max_new_tokens, request_rate,
                         max_concurrency, as_json)
    from fastspec.bench import run_bench
    from fastspec.llm import LLM
    kwargs = options.llm_kwargs() | {"max_running_requests": max(max(sizes), options.max_running_requests)}
    if kwargs["cuda_graph_bs"] is None:  # graphs for every batch a run shrinks through, captured before any timing
        from fastspec.graphs.buckets import default_buckets

        kwargs["cuda_graph_bs"] = tuple(default_buckets(max(sizes)))
    notes = Notes()
    spec = LLM(**kwargs, on_prepare=prepare_progress(), say=notes)
    base_kwargs = kwargs | {"speculative_algorithm": "NONE", "draft_model": None, "token_map": None, "ngram": None}
    baseline = LLM(**{k: v for k, v in base_kwargs.items() if k not in ("num_steps", "topk", "num_draft_tokens")})
    ids = [spec.encode(t, chat=True) for t in texts[:num_prompts]]
    from rich.console import Console

    console = Console(stderr=True)
    with console.status("benchmarking") as status:
        results = run_bench(baseline, spec, ids, sizes, max_new_tokens, trials, warmup,
                            on_progress=lambda text: status.update(text))
    notes.show()
    config = {"model": options.model, "algorithm": spec.engine.spec.algorithm, "num_steps": spec.engine.spec.num_steps,
              "topk": spec.engine.spec.topk, "num_draft_tokens": spec.engine.spec.num_draft_tokens,
              "dtype": options.dtype, "max_new_tokens": max_new_tokens, "num_prompts": len(ids), "trials": trials,
              "graphs": spec.engine.config.graph_mode}
    if as_json:
        typer.echo(json.dumps({"config": config, "results": [r.as_dict() for r in results]}))
    else:
        print_bench_table(config, results)


def print_bench_table(config: dict, results) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"fastspec bench · {config['algorithm']} (steps {config['num_steps']}, topk "
                        f"{config['topk']}, draft tokens {config['num_draft_tokens']}) vs no speculation")
    for column in ("batch", "baseline tok/s", "spec tok/s", "speedup", "per request", "tau", "accept by depth",
                   "ms/round draft·verify·extend·host"):
        table.add_column(column, justify="right")
    for r in results:
        split = r.ms_per_round
        table.add_row(str(r.batch_size), f"{r.baseline_tok_s:.1f}", f"{r.spec_tok_s:.1f}", f"{r.speedup:.2f}x",
                      f"{r.spec_tok_s_per_request:.1f}", f"{r.tau:.2f}",
                      " ".join(f"{a:.2f}" for a in r.acceptance_by_depth[:6]),
                      "·".join(f"{split.get(k, 0):.0f}" for k in ("draft", "verify", "draft_extend", "host")))
    Console().print(table)


from fastspec.cli_chat import chat  # noqa: E402  (own modules: cli.py's size budget)
from fastspec.cli_train import train_draft  # noqa: E402
from fastspec.cli_serve import serve  # noqa: E402
from fastspec.cli_tune import tune  # noqa: E402

app.command("chat")(user_errors(model_options(chat)))
app.command("train-draft")(user_errors(train_draft))
app.command("tune")(user_errors(model_options(tune)))
app.command("serve")(user_errors(model_options(serve)))

if __name__ == "__main__":
    app()
