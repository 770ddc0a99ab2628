"""Start-up's one resolve step: what the user named (an embedded model, a directory, a .gguf file, a hub id; a draft)
-> the directories and configs every later stage reads, as one frozen `ModelSources`; and the steps it is made of
(`resolve_model_dir`: a spec to a directory, converting a .gguf file once; `resolve_quantization`).

Reads config.json files and the quantisation scheme once, and runs every check that needs no weights: the draft
head against the target (width, vocabulary, EAGLE vs EAGLE-3, aux layers), a STANDALONE draft, an MTP draft, and
`--quantization` against the checkpoint. Loads no tensors (fastspec.models.assemble does, from this value).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from fastspec.config import resolve_dtype
from fastspec.errors import FastspecError, first_line
from fastspec.models import hub
from fastspec.models.draft_loader import check_draft_fits, read_draft_config
from fastspec.models.hub import check_model_spec
from fastspec.models.loader import check_target, read_config, weight_files
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
    eos_ids: frozenset[int]  # config.json's and generation_config.json's
    scheme: QuantScheme | None  # a quantised checkpoint's method and layout (None: float weights)
    quantization: str | None  # EngineConfig.quantization with `auto` decided (resolve_quantization)
    draft_dir: Path | None = None  # EAGLE / EAGLE3 / STANDALONE: the draft (an MTP draft: the target's own dir)
    draft_config: ModelConfig | None = None  # as read_draft_config reads it
    draft_scheme: QuantScheme | None = None  # a STANDALONE / MTP draft checkpoint's quantisation (None: float)
    draft_quantization: str | None = None  # "auto": that draft kept in its stored form; None: float or dequantised


def resolve_sources(model: str, algorithm: str | None, draft_model: str | None = None, *, revision: str | None = None,
                    draft_revision: str | None = None, quantization: str | None = "auto", device: str = "cpu",
                    load_format: str = "auto") -> ModelSources:
    """`algorithm` as the user named it (NEXTN: EAGLE with the checkpoint's MTP layer). Hub ids are fetched (the
    draft's config first, so a head that cannot fit is refused before its weights download)."""
    named, algorithm, asked = algorithm, check_spec_flags(algorithm), quantization
    model_dir = resolve_model_dir(model, revision)
    config = read_config(model_dir)
    check_target(config, model_dir)
    scheme = checkpoint_scheme(model_dir)
    quantization = resolve_quantization(quantization, model_dir, scheme, device, load_format, algorithm)
    check_int4_rounding(quantization, config, model_dir)
    draft_dir = draft_config = draft_scheme = None
    if algorithm in DRAFTED:
        draft = mtp_draft(str(model_dir), model_dir, config, named, draft_model)
        if draft is None:
            raise FastspecError(f"{algorithm} needs a draft model (--speculative-draft-model-path / --draft)")
        draft_dir = resolve_draft_dir(draft, draft_revision, config, algorithm)
        draft_config = read_draft_config(draft_dir, algorithm)
        check_draft(algorithm, draft_config, config, draft_dir, quantization)
        stored = algorithm == "STANDALONE" or drafts_with_mtp(algorithm, draft_config)  # checkpoints, not heads
        draft_scheme = checkpoint_scheme(draft_dir) if stored else None
    keep_draft = draft_scheme is not None and asked is not None and load_format != "dummy"  # unless --quantization none
    return ModelSources(model_dir, config, generation_eos_ids(model_dir, config.eos_token_ids), scheme, quantization,
                        draft_dir, draft_config, draft_scheme, "auto" if keep_draft else None)


def resolve_model_dtype(dtype: str, device: str, sources: ModelSources) -> str:
    """--dtype with auto decided for these models (config.resolve_dtype). On the CPU a float checkpoint stored in
    bfloat16 keeps its dtype where fastspec's GEMM multiplies it with the CPU's bfloat16 dot products (AVX512-BF16,
    AMX: half the bytes a decode step reads, 1.6-2.0x float32's one-row product by bench/bench_dtype_probe.py on an
    EPYC with them; without them the widening costs what the bytes save), and any 16-bit checkpoint keeps its dtype
    where a float32 copy would not fit in memory; else, and for quantised or dequantised weights (float32: the exact
    reference), float32. Decided by the CPU's flags, not timed at start-up: a busy machine measures anything."""
    stored = sources.config.torch_dtype
    if (dtype != "auto" or device != "cpu" or stored not in ("bfloat16", "float16") or sources.scheme is not None
            or sources.quantization is not None):
        return resolve_dtype(dtype, device, stored)
    from fastspec.kernels import cpu_library
    from fastspec.memory.kv_pool import available_bytes

    if _need(sources.model_dir, sources.config, None, "float32") > 0.8 * available_bytes("cpu"):
        return stored  # float32 would not fit (with room left for the KV cache)
    return stored if stored == "bfloat16" and cpu_library.has_bf16_dot() else "float32"


def check_weights_fit(sources: ModelSources, dtype: str, device: str) -> None:
    """A target whose weights cannot fit in the memory `device` has free: one line before loading (it would be
    killed for memory midway on a CPU, or fail in torch on a GPU). The need is the checkpoint's bytes and its
    draft's, scaled to `dtype` for float weights (an online quantisation holds them in it first), a lower bound for
    quantised ones."""
    from fastspec.memory.kv_pool import available_bytes

    need = _need(sources.model_dir, sources.config, sources.scheme, dtype, sources.quantization is None)
    drafted = sources.draft_dir not in (None, sources.model_dir)  # (an MTP draft is the target's own checkpoint)
    if drafted:
        need += _need(sources.draft_dir, sources.draft_config, sources.draft_scheme, dtype,
                      sources.draft_quantization is None)
    free = available_bytes(device)
    if need > free:
        hint = ("pass --dtype bfloat16 (--quantization int8 / int4 rounds the weights after loading them in --dtype)"
                if dtype == "float32" else "use a quantised checkpoint (GGUF, GPTQ, AWQ: loaded as stored)")
        raise FastspecError(f"{sources.model_dir}{' and its draft' if drafted else ''}: the weights need "
                            f"{need / 2**30:.1f} GiB as {dtype} and {device} has {free / 2**30:.1f} GiB free; {hint}, "
                            "or free memory")


def _need(directory: Path, config: ModelConfig, scheme: QuantScheme | None, dtype: str,
          dequantised: bool = False) -> int:
    """The bytes `directory`'s weights take loaded in `dtype`: a float checkpoint's scaled from the dtype its tensors
    are stored in, a quantised one's as stored (a lower bound) or, `dequantised` (--quantization none), each of its
    values in `dtype`."""
    if scheme is not None and not dequantised:
        return _stored_bytes(directory)
    shapes = _headers(directory)
    if scheme is not None and shapes is not None:
        # int32 words hold 32 / bits values (GPTQ / AWQ / compressed-tensors packing; their packed zero points and
        # g_idx are counted alike: a group's share too many); every other element one value
        return sum(math.prod(shape) * (32 // scheme.bits if code == "I32" else 1)
                   for code, shape in shapes) * _ITEMSIZE[dtype]
    need, stored = _stored_bytes(directory), _stored_dtype(shapes, config)
    return need * _ITEMSIZE[dtype] // _ITEMSIZE[stored] if scheme is None and stored in _ITEMSIZE else need


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def _headers(model_dir: Path) -> list[tuple[str, list[int]]] | None:
    """(dtype code, shape) of each tensor in `model_dir`'s *.safetensors, from their headers; None for .bin files."""
    from safetensors import safe_open

    files = weight_files(model_dir)
    if not files or files[0].suffix != ".safetensors":
        return None
    shapes = []
    for path in files:
        try:
            with safe_open(str(path), "pt") as handle:
                shapes += [(s.get_dtype(), s.get_shape()) for s in map(handle.get_slice, handle.keys())]
        except Exception as e:  # (a download cut short: the loader's line, before it; no common error class)
            raise FastspecError(f"{path}: corrupt or truncated weights file ({first_line(e, None)})") from None
    return shapes


def _stored_dtype(shapes: list | None, config: ModelConfig) -> str | None:
    """The float dtype most of the checkpoint's values are stored in: config.json's torch_dtype may disagree with
    the tensors (an fp16 export whose config says float32 would be counted at twice its size); config's where the
    headers can't say."""
    values: dict[str, int] = {}
    for code, shape in shapes or ():
        values[code] = values.get(code, 0) + math.prod(shape)
    return _SAFETENSORS_DTYPES.get(max(values, key=values.get), config.torch_dtype) if values else config.torch_dtype


def _stored_bytes(model_dir: Path) -> int:
    """The bytes of the weight files the loader reads: *.safetensors (else pytorch_model*.bin), and a converted
    GGUF's blocks' quants (the packed kernels hold at least those; the blocks file's float32 scales and offsets are
    repacked smaller, so its size would overstate them)."""
    return sum(f.stat().st_size for f in weight_files(model_dir)) + _block_quant_bytes(model_dir)


def _block_quant_bytes(model_dir: Path) -> int:
    from safetensors import safe_open

    from fastspec.models.gguf_blocks import BLOCKS_FILE

    if not (model_dir / BLOCKS_FILE).is_file():
        return 0
    with safe_open(str(model_dir / BLOCKS_FILE), "pt") as blocks:  # (the header only: 1-byte quants, 4-bit packed)
        return sum(math.prod(blocks.get_slice(k).get_shape()) for k in blocks.keys() if k.endswith(".q"))


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
    if drafts_with_mtp(algorithm, draft):  # NEXTN
        check_mtp_fits(draft, target, str(draft_dir))
        return
    if (algorithm == "EAGLE3") != draft.is_eagle3:
        wanted = "LlamaForCausalLMEagle3" if algorithm == "EAGLE3" else "LlamaForCausalLMEagle"
        hint = "" if draft.is_draft else " (a full model: STANDALONE drafts with one)"
        raise FastspecError(f"{draft_dir}: {algorithm} needs a {wanted} head, got {draft.architecture}{hint}")
    check_draft_fits(draft, target, str(draft_dir))
    if quantization == "gguf" and not draft.is_eagle3:  # an EAGLE-2 head multiplies by the target's lm_head weight
        raise FastspecError(f"{draft_dir}: an EAGLE-2 head needs the target's float lm_head, which --quantization "
                            "gguf does not keep (use an EAGLE-3 head, or no --quantization)")


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
    return _converted_gguf(path) if path.suffix == ".gguf" else path


def _converted_gguf(path: Path) -> Path:
    """The conversion of the .gguf file at `path` (converted once per path, size and time; converting a new version
    removes the earlier versions' conversions)."""
    from fastspec.models.embedded import is_current_conversion, models_root, remove_stale_conversions
    from fastspec.models.gguf import convert_gguf

    stat, real = path.stat(), path.resolve()  # (a symlink shares its file's conversion)
    key = hashlib.sha1(f"{real}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = models_root() / "gguf" / f"{real.stem}-{key}"
    if is_current_conversion(out, path):
        return out
    log.warning("%s: converting it into %s (once: later starts read that)", path.name, out)
    convert_gguf(path, out)
    remove_stale_conversions(out, path)
    return out


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
        raise FastspecError(f"--quantization {quantization} contradicts {model_dir}'s own quantisation "
                            f"({scheme.label}); use auto, {scheme.method} or none (dequantised)")
    if quantization in ("awq", "gptq", "compressed-tensors", "fbgemm_fp8", "modelopt"):
        raise FastspecError(f"--quantization {quantization}: {model_dir} is a float checkpoint (no "
                            "quantization_config); fp8, int8 or int4 round one at load")
    if quantization != "auto":
        return quantization
    converted = (Path(model_dir) / BLOCKS_FILE).is_file()
    return "gguf" if converted and device == "cpu" and load_format == "auto" and algorithm != "EAGLE" else None


def check_int4_rounding(quantization: str | None, config: ModelConfig, model_dir: Path) -> None:
    """int4 rounding at load takes groups of 32 inputs: a model whose hidden size is not a multiple of that would
    keep every projection that reads the hidden state float (one line, before any weight is read)."""
    from fastspec.models.gguf_blocks import BLOCK

    if quantization == "int4" and config.hidden_size % BLOCK:
        raise FastspecError(f"--quantization int4 rounds groups of {BLOCK} inputs, but {model_dir}'s hidden size "
                            f"{config.hidden_size} is not a multiple of {BLOCK}; use int8 or fp8 (per channel)")


def generation_eos_ids(model_dir, config_eos: tuple[int, ...]) -> frozenset[int]:
    """EOS ids from config.json and generation_config.json (either may list several)."""
    ids = set(config_eos)
    path = model_dir / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)
