"""What fastspec.LLM hands back: a Completion per prompt from generate / chat, TextDeltas from stream. A name of
vLLM's RequestOutput / CompletionOutput read on a Completion is an AttributeError naming fastspec's own."""

from __future__ import annotations

from dataclasses import dataclass

from fastspec.errors import no_attribute
from fastspec.utils.metrics import SpecMetrics


@dataclass(frozen=True)
class TextDelta:
    index: int  # which prompt
    text: str | None  # new text safe to show (None: token-id prompts to a model without a tokenizer)
    finish_reason: str | None
    metrics: SpecMetrics
    new_ids: list[int]
    kept_tokens: int | None  # after a stop string: how many output tokens the kept text covers
    logprobs: tuple | None = None  # TokenLogprob per new id, when asked for
    prompt_logprobs: tuple | None = None  # TokenLogprob per prompt token after the first: with the first tokens


# vLLM's RequestOutput and CompletionOutput fields that a Completion spells otherwise or does not have
VLLM_FIELDS = {
    "outputs": "a Completion is its prompt's one answer (vLLM's .outputs[0]): read .text, .output_ids, .finish_reason",
    "token_ids": "use output_ids", "prompt_token_ids": "use prompt_ids",
    "prompt": "the prompt is kept as its tokens: prompt_ids", "stop_reason": "finish_reason says stop, length or abort",
    "cumulative_logprob": "sum the logprob of each of .logprobs (SamplingParams(logprobs=0) asks for them)",
    "finished": "a Completion is always finished (finish_reason: stop, length or abort)",
    "request_id": "completions come back in the order of their prompts", "index": "one answer per prompt, in order",
}


@dataclass(frozen=True)
class Completion:
    prompt_ids: list[int]
    output_ids: list[int]  # the text's tokens (after a stop string: the fewest whose decode holds the text kept)
    text: str | None  # None: token-id prompts to a model without a tokenizer
    finish_reason: str
    metrics: SpecMetrics
    logprobs: list | None = None  # TokenLogprob per output id (the target's), when SamplingParams.logprobs is set
    prompt_logprobs: tuple | None = None  # TokenLogprob per prompt token after the first, when asked for

    def __getattr__(self, name: str):
        raise no_attribute(self, name, VLLM_FIELDS)
