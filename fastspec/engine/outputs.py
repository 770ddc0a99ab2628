"""What the engine hands back: a step's output per request, a whole generation's, the engine's load, and `collect`,
which gathers a stream of steps per request."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from fastspec.sampling.params import SamplingParams
from fastspec.utils.metrics import SpecMetrics


@dataclass(frozen=True)
class StepOutput:
    index: int  # the request's position in the submitted list
    new_ids: list[int]  # tokens emitted by this step (several per speculative round)
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    metrics: SpecMetrics
    logprobs: tuple | None = None  # TokenLogprob per new id, when the request asked for them


@dataclass(frozen=True)
class EngineLoad:
    """What the engine held after its last step (read by other threads: a server's /metrics)."""

    running: int  # requests in the running batch
    waiting: int  # requests queued for admission
    free_kv: int  # free KV slots, counting what the prefix cache would give back and the room the pool may grow by


@dataclass(frozen=True)
class GenerateOutput:
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    metrics: SpecMetrics
    logprobs: list | None = None  # TokenLogprob per output id, when the request asked for them


def collect(steps: Iterator[list], params: list[SamplingParams]) -> tuple[dict, dict, dict]:
    """A stream's steps (each output with index, new_ids, logprobs, finish_reason) gathered per request:
    (token ids, logprobs or None when not asked for, the finishing output), each keyed by request index."""
    outputs = {i: [] for i in range(len(params))}
    logprobs = {i: [] if p.logprobs is not None else None for i, p in enumerate(params)}
    final = {}
    for step in steps:
        for out in step:
            outputs[out.index].extend(out.new_ids)
            if out.logprobs is not None:
                logprobs[out.index].extend(out.logprobs)
            if out.finish_reason is not None:
                final[out.index] = out
    return outputs, logprobs, final
