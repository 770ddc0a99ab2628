"""Plain (non-speculative) token sampling from a batch's SamplingParams, and the uniforms every draw uses.

Sampling is inverse-CDF over a uniform that is a function of the request's seed and the position of the token
drawn (`position_uniforms`: a counter-based hash, no generator state). So a seeded request gives the same tokens
whatever batch it runs in, and speculative verification, which draws each tree node's token with its position's
uniform (fastspec.speculative.tree.verify_sampling), emits what plain sampling emits. Speculative acceptance
lives in fastspec.speculative.
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
    """softmax(logits / T) -> top-k renorm -> top-p renorm; temperature-0 rows become one-hot (top_k 1), +inf
    logits the largest float32.
    top-p is applied unconditionally: rows with top_p >= 1 pass through exactly, so no host check."""
    greedy = temperature <= 0
    temperature = torch.where(greedy, 1.0, temperature.to(torch.float32)).repeat_interleave(rows_per_request)
    top_k = torch.where(greedy, 1, top_k.to(torch.int64)).repeat_interleave(rows_per_request)
    scaled = logits.to(torch.float32) / temperature[:, None]
    # a logit past float32's range (a huge bias, or divided by a small temperature) is inf, and inf - inf would make
    # the row NaN: at float32's largest value its token takes all the mass, as in the limit
    probs = torch.softmax(scaled.clamp(max=torch.finfo(torch.float32).max), -1)
    probs = top_k_renorm_prob(probs, top_k)
    return top_p_renorm_prob(probs, top_p.to(torch.float32).repeat_interleave(rows_per_request))


M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> a bijective 32-bit mix of each (xor-shift-multiply; odd multipliers below 2^31,
    so no product passes 2^63)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & M32
    return x ^ (x >> 16)


def position_uniforms(seeds: torch.Tensor,      # int64 [bs]  each request's seed (any 64-bit value)
                      positions: torch.Tensor,  # int64 [bs, m]  positions of the tokens drawn (< 2^32)
                      ) -> torch.Tensor:        # float32 [bs, m] in [0, 1), multiples of 2^-24
    """The uniform that draws the token at each position: a hash of (seed, position), the same on every device,
    in any batch and under any schedule; elementwise tensor ops (no host sync: safe inside a captured graph)."""
    key = _mix32(_mix32(seeds & M32) ^ ((seeds >> 32) & M32))[:, None]  # [bs, 1]: the seed's 32-bit digest
    h = _mix32(((positions & M32) * 0x61C88647 & M32) ^ key)
    h = _mix32(h ^ key)
    return (h >> 8).to(torch.float32) * 2.0**-24


def request_seed(seed: int | None) -> int:
    """A request's seed: its own, or one drawn from torch's global generator (torch.manual_seed fixes it)."""
    return seed if seed is not None else int(torch.randint(0, 2**62, ()))


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: the first token whose cumulative probability exceeds u * total. probs [bs, V], u [bs]."""
    cdf = probs.cumsum(-1)
    u = uniforms * cdf[:, -1]
    return torch.searchsorted(cdf, u[:, None], right=True).clamp_(max=probs.shape[-1] - 1).squeeze(1)


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int],
           ) -> torch.Tensor:
    """logits [bs, V] float32 -> next tokens int64 [bs] under each request's params, row b drawn with the uniform
    of (seeds[b], positions[b]) (the position of the token drawn); all greedy: the argmax alone, no sampling
    tensors built."""
    if all(p.greedy for p in params):
        return cpu_fused.argmax(logits)
    sampling = SamplingTensors.from_params(params, logits.device)
    probs = target_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    uniforms = position_uniforms(to_device(seeds, logits.device), to_device(positions, logits.device)[:, None])
    return sample_from_probs(probs, uniforms[:, 0])
