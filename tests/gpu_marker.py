"""The `gpu` marker: tests marked `@pytest.mark.gpu` are skipped when no CUDA device is present.

Wire it into tests/conftest.py with `from gpu_marker import pytest_collection_modifyitems  # noqa: F401`
(pytest's default "prepend" import mode puts tests/ on sys.path).
"""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
