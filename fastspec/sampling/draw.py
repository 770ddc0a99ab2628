"""Plain (non-speculative) token sampling from a batch's SamplingParams.

Sampling is inverse-CDF over explicit uniforms drawn from each request's own generator, so a seeded request
gives the same tokens whatever batch it runs in. Speculative acceptance lives in fastspec.speculative.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastspec.kernels import cpu_fused, top_k_renorm_prob, top_p_renorm_prob
from fastspec.sampling.params import SamplingParams
from fastspec.utils.transfer import to_device

TOP_K_ALL = 1 << 30


@dataclass(frozen=True)
class SamplingTensors:
    """A batch's sampling parameters as tensors; greedy rows carry temperature 1 and top_k 1."""

    temperature: torch.Tensor  # float32 [bs]
    top_k: torch.Tensor  # int64 [bs]
    top_p: torch.Tensor  # float32 [bs]

    @classmethod
    def from_params(cls, params: list[SamplingParams], device="cpu") -> SamplingTensors:
        temperature = [1.0 if p.greedy else p.temperature for p in params]
        top_k = [1 if p.greedy else (TOP_K_ALL if p.top_k == -1 else p.top_k) for p in params]
        return cls(
            temperature=to_device(temperature, device, torch.float32),
            top_k=to_device(top_k, device),
            top_p=to_device([p.top_p for p in params], device, torch.float32),
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


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           ) -> torch.Tensor:
    """logits [bs, V] float32 -> next tokens int64 [bs] under each request's params; all greedy: the argmax alone,
    no sampling tensors built."""
    if all(p.greedy for p in params):
        return cpu_fused.argmax(logits)
    sampling = SamplingTensors.from_params(params, logits.device)
    probs = target_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    return sample_from_probs(probs, draw_uniforms(generators, 1, logits.device)[:, 0])


def make_generator(seed: int | None, device="cpu") -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)
