"""Turn an ordinary torch layer into its spatially distributed counterpart, weights included.

Why: users write plain ``nn.Sequential`` models; the spec says per layer how it is split. Each
conversion passes the torch layer's own constructor arguments to the Dist class (so they agree by
construction) and then loads the torch layer's state (so weights and running statistics carry over).
"""

from __future__ import annotations

import copy

from torch import nn

from hybridpar import nn as hnn
from hybridpar.grid import ProcessGrid


def to_distributed(m: nn.Module, grid: ProcessGrid, overlap: bool = False) -> nn.Module:
    """The Dist counterpart of ``m`` under ``grid``'s split, or a copy of ``m`` if it is pointwise."""
    if isinstance(m, nn.Conv3d):
        d = hnn.DistConv3d(m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding, m.dilation,
                           m.groups, m.bias is not None, m.padding_mode, grid=grid, overlap=overlap)
    elif isinstance(m, nn.ConvTranspose3d):
        d = hnn.DistConvTranspose3d(m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding,
                                    m.output_padding, m.groups, m.bias is not None, m.dilation,
                                    m.padding_mode, grid=grid)
    elif isinstance(m, nn.MaxPool3d):
        d = hnn.DistMaxPool3d(m.kernel_size, m.stride, m.padding, m.dilation, m.return_indices, m.ceil_mode,
                              grid=grid)
    elif isinstance(m, nn.AvgPool3d):
        d = hnn.DistAvgPool3d(m.kernel_size, m.stride, m.padding, m.ceil_mode, m.count_include_pad,
                              m.divisor_override, grid=grid)
    elif isinstance(m, nn.BatchNorm3d):
        d = hnn.DistBatchNorm3d(m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats,
                                grid=grid)
    else:
        return copy.deepcopy(m)
    ref = next((t for t in (*m.parameters(), *m.buffers()) if t.is_floating_point()), None)
    if ref is not None:
        d = d.to(dtype=ref.dtype, device=ref.device)
    d.load_state_dict(m.state_dict())
    d.train(m.training)
    return d
