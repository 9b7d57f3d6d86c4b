"""The torch functions and tensor methods a traced forward may call on split activations, registered.

Why a module of its own: the layer registry holds the tables and the rules of lookup; which of torch's
many functions are elementwise, which read shapes, and which stand for a layer (``F.interpolate`` is an
``nn.Upsample``, ``F.conv3d`` an ``nn.Conv3d`` of the caller's weights) is a long list of facts about
torch, kept apart from them. Registered on import
(:mod:`hybridpar.nn` imports it).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridpar.nn import registry


def register_functions() -> None:
    """Functions and tensor methods a traced forward may call on split activations. Elementwise ones
    run on shards whose layouts agree; ``torch.cat`` along channels too (its role ``"concat"``: the
    planner checks the dim); the rest needs the whole tensor."""
    pointwise = [operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.iadd,
                 operator.imul, torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.relu,
                 torch.sigmoid, torch.tanh, torch.exp, torch.log1p, torch.abs, torch.clamp, torch.square,
                 F.relu, F.leaky_relu, F.elu, F.gelu, F.silu, F.sigmoid, F.tanh, F.mish,
                 F.softplus, F.hardtanh, F.relu6, F.selu, F.celu, F.hardswish,
                 "add", "sub", "mul", "div", "neg", "relu", "sigmoid", "tanh", "exp", "abs", "clamp",
                 "square", "add_", "mul_", "relu_", "contiguous", "float", "double", "to", "type_as",
                 "radd", "rsub", "rmul", "truediv", "rtruediv", "iadd", "isub", "imul", "itruediv", "pow",
                 # comparisons, masks and in-place forms (planner.in_place rewires their readers)
                 operator.gt, operator.lt, operator.ge, operator.le, operator.isub, operator.itruediv,
                 torch.gt, torch.lt, torch.ge, torch.le, torch.where, torch.lerp, F.leaky_relu_, F.elu_,
                 torch.relu_, torch.sigmoid_, torch.tanh_, torch.clamp_, F.threshold, F.threshold_,
                 F.hardtanh_, F.relu_,
                 "gt", "lt", "ge", "le", "where", "masked_fill", "masked_fill_", "lerp", "lerp_", "sub_",
                 "div_", "sigmoid_", "tanh_", "clamp_", "abs_", "neg_", "exp_", "leaky_relu_", "threshold_"]
    for fn in pointwise:
        registry.register_function(fn, "pointwise")
    for fn in (getattr, "size", "numel", "nelement", "dim", "ndimension"):
        registry.register_function(fn, "shape")
    registry.register_function(torch.cat, "concat")
    registry.register_function(torch.concat, "concat")

    def interpolate(x, size=None, scale_factor=None, mode="nearest", align_corners=None,
                    recompute_scale_factor=None, antialias=False) -> nn.Module:
        if antialias:
            raise NotImplementedError("F.interpolate: antialias is not supported on a split volume")
        return nn.Upsample(size, scale_factor, mode, align_corners, recompute_scale_factor)

    def pad(x, pad, mode="constant", value=None) -> nn.Module | None:
        if len(pad) > 6 or len(pad) % 2 or any(not isinstance(p, int) for p in pad) or (
                mode != "constant" and min(pad) < 0):
            return None  # pads not known when traced, or another mode's crop: the whole tensor
        six = (*pad, *(0,) * (6 - len(pad)))  # a negative pad crops (a kernel-1 window, hybridpar.nn.pad)
        if mode == "constant":
            return nn.ConstantPad3d(six, 0.0 if value is None else value)
        layer = {"replicate": nn.ReplicationPad3d, "reflect": nn.ReflectionPad3d,
                 "circular": nn.CircularPad3d}.get(mode)
        return layer(six) if layer is not None else None

    def group_norm(x, num_groups, weight=None, bias=None, eps=1e-5) -> nn.Module | None:
        if weight is not None or bias is not None:
            return None  # weights of the caller's: the whole tensor
        return nn.GroupNorm(num_groups, num_groups, eps, affine=False)  # any channels the groups divide

    def instance_norm(x, running_mean=None, running_var=None, weight=None, bias=None, use_input_stats=True,
                      momentum=0.1, eps=1e-5) -> nn.Module | None:
        if not isinstance(x, torch.Tensor) or x.dim() != 5 or not use_input_stats or any(
                t is not None for t in (running_mean, running_var, weight, bias)):
            return None  # statistics or weights of the caller's, or channels unknown when traced
        return nn.InstanceNorm3d(x.shape[1], eps=eps)

    registry.register_function(F.pad, as_module=pad)
    registry.register_function(F.interpolate, as_module=interpolate)
    registry.register_function(F.upsample, as_module=interpolate)
    registry.register_function(F.group_norm, as_module=group_norm)
    registry.register_function(F.instance_norm, as_module=instance_norm)
    registry.register_function(F.adaptive_avg_pool3d,
                               as_module=lambda x, output_size: nn.AdaptiveAvgPool3d(output_size))
    registry.register_function(F.adaptive_max_pool3d, as_module=lambda x, output_size, return_indices=False:
                               nn.AdaptiveMaxPool3d(output_size, return_indices))
    registry.register_function(F.dropout, as_module=lambda x, p=0.5, training=True, inplace=False:
                               nn.Dropout(p, inplace) if training else nn.Identity())  # one process's mask
    registry.register_function(F.max_pool3d, as_module=lambda x, *a, **k: nn.MaxPool3d(*a, **k))
    registry.register_function(F.avg_pool3d, as_module=lambda x, *a, **k: nn.AvgPool3d(*a, **k))


WEIGHTED = {
    F.conv3d: ("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
    F.conv_transpose3d: ("input", "weight", "bias", "stride", "padding", "output_padding", "groups",
                         "dilation"),
    F.group_norm: ("input", "num_groups", "weight", "bias", "eps"),
    F.instance_norm: ("input", "running_mean", "running_var", "weight", "bias", "use_input_stats", "momentum",
                      "eps")}
"""Functions that stand for a layer with the caller's weights, by their arguments' names: the layer
runs split with the weights given at each call (``F.conv3d(h, self.w)``, a norm subclass's own
forward calling ``F.group_norm(x, g, self.weight, self.bias)``)."""
SUMMED = (F.group_norm, F.instance_norm)
"""Of :data:`WEIGHTED`, those whose split layer returns its weights' gradients already summed over the
shards (its statistics are the volume's); a conv's are each shard's part."""


def weighted_args(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """A call of one of :data:`WEIGHTED` by its arguments' names."""
    return {**dict(zip(WEIGHTED[func], args)), **kwargs}


def weighted_module(func: Any, args: tuple, kwargs: dict) -> nn.Module:
    """The layer a call of one of :data:`WEIGHTED` stands for, on the meta device (its weight and bias
    are the call's, given at each call)."""
    got = weighted_args(func, args, kwargs)
    w, b = got.get("weight"), got.get("bias")
    if func in SUMMED:
        stats = got.get("running_mean") is not None or got.get("running_var") is not None
        if func is F.instance_norm and (stats or not got.get("use_input_stats", True)):
            raise ValueError("instance_norm with running statistics of the caller's (an nn.InstanceNorm3d "
                             "with track_running_stats keeps its own)")
        if not (isinstance(w, torch.Tensor) and isinstance(b, torch.Tensor) and w.dim() == 1
                and b.shape == w.shape):
            layer = "GroupNorm" if func is F.group_norm else "InstanceNorm3d"
            raise ValueError(f"{func.__name__} with a weight and no bias (or a bias and no weight): give "
                             f"both (as nn.{layer} does) or none")
        eps = got.get("eps", 1e-5)
        if func is F.group_norm:
            return nn.GroupNorm(got["num_groups"], w.shape[0], eps, affine=True, device="meta")
        return nn.InstanceNorm3d(w.shape[0], eps, affine=True, device="meta")
    if not isinstance(w, torch.Tensor) or w.dim() != 5:
        raise ValueError("a functional conv3d takes a 5-D weight")
    groups = got.get("groups", 1)
    common = dict(kernel_size=tuple(w.shape[2:]), stride=got.get("stride", 1), padding=got.get("padding", 0),
                  dilation=got.get("dilation", 1), groups=groups, bias=b is not None, device="meta")
    if func is F.conv3d:
        if isinstance(common["padding"], str) and common["padding"] == "same" and common["stride"] != 1:
            raise ValueError("padding='same' needs stride 1")
        return nn.Conv3d(w.shape[1] * groups, w.shape[0], **common)
    return nn.ConvTranspose3d(w.shape[0], w.shape[1] * groups, output_padding=got.get("output_padding", 0),
                              **common)


register_functions()
