"""transformers' own model of a directory fastspec reads: the independent reference the tests and benches compare
fastspec against. A converted GGUF keeps its block matrices as blocks only (no float copy on disk), so its weights
come through fastspec's loader (read_state_dict dequantises them); every other tensor is read as stored. Per-expert
MoE weights (a converted GGUF's, transformers 4's) are stacked as transformers 5 keeps them ([E, 2I, H] gate_up).
Not used to serve: fastspec's models are its own (fastspec.models.causal_lm).
"""

from __future__ import annotations

from pathlib import Path

import torch

from fastspec.models.loader import read_state_dict, renamed
from fastspec.models.moe import stack_experts


def transformers_model(model_dir: Path, dtype: torch.dtype = torch.float32):
    """AutoModelForCausalLM of `model_dir` in `dtype`, eval mode, every weight loaded (a tied lm_head by tying)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype).eval()
    state = {name: t.to(dtype) for name, t in read_state_dict(Path(model_dir)).items()}
    if any(name.endswith(".experts.gate_up_proj") for name in model.state_dict()):
        state = _stacked_experts(state)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"} or (missing and not model.config.tie_word_embeddings):
        raise ValueError(f"{model_dir}: weights do not match transformers' model (missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(unexpected)[:3]})")
    return model


def _stacked_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert weights (Mixtral's block_sparse_moe / w1 w3 w2 names too) as transformers 5's stacked experts:
    gate_up_proj [E, 2I, H] (gate first), down_proj [E, H, I]."""
    state = stack_experts(renamed(state))
    for gate in [name for name in state if name.endswith(".experts.gate_proj")]:
        prefix = gate.removesuffix("gate_proj")
        state[f"{prefix}gate_up_proj"] = torch.cat([state.pop(gate), state.pop(f"{prefix}up_proj")], 1)
    return state
