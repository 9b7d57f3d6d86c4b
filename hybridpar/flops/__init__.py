"""FLOPs, parameters and activation sizes of a model from shapes alone, whole and per rank.

Why a module of its own: the scaling harness reports achieved FLOP/s, the performance model predicts
step times from per-layer work, and the planner compares layouts before any allocation is spent.
All of them need the same per-layer numbers, computed once on the un-sharded model on the meta device
(nothing is allocated, so a 512^3 model costs no memory) and then divided among ranks by the same index
arithmetic the distributed layers use (:mod:`hybridpar.geometry`).

Conventions
-----------
* **2 FLOPs per multiply-add**, counted densely: padding taps are multiplied like any other, exactly as
  ``torch.utils.flop_counter.FlopCounterMode`` counts them.
* ``forward``, ``input_grad`` and ``weight_grad`` hold the **matmul-type work only** (convolutions,
  transposed convolutions, linear layers): the subset ``FlopCounterMode`` counts, so the totals agree
  with it. ``input_grad`` is zero when the layer's input does not require grad (the first layer:
  the model input needs no gradient), ``weight_grad`` is zero for frozen weights. Each equals the
  forward count when present (a conv's input gradient is a transposed conv of the same size, its
  weight gradient a conv of the same size).
* Grouped convolutions: the weight gradient is ``2 * N * out_voxels * C_out * (C_in / groups) * k``,
  like the forward. ``FlopCounterMode`` in torch 2.13 multiplies it by ``groups`` (it ignores groups
  in its weight-gradient formula); ours is the correct count.
* ``forward_other`` and ``backward_other`` hold **nominal** counts of the rest, which
  ``FlopCounterMode`` ignores: bias additions (1 per output element; 1 per element for the bias
  gradient), activations and dropout (1 per element each way), pooling (``prod(kernel)`` per output
  element; max pooling's backward 1 per input element), adaptive pooling (1 per input element each
  way), normalisation (4 per element each way). These layers are memory-bound: the numbers are for
  completeness, not for rate models (the performance model times them instead).
* Which modules are counted: the outermost module with an entry in the layer registry
  (:mod:`hybridpar.nn.registry`: convolutions incl. transposed and ``padding='same'``, ``Linear``,
  max/avg/adaptive pooling, batch/group/instance/layer norm, upsampling, pads, activations,
  ``Flatten``/``Unflatten``/``Identity``, dropout, and what users register), or one that wraps such a
  module in ``.local_module`` (the wrapper's observed shapes are used with the counterpart's
  hyperparameters). Each entry's ``flops`` gives the formula. The children of a counted module are
  not visited again. Leaves matching nothing are recorded with zero FLOPs and, when they hold
  parameters, listed in ``unsupported`` with a warning. Work done in ``forward`` by plain functions
  (``torch.flatten``, ``x * 1.2``) is not counted, nor by ``FlopCounterMode`` unless it is a matmul.

Modules: :mod:`.counter` counts the whole model (:func:`count`), :mod:`.sharded` divides that work
among the ranks of a spatial group (:func:`count_sharded`).
"""

from hybridpar.flops.counter import FlopCount, LayerFlops, count
from hybridpar.flops.sharded import (
    RankFlops,
    ShardedFlops,
    ShardedLayer,
    count_sharded,
    received_halo,
    work_shares,
)

__all__ = ["FlopCount", "LayerFlops", "RankFlops", "ShardedFlops", "ShardedLayer", "count", "count_sharded",
           "received_halo", "work_shares"]
