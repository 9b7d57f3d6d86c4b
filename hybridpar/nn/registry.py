"""One entry per torch layer type: everything the rest of the library asks of a layer.

Why: the converter (``parallelize``), the spec planner, ``explain``, the FLOP counter, the performance
model and the memory estimate all need facts about a layer: how it is split (its *role*), its window
(:class:`~hybridpar.nn.window.Window` per dim), its distributed counterpart, its FLOPs, what it
keeps for backward. Kept here once per layer type, a new layer is one file plus one
:func:`register` call, and a layer nobody registered is found out (a clear error in a split region)
instead of being counted as zero FLOPs or silently gathered.

Roles (how a layer meets a spatially split input):

* ``"window"``: conv and pooling windows; halos from the entry's ``window``
  (:class:`~hybridpar.nn.window.Window` records, one per dim).
* ``"transposed"``: transposed convolution; halos from its transposed ``window``.
* ``"pointwise"``: works voxel by voxel (activations, dropout, BatchNorm with its statistics reduced
  over the split): keeps the split of its input, no halo.
* ``"resample"``: its output is split like its input but needs its own halo plan (upsampling); without
  a Dist class a copy runs on each shard, planned only where the shards' boundaries fall on its whole
  factor (nearest resampling: :func:`~hybridpar.copied_resample.check_copied_resample`).
* ``"reduce"``: reduces the whole volume (global and adaptive pooling): split input, replicated output.
* ``"dense"``: needs the whole tensor (Linear, Flatten): runs replicated, after a planned gather.

The formulas themselves (FLOPs, window geometry, saved bytes) live in :mod:`hybridpar.nn.formulas`;
an entry only names which of them its layer type uses.

Lookup walks the type's MRO, so a subclass (a distributed layer, a user's Conv3d subclass) finds its
base's entry unless it registers its own. A split layer (a subclass of
:class:`~hybridpar.nn.spatial.SpatialLayer` and of the layer it splits) is that layer's wherever it is
written: its forward is, by that contract, the split version of its base's, and it reads its window
from its base's entry, so a layer and its Dist class written in a user's module need one call::

    hp.nn.register(SoftPool3d, role="window", op="pool", to_dist=lambda m, grid, overlap=False:
                   DistSoftPool3d(m.kernel, m.stride, m.padding, grid=grid),
                   window=lambda m: (hp.nn.Window(m.kernel, m.stride, m.padding, m.padding),) * 3,
                   flops=lambda m, x, y: ({"forward_other": 2 * m.kernel ** 3 * y.numel()}, None))
"""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hybridpar import geometry
from hybridpar.axes import SPATIAL_AXES
from hybridpar.copied_resample import check_copied_resample
from hybridpar.geometry import ntuple
from hybridpar.nn import families
from hybridpar.nn import window as windows
from hybridpar.nn.copy_check import check_copies
from hybridpar.nn.formulas import (
    LayerGeometry,
    Work,
    conv_flops,
    elementwise_flops,
    linear_flops,
    no_flops,
    no_flops_pointwise,
    norm_flops,
    per_input_flops,
    pool_dims,
    pool_flops,
    saved_window,
)
from hybridpar.nn.window import Window, Windows

ROLES = ("window", "transposed", "pointwise", "resample", "reduce", "dense")
OPS = ("conv", "linear", "pool", "norm", "pointwise", "free")

Halos = tuple[tuple[int, int], ...]


FlopFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[Work, LayerGeometry | None]]
DistFn = Callable[..., nn.Module]
HaloFn = Callable[[nn.Module, str, tuple[int, ...], tuple[int, ...], tuple[int, int, int]], Halos]


@dataclass(frozen=True)
class LayerEntry:
    """What the library knows about one torch layer type (see the module doc for ``role``).

    ``to_dist(module, grid, overlap)`` builds the distributed counterpart with the module's own
    hyperparameters (None: a copy of the module runs on a shard as it is; refused for the roles a copy
    never runs exactly: window, transposed, reduce); ``window(module)`` gives
    its window, one :class:`~hybridpar.nn.window.Window` per spatial dim (d, h, w), the one description
    its Dist layer, the planner, the FLOP counter and the performance model read (use
    :meth:`windows_of`, which checks it); ``halos(module, name, in_shape, out_shape, split)`` the
    widest (low, high) halo per dim under ``split`` (default: from the role) and raises
    ``geometry.HaloError`` when the split is too fine; ``flops(module, x, y)`` the work of one call
    in the conventions of :mod:`hybridpar.flops`; ``op`` the performance model's kernel class;
    ``saved(module, elem_bytes, out_elems, extended_elems)`` the bytes one rank keeps for backward
    (``extended_elems`` is 0 when no halo is assembled); ``replicates(module)`` whether this
    instance's output is replicated (default: the ``"reduce"`` role).
    """

    torch_type: type
    role: str
    op: str
    flops: FlopFn
    to_dist: DistFn | None = None
    window: Callable[[nn.Module], Windows] | None = None
    halos: HaloFn | None = None
    saved: Callable[[nn.Module, int, int, int], int] | None = None
    replicates: Callable[[nn.Module], bool] | None = None
    flattens: bool = False
    """Where a split ends: the layer folds the volume into features (``nn.Flatten``)."""
    transposes: Callable[[nn.Module, tuple[int, ...], tuple[int, int, int]], int] | None = None
    """Elements one rank moves in the layer's own transposes (a spectral layer's FFT pencils) on an
    input of the given global shape under the given split, for the plan's traffic figures."""

    @property
    def splittable(self) -> bool:
        """Whether the layer can run on a spatially split input."""
        return self.role != "dense"

    def replicated_output(self, m: nn.Module) -> bool:
        """Whether ``m`` on a split input gives a replicated output (a whole-volume reduction): the
        ``"reduce"`` role, or what ``replicates(m)`` says for a type whose instances differ (an
        adaptive pool to one voxel reduces, one to many voxels resamples)."""
        if self.replicates is not None:
            return self.replicates(m)
        return self.role == "reduce"

    def halo_widths(self, m: nn.Module, name: str, in_shape: tuple[int, ...], out_shape: tuple[int, ...],
                    split: tuple[int, int, int]) -> Halos:
        """Widest (low, high) halo per dim of ``m`` under ``split`` (raises ``HaloError``)."""
        if self.halos is not None:
            return self.halos(m, name, in_shape, out_shape, split)
        return _role_halos(self, m, name, in_shape, out_shape, split)

    def windows_of(self, m: nn.Module) -> Windows | None:
        """``m``'s window per spatial dim (None for a layer without one), checked to be
        :class:`~hybridpar.nn.window.Window` records (a TypeError naming the layer otherwise)."""
        if self.window is None:
            return None
        return windows.checked(self.window(m), type(m).__name__)

    def work(self, m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[Work, LayerGeometry | None]:
        """One call's work (``flops``) and the geometry that splits it per rank: a window layer's is its
        ``window`` (the description its distributed layer builds its halos from), any other's
        what its ``flops`` function says (pointwise, adaptive, none)."""
        work, geom = self.flops(m, x, y)
        ws = self.windows_of(m)
        if ws is not None:
            kind = "conv_transposed" if ws[0].transposed else "conv" if self.op == "conv" else "window"
            geom = LayerGeometry(kind, ws)
        return work, geom

    def saved_bytes(self, m: nn.Module, elem: int, out_n: int, ext_n: int) -> int:
        if self.saved is not None:
            return self.saved(m, elem, out_n, ext_n)
        return elem * out_n if self.op != "free" else 0


_NEEDS_DIST = {
    "window": "a copy on each shard would run without its neighbours' halos",
    "transposed": "a copy on each shard would run without its neighbours' halos",
    "reduce": "a copy on each shard would reduce its own shard alone",
}
"""Roles whose layer a copy on each shard never runs exactly, and why: their entries need a Dist class.
A ``resample`` copy can (nearest resampling by a whole factor): the plan checks its shards' boundaries."""

_REGISTRY: dict[type, LayerEntry] = {}
_FUNCTIONS: dict[Any, str] = {}
_AS_MODULE: dict[Any, Callable[..., nn.Module]] = {}


def register(torch_type: type, *, role: str, flops: FlopFn, op: str = "free", to_dist: DistFn | None = None,
             window: Callable[[nn.Module], Windows] | None = None, halos: HaloFn | None = None,
             saved: Callable[[nn.Module, int, int, int], int] | None = None,
             replicates: Callable[[nn.Module], bool] | None = None, flattens: bool = False,
             transposes: Callable[[nn.Module, tuple[int, ...], tuple[int, int, int]], int] | None = None,
             **unknown: Any) -> LayerEntry:
    """Register (or replace) the entry of ``torch_type``; returns it. See :class:`LayerEntry`.

    A Dist class ``to_dist`` builds for a window layer reads its window from this entry (it subclasses
    ``hybridpar.nn.SpatialLayer`` and the registered layer); ``parallelize`` refuses a Dist layer whose
    window differs from the entry's for the module it replaces."""
    if role not in ROLES:
        raise ValueError(f"hybridpar.nn.register({torch_type.__name__}): role must be one of {ROLES}, "
                         f"got {role!r}")
    if op not in OPS:
        raise ValueError(f"hybridpar.nn.register({torch_type.__name__}): op must be one of {OPS}, got {op!r}")
    if "window_args" in unknown:
        raise TypeError(f"hybridpar.nn.register({torch_type.__name__}): window= (one "
                        "hybridpar.nn.Window per spatial dim) describes a window, not window_args=")
    if unknown:
        raise TypeError(f"hybridpar.nn.register({torch_type.__name__}): no argument "
                        f"{', '.join(map(repr, unknown))}; hybridpar.nn.LayerEntry says what an entry holds")
    if role in ("window", "transposed") and window is None and halos is None:
        raise ValueError(f"hybridpar.nn.register({torch_type.__name__}): a {role} layer needs "
                         f"window= (or halos=)")
    if role in _NEEDS_DIST and to_dist is None:
        raise ValueError(f"hybridpar.nn.register({torch_type.__name__}): a {role} layer needs to_dist= (its "
                         f"split version, a hybridpar.nn.SpatialLayer): {_NEEDS_DIST[role]}")
    entry = LayerEntry(torch_type, role, op, flops, to_dist, window, halos, saved, replicates, flattens,
                       transposes)
    _REGISTRY[torch_type] = entry
    return entry


_TRUSTED_FORWARDS = ("torch.nn.modules.", "hybridpar.")
"""Modules whose classes' forwards compute what their registered base's entry describes: torch's own
layer classes (``Conv2d`` under ``_ConvNd``) and hybridpar's split layers."""

_SPLIT_CLASSES: set[type] = set()
"""Split layers (``SpatialLayer`` subclasses, wherever written): their forward is their registered
base's on a split input, so their base's entry is theirs (:func:`mark_split`)."""


def mark_split(cls: type) -> None:
    """Say that ``cls``'s forward computes its registered base's forward on a split input (every
    ``SpatialLayer`` subclass is so marked when it is defined), so it finds its base's entry even when
    written outside torch and hybridpar."""
    _SPLIT_CLASSES.add(cls)


FORWARDS = ("forward", "_conv_forward")  # what torch's layers compute with (Conv3d.forward: _conv_forward)


def overriding_forward(m: nn.Module | type) -> type | None:
    """The class that defines the forward (:data:`FORWARDS`) of ``m``, when that class, written
    elsewhere than torch.nn or hybridpar, comes before a registered type in the MRO (a user's
    ``WSConv3d(nn.Conv3d)``, a mixin's forward); else None (one set on an instance: ``user_hooks``).
    Such a layer is not its base's entry's: split as its base, what its forward adds would be lost."""
    mro = (m if isinstance(m, type) else type(m)).__mro__
    registered = _registered_base(m)
    if registered is None:
        return None
    for name in FORWARDS:
        definer = next((c for c in mro if name in c.__dict__), None)
        if definer is None or definer in _REGISTRY or definer in _SPLIT_CLASSES or \
                definer.__module__.startswith(_TRUSTED_FORWARDS):
            continue
        if mro.index(definer) < mro.index(registered):  # a mixin's too: DepthwiseFFTConv3d(_Fwd, Conv3d)
            return definer
    return None


def _registered_base(m: nn.Module | type) -> type | None:  # the nearest registered class in its MRO
    return next((c for c in (m if isinstance(m, type) else type(m)).__mro__ if c in _REGISTRY), None)


def users_own(m: nn.Module) -> bool:
    """Whether ``m`` is a module of the user's own type, not registered: its forward is the user's
    Python, which a forward run by module swapping runs as it is, call by call, rather than as one
    layer."""
    return lookup(m) is None and not type(m).__module__.startswith(("torch.", "hybridpar."))


def unregistered(m: nn.Module) -> str:
    """Why ``m`` has no entry, as an error message says it."""
    definer = overriding_forward(m)
    if definer is None:
        return "this layer type is not registered"
    base = _registered_base(m).__name__
    name = next(n for n in FORWARDS if n in definer.__dict__)
    return (f"a {base} subclass with its own forward ({definer.__name__}.{name}), which {base}'s split "
            f"version would not run, so the type is not registered")


LAZY_ADAPTERS: dict[str, str] = {"neuralop": "hybridpar.nn.neuralop"}
"""The modules that register the layers of another package, by that package's top-level name: each is
imported, and its ``register()`` called, the first time a lookup misses on a type from that package.
Why not at import: registering imports the package (neuraloperator's takes seconds: tensorly, wandb),
which ``import hybridpar`` should not pay where it is installed but not used."""


def _register_adapters(cls: type) -> bool:
    """Register the waiting adapters of the packages ``cls`` and its bases come from; whether any was."""
    packages = {c.__module__.partition(".")[0] for c in cls.__mro__} & LAZY_ADAPTERS.keys()
    for package in sorted(packages):
        importlib.import_module(LAZY_ADAPTERS.pop(package)).register()
    return bool(packages)


_SPLIT_OF: weakref.WeakKeyDictionary[nn.Module, LayerEntry] = weakref.WeakKeyDictionary()
"""Split layers by instance, each with the entry of the layer it was made from (:func:`note_split`)."""


def note_split(split: nn.Module, entry: LayerEntry) -> None:
    """Say that the module ``split`` runs the layer of ``entry`` on split inputs: a split layer that is
    not a subclass of the type it splits (neuraloperator's ``SpectralConv``, whose split version is a
    ``SpatialLayer`` alone) is then found by :func:`lookup` as that layer, as a forward run by module
    swapping must find it to follow its output's layout."""
    _SPLIT_OF[split] = entry


def lookup(m: nn.Module | type) -> LayerEntry | None:
    """The entry of ``m``'s type or of its nearest registered base class, or None; None too for a
    subclass of a registered type with a forward of its own (:func:`overriding_forward`), unless that
    subclass is registered itself. A split layer made from a registered one has that layer's entry
    (:func:`note_split`). A miss on a type from a package with an adapter waiting
    (:data:`LAZY_ADAPTERS`) registers that package's layers and looks again."""
    if not isinstance(m, type) and (noted := _SPLIT_OF.get(m)) is not None:
        return noted
    cls = m if isinstance(m, type) else type(m)
    for base in cls.__mro__:
        entry = _REGISTRY.get(base)
        if entry is not None:
            return entry if base is cls or overriding_forward(cls) is None else None
    return lookup(cls) if LAZY_ADAPTERS and _register_adapters(cls) else None


def registered_types() -> list[type]:
    """Every registered torch type (for tests and documentation)."""
    return list(_REGISTRY)


def register_function(fn: Any, role: str | None = None, *, as_module: Callable[..., nn.Module] | None = None
                      ) -> None:
    """Say how a function called in a model's forward meets split inputs: ``"pointwise"``
    (elementwise, ``torch.add``, ``operator.mul``: runs on shards whose layouts agree), ``"concat"``
    (``torch.cat``: pointwise along channels, dense along a spatial dim), ``"shape"`` (``x.size()``,
    ``x.shape``: reads what a split tensor is, answered with its global extents) or ``"dense"``; or give
    ``as_module(*args, **kwargs)``, the module the call stands for (``F.interpolate`` is an
    ``nn.Upsample``), which then runs as that module's registered layer, on the call's first argument.
    """
    if as_module is not None:
        _AS_MODULE[fn] = as_module
        return
    if role not in ("pointwise", "dense", "concat", "shape"):
        raise ValueError(f"hybridpar.nn.register_function: role must be pointwise, dense, concat or shape, "
                         f"got {role!r}")
    _FUNCTIONS[fn] = role


def function_module(fn: Any, args: tuple, kwargs: dict) -> nn.Module | None:
    """The module a call of ``fn(*args, **kwargs)`` stands for, if registered (see
    :func:`register_function`; ``as_module`` may return None for calls it does not stand for)."""
    make = _AS_MODULE.get(fn)
    return make(*args, **kwargs) if make is not None else None


def function_role(fn: Any) -> str | None:
    """The role of a function or method name (``"add"``) met in a traced forward, or None."""
    return _FUNCTIONS.get(fn)


# ---------------------------------------------------------------------- helpers for entries
def conv_window(m: nn.Module) -> Windows:
    """A convolution's window per dim (any dims): the one place its ``'same'``/``'valid'`` padding is
    resolved; its ``padding_mode`` is the window's mode (circular halos wrap around)."""
    n, name = len(m.kernel_size), type(m).__name__
    k, s, d = (ntuple(v, n, what=w, layer=name) for v, w in ((m.kernel_size, "kernel_size"),
                                                            (m.stride, "stride"), (m.dilation, "dilation")))
    if m.padding == "same":
        lohi = [geometry.same_padding(k[i], d[i]) for i in range(n)]
    elif m.padding == "valid":
        lohi = [(0, 0)] * n
    else:
        lohi = [(p, p) for p in ntuple(m.padding, n, what="padding", layer=name)]
    mode = getattr(m, "padding_mode", "zeros")
    return tuple(Window(k[i], s[i], lohi[i][0], lohi[i][1], d[i], mode=mode) for i in range(n))


def pool_window(m: nn.Module) -> Windows:
    """A max, average or power-average pool's window per dim (any dims; stride None means the kernel;
    no padding or dilation attribute means none)."""
    n, name = pool_dims(m), type(m).__name__
    k = ntuple(m.kernel_size, n, what="kernel_size", layer=name)
    s = ntuple(m.stride if m.stride is not None else m.kernel_size, n, what="stride", layer=name)
    d = ntuple(getattr(m, "dilation", 1), n, what="dilation", layer=name)
    p = ntuple(getattr(m, "padding", 0), n, what="padding", layer=name)
    for i in range(n):
        if p[i] > (d[i] * (k[i] - 1) + 1) // 2:
            raise ValueError(f"{name}: padding {p[i]} should be at most half of the effective kernel size "
                             f"{d[i] * (k[i] - 1) + 1}, as in torch")
    return tuple(Window(k[i], s[i], p[i], p[i], d[i], ceil_mode=bool(m.ceil_mode)) for i in range(n))


def transposed_window(m: nn.Module) -> Windows:
    """A transposed convolution's window per dim."""
    n = len(m.kernel_size)
    k, s, p, d, op = (ntuple(v, n) for v in (m.kernel_size, m.stride, m.padding, m.dilation,
                                             m.output_padding))
    return tuple(Window(k[i], s[i], p[i], p[i], d[i], transposed=True, output_padding=op[i])
                 for i in range(n))


def check_extent(name: str, extent: int, parts: int, axis: int) -> None:
    """A split without halos still needs every shard non-empty (raises ``HaloError``)."""
    if extent < parts:
        reason = f"dim {SPATIAL_AXES[axis]} has extent {extent}, too small to split over {parts} ranks"
        raise geometry.HaloError(f"{name}: {reason}; use a split of at most {extent}", layer=name,
                                 reason=reason)


def _role_halos(entry: LayerEntry, m: nn.Module, name: str, in_shape: tuple[int, ...],
                out_shape: tuple[int, ...], split: tuple[int, int, int]) -> Halos:
    """The halos of a layer without a halo function of its own: its window's, none for the other roles
    (a resample layer copied onto each shard only where its shards' boundaries fall on its factor; a copy
    of a user's resample or pointwise layer only where it gives the volume's shards, run to see)."""
    halo = []
    ws = entry.windows_of(m)
    copied_resample = entry.role == "resample" and entry.to_dist is None and len(out_shape) == 5
    copied = copied_resample or (entry.role == "pointwise" and entry.to_dist is None and len(out_shape) == 5
                                 and not type(m).__module__.startswith(("torch.", "hybridpar.")))
    for i, parts in enumerate(split):
        if parts == 1:
            halo.append((0, 0))
            continue
        extent = in_shape[2 + i]
        if entry.role in ("window", "transposed"):
            plans = ws[i].plans(extent, parts, layer=name, dim=SPATIAL_AXES[i])
        else:
            check_extent(name, extent, parts, i)
            if copied_resample:
                check_copied_resample(extent, out_shape[2 + i], parts, name, SPATIAL_AXES[i])
            halo.append((0, 0))
            continue
        halo.append((max(p.halo[0] for p in plans), max(p.halo[1] for p in plans)))
    if copied and any(parts > 1 for parts in split):  # a user's copy: does it read the volume's extents?
        check_copies(m, name, in_shape, out_shape, split)
    return tuple(halo)


# ---------------------------------------------------------------------- torch types without a Dist class
def _register_builtins() -> None:
    """Entries of torch types that have no Dist class: 1D/2D layers and dense layers run replicated,
    activations and dropout as copies on shards. The 3D layers with Dist classes register in the
    files of those classes (:mod:`hybridpar.nn.conv`, ``pool``, ``norm``, ...)."""
    # 1d/2d windows are not split (3D only); their window still splits their work in ``count_sharded``
    register(families.CONV_ND, role="dense", op="conv", flops=conv_flops, window=conv_window)
    register(families.CONV_TRANSPOSE_ND, role="dense", op="conv", flops=conv_flops, window=transposed_window)
    for t in (families.MAX_POOL_ND, families.AVG_POOL_ND):
        register(t, role="dense", op="pool", flops=pool_flops, saved=saved_window, window=pool_window)
    for t in families.ADAPTIVE_POOL_ND:
        register(t, role="dense", op="pool", flops=per_input_flops)
    register(nn.Linear, role="dense", op="linear", flops=linear_flops)
    for t in (families.BATCH_NORM, nn.GroupNorm, families.INSTANCE_NORM, nn.LayerNorm):
        register(t, role="dense", op="norm", flops=norm_flops)
    for t in families.ACTIVATIONS:
        register(t, role="pointwise", op="pointwise", flops=elementwise_flops)
    for t in (nn.Softmax, nn.LogSoftmax, nn.GLU):  # along a dim that may be spatial: not split
        register(t, role="dense", op="pointwise", flops=elementwise_flops)
    register(families.DROPOUT_ND, role="pointwise", op="pointwise", flops=elementwise_flops)
    register(nn.Identity, role="pointwise", op="free", flops=no_flops_pointwise)
    register(nn.Flatten, role="dense", op="free", flops=no_flops, flattens=True)  # where a split ends
    register(nn.Unflatten, role="dense", op="free", flops=no_flops)


_register_builtins()
