"""The `fastspec` command line (`fastspec.cli:app`): one module per command, the shared flags (options) and
helpers (common)."""

from fastspec.cli.main import app

__all__ = ["app"]
