"""GGUF -> Hugging Face directory conversion for the llama, qwen2, qwen3, phi3 and qwen3moe architectures (phi3 as a
Llama: its fused QKV and gate_up rows split; a llama with an expert_count as Mixtral): a MoE's experts, stacked [E, ...]
in one GGUF tensor per projection (or one per expert, as llama.cpp's early Mixtral files), are written as
transformers' per-expert weights (each expert's blocks, where they are of a block type).

Owns: writing the directory, published atomically (the tokenizer: gguf_tokenizer; how processes share the cache:
shared_dirs), or a GGUF's tokenizer files alone (write_gguf_tokenizer, for a tokenizer given apart): every tensor
of a block format as its blocks only (BLOCKS_FILE: what --quantization gguf runs, see gguf_packed; a float load
dequantises them, gguf_blocks.stored_floats), the others dequantised in model.safetensors, and each tensor's GGUF
type; its SOURCE_MARKER, the "convert once, reuse after" check (is_current_conversion) and its use by a reader
(held_conversion: checked under the reader's hold), and the name of a .gguf path's conversion (conversion_name).
Does not own: reading the tensors (gguf_read; their names: gguf_names), the configs its metadata maps to (gguf_config;
the rope scaling a file describes: gguf_rope), which GGUF to convert or where to cache it (embedded.py), nor loading
the result (loader.py).
"""

import hashlib
import json
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors.torch import save_file

from fastspec.errors import FastspecError
from fastspec.models.gguf_blocks import BLOCKS_FILE
from fastspec.utils.shared_dirs import hold_for_reading, publish, staging
from fastspec.models.gguf_config import generation_config, meta, model_config, reader_meta
from fastspec.models.gguf_names import ARCHITECTURES, arch_spec
from fastspec.models.gguf_read import open_reader, read_tensors
from fastspec.models.gguf_tokenizer import adds_bos, build_tokenizer, special_id

CONVERTER_VERSION = 8  # bump when the output layout changes, so cached conversions are redone
SOURCE_MARKER = "fastspec_source.json"
TOKENIZER_ONLY = "tokenizer"  # the marker's dtype of a directory holding the tokenizer files alone (no weights)
CONVERSION_NAME = re.compile(r".+-[0-9a-f]{12}")  # conversion_name's: <stem>-<key>
CONVERSION_FOLDERS = ("gguf", "gguf-tokenizers")  # the models' cache folders of .gguf paths' conversions (sources.py)
_ATTEMPTS = 3  # conversions published by this process before one is still current when held (held_conversion)


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Convert a llama / qwen2 / qwen3 / phi3 / qwen3moe GGUF into a HF model directory at `out_dir`, published
    atomically (shared_dirs: a conversion of this very file published meanwhile by another process is kept, not
    replaced under its readers); returns out_dir."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = open_reader(gguf_path)
    arch = meta(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise FastspecError(f"{gguf_path}: GGUF architecture '{arch}' is not supported "
                            f"(supported: {', '.join(ARCHITECTURES)})")
    tensors, blocks, kinds = read_tensors(reader, gguf_path, dtype, arch)
    config = model_config(reader, dtype, arch, arch_spec(reader, arch), gguf_path)
    with _publishing(gguf_path, out_dir, config["torch_dtype"]) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "model.safetensors").chmod(0o644)
        del tensors
        (tmp / BLOCKS_FILE).parent.mkdir(mode=0o755)
        save_file(blocks, str(tmp / BLOCKS_FILE), metadata={"format": "pt", "kinds": json.dumps(kinds)})
        (tmp / BLOCKS_FILE).chmod(0o644)
        del blocks
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", generation_config(reader, config))
        _write_tokenizer(reader, tmp)
    return out_dir


def write_gguf_tokenizer(gguf_path: Path, out_dir: Path) -> Path:
    """The tokenizer files of a GGUF alone (tokenizer.json, tokenizer_config.json; no tensor read) at `out_dir`,
    published atomically as convert_gguf's directories are (its marker's dtype TOKENIZER_ONLY); returns out_dir."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = open_reader(gguf_path)
    with _publishing(gguf_path, out_dir, TOKENIZER_ONLY) as tmp:
        _write_tokenizer(reader, tmp)
    return out_dir


def held_conversion(gguf_path: Path, place: Callable[[], Path], tokenizer_only: bool = False,
                    announce: Callable[[Path], None] = lambda out_dir: None) -> tuple[Path, bool]:
    """(the directory, whether it was converted now): a current conversion of `gguf_path` (its tokenizer files alone:
    write_gguf_tokenizer) at `place()`, held for reading by this process (shared_dirs.hold_for_reading): checked
    current under the hold, so a conversion of another version (another file, fastspec or time) published meanwhile
    is never read unchecked nor left unheld. `place()` is asked again under the hold and before converting: a .gguf
    path's conversion is named by the file's size and time (conversion_name), and a name taken before the file was
    rewritten would hold another version's files. Converts (after `announce(directory)`) when it is not current.
    One line when another process's conversions replace each of this process's before it is held (the file
    rewritten all along)."""
    dtype = TOKENIZER_ONLY if tokenizer_only else "float32"
    converted = False
    for _ in range(_ATTEMPTS):
        out_dir = place()
        if hold_for_reading(out_dir, lambda d: d == place() and is_current_conversion(d, gguf_path, dtype)):
            return out_dir, converted
        out_dir = place()  # (the file may have been rewritten since: its conversion is named for what it is now)
        announce(out_dir)
        (write_gguf_tokenizer if tokenizer_only else convert_gguf)(gguf_path, out_dir)
        converted = True
    raise FastspecError(f"{gguf_path}: its conversion in {out_dir} was replaced by another process's "
                        f"{_ATTEMPTS} times before it could be read; is the file being rewritten?")


def conversion_name(gguf_path: Path) -> str:
    """The name of the conversion of the .gguf file at `gguf_path`: its stem and a key of its path, size and time (a
    symlink shares its file's), so each version of a file has its own."""
    stat, real = gguf_path.stat(), gguf_path.resolve()
    key = hashlib.sha1(f"{real}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return f"{real.stem}-{key}"


def _is_ours(path: Path) -> bool:
    """Whether the directory `path` is a conversion (its marker), or is named as only a conversion is in a folder of
    .gguf paths' conversions (CONVERSION_FOLDERS: the models' cache root, which FASTSPEC_MODEL_CACHE may share with
    other tools, proves nothing by a name): what proves an earlier fastspec's staging or replaced directory ours
    (shared_dirs.sweep)."""
    named = path.parent.name in CONVERSION_FOLDERS and CONVERSION_NAME.fullmatch(path.name) is not None
    return named or (path / SOURCE_MARKER).is_file()


@contextmanager
def _publishing(gguf_path: Path, out_dir: Path, dtype: str) -> Iterator[Path]:
    """A private directory for `out_dir`'s files (shared_dirs.staging); once the block has written them, its marker
    (`dtype`: the weights', or TOKENIZER_ONLY) and the directory published atomically (a conversion of this very file
    published meanwhile by another process is kept, not replaced under its readers). A full disk is one line."""
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        with staging(out_dir, _is_ours) as tmp:
            tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary model directory
            yield tmp
            _write_marker(tmp, gguf_path, dtype)
            publish(tmp, out_dir, lambda d: is_current_conversion(d, gguf_path, dtype))
    except OSError as e:  # (a full disk)
        raise _unwritable(out_dir, e) from None


def _unwritable(out_dir: Path, e: OSError) -> FastspecError:
    return FastspecError(f"cannot write the converted model into {out_dir.parent} ({e.strerror or e}); point "
                         "FASTSPEC_MODEL_CACHE (or FASTSPEC_CACHE) at a directory that can take it")


def _write_tokenizer(reader, out_dir: Path) -> None:
    m = reader_meta(reader)
    build_tokenizer(m).save(str(out_dir / "tokenizer.json"))
    tokens = m("tokenizer.ggml.tokens")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "add_bos_token": adds_bos(m), "add_eos_token": bool(m("tokenizer.ggml.add_eos_token", False)),
              "model_max_length": m(f"{m('general.architecture')}.context_length"),
              "fastspec_chat_special_tokens": True}  # text.tokenizer.CHAT_SPECIAL_TOKENS: chat as llama.cpp frames it
    for key in ("bos", "eos", "pad", "unk"):
        token_id = special_id(m, key)
        if token_id is not None:
            config[f"{key}_token"] = tokens[token_id]
    template = m("tokenizer.chat_template", None)
    if template is not None:
        config["chat_template"] = template
    _write_json(out_dir / "tokenizer_config.json", config)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_marker(tmp: Path, gguf_path: Path, dtype: str) -> None:
    """SOURCE_MARKER: the file converted (path, size, time), the dtype, the converter and every file written with
    its size (what is_current_conversion checks)."""
    stat = gguf_path.stat()
    files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
    _write_json(tmp / SOURCE_MARKER, {"gguf": str(gguf_path.resolve()), "size": stat.st_size,
                                      "mtime_ns": stat.st_mtime_ns, "dtype": dtype,
                                      "converter_version": CONVERTER_VERSION, "files": files})


def is_current_conversion(out_dir: Path, gguf_path: Path, dtype: str = "float32") -> bool:
    """True when out_dir was converted from this very GGUF (same path, size, mtime) in `dtype` by this converter and
    every file it wrote is still there at its size; False for a missing, foreign or damaged marker or a missing or cut
    file (the caller converts again)."""
    marker = read_marker(out_dir)
    if marker is None:
        return False
    stat, files = gguf_path.stat(), marker.get("files")
    return (marker.get("gguf") == str(gguf_path.resolve()) and marker.get("size") == stat.st_size
            and marker.get("mtime_ns") == stat.st_mtime_ns and marker.get("dtype") == dtype
            and marker.get("converter_version") == CONVERTER_VERSION and isinstance(files, dict) and bool(files)
            and all(_has_size(out_dir / name, size) for name, size in files.items()))


def read_marker(out_dir: Path) -> dict | None:
    """A converted directory's SOURCE_MARKER, or None when it is missing or damaged."""
    try:
        marker = json.loads((out_dir / SOURCE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _has_size(path: Path, size) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False
