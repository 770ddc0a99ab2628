"""Where fastspec keeps what it makes: converted models, packed weights, built kernels, compiler caches, tuned files,
saved chats. One root for all of it; each user names its own subdirectory. Knows nothing about what is stored."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$FASTSPEC_CACHE, else $XDG_CACHE_HOME/fastspec, else ~/.cache/fastspec (`env_dir`: a blank one is unset)."""
    if (root := env_dir("FASTSPEC_CACHE")) is not None:
        return root
    if (xdg := env_dir("XDG_CACHE_HOME")) is not None:
        return xdg / "fastspec"
    return Path.home() / ".cache" / "fastspec"


def env_dir(name: str) -> Path | None:
    """The directory the environment variable `name` names; None when it is unset, empty (as the XDG rules read
    XDG_CACHE_HOME) or spaces only (`FASTSPEC_CACHE=" $UNSET"` would otherwise make a folder of spaces wherever
    fastspec runs)."""
    value = os.environ.get(name, "")
    return Path(value).expanduser() if value.strip() else None
