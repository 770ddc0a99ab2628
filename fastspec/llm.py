"""The Python API: `fastspec.LLM(model=...).generate(prompts, params)` — text in, text out.

Owns tokenisation and chat templating around the engine (which speaks token ids only).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from fastspec.config import EngineConfig, SpecConfig
from fastspec.engine import Engine
from fastspec.metrics import SpecMetrics
from fastspec.models.loader import read_config, resolve_model_dir
from fastspec.tokenizer import Tokenizer
from fastspec.sampling import SamplingParams


@dataclass(frozen=True)
class Completion:
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str
    metrics: SpecMetrics


class LLM:
    def __init__(self, model: str = EngineConfig.model, speculative_algorithm: str | None = None,
                 draft_model: str | None = None, num_steps: int | None = None, topk: int | None = None,
                 num_draft_tokens: int | None = None, accept_threshold_single: float = 1.0,
                 accept_threshold_acc: float = 1.0, token_map: str | None = None, ngram=None, on_prepare=None,
                 **engine_options):
        """`speculative_algorithm`: NONE (default), EAGLE (alias NEXTN), EAGLE3, STANDALONE or NGRAM; unset
        num_steps / topk / num_draft_tokens follow SGLang's per-architecture defaults."""
        target_arch = read_config(resolve_model_dir(model)).architecture
        spec = SpecConfig.resolve(speculative_algorithm, target_arch, draft_model=draft_model, num_steps=num_steps,
                                  topk=topk, num_draft_tokens=num_draft_tokens, token_map=token_map,
                                  accept_threshold_single=accept_threshold_single,
                                  accept_threshold_acc=accept_threshold_acc, ngram=ngram)
        self.engine = Engine(EngineConfig(model=model, **engine_options), spec, on_prepare)

    @cached_property
    def tokenizer(self) -> Tokenizer:
        """Loaded on first use: token-id prompts need none (tiny test models ship no tokenizer)."""
        return Tokenizer(self.engine.model_dir)

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if not chat:
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return self.encode_chat([{"role": "user", "content": prompt}])

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.encode_chat(messages)

    def generate(self, prompts: str | list[str] | list[list[int]], params: SamplingParams | list[SamplingParams]
                 = SamplingParams(), chat: bool = False) -> list[Completion]:
        """Prompts as text (optionally chat-templated) or as token-id lists; one SamplingParams or one each."""
        if isinstance(prompts, str):
            prompts = [prompts]
        ids = [p if isinstance(p, list) else self.encode(p, chat) for p in prompts]
        params = params if isinstance(params, list) else [params] * len(ids)
        outputs = self.engine.generate(ids, params)
        return [Completion(o.prompt_ids, o.output_ids, self.decode(o.output_ids), o.finish_reason, o.metrics)
                for o in outputs]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
