"""`fastspec bench`: the speculative configuration against no speculation in one process and run (a table or
JSON); with --url, a running OpenAI-compatible server under load (fastspec.benchmark.serving)."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from fastspec.cli.common import Notes, parse_ids, prepare_progress, refuse_lossy_thresholds, stdout_refusals
from fastspec.cli.options import ModelOptions
from fastspec.errors import FastspecError


def bench(
    context: typer.Context,
    options: ModelOptions,
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "1,4,8",
    max_new_tokens: Annotated[int, typer.Option(help="Tokens generated per request (EOS ignored).")] = 128,
    num_prompts: Annotated[int, typer.Option(help="Prompts per batch size (cycled to fill every batch).")] = 8,
    prompts: Annotated[Optional[str], typer.Option(help="JSONL file, one {\"prompt\": ...} per line.")] = None,
    prompt_set: Annotated[str, typer.Option(help="Built-in held-out prompts: a set name or all (evenly sampled).")]
    = "all",
    trials: Annotated[int, typer.Option(help="Timed trials per configuration (median reported).")] = 2,
    warmup: Annotated[int, typer.Option(help="Warm-up runs per configuration and batch size.")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    url: Annotated[Optional[str], typer.Option(help="Measure a running server instead (http://HOST:PORT, or "
                                                    "http://HOST:PORT/PREFIX behind a proxy): TTFT, inter-token "
                                                    "latency, throughput; no model is loaded.")] = None,
    request_rate: Annotated[float, typer.Option(help="--url: requests per second, Poisson (inf: all at once).")]
    = float("inf"),
    max_concurrency: Annotated[int, typer.Option(help="--url: most requests in flight.")] = 16,
    profile: Annotated[bool, typer.Option("--profile", help="Instead of throughput: where a plain decode step's and "
                                                            "a speculative round's time goes on this device (time "
                                                            "per kernel category, host share).")] = False,
):
    """Throughput of the speculative configuration against no speculation, in the same process and run; with
    --url, a running OpenAI-compatible server under load."""
    from fastspec.prompts import load_prompts, read_jsonl_prompts

    sizes = parse_ids(batch_sizes, "--batch-sizes")
    for flag, value in (("--batch-sizes", min(sizes)), ("--num-prompts", num_prompts), ("--trials", trials),
                        ("--max-new-tokens", max_new_tokens)):
        if value < 1:
            raise FastspecError(f"{flag} must be >= 1, got {value}")
    if warmup < 0:
        raise FastspecError(f"--warmup must be >= 0, got {warmup}")
    if prompts and prompt_set != "all":
        raise FastspecError("--prompts and --prompt-set both name the prompts: give one")
    if url is None:  # a flag this run would ignore is refused, as --url refuses a local model's
        _refuse_set("for --url (a running server); without it a model is loaded here", request_rate=request_rate,
                    max_concurrency=max_concurrency)
        refuse_lossy_thresholds(options, "fastspec bench decodes greedily")
        refuse_engine_flags(context, options, sizes, profile)
    if url is None and profile:
        _refuse_set("not used by --profile (it times 16-token runs of the first prompt, the fastest of 3)",
                    max_new_tokens=max_new_tokens, num_prompts=num_prompts, trials=trials, warmup=warmup)
    texts = read_jsonl_prompts(prompts) if prompts else load_prompts(prompt_set)
    if not prompts:  # spread the first num_prompts over every set
        texts = texts[::max(1, len(texts) // num_prompts)]
    if url is not None:
        _check_offline_flags_unset(options, batch_sizes=batch_sizes, trials=trials, warmup=warmup, profile=profile)
        return bench_url(url, [texts[i % len(texts)] for i in range(num_prompts)], max_new_tokens, request_rate,
                         max_concurrency, as_json)
    from fastspec.benchmark.offline import run_bench
    from fastspec.llm import LLM
    # (the default, not typed, grows to the largest batch size: refuse_engine_flags refuses a typed one below it)
    kwargs = options.llm_kwargs() | {"max_running_requests": max(max(sizes), options.max_running_requests)}
    if kwargs["cuda_graph_bs"] is None:  # graphs for every batch a run shrinks through, captured before any timing
        from fastspec.graphs.buckets import default_buckets

        kwargs["cuda_graph_bs"] = tuple(default_buckets(max(sizes)))
    if profile:  # a speculative round to profile at every batch size, whatever the measured fallback prefers
        kwargs["speculative_fallback"] = False
    notes = Notes()
    spec = LLM(**kwargs, on_prepare=prepare_progress(), say=notes)
    if not spec.engine.spec.enabled and spec.tuned_schedule is None:  # (a tuned all-plain file is a measured choice)
        notes(f"{spec.engine.spec.algorithm}: no speculation, so both columns decode plainly (their ratio is the "
              "run-to-run noise); give --speculative-algorithm and a draft to compare")
    base_kwargs = kwargs | {"speculative_algorithm": "NONE", "draft_model": None, "token_map": None, "ngram": None}
    baseline = LLM(**{k: v for k, v in base_kwargs.items() if k not in ("num_steps", "topk", "num_draft_tokens")})
    ids = [spec.encode(t, chat=True) for t in texts[:num_prompts]]
    from rich.console import Console

    console = Console(stderr=True)
    if profile:
        return bench_profile(baseline, spec, ids[0], sizes, options, as_json, console)
    with console.status("benchmarking") as status:
        results = run_bench(baseline, spec, ids, sizes, max_new_tokens, trials, warmup,
                            on_progress=lambda text: status.update(text))
    notes.show()
    run = spec.engine.spec  # a tuned schedule: the maxima of its shapes; each result names the shape it ran
    config = {"model": options.model, "algorithm": _algorithm(spec, options), "num_steps": run.num_steps,
              "topk": run.topk, "num_draft_tokens": run.num_draft_tokens, "tuned": spec.tuned_schedule is not None,
              "dtype": spec.engine.config.dtype, "max_new_tokens": max_new_tokens,
              "num_prompts": len(ids),  # the prompts given; each result's `requests`: those it ran, cycled
              "trials": trials, "graphs": spec.engine.config.graph_mode}
    measured = json.dumps({"config": config, "results": [r.as_dict() for r in results]})
    with stdout_refusals(lambda: measured):  # (a full disk: the figures on stderr's one line)
        if as_json:
            typer.echo(measured)
        else:
            print_bench_table(config, results)


def refuse_engine_flags(context: typer.Context, options: ModelOptions, sizes: list[int], profile: bool) -> None:
    """One line for an engine flag typed that this run could not honour: --max-running-requests below the largest
    batch size (it runs full batches of each), --speculative-fallback with --profile (it profiles a speculative
    round at every batch size, so it runs with the fallback off)."""
    from fastspec.cli.common import given

    if given(context, "max_running_requests") and options.max_running_requests < max(sizes):
        raise FastspecError(f"--max-running-requests {options.max_running_requests} is below the largest "
                            f"--batch-sizes, {max(sizes)}: bench runs batches of each size")
    if profile and options.speculative_fallback and given(context, "speculative_fallback"):
        raise FastspecError("--speculative-fallback is not used by --profile (it profiles a speculative round at "
                            "every batch size, with the fallback off); drop it")


def _algorithm(spec, options: ModelOptions) -> str:
    """The algorithm asked for, also where a tuned file decodes plainly at every batch size (the engine runs NONE)."""
    from fastspec.models.embedded import default_speculation

    if spec.engine.spec.enabled or spec.tuned_schedule is None:
        return spec.engine.spec.algorithm
    asked, _ = default_speculation(options.model, options.speculative_algorithm, options.speculative_draft_model_path)
    return {"NEXTN": "EAGLE"}.get(asked.upper(), asked.upper())


def print_bench_table(config: dict, results) -> None:
    """One row per batch size, in 80 columns: acceptance at the first four draft depths in percent, and a speculative
    round's milliseconds split as the caption says (the JSON keeps every depth and every figure); below it, where
    plain rounds ran too, how many of each kind a trial ran (tok/s counts both, the split the speculative)."""
    from rich.console import Console
    from rich.table import Table

    if config.get("tuned"):  # the shape each batch size ran, as the tuned file switches them
        shapes = "tuned (" + " · ".join(f"bs {r.batch_size}: {r.shape}" for r in results) + ")"
    else:
        shapes = f"(steps {config['num_steps']}, topk {config['topk']}, draft tokens {config['num_draft_tokens']})"
    table = Table(title=f"fastspec bench · {config['algorithm']} {shapes} vs plain",
                  caption="tok/s: plain, speculative, per request · accept %: by draft depth, to 4\n"
                          "ms/round: draft·verify·extend·catch-up·host", box=None, pad_edge=False)
    for column in ("bs", "plain", "spec", "speedup", "per req", "tau", "accept %", "ms/round"):
        table.add_column(column, justify="right", no_wrap=True)
    for r in results:
        split, rounds = r.ms_per_round, r.tau > 0  # tau 0: no speculative round ran (a plain tier or fallback)
        table.add_row(str(r.batch_size), f"{r.baseline_tok_s:.1f}", f"{r.spec_tok_s:.1f}", f"{r.speedup:.2f}x",
                      f"{r.spec_tok_s_per_request:.1f}", f"{r.tau:.2f}" if rounds else "-",
                      " ".join(f"{100 * a:.0f}" for a in r.acceptance_by_depth[:4]) if rounds else "-",
                      "·".join(f"{split.get(k, 0):.1f}" for k in SPLIT) if rounds else "- (no rounds)")
    Console().print(table)
    if any(r.rounds["plain"] for r in results):  # (the measured fallback, or a plain tier)
        mix = " · ".join(f"bs {r.batch_size}: {r.rounds['speculative']:g} + {r.rounds['plain']:g}" for r in results)
        Console().print(f"rounds a trial, speculative + plain: {mix}\n(tok/s counts both kinds; tau, accept % and "
                        "ms/round only the speculative)")


SPLIT = ("draft", "verify", "draft_extend", "catch_up", "host")  # the table's ms/round, in the caption's order


def bench_profile(baseline, spec, prompt: list[int], sizes: list[int], options: ModelOptions, as_json: bool,
                  console) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from fastspec.benchmark.profile import CATEGORIES, profile_step

    rows = []
    for bs in sizes:
        for llm in (baseline, spec) if spec.engine.spec.enabled else (baseline,):
            with console.status(f"profiling batch size {bs}"):
                rows.append((bs, profile_step(llm, prompt, bs)))
    if as_json:
        typer.echo(json.dumps({"model": options.model, "algorithm": spec.engine.spec.algorithm,
                               "profile": [p.as_dict() | {"batch_size": bs} for bs, p in rows]}))
        return
    device = rows[0][1].device if rows else "cpu"
    table = Table(title=f"fastspec bench --profile · {spec.engine.spec.algorithm} · {device}: share of each step's "
                        f"time by {'kernel' if device == 'cuda' else 'operator'} category, and the host's",
                  box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for column in ("bs", "step", "ms", "calls", "host", *SHORT.values()):
        table.add_column(column, justify="right")
    for bs, p in rows:
        shares = [f"{p.ms_by_category[c] / p.ms_per_step:.0%}" if p.ms_per_step else "-" for c in CATEGORIES]
        table.add_row(str(bs), STEPS[p.name], f"{p.ms_per_step:.1f}",
                      f"{p.launches_per_step:.0f}", f"{p.host_share:.0%}", *shares)
    Console().print(table)
    kernels = {model: counts for _, p in rows for model, counts in p.gemm_kernels.items()}
    for model, counts in kernels.items():
        Console().print(f"{model} GEMMs: " + "; ".join(f"{n} x {kernel}" for kernel, n in counts.items()))


STEPS = {"plain step": "plain", "speculative round": "spec",
         "plain step of the tuned schedule": "spec: plain"}  # (its tier at that batch size decodes plainly)
SHORT = {"gemm": "gemm", "attention": "attn", "norm/elementwise": "norm", "copies": "copy", "sampling": "sample",
         "other": "other"}  # the profile's categories as column headers; calls: kernels (CUDA) or operators (CPU)


def _check_offline_flags_unset(options: ModelOptions, **given) -> None:
    """--url measures the server's model as it runs: a flag for a model loaded here is refused, not ignored."""
    from dataclasses import fields

    model = {f.name: getattr(options, f.name) for f in fields(ModelOptions) if f.name != "threads"}
    _refuse_set("for a model loaded here; --url measures the server's model as it runs", options, **given, **model)


def _refuse_set(why: str, options: ModelOptions | None = None, **given) -> None:
    """One line naming each of `given` (bench's parameters, or ModelOptions' fields with `options`) that is set away
    from its default: `why` says why this run would ignore it."""
    import inspect
    from dataclasses import fields

    defaults = {name: p.default for name, p in inspect.signature(bench).parameters.items()}
    defaults |= {f.name: f.default for f in fields(ModelOptions)} if options is not None else {}
    changed = [name for name, value in given.items() if value != defaults[name]]
    if changed:
        flags = ", ".join("--" + name.replace("_", "-") for name in changed)
        verb = "are" if len(changed) > 1 else "is"
        raise FastspecError(f"{flags} {verb} {why}")


def bench_url(url: str, prompts: list[str], max_tokens: int, rate: float, concurrency: int, as_json: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    from fastspec.benchmark.serving import run_serving

    if not rate > 0:  # (nan too)
        raise FastspecError(f"--request-rate must be > 0 (requests per second; inf: all at once), got {rate:g}")
    if concurrency < 1:
        raise FastspecError(f"--max-concurrency must be >= 1, got {concurrency}")
    with Console(stderr=True).status(f"{len(prompts)} requests to {url}"):
        summary = run_serving(url, prompts, max_tokens, rate, concurrency)
    if not summary["completed"]:  # no figure to show: every latency would read nan
        raise FastspecError(f"all {summary['failed']} requests to {url} failed; the first error: "
                            f"{summary['errors'][0] if summary['errors'] else 'unknown'}")
    if summary["failed"]:  # (stderr: stdout keeps only the table or the JSON)
        typer.echo(f"{summary['failed']} of {len(prompts)} requests failed; the figures are over the "
                   f"{summary['completed']} that completed", err=True)
        for error in summary["errors"]:
            typer.echo(f"failed: {error}", err=True)
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
        table.add_row(name.removesuffix("_ms").upper(), *(f"{row[k]:.1f}" if row else "-"  # (-: no sample)
                                                          for k in ("mean", "median", "p99")))
    Console().print(table)
