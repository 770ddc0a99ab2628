"""`fastspec tune`: replay -> predict -> confirm -> write, per batch size, with "off" always a candidate.

1. Greedy answers to the workload's prompts, then acceptance of every tree shape by replay (replay.py).
2. Round costs of every shape per batch size measured in-process (costs.py) at the workload's KV width.
3. Predicted tok/s = bs * tau / (draft + verify + extend + host); plain = bs / (decode + host).
4. Successive halving end to end: the best predicted shapes (of several tree sizes) run the prompts at that
   batch size, the faster half runs again with twice the tokens until one is left, which then faces plain
   decoding over alternating full-length runs (median); a speculative winner is checked lossless against plain
   greedy output. The chosen tiers go to the tuned file (fastspec.speculative.tuned) the engine loads automatically.
5. Honest choices (`rank`): a larger tree replaces a smaller one, and speculation replaces plain decoding, only when
   faster by more than the noise: MIN_MARGIN in the halving rounds (one run each), in the rematch the larger of
   MIN_MARGIN and the spread its own repeated runs showed. Each tier says why it was chosen (`why`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from fastspec.errors import FastspecError
from fastspec.sampling.params import SamplingParams
from fastspec.spec_config import SpecParams
from fastspec.tune.costs import CostModel
from fastspec.tune.replay import candidate_params, record, replay_tau

MIN_MARGIN = 0.03  # a smaller gain is a coin toss on a shared machine, however steady a few runs looked


@dataclass(frozen=True)
class TuneConfig:
    batch_sizes: tuple[int, ...] = (1, 4, 8)
    max_steps: int = 6
    topks: tuple[int, ...] = (1, 2, 4, 8)
    max_draft_tokens: int = 16
    max_new_tokens: int = 96
    confirm: int = 3  # speculative candidates per batch size confirmed end to end (plus plain)
    final_trials: int = 3  # full-length runs of the last shape and of plain, alternating; median decides
    budget: float = 600.0  # seconds; the end-to-end stage shrinks to fit

    @classmethod
    def for_device(cls, device: str, **fields) -> "TuneConfig":
        """On a GPU deeper and wider trees are candidates too: a captured verify of 16 or 32 nodes may cost what 8
        cost at small batches (the GEMMs are bound by reading the weights), so only measured costs can rule them
        out; on a CPU a verify's cost grows with its nodes from the first."""
        if str(device).startswith("cuda"):
            fields = {"max_steps": 8, "max_draft_tokens": 32} | fields
        return cls(**fields)


@dataclass
class Candidate:
    bs: int
    params: SpecParams | None  # None: no speculation
    tau: float  # replayed (1.0 for plain)
    predicted: float  # tok/s
    measured: float | None = None  # tok/s of the latest measurement (the final rematch's: the median of its runs)
    measured_tau: float | None = None  # tau of the run behind `measured` (the rematch's: its median run)
    measured_tokens: int | None = None  # new tokens per request of those runs (halving rounds run fewer)

    def row(self) -> dict:
        p = self.params
        return {"bs": self.bs, "params": None if p is None else [p.num_steps, p.topk, p.num_draft_tokens],
                "tau": round(self.tau, 3), "predicted_tok_s": round(self.predicted, 2),
                "measured_tok_s": None if self.measured is None else round(self.measured, 2),
                "measured_tau": None if self.measured_tau is None else round(self.measured_tau, 3),
                "measured_tokens": self.measured_tokens}


@dataclass
class TuneResult:
    winners: dict[int, Candidate]
    why: dict[int, str] = field(default_factory=dict)  # per batch size: the rematch's margin and verdict
    confirmed: list[Candidate] = field(default_factory=list)
    taus: dict[SpecParams, float] = field(default_factory=dict)  # replayed, every shape
    replay_seconds: float = 0.0
    cost_seconds: float = 0.0
    confirm_seconds: float = 0.0

    def tiers(self) -> list[dict]:
        return [{"max_batch_size": bs, **c.row()} | ({"why": self.why[bs]} if bs in self.why else {})
                for bs, c in sorted(self.winners.items())]


def tune(llm, prompts: list[list[int]], cfg: TuneConfig, say: Callable[[str], None] = lambda s: None) -> TuneResult:
    """`llm`: an EAGLE / EAGLE-3 fastspec.LLM built with the largest shape (cfg.max_steps, max topk, N)."""
    engine = llm.engine
    if engine.drafter is None or not hasattr(engine.drafter, "model"):
        raise FastspecError("fastspec tune needs an EAGLE or EAGLE3 draft head")
    started = time.perf_counter()
    grid = candidate_params(cfg.max_steps, cfg.topks, cfg.max_draft_tokens)
    say(f"greedy answers to {len(prompts)} prompts")
    plain_params = SamplingParams(max_new_tokens=cfg.max_new_tokens, ignore_eos=True)  # as the timed runs
    outputs = llm.generate(prompts, plain_params)
    say(f"replaying {len(grid)} tree shapes")
    recorded = [record(engine.model, engine.drafter.model, engine.drafter.hot_token_id, engine.feature,
                       o.prompt_ids, o.output_ids, grid) for o in outputs]
    taus = {p: _tau(*replay_tau(recorded, p)) for p in grid}
    replayed = time.perf_counter()
    context = sum(len(o.prompt_ids) + len(o.output_ids) / 2 for o in outputs) / len(outputs)
    costs = CostModel(engine, width=max(1, math.ceil(context)))
    host = _host_seconds(llm, prompts, cfg)
    ranked = {}
    for bs in cfg.batch_sizes:
        say(f"measuring round costs at batch size {bs}")
        plain = Candidate(bs, None, 1.0, bs / (costs.plain(bs) + host))
        spec = [Candidate(bs, p, taus[p], bs * taus[p] / (costs.round(p, bs).total + host)) for p in grid]
        ranked[bs] = [plain] + _diverse(sorted(spec, key=lambda c: -c.predicted), cfg.confirm)
    measured = time.perf_counter()
    result = TuneResult({}, taus=taus, replay_seconds=replayed - started, cost_seconds=measured - replayed)
    remaining = cfg.budget - (measured - started)
    if remaining <= 0:
        raise FastspecError(f"--budget {cfg.budget:g} s was spent before any tree shape could be confirmed end to "
                            f"end (replay and round costs took {measured - started:.2f} s): give a larger --budget")
    for bs in cfg.batch_sizes:
        say(f"confirming batch size {bs} end to end")
        winner, why = _halve(llm, prompts, bs, ranked[bs], cfg, remaining / len(cfg.batch_sizes), result.confirmed)
        _check_lossless(llm, prompts[:2], winner, outputs[:2], cfg)
        result.winners[bs], result.why[bs] = winner, why
    result.confirm_seconds = time.perf_counter() - measured
    if any(c.params for c in result.winners.values()):
        engine.use_schedule(schedule_from(result.winners))
    return result


def schedule_from(winners: dict[int, Candidate]):
    """Tiers: batch sizes up to each tuned size use its winner; larger batches the largest size's."""
    return tuple((bs, c.params) for bs, c in sorted(winners.items()))


def describe_schedule(schedule) -> str:
    """A schedule as `fastspec tune` prints it: ((1, SpecParams(3, 2, 5)), (4, None)) ->
    "bs <= 1: 3/2/5 · bs <= 4: plain (steps/topk/draft tokens; larger batches: the last)"."""
    tiers = " · ".join(f"bs <= {bs}: " + ("plain" if p is None else p.shape) for bs, p in schedule)
    return f"{tiers} (steps/topk/draft tokens; larger batches: the last)"


def complexity(c: Candidate) -> tuple[int, ...]:
    """Plain decoding first, then trees by draft tokens, steps and topk: what a tie keeps."""
    p = c.params
    return (0, 0, 0, 0) if p is None else (1, p.num_draft_tokens, p.num_steps, p.topk)


def rank(candidates: list[Candidate], margin: float) -> list[Candidate]:
    """Fastest measured first, where a candidate ranks above a simpler one (`complexity`) only when faster by more
    than `margin` (relative): the simplest of those within `margin` of the fastest left goes next.
    E.g. margin 0.03, plain 100 tok/s, 3/1/4 at 102 -> [plain, 3/1/4]; at 104 -> [3/1/4, plain]."""
    left, out = list(candidates), []
    while left:
        best = max(c.measured for c in left)
        pick = min((c for c in left if c.measured * (1 + margin) >= best), key=complexity)
        out.append(pick)
        left = [c for c in left if c is not pick]
    return out


def spread(rates: list[float]) -> float:
    """Run-to-run spread of repeated measurements of one candidate: (max - min) / median; 0 for a single run."""
    return (max(rates) - min(rates)) / statistics.median(rates) if len(rates) > 1 else 0.0


def verdict(spec: Candidate, plain: Candidate, margin: float) -> tuple[Candidate, str]:
    """(the rematch's winner, why): the tree only when faster than plain by more than `margin`."""
    winner = rank([spec, plain], margin)[0]
    gain = spec.measured / plain.measured - 1
    said = f"{spec.params.shape} {gain:+.1%} vs plain, noise margin {margin:.1%}"
    if winner is spec:
        return winner, f"{said}: faster beyond the noise"
    return winner, f"{said}: within noise, plain kept" if gain > 0 else f"{said}: plain is faster"


def _diverse(ranked: list[Candidate], n: int) -> list[Candidate]:
    """The n best predicted, at most one per num_draft_tokens while others are left, then the next best.

    Why: the predicted rates of shapes that share N differ by tau alone, but the cost model's error is mostly in
    how round time grows with N (host work per tree token is one measured constant), so the end-to-end stage
    must see more than one N: at bs 4 the top 3 were all N=7, measured 10% slower than an N=4 shape."""
    first, rest, seen = [], [], set()
    for c in ranked:
        (rest if c.params.num_draft_tokens in seen else first).append(c)
        seen.add(c.params.num_draft_tokens)
    return (first + rest)[:n]


def _tau(rounds: int, emitted: int) -> float:
    return emitted / rounds if rounds else 1.0


def _host_seconds(llm, prompts, cfg: TuneConfig) -> float:
    """Host time per speculative round (packing, acceptance, commit), from a short real run; not the draft's
    catch-up over the prompts (a phase of its own: a cost per prompt token, not per round)."""
    engine = llm.engine
    engine.times.reset()
    llm.generate(prompts[:2], SamplingParams(max_new_tokens=min(24, cfg.max_new_tokens)))
    split, rounds = engine.times.split(), engine.times.counts.get("round", 0)
    return split["host"] / rounds if rounds else 0.0


def _halve(llm, prompts, bs: int, candidates: list[Candidate], cfg: TuneConfig, budget: float,
           log: list[Candidate]) -> tuple[Candidate, str]:
    """Successive halving of the speculative shapes (the faster half by `rank` at MIN_MARGIN reruns with twice the
    tokens), then the survivor against plain decoding: `cfg.final_trials` alternating full-length runs each,
    compared by median at the larger of MIN_MARGIN and their spread (`verdict`). Returns (winner, why).

    Why a final rematch: one run on a shared CPU can vary by more than a weak head's gain, so a
    single short run could crown a shape slower than no speculation (or knock plain out early)."""
    tokens, start = max(8, cfg.max_new_tokens // 4), time.perf_counter()
    plain = next(c for c in candidates if c.params is None)
    spec = [c for c in candidates if c.params is not None]  # best predicted first
    batch = [prompts[i % len(prompts)] for i in range(bs)]
    while len(spec) > 1 and tokens < cfg.max_new_tokens and time.perf_counter() - start < budget / 2:
        for c in spec:
            c.measured, c.measured_tau = _run(llm, batch, c, tokens)
            c.measured_tokens = tokens
            log.append(replace(c))
        spec = rank(spec, MIN_MARGIN)[:max(1, len(spec) // 2)]
        tokens *= 2
    finalists = spec[:1] + [plain]
    runs: dict[int, list[tuple[float, float]]] = {id(c): [] for c in finalists}  # (tok/s, tau) per run
    for trial in range(cfg.final_trials):
        for c in finalists if trial % 2 == 0 else finalists[::-1]:
            runs[id(c)].append(_run(llm, batch, c, cfg.max_new_tokens))
    for c in finalists:
        c.measured = statistics.median(rate for rate, _ in runs[id(c)])
        c.measured_tau = statistics.median_low(runs[id(c)])[1]  # the median run's (the low one of an even count)
        c.measured_tokens = cfg.max_new_tokens
        log.append(replace(c))
    margin = max(MIN_MARGIN, *(spread([rate for rate, _ in runs[id(c)]]) for c in finalists))
    return verdict(finalists[0], plain, margin)


def _run(llm, batch, c: Candidate, tokens: int) -> tuple[float, float]:
    """(tok/s, tau) of `batch` run together under candidate c's shape (plain when c.params is None)."""
    engine = llm.engine
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    if c.params is None:
        engine.use_schedule(((len(batch), None), (1 << 30, engine.spec.tiers[0])))
    else:
        engine.use_schedule(((1 << 30, c.params),))
    start = time.perf_counter()
    outs = engine.generate(batch, [params] * len(batch))
    seconds = time.perf_counter() - start
    metrics = sum((o.metrics for o in outs[1:]), outs[0].metrics)
    return sum(len(o.output_ids) for o in outs) / seconds, metrics.tau if metrics.verify_rounds else 1.0


def _check_lossless(llm, prompts, winner: Candidate, expected, cfg: TuneConfig) -> None:
    if winner.params is None:
        return
    llm.engine.use_schedule(((1 << 30, winner.params),))
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens, ignore_eos=True)
    outs = llm.engine.generate(prompts, [params] * len(prompts))
    if [o.output_ids for o in outs] != [o.output_ids for o in expected]:
        raise FastspecError(f"tuned shape {winner.params} changed greedy output: please report this bug")
