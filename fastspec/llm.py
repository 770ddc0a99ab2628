"""The Python API: `fastspec.LLM(model=...).generate(prompts, params)` — text in, text out.

Owns tokenisation and chat templating around the engine (which speaks token ids only).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastspec.config import EngineConfig
from fastspec.engine import Engine
from fastspec.tokenizer import Tokenizer
from fastspec.sampling import SamplingParams


@dataclass(frozen=True)
class Completion:
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str


class LLM:
    def __init__(self, model: str = EngineConfig.model, **engine_options):
        self.engine = Engine(EngineConfig(model=model, **engine_options))
        self.tokenizer = Tokenizer(self.engine.model_dir)

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
        return [Completion(o.prompt_ids, o.output_ids, self.decode(o.output_ids), o.finish_reason) for o in outputs]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
