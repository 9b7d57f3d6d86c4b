"""Whether a user's resampling or pointwise layer registered without a split version gives the volume's
shards when a copy of it runs on each shard: checked by running it, on a small random volume, whole and
shard by shard.

Why: the registry's index check (:func:`hybridpar.copied_resample.check_copied_resample`) says where
the shards' boundaries fall, not whether the layer reads across them. Nearest resampling does not;
trilinear interpolation reads the neighbour's plane, and a copy on each shard, which exchanges no
halos, then gives a different answer at every boundary; a "pointwise" layer that scales by its input's
extents reads the shard's. The layer is the user's code, so only running it tells; a few voxels per
shard are enough, in float64 on the CPU, with a generator of its own (the job's random streams are
left as they were).
"""

from __future__ import annotations

import copy
import itertools
import weakref

import torch
from torch import nn

from hybridpar.geometry import HaloError, shard_ranges
from hybridpar.nn.meta import unwatched

__all__ = ["check_copies"]

_SHARD = 2  # voxels of each input shard along a split dim (times the factor where it downsamples)


def _small_extents(in_shape: tuple[int, ...], out_shape: tuple[int, ...], split: tuple[int, int, int]
                   ) -> list[int]:
    """Input extents for the check: a few voxels per shard along split dims, at the layer's factor."""
    small = []
    for extent, n_out, parts in zip(in_shape[2:], out_shape[2:], split, strict=True):
        down = max(1, round(extent / n_out)) if n_out < extent else 1
        small.append(parts * _SHARD * down if parts > 1 else min(extent, _SHARD * down))
    return small


def check_copies(m: nn.Module, name: str, in_shape: tuple[int, ...], out_shape: tuple[int, ...],
                 split: tuple[int, int, int]) -> None:
    """Raise :class:`HaloError` naming layer ``name`` unless copies of ``m`` on the shards of ``split``
    give the shards of its output on the whole volume (``in_shape`` -> ``out_shape`` on the volume
    sizes its factors; the check runs at a few voxels per shard; once per layer and geometry, as a
    layer called in a loop is planned at each call)."""
    key = (tuple(in_shape), tuple(out_shape), tuple(split))
    if key in _CHECKED.setdefault(m, set()):
        return
    _check(m, name, in_shape, out_shape, split)
    _CHECKED[m].add(key)


_CHECKED: weakref.WeakKeyDictionary[nn.Module, set[tuple]] = weakref.WeakKeyDictionary()


def _check(m: nn.Module, name: str, in_shape: tuple[int, ...], out_shape: tuple[int, ...],
           split: tuple[int, int, int]) -> None:
    layer = copy.deepcopy(m)
    for sub in layer.modules():  # planning swaps plain tensors into the parameters' slots
        sub._parameters.update({k: nn.Parameter(t, t.requires_grad) for k, t in sub._parameters.items()
                                if t is not None and not isinstance(t, nn.Parameter)})
    g = torch.Generator().manual_seed(0)
    if any(t.is_meta for t in [*layer.parameters(), *layer.buffers()]):  # planned on meta: weights drawn
        layer = layer.to_empty(device="cpu")  # (where a layer reads is no matter of their values)
        for t in [*layer.parameters(), *layer.buffers()]:
            with torch.no_grad():
                t.copy_(torch.randn(t.shape, generator=g)) if t.is_floating_point() else t.zero_()
    layer = layer.to(device="cpu", dtype=torch.float64)
    x = torch.randn((1, in_shape[1], *_small_extents(in_shape, out_shape, split)), generator=g,
                    dtype=torch.float64)
    try:  # alone: no planner's mode or hooks see these calls; a layer that draws leaves the job's stream
        with torch.no_grad(), torch.random.fork_rng(devices=[]), unwatched(layer):
            same = _copies_agree(layer, x, split)
    except Exception as err:  # noqa: BLE001 - the layer's own code: what it raises says why
        same, why = False, f"it fails on a volume of {list(x.shape[2:])} voxels: {type(err).__name__}: {err}"
    else:
        why = "on a random volume the shards' outputs differ from the volume's: trilinear, x / x.shape[2]"
    if not same:
        reason = (f"a copy on each shard (registered without to_dist) reads across the shards' boundaries or "
                  f"the volume's extents, or cannot be checked ({why})")
        raise HaloError(f"{name}: {reason}; register a split version (to_dist=) or replicate it", layer=name,
                        reason=reason)


def _copies_agree(layer: nn.Module, x: torch.Tensor, split: tuple[int, int, int]) -> bool:
    whole = layer(x)
    for pick in itertools.product(*(range(p) for p in split)):
        ins = [shard_ranges(e, p)[k] for e, p, k in zip(x.shape[2:], split, pick, strict=True)]
        outs = [shard_ranges(e, p)[k] for e, p, k in zip(whole.shape[2:], split, pick, strict=True)]
        part = layer(x[(..., *(slice(lo, hi) for lo, hi in ins))])
        want = whole[(..., *(slice(lo, hi) for lo, hi in outs))]
        if part.shape != want.shape or not torch.allclose(part, want, rtol=1e-9, atol=1e-12):
            return False
    return True
