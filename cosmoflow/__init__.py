"""CosmoFlow on hybridpar: synthetic universes, the HDF5 formats and the network.

Only the application lives here (generic parallel machinery is in ``hybridpar``):

* :mod:`cosmoflow.universe` - the physics of a synthetic universe (numpy only);
* :mod:`cosmoflow.generate` - ``python -m cosmoflow.generate``, one HDF5 file per universe;
* :mod:`cosmoflow.data` - the three on-disk formats, read whole or as per-rank spatial regions;
* :mod:`cosmoflow.pack` - ``python -m cosmoflow.pack``, one chunked file per split;
* :mod:`cosmoflow.model` - the MLPerf HPC reference network and LBANN's large-input variant.
"""

from cosmoflow.data import CosmoDataset, open_dataset
from cosmoflow.model import build_lbann_model, build_model

__all__ = ["CosmoDataset", "build_lbann_model", "build_model", "open_dataset"]
