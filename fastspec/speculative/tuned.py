"""The tuned file: per batch-size tree shapes that `fastspec tune` chose, keyed by a fingerprint.

A tuned file is only valid for the hardware, target, draft and dtype it was measured on; `load_schedule`
ignores, with one note, a file whose fingerprint differs or that is damaged (unreadable, or naming a tree shape
that cannot exist); `read_tuned` refuses such a file with a FastspecError. The engine settings its round costs
were measured under (`settings`: graphs, page size, attention backend, graph buckets) only shift which shape is
fastest, never what is decoded: a file measured under others is used, with one note. A new tune's tiers are merged
into a file of the same fingerprint and settings (`merge_tiers`; under the folder's lock: `add_tiers`), replacing it
otherwise. Lives in <cache>/tuned/<target>--<draft>--<dtype>-<device>.json, each model named by `model_name`.
Written by fastspec.tune; knows nothing about tuning itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from fastspec.errors import FastspecError
from fastspec.spec_config import Schedule, SpecParams, check_tree
from fastspec.utils import threads
from fastspec.utils.cache import cache_root
from fastspec.utils.files import write_atomic
from fastspec.utils.shared_dirs import locked

VERSION = 1


def weights_label(dtype: str, quantization: str | None, kv: str | None = None) -> str:
    """What a tuned file is keyed by besides the model: the dtype, the quantization when there is one (a packed
    target's rounds cost differently from its dequantised twin's) and the KV cache's dtype (`kv`: its torch name, as
    config.kv_cache_dtype_name resolves it) when it is not the model's (attention costs by the cache's bytes)."""
    label = dtype if quantization is None else f"{dtype}-{quantization}"
    return label if kv in (None, dtype) else f"{label}-kv-{kv}"


def fingerprint(model_dir: Path, draft_dir: Path, dtype: str, device: str) -> dict:
    return {"hardware": _hardware(device), "model": dir_digest(model_dir), "draft": dir_digest(draft_dir),
            "dtype": dtype, "torch": torch.__version__}


def tuned_path(model_dir: Path, draft_dir: Path, dtype: str, device: str) -> Path:
    """One file per target, draft, dtype and device kind: tuning one never replaces another's."""
    kind = device.split(":")[0]
    return cache_root() / "tuned" / f"{model_name(model_dir)}--{model_name(draft_dir)}--{dtype}-{kind}.json"


def model_name(directory: Path) -> str:
    """A readable name unique per model: the folder's name (a hub snapshot's: its repository's) and 8 hex digits
    of the resolved path, which also names a hub id and revision. E.g. /a/target -> target-3f9c0e12."""
    path = Path(directory).resolve()
    repo = path.parent.parent.name
    hub = path.parent.name == "snapshots" and repo.startswith("models--")
    name = (repo.split("--")[-1] if hub else path.name).lstrip("-") or "model"
    return f"{name}-{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"


def settings(config) -> dict:
    """The engine settings (of an EngineConfig, resolved) that a round's cost depends on beyond the fingerprint: with
    graphs, their batch buckets as --cuda-graph-bs / --cuda-graph-max-bs resolve them (a list, as JSON keeps it)."""
    buckets = None if config.graph_mode == "eager" else list(config.graph_buckets)
    return {"graphs": config.graph_mode, "page_size": config.page_size, "attention_backend": config.attention_backend,
            "graph_buckets": buckets}


def save_tuned(path: Path, print_: dict, tiers: list[dict], measured_under: dict | None = None) -> None:
    """tiers: [{"max_batch_size", "params": [num_steps, topk, num_draft_tokens] or null, ...measurements}];
    measured_under: the `settings` the costs were measured under (None: unknown, as in files written before them).
    Written atomically: a reader sees the old file or the new one, never half of one (also with two tunes at once)."""
    text = json.dumps({"version": VERSION, "fingerprint": print_, "tiers": tiers}
                      | ({} if measured_under is None else {"settings": measured_under}), indent=1) + "\n"
    write_atomic(path, lambda f: f.write(text.encode()))


@dataclass(frozen=True)
class Merged:
    """What a tune writes: its tiers and those of the file before it that it did not tune, sorted by batch size."""

    tiers: tuple[dict, ...]
    settings: dict  # what the tiers were measured under (graph buckets: both runs', when they agree on every tier)
    kept: tuple[int, ...] = ()  # batch sizes whose tiers come from the file before
    note: str | None = None  # why a file there was replaced rather than merged into


def merge_tiers(path: Path, print_: dict, tiers: list[dict], here: dict) -> Merged:
    """`tiers` (measured under `here`, the `settings`) merged into the tuned file at `path`: its tiers at other batch
    sizes are kept when it has this fingerprint and was measured under the same settings (its graph buckets placing
    each kept tier in the graph it ran in); else, or when damaged, it is replaced, with one note saying why."""
    ours = tuple(sorted(tiers, key=lambda t: t["max_batch_size"]))
    if not Path(path).exists():
        return Merged(ours, here)
    try:
        data = read_tuned(path)
    except FastspecError as e:
        return Merged(ours, here, note=f"replacing {e}")
    sizes = {t["max_batch_size"] for t in tiers}
    kept = [t for t in data["tiers"] if t["max_batch_size"] not in sizes]
    if not kept:
        return Merged(ours, here)  # every tier tuned again: nothing of the old file is left to keep
    why, measured_under = _mergeable(data, print_, here, kept, tiers)
    if why is not None:
        dropped = ", ".join(str(t["max_batch_size"]) for t in kept)
        return Merged(ours, here, note=f"replacing tuned file {path}, not adding to it: its tiers for bs {dropped} "
                                       f"were {why}")
    both = sorted(kept + list(tiers), key=lambda t: t["max_batch_size"])
    return Merged(tuple(both), measured_under, tuple(t["max_batch_size"] for t in kept))


def add_tiers(path: Path, print_: dict, tiers: list[dict], here: dict) -> Merged:
    """`merge_tiers`, then `save_tuned` of what it returns, under the lock of the file's folder (shared_dirs.locked):
    two tunes at once each add their tiers (unlocked, the one that read first and wrote last dropped the other's)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # (the lock file lives there)
    with locked(Path(path).parent, ".fastspec-tuned.lock"):
        merged = merge_tiers(path, print_, tiers, here)
        save_tuned(path, print_, list(merged.tiers), merged.settings)
    return merged


def _mergeable(data: dict, print_: dict, here: dict, kept: list[dict], tiers: list[dict]) -> tuple[str | None, dict]:
    """(None, the merged file's settings) when the `kept` tiers of `data` can join `tiers`; else (why not, here)."""
    if (stale := staleness(data, print_)) is not None:
        return stale, here
    recorded = data.get("settings")
    if not (isinstance(recorded, dict) and set(here) <= set(recorded)):
        return "measured under engine settings it does not record", here
    if (merged := _merged_settings(recorded, here, kept, tiers)) is not None:
        return None, merged
    if (other := other_settings({"settings": recorded, "tiers": kept}, here)) is not None:
        return f"measured with {other}", here
    return (f"measured with graph buckets {recorded['graph_buckets']}, that and this run's {here['graph_buckets']} "
            "cannot be recorded together"), here


def _merged_settings(recorded: dict, here: dict, kept: list[dict], tiers: list[dict]) -> dict | None:
    """The settings a merged file records, None when the kept tiers were measured under others. Graph buckets: the
    union of both runs', when it places every tier in the graph it ran in. E.g. kept bs 4, 8 under [1, 2, 4, 8], new
    bs 1 under [1, 2] -> [1, 2, 4, 8]; kept bs 3 under [1, 4] (in graph 4), new bs 1 under [1, 2, 3] -> None (the
    union [1, 2, 3, 4] would say bs 3 ran in graph 3)."""
    if any(recorded[k] != v for k, v in here.items() if k != "graph_buckets"):
        return None
    theirs, ours = recorded["graph_buckets"], here["graph_buckets"]
    if theirs is None or ours is None:  # eager (graphs equal above): no graph at any batch size
        return here if theirs == ours else None
    if not isinstance(theirs, list) or not all(isinstance(b, int) for b in theirs):
        return None
    union = sorted(set(theirs) | set(ours))
    old, new = [t["max_batch_size"] for t in kept], [t["max_batch_size"] for t in tiers]
    if _graphs_at(union, old) != _graphs_at(theirs, old) or _graphs_at(union, new) != _graphs_at(ours, new):
        return None
    return here | {"graph_buckets": union}


def read_tuned(path: Path) -> dict:
    """The tuned file's contents, checked; a FastspecError naming the file if it is unreadable or unsound."""
    try:
        data = json.loads(Path(path).read_text())
        schedule_of(data["tiers"])
        if not isinstance(data.get("fingerprint"), dict):
            raise FastspecError("no fingerprint")
        return data
    except FastspecError as e:
        raise FastspecError(f"tuned file {path}: {e}") from None
    except Exception as e:  # truncated, not JSON, wrong types: whatever a damaged file holds
        raise FastspecError(f"tuned file {path}: unreadable ({e.__class__.__name__}: {e})") from None


def schedule_of(tiers: list[dict]) -> Schedule:
    if not isinstance(tiers, list) or not tiers:  # tune writes a tier per batch size: none is a damaged file
        raise FastspecError(f"tiers must be a non-empty list, got {json.dumps(tiers)[:40]}")
    out = []
    for t in tiers:
        params = t["params"]
        if params is not None:
            if len(params) != 3 or not all(isinstance(v, int) for v in params):
                raise FastspecError(f"params must be [num_steps, topk, num_draft_tokens], got {params}")
            try:
                check_tree(*params)
            except FastspecError as e:
                raise FastspecError(f"names an impossible tree {params}: {e}") from None
            params = SpecParams(*params)
        if not isinstance(t["max_batch_size"], int) or t["max_batch_size"] < 1:
            raise FastspecError(f"max_batch_size must be a positive integer, got {t['max_batch_size']}")
        out.append((t["max_batch_size"], params))
    if not any(p is not None for _, p in out):
        return ()  # every tier is "off": nothing to switch, the caller decodes plainly
    return tuple(out)


def staleness(data: dict, print_: dict) -> str | None:
    """Why a tuned file's contents (as read_tuned returns them) do not fit `print_`; None when they do."""
    if data.get("version") == VERSION and data["fingerprint"] == print_:
        return None
    differs = [k for k in print_ if data["fingerprint"].get(k) != print_[k]]
    return f"measured with a different {', '.join(differs) or 'version'}"


def other_settings(data: dict, here: dict) -> str | None:
    """The settings a tuned file's costs were measured under that differ from `here`, as flags: "--graphs eager
    (here cuda)"; None when none differs. A setting the file does not record (an older file) is unknown: not said."""
    recorded = data.get("settings")
    recorded = recorded if isinstance(recorded, dict) else {}
    sizes = [t["max_batch_size"] for t in data["tiers"]]
    shown = {k: (_graphs_at(recorded[k], sizes), _graphs_at(v, sizes)) if k == "graph_buckets" else (recorded[k], v)
             for k, v in here.items() if k in recorded}
    differs = [f"{FLAGS.get(k, '--' + k.replace('_', '-'))} {theirs} (here {ours})"
               for k, (theirs, ours) in shown.items() if theirs != ours]
    return ", ".join(differs) or None


FLAGS = {"graph_buckets": "--cuda-graph-bs / --cuda-graph-max-bs, graphs run at"}  # a setting two flags make


def _graphs_at(buckets, sizes: list[int]) -> str:
    """The graph each tuned batch size runs in (the smallest bucket holding it; beyond the largest: eager), which is
    what its cost depends on: buckets [1, 2, 4, 8], sizes [1, 3, 16] -> "bs 1: 1, bs 3: 4, bs 16: eager". Buckets
    that differ elsewhere (a larger --max-running-requests adds some) change no tuned cost."""
    buckets = sorted(b for b in buckets if isinstance(b, int)) if isinstance(buckets, list) else []  # (damaged: none)
    return ", ".join(f"bs {bs}: " + str(next((b for b in buckets if b >= bs), "eager")) for bs in sizes)


def load_schedule(path: Path, print_: dict, say=lambda message: None,
                  here: dict | None = None) -> tuple[Schedule, bool] | None:
    """(schedule, every tier off) from the tuned file at `path` if it exists, is sound and matches `print_`;
    else None, after one note through `say` when a file is there but not used. A file measured under settings
    other than `here` is used, after one note naming them."""
    if not Path(path).exists():
        return None
    try:
        data = read_tuned(path)
    except FastspecError as e:
        say(f"ignoring {e}; run fastspec tune again to replace it")
        return None
    if (stale := staleness(data, print_)) is not None:
        say(f"ignoring tuned file {path}: {stale}")
        return None
    if here is not None and (other := other_settings(data, here)) is not None:
        say(f"tuned file {path} was measured with {other}: its shapes may not be the fastest here; fastspec tune "
            "with this run's flags measures them")
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
    return f"{model} x{os.cpu_count()} threads={threads.ALL}"  # torch's default: `--threads auto` varies with load


def dir_digest(directory: Path) -> str:
    """config.json + every weight file (whole below 64 MB, else its size and first 4 MB): a guard against
    stale tuning that costs milliseconds, not a signature."""
    h = hashlib.sha256((Path(directory) / "config.json").read_bytes())
    for f in sorted(Path(directory).glob("*.safetensors")) + sorted(Path(directory).glob("*.bin")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            left = size if size < 64 << 20 else 4 << 20
            while left > 0:  # 1 MB at a time: no copy of the file in memory
                chunk = fh.read(min(left, 1 << 20))
                h.update(chunk)
                left -= len(chunk) or left
    return h.hexdigest()[:16]


def find_schedule(model_dir: Path, draft_dir: Path, dtype: str, device: str, say=lambda message: None,
                  here: dict | None = None) -> tuple[Schedule, bool] | None:
    """The tuned schedule for this target, draft, dtype (weights_label: with its quantization) and machine, if
    `fastspec tune` wrote one; `here`: the engine's `settings`, a note if the file was measured under others."""
    return load_schedule(tuned_path(model_dir, draft_dir, dtype, device),
                         fingerprint(model_dir, draft_dir, dtype, device), say, here)
