"""`fastspec tune`: flags -> fastspec.tune.tuner, a rich table of predicted vs measured, the tuned file, a PNG
plot and, with `--emit sglang`, the equivalent SGLang launch flags. Registered on the app by fastspec.cli.main."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from fastspec.cli.common import refuse_lossy_thresholds, stdout_refusals
from fastspec.cli.options import ModelOptions
from fastspec.errors import FastspecError


def tune(
    context: typer.Context,
    options: ModelOptions,
    batch_sizes: Annotated[str, typer.Option(help="Batch sizes to tune, e.g. 1,4,8.")] = "1,4,8",
    budget: Annotated[float, typer.Option(help="Seconds for the whole tuning (the end-to-end stage shrinks).")]
    = 600.0,
    prompts: Annotated[Optional[Path], typer.Option(help="JSONL prompts of the workload (default: built-in).")]
    = None,
    num_prompts: int = 8,
    max_new_tokens: int = 96,
    emit: Annotated[Optional[str], typer.Option(help="Also print the equivalent launch flags: sglang.")] = None,
    from_tuned: Annotated[bool, typer.Option(help="With --emit: read the existing tuned file, do not tune.")]
    = False,
    plot: Annotated[Optional[Path], typer.Option(help="PNG of tok/s vs batch size (default: next to the file).")]
    = None,
):
    """Choose (num_steps, topk, num_draft_tokens) per batch size from replayed acceptance and measured costs
    (measured without the speculative fallback and the prefix cache)."""
    from rich.console import Console

    from fastspec.cli.common import parse_ids, prepare_progress
    from fastspec.llm import LLM
    from fastspec.models.embedded import default_speculation
    from fastspec.models.sources import resolve_sources
    from fastspec.prompts import load_prompts, read_jsonl_prompts
    from fastspec.speculative import tuned as tuned_file
    from fastspec.tune.tuner import TuneConfig
    from fastspec.tune.tuner import tune as run

    if emit not in (None, "sglang"):
        raise FastspecError(f"--emit supports sglang, got {emit!r}")
    if from_tuned and emit is None:
        raise FastspecError("--from-tuned only goes with --emit")
    given = [flag for flag, value in (("--speculative-num-steps", options.speculative_num_steps),
                                      ("--speculative-eagle-topk", options.speculative_eagle_topk),
                                      ("--speculative-num-draft-tokens", options.speculative_num_draft_tokens))
             if value is not None]
    if given:
        raise FastspecError(f"{given[0]}: fastspec tune chooses the tree shapes itself"
                            + (" (--from-tuned: the tuned file's)" if from_tuned else "") + "; drop it")
    # (the tuned file would not record them either: chat would use the shapes tuned under them)
    refuse_lossy_thresholds(options, "fastspec tune measures greedy decoding")
    sizes = tuple(parse_ids(batch_sizes, "--batch-sizes"))
    check_sizes(batch_sizes, sizes, num_prompts, max_new_tokens, budget)
    running = engine_flags(context, options, sizes)
    if plot is not None and not plot.parent.is_dir():
        raise FastspecError(f"--plot {plot}: no such directory {plot.parent}")
    algorithm, draft = default_speculation(options.model, options.speculative_algorithm,
                                           options.speculative_draft_model_path)
    if (algorithm or "").upper() not in ("EAGLE", "EAGLE3") or draft is None:
        given = f", not {algorithm.upper()}" if algorithm and draft is not None else ""
        raise FastspecError(f"fastspec tune tunes EAGLE / EAGLE3 heads{given}: give --speculative-algorithm EAGLE or "
                            "EAGLE3 and --draft")
    texts = read_jsonl_prompts(prompts) if prompts else load_prompts("all", "train")[::37]
    from fastspec.config import resolve_device

    device = resolve_device(options.device)
    if from_tuned:  # no model loaded: its sources name the tuned file
        quantization = None if options.quantization == "none" else options.quantization  # as EngineConfig reads it
        sources = resolve_sources(options.model, algorithm, draft, revision=options.revision,
                                  draft_revision=options.speculative_draft_model_revision,
                                  quantization=quantization, device=device, load_format=options.load_format)
        path, weights = tuned_location(sources, options.dtype, options.kv_cache_dtype, device)
        if not path.exists():
            raise FastspecError(f"no tuned file at {path}: run fastspec tune first")
        data = tuned_file.read_tuned(path)
        stale = tuned_file.staleness(data, tuned_file.fingerprint(sources.model_dir, sources.draft_dir, weights,
                                                                  device))
        if stale is not None:  # what chat / generate would ignore is not handed to SGLang either
            raise FastspecError(f"tuned file {path}: {stale}; run fastspec tune again")
        print(sglang_flags(data["tiers"], algorithm, sources.draft_dir))
        return
    cfg = TuneConfig.for_device(device, batch_sizes=sizes, max_new_tokens=max_new_tokens,
                                budget=budget)
    kwargs = options.llm_kwargs() | dict(speculative_algorithm=algorithm, draft_model=draft, tuned=False,
                                         num_steps=cfg.max_steps, topk=max(cfg.topks),
                                         num_draft_tokens=cfg.max_draft_tokens, speculative_fallback=False,
                                         radix_cache=False, max_running_requests=running)
    llm = LLM(**kwargs, on_prepare=prepare_progress())
    model_dir, draft_dir, config = llm.sources.model_dir, llm.sources.draft_dir, llm.engine.config
    # the label the engine was built with (resolving --dtype auto again, after loading, could read less free memory)
    weights = tuned_file.weights_label(config.dtype, config.quantization, config.kv_cache_torch_name)
    path = tuned_file.tuned_path(model_dir, draft_dir, weights, config.device)
    console = Console(stderr=True)
    ids = [llm.encode(t, chat=True) for t in texts[:num_prompts]]
    with console.status("tuning") as status:
        result = run(llm, ids, cfg, say=lambda text: status.update(text))
    print_ = tuned_file.fingerprint(model_dir, draft_dir, weights, config.device)
    # (written first: a stdout that refuses the table loses nothing)
    merged = tuned_file.add_tiers(path, print_, result.tiers(), tuned_file.settings(config))
    kept = [t for t in merged.tiers if t["max_batch_size"] in merged.kept]  # (measured by an earlier tune)
    with stdout_refusals(lambda: f"the tuned file {path} is written"):
        print_table(result, kept)
    if merged.note:
        console.print(merged.note, markup=False, soft_wrap=True)
    console.print(f"wrote {path} · {describe_written(merged)}", markup=False,
                  soft_wrap=True)  # (a path split across lines cannot be copied)
    _plot(result, kept, plot or path.with_suffix(".png"), console)
    if emit:
        with stdout_refusals():
            print(sglang_flags(list(merged.tiers), algorithm, draft_dir))


def check_sizes(batch_sizes: str, sizes: tuple[int, ...], num_prompts: int, max_new_tokens: int,
                budget: float) -> None:
    """One line naming the flag that is out of range."""
    if min(sizes) < 1:
        raise FastspecError(f"--batch-sizes must all be >= 1, got {batch_sizes!r}")
    if len(set(sizes)) < len(sizes):  # (each was tuned again, and the tuned file held two tiers for it)
        raise FastspecError(f"--batch-sizes names a batch size twice: {batch_sizes!r}")
    if num_prompts < 1:
        raise FastspecError(f"--num-prompts must be >= 1, got {num_prompts}")
    if max_new_tokens < 8:
        raise FastspecError(f"--max-new-tokens must be >= 8, got {max_new_tokens}")
    if not budget > 0:
        raise FastspecError(f"--budget must be > 0, got {budget:g}")


FIXED_OFF = {  # the engine flags tune runs with off, and why: typed on (`--radix-cache`) they are refused
    "speculative_fallback": "it times each tree shape and plain decoding itself, and the fallback would switch the "
                            "shape being timed",
    "radix_cache": "its runs repeat the same prompts, and cached prefills would be timed as free"}


def engine_flags(context: typer.Context, options: ModelOptions, sizes: tuple[int, ...]) -> int:
    """The engine's max_running_requests for tuning `sizes`: --max-running-requests when given (at least the largest
    batch size, or one line), else the largest (2 at least). A flag of FIXED_OFF typed on is refused in one line."""
    from fastspec.cli.common import given

    for name, why in FIXED_OFF.items():
        if getattr(options, name) and given(context, name):
            raise FastspecError(f"--{name.replace('_', '-')}: fastspec tune measures with it off ({why}); drop it")
    if not given(context, "max_running_requests"):
        return max(max(sizes), 2)
    if options.max_running_requests < max(sizes):
        raise FastspecError(f"--max-running-requests {options.max_running_requests} is below the largest "
                            f"--batch-sizes, {max(sizes)}: tune runs batches of each size")
    return options.max_running_requests


def tuned_location(sources, dtype: str | None, kv_cache_dtype: str, device: str) -> tuple[Path, str]:
    """(where the tuned file of these sources on `device` lives, its weights label)."""
    from fastspec.config import kv_cache_dtype_name
    from fastspec.models.weights_fit import resolve_model_dtype
    from fastspec.speculative import tuned as tuned_file

    dtype = resolve_model_dtype(dtype, device, sources)
    kv = kv_cache_dtype_name(kv_cache_dtype, dtype, device, sources.quantization)
    weights = tuned_file.weights_label(dtype, sources.quantization, kv)
    return tuned_file.tuned_path(sources.model_dir, sources.draft_dir, weights, device), weights


def describe_written(merged) -> str:
    """The schedule a tune wrote, and which of its tiers an earlier tune measured: "schedule bs <= 1: 3/2/5 ·
    bs <= 4: plain (...) · kept from the earlier tune: bs 4"."""
    from fastspec.spec_config import SpecParams
    from fastspec.tune.tuner import describe_schedule

    schedule = tuple((t["max_batch_size"], None if t["params"] is None else SpecParams(*t["params"]))
                     for t in merged.tiers)
    kept = f" · kept from the earlier tune: bs {', '.join(map(str, merged.kept))}" if merged.kept else ""
    return f"schedule {describe_schedule(schedule)}{kept}"


def sglang_flags(tiers: list[dict], algorithm: str, draft_dir: Path) -> str:
    """SGLang launch flags of the bs = 1 choice (SGLang takes one tree shape for every batch size)."""
    first = min(tiers, key=lambda t: t["max_batch_size"])
    if first["params"] is None:
        return "# speculation does not pay at batch size 1 here: launch SGLang without --speculative-* flags"
    s, k, n = first["params"]
    return (f"--speculative-algorithm {algorithm.upper()} --speculative-draft-model-path {draft_dir} "
            f"--speculative-num-steps {s} --speculative-eagle-topk {k} --speculative-num-draft-tokens {n}")


def print_table(result, kept: list[dict] = ()) -> None:
    """This run's confirmed candidates, and the tiers `kept` from the tuned file before it (as it recorded them,
    marked `kept`: an earlier tune measured them)."""
    from rich.console import Console
    from rich.table import Table

    why = sorted([(bs, f"bs {bs}: {text}") for bs, text in result.why.items()]  # the rematch's verdicts
                 + [(t["max_batch_size"], f"bs {t['max_batch_size']}, kept from the earlier tune: {t['why']}")
                    for t in kept if t.get("why")])
    table = Table(title="fastspec tune: candidates confirmed end to end (the last measurement of each: the final "
                        "rematch's median for the chosen shape and plain, a shorter halving run for the rest; tau "
                        "replayed over every prompt, measured over the batch timed: the first bs prompts)",
                  caption="\n".join(line for _, line in why) or None)
    for col in ("bs", "shape (steps/topk/N)", "replayed tau", "measured tau", "predicted tok/s", "measured tok/s",
                "tokens", "chosen"):
        table.add_column(col, justify="right")
    last = {(c.bs, c.params): c for c in result.confirmed}
    rows = [(bs, -(c.measured or 0), confirmed_row(c, result.winners[bs].params == params))
            for (bs, params), c in last.items()]  # by batch size, the fastest first
    rows += [(t["max_batch_size"], 0, kept_row(t)) for t in kept]
    for _, _, cells in sorted(rows, key=lambda row: row[:2]):
        table.add_row(*cells)
    Console().print(table)


def confirmed_row(c, chosen: bool) -> list[str]:
    """A confirmed candidate's row (tuner.Candidate), ✓ where it was `chosen`."""
    return [str(c.bs), "plain" if c.params is None else c.params.shape, f"{c.tau:.2f}", f"{c.measured_tau or 0:.2f}",
            f"{c.predicted:.1f}", f"{c.measured or 0:.1f}", str(c.measured_tokens or "-"), "✓" if chosen else ""]


def kept_row(tier: dict) -> list[str]:
    """A kept tier's row as the tuned file recorded it (a figure it lacks: -), `kept` where this run's say ✓."""
    from fastspec.spec_config import SpecParams

    def figure(key: str, digits: int) -> str:
        value = tier.get(key)
        return "-" if not isinstance(value, (int, float)) else f"{value:.{digits}f}"

    params = tier["params"]
    return [str(tier["max_batch_size"]), "plain" if params is None else SpecParams(*params).shape,
            figure("tau", 2), figure("measured_tau", 2), figure("predicted_tok_s", 1), figure("measured_tok_s", 1),
            str(tier.get("measured_tokens") or "-"), "kept"]


def _plot(result, kept: list[dict], path: Path, console) -> None:
    """tok/s vs batch size: this run's plain and tuned, and the measured `kept` tiers of an earlier tune."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        console.print("[dim]no PNG plot: pip install matplotlib (fastspec\\[plot])[/dim]")
        return
    last = {(c.bs, c.params): c for c in result.confirmed}
    sizes = sorted(result.winners)
    plain = [last[(bs, None)].measured for bs in sizes]
    tuned = [result.winners[bs].measured for bs in sizes]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(sizes, plain, "o-", label="no speculation")
    ax.plot(sizes, tuned, "o-", label="tuned")
    earlier = [(t["max_batch_size"], t["measured_tok_s"]) for t in kept
               if isinstance(t.get("measured_tok_s"), (int, float))]
    if earlier:
        ax.plot(*zip(*earlier), "s", fillstyle="none", label="kept from the earlier tune")
    ax.set_xlabel("batch size"), ax.set_ylabel("tokens / s"), ax.set_xscale("log", base=2), ax.legend()
    ax.set_title("fastspec tune")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        console.print(f"no PNG plot: cannot write {path} ({e.strerror or e})", markup=False)
        return
    finally:
        plt.close(fig)
    console.print(f"plot: {path}")
