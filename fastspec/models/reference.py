"""transformers' own model of a directory fastspec reads: the independent reference the tests and benches compare
fastspec against. A converted GGUF keeps its block matrices as blocks only (no float copy on disk), so its weights
come through fastspec's loader (read_state_dict dequantises them); every other tensor is read as stored.
Not used to serve: fastspec's models are its own (fastspec.models.causal_lm).
"""

from __future__ import annotations

from pathlib import Path

import torch

from fastspec.models.loader import read_state_dict


def transformers_model(model_dir: Path, dtype: torch.dtype = torch.float32):
    """AutoModelForCausalLM of `model_dir` in `dtype`, eval mode, every weight loaded (a tied lm_head by tying)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype).eval()
    state = {name: t.to(dtype) for name, t in read_state_dict(Path(model_dir)).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"} or (missing and not model.config.tie_word_embeddings):
        raise ValueError(f"{model_dir}: weights do not match transformers' model (missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(unexpected)[:3]})")
    return model
