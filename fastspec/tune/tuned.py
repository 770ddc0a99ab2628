"""The tuned file: per batch-size tree shapes that `fastspec tune` chose, keyed by a fingerprint.

A tuned file is only valid for the hardware, target, draft and dtype it was measured on; `load_schedule`
ignores (with a message) a file whose fingerprint differs, and refuses (FastspecError) one naming a tree
shape that cannot exist. Lives in <cache>/tuned/<target>--<draft>.json. Knows nothing about tuning itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

import torch

from fastspec.config import Schedule, SpecParams, _check_tree
from fastspec.errors import FastspecError
from fastspec.models.embedded import cache_root

VERSION = 1


def fingerprint(model_dir: Path, draft_dir: Path, dtype: str, device: str) -> dict:
    return {"hardware": _hardware(device), "model": _dir_digest(model_dir), "draft": _dir_digest(draft_dir),
            "dtype": dtype, "torch": torch.__version__}


def tuned_path(model_dir: Path, draft_dir: Path) -> Path:
    return cache_root() / "tuned" / f"{Path(model_dir).name}--{Path(draft_dir).name}.json"


def save_tuned(path: Path, print_: dict, tiers: list[dict]) -> None:
    """tiers: [{"max_batch_size", "params": [num_steps, topk, num_draft_tokens] or null, ...measurements}]."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"version": VERSION, "fingerprint": print_, "tiers": tiers}, indent=1) + "\n")
    os.replace(tmp, path)


def read_tuned(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
        tiers = data["tiers"]
        schedule_of(tiers)
        return data
    except FastspecError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise FastspecError(f"tuned file {path}: unreadable ({e.__class__.__name__}: {e})") from None


def schedule_of(tiers: list[dict]) -> Schedule:
    out = []
    for t in tiers:
        params = t["params"]
        if params is not None:
            if len(params) != 3 or not all(isinstance(v, int) for v in params):
                raise FastspecError(f"tuned file: params must be [num_steps, topk, num_draft_tokens], got {params}")
            try:
                _check_tree(*params)
            except FastspecError as e:
                raise FastspecError(f"tuned file names an impossible tree {params}: {e}") from None
            params = SpecParams(*params)
        if not isinstance(t["max_batch_size"], int) or t["max_batch_size"] < 1:
            raise FastspecError(f"tuned file: max_batch_size must be a positive integer, got {t['max_batch_size']}")
        out.append((t["max_batch_size"], params))
    if not any(p is not None for _, p in out):
        return ()  # every tier is "off": nothing to switch, the caller decodes plainly
    return tuple(out)


def load_schedule(path: Path, print_: dict, say=lambda message: None) -> tuple[Schedule, bool] | None:
    """(schedule, every tier off) from the tuned file at `path` if it exists and matches `print_`, else None."""
    if not Path(path).exists():
        return None
    data = read_tuned(path)
    if data.get("version") != VERSION or data.get("fingerprint") != print_:
        differs = [k for k in print_ if data.get("fingerprint", {}).get(k) != print_[k]]
        say(f"ignoring tuned file {path}: measured with a different {', '.join(differs) or 'version'}")
        return None
    schedule = schedule_of(data["tiers"])
    return schedule, not schedule


def _hardware(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} x{os.cpu_count()} threads={torch.get_num_threads()}"


def _dir_digest(directory: Path) -> str:
    """config.json + every weight file (whole below 64 MB, else its size and first 4 MB): a guard against
    stale tuning that costs milliseconds, not a signature."""
    h = hashlib.sha256((Path(directory) / "config.json").read_bytes())
    for f in sorted(Path(directory).glob("*.safetensors")) + sorted(Path(directory).glob("*.bin")):
        size = f.stat().st_size
        with f.open("rb") as fh:
            h.update(f"{f.name}:{size}".encode() + fh.read(size if size < 64 << 20 else 4 << 20))
    return h.hexdigest()[:16]


def find_schedule(model_dir: Path, draft_model: str, dtype: str, device: str) -> tuple[Schedule, bool] | None:
    """The tuned schedule for this target, draft, dtype and machine, if `fastspec tune` wrote one."""
    import sys

    from fastspec.models.loader import resolve_model_dir

    draft_dir = resolve_model_dir(draft_model)
    say = lambda message: print(message, file=sys.stderr)  # noqa: E731
    return load_schedule(tuned_path(model_dir, draft_dir), fingerprint(model_dir, draft_dir, dtype, device), say)
