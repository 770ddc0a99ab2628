"""A Hugging Face hub cache laid out as huggingface_hub lays it out, written by hand (no huggingface_hub call):

    <cache>/models--<org>--<name>/blobs/<sha256 of the file>         the files' bytes
    <cache>/models--<org>--<name>/snapshots/<commit>/<file>          symlinks to ../../blobs/<sha256>
    <cache>/models--<org>--<name>/refs/<branch or tag>               the commit it points at
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_snapshot(cache: Path, repo_id: str, source: Path, commit: str, refs: tuple[str, ...] = ("main",),
                 skip: tuple[str, ...] = ()) -> Path:
    """Cache every file of the model directory `source` (but `skip`) as `repo_id` at `commit` (40 hex digits),
    with `refs` pointing at it. Returns the snapshot directory."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(source.iterdir()):
        if not f.is_file() or f.name in skip:
            continue
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def commit_id(n: int) -> str:
    return f"{n:040x}"
