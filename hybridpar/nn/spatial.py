"""What every spatially split layer shares: its grid, the global input shape, memoised halo plans.

Why: a layer sees only its shard, but its halos depend on the global extent and on every rank's
shard. The global shape is inferred once per forward from all ranks' local shapes (a tiny CPU
collective), or set ahead of time by the engine (``layer.global_input_shape``) to skip even that.

:class:`SpatialLayer` is public (``hybridpar.nn.SpatialLayer``): a split version of a layer of one's
own subclasses it and that layer, calls :meth:`~SpatialLayer.init_spatial` in its ``__init__``, and in
its ``forward`` runs the layer's kernel unpadded on :meth:`~SpatialLayer.with_halos` of its shard,
with the kernel and stride of :meth:`~SpatialLayer.window` (its registry entry's, read, not repeated).
A split version that reduces over the volume (a ``reduce`` layer, a norm) sums with
:meth:`~SpatialLayer.volume_sum`, whose total may be used on whole values or on the shard (its gradient
then summed over the shards: ``nn/value_flow.py``), and says of each parameter applied to whole values
:meth:`~SpatialLayer.applied_whole` (a ``reduce`` layer says it of each, or
:meth:`~SpatialLayer.applied_split`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from hybridpar.axes import DIM_NAMES
from hybridpar.comm.agree import check_agree
from hybridpar.comm.halo import DimExchange, HaloExchanger, exchange
from hybridpar.comm.redistribute import infer_global_shape
from hybridpar.comm.reduce import is_marked, mark_grad_split, sum_to_replicated
from hybridpar.comm.transport import get_transport
from hybridpar.device.eager import eager
from hybridpar.geometry import HaloPlan
from hybridpar.grid import ProcessGrid
from hybridpar.nn import registry
from hybridpar.nn.value_flow import follow_values
from hybridpar.nn.window import Windows

_STATED: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Parameters whose split layer has said how its shards' gradients add up (:meth:`SpatialLayer.applied_whole`,
:meth:`~SpatialLayer.applied_split`, the library's own layers): the converter refuses a reduce layer's
parameter that is not among them, as the default (a partial gradient per shard) is wrong for one applied
after the reduction."""


def stated(param: torch.Tensor) -> bool:
    """Whether ``param``'s split layer has said how its gradient adds up over the shards."""
    return param in _STATED


def _check_weights_once(layer: SpatialLayer, _args: tuple) -> None:
    if any(t.is_meta for t in [*layer.parameters(), *layer.buffers()]):
        return  # a planning run on the meta device: no values to compare yet
    if check_agree(layer, layer.grid.spatial_group, layer.layer_name):
        layer.weights_agreed()


class SpatialLayer(nn.Module):
    """Mixin for layers whose input is split over ``grid``'s spatial axes.

    A subclass is the split version of the registered layer it also subclasses (``class
    DistSoftPool3d(hp.nn.SpatialLayer, SoftPool3d)``): it takes that layer's registry entry, wherever
    it is written (``registry.mark_split``), and reads its window from it.
    """

    grid: ProcessGrid
    global_input_shape: tuple[int, int, int] | None

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        registry.mark_split(cls)

    def init_spatial(self, grid: ProcessGrid | None, transport: str | None = None) -> None:
        """Set up the split: call it in ``__init__`` after the torch layer's own ``__init__``.
        ``transport`` names the halo transport (None: the grid's backend's default)."""
        if not isinstance(grid, ProcessGrid):
            raise TypeError(f"{type(self).__name__}: pass grid=hybridpar.ProcessGrid(...), got {grid!r}")
        self.grid = grid
        self.transport_name = transport
        self.global_input_shape = None
        self.layer_name = type(self).__name__
        self._exchangers: dict[tuple, HaloExchanger] = {}
        self.mark_split_params()
        if not type(self).__module__.startswith("hybridpar."):
            follow_values(self)  # a user's split layer: what it does with volume_sum's totals, followed
        # The ranks of the split share this layer's weights: on its first forward they are checked
        # equal (hybridpar.comm.agree), unless whoever built it has made them so (weights_agreed()).
        self._agree_hook = self.register_forward_pre_hook(_check_weights_once)

    def weights_agreed(self) -> None:
        """Say that every rank of the grid holds the same parameters and buffers (they were broadcast):
        the first forward's check is skipped."""
        hook = getattr(self, "_agree_hook", None)
        if hook is not None:
            hook.remove()
            self._agree_hook = None

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() != 5:
            raise ValueError(f"{self.layer_name}: expected a 5-D (N, C, D, H, W) shard, got shape "
                             f"{tuple(x.shape)}")

    def global_shape(self, x: torch.Tensor) -> tuple[int, int, int]:
        """Global (D, H, W) of the input whose shard is ``x``; refused alike on every rank (all know
        it) where a shard would be empty, before the ranks could part ways in a collective."""
        self._check_input(x)
        if self.global_input_shape is not None:
            shape = tuple(self.global_input_shape)
        else:
            shape = infer_global_shape(x, self.grid)
        for i, parts in enumerate(self.grid.spatial_shape):
            if shape[i] < parts:
                raise ValueError(f"{self.layer_name}: dim {DIM_NAMES[i]} has extent {shape[i]}, too small "
                                 f"to split over {parts} ranks (a rank would hold no voxel); use a split "
                                 f"of at most {shape[i]} along {DIM_NAMES[i]}")
        return shape  # type: ignore[return-value]

    def exchanger(self, shape: tuple[int, int, int], plans_of: Callable[[int, int, str], list[HaloPlan]],
                  fill: float = 0.0, key: tuple = ()) -> HaloExchanger:
        """The (memoised) halo exchanger for global ``shape``; ``plans_of(extent, parts, dim_name)``.

        A dim whose plans are periodic (``circular`` padding) takes its neighbours across the faces:
        the first and the last rank along the axis are each other's.
        """
        k = (tuple(shape), fill, *key)
        ex = self._exchangers.get(k)
        return ex if ex is not None else self._new_exchanger(k, shape, plans_of, fill)

    @eager  # built once per shape, eagerly (a compiled forward finds it memoised)
    def _new_exchanger(self, k: tuple, shape: tuple[int, int, int],
                       plans_of: Callable[[int, int, str], list[HaloPlan]], fill: float) -> HaloExchanger:
        if k not in self._exchangers:
            dims = []
            for axis in range(3):
                plans = plans_of(shape[axis], self.grid.spatial_shape[axis], DIM_NAMES[axis])
                plan = plans[self.grid.spatial_coord[axis]]
                lo, hi = self.grid.neighbours(axis, periodic=plan.periodic)
                dims.append(DimExchange(2 + axis, plan, lo, hi))
            # one rank has no neighbour to talk to: no communicator for it (see grid._self_group)
            group = self.grid.halo_group if self.grid.spatial_size > 1 else None
            ex = HaloExchanger(dims, get_transport(self.transport_name, group), fill, rank=self.grid.rank)
            self._exchangers[k] = ex
        return self._exchangers[k]

    def window(self) -> Windows:
        """This layer's window, one :class:`~hybridpar.nn.window.Window` per dim (D, H, W), as the
        registry entry of the layer it splits describes it: the one description of its geometry,
        which its halos, FLOPs, the planner and the performance model all read."""
        ws = self.__dict__.get("_window")  # read once: a layer's hyperparameters are set when it is built
        if ws is None:
            entry = registry.lookup(self)
            if entry is None or entry.window is None:
                raise TypeError(f"{self.layer_name}: no registry entry gives this layer's window; subclass "
                                f"the layer it splits (class {self.layer_name}(hybridpar.nn.SpatialLayer, "
                                "YourLayer)) and register that layer with window=")
            ws = self.__dict__["_window"] = entry.windows_of(self)
        return ws

    def window_exchanger(self, shape: tuple[int, int, int], fill: float = 0.0) -> HaloExchanger:
        """The halo operator of :meth:`window` for a global (D, H, W) = ``shape`` input (the plans of
        ``Window.plans``)."""
        ws = self.window()

        def plans_of(n: int, parts: int, dim: str) -> list[HaloPlan]:
            return ws[DIM_NAMES.index(dim)].plans(n, parts, layer=self.layer_name, dim=dim)

        return self.exchanger(shape, plans_of, fill, key=("window",))

    def with_halos(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """This rank's shard ``x`` extended by its neighbours' halos and the window's padding (``fill``
        beyond zero-padded faces), cropped to what its outputs read: the layer's kernel run on it
        with no padding gives this rank's shard of the output. Differentiable (the backward sends
        the halos' gradients back to their owners)."""
        return exchange(x, self.window_exchanger(self.global_shape(x), fill))

    def mark_split_params(self) -> None:
        """Say that each of this layer's parameters (its submodules' too) not yet accounted for gets a
        partial gradient from every shard of the split, to be summed over them.

        Why this default: a split layer computes its own shard of the output, so a parameter it applies,
        before the halo exchange or after, contributes to each rank's shard alone, and the whole
        gradient is the sum of the ranks' (averaging them would train it at a fraction of its gradient).
        A layer whose gradients leave it already reduced, or that applies a parameter to whole values,
        says so itself (:meth:`applied_whole`; the norm layers' ``_mark_params(1)``). Called by
        ``init_spatial`` and again by the converter after ``to_dist``, for parameters made after
        ``init_spatial``."""
        mark_grad_split([p for p in self.parameters() if not is_marked(p)], self.grid.spatial_size)

    def _mark_params(self, split: int) -> None:
        """Tell the engine's bucketed reduction how many shards contribute to each parameter."""
        self._state_params(list(self.parameters(recurse=False)), split)

    def _state_params(self, params: list[torch.Tensor], split: int) -> None:
        mark_grad_split(params, split)
        for p in params:
            _STATED[p] = True

    def applied_split(self, *params: torch.Tensor) -> None:
        """Say that ``params`` are applied to this rank's shard (before any reduction over the volume):
        each shard gives part of their gradient, summed over the shards. Every split layer's default;
        a ``reduce`` layer says it of each parameter, or :meth:`applied_whole`."""
        self._state_params(list(params), self.grid.spatial_size)

    def applied_whole(self, *params: torch.Tensor) -> None:
        """Say that ``params`` are applied to whole values, the same on every rank (after
        :meth:`volume_sum`: a weight on a pooled feature): every rank computes their whole gradient,
        which summed over the shards would count it once per shard."""
        self._state_params(list(params), 1)

    def volume_sum(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over the whole split volume of ``partial``, what this rank's shard gives
        (``x.sum((2, 3, 4))``): the same on every rank, differentiable (its gradient reaches every
        shard), used on whole values (a ``reduce`` layer's pooled features; a mean: divide by the voxels
        of :meth:`global_shape`) or on the shard (a norm's mean and variance), in the forward of a user's
        split layer (followed there: ``nn/value_flow.py``)."""
        total = sum_to_replicated(partial, self.grid.spatial_group)
        flow = getattr(self, "_value_flow", None)  # a user's layer's forward, followed (nn/value_flow.py)
        if flow is not None:
            flow.summed(total)
        return total

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, split={self.grid.spatial_shape}"
