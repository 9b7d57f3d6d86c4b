"""Spatially distributed layers: drop-in counterparts of ``torch.nn`` layers taking ``grid=``.

Each layer file registers its torch counterpart in :mod:`hybridpar.nn.registry`, the one place the
converter, the planner, the FLOP counter and the performance model learn about a layer from. A layer
of one's own takes the same public names: :func:`register` with its window as :class:`Window`
records, and a Dist class built on :class:`SpatialLayer` (``launch/examples/own_layer.py``).
"""

from hybridpar.nn import dropout, functions, neuralop, registry, slicing  # noqa: F401 (they register)
from hybridpar.nn.conv import DistConv3d, DistConvTranspose3d
from hybridpar.nn.dropout import DistAlphaDropout, DistDropout, DistRReLU
from hybridpar.nn.layout import Gather, Redistribute, Scatter
from hybridpar.nn.lppool import DistLPPool3d
from hybridpar.nn.norm import DistBatchNorm3d, DistGroupNorm, DistInstanceNorm3d
from hybridpar.nn.pad import DistCircularPad3d, DistConstantPad3d, DistReflectionPad3d, DistReplicationPad3d
from hybridpar.nn.pool import (
    DistAdaptiveAvgPool3d,
    DistAdaptiveMaxPool3d,
    DistAvgPool3d,
    DistGlobalAvgPool3d,
    DistMaxPool3d,
)
from hybridpar.nn.registry import LayerEntry, lookup, register, register_function
from hybridpar.nn.shapes import set_global_shapes
from hybridpar.nn.spatial import SpatialLayer
from hybridpar.nn.spectral import DistPowerSpectrum, DistSpectralConv3d, PowerSpectrum, SpectralConv3d
from hybridpar.nn.upsample import DistUpsample, dist_interpolate
from hybridpar.nn.window import Window

__all__ = [
    "DistConv3d", "DistConvTranspose3d", "DistMaxPool3d", "DistAvgPool3d", "DistGlobalAvgPool3d",
    "DistBatchNorm3d", "Scatter", "Gather", "Redistribute", "set_global_shapes", "registry", "register",
    "register_function", "lookup", "LayerEntry", "SpatialLayer", "Window",
    "DistUpsample", "dist_interpolate", "DistGroupNorm", "DistInstanceNorm3d", "DistAdaptiveAvgPool3d",
    "DistAdaptiveMaxPool3d",
    "DistConstantPad3d", "DistReplicationPad3d", "DistReflectionPad3d", "DistCircularPad3d",
    "PowerSpectrum", "DistPowerSpectrum", "SpectralConv3d", "DistSpectralConv3d", "DistLPPool3d",
    "DistDropout", "DistAlphaDropout", "DistRReLU",
]
