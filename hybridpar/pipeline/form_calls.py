"""Which torch calls a loss's form is followed through, by name: the tables of
:mod:`hybridpar.pipeline.loss_form`, apart from the mode that reads them.

Why by name: a call reaches a ``TorchFunctionMode`` as ``torch.sum``, ``Tensor.sum`` or ``F.mse_loss``
alike (:func:`hybridpar.planner.elementwise.name_of`), and what it does to positions along a dim is a
property of the call, whichever way it was spelled. Elementwise calls are not listed here: torch's tag
and the list the planners share decide them (:func:`hybridpar.planner.elementwise.elementwise`).
"""

from __future__ import annotations

from hybridpar.pipeline.form_algebra import MEAN, SUM
from hybridpar.planner import calls

FILLS = {"zeros": 0.0, "new_zeros": 0.0, "zeros_like": 0.0, "empty": 0.0, "new_empty": 0.0, "empty_like": 0.0,
         "ones": 1.0, "new_ones": 1.0, "ones_like": 1.0, "full": None, "new_full": None, "full_like": None}
"""Calls that make a tensor of one value (its value where known; an empty one counts as zero: what it
holds is only ever what is written into it); ``zeros_like`` of a followed value has its extents, and is
followed as an elementwise call of it."""
FROM_NUMBER = ("tensor", "as_tensor", "scalar_tensor", "new_tensor")
"""Calls that make a tensor of a number given (``torch.tensor(0.0)``): a fill of that value."""
EXTENT_READS = ("nbytes", "stride", "storage_offset")
"""Reads that tell a tensor's extents without naming a shape (a stride is the product of later extents)."""
UNARY = {"neg", "neg_", "__neg__", "negative", "__pos__", "positive", "to", "type", "type_as", "float",
         "double", "half", "bfloat16", "clone", "detach", "detach_", "contiguous", "data", "cpu", "cuda",
         "resolve_conj", "resolve_neg", "expand", "expand_as", "broadcast_to"}
"""Linear calls of one tensor: only the tensors are operands (the numbers are sizes or a dtype's)."""
JOIN = UNARY | {"add", "add_", "__add__", "__radd__", "__iadd__", "sub", "sub_", "__sub__", "__rsub__",
                "__isub__", "subtract", "rsub", "__setitem__", *calls.JOINS}
"""Linear in each operand, adding them (or placing them side by side, to be added later)."""
SCALE = {"mul", "mul_", "__mul__", "__rmul__", "__imul__", "multiply"}
NUMERATOR = {"div", "div_", "__truediv__", "__itruediv__", "divide", "true_divide"}
LINEAR = {"sum": SUM, "nansum": SUM, "mean": MEAN}
REDUCTIONS = set(calls.REDUCTIONS) | {"nansum", "nanmean", "prod", "var_mean", "std_mean", "logsumexp",
                                      "count_nonzero", "median", "nanmedian", "mode", "argmax", "argmin",
                                      "aminmax", "quantile", "nanquantile", "kthvalue"}
"""The planners' reductions (:data:`hybridpar.planner.calls.REDUCTIONS`) and others a loss may take."""
DIM_AT = {name: at for name, (_, at) in calls.REDUCTIONS.items()} | {"quantile": 2, "nanquantile": 2,
                                                                      "kthvalue": 2}
"""Where a reduction takes its dims, if not at 1."""
RESHAPES = {"view", "reshape", "view_as", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze",
            "ravel"}
PERMUTES = {"permute", "transpose", "swapaxes", "swapdims", "movedim", "moveaxis", "t", "T", "mT"}
ALONG = {"softmax": (1, None), "log_softmax": (1, None), "softmin": (1, None), "normalize": (2, 1),
         "cumsum": (1, None), "cumprod": (1, None), "logcumsumexp": (1, None), "cummax": (1, None),
         "cummin": (1, None), "glu": (1, -1), "sort": (1, -1), "argsort": (1, -1), "topk": (2, -1),
         "flip": (1, None), "roll": (2, None), "diff": (2, -1), "narrow": (1, None), "select": (1, None),
         "unbind": (1, 0), "split": (2, 0), "chunk": (2, 0), "tensor_split": (2, 0), "gather": (1, None),
         "scatter": (1, None), "scatter_": (1, None), "scatter_add": (1, None), "scatter_add_": (1, None),
         "scatter_reduce": (1, None), "scatter_reduce_": (1, None), "index_select": (1, None),
         "take_along_dim": (2, None), "cosine_similarity": (2, 1)} | {name: (1, 0) for name in calls.JOINS}
"""Calls along given dims (argument position, default): exact on a part where no such dim is cut."""
DROPS = {"select", "unbind", "cosine_similarity"}  # the dim goes
LOSSES = {"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
          "binary_cross_entropy_with_logits", "soft_margin_loss", "kl_div", "poisson_nll_loss",
          "gaussian_nll_loss", "cross_entropy", "nll_loss"}
WINDOWS = ("conv", "conv_transpose", "avg_pool", "max_pool", "lp_pool", "adaptive_avg_pool",
           "adaptive_max_pool")
PER_SAMPLE = {f"{kind}{n}d" for n in (1, 2, 3) for kind in WINDOWS} | {
    "interpolate", "upsample", "upsample_nearest", "upsample_bilinear", "pad", "grid_sample", "group_norm",
    "instance_norm", "layer_norm", "local_response_norm", "pixel_shuffle", "pixel_unshuffle", "unfold",
    "fold"}
"""Functions that work on each sample alone, mixing positions along its own dims (a window, a resampling,
a norm over a sample): the samples stay apart, a cut spatial dim's positions do not."""
KEEPS_VALUES = RESHAPES | PERMUTES | {"long", "int", "to", "type", "clone", "contiguous", "detach",
                                     "__getitem__", "select", "narrow"}
"""Calls whose result holds its input's values (an ``ignore_index`` still where it was)."""


def in_place(name: str) -> bool:
    return (name.endswith("_") and not name.startswith("_")) or name in (
        "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__")


def fill_value(name: str, args: tuple, kwargs: dict) -> float | None:
    at = 2 if name == "new_full" else 1
    value = kwargs.get("fill_value", args[at] if len(args) > at else None)
    return float(value) if isinstance(value, int | float) else None
