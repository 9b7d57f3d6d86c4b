"""CosmoFlow on hybridpar: synthetic universes, the HDF5 formats, the networks of its two tasks.

Only the application lives here (generic parallel machinery is in ``hybridpar``):

* :mod:`cosmoflow.universe` - the physics of a synthetic universe (numpy only);
* :mod:`cosmoflow.generate` - ``python -m cosmoflow.generate``, one HDF5 file per universe;
* :mod:`cosmoflow.data` - the three on-disk formats, read whole or as per-rank spatial regions;
* :mod:`cosmoflow.pack` - ``python -m cosmoflow.pack``, one chunked file per split;
* :mod:`cosmoflow.validate` - what a good sample is; :mod:`cosmoflow.check` - ``python -m cosmoflow.check``;
* :mod:`cosmoflow.errors` - the one line each failure of a run prints, and its exit code;
* :mod:`cosmoflow.model` - the MLPerf HPC reference network and LBANN's large-input variant;
* :mod:`cosmoflow.unet` - the 3D U-Net of the reconstruction task (initial field from evolved one);
* :mod:`cosmoflow.correlation` - r(k), the cross-correlation coefficient per Fourier shell;
* :mod:`cosmoflow.reconstruct` - the reconstruction task's scores, table, plots and result file.

The names below are imported when first used (PEP 562), not when the package is: importing a
torch-free module such as :mod:`cosmoflow.train_args` (``launch/train.py --help``) must not import
torch, which takes seconds.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cosmoflow.data import CosmoDataset, open_dataset
    from cosmoflow.model import build_lbann_model, build_model

_HOME = {"CosmoDataset": "cosmoflow.data", "open_dataset": "cosmoflow.data",
         "build_lbann_model": "cosmoflow.model", "build_model": "cosmoflow.model"}

__all__ = ["CosmoDataset", "build_lbann_model", "build_model", "open_dataset"]


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'cosmoflow' has no attribute {name!r}")
