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
from fastspec.utils.metrics import SpecMetrics


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
    ms_per_round: dict[str, float]  # draft / verify / draft_extend / host / round

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
                               _phase_split(spec, batch_prompts, bs, params)))
    return results


def shape_at(spec, bs: int) -> str:
    """The tree shape a SpecConfig runs at batch size `bs` ("plain": none): a tuned schedule's varies with it."""
    params = spec.params_for(bs) if spec.enabled else None
    return "plain" if params is None else params.shape


def _phase_split(spec, prompts: list[list[int]], bs: int, params: SamplingParams) -> dict:
    """The timed trials' phase times; on a GPU those are launch times, so one more run synchronises at every
    phase boundary (untimed for tok/s: the syncs stall the launch queue)."""
    times, device = spec.engine.times, spec.engine.config.device
    if not device.startswith("cuda"):
        return times.split()
    return times.synced_split(lambda: timed_run(spec, prompts, bs, params), device)


def _result(bs: int, requests: int, shape: str, rates: dict, metrics: SpecMetrics, split: dict) -> BenchResult:
    base, spec = statistics.median(rates["baseline"]), statistics.median(rates["spec"])
    rounds = max(metrics.verify_rounds, 1) / bs  # rounds of the whole batch (every request verifies each round)
    skip = ("prefill", "plain_round", "decode")  # not parts of a speculative round
    per_round = {k: round(v / rounds * 1000, 2) for k, v in split.items() if k not in skip}
    return BenchResult(bs, requests, shape, round(base, 2), round(spec, 2), round(spec / base, 3), round(base / bs, 2),
                       round(spec / bs, 2), round(metrics.tau, 3), [round(a, 3) for a in metrics.acceptance_by_depth],
                       per_round)
