"""torch's layer families, each named by the base class that all its n-D variants share, and the
questions the rest of the library asks of a norm layer's family.

Why: torch keeps these bases private (``_ConvNd``, ``_MaxPoolNd``, ...), yet "any conv" or "any max
pool" is what a FLOP formula or a registry entry means. Naming them once here keeps every reach into
torch's private modules in one file, so a rename in torch is a one-line change.
"""

from __future__ import annotations

from torch import nn

CONV_ND: type = nn.modules.conv._ConvNd
CONV_TRANSPOSE_ND: type = nn.modules.conv._ConvTransposeNd
MAX_POOL_ND: type = nn.modules.pooling._MaxPoolNd
AVG_POOL_ND: type = nn.modules.pooling._AvgPoolNd
ADAPTIVE_POOL_ND: tuple[type, ...] = (nn.modules.pooling._AdaptiveAvgPoolNd,
                                      nn.modules.pooling._AdaptiveMaxPoolNd)
LP_POOL_ND: type = nn.modules.pooling._LPPoolNd
MAX_UNPOOL_ND: type = nn.modules.pooling._MaxUnpoolNd
PAD_ND: tuple[type, ...] = (nn.modules.padding._ConstantPadNd, nn.modules.padding._ReflectionPadNd,
                            nn.modules.padding._ReplicationPadNd, nn.modules.padding._CircularPadNd)
"""Pads of the last n dims, every mode (``nn.ZeroPad3d`` is a constant pad)."""
NORM_BASE: type = nn.modules.batchnorm._NormBase  # batch and instance norms: the running-statistics holders
BATCH_NORM: type = nn.modules.batchnorm._BatchNorm
INSTANCE_NORM: type = nn.modules.instancenorm._InstanceNorm
DROPOUT_ND: type = nn.modules.dropout._DropoutNd
ACTIVATIONS: tuple[type, ...] = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
    nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardsigmoid, nn.Hardswish, nn.Softplus, nn.Softsign, nn.Tanhshrink,
    nn.Threshold, nn.LogSigmoid, nn.Hardshrink, nn.Softshrink)
"""The activations that compute alike wherever they run (``nn.RReLU`` draws its slopes: it registers in
:mod:`hybridpar.nn.dropout`)."""


def elementwise(m: nn.Module) -> bool:
    """Whether ``m`` maps every element on its own, alike wherever it lies, so that it runs on a shard of
    a tensor of any dims (``h.mean(1)``, the depth become channels): an activation, or an identity. Not
    a dropout (it draws per element or per dim 1), a PReLU of many weights (one per index along dim 1),
    a norm or a softmax (they read along dims), nor a user's layer registered as pointwise (it may mix
    dim 1, the channels of a volume)."""
    return (isinstance(m, ACTIVATIONS) and all(p.numel() == 1 for p in m.parameters())) or \
        type(m) is nn.Identity


def uses_batch_statistics(m: nn.Module) -> bool:
    """Whether ``m`` normalises by the statistics of its batch while training (a batch norm)."""
    return isinstance(m, BATCH_NORM)


def reduces_over_job(m: nn.Module) -> bool:
    """Whether ``m``'s own forward reduces over the job's ranks (torch's ``SyncBatchNorm``, over the
    default group unless it was given one): never to run as it is on a rank's copy of a block."""
    return isinstance(m, nn.SyncBatchNorm)


def tracks_replica_statistics(m: nn.Module) -> bool:
    """Whether ``m`` is a norm layer whose running statistics each data-parallel replica tracks from
    its own batch: not ``SyncBatchNorm`` nor a layer reducing over the stage (``stats="stage"``),
    whose statistics are already the whole batch's."""
    return (isinstance(m, NORM_BASE) and m.track_running_stats and m.running_mean is not None
            and not isinstance(m, nn.SyncBatchNorm) and getattr(m, "stats", "spatial") != "stage")


def moves_per_forward(m: nn.Module) -> bool:
    """Whether ``m`` is a norm whose training forward depends on or updates per-forward statistics:
    a batch norm (normalises by its batch), or any norm tracking running statistics."""
    return uses_batch_statistics(m) or (isinstance(m, NORM_BASE) and bool(m.track_running_stats)
                                        and getattr(m, "running_mean", None) is not None)


def one_layer_with_children(m: nn.Module) -> bool:
    """Whether ``m`` is a torch layer that holds modules of its own yet computes as one layer, calling
    them as functions rather than as steps (torch's attention and its output projection): a planner
    that walks into a module's children takes it whole, as a traced graph does."""
    return isinstance(m, nn.MultiheadAttention)
