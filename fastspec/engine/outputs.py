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
    prompt_logprobs: tuple | None = None  # TokenLogprob per prompt token after the first: on its first tokens' output


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
    prompt_logprobs: tuple | None = None  # TokenLogprob per prompt token after the first, when asked for


@dataclass(frozen=True)
class Collected:
    """A stream's steps gathered per request, each keyed by request index."""

    ids: dict[int, list[int]]  # the output token ids
    logprobs: dict[int, list | None]  # TokenLogprob per output id, None when not asked for
    prompt_logprobs: dict[int, tuple | None]  # TokenLogprob per prompt token after the first, None when not given
    final: dict[int, object]  # the finishing output


def collect(steps: Iterator[list], params: list[SamplingParams]) -> Collected:
    """A stream's steps (each output with index, new_ids, logprobs, prompt_logprobs, finish_reason) per request."""
    got = Collected({i: [] for i in range(len(params))},
                    {i: [] if p.logprobs is not None else None for i, p in enumerate(params)},
                    dict.fromkeys(range(len(params))), {})
    for step in steps:
        for out in step:
            got.ids[out.index].extend(out.new_ids)
            if out.logprobs is not None:
                got.logprobs[out.index].extend(out.logprobs)
            if out.prompt_logprobs is not None:
                got.prompt_logprobs[out.index] = out.prompt_logprobs
            if out.finish_reason is not None:
                got.final[out.index] = out
    return got
