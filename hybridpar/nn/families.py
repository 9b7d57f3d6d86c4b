"""torch's layer families, each named by the base class that all its n-D variants share.

Why: torch keeps these bases private (``_ConvNd``, ``_MaxPoolNd``, ...), yet "any conv" or "any max
pool" is what a FLOP formula or a registry entry means. Naming them once here keeps every reach into
torch's private modules in one file, so a rename in torch is a one-line change.
"""

from __future__ import annotations

from torch import nn

CONV_ND: type = nn.modules.conv._ConvNd
MAX_POOL_ND: type = nn.modules.pooling._MaxPoolNd
AVG_POOL_ND: type = nn.modules.pooling._AvgPoolNd
ADAPTIVE_POOL_ND: tuple[type, ...] = (nn.modules.pooling._AdaptiveAvgPoolNd,
                                      nn.modules.pooling._AdaptiveMaxPoolNd)
NORM_BASE: type = nn.modules.batchnorm._NormBase  # batch and instance norms: the running-statistics holders
BATCH_NORM: type = nn.modules.batchnorm._BatchNorm
INSTANCE_NORM: type = nn.modules.instancenorm._InstanceNorm
DROPOUT_ND: type = nn.modules.dropout._DropoutNd
