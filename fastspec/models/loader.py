"""Loading: a model directory -> its config, weights and model (specs become directories in fastspec.models.sources).

Reads single or sharded safetensors (and `pytorch_model*.bin` with `weights_only=True`), EAGLE / EAGLE-3
checkpoints in SGLang / SpecForge key format, and FR-Spec token maps (a checkpoint's MTP layers: mtp_loader), all
without arbitrary unpickling and without network access; or, with load format dummy, nothing at all (random weights:
fastspec.models.dummy). Every failure a user can cause becomes a one-line FastspecError.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch import nn

from fastspec.errors import FastspecError, first_line
from fastspec.models.causal_lm import CausalLM, eagle3_capture_layers
from fastspec.models.draft_formats import from_speculators, is_speculators
from fastspec.models.dummy import default_dtype, fill_random
from fastspec.models.eagle import LlamaForCausalLMEagle, LlamaForCausalLMEagle3
from fastspec.models.gguf_blocks import stored_floats
from fastspec.models.model_config import LLAMA_FAMILY, ModelConfig
from fastspec.models.moe import Router, stack_experts
from fastspec.models.quant_config import QuantScheme
from fastspec.models.quant_loader import build_quantised, checkpoint_scheme, split_quantised


def read_config(model_dir: Path) -> ModelConfig:
    source = str(model_dir / "config.json")
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise FastspecError(f"{source}: cannot read ({e})") from None
    if not isinstance(raw, dict):
        raise FastspecError(f"{source}: not a JSON object")
    if is_speculators(raw):  # vLLM's speculators format: the SGLang config it equals
        bias = "fc.bias" in weight_names(model_dir) if _weight_files(model_dir) else None
        raw = from_speculators(raw, source, bias)
    return ModelConfig.from_hf(raw, source=source)


def read_state_dict(model_dir: Path, keep=None) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (or those whose name `keep(name)` accepts: safetensors files then
    read only those), on CPU, in their stored dtype (a converted GGUF's block matrices: dequantised, float32)."""
    files = _weight_files(model_dir)
    if not files:
        raise FastspecError(f"{model_dir}: no *.safetensors or pytorch_model*.bin weights")
    state: dict[str, torch.Tensor] = stored_floats(model_dir, keep)
    for f in files:
        state.update(_read_weight_file(f, keep))
    return state


def weight_names(model_dir: Path) -> list[str]:
    """The names of a checkpoint's tensors without reading them where the format allows (a safetensors index or
    headers); .bin files are read (weights_only, memory-mapped)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text()).get("weight_map", {}))
    from safetensors import safe_open

    names = []
    try:
        for f in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(f), "pt") as handle:
                names += list(handle.keys())
    except Exception:  # safetensors has no common error class: let the full read name the damage
        names = []
    return names or list(read_state_dict(model_dir))


def _weight_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("pytorch_model*.bin"))


def _read_weight_file(path: Path, keep=None) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors" and keep is not None:
            from safetensors import safe_open

            with safe_open(str(path), "pt") as handle:
                return {name: handle.get_tensor(name) for name in handle.keys() if keep(name)}
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # safetensors / unpickler errors have no common base class
        raise FastspecError(f"{path}: corrupt or truncated weights file ({first_line(e, None)})") from None
    bad = [k for k, t in state.items() if not isinstance(t, torch.Tensor)] if isinstance(state, dict) else ["(top)"]
    if bad:
        raise FastspecError(f"{path}: not a state dict of tensors ({bad[0]})")
    return state if keep is None else {name: t for name, t in state.items() if keep(name)}


@contextlib.contextmanager
def _skip_init():
    """Build modules without random initialisation: every weight is overwritten by the checkpoint."""
    names = ("kaiming_uniform_", "uniform_", "normal_")
    saved = {n: getattr(nn.init, n) for n in names}
    try:
        for n in names:
            setattr(nn.init, n, lambda t, *a, **k: t)
        yield
    finally:
        for n, fn in saved.items():
            setattr(nn.init, n, fn)


def _load_into(model: nn.Module, state: dict[str, torch.Tensor], skip: tuple[str, ...], source: str) -> None:
    """Copy `state` into `model`'s parameters/buffers; every tensor not under a `skip` prefix must be present."""
    own = model.state_dict(keep_vars=True)  # parameters and persistent buffers, the live tensors
    with torch.no_grad():
        for name, tensor in own.items():
            if name.startswith(skip) or tensor is None:
                continue
            if name not in state:
                raise FastspecError(f"{source}: missing weight {name}")
            if tuple(state[name].shape) != tuple(tensor.shape):
                raise FastspecError(f"{source}: weight {name} has shape {tuple(state[name].shape)}, "
                                    f"expected {tuple(tensor.shape)}")
            tensor.copy_(state[name])


def check_target(config: ModelConfig, model_dir: Path) -> None:
    if config.is_draft:
        raise FastspecError(f"{model_dir}: {config.architecture} is a draft head, not a target model")


def load_target(model_dir: Path, dtype: torch.dtype, device="cpu", capture_layers: tuple[int, ...] = (),
                load_format: str = "auto", quantization: str | None = None,
                read: tuple[ModelConfig, QuantScheme | None] | None = None) -> CausalLM:
    """`load_format` dummy: random weights (fastspec.models.dummy), none read. `quantization` gguf: a converted GGUF
    model on its own blocks, already fused (fastspec.models.gguf_packed). `read`: the checkpoint's config and
    quantisation scheme as start-up read them (fastspec.models.sources); default: read here."""
    config, scheme = read or (read_config(model_dir), checkpoint_scheme(model_dir))
    check_target(config, model_dir)
    if any(not 0 <= i <= config.num_layers for i in capture_layers):
        raise FastspecError(f"capture layers {capture_layers} outside 0..{config.num_layers}")
    if quantization == "gguf":
        from fastspec.models.gguf_packed import load_packed_target  # the gguf package: only for this path
        from fastspec.models.packed_layers import fast_activation

        with _skip_init(), torch.device("meta"):  # a skeleton: every weight is built from the stored blocks
            skeleton = CausalLM(config, capture_layers)
        return load_packed_target(skeleton, model_dir, dtype, device, fast_activation())
    dummy = load_format == "dummy"
    if scheme is not None and not dummy:  # a quantised checkpoint: kept in its stored form, or dequantised (None)
        return _load_quantised(model_dir, config, capture_layers, scheme, dtype, device, quantization is not None)
    with _skip_init(), torch.device(device), default_dtype(dtype if dummy else None):
        model = _keep_routers_float32(CausalLM(config, capture_layers).to(dtype))
    if dummy:
        fill_random(model, config.initializer_range)
        return model.eval().requires_grad_(False)
    skip = ("lm_head.",) if config.tie_word_embeddings else ()
    _load_into(model, _renamed(stack_experts(read_state_dict(model_dir))), skip, str(model_dir))
    return model.eval().requires_grad_(False)


def _renamed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if "model.final_layernorm.weight" in state:  # Bamba's name for the final norm
        state["model.norm.weight"] = state.pop("model.final_layernorm.weight")
    return state


def _load_quantised(model_dir: Path, config: ModelConfig, capture_layers: tuple[int, ...], scheme, dtype, device,
                    keep: bool) -> CausalLM:
    """A quantised checkpoint (fastspec.models.quant_loader): its linears kept in their stored form (`keep`), or
    every weight dequantised to `dtype` and loaded as a float model."""
    with _skip_init(), torch.device("meta"):  # (init on meta would import torch's decompositions: ~1 s)
        skeleton = CausalLM(config, capture_layers)
    state, forms, experts = split_quantised(read_state_dict(model_dir), scheme, skeleton, dtype, keep, str(model_dir))
    state = _renamed(stack_experts(state))
    skip = ("lm_head.",) if config.tie_word_embeddings else ()
    if forms or experts:  # the kept linears built on the skeleton, the rest filled as a float model's
        model = skeleton
        skip += build_quantised(model, state, forms, experts, dtype, device, str(model_dir))
        model.tie_weights()
    else:
        with _skip_init(), torch.device(device):
            model = CausalLM(config, capture_layers).to(dtype)
    _load_into(_keep_routers_float32(model), state, skip, str(model_dir))
    return model.eval().requires_grad_(False)


def _keep_routers_float32(model: nn.Module) -> nn.Module:
    """MoE routers score in float32 whatever the model's dtype (as DeepSeek and transformers do)."""
    for module in model.modules():
        if isinstance(module, Router):
            module.float()
    return model


def read_draft_config(draft_dir: Path, algorithm: str | None) -> ModelConfig:
    """The draft's config. A head published under a target's architecture (EAGLE-1's `LlamaForCausalLM`) whose
    weights are an EAGLE head's (`fc` beside `layers.0.*`) or an EAGLE-3 head's (`midlayer.*` or `d2t`) is read as
    that head when `algorithm` asks for one."""
    config = read_config(draft_dir)
    if config.is_draft or algorithm not in ("EAGLE", "EAGLE3") or config.architecture not in LLAMA_FAMILY:
        return config
    names = {n.removeprefix("model.") for n in weight_names(draft_dir)} if _weight_files(draft_dir) else set()
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
    dummy = load_format == "dummy" and not _weight_files(draft_dir)
    state = {} if dummy else {draft_key(k, config): v for k, v in read_state_dict(draft_dir).items()}
    with _skip_init(), torch.device(device), default_dtype(dtype if dummy else None):
        if config.is_eagle3:
            model, skip = _build_eagle3(config, target)
        else:
            hot = load_token_map(token_map, target.config.vocab_size).to(device) if token_map else None
            model = LlamaForCausalLMEagle(config, target.model.embed_tokens, target.lm_head.weight, hot)
            skip = ("embed_tokens.", "lm_head.")
        model = model.to(dtype)
    if config.is_eagle3:
        model.d2t.zero_()
        state.setdefault("d2t", model.d2t)
    if dummy:
        fill_random(model, config.initializer_range, skip)
    else:
        _load_into(model, state, skip, str(draft_dir))
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


