"""What a torch layer does along dim 0 of its input: whether it keeps the samples of a batch apart.

Why here, with the layers: a fact about a layer type lives in :mod:`hybridpar.nn`. The planners
(:mod:`hybridpar.planner.per_sample`) ask it of every torch layer on a batch that data parallelism or
micro-batches hold in parts, where a layer that reads dim 0 as its sequence or its channels would give
each part its own answer.
"""

from __future__ import annotations

import inspect
import math
import re

import torch
from torch import nn

from hybridpar.nn import families, registry

_SPATIAL_RANK = re.compile(r"([123])d$")
_WINDOWS = (families.CONV_ND, families.MAX_POOL_ND, families.AVG_POOL_ND, *families.ADAPTIVE_POOL_ND,
            families.LP_POOL_ND, families.MAX_UNPOOL_ND, *families.PAD_ND)
"""Layers over their last n dims (n in the class name): a convolution mixes the dim before them (the
channels), the others (pools, pads) work on each index of it apart."""


def _softmax_dim(m: nn.Module, nd: int) -> int:
    """The dim a softmax layer works along (``dim=None``: torch's legacy choice, dim 0 of a 0-, 1- or
    3-dim input, else dim 1)."""
    dim = getattr(m, "dim", None)
    return (0 if nd in (0, 1, 3) else 1) if dim is None else dim % max(nd, 1)


def judged_by_forward(m: nn.Module) -> bool:
    """Whether what layer ``m`` does across the samples is judged by following its own forward: a layer
    of the user's own type registered with a role, of one input, whose split class says nothing of dim 0
    (a norm over the batch's samples registered as pointwise splits the volume exactly and still sees
    only its micro-batch); the forward it stands for says, as one process runs it."""
    if type(m).__module__.startswith(("torch.", "hybridpar.")) or registry.lookup(m) is None:
        return False
    params = inspect.signature(m.forward).parameters.values()
    return sum(p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD for p in params) == 1


def module_across(m: nn.Module, x: torch.Tensor) -> str | None:
    """What layer ``m`` does across the samples of its input ``x`` (which holds them along dim 0), or
    None if it works on each sample apart: a layer of n spatial dims on a batched input (n + 2 dims;
    unbatched, a convolution reads dim 0 as its channels), one along dims past 0 (a linear layer, a
    softmax, a norm), an elementwise one. Anything else (a recurrent layer or an attention that reads its
    sequence first, a layer of unknown kind) is refused, as a call would be; a batch norm normalises over
    each part's samples, as DDP's replicas do (the README says so)."""
    if not type(m).__module__.startswith("torch."):  # registered with its role, or a block whose own
        return None  # forward's calls are judged as they run
    nd, kind = x.dim(), type(m).__name__
    rank = _SPATIAL_RANK.search(kind)
    n = int(rank.group(1)) if rank else None
    why = f"{kind} (not known to keep the samples apart)"
    if families.elementwise(m) or isinstance(m, families.DROPOUT_ND | nn.RReLU | nn.Identity |
                                             families.BATCH_NORM | nn.Embedding):
        return None
    if isinstance(m, nn.PReLU | nn.GroupNorm | nn.Linear | nn.Bilinear | nn.PairwiseDistance):
        return None if nd >= 2 else f"{kind} (reads dim 0 as its features)"
    if isinstance(m, nn.LayerNorm | nn.RMSNorm):
        return None if len(m.normalized_shape) < nd else f"{kind} (over the samples' dim)"
    if isinstance(m, nn.Softmax | nn.LogSoftmax | nn.Softmin):
        return None if _softmax_dim(m, nd) != 0 else f"{kind} (along the samples' dim)"
    if isinstance(m, nn.GLU | nn.CosineSimilarity | nn.Unflatten):
        return None if m.dim % max(nd, 1) != 0 else f"{kind} (along the samples' dim)"
    if isinstance(m, nn.Flatten):
        return None if m.start_dim % max(nd, 1) != 0 else f"{kind} (moves the samples' dim)"
    sequence = next((s for s in m.modules() if isinstance(s, nn.MultiheadAttention | nn.RNNBase)), None)
    if sequence is not None:  # an attention, a recurrent layer, a transformer of them
        return None if sequence.batch_first and nd == 3 else \
            f"{kind} (reads its sequence along the samples' dim: batch_first=True keeps them apart)"
    if isinstance(m, nn.PixelShuffle | nn.PixelUnshuffle | nn.ChannelShuffle | nn.LocalResponseNorm):
        return None if nd >= (4 if isinstance(m, nn.PixelShuffle | nn.PixelUnshuffle) else 3) else \
            f"{kind} (reads dim 0 as its channels)"
    if isinstance(m, families.CONV_TRANSPOSE_ND | families.CONV_ND | families.INSTANCE_NORM | nn.Upsample):
        return None if n is None or nd == n + 2 else f"{kind} (of an unbatched input: reads dim 0 as " \
                                                      f"its channels)"
    if isinstance(m, _WINDOWS):
        return None if n is not None and nd > n else why
    return why


def single_values(m: nn.Module, shape: tuple[int, ...], part: int, batch: int) -> str | None:
    """Why a batch norm training on an input of global ``shape`` (dim 0 the ``batch`` samples, or rows
    of them: a fold) fails on each part of ``part`` samples the batch is held in (one value per channel
    there: a map pooled to 1x1x1 on a replica's one sample), where one process, normalising the whole
    batch, trains; or None. Refused before any step, since the norms before it would otherwise move
    their statistics in the failing forward."""
    if not (isinstance(m, families.BATCH_NORM) and m.training) or families.reduces_over_job(m) or \
            len(shape) < 2 or part < 1:
        return None
    per_sample = max(shape[0] // max(batch, 1), 1) * math.prod(shape[2:])
    if part * per_sample > 1 or shape[0] * math.prod(shape[2:]) <= 1:
        return None
    return (f"{type(m).__name__} (one value per channel on each part of {part} sample{'s' * (part > 1)} the "
            f"batch is held in, its input {list(shape)}: it cannot train there, as torch's cannot on a "
            f"batch of one; give each replica and micro-batch more samples, or use GroupNorm or "
            f"SyncBatchNorm)")
