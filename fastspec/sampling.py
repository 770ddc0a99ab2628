"""Per-request sampling parameters and plain (non-speculative) token sampling.

Sampling is inverse-CDF over explicit uniforms drawn from each request's own generator, so a seeded request
gives the same tokens whatever batch it runs in. Speculative acceptance lives in fastspec.speculative.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fastspec.errors import FastspecError
from fastspec.grammar import KINDS, normalise_schema
from fastspec.kernels import top_k_renorm_prob, top_p_renorm_prob
from fastspec.transfer import to_device

TOP_K_ALL = 1 << 30


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = -1  # -1 = whole vocabulary
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # report the target's logprob of each output token and of its top-n alternatives
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and output (fastspec.controls)
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    presence_penalty: float = 0.0  # subtracted once if the token occurs in the output
    min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); a dict is accepted too
    json_schema: str | None = None  # structured output (fastspec.grammar), at most one: a JSON schema (a dict too),
    regex: str | None = None  # a regular expression the whole output matches,
    ebnf: str | None = None  # or a GBNF grammar (llama.cpp's / xgrammar's EBNF: `root ::= ...`)

    def __post_init__(self):
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise FastspecError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise FastspecError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise FastspecError(f"top-k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise FastspecError(f"max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop):
            raise FastspecError("stop strings must not be empty")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise FastspecError(f"repetition penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise FastspecError(f"{name.replace('_', ' ')} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 <= self.min_p <= 1:
            raise FastspecError(f"min-p must be in [0, 1], got {self.min_p}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((t, float(v)) for t, v in bias)))  # hashable
        if any(not isinstance(t, int) or t < 0 or not math.isfinite(v) for t, v in self.logit_bias):
            raise FastspecError("logit bias must map token ids >= 0 to finite numbers")
        self._check_grammar()
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise FastspecError(f"logprobs must be in [0, 20] (top alternatives per token), got {self.logprobs}")

    def _check_grammar(self) -> None:
        kinds = [k for k in KINDS if getattr(self, k) is not None]
        if len(kinds) > 1:
            raise FastspecError(f"one grammar per request: {' and '.join(kinds)} are both set")
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", normalise_schema(self.json_schema))
        if kinds and self.ignore_eos:
            raise FastspecError(f"ignore-eos with a {kinds[0].replace('_', ' ')}: the grammar ends the output at EOS")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass(frozen=True)
class SamplingTensors:
    """A batch's sampling parameters as tensors; greedy rows carry temperature 1 and top_k 1."""

    temperature: torch.Tensor  # float32 [bs]
    top_k: torch.Tensor  # int64 [bs]
    top_p: torch.Tensor  # float32 [bs]
    all_greedy: bool

    @classmethod
    def from_params(cls, params: list[SamplingParams], device="cpu") -> SamplingTensors:
        temperature = [1.0 if p.greedy else p.temperature for p in params]
        top_k = [1 if p.greedy else (TOP_K_ALL if p.top_k == -1 else p.top_k) for p in params]
        return cls(
            temperature=to_device(temperature, device, torch.float32),
            top_k=to_device(top_k, device),
            top_p=to_device([p.top_p for p in params], device, torch.float32),
            all_greedy=all(p.greedy for p in params),
        )


def target_probs(logits: torch.Tensor,       # [bs*n, V]
                 temperature: torch.Tensor,  # float [bs]  0 = greedy
                 top_k: torch.Tensor,        # int [bs]  <= 0 or >= V: off
                 top_p: torch.Tensor,        # float [bs]  1 = off
                 rows_per_request: int = 1) -> torch.Tensor:  # float32 [bs*n, V]
    """softmax(logits / T) -> top-k renorm -> top-p renorm; temperature-0 rows become one-hot (top_k 1).
    top-p is applied unconditionally: rows with top_p >= 1 pass through exactly, so no host check."""
    greedy = temperature <= 0
    temperature = torch.where(greedy, 1.0, temperature.to(torch.float32)).repeat_interleave(rows_per_request)
    top_k = torch.where(greedy, 1, top_k.to(torch.int64)).repeat_interleave(rows_per_request)
    probs = torch.softmax(logits.to(torch.float32) / temperature[:, None], -1)
    probs = top_k_renorm_prob(probs, top_k)
    return top_p_renorm_prob(probs, top_p.to(torch.float32).repeat_interleave(rows_per_request))


def draw_uniforms(generators: list[torch.Generator | None], n: int, device="cpu") -> torch.Tensor:
    """[bs, n] float32 uniforms, row b from request b's generator (the global one when None)."""
    return torch.stack([torch.rand(n, generator=g, device=device) for g in generators])


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: the first token whose cumulative probability exceeds u * total. probs [bs, V], u [bs]."""
    cdf = probs.cumsum(-1)
    u = uniforms * cdf[:, -1]
    return torch.searchsorted(cdf, u[:, None], right=True).clamp_(max=probs.shape[-1] - 1).squeeze(1)


def sample(logits: torch.Tensor, sampling: SamplingTensors, generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits [bs, V] float32 -> next tokens int64 [bs]."""
    if sampling.all_greedy:
        return logits.argmax(-1)
    probs = target_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    return sample_from_probs(probs, draw_uniforms(generators, 1, logits.device)[:, 0])


def make_generator(seed: int | None, device="cpu") -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)
