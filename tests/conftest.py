"""Tests marked ``cuda`` need a CUDA device and are skipped without one (``python -m perf gpu_check`` runs
them on a GPU)."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
