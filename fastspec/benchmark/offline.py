"""`fastspec bench`: one speculative configuration against the no-speculation baseline, same process and run.

For every batch size the prompts are run in batches of that size with fixed output length (ignore_eos),
trials alternating baseline / speculative so machine noise hits both; medians are reported. No printing here:
`run_bench` returns values and calls `on_progress`; fastspec.cli.bench renders tables / JSON.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from fastspec.sampling.params import SamplingParams
from fastspec.utils.metrics import ROUND_PHASES, SpecMetrics


@dataclass(frozen=True)
class BenchResult:
    batch_size: int
    requests: int  # requests each trial ran: the prompts cycled to fill every batch of batch_size
    shape: str  # the tree the speculative engine runs at this batch size, "steps/topk/draft tokens", or "plain"
    baseline_tok_s: float  # all requests' tokens / wall time
    spec_tok_s: float
    speedup: float
    baseline_tok_s_per_request: float
    spec_tok_s_per_request: float
    tau: float
    acceptance_by_depth: list[float]
    ms_per_round: dict[str, float]  # per speculative round: ROUND_PHASES and host, which sum to round
    rounds: dict[str, float]  # decode rounds of the batch a trial: speculative, plain (the measured fallback's choice,
    # or a plain tier): tok/s counts both, ms_per_round and tau the speculative ones

    def as_dict(self) -> dict:
        return asdict(self)


def timed_run(llm, prompts: list[list[int]], bs: int, params: SamplingParams) -> tuple[float, int, SpecMetrics]:
    """Run `prompts` in batches of `bs`; (seconds, generated tokens, summed metrics). Every run starts with an
    empty prefix cache: trials repeat the same prompts, and a decode benchmark must not time cached prefills."""
    llm.engine.flush_cache()
    start, tokens, metrics = time.perf_counter(), 0, SpecMetrics()
    for i in range(0, len(prompts), bs):
        for out in llm.engine.generate(prompts[i:i + bs], [params] * len(prompts[i:i + bs])):
            tokens += len(out.output_ids)
            metrics = metrics + out.metrics
    return time.perf_counter() - start, tokens, metrics


def run_bench(baseline, spec, prompts: list[list[int]], batch_sizes: list[int], max_new_tokens: int, trials: int,
              warmup: int, on_progress: Callable[[str], None] = lambda _: None) -> list[BenchResult]:
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    results = []
    for bs in batch_sizes:
        whole = -(-len(prompts) // bs) * bs  # every batch full (prompts cycled): the figures per request and per
        batch_prompts = [prompts[i % len(prompts)] for i in range(whole)]  # round divide by bs
        warm = SamplingParams(max_new_tokens=min(8, max_new_tokens), ignore_eos=True)
        for _ in range(warmup):
            timed_run(baseline, batch_prompts[:bs], bs, warm), timed_run(spec, batch_prompts[:bs], bs, warm)
        rates = {"baseline": [], "spec": []}
        spec.engine.times.reset()
        metrics = SpecMetrics()
        for trial in range(trials):
            for name, llm in (("baseline", baseline), ("spec", spec)):
                on_progress(f"batch size {bs} · trial {trial + 1}/{trials} · {name}")
                seconds, tokens, m = timed_run(llm, batch_prompts, bs, params)
                rates[name].append(tokens / seconds)
                metrics = metrics + m if name == "spec" else metrics
        results.append(_result(bs, whole, shape_at(spec.engine.spec, bs), rates, metrics,
                               _phase_split(spec, batch_prompts, bs, params, trials)))
    return results


def shape_at(spec, bs: int) -> str:
    """The tree shape a SpecConfig runs at batch size `bs` ("plain": none): a tuned schedule's varies with it."""
    params = spec.params_for(bs) if spec.enabled else None
    return "plain" if params is None else params.shape


@dataclass(frozen=True)
class PhaseSplit:
    seconds: dict[str, float]  # PhaseTimes.split() of the speculative engine over `runs` runs of the prompts
    counts: dict[str, int]  # calls per phase over those runs: "round" = speculative rounds, "plain_round" = plain
    runs: int


def _phase_split(spec, prompts: list[list[int]], bs: int, params: SamplingParams, trials: int) -> PhaseSplit:
    """The timed trials' phase times; on a GPU those are launch times, so one more run synchronises at every
    phase boundary (untimed for tok/s: the syncs stall the launch queue)."""
    times, device = spec.engine.times, spec.engine.config.device
    if not device.startswith("cuda"):
        return PhaseSplit(times.split(), dict(times.counts), trials)
    seconds = times.synced_split(lambda: timed_run(spec, prompts, bs, params), device)
    return PhaseSplit(seconds, dict(times.counts), 1)


def _result(bs: int, requests: int, shape: str, rates: dict, metrics: SpecMetrics, split: PhaseSplit) -> BenchResult:
    base, spec = statistics.median(rates["baseline"]), statistics.median(rates["spec"])
    rounds = split.counts.get("round", 0)  # the split's own: on a GPU it is one synchronised run, not the trials
    per_round = {k: round(split.seconds.get(k, 0.0) / rounds * 1000, 2) if rounds else 0.0
                 for k in (*ROUND_PHASES, "host", "round")}
    mix = {kind: round(split.counts.get(name, 0) / split.runs, 1)
           for kind, name in (("speculative", "round"), ("plain", "plain_round"))}
    return BenchResult(bs, requests, shape, round(base, 2), round(spec, 2), round(spec / base, 3), round(base / bs, 2),
                       round(spec / bs, 2), round(metrics.tau, 3), [round(a, 3) for a in metrics.acceptance_by_depth],
                       per_round, mix)
