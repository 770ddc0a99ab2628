"""A static step function run eagerly at exact shapes, or through one GraphRunner keyed by batch bucket.

Graph modes need every shape fixed: the batch dimension is padded to a bucket by GraphRunner; there is no KV
width (attention reads each request's committed KV through its table row and length: fastspec.attention.paged),
so one capture / compile per bucket serves every context length. Buckets are prepared lazily, the first time a
batch needs one (outside the phase timing), or all ahead of time when the plan says so (explicit buckets on the
command line).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastspec.graphs import GraphRunner, StaticInput


@dataclass(frozen=True)
class GraphPlan:
    """How the round functions run: mode (cuda | compile | eager), batch buckets, and when buckets are prepared."""

    mode: str
    buckets: tuple[int, ...]
    device: str
    ahead: bool = False  # prepare every bucket up front, not on first use
    on_prepare: Callable[[str, int], None] | None = None  # called before a bucket is captured / compiled


class StepGraphs:
    def __init__(self, name: str, fn: Callable[[dict], dict], specs: list[StaticInput], plan: GraphPlan,
                 times=None, phase: str = "", persist: tuple[str, ...] | None = None):
        """times(phase) (a metrics.PhaseTimes) times each call; preparing graphs is not counted. `persist`: the
        outputs kept past the next run of this function (None: all), copied out of the graph's memory, which the
        next replay overwrites; the others are read before it (a copy each is a launch per round saved)."""
        self.name, self.fn, self.plan, self.persist = name, fn, plan, persist
        self.times, self.phase = times, phase
        self.runner = None if plan.mode == "eager" else GraphRunner(
            name, fn, specs, list(plan.buckets), plan.mode, plan.device, on_bucket=plan.on_prepare)
        if plan.ahead and self.runner is not None:
            self.runner.prepare()

    def __call__(self, bs: int, inputs: dict) -> dict:
        if self.runner is None or bs > self.plan.buckets[-1]:  # past the largest bucket: eager, as SGLang
            with self.times(self.phase):
                return self.fn(inputs)
        self.runner.prepare(buckets=[bs])  # a no-op once prepared; outside the timing
        with self.times(self.phase):
            outputs = self.runner.run(bs, inputs)
            return {k: v.clone() if self.persist is None or k in self.persist else v for k, v in outputs.items()}
