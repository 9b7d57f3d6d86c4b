"""Periodic boxes and every padding mode on split volumes, exact against torch (float64, 1e-10 relative,
forward and backward): ``DistConv3d(padding_mode=...)``, the Dist pad layers, and adjoint tests of their
halo exchangers, on 1-8 ranks (one pytest test per grid and case family, the cases of a world size sharing
one process group; see periodic_cases.py). Without processes: the registry's windows of the pads
and of non-zero-padded convolutions give what torch's padding reads, and a periodic split too fine is an
error naming the layer, the dim and the split that fits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import distributed
import layer_cases
import periodic_cases


@pytest.mark.parametrize("family", list(periodic_cases.FAMILIES))
@pytest.mark.parametrize("world,shape", distributed.flat_grids(),
                         ids=distributed.grid_ids(distributed.flat_grids()))
def test_padding_modes_match_torch(pools, world, shape, family):
    # 8 ranks time-share 2 cores here: every other fixed convolution case, no random ones
    opts = {"n_random": 8, "every": 1} if world < 8 else {"n_random": 0, "every": 2}
    counts = pools(world).run(layer_cases.run_family, "periodic_cases", shape, family, opts, timeout=300)
    skipped = (family == "stack" and world == 8) or (family == "tagless" and 2 not in shape)
    assert skipped or counts[0] > 0, f"no {family} case ran on grid {shape}"


def _assembled_1d(x: np.ndarray, plans: list) -> np.ndarray:
    """Every rank's extended input along one dim, concatenated (kernel 1: the padded volume)."""
    parts, out = len(plans), []
    for i, p in enumerate(plans):
        pieces = []
        if p.recv_lo:
            q = plans[(i - 1) % parts]
            pieces.append(x[q.own[0]:q.own[1]][q.send_hi[0]:q.send_hi[1]])
        pieces.append(x[p.own[0] + p.trim_lo:p.own[1] - p.trim_hi])
        if p.recv_hi:
            q = plans[(i + 1) % parts]
            pieces.append(x[q.own[0]:q.own[1]][q.send_lo[0]:q.send_lo[1]])
        fetched = np.concatenate(pieces)
        out.append(fetched[list(p.index)] if p.index is not None else
                   np.concatenate([np.full(p.pad_lo, 0.5), fetched, np.full(p.pad_hi, 0.5)]))
    return np.concatenate(out)


PADS = [nn.ConstantPad3d((1, 2, -1, 3, 2, 0), 0.5), nn.ReplicationPad3d((2, 0, 1, -2, 3, 1)),
        nn.ReflectionPad3d((1, 3, 0, 2, 2, -1)), nn.CircularPad3d((2, -1, 3, 1, 0, 2))]
TORCH_MODE = {nn.ConstantPad3d: "constant", nn.ReplicationPad3d: "replicate", nn.ReflectionPad3d: "reflect",
              nn.CircularPad3d: "circular"}


@pytest.mark.parametrize("m", PADS, ids=lambda m: type(m).__name__)
def test_pad_windows_give_torch_padding(m):
    """What the planner reads (the registry's Window records through Window.plans) reproduces the
    torch pad along each dim on every split (torch lists W first: the extents check the order), so
    the halos it plans are the ones the layer exchanges."""
    from hybridpar import geometry
    from hybridpar.nn import registry

    entry = registry.lookup(m)
    assert entry.role == "window" and entry.to_dist is not None
    shape = (7, 9, 6)
    padded = m(torch.zeros(1, 1, *shape)).shape[2:]
    line = np.random.default_rng(0).random(9)
    for axis, w in enumerate(entry.windows_of(m)):
        lo, hi = w.pad_lo, w.pad_hi
        mode = TORCH_MODE[type(m)]
        want = F.pad(torch.tensor(line).view(1, 1, -1), (lo, hi), mode=mode,
                     **({"value": 0.5} if mode == "constant" else {})).view(-1).numpy()
        for parts in (1, 2, 3, 4):
            try:
                np.testing.assert_allclose(_assembled_1d(line, w.plans(9, parts)), want, rtol=1e-12)
                plans = w.plans(shape[axis], parts)
            except geometry.HaloError:
                assert parts > 2   # a split too fine for the padding
                continue
            assert sum(p.out[1] - p.out[0] for p in plans) == padded[axis]


@pytest.mark.parametrize("mode", ["circular", "replicate", "reflect"])
def test_conv_windows_carry_the_mode(mode):
    import dataclasses

    from hybridpar.nn import registry

    m = nn.Conv3d(1, 1, 3, padding=2, padding_mode=mode)
    w = registry.lookup(m).windows_of(m)[0]
    plans = w.plans(9, 3)
    assert {p.mode for p in plans} == {mode}
    line = np.random.default_rng(1).random(9)
    want = F.pad(torch.tensor(line).view(1, 1, -1), (2, 2), mode=mode).view(-1).numpy()
    padded = dataclasses.replace(w, kernel=1)   # the same padding read by a kernel of 1: the padded line
    np.testing.assert_allclose(_assembled_1d(line, padded.plans(9, 3)), want)


def test_periodic_split_too_fine_for_the_planner():
    """The planner's halo check (registry entry → geometry) on a periodic conv: the error names the
    layer, the dim, the wrap-around and the largest split that fits."""
    from hybridpar import geometry
    from hybridpar.nn import registry

    m = nn.Conv3d(2, 2, 5, padding=2, padding_mode="circular")
    entry = registry.lookup(m)
    with pytest.raises(geometry.HaloError) as err:
        entry.halo_widths(m, "encoder.0", (1, 2, 16, 9, 16), (1, 2, 16, 9, 16), (1, 5, 1))
    msg = str(err.value)
    assert msg.startswith("encoder.0: dim h: a halo of 2 voxels from the left neighbour (across the periodic "
                          "boundary) is wider than its shard of 1 voxels")
    assert msg.endswith("use a split of at most 4 along h")
    assert entry.halo_widths(m, "encoder.0", (1, 2, 16, 9, 16), (1, 2, 16, 9, 16), (2, 4, 1)) == \
        ((2, 2), (2, 2), (0, 0))
