"""`--load-format dummy`: random weights drawn on the device in the model's dtype from config.json alone, so a
model directory holding only its config (a Llama-3.1-8B shape, say) runs for benchmarks with nothing downloaded.

The engine's config passes the format to the loader (`load_target` / `load_draft`, load_format="dummy"). Targets
are always random under dummy; an EAGLE head is random only when its directory holds no weight files. The text
such a model writes is noise: it measures speed, never quality. Nothing here reads or writes a weight file.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from fastspec.models.layers import OffsetRMSNorm

SEED = 0  # every dummy load draws the same weights


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype | None):
    """Parameters built inside take `dtype` directly (an 8B model never exists in float32 on the device);
    None changes nothing."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype or saved)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def fill_random(model: nn.Module, std: float, skip: tuple[str, ...] = (), seed: int = SEED) -> None:
    """Every matrix ~ N(0, std) from one generator seeded with `seed`, in parameter order (two loads of a config
    give the same weights); biases 0; norms at the identity (weight 1, or 0 for offset norms); other vectors
    as their constructor made them. Parameters under a `skip` prefix (shared with the target) are left alone."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(skip):
                continue
            owner = model.get_submodule(name.rpartition(".")[0])
            if p.ndim >= 2:
                gen = generators.setdefault(p.device, torch.Generator(p.device).manual_seed(seed))
                p.normal_(0.0, std, generator=gen)
            elif name.endswith(".bias") or isinstance(owner, OffsetRMSNorm):
                p.zero_()
