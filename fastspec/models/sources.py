"""Start-up's one resolve step: what the user named (an embedded model, a directory, a .gguf file, a hub id; a draft)
-> the directories and configs every later stage reads, as one frozen `ModelSources`; and the steps it is made of
(`resolve_model_dir`: a spec to a directory, converting a .gguf file once; `resolve_tokenizer_dir`: a tokenizer given
apart from the model; `resolve_quantization`).

Reads config.json files and the quantisation scheme once, and runs every check that needs no weights: the draft
head against the target (width, vocabulary, EAGLE vs EAGLE-3, aux layers), a STANDALONE draft, an MTP draft, and
`--quantization` against the checkpoint. Loads no tensors (fastspec.models.assemble does, from this value), nor
decides whether they fit in memory (weights_fit).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from fastspec.errors import FastspecError, OptionError
from fastspec.models import hub
from fastspec.models.draft_loader import check_draft_fits, read_draft_config
from fastspec.models.hub import check_model_spec
from fastspec.models.loader import check_target, read_config
from fastspec.models.model_config import LLAMA_FAMILY, ModelConfig
from fastspec.models.mtp_loader import check_mtp_fits, drafts_with_mtp, mtp_draft
from fastspec.models.quant_config import QuantScheme
from fastspec.models.quant_loader import checkpoint_scheme
from fastspec.spec_config import check_spec_flags

log = logging.getLogger(__name__)

DRAFTED = ("EAGLE", "EAGLE3", "STANDALONE")  # the algorithms with a draft model


@dataclass(frozen=True)
class ModelSources:
    """The target's and the draft's directories and configs, resolved and checked against each other."""

    model_dir: Path
    config: ModelConfig
    eos_ids: frozenset[int]  # config.json's and generation_config.json's; a tokenizer's given apart from the model
    scheme: QuantScheme | None  # a quantised checkpoint's method and layout (None: float weights)
    quantization: str | None  # EngineConfig.quantization with `auto` decided (resolve_quantization)
    tokenizer_dir: Path  # tokenizer.json's: the model's own directory, or the tokenizer named apart from it
    draft_dir: Path | None = None  # EAGLE / EAGLE3 / STANDALONE: the draft (an MTP draft: the target's own dir)
    draft_config: ModelConfig | None = None  # as read_draft_config reads it
    draft_scheme: QuantScheme | None = None  # a STANDALONE / MTP draft checkpoint's quantisation (None: float)
    draft_quantization: str | None = None  # "auto": that draft kept in its stored form; None: float or dequantised


def resolve_sources(model: str, algorithm: str | None, draft_model: str | None = None, *, revision: str | None = None,
                    draft_revision: str | None = None, quantization: str | None = "auto", device: str = "cpu",
                    load_format: str = "auto", tokenizer: str | None = None) -> ModelSources:
    """`algorithm` as the user named it (NEXTN: EAGLE with the checkpoint's MTP layer). Hub ids are fetched (the
    draft's config first, so a head that cannot fit is refused before its weights download). `tokenizer`: one to
    use instead of the model's own (resolve_tokenizer_dir)."""
    named, algorithm, asked = algorithm, check_spec_flags(algorithm), quantization
    if tokenizer is not None:
        hub.check_tokenizer_spec(tokenizer)  # (before the model is fetched or converted)
    model_dir = resolve_model_dir(model, revision)
    config = read_config(model_dir)
    check_target(config, model_dir)
    scheme = checkpoint_scheme(model_dir)
    quantization = resolve_quantization(quantization, model_dir, scheme, device, load_format, algorithm)
    check_int4_rounding(quantization, config, model_dir)
    tokenizer_dir = model_dir if tokenizer is None else resolve_tokenizer_dir(tokenizer, config.vocab_size)
    eos_ids = generation_eos_ids(model_dir, config.eos_token_ids) | hub.tokenizer_eos_ids(tokenizer_dir,
                                                                                         config.vocab_size)
    draft_dir = draft_config = draft_scheme = None
    if algorithm in DRAFTED:
        draft = mtp_draft(str(model_dir), model_dir, config, named, draft_model)
        if draft is None:
            raise OptionError(f"{algorithm} needs a draft model ({{draft_model}})", draft_model=draft_model)
        draft_dir = resolve_draft_dir(draft, draft_revision, config, algorithm)
        draft_config = read_draft_config(draft_dir, algorithm)
        check_draft(algorithm, draft_config, config, draft, quantization)  # (named as given, not its conversion)
        stored = algorithm == "STANDALONE" or drafts_with_mtp(algorithm, draft_config)  # checkpoints, not heads
        draft_scheme = checkpoint_scheme(draft_dir) if stored else None
    keep_draft = draft_scheme is not None and asked is not None and load_format != "dummy"  # unless --quantization none
    return ModelSources(model_dir, config, eos_ids, scheme, quantization, tokenizer_dir, draft_dir, draft_config,
                        draft_scheme, "auto" if keep_draft else None)


def check_draft(algorithm: str, draft: ModelConfig, target: ModelConfig, draft_dir: Path | str,
                quantization: str | None) -> None:
    """A draft that cannot run with this target and algorithm: one line naming `draft_dir` (the draft as the user
    gave it: a .gguf file's conversion or a hub id's snapshot is a cache path they never typed), before any weight
    is read."""
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
    if drafts_with_mtp(algorithm, draft):  # NEXTN
        check_mtp_fits(draft, target, str(draft_dir))
        return
    if (algorithm == "EAGLE3") != draft.is_eagle3:
        wanted = "LlamaForCausalLMEagle3" if algorithm == "EAGLE3" else "LlamaForCausalLMEagle"
        hint = "" if draft.is_draft else " (a full model: STANDALONE drafts with one)"
        raise FastspecError(f"{draft_dir}: {algorithm} needs a {wanted} head, got {draft.architecture}{hint}")
    check_draft_fits(draft, target, str(draft_dir))
    if quantization == "gguf" and not draft.is_eagle3:  # an EAGLE-2 head multiplies by the target's lm_head weight
        raise OptionError("{draft_dir!s}: an EAGLE-2 head needs the target's float lm_head, which {quantization=} "
                          "does not keep (use an EAGLE-3 head, or {quantization=none})", quantization=quantization,
                          draft_dir=draft_dir)


def resolve_model_dir(spec: str, revision: str | None = None) -> Path:
    """An embedded model name, a Hugging Face model directory, a .gguf file or a hub id (`org/name` at `revision`:
    the cached snapshot, or downloaded) -> a model directory."""
    from fastspec.models import embedded

    check_model_spec(spec)
    if revision is not None and not hub.is_hub_id(spec):  # (a local model has no revisions: not silently ignored)
        raise FastspecError(f"a revision ({revision}) applies to a hub id (org/name), not to {spec}")
    if spec in embedded.EMBEDDED_MODELS:
        return embedded.embedded_model_dir(spec)
    if hub.is_hub_id(spec):
        return hub.fetch(spec, revision)
    path = Path(spec).expanduser()
    return _converted_gguf(path) if hub.names_gguf(path) else path


def _converted_gguf(path: Path) -> Path:
    """The conversion of the .gguf file at `path` (converted once per path, size and time; converting a new version
    removes the earlier versions' conversions), held for reading (gguf.held_conversion)."""
    from fastspec.models.embedded import remove_stale_conversions
    from fastspec.models.gguf import CONVERSION_FOLDERS, held_conversion

    announce = partial(log.warning, "%s: converting it into %s (once: later starts read that)", path.name)
    out, converted = held_conversion(path, partial(_conversion_dir, path, CONVERSION_FOLDERS[0]), announce=announce)
    if converted:
        remove_stale_conversions(out, path)
    return out


def _conversion_dir(path: Path, folder: str) -> Path:
    """Where the .gguf file at `path` is converted under the models' cache `folder` (gguf.conversion_name)."""
    from fastspec.models.embedded import models_root
    from fastspec.models.gguf import conversion_name

    return models_root() / folder / conversion_name(path)


def resolve_tokenizer_dir(spec: str, vocab_size: int) -> Path:
    """A tokenizer given apart from the model -> the directory of its files: an embedded model's (its conversion), a
    .gguf file's (its tokenizer files alone, written once: converting a large model's weights for its tokenizer would
    cost their size), else a directory's or a hub id's (hub.resolve_tokenizer_dir). Its ids must fit the model's
    `vocab_size` rows (hub.check_tokenizer_fits)."""
    from fastspec.models import embedded
    from fastspec.models.gguf import CONVERSION_FOLDERS, held_conversion

    hub.check_tokenizer_spec(spec)
    path = Path(spec).expanduser()
    if spec in embedded.EMBEDDED_MODELS:
        return hub.check_tokenizer_fits(embedded.embedded_model_dir(spec), spec, vocab_size)
    if not hub.names_gguf(path) or not path.is_file():
        return hub.resolve_tokenizer_dir(spec, vocab_size)
    out, converted = held_conversion(path, partial(_conversion_dir, path, CONVERSION_FOLDERS[1]), tokenizer_only=True)
    if converted:  # (held: a later version's cannot remove it while read)
        embedded.remove_stale_conversions(out, path)
    return hub.check_tokenizer_fits(out, spec, vocab_size)


def resolve_draft_dir(spec: str, revision: str | None, target: ModelConfig, algorithm: str) -> Path:
    """The draft's directory (see resolve_model_dir). A hub id's config is fetched and checked against the target
    first (an EAGLE head's width and vocabulary; a STANDALONE model's or an MTP checkpoint's vocabulary), so a head
    that cannot fit is refused before its weights are downloaded or read."""
    if hub.is_hub_id(spec):
        config = read_config(hub.fetch(spec, revision, config_only=True))
        # a head labelled as a Llama model (EAGLE-1's): only its weights tell, so only its width is checked here
        maybe_head = algorithm in ("EAGLE", "EAGLE3") and config.architecture in LLAMA_FAMILY
        if config.is_draft or (algorithm == "EAGLE3" and not maybe_head):
            check_draft_fits(config, target, spec)
        elif maybe_head and config.hidden_size != target.hidden_size:
            raise FastspecError(f"{spec}: draft expects target features of width {config.hidden_size}, "
                                f"the target's hidden size is {target.hidden_size}")
        elif config.vocab_size != target.vocab_size:
            raise FastspecError(f"{spec}: draft vocabulary {config.vocab_size} != target vocabulary "
                                f"{target.vocab_size}")
    return resolve_model_dir(spec, revision)


def resolve_quantization(quantization: str | None, model_dir: Path, scheme: QuantScheme | None, device: str,
                         load_format: str, algorithm: str | None) -> str | None:
    """EngineConfig.quantization with `auto` decided and checked against the checkpoint: a quantised checkpoint's
    own method (dummy weights: the online rounding of its kind); gguf for a model converted from a .gguf file (its
    blocks stored) run on CPU with its real weights and no EAGLE-2 head (which needs the float lm_head); else None.
    A method the checkpoint contradicts is one line. `scheme`: the checkpoint's (checkpoint_scheme)."""
    from fastspec.models.gguf_blocks import BLOCKS_FILE

    if scheme is not None and load_format == "dummy":  # random weights: rounded at load as the checkpoint's kind
        return ("fp8" if scheme.kind == "fp8" else f"int{scheme.bits}") if quantization == "auto" else quantization
    if scheme is not None:
        if quantization in ("auto", scheme.method) or (quantization == "fp8" and scheme.kind == "fp8"):
            return scheme.method
        if quantization is None:
            return None
        raise OptionError(f"{{quantization=}} contradicts {{model_dir!s}}'s own quantisation ({scheme.label}); use "
                          f"auto, {scheme.method} or none (dequantised)", quantization=quantization,
                          model_dir=model_dir)
    if quantization in ("awq", "gptq", "compressed-tensors", "fbgemm_fp8", "modelopt"):
        raise OptionError("{quantization=}: {model_dir!s} is a float checkpoint (no quantization_config); fp8, "
                          "int8 or int4 round one at load", quantization=quantization, model_dir=model_dir)
    if quantization != "auto":
        return quantization
    converted = (Path(model_dir) / BLOCKS_FILE).is_file()
    return "gguf" if converted and device == "cpu" and load_format == "auto" and algorithm != "EAGLE" else None


def check_int4_rounding(quantization: str | None, config: ModelConfig, model_dir: Path) -> None:
    """int4 rounding at load takes groups of 32 inputs: a model whose hidden size is not a multiple of that would
    keep every projection that reads the hidden state float (one line, before any weight is read)."""
    from fastspec.models.gguf_blocks import BLOCK

    if quantization == "int4" and config.hidden_size % BLOCK:
        raise OptionError(f"{{quantization=}} rounds groups of {BLOCK} inputs, but {{model_dir!s}}'s hidden size "
                          f"{config.hidden_size} is not a multiple of {BLOCK}; use int8 or fp8 (per channel)",
                          quantization=quantization, model_dir=model_dir)


def generation_eos_ids(model_dir, config_eos: tuple[int, ...]) -> frozenset[int]:
    """EOS ids from config.json and generation_config.json (either may list several)."""
    ids = set(config_eos)
    path = model_dir / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)
