"""A static step function run eagerly at exact shapes, or through GraphRunners keyed by committed-KV width.

Graph modes need every shape fixed: the batch dimension is padded to a bucket by GraphRunner, the KV width
is rounded up to a multiple of packing.KV_BUCKET here, one runner per width. Buckets are prepared lazily, the
first time a batch needs one (outside the phase timing), or all ahead of time when the plan says so (explicit
buckets on the command line). In compile mode the KV width is a dynamic dim, so every width shares one compile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastspec.graphs import GraphRunner, StaticInput

AHEAD_WIDTH = 256  # the width prepared ahead of time: the first committed-KV bucket every request passes through


@dataclass(frozen=True)
class GraphPlan:
    """How the round functions run: mode (cuda | compile | eager), batch buckets, and when buckets are prepared."""

    mode: str
    buckets: tuple[int, ...]
    device: str
    ahead: bool = False  # prepare every bucket up front (and for each new KV width), not on first use
    on_prepare: Callable[[str, int], None] | None = None  # called before a bucket is captured / compiled


class StepGraphs:
    def __init__(self, name: str, fn: Callable[[dict], dict], specs: Callable[[int], list[StaticInput]],
                 plan: GraphPlan, times=None, phase: str = ""):
        """times(phase) (a metrics.PhaseTimes) times each call; preparing graphs is not counted."""
        self.name, self.fn, self.specs, self.plan = name, fn, specs, plan
        self.times, self.phase = times, phase
        self.runners: dict[int, GraphRunner] = {}
        self.compiled: dict = {}  # compile: {bucket: compiled fn}, shared by every width (the width is dynamic)
        self.pool = None  # cuda: one memory pool shared by every width's graphs
        if plan.ahead and self.bucketed:
            self.runner(AHEAD_WIDTH)

    @property
    def bucketed(self) -> bool:
        return self.plan.mode != "eager"

    def runner(self, width: int) -> GraphRunner:
        if width not in self.runners:
            plan = self.plan
            name = self.name if plan.mode == "compile" else f"{self.name} (kv {width})"
            runner = GraphRunner(name, self.fn, self.specs(width), list(plan.buckets), plan.mode, plan.device,
                                 pool=self.pool, compiled=self.compiled, on_bucket=plan.on_prepare)
            if plan.mode == "cuda" and self.pool is None:  # the runner checked the device first
                self.pool = runner.pool = torch.cuda.graph_pool_handle()
            if plan.ahead:
                runner.prepare()
            self.runners[width] = runner
        return self.runners[width]

    def __call__(self, bs: int, inputs: dict, width: int) -> dict:
        if self.plan.mode == "eager" or bs > self.plan.buckets[-1]:  # past the largest bucket: eager, as SGLang
            with self.times(self.phase):
                return self.fn(inputs)
        runner = self.runner(width)
        runner.prepare(buckets=[bs])  # a no-op once prepared; outside the timing
        with self.times(self.phase):
            outputs = runner.run(bs, inputs)
            return {k: v.clone() for k, v in outputs.items()}  # graph-owned memory: overwritten by the next replay
