"""The rope scaling a GGUF file describes, as Hugging Face's `rope_scaling`: linear and YaRN (with its attn_factor)
from its metadata keys, Llama 3's from the per-frequency divisors of its rope_freqs tensor (fitted, then checked
against every divisor).
Phi-3's LongRoPE factor tensors are named here so the conversion can refuse them.
"""

import math

import numpy as np
import torch

from fastspec.errors import FastspecError
from fastspec.models.model_config import RopeScaling
from fastspec.models.rope import rope_inv_freq, yarn_mscale

ROPE_FACTORS = "rope_freqs.weight"  # Llama 3's per-frequency divisors: read into the config's rope scaling
LONGROPE = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3 128k / Phi-3.5 / Phi-4-mini


def f32(value: float) -> float:
    """GGUF stores floats as float32; keep the short decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def rope_scaling(m, factors: torch.Tensor | None, head_dim: int, theta: float) -> dict | None:
    """HF's rope_scaling for a GGUF whose `{arch}.` keys m(key, default) reads: linear or YaRN as its metadata says,
    Llama 3's from its rope_freqs `factors` ([head_dim / 2], or None)."""
    kind = "llama3" if factors is not None else m("rope.scaling.type", "none")
    attn_factor = f32(m("rope.scaling.attn_factor", 1.0))  # llama.cpp's factor on the cos / sin of any rope
    if attn_factor != 1.0 and kind != "yarn":
        raise FastspecError(f"GGUF rope.scaling.attn_factor {attn_factor} without YaRN is not supported")
    if kind == "llama3":
        return llama3_scaling(factors, head_dim, theta)
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": f32(m("rope.scaling.factor"))}
    if kind == "yarn":
        factor = f32(m("rope.scaling.factor"))
        scaling = {"rope_type": "yarn", "factor": factor,
                   "original_max_position_embeddings": m("rope.scaling.original_context_length")}
        if attn_factor != 1.0:  # llama.cpp multiplies YaRN's own scale by it; HF's attention_factor replaces that
            scaling["attention_factor"] = attn_factor * yarn_mscale(factor)
        return scaling
    raise FastspecError(f"GGUF rope scaling '{kind}' is not supported (supported: linear, yarn, llama3)")


def llama3_scaling(factors: torch.Tensor, head_dim: int, theta: float) -> dict | None:  # factors [head_dim / 2]
    """Llama 3's rope scaling from llama.cpp's divisors of each inverse frequency. `factor` is the largest divisor;
    between the kept and the fully slowed frequencies 1 / divisor = (1 - s) / factor + s with s linear in
    1 / wavelength, so two or more divisors strictly between 1 and `factor` give the blend's edges (as fractions of an
    original length of 8192: only their ratios matter), fewer keep Llama 3's 1 / 4. None when nothing is slowed;
    refused unless the result reproduces every divisor."""
    factor = float(factors.max())
    if factor <= 1 + 1e-6:
        return None
    wavelen = 2 * math.pi / rope_inv_freq(head_dim, theta, None).double()
    middle = (factors > 1 + 1e-5) & (factors < factor * (1 - 1e-5))
    low, high = 1.0, 4.0
    if int(middle.sum()) >= 2:
        s = (1 / factors[middle].double() - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit((1 / wavelen[middle]).numpy(), s.numpy(), 1)  # s = 8192 / (w span) - low / span
        span = 8192 / slope
        low = round(float(-intercept * span), 6)
        high = round(low + float(span), 6)
    scaling = RopeScaling("llama3", f32(factor), low, high, 8192)
    rebuilt = rope_inv_freq(head_dim, theta, None) / rope_inv_freq(head_dim, theta, scaling)
    if not torch.allclose(rebuilt, factors, rtol=1e-4, atol=0):
        raise FastspecError(f"GGUF {ROPE_FACTORS} is not Llama 3's rope scaling (no factor, low / high frequency "
                            "factors reproduce it)")
    return {"rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": 8192}
