"""A static step function run eagerly at exact shapes, or through GraphRunners keyed by committed-KV width.

Graph modes need every shape fixed: the batch dimension is padded to a bucket by GraphRunner, the KV width
is rounded up to a multiple of packing.KV_BUCKET here, one runner per width, prepared on first use.
"""

from __future__ import annotations

from collections.abc import Callable

from fastspec.graphs import GraphRunner, StaticInput


class StepGraphs:
    def __init__(self, name: str, fn: Callable[[dict], dict], specs: Callable[[int], list[StaticInput]],
                 mode: str, buckets: list[int], device, on_prepare: Callable[[str, int], None] | None = None,
                 times=None, phase: str = ""):
        """times(phase) (a metrics.PhaseTimes) times each call; preparing graphs is not counted."""
        self.name, self.fn, self.specs, self.mode = name, fn, specs, mode
        self.times, self.phase = times, phase
        self.buckets, self.device, self.on_prepare = buckets, device, on_prepare
        self.runners: dict[int, GraphRunner] = {}
        self.pool = None  # cuda: one memory pool shared by every width's graphs

    @property
    def bucketed(self) -> bool:
        return self.mode != "eager"

    def runner(self, width: int) -> GraphRunner:
        if width not in self.runners:
            runner = GraphRunner(f"{self.name} (kv {width})", self.fn, self.specs(width), self.buckets, self.mode,
                                 self.device, pool=self.pool)
            runner.prepare(self.on_prepare)
            self.pool = runner.pool
            self.runners[width] = runner
        return self.runners[width]

    def __call__(self, bs: int, inputs: dict, width: int) -> dict:
        if self.mode == "eager" or bs > self.buckets[-1]:  # past the largest bucket: eager, as SGLang does
            with self.times(self.phase):
                return self.fn(inputs)
        runner = self.runner(width)
        with self.times(self.phase):
            outputs = runner.run(bs, inputs)
            return {k: v.clone() for k, v in outputs.items()}  # graph-owned memory: overwritten by the next replay
