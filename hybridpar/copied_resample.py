"""Where a resampling layer's copy on each shard (registered without a split version) is exact: pure
index arithmetic, as :mod:`hybridpar.geometry`, for the registry's plan-time check.

Why a module of its own: a copy exchanges no halos, so whether it computes the volume's shards is a
question of the layouts alone (its factor, the shards' boundaries), apart from the halo plans of the
layers that have split versions.
"""

from __future__ import annotations

from hybridpar.geometry import HaloError, check_split, shard_ranges

__all__ = ["check_copied_resample"]


def check_copied_resample(extent: int, n_out: int, parts: int, layer: str, dim: str) -> None:
    """Refuse (:class:`HaloError`) a split of a resampling run as a copy on each shard unless the copy
    computes the volume's own shards: its factor ``f`` (``n_out / extent``, or ``extent / n_out``) an
    integer, and every inner boundary ``b`` of the input's shards where the output's lie, ``f * b``
    when it upsamples (nearest: ``f`` voxels per voxel), ``b / f`` with ``b`` a multiple of ``f``
    when it downsamples (a stride-``f`` pick counts from its own shard's start).

    Why: a copy exchanges no halos and resamples its shard as if it were the volume; sizes may still
    agree where it picks the wrong voxels (a 5 | 4 split of 9 read ``[::2]``), so only the layouts
    can tell, and these are known at plan time."""
    check_split(extent, n_out, parts, layer, dim)
    up = n_out >= extent
    f = n_out // extent if up else round(extent / n_out)
    if (n_out % extent if up else n_out not in (extent // f, -(-extent // f))):
        reason = f"its extents {extent} -> {n_out} along {dim} resample by no whole factor"
        raise HaloError(f"{layer}: {reason}, which a copy on each shard cannot run exactly; register a split "
                        "version (to_dist=) or replicate it", layer=layer, reason=reason)
    ins = [lo for lo, _ in shard_ranges(extent, parts)[1:]]
    outs = [lo for lo, _ in shard_ranges(n_out, parts)[1:]]
    want = [b * f if up else b // f for b in ins]
    if want == outs and (up or all(b % f == 0 for b in ins)):
        return
    fits = parts if up else parts * f
    reason = (f"a copy on each shard (registered without to_dist) is exact only where the shards' "
              f"boundaries fall on its factor {f}, and extent {extent} split {parts} ways along {dim} "
              f"puts them at {ins} (output {outs})")
    raise HaloError(f"{layer}: {reason}; use an extent along {dim} that is a multiple of {fits}, or register "
                    "a split version (to_dist=)", layer=layer, reason=reason)
