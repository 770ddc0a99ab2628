"""The models a worker runs, from resolved `ModelSources`: the target (and the draft its algorithm needs) loaded,
their projections fused, quantised and packed for the device.

With quantization "gguf" a GGUF target runs on its own blocks (fastspec.models.gguf_packed); with a quantised
checkpoint's method, on its stored linears (fastspec.models.quant_loader); with fp8 / int8 / int4, its projections
are rounded at load (fastspec.models.quantise). On CPU the draft's linears run on fastspec's block kernels (an
EAGLE head's rounded to 4 bits, other drafts' to 8) where the target runs on them (else in the fast float dtype), and
the float linears left run fastspec's row-invariant GEMM (fastspec.kernels.cpu_row_gemm; without the C library,
in float32 MKL's, prepacked for the row counts of the rounds: fastspec.kernels.cpu_linear). A quantised
STANDALONE draft keeps its stored form, bound to the device's kernels as the target's are, unless --quantization is
none. Reads no config: every check ran in resolve_sources.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from fastspec.config import EngineConfig
from fastspec.kernels.cpu_row_gemm import row_invariant_linears
from fastspec.kernels.cpu_linear import can_prepack, prepack_linears, trim_host_heap
from fastspec.models.causal_lm import CausalLM, eagle3_capture_layers
from fastspec.models.draft_loader import load_draft
from fastspec.models.eagle import StandaloneDraft
from fastspec.models.kv_scales import read_kv_scales
from fastspec.models.layers import fuse_projections
from fastspec.models.loader import load_target
from fastspec.models.mtp_loader import drafts_with_mtp, load_mtp
from fastspec.models.quantise import ONLINE, bind_model, quantise_target
from fastspec.models.sources import DRAFTED, ModelSources
from fastspec.spec_config import SpecConfig

PREPACK_BS = (1, 2, 4)  # each packed row count is one more copy of the weights: only the small batches


@dataclass(frozen=True)
class LoadedModels:
    target: CausalLM
    draft: nn.Module | None
    feature: str  # which target hidden state the draft is fed: "final" | "aux" | "none"
    kv_scales: tuple[tuple[float, float], ...] | None = None  # the target's fp8 KV scales per KV layer (kv_scales)

    @property
    def draft_kv_shape(self) -> tuple[int, int, int, bool] | None:
        """(num_layers, num_kv_heads, head_dim, separate_v) of the draft's KV pool; None without a draft model."""
        return None if self.draft is None else self.draft.config.kv_layout


def load_models(sources: ModelSources, spec: SpecConfig, config: EngineConfig) -> LoadedModels:
    """The target and, for EAGLE / EAGLE3 / STANDALONE, the draft; fused, quantised and packed (module docstring)."""
    models = _load(sources, spec, config)
    if config.kv_torch_dtype.itemsize == 1 and config.load_format != "dummy" and config.quantization != "gguf":
        models = replace(models, kv_scales=read_kv_scales(sources.model_dir, sources.config))
    # rounded here, not stored so (a quantised checkpoint's dummy weights too: random floats of its shapes)
    online = config.quantization in ONLINE and (sources.scheme is None or config.load_format == "dummy")
    for model in (models.target, models.draft):
        if isinstance(model, nn.Module):
            fuse_projections(model)  # one QKV and one gate_up GEMM per layer
    cpu, draft = config.device == "cpu", models.draft
    act = None  # CPU: the packed kernels' activations, measured here when something runs on them
    if cpu and (config.quantization is not None or sources.draft_quantization is not None):
        from fastspec.models.activation_choice import fast_activation

        act = fast_activation()
    if config.quantization not in (None, "gguf"):  # gguf_packed built its kernels already
        quantise_target(models.target, config.quantization, act, online)
    if isinstance(draft, nn.Module):
        bind_model(draft, act)  # a quantised STANDALONE draft's (or MTP layer's) stored linears
        if cpu and config.quantization is not None:  # on fastspec's kernels where the target is, else the float dtype
            from fastspec.models.activation_choice import float_dtype
            from fastspec.models.packed_layers import cast_linears, pack_linears

            if act == torch.int16:  # an EAGLE head in 4 bits (half the bytes, the same acceptance), others in 8
                mtp = drafts_with_mtp(spec.algorithm, sources.draft_config)
                pack_linears(draft, float_dtype(act), 4 if spec.algorithm in ("EAGLE", "EAGLE3") and not mtp else 8)
            else:
                cast_linears(draft, float_dtype(act))
    if cpu:  # a row computes the same whatever rows share its GEMM
        for model in (models.target, models.draft):
            if isinstance(model, nn.Module):
                row_invariant_linears(model)
    pack_round_rows(models.target, models.draft, spec, config)
    if config.device == "cpu":
        trim_host_heap()  # what loading freed goes back to the OS
    return models


def pack_round_rows(target, draft, spec: SpecConfig, config: EngineConfig) -> None:
    """(Re)pack the linears for the row counts of spec's tree shapes (CPU, float32; eager or compiled rounds): the
    verify's bs * num_draft_tokens and the draft steps' bs * topk at batch sizes PREPACK_BS."""
    if spec.enabled and config.graph_mode != "cuda" and can_prepack(config.device, config.torch_dtype):
        prepack_linears(target, tuple(bs * p.num_draft_tokens for p in spec.tiers for bs in PREPACK_BS))
        if isinstance(draft, nn.Module):
            prepack_linears(draft, tuple(bs * p.topk for p in spec.tiers for bs in PREPACK_BS))


def _load(sources: ModelSources, spec: SpecConfig, config: EngineConfig) -> LoadedModels:
    dtype, device, load = config.torch_dtype, config.device, config.load_format

    def target(capture: tuple[int, ...] = ()) -> CausalLM:
        return load_target(sources.model_dir, dtype, device, capture_layers=capture, load_format=load,
                           quantization=config.quantization, read=(sources.config, sources.scheme))

    draft_dir, draft_config = sources.draft_dir, sources.draft_config
    if spec.algorithm not in DRAFTED or draft_dir is None:
        return LoadedModels(target(), None, "none")
    if spec.algorithm == "STANDALONE":  # a quantised draft checkpoint kept as stored unless --quantization none
        draft = load_target(draft_dir, dtype, device, load_format=load, quantization=sources.draft_quantization,
                            read=(draft_config, sources.draft_scheme))
        return LoadedModels(target(), StandaloneDraft(draft), "none")
    if drafts_with_mtp(spec.algorithm, draft_config):  # NEXTN: the checkpoint's MTP layer
        model = target()
        mtp = load_mtp(draft_dir, model, dtype, device, draft_config, sources.draft_scheme,
                       keep=sources.draft_quantization is not None)
        return LoadedModels(model, mtp, "final")
    aux = draft_config.is_eagle3 and draft_config.use_aux_hidden_state
    model = target(eagle3_capture_layers(sources.config.num_layers, draft_config.aux_layer_ids) if aux else ())
    token_map = Path(spec.token_map) if spec.token_map else None
    draft = load_draft(draft_dir, model, dtype, device, token_map, load_format=load, config=draft_config)
    return LoadedModels(model, draft, "aux" if aux else "final")
