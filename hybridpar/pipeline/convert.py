"""Turn an ordinary torch layer into its spatially distributed counterpart, weights included.

Why: users write ordinary models; the spec says per layer how it is split. The layer registry
(:mod:`hybridpar.nn.registry`) builds the Dist class from the torch layer's own constructor arguments
(so they agree by construction); this module then hands it the torch layer's own parameters and
buffers (the same tensors, not copies), as FSDP2's ``fully_shard`` keeps the user's: an optimizer
built on ``model.parameters()`` trains what the engine runs, and ``model.state_dict()`` is current
after training (:mod:`hybridpar.nn.sharing`). Layers that work voxel by voxel run as copies of the module
sharing those tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.utils import parametrize

from hybridpar.comm.reduce import grad_split, mark_grad_split
from hybridpar.grid import ProcessGrid
from hybridpar.nn import registry
from hybridpar.nn.dist_check import watch_split_version
from hybridpar.nn.families import reduces_over_job
from hybridpar.nn.sharing import share_state, sharing_copy
from hybridpar.nn.spatial import SpatialLayer, stated
from hybridpar.nn.window import describe
from hybridpar.planner.terms import SpecError


def to_distributed(m: nn.Module, grid: ProcessGrid, overlap: bool = False, name: str | None = None
                   ) -> nn.Module:
    """The Dist counterpart of ``m`` (the model's layer ``name``) under ``grid``'s split, or a copy of
    ``m`` if it is pointwise.

    A copied layer with parameters on a split input computes partial gradients on each shard, whatever
    its role (a pointwise or resample layer): its parameters are marked so that the engine's reduction
    sums them over the shards; a dense layer's copy, on whole values, computes whole ones. A window
    layer's Dist counterpart must run the window its entry gives for ``m`` (:func:`check_window`), a
    reduce layer's must say how its parameters' gradients add up (:func:`check_reduce_params`). Within
    :func:`one_build`, a parameter two layers apply with gradients counted apart is refused.
    """
    entry = registry.lookup(m)
    whole = entry is not None and grid.spatial_size == 1 and parametrize.is_parametrized(m)
    if entry is not None and entry.to_dist is not None and parametrize.is_parametrized(m) and not whole:
        _refuse_stateful(m, name)
    if entry is None or entry.to_dist is None or whole:  # a parametrized layer run whole: itself
        d = sharing_copy(m)
        mark_grad_split(d.parameters(), grid.spatial_size if entry is not None and entry.splittable else 1)
        _sync_norms(d, grid, overlap, name)
        if entry is not None and entry.splittable and grid.spatial_size > 1 and _users(entry):
            # a user's layer run as a copy on each shard: checked as a split version is (a shape read)
            watch_split_version(d, m, _what(m, name), grid=grid)
        _note(m, grid, name)
        return d
    try:
        d = entry.to_dist(m, grid, overlap)
    except (NotImplementedError, ValueError, TypeError) as err:  # the Dist layer's own refusal, named
        if not name or name in str(err):
            raise
        raise SpecError(f"{_what(m, name)}: {err}") from err
    registry.note_split(d, entry)
    check_window(entry, m, d, name)
    check_reduce_params(entry, m, d, name)
    what = _what(m, name)
    if grid.spatial_size > 1 and isinstance(d, SpatialLayer) and _users(entry):  # a user's own split version
        watch_split_version(d, m, what, replicated=entry.replicated_output(m))
    ref = next((t for t in (*m.parameters(), *m.buffers()) if t.is_floating_point()), None)
    if ref is not None:  # floating tensors only: a complex one cast to a real dtype loses its imaginary part
        d = d.to(device=ref.device)._apply(lambda t: t.to(ref.dtype) if t.is_floating_point() else t)
    _share_parametrizations(m, d)
    share_state(m, d)
    for s in d.modules():  # parameters a Dist layer made after init_spatial, or kept in plain submodules
        if isinstance(s, SpatialLayer):
            s.mark_split_params()
    d.train(m.training)
    _note(m, grid, name)
    return d


def _sync_norms(d: nn.Module, grid: ProcessGrid, overlap: bool, name: str | None) -> None:
    """The ``SyncBatchNorm`` layers inside a block copied whole, as their split version on its grid.

    Why: torch's own reduces over the default group, every rank of the job: the copies of one value
    that the block's layout replicas hold are counted again (the running variance's correction is
    off), a pipeline's other stages never join, and on the CPU it raises. Its split version reduces
    over the ranks that hold the global batch once (:attr:`ProcessGrid.batch_group`)."""
    made: dict[int, nn.Module] = {}
    for path, sub in d.named_modules(remove_duplicate=False):
        for slot, child in list(sub._modules.items()):
            if reduces_over_job(child):
                if id(child) not in made:
                    where = ".".join(p for p in (name, path, slot) if p)
                    made[id(child)] = to_distributed(child, grid, overlap, where)
                sub._modules[slot] = made[id(child)]


def _refuse_stateful(m: nn.Module, name: str | None) -> None:
    """Refuse a parametrization that keeps state of its own (spectral_norm's power iteration updates
    its vectors on every read of the weight): a split layer may read its weight more than once a
    forward (the overlapped convolution's interior and faces), each read another iteration."""
    for tensor, plist in m.parametrizations.items():
        held = [f"parametrizations.{tensor}.{k}" for k, _ in plist.named_buffers()]
        if held:
            what = _what(m, name)
            raise SpecError(f"{what}: its parametrization of {tensor} keeps state ({', '.join(held)}) "
                            f"that each computation of the weight updates (spectral_norm's power iteration), "
                            f"which a split layer would update once per read; run the layer whole (layers: "
                            f"{{{name or '<layer>'}: {{spatial: replicate}}}}) or remove the parametrization "
                            f"(torch.nn.utils.parametrize.remove_parametrizations)")


def _share_parametrizations(m: nn.Module, d: nn.Module) -> None:
    """Give the split layer ``d`` the parametrizations of ``m`` (weight_norm: its weight computed from
    ``g`` and ``v`` on each call), the same modules: ``d`` then computes the weight from ``m``'s own
    tensors as ``m`` does, and their gradients flow through it (a shard's partial weight gradient, a
    linear function of the parametrization's, sums over the shards as the weight's would)."""
    if not parametrize.is_parametrized(m):
        return
    for tensor, plist in m.parametrizations.items():
        if tensor not in d._parameters:
            raise SpecError(f"{type(m).__name__}: its split version {type(d).__name__} holds no parameter "
                            f"{tensor} of its own to compute from the parametrization; run the layer whole")
        parametrize.register_parametrization(d, tensor, nn.Identity(), unsafe=True)
        d.parametrizations[tensor] = plist


def _what(m: nn.Module, name: str | None) -> str:
    """How a refusal names layer ``m``: its place in the model and its type (``enc.0 (Conv3d)``)."""
    return f"{name} ({type(m).__name__})" if name else type(m).__name__


def _users(entry: registry.LayerEntry) -> bool:
    """Whether ``entry`` registers a layer of the user's own (not torch's nor the library's)."""
    return not entry.torch_type.__module__.startswith(("torch.", "hybridpar."))


def check_window(entry: registry.LayerEntry, m: nn.Module, d: nn.Module, name: str | None = None) -> None:
    """Refuse a window layer's Dist counterpart ``d`` unless it runs the window the entry gives for
    ``m``: the planner, ``explain``, the FLOP counter and the performance model read the entry's, the
    Dist layer exchanges the halos of its own (:meth:`SpatialLayer.window`), and where they differ
    the plan is wrong while the numbers may still come out (a 5³ filter given a 3³ window)."""
    if entry.role not in ("window", "transposed"):
        return
    want = entry.windows_of(m)
    what = _what(m, name)
    if not isinstance(d, SpatialLayer):
        raise TypeError(f"{what}: the registry's to_dist gave a {type(d).__name__}, not a hybridpar.nn."
                        "SpatialLayer, so nothing ties its halos to the entry's window; subclass "
                        "hybridpar.nn.SpatialLayer and the registered layer")
    got = d.window()
    if tuple(got) != tuple(want):
        raise ValueError(f"{what}: the registry entry gives the window {describe(want)}, but its Dist layer "
                         f"{type(d).__name__} runs {describe(got)}; build the Dist layer from the module's "
                         "own hyperparameters in to_dist, or make window= describe what the layer computes")


def check_reduce_params(entry: registry.LayerEntry, m: nn.Module, d: nn.Module, name: str | None = None
                        ) -> None:
    """Refuse a reduce layer's Dist counterpart ``d`` with a parameter whose gradient accounting it has
    not stated: one applied after the reduction, to whole values, has its whole gradient on every rank,
    one applied to the shard before it a part per shard, and nothing in the layer tells them apart
    (the default, a part per shard, would count the first once per shard)."""
    if not (entry.role == "reduce" or entry.replicated_output(m)):
        return
    what = _what(m, name)
    for pname, p in d.named_parameters():
        if not stated(p):
            raise SpecError(f"{what}: its split version {type(d).__name__} reduces over the volume but "
                            f"does not say how its parameter {pname} is applied; in its __init__ call "
                            f"self.applied_whole(self.{pname}) if it acts on the reduced (whole) values, or "
                            f"self.applied_split(self.{pname}) if on the shard before the reduction")


_BUILDS: list[dict[int, tuple[torch.Tensor, str, str, int, int]]] = []
"""Per build under way (:func:`one_build`): each parameter converted, with the first layer that applies
it, its name there, that layer's split and how many shards add up its gradient (``grad_split``)."""


@contextmanager
def one_build() -> Iterator[None]:
    """Refuse, while converting one build's layers, a parameter that two layers apply with gradients
    counted apart (tied between a split layer and one run replicated): the engine's reduction scales a
    parameter's gradient by one count, so one of the two would be over- or under-counted, silently."""
    _BUILDS.append({})
    try:
        yield
    finally:
        _BUILDS.pop()


def _how(split: int, counted: int) -> str:
    run = f"split over {split} ranks" if split > 1 else "run replicated"
    grad = "a part of its gradient per shard" if counted > 1 else "its whole gradient on every rank"
    return f"{run}, {grad}"


def _note(m: nn.Module, grid: ProcessGrid, name: str | None) -> None:
    """Record ``m``'s parameters in the build under way; refuse one applied before with another count."""
    if not _BUILDS:
        return
    seen, layer = _BUILDS[-1], name or type(m).__name__
    for pname, p in m.named_parameters():
        now = grad_split(p)
        if pname.startswith("parametrizations.") and pname.count(".") > 2:
            # a parametrization's own parameter (a scale shared by two layers' weights), not the tensor's
            # original(s): counted as that tensor, this layer's (its mark is the layer's that marked it)
            now = grad_split(next(m.parametrizations[pname.split(".")[1]].parameters(recurse=False)))
        _, was, as_was, split, counted = seen.setdefault(id(p), (p, layer, pname, grid.spatial_size, now))
        if counted != now:
            raise SpecError(f"parameter {was}.{as_was} is also {layer}.{pname}: {was} applies it "
                            f"({_how(split, counted)}) and {layer} ({_how(grid.spatial_size, now)}), "
                            f"so its gradient cannot be added up one way for both; untie them, or run both "
                            f"layers in one split (spec rules)")
