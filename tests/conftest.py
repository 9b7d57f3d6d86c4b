"""Shared fixtures: ``pools`` (process groups that run one pytest case after another). Tests marked
``cuda`` need a CUDA device and are skipped without one (``python -m perf gpu_check`` runs them on a
GPU)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from distributed import Pools


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def pools() -> Iterator[Pools]:
    """``pools(world)``: a group of ``world`` ranks kept for the module's next cases of that size."""
    found = Pools()
    yield found
    found.close()
