"""hybridpar: spatial, pipeline and data parallelism for 3D CNNs on volumes too large for one device."""

from hybridpar.grid import ProcessGrid
from hybridpar.launch import init_distributed

__all__ = ["ProcessGrid", "init_distributed"]
__version__ = "0.1.0"
