"""Interpolation on the meta device at the cost of its shape arithmetic.

Why: torch's meta kernels of the linear and cubic upsampling operations run their Python
decomposition, about 20 ms a call on a small volume, most of a small U-Net's plan (a plan runs the
forward on meta several times: the trace check, the plan, the FLOP count, each layer's extents).
Nearest upsampling takes its output's extents and layout from the same ``output_size`` or scale
factors, through a C++ meta kernel. This mode sits below autograd and below every function-level
mode (the planners', which see the call as written), so the graph a meta run records is the
operation's own and only the shapeless computation is swapped.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

NEAREST = {
    aten.upsample_linear1d.default: aten.upsample_nearest1d.default,
    aten.upsample_linear1d.vec: aten.upsample_nearest1d.vec,
    aten.upsample_bilinear2d.default: aten.upsample_nearest2d.default,
    aten.upsample_bilinear2d.vec: aten.upsample_nearest2d.vec,
    aten.upsample_bicubic2d.default: aten.upsample_nearest2d.default,
    aten.upsample_bicubic2d.vec: aten.upsample_nearest2d.vec,
    aten.upsample_trilinear3d.default: aten.upsample_nearest3d.default,
    aten.upsample_trilinear3d.vec: aten.upsample_nearest3d.vec,
}
"""Each upsampling operation with ``align_corners`` (its third argument), and the nearest one of the
same arguments without it, which gives the same extents and layout."""


class ShapeOnlyResampling(TorchDispatchMode):
    """Runs an interpolation of :data:`NEAREST` on a meta tensor as its nearest counterpart."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in NEAREST and not kwargs and len(args) >= 3 and isinstance(args[0], torch.Tensor) \
                and args[0].is_meta:
            return NEAREST[func](args[0], args[1], *args[3:])
        return func(*args, **kwargs)
