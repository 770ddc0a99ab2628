"""Loading: a model directory -> its config, weights and model (specs become directories in fastspec.models.sources;
draft heads: fastspec.models.draft_loader).

Reads single or sharded safetensors (and `pytorch_model*.bin` with `weights_only=True`; a checkpoint's MTP layers:
mtp_loader), without arbitrary unpickling and without network access; or, with load format dummy, nothing at all
(random weights: fastspec.models.dummy). Every failure a user can cause becomes a one-line FastspecError.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import torch
from torch import nn

from fastspec.errors import FastspecError, first_line
from fastspec.models.causal_lm import CausalLM
from fastspec.models.draft_formats import from_speculators, is_speculators
from fastspec.models.dummy import default_dtype, fill_random
from fastspec.models.gguf_blocks import stored_floats, stored_names
from fastspec.models.model_config import ModelConfig
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
        bias = "fc.bias" in weight_names(model_dir) if weight_files(model_dir) else None
        raw = from_speculators(raw, source, bias)
    return ModelConfig.from_hf(raw, source=source)


def read_state_dict(model_dir: Path, keep=None) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (or those whose name `keep(name)` accepts: safetensors files then
    read only those), on CPU, in their stored dtype (a converted GGUF's block matrices: dequantised, float32)."""
    files = weight_files(model_dir)
    if not files:
        raise FastspecError(f"{model_dir}: no *.safetensors or pytorch_model*.bin weights")
    state: dict[str, torch.Tensor] = stored_floats(model_dir, keep)
    for f in files:
        state.update(_read_weight_file(f, keep))
    return state


def weight_names(model_dir: Path) -> list[str]:
    """The names of a checkpoint's tensors without reading them where the format allows (a safetensors index or
    headers; a converted GGUF's block matrices included); .bin files are read (weights_only, memory-mapped)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text()).get("weight_map", {}))
    from safetensors import safe_open

    names = []
    try:
        for f in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(f), "pt") as handle:
                names += list(handle.keys())
        names += stored_names(model_dir)
    except Exception:  # safetensors has no common error class: let the full read name the damage
        names = []
    return names or list(read_state_dict(model_dir))


def weight_files(model_dir: Path) -> list[Path]:
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
def skip_init():
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


def cast_own(model: nn.Module, dtype: torch.dtype, target: nn.Module) -> nn.Module:
    """model.to(dtype) for the head's own tensors only: the target's embedding / lm_head it shares keep theirs (a
    cast of the shared module rounded the target's own tables, e.g. a packed embedding's float32 scales to
    bfloat16, so a target beside a head computed other logits than the same target alone)."""
    theirs = {id(t) for t in (*target.parameters(), *target.buffers())}
    with torch.no_grad():
        for module in model.modules():
            for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                if id(t) in theirs or not t.is_floating_point() or t.dtype == dtype:
                    continue
                if isinstance(t, nn.Parameter):
                    t.data = t.data.to(dtype)
                else:
                    setattr(module, name, t.to(dtype))
    return model


def load_into(model: nn.Module, state: dict[str, torch.Tensor], skip: tuple[str, ...], source: str) -> None:
    """Copy `state` into `model`'s parameters/buffers; every tensor not under a `skip` prefix must be present."""
    own = model.state_dict(keep_vars=True)  # parameters and persistent buffers, the live tensors
    with torch.no_grad():
        for name, tensor in own.items():
            if name.startswith(skip) or tensor is None:
                continue
            if name not in state:
                packed = [f"{name.removesuffix('.weight')}.{k}" for k in ("qweight", "weight_packed")]
                if any(key in state for key in packed):  # a GPTQ / AWQ / compressed-tensors repo without its config
                    raise FastspecError(f"{source}: {next(k for k in packed if k in state)} is a packed quantised "
                                        "weight but the checkpoint declares no quantisation (quantization_config)")
                raise FastspecError(f"{source}: missing weight {name}")
            if tuple(state[name].shape) != tuple(tensor.shape):
                raise FastspecError(f"{source}: weight {name} has shape {tuple(state[name].shape)}, "
                                    f"expected {tuple(tensor.shape)}")
            if state[name].dtype.itemsize == 1 and tensor.is_floating_point():  # fp8 / int8: its scale dropped
                raise FastspecError(f"{source}: weight {name} is stored in {str(state[name].dtype)[6:]} but the "
                                    "checkpoint declares no quantisation for it (quantization_config)")
            tensor.copy_(state[name])
    for name in state:  # a bias the config gives the layer none of would be dropped: other outputs, silently
        stray = name.endswith(".bias") and name not in own and f"{name[:-5]}.weight" in own
        if stray and not name.startswith(skip) and state[name].any():  # (GPTQ-for-LLaMa saved zero ones: no change)
            raise FastspecError(f"{source}: {name} is a bias the config gives its layer none of (attention_bias / "
                                "mlp_bias in config.json)")


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
        from fastspec.models.activation_choice import fast_activation

        with skip_init(), torch.device("meta"):  # a skeleton: every weight is built from the stored blocks
            skeleton = CausalLM(config, capture_layers)
        return load_packed_target(skeleton, model_dir, dtype, device, fast_activation())
    dummy = load_format == "dummy"
    if scheme is not None and not dummy:  # a quantised checkpoint: kept in its stored form, or dequantised (None)
        return _load_quantised(model_dir, config, capture_layers, scheme, dtype, device, quantization is not None)
    with skip_init(), torch.device(device), default_dtype(dtype if dummy else None):
        model = _keep_routers_float32(CausalLM(config, capture_layers).to(dtype))
    if dummy:
        fill_random(model, config.initializer_range)
        return model.eval().requires_grad_(False)
    skip = ("lm_head.",) if config.tie_word_embeddings else ()
    load_into(model, stack_experts(renamed(read_state_dict(model_dir))), skip, str(model_dir))
    return model.eval().requires_grad_(False)


_MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w([123])\.")
_MIXTRAL_PROJ = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def renamed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's names where they differ from fastspec's (as stored, before any is decoded or stacked): Bamba's
    final norm; Mixtral's MoE block (`block_sparse_moe.gate`, experts' w1 / w3 / w2: gate / up / down, with every
    quantised tensor beside them) named as Qwen3-MoE's (`mlp.gate`, `mlp.experts.{e}.gate_proj`), as transformers
    renames them."""
    if "model.final_layernorm.weight" in state:  # Bamba's name for the final norm
        state["model.norm.weight"] = state.pop("model.final_layernorm.weight")
    for name in [k for k in state if ".block_sparse_moe." in k]:
        new = _MIXTRAL_EXPERT.sub(lambda m: f".block_sparse_moe.experts.{m[1]}.{_MIXTRAL_PROJ[m[2]]}.", name)
        state[new.replace(".block_sparse_moe.", ".mlp.")] = state.pop(name)
    return state


def _load_quantised(model_dir: Path, config: ModelConfig, capture_layers: tuple[int, ...], scheme, dtype, device,
                    keep: bool) -> CausalLM:
    """A quantised checkpoint (fastspec.models.quant_loader): its linears kept in their stored form (`keep`), or
    every weight dequantised to `dtype` and loaded as a float model."""
    with skip_init(), torch.device("meta"):  # (init on meta would import torch's decompositions: ~1 s)
        skeleton = CausalLM(config, capture_layers)
    state, forms, experts = split_quantised(renamed(read_state_dict(model_dir)), scheme, skeleton, dtype, keep,
                                            str(model_dir))
    state = stack_experts(state)
    skip = ("lm_head.",) if config.tie_word_embeddings else ()
    if forms or experts:  # the kept linears built on the skeleton, the rest filled as a float model's
        model = skeleton
        skip += build_quantised(model, state, forms, experts, dtype, device, str(model_dir))
        model.tie_weights()
    else:
        with skip_init(), torch.device(device):
            model = CausalLM(config, capture_layers).to(dtype)
    load_into(_keep_routers_float32(model), state, skip, str(model_dir))
    return model.eval().requires_grad_(False)


def _keep_routers_float32(model: nn.Module) -> nn.Module:
    """MoE routers score in float32 whatever the model's dtype (as DeepSeek and transformers do)."""
    for module in model.modules():
        if isinstance(module, Router):
            module.float()
    return model
