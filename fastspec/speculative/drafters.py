"""Which drafter an algorithm gets, and loading the target / draft models it needs.

EAGLE / EAGLE3 / STANDALONE share one drafter (`EagleDrafter`, differing only in the draft model and the
target feature it is fed); NGRAM proposes trees from each request's own tokens; NONE has no drafter.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fastspec.config import EngineConfig, SpecConfig
from fastspec.errors import FastspecError
from fastspec.kernels.cpu_linear import can_prepack, prepack_linears, trim_host_heap
from fastspec.models.layers import fuse_projections
from fastspec.models.llama import LlamaForCausalLM, eagle3_capture_layers
from fastspec.models.loader import (check_draft_fits, load_draft, load_target, read_config, read_draft_config,
                                    resolve_model_dir)
from fastspec.models.mtp_loader import check_mtp_fits, load_mtp, mtp_prefix
from fastspec.models.quant_loader import checkpoint_scheme
from fastspec.models.quantise import ONLINE, quantise_target
from fastspec.speculative.batch import DecodeBatch, ExtendBatch
from fastspec.speculative.eagle_drafter import EagleDrafter, StandaloneDraft
from fastspec.graphs.step_graphs import GraphPlan
from fastspec.speculative.tree import DraftTree, tree_from_parents


@dataclass(frozen=True)
class LoadedModels:
    target: LlamaForCausalLM
    draft: torch.nn.Module | None
    feature: str  # which target hidden state the draft is fed: "final" | "aux" | "none"


PREPACK_BS = (1, 2, 4)  # each packed row count is one more copy of the weights: only the small batches


def load_models(model_dir: Path, spec: SpecConfig, config: EngineConfig) -> LoadedModels:
    """Target and draft weights, their projections fused (fastspec.models.layers.fuse_projections); with quantization
    "gguf" a GGUF target on its own blocks (fastspec.models.gguf_packed), with a quantised checkpoint's method its
    stored linears (fastspec.models.quant_loader), with fp8 / int8 / int4 its projections rounded at load, each on
    its device's kernel (fastspec.models.quantise.quantise_target); on CPU the draft's linears on fastspec's kernels (8-bit blocks)
    where the target runs on them, else in the fast float dtype; on CPU in float32, other linears are prepacked for
    the row counts of the verify (bs * num_draft_tokens) and of the draft steps (bs * topk) at batch sizes 1, 2
    and 4."""
    models = _load_models(model_dir, spec, config)
    online = config.quantization in ONLINE and checkpoint_scheme(model_dir) is None  # rounded here, not stored so
    for model in (models.target, models.draft):
        if isinstance(model, nn.Module):
            fuse_projections(model)  # one QKV and one gate_up GEMM per layer
    if config.quantization is not None and config.device == "cpu":
        from fastspec.models.packed_layers import cast_linears, fast_activation, float_dtype, pack_linears

        act = fast_activation()
        if config.quantization != "gguf":  # gguf_packed built its kernels already
            quantise_target(models.target, config.quantization, act, online)
        if isinstance(models.draft, nn.Module):  # on fastspec's kernels where the target is, else in the float dtype
            (pack_linears if act == torch.int16 else cast_linears)(models.draft, float_dtype(act))
    elif config.quantization is not None:
        quantise_target(models.target, config.quantization, None, online)
    pack_round_rows(models.target, models.draft, spec, config)
    if config.device == "cpu":
        trim_host_heap()  # what loading freed goes back to the OS
    return models


def pack_round_rows(target, draft, spec: SpecConfig, config: EngineConfig) -> None:
    """(Re)pack the linears for the row counts of spec's tree shapes (CPU, float32; eager or compiled rounds)."""
    if spec.enabled and config.graph_mode != "cuda" and can_prepack(config.device, config.torch_dtype):
        prepack_linears(target, tuple(bs * p.num_draft_tokens for p in spec.tiers for bs in PREPACK_BS))
        if isinstance(draft, nn.Module):
            prepack_linears(draft, tuple(bs * p.topk for p in spec.tiers for bs in PREPACK_BS))


def _load_models(model_dir: Path, spec: SpecConfig, config: EngineConfig) -> LoadedModels:
    dtype, device, load, quant = config.torch_dtype, config.device, config.load_format, config.quantization
    if spec.algorithm not in ("EAGLE", "EAGLE3", "STANDALONE"):
        return LoadedModels(load_target(model_dir, dtype, device, load_format=load, quantization=quant), None, "none")
    draft_dir = resolve_model_dir(spec.draft_model)
    draft_config = read_draft_config(draft_dir, spec.algorithm)
    if spec.algorithm == "STANDALONE":
        target = load_target(model_dir, dtype, device, load_format=load, quantization=quant)
        if draft_config.is_draft:
            raise FastspecError(f"{draft_dir}: STANDALONE needs a full model, not the draft head "
                                f"{draft_config.architecture} (use EAGLE / EAGLE3)")
        if draft_config.hybrid is not None:
            raise FastspecError(f"{draft_dir}: STANDALONE with a {draft_config.architecture} draft: drafting does not "
                                "track recurrent states yet (a hybrid target drafted by an attention model works)")
        if draft_config.vocab_size != target.config.vocab_size:
            raise FastspecError(f"{draft_dir}: draft vocabulary {draft_config.vocab_size} != target vocabulary "
                                f"{target.config.vocab_size}")
        return LoadedModels(target, StandaloneDraft(load_target(draft_dir, dtype, device, load_format=load)), "none")
    if spec.algorithm == "EAGLE" and mtp_prefix(draft_config) is not None:  # NEXTN: the checkpoint's MTP layer
        target = load_target(model_dir, dtype, device, load_format=load, quantization=quant)
        check_mtp_fits(draft_config, target.config, str(draft_dir))
        return LoadedModels(target, load_mtp(draft_dir, target, dtype, device), "final")
    if (spec.algorithm == "EAGLE3") != draft_config.is_eagle3:
        wanted = "LlamaForCausalLMEagle3" if spec.algorithm == "EAGLE3" else "LlamaForCausalLMEagle"
        raise FastspecError(f"{draft_dir}: {spec.algorithm} needs a {wanted} head, got {draft_config.architecture}")
    target_config = read_config(model_dir)
    check_draft_fits(draft_config, target_config, str(draft_dir))  # before any weights load
    if quant == "gguf" and not draft_config.is_eagle3:  # an EAGLE-2 head multiplies by the target's lm_head weight
        raise FastspecError(f"{draft_dir}: an EAGLE-2 head needs the target's float lm_head, which --quantization "
                            "gguf does not keep (use an EAGLE-3 head, or no --quantization)")
    aux = draft_config.is_eagle3 and draft_config.use_aux_hidden_state
    capture = eagle3_capture_layers(target_config.num_layers, draft_config.aux_layer_ids) if aux else ()
    target = load_target(model_dir, dtype, device, capture_layers=capture, load_format=load,
                         quantization=quant)
    token_map = Path(spec.token_map) if spec.token_map else None
    draft = load_draft(draft_dir, target, dtype, device, token_map, load_format=load, config=draft_config)
    return LoadedModels(target, draft, "aux" if aux else "final")


def draft_kv_shape(draft) -> tuple[int, int, int, bool] | None:
    """(num_layers, num_kv_heads, head_dim, separate_v) of the draft's KV pool, or None without a draft model."""
    if draft is None:
        return None
    c = draft.config
    return c.kv_layout


class NgramTreeDrafter:
    """NGRAM: per-request tries over prompt + output; no draft model, no draft KV, no draft extend."""

    uses_extend = False
    uses_scratch = False

    def __init__(self, spec: SpecConfig):
        from fastspec.speculative.ngram import NgramDrafter

        self.ngram = NgramDrafter(spec.ngram, spec.num_draft_tokens)
        self.num_steps = spec.num_steps

    def draft(self, batch: DecodeBatch) -> DraftTree:  # host-side trie walk: counted as host time
        for rid, history in zip(batch.rids, batch.histories):
            self.ngram.update(rid, history)
        tokens, parents = self.ngram.propose(list(batch.rids), list(batch.histories))  # host tensors
        return tree_from_parents(batch.verified_id, tokens, parents, batch.seq_lens, self.num_steps)

    def extend(self, batch: ExtendBatch, decode_round: bool) -> None:
        raise AssertionError("NGRAM has no draft extend")

    def release(self, rid: int) -> None:
        self.ngram.release(rid)


def build_drafter(spec: SpecConfig, draft, draft_pool, table, allocator, feature_width: int, plan: GraphPlan,
                  times=None) -> dict:
    """{tree shape: drafter}: one entry, or one per tier of a batch-size schedule (sharing request states)."""
    if spec.algorithm == "NONE":
        return {}
    if spec.algorithm == "NGRAM":
        return {spec.params: NgramTreeDrafter(spec)}
    tiers = spec.tiers
    shared = {} if len(tiers) > 1 else None
    extend_topk = max(p.topk for p in tiers) if shared is not None else None
    return {p: EagleDrafter(draft, draft_pool, table, allocator, p.num_steps, p.topk, p.num_draft_tokens,
                            feature_width, plan, times, extend_topk, shared) for p in tiers}
