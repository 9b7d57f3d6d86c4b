"""Shared fixtures: ``pools`` (process groups that run one pytest case after another). Tests marked
``cuda`` need a CUDA device and are skipped without one (``python -m perf gpu_check`` runs them on a
GPU)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from distributed import Pools

# The longest files (seconds on 2 cores), run first: ``make test`` hands whole files to two workers
# as each gets free (xdist's loadfile, in collection order with --no-loadscope-reorder; by default it
# orders files by their number of tests), and a long file taken last leaves the other worker idle.
LONGEST_FIRST = ("test_perf_suite.py", "test_model_zoo.py", "test_failures.py", "test_fault_soak.py",
                 "test_loss_split.py", "test_user_models.py", "test_launch_grid.py", "test_examples.py",
                 "test_dist_layers.py", "test_gpu_check.py", "test_train_app.py", "test_engine.py",
                 "test_periodic.py", "test_volume_study.py", "test_compile.py", "test_new_layers.py",
                 "test_graph_engine.py", "test_untraced_forwards.py", "test_blocks.py", "test_fft.py",
                 "test_mpi_transport.py", "test_predict_any_size.py", "test_lppool.py",
                 "test_checkpoint_kill.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: within a file, as written
    items[:] = _cases_by_world(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _cases_by_world(items: list) -> list:
    """Each file's cases that name a ``world`` put in order of it (stable; the others first, as written).
    Why: the ``pools`` fixture keeps one group of ranks, of the size last asked for, so cases listed
    2, 4, 2, 4 started a group of ranks (and imported the test module in each) for every one of them."""
    def world(item) -> int:
        w = getattr(getattr(item, "callspec", None), "params", {}).get("world", 0)
        return w if isinstance(w, int) else 0

    files: dict = {}
    for item in items:
        files.setdefault(item.path, []).append(item)
    return [item for same in files.values() for item in sorted(same, key=world)]


@pytest.fixture(scope="module")
def pools() -> Iterator[Pools]:
    """``pools(world)``: a group of ``world`` ranks kept for the module's next cases of that size."""
    found = Pools()
    yield found
    found.close()
