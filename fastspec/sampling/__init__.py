"""Sampling: per-request parameters (params), token draws (draw), penalties / bias / min_p (controls), the
target's logprobs (logprobs) and structured output (grammar). The package's face is `SamplingParams`."""

from fastspec.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
