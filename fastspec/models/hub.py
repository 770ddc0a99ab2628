"""Hugging Face hub ids (`org/name`, as SGLang, vLLM and transformers name models and EAGLE-3 heads) -> a local
model directory: the snapshot in the local hub cache, or downloaded into it (with huggingface_hub's progress bars)
when the hub is reachable and HF_HUB_OFFLINE is not set.

The cache is read where huggingface_hub keeps it ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub),
read from the environment at each call (huggingface_hub reads it once, at import). Every failure a user can cause
(offline and not cached, an unknown revision, a snapshot missing a shard its index names) is one FastspecError
naming the id, the revision and the cache searched. Nothing here reads weights.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

from fastspec.errors import FastspecError, first_line

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name: one slash, no leading ./ or /
CONFIG_FILES = ["config.json"]
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]  # no .bin, .gguf, .onnx
BIN_FILES = ["pytorch_model*.bin"]  # fetched only for a repo without safetensors (EAGLE heads published as .bin)
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"]


def is_hub_id(spec: str) -> bool:
    """`org/name` that is not a path on this machine (a local directory of that name wins, as in transformers)."""
    return bool(HUB_ID.match(spec)) and not Path(spec).expanduser().exists()


def names_gguf(path: Path) -> bool:
    """Whether `path` is named as a GGUF file (.gguf in any case: llama.cpp's Model.Q4_0.GGUF too) and is not a
    directory (a directory so named is a directory)."""
    return path.suffix.lower() == ".gguf" and not path.is_dir()


def hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "on", "yes", "true")


def fetch(repo_id: str, revision: str | None = None, config_only: bool = False) -> Path:
    """The local snapshot directory of `repo_id` at `revision` (a branch, tag or commit; None: main): its
    config.json only (`config_only`: enough to check a model before its weights are fetched) or every file a
    model loads (configs, safetensors, tokenizer). From the cache when it holds them, else downloaded."""
    from huggingface_hub import snapshot_download

    patterns = CONFIG_FILES if config_only else MODEL_FILES
    where = f"{repo_id}" + (f" at revision {revision}" if revision else "")
    cache = hub_cache()
    path = _cached_or_none(repo_id, revision, patterns, where)
    if path is not None and (path / "config.json").is_file() and (config_only or _has_weights(path)):
        return path if config_only else _checked(path, where)
    if offline():
        if path is not None:  # cached, but not whole: say what the snapshot lacks, not that it is absent
            raise FastspecError(f"{path}: {_lacks(path)} (the cached snapshot of {where}; HF_HUB_OFFLINE is set)")
        raise FastspecError(f"{where} is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE is set "
                            f"(download it where the hub is reachable, or give a local directory)")
    try:
        path = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=patterns))
        if not config_only and not _has_weights(path):  # no safetensors: its PyTorch .bin weights
            path = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=BIN_FILES))
    except Exception as e:
        raise FastspecError(f"{where}: not in the Hugging Face cache {cache}, and downloading it failed: "
                            f"{first_line(e, 200)}") from None
    if not (path / "config.json").is_file():
        raise FastspecError(f"{where} has no config.json: not a Hugging Face model")
    return path if config_only else _checked(path, where)


def _cached_or_none(repo_id: str, revision: str | None, patterns, where: str) -> Path | None:
    """The cached snapshot of `repo_id` at `revision` (None: not cached, to be downloaded); an error of the cache
    other than a missing entry is a FastspecError naming `where` (huggingface_hub's errors differ across versions)."""
    try:
        return _cached_snapshot(repo_id, revision, patterns)
    except Exception as e:
        if not offline() and not _is_missing(e):
            raise FastspecError(f"{where}: {first_line(e, 200)}") from None
        return None


def fetch_tokenizer(repo_id: str) -> Path:
    """The local snapshot of `repo_id` (main) holding its tokenizer files (TOKENIZER_FILES; no config, no
    weights): from the cache when it holds tokenizer.json, else downloaded unless HF_HUB_OFFLINE is set."""
    from huggingface_hub import snapshot_download

    path = _cached_or_none(repo_id, None, TOKENIZER_FILES, repo_id)
    if path is None or not (path / "tokenizer.json").is_file():
        if offline():
            raise FastspecError(f"{repo_id}'s tokenizer.json is not in the Hugging Face cache {hub_cache()} and "
                                "HF_HUB_OFFLINE is set (download it where the hub is reachable, or give a directory)")
        try:
            path = Path(snapshot_download(repo_id, cache_dir=hub_cache(), allow_patterns=TOKENIZER_FILES))
        except Exception as e:
            raise FastspecError(f"{repo_id}: not in the Hugging Face cache {hub_cache()}, and downloading its "
                                f"tokenizer failed: {first_line(e, 200)}") from None
    if not (path / "tokenizer.json").is_file():
        raise FastspecError(f"{repo_id} has no tokenizer.json")
    return path


def cached_config(repo_id: str) -> Path | None:
    """The cached snapshot of `repo_id` (main) if it holds its config.json, else None; never downloads."""
    try:
        path = _cached_snapshot(repo_id, None, CONFIG_FILES)
    except Exception:  # not cached, whatever huggingface_hub calls that
        return None
    return path if (path / "config.json").is_file() else None


def _cached_snapshot(repo_id: str, revision: str | None, patterns: list[str]) -> Path:
    """The snapshot directory the hub cache holds for `repo_id` at `revision`; raises what huggingface_hub raises
    when it holds none."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, revision=revision, cache_dir=hub_cache(), allow_patterns=patterns,
                                  local_files_only=True))


def _is_missing(error: Exception) -> bool:
    """The error huggingface_hub raises offline for what the cache does not hold."""
    names = {type(e).__name__ for e in (error, error.__cause__, error.__context__) if e is not None}
    return bool(names & {"LocalEntryNotFoundError", "FileNotFoundError", "EntryNotFoundError", "OfflineModeIsEnabled"})


def _has_weights(path: Path) -> bool:
    """safetensors (or their index), else PyTorch .bin files (read with weights_only by the loader)."""
    return (any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file()
            or any(path.glob("pytorch_model*.bin")))


def _lacks(path: Path) -> str:
    """What keeps a cached snapshot from loading, in the loader's words."""
    if not (path / "config.json").is_file():
        return "no config.json"
    return "no *.safetensors or pytorch_model*.bin weights"


def _checked(path: Path, where: str) -> Path:
    """Refuse a snapshot whose index names shards it does not hold (a download cut short, a partial cache)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        except (OSError, ValueError, AttributeError) as e:
            raise FastspecError(f"{where}: cannot read {index.name} ({first_line(e, 120)})") from None
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise FastspecError(f"{where}: the cached snapshot {path} lacks {len(missing)} of {len(shards)} "
                                f"weight shards ({missing[0]}...); download it again")
    return path


def check_model_spec(spec: str, flag: str = "model", head: bool = False) -> None:
    """Refuse a model spec that names nothing, before anything is read or converted. `head`: a draft head, which
    is a directory or a hub id only (no .gguf file, no embedded name)."""
    from fastspec.models import embedded

    if is_hub_id(spec) or spec in embedded.EMBEDDED_MODELS and not head:  # a hub id is looked up when resolved
        return
    path = Path(spec).expanduser()
    if names_gguf(path) and not head:
        if not path.is_file():
            raise FastspecError(f"{flag} file {spec} does not exist")
        return
    if not path.exists():
        known = ", ".join(embedded.EMBEDDED_MODELS)
        kinds = ("a directory nor a Hugging Face hub id (org/name)" if head else "a directory, a .gguf file, a Hugging "
                 f"Face hub id (org/name) nor an embedded model ({known})")
        raise FastspecError(f"{flag} {spec!r} is neither {kinds}")
    if not path.is_dir():
        kinds = "" if head else "a .gguf file, or "
        raise FastspecError(f"{flag} {spec} is a file, not a model directory ({kinds}a directory with config.json)")
    if not (path / "config.json").is_file():
        raise FastspecError(f"{flag} directory {spec} has no config.json")


def check_tokenizer_spec(spec: str) -> None:
    """Refuse a tokenizer (given apart from the model) that names nothing, before anything is read: it is a hub id
    (looked up when resolved), a directory holding tokenizer.json, an embedded model's name or a .gguf file (their
    tokenizer files: sources.resolve_tokenizer_dir). Empty or blank is refused (it read the current directory)."""
    from fastspec.models import embedded

    kinds = ("a directory with tokenizer.json, a Hugging Face hub id (org/name), a .gguf file {} an embedded model ("
             + ", ".join(embedded.EMBEDDED_MODELS) + ")")
    if not spec.strip():
        raise FastspecError(f"tokenizer is empty: give {kinds.format('or')}")
    path = Path(spec).expanduser()
    if is_hub_id(spec) or spec in embedded.EMBEDDED_MODELS or (path / "tokenizer.json").is_file():
        return
    if names_gguf(path):
        if not path.is_file():
            raise FastspecError(f"tokenizer file {spec} does not exist")
        return
    what = "has no tokenizer.json" if path.is_dir() else f"is neither {kinds.format('nor')}"
    raise FastspecError(f"tokenizer {spec} {what}")


def resolve_tokenizer_dir(spec: str, vocab_size: int) -> Path:
    """The directory of a tokenizer given apart from the model (vLLM's `tokenizer`, for a checkpoint shipped
    without one) as a local directory or a hub id (its tokenizer files: fetch_tokenizer), checked by
    check_tokenizer_fits."""
    check_tokenizer_spec(spec)
    return check_tokenizer_fits(fetch_tokenizer(spec) if is_hub_id(spec) else Path(spec).expanduser(), spec,
                                vocab_size)


def check_tokenizer_fits(directory: Path, spec: str, vocab_size: int) -> Path:
    """`directory` (tokenizer `spec`'s files) when its ids fit the model's `vocab_size` embedding rows: a larger one
    is refused (its tokens would index past them), as is a tokenizer.json that cannot be read."""
    path = directory / "tokenizer.json"
    try:
        ids = read_tokenizer(path).get_vocab(with_added_tokens=True).values()
    except Exception as e:
        raise FastspecError(f"{path}: cannot load the tokenizer ({first_line(e, None)})") from None
    largest = max(ids, default=-1)
    if largest >= vocab_size:
        raise FastspecError(f"tokenizer {spec} does not fit the model: it has token ids up to {largest}, the model's "
                            f"vocabulary {vocab_size}")
    return directory


def tokenizer_eos_ids(directory: Path, vocab_size: int) -> frozenset[int]:
    """The id of the eos token a tokenizer's config names, where the model's `vocab_size` rows hold it (none
    otherwise, or without tokenizer.json): an answer ends with it too, as vLLM stops on its tokenizer's eos besides
    generation_config's (Llama-3-Instruct's config.json names <|end_of_text|>, its tokenizer <|eot_id|>). Files that
    cannot be read add none: token ids still run, and text is the tokenizer's own one-line refusal."""
    config_file, tokenizer_file = directory / "tokenizer_config.json", directory / "tokenizer.json"
    try:
        eos = json.loads(config_file.read_text()).get("eos_token") if config_file.is_file() else None
        eos = eos.get("content") if isinstance(eos, dict) else eos
        found = (read_tokenizer(tokenizer_file).token_to_id(eos)
                 if isinstance(eos, str) and tokenizer_file.is_file() else None)
    except Exception:  # (malformed JSON, a tokenizer.json this tokenizers version refuses, a config that is no dict)
        return frozenset()
    return frozenset() if found is None or found >= vocab_size else frozenset([found])


def read_tokenizer(path: Path):
    """The tokenizers.Tokenizer of the tokenizer.json at `path`, parsed once per process and version of the file:
    start-up reads it for the stop ids and the vocabulary check, the LLM for its text, a grammar for its vocabulary
    (~0.2 s each for a 49k-token BPE). Shared: callers only read it. Raises what tokenizers raises."""
    stat = path.stat()
    return _parsed_tokenizer(str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _parsed_tokenizer(path: str, inode: int, size: int, mtime_ns: int):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)
