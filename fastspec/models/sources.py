"""Start-up's one resolve step: what the user named (an embedded model, a directory, a .gguf file, a hub id; a draft)
-> the directories and configs every later stage reads, as one frozen `ModelSources`.

Reads config.json files and the quantisation scheme once, and runs every check that needs no weights: the draft
head against the target (width, vocabulary, EAGLE vs EAGLE-3, aux layers), a STANDALONE draft, an MTP draft, and
`--quantization` against the checkpoint. Loads no tensors (fastspec.models.assemble does, from this value).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fastspec.config import check_spec_flags
from fastspec.errors import FastspecError
from fastspec.models.loader import (
    check_draft_fits,
    generation_eos_ids,
    read_config,
    read_draft_config,
    resolve_draft_dir,
    resolve_model_dir,
    resolve_quantization,
)
from fastspec.models.model_config import ModelConfig
from fastspec.models.mtp_loader import check_mtp_fits, mtp_draft, mtp_prefix
from fastspec.models.quant_config import QuantScheme
from fastspec.models.quant_loader import checkpoint_scheme

DRAFTED = ("EAGLE", "EAGLE3", "STANDALONE")  # the algorithms with a draft model


@dataclass(frozen=True)
class ModelSources:
    """The target's and the draft's directories and configs, resolved and checked against each other."""

    model_dir: Path
    config: ModelConfig
    eos_ids: frozenset[int]  # config.json's and generation_config.json's
    scheme: QuantScheme | None  # a quantised checkpoint's method and layout (None: float weights)
    quantization: str | None  # EngineConfig.quantization with `auto` decided (resolve_quantization)
    draft_dir: Path | None = None  # EAGLE / EAGLE3 / STANDALONE: the draft (an MTP draft: the target's own dir)
    draft_config: ModelConfig | None = None  # as read_draft_config reads it


def resolve_sources(model: str, algorithm: str | None, draft_model: str | None = None, *, revision: str | None = None,
                    draft_revision: str | None = None, quantization: str | None = "auto", device: str = "cpu",
                    load_format: str = "auto") -> ModelSources:
    """`algorithm` as the user named it (NEXTN: EAGLE with the checkpoint's MTP layer). Hub ids are fetched (the
    draft's config first, so a head that cannot fit is refused before its weights download)."""
    named, algorithm = algorithm, check_spec_flags(algorithm)
    model_dir = resolve_model_dir(model, revision)
    config = read_config(model_dir)
    if config.is_draft:
        raise FastspecError(f"{model_dir}: {config.architecture} is a draft head, not a target model")
    scheme = checkpoint_scheme(model_dir)
    quantization = resolve_quantization(quantization, model_dir, scheme, device, load_format, algorithm)
    draft_dir = draft_config = None
    if algorithm in DRAFTED:
        draft = mtp_draft(str(model_dir), model_dir, config, named, draft_model)
        if draft is None:
            raise FastspecError(f"{algorithm} needs a draft model (--speculative-draft-model-path / --draft)")
        draft_dir = resolve_draft_dir(draft, draft_revision, config, algorithm)
        draft_config = read_draft_config(draft_dir, algorithm)
        check_draft(algorithm, draft_config, config, draft_dir, quantization)
    return ModelSources(model_dir, config, generation_eos_ids(model_dir, config.eos_token_ids), scheme, quantization,
                        draft_dir, draft_config)


def check_draft(algorithm: str, draft: ModelConfig, target: ModelConfig, draft_dir: Path,
                quantization: str | None) -> None:
    """A draft that cannot run with this target and algorithm: one line, before any weight is read."""
    if algorithm == "STANDALONE":
        if draft.is_draft:
            raise FastspecError(f"{draft_dir}: STANDALONE needs a full model, not the draft head "
                                f"{draft.architecture} (use EAGLE / EAGLE3)")
        if draft.hybrid is not None:
            raise FastspecError(f"{draft_dir}: STANDALONE with a {draft.architecture} draft: drafting does not "
                                "track recurrent states yet (a hybrid target drafted by an attention model works)")
        if draft.vocab_size != target.vocab_size:
            raise FastspecError(f"{draft_dir}: draft vocabulary {draft.vocab_size} != target vocabulary "
                                f"{target.vocab_size}")
        return
    if algorithm == "EAGLE" and mtp_prefix(draft) is not None:  # NEXTN: a checkpoint's MTP layer
        check_mtp_fits(draft, target, str(draft_dir))
        return
    if (algorithm == "EAGLE3") != draft.is_eagle3:
        wanted = "LlamaForCausalLMEagle3" if algorithm == "EAGLE3" else "LlamaForCausalLMEagle"
        raise FastspecError(f"{draft_dir}: {algorithm} needs a {wanted} head, got {draft.architecture}")
    check_draft_fits(draft, target, str(draft_dir))
    if quantization == "gguf" and not draft.is_eagle3:  # an EAGLE-2 head multiplies by the target's lm_head weight
        raise FastspecError(f"{draft_dir}: an EAGLE-2 head needs the target's float lm_head, which --quantization "
                            "gguf does not keep (use an EAGLE-3 head, or no --quantization)")
