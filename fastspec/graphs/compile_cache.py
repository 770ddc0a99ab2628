"""Inductor's on-disk cache for `--graphs compile`: where it lives, and what happens when an entry in it is damaged.

A second process compiles from the cache in a fraction of the cold time. An entry cut short or left by something
else (a truncated pickle, kernel source or library; a kernel module cut after a whole statement, so it imports but
lacks its entry point) makes Inductor fail, not recompile; `renew_compile_cache` recognises that failure and moves
the process to an empty cache (clearing fastspec's own directory, never one the user named), once, so the caller
compiles again. Knows nothing about graphs or buckets.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import shutil
import sys
import tempfile
from pathlib import Path

from fastspec.errors import first_line
from fastspec.utils.cache import cache_root

log = logging.getLogger(__name__)
DYNAMO_RECOMPILE_LIMIT = 1024  # one dynamo cache entry per bucket (and per runner sharing a function)
DAMAGE = (pickle.UnpicklingError, EOFError, SyntaxError, ImportError, OSError)  # how a damaged entry fails
_renewed = False  # this process already moved to a new cache: a later failure is a real one


def configure_compile_caches() -> None:
    """Inductor's on-disk caches under `cache_root()/inductor`, FX-graph and AOTAutograd caches on, and room in
    dynamo's cache for one entry per bucket.

    An explicit $TORCHINDUCTOR_CACHE_DIR wins; torch writes its own default into that variable on first use,
    which is not treated as explicit. Inductor's own warnings about unreadable entries are silenced (each is a
    traceback on stderr), as is the AttributeError a half-loaded graph's __del__ raises: a damaged entry is
    handled by `renew_compile_cache`.
    """
    import torch._dynamo.config
    import torch._functorch.config
    import torch._inductor.config

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or current == _torch_default_cache_dir():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(_own_cache_dir())
    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True
    logging.getLogger("torch._inductor.codecache").setLevel(logging.ERROR)
    if not isinstance(sys.unraisablehook, _QuietHalfLoaded):
        sys.unraisablehook = _QuietHalfLoaded(sys.unraisablehook)
    dynamo = torch._dynamo.config
    dynamo.cache_size_limit = max(dynamo.cache_size_limit, DYNAMO_RECOMPILE_LIMIT)
    dynamo.accumulated_cache_size_limit = max(dynamo.accumulated_cache_size_limit, DYNAMO_RECOMPILE_LIMIT)


class _QuietHalfLoaded:
    """An unraisable-exception hook that drops what Inductor's CompiledFxGraph.__del__ raises for a graph whose
    load from a damaged entry failed half-way (it lacks the attributes __del__ reads: an AttributeError, printed
    as a traceback on stderr); everything else goes to the hook before it."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, unraisable) -> None:
        where = getattr(unraisable.object, "__qualname__", "")
        if isinstance(unraisable.exc_value, AttributeError) and where == "CompiledFxGraph.__del__":
            return
        self.previous(unraisable)


def renew_compile_cache(error: BaseException) -> bool:
    """After a failed compile: True if `error` came from a damaged cache entry and this process now compiles into an
    empty cache (the caller compiles again); False for any other failure, or if the cache was already renewed."""
    global _renewed
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    damage = None if _renewed or current is None else _cache_damage(error, current)
    if damage is None:
        return False
    _renewed = True
    if Path(current).resolve() == _own_cache_dir().resolve():
        shutil.rmtree(current, ignore_errors=True)  # ours: later runs start clean too
        where = f"cleared {current}"
    else:  # the user's: left as it is, this process uses a new one
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fastspec-inductor-")
        atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
        where = f"compiling into {os.environ['TORCHINDUCTOR_CACHE_DIR']} instead"
    _clear_loaded_modules()
    log.warning("the compiled-graph cache held a damaged entry (%s); %s", first_line(damage, 200), where)
    return True


def _cache_damage(error: BaseException, cache_dir: str) -> BaseException | None:
    """The exception in `error`'s chain that a damaged file raised or that names a file in `cache_dir`, if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, DAMAGE) or cache_dir in str(error) or _half_a_module(error, cache_dir):
            return error
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    return None


def _half_a_module(error: BaseException, cache_dir: str) -> bool:
    """A kernel module from `cache_dir` that imports but lacks what Inductor looks up in it (a file cut short
    after a complete statement)."""
    module_file = getattr(getattr(error, "obj", None), "__file__", None) if isinstance(error, AttributeError) else None
    return module_file is not None and os.path.abspath(module_file).startswith(os.path.abspath(cache_dir))


def _clear_loaded_modules() -> None:
    """Forget the kernels Inductor already loaded from the old cache (in-memory caches keyed like the files)."""
    try:
        from torch._inductor.utils import clear_caches
    except ImportError:  # older torch: nothing registered to clear
        return
    clear_caches()


def _own_cache_dir() -> Path:
    return cache_root() / "inductor"


def _torch_default_cache_dir() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # older torch: only an unset variable is replaced
        return None
    return os.path.abspath(default_cache_dir())
