"""`fastspec bench --url`: the table / JSON of a running server's measurement (fastspec.bench_serving)."""

from __future__ import annotations

import json

import typer

from fastspec.errors import FastspecError


def bench_url(url: str, prompts: list[str], max_tokens: int, rate: float, concurrency: int, as_json: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    from fastspec.bench_serving import run_serving

    if not rate > 0 or concurrency < 1:
        raise FastspecError("--request-rate must be > 0 and --max-concurrency >= 1")
    with Console(stderr=True).status(f"{len(prompts)} requests to {url}"):
        summary = run_serving(url, prompts, max_tokens, rate, concurrency)
    if as_json:
        typer.echo(json.dumps(summary))
        return
    table = Table(title=f"fastspec bench --url {url} · {summary['model']} · rate {rate} req/s · concurrency "
                        f"{concurrency} · {summary['completed']} ok, {summary['failed']} failed in "
                        f"{summary['duration_s']:.1f} s · {summary['output_tok_s']:.1f} tok/s")
    for column in ("ms", "mean", "median", "p99"):
        table.add_column(column, justify="right")
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_latency_ms"):
        row = summary[name] or {}
        table.add_row(name.removesuffix("_ms").upper(), *(f"{row.get(k, float('nan')):.1f}"
                                                          for k in ("mean", "median", "p99")))
    Console().print(table)
    for error in summary["errors"]:
        typer.echo(f"failed: {error}", err=True)
