"""Loading a draft head: an EAGLE-2 or EAGLE-3 checkpoint (SGLang / SpecForge key format; an EAGLE-1 head published
under its target's architecture read as the head it is) built beside its target, sharing the target's embedding /
lm_head where it fits, and FR-Spec token maps. Every failure a user can cause becomes a one-line FastspecError.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fastspec.errors import FastspecError, first_line
from fastspec.models.causal_lm import CausalLM, eagle3_capture_layers
from fastspec.models.dummy import default_dtype, fill_random
from fastspec.models.eagle import LlamaForCausalLMEagle, LlamaForCausalLMEagle3
from fastspec.models.loader import (cast_own, load_into, read_config, read_state_dict, skip_init, weight_files,
                                    weight_names)
from fastspec.models.model_config import LLAMA_FAMILY, ModelConfig


def read_draft_config(draft_dir: Path, algorithm: str | None) -> ModelConfig:
    """The draft's config. A head published under a target's architecture (EAGLE-1's `LlamaForCausalLM`) whose
    weights are an EAGLE head's (`fc` beside `layers.0.*`) or an EAGLE-3 head's (`midlayer.*` or `d2t`) is read as
    that head when `algorithm` asks for one."""
    config = read_config(draft_dir)
    if config.is_draft or algorithm not in ("EAGLE", "EAGLE3") or config.architecture not in LLAMA_FAMILY:
        return config
    names = {n.removeprefix("model.") for n in weight_names(draft_dir)} if weight_files(draft_dir) else set()
    if "fc.weight" not in names:
        return config
    if "d2t" in names or any(n.startswith("midlayer.") for n in names):
        kind = "LlamaForCausalLMEagle3"
    elif any(n.startswith("layers.0.") for n in names) and not any(n.startswith("layers.1.") for n in names):
        kind = "LlamaForCausalLMEagle"
    else:
        return config
    raw = json.loads((draft_dir / "config.json").read_text())
    return ModelConfig.from_hf(raw | {"architectures": [kind]}, source=str(draft_dir / "config.json"))


def load_draft(draft_dir: Path, target: CausalLM, dtype: torch.dtype, device="cpu",
               token_map: Path | None = None, load_format: str = "auto", config: ModelConfig | None = None
               ) -> LlamaForCausalLMEagle | LlamaForCausalLMEagle3:
    """An EAGLE-2 or EAGLE-3 head that fits `target` (checked), sharing its embedding / lm_head; `config`: the
    head's as read_draft_config reads it (default: its config.json). With load_format dummy (see load_target) a
    head directory without weight files gets random weights; one with them loads them."""
    config = config or read_config(draft_dir)
    check_draft_fits(config, target.config, str(draft_dir))
    dummy = load_format == "dummy" and not weight_files(draft_dir)
    state = {} if dummy else {draft_key(k, config): v for k, v in read_state_dict(draft_dir).items()}
    with skip_init(), torch.device(device), default_dtype(dtype if dummy else None):
        if config.is_eagle3:
            model, skip = _build_eagle3(config, target)
        else:
            hot = load_token_map(token_map, target.config.vocab_size).to(device) if token_map else None
            model = LlamaForCausalLMEagle(config, target.model.embed_tokens, target.lm_head.weight, hot)
            skip = ("embed_tokens.", "lm_head.")
        model = cast_own(model, dtype, target)
    if config.is_eagle3:
        model.d2t.zero_()
        state.setdefault("d2t", model.d2t)
    if dummy:
        fill_random(model, config.initializer_range, skip)
    else:
        load_into(model, state, skip, str(draft_dir))
    _check_hot_map(model.hot_token_map(), target.config.vocab_size, str(draft_dir))
    return model.eval().requires_grad_(False)


def draft_key(name: str, config: ModelConfig) -> str:
    """A head's weight name as fastspec's modules name it: no `model.` prefix; an EAGLE-3 midlayer saved as
    `layers.0.` (the speculators format) is `midlayer.`."""
    name = name.removeprefix("model.")
    return "midlayer." + name.removeprefix("layers.0.") if config.is_eagle3 and name.startswith("layers.0.") else name


def _build_eagle3(config: ModelConfig, target: CausalLM):
    share_embed = config.target_hidden_size == config.hidden_size == target.config.hidden_size
    lm_head = target.lm_head if config.load_lm_head_from_target else None
    model = LlamaForCausalLMEagle3(config, target.model.embed_tokens if share_embed else None, lm_head)
    skip = (("embed_tokens.",) if share_embed else ()) + (("lm_head.",) if lm_head is not None else ())
    return model, skip


def check_draft_fits(draft: ModelConfig, target: ModelConfig, source: str) -> None:
    if not draft.is_draft:
        standalone = draft.vocab_size == target.vocab_size and draft.hybrid is None  # where that advice would work
        raise FastspecError(f"{source}: {draft.architecture} is not an EAGLE draft head (its weights have no fc "
                            "beside one decoder layer)" + ("; a full model drafts with --speculative-algorithm "
                                                          "STANDALONE" if standalone else ""))
    if draft.vocab_size != target.vocab_size:
        raise FastspecError(f"{source}: draft vocabulary {draft.vocab_size} != target vocabulary {target.vocab_size}")
    width = draft.target_hidden_size if draft.is_eagle3 else draft.hidden_size
    if width != target.hidden_size:
        raise FastspecError(f"{source}: draft expects target features of width {width}, "
                            f"the target's hidden size is {target.hidden_size}")
    if draft.is_eagle3 and draft.use_aux_hidden_state:
        layers = eagle3_capture_layers(target.num_layers, draft.aux_layer_ids)
        if any(not 0 <= i <= target.num_layers for i in layers):
            raise FastspecError(f"{source}: aux hidden state layers {draft.aux_layer_ids} do not exist in a "
                                f"{target.num_layers}-layer target")


def load_token_map(path: Path, vocab_size: int) -> torch.Tensor:
    """FR-Spec hot-token list (.pt tensor/list via weights_only, .npy without pickle, .json list) -> int64 [Vh]."""
    path = Path(path)
    try:
        if path.suffix == ".json":
            ids = torch.tensor(json.loads(path.read_text()), dtype=torch.int64)
        elif path.suffix == ".npy":
            import numpy as np

            ids = torch.from_numpy(np.load(path, allow_pickle=False)).to(torch.int64)
        else:
            ids = torch.as_tensor(torch.load(path, map_location="cpu", weights_only=True), dtype=torch.int64)
    except Exception as e:
        raise FastspecError(f"token map {path}: cannot read ({first_line(e, None)})") from None
    if ids.ndim != 1 or ids.numel() == 0:
        raise FastspecError(f"token map {path}: expected a non-empty 1-D list of token ids")
    _check_hot_map(ids, vocab_size, f"token map {path}")
    return ids


def _check_hot_map(ids: torch.Tensor | None, vocab_size: int, source: str) -> None:
    if ids is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise FastspecError(f"{source}: token ids outside the target vocabulary [0, {vocab_size})")


