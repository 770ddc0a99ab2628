"""Where fastspec keeps what it makes: converted models, packed weights, built kernels, compiler caches, tuned files,
saved chats. One root for all of it; each user names its own subdirectory. Knows nothing about what is stored."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$FASTSPEC_CACHE, else $XDG_CACHE_HOME/fastspec, else ~/.cache/fastspec."""
    if os.environ.get("FASTSPEC_CACHE"):
        return Path(os.environ["FASTSPEC_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "fastspec"
    return Path.home() / ".cache" / "fastspec"
