"""Geometry checked without any process: against torch.tensor_split, torch's output sizes, and a
1-D simulation of every rank assembling its extended input from its plan and computing its outputs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hybridpar.geometry import (
    HaloError,
    conv_output_extent,
    interior,
    max_parts,
    ntuple,
    plans_from_needs,
    same_padding,
    shard_range,
    shard_ranges,
    transposed_output_extent,
    transposed_plans,
    window_plans,
)


@pytest.mark.parametrize("extent,parts", [(n, p) for n in (0, 1, 5, 13, 17, 64) for p in (1, 2, 3, 4, 7, 8)])
def test_shards_match_tensor_split(extent, parts):
    """Balanced split, first shards take the remainder, exactly as torch.tensor_split."""
    pieces = torch.tensor_split(torch.arange(extent), parts)
    assert [(int(p[0]), int(p[-1]) + 1) if len(p) else None for p in pieces] == \
        [r if r[1] > r[0] else None for r in shard_ranges(extent, parts)]


def test_shard_range_rejects_bad_index():
    with pytest.raises(ValueError, match="outside"):
        shard_range(10, 2, 2)
    with pytest.raises(ValueError, match="parts"):
        shard_range(10, 0, 0)


@pytest.mark.parametrize("n,k,s,p,d,ceil", list(itertools.product((5, 8, 13), (1, 2, 3, 4), (1, 2, 3), (0, 1),
                                                                   (1, 2), (False, True))))
def test_output_extent_matches_torch(n, k, s, p, d, ceil):
    if p > (d * (k - 1) + 1) // 2 or d * (k - 1) + 1 > n + 2 * p:
        return
    x = torch.zeros(1, 1, n)
    assert conv_output_extent(n, k, s, p, p, d) == F.conv1d(x, torch.zeros(1, 1, k), stride=s, padding=p,
                                                           dilation=d).shape[-1]
    assert conv_output_extent(n, k, s, p, p, d, ceil) == F.max_pool1d(x, k, s, p, d, ceil_mode=ceil).shape[-1]


def test_a_pool_in_ceil_mode_over_an_extent_below_its_window_matches_torch():
    """With ``ceil_mode`` a window may overhang the input: an extent of 1 pooled by 2 gives 1 voxel (a
    volume's last level at odd sizes); torch's count, or 0 where torch refuses the pool."""
    for n, k, s, p, d in itertools.product(range(1, 5), range(1, 6), range(1, 5), range(3), (1, 2)):
        if p > k // 2:
            continue
        try:
            want = F.max_pool1d(torch.zeros(1, 1, n), k, s, p, d, ceil_mode=True).shape[-1]
        except RuntimeError:  # "output size is too small"
            want = 0
        assert conv_output_extent(n, k, s, p, p, d, True) == want, (n, k, s, p, d)


@pytest.mark.parametrize("n,k,s,p,d,op", [
    (n, k, s, p, d, op) for n in (3, 7) for k in (1, 2, 3) for s in (1, 2, 3) for p in (0, 1) for d in (1, 2)
    for op in (0, 1) if op < max(s, d) and (n - 1) * s - 2 * p + d * (k - 1) + op + 1 > 0])
def test_transposed_extent_matches_torch(n, k, s, p, d, op):
    y = F.conv_transpose1d(torch.zeros(1, 1, n), torch.zeros(1, 1, k), stride=s, padding=p, dilation=d,
                           output_padding=op)
    assert transposed_output_extent(n, k, s, p, d, op) == y.shape[-1]


def test_same_padding_puts_odd_voxel_right():
    assert same_padding(3) == (1, 1)
    assert same_padding(4) == (1, 2)
    assert same_padding(3, 2) == (2, 2)


def _extended(x, plans, i, fill=0.0):
    """What rank i assembles: fill, left halo (as the left rank sends it), own trimmed, right halo, fill."""
    p = plans[i]
    own = x[p.own[0]:p.own[1]]
    parts = [np.full(p.pad_lo, fill)]
    if p.recv_lo:
        left = plans[i - 1]
        parts.append(x[left.own[0]:left.own[1]][left.send_hi[0]:left.send_hi[1]])
    parts.append(own[p.trim_lo:len(own) - p.trim_hi])
    if p.recv_hi:
        right = plans[i + 1]
        parts.append(x[right.own[0]:right.own[1]][right.send_lo[0]:right.send_lo[1]])
    parts.append(np.full(p.pad_hi, fill))
    ext = np.concatenate(parts)
    assert len(ext) == p.extended
    return ext


def _windows(x, k, s, d, n_out):
    return np.array([x[o * s:o * s + d * (k - 1) + 1:d].sum() for o in range(n_out)])


@pytest.mark.parametrize("n", [1, 2, 5, 7, 13, 17])
def test_window_plans_reproduce_global_windows(n):
    """Every (parts, kernel, stride, pads, dilation, ceil): concatenated local results == global result,
    or a HaloError; every rank's windows lie fully inside its extended input."""
    rng = np.random.default_rng(n)
    checked = 0
    for parts, k, s, pl, ph, d, ceil in itertools.product((1, 2, 3, 4, 8), (1, 2, 3, 4, 5), (1, 2, 3),
                                                          (0, 1, 2), (0, 1, 2), (1, 2), (False, True)):
        x = rng.random(n)
        n_out = conv_output_extent(n, k, s, pl, ph, d, ceil)
        if n_out == 0:
            continue
        try:
            plans = window_plans(n, parts, k, s, pl, ph, d, ceil)
        except HaloError:
            continue
        padded = np.concatenate([np.zeros(pl), x, np.zeros(ph + d * k + s)])
        expected = _windows(padded, k, s, d, n_out)
        got = []
        for i, p in enumerate(plans):
            ext = _extended(x, plans, i)
            n_loc = p.out[1] - p.out[0]
            assert n_loc == 0 or (n_loc - 1) * s + d * (k - 1) + 1 <= len(ext)
            got.append(_windows(ext, k, s, d, n_loc))
        np.testing.assert_allclose(np.concatenate(got), expected, rtol=1e-12)
        checked += 1
    assert checked > 100


@pytest.mark.parametrize("n", [3, 5, 8, 13])
def test_transposed_plans_reproduce_global_result(n):
    rng = np.random.default_rng(n)
    checked = 0
    for parts, k, s, p, d, op in itertools.product((1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 3), (0, 1, 2), (1, 2),
                                                    (0, 1, 2)):
        if op >= max(s, d) or transposed_output_extent(n, k, s, p, d, op) <= 0:
            continue
        x, w = rng.random(n), rng.random(k)
        ref = F.conv_transpose1d(torch.tensor(x).view(1, 1, -1), torch.tensor(w).view(1, 1, -1), stride=s,
                                 padding=p, dilation=d, output_padding=op).view(-1).numpy()
        try:
            plans, origins = transposed_plans(n, parts, k, s, p, d, op)
        except HaloError:
            continue
        got = []
        for i, pl in enumerate(plans):
            ext = _extended(x, plans, i)
            a, b = pl.out
            full = np.zeros(b - a)
            if len(ext):
                y = F.conv_transpose1d(torch.tensor(ext).view(1, 1, -1), torch.tensor(w).view(1, 1, -1),
                                       stride=s, dilation=d).view(-1).numpy()
                for j, v in enumerate(y):
                    if a <= origins[i] + j < b:
                        full[origins[i] + j - a] = v
            got.append(full)
        np.testing.assert_allclose(np.concatenate(got), ref, rtol=1e-12, atol=1e-12)
        checked += 1
    assert checked > 50


def test_asymmetric_halos_and_trims():
    """Stride 2 on an uneven split: halos differ left and right, and surplus input is trimmed."""
    plans = window_plans(13, 3, 3, 2, 1, 1, 1)
    assert [p.out for p in plans] == [(0, 3), (3, 5), (5, 7)]
    assert plans[1].halo == (0, 1)          # needs one voxel from the right, nothing from the left
    assert plans[0].send_hi == (0, 0) and plans[1].send_lo == (0, 1)
    assert plans[2].pad_hi == 1 and plans[0].pad_lo == 1
    trims = window_plans(12, 2, 1, 3, 0, 0, 1)   # 1x1 stride 3 reads every third voxel only
    assert any(p.trim_lo or p.trim_hi for p in trims)


def test_halo_wider_than_neighbour_is_a_clear_error():
    with pytest.raises(HaloError) as err:
        window_plans(5, 4, 5, 1, 2, 2, 1, layer="DistConv3d(features.0)", dim="H")
    msg = str(err.value)
    assert "DistConv3d(features.0)" in msg and "dim H" in msg and "shard of 1 voxels" in msg
    assert "halo of 2 voxels" in msg and "at most 3" in msg


def test_too_small_to_split_names_what_fits():
    with pytest.raises(HaloError, match="at most 2 along W"):
        window_plans(4, 4, 2, 2, layer="DistMaxPool3d", dim="W")


@pytest.mark.parametrize("n,parts,k,s", [(16, 4, 3, 1), (17, 3, 4, 2), (9, 2, 3, 3), (12, 5, 2, 1)])
def test_plans_from_needs_match_window_plans(n, parts, k, s):
    """A window layer without padding, described only by the input range each output shard reads,
    gets the plans window_plans gives it."""
    n_out = conv_output_extent(n, k, s)
    needs = lambda outs: [(a * s, (b - 1) * s + k) if b > a else (0, 0) for a, b in outs]  # noqa: E731
    assert plans_from_needs(n, n_out, parts, needs) == window_plans(n, parts, k, s)


def test_plans_from_needs_refuse_empty_shards():
    with pytest.raises(HaloError, match="at most 2 along H"):
        plans_from_needs(2, 2, 3, lambda outs: outs, layer="Up", dim="H")


def test_ntuple_expands_and_checks():
    assert ntuple(3) == (3, 3, 3) and ntuple([1, 2, 3]) == (1, 2, 3) and ntuple(2, 2) == (2, 2)
    with pytest.raises(ValueError, match=r"DistMaxPool3d: stride must be an int or 3 ints, got \(1, 2\)"):
        ntuple((1, 2), what="stride", layer="DistMaxPool3d")
    with pytest.raises(ValueError, match="kernel_size must be an int or 3 ints"):
        ntuple(1.5, what="kernel_size")
    strides = ntuple(tuple(np.array([2, 2, 1])), what="stride")  # as MONAI's SegResNetDS computes them
    assert strides == (2, 2, 1) and all(type(s) is int for s in strides)


def test_max_parts():
    assert max_parts(16, 3, 1, 1, 1) == 16
    assert max_parts(5, 5, 1, 2, 2) == 3


def test_interior_excludes_every_halo_read():
    for n, parts, k, s, p in itertools.product((9, 13), (2, 3), (1, 3, 5), (1, 2), (0, 1, 2)):
        try:
            plans = window_plans(n, parts, k, s, p, p)
        except HaloError:
            continue
        for pl in plans:
            lo, hi = interior(pl, pl.out[1] - pl.out[0], k, s, 1)
            first_own = pl.pad_lo + pl.recv_lo if pl.recv_lo else 0
            last_own = pl.extended - (pl.recv_hi + pl.pad_hi) if pl.recv_hi else pl.extended
            for o in range(lo, hi):
                assert o * s >= first_own and o * s + k <= last_own


# ---------------------------------------------------------------------- padding modes (periodic boxes)
def _assembled(x, plans, i, mode, fill=0.0):
    """What rank i assembles under ``mode``: the neighbours' sends (across the faces too when
    circular), its kept own voxels, then the fill or the edge-voxel map of the plan."""
    p, parts = plans[i], len(plans)

    def shard(j):
        return x[plans[j].own[0]:plans[j].own[1]]

    pieces = []
    if p.recv_lo:
        j = (i - 1) % parts
        assert i > 0 or mode == "circular"
        pieces.append(shard(j)[plans[j].send_hi[0]:plans[j].send_hi[1]])
    own = shard(i)
    pieces.append(own[p.trim_lo:len(own) - p.trim_hi])
    if p.recv_hi:
        j = (i + 1) % parts
        assert i < parts - 1 or mode == "circular"
        pieces.append(shard(j)[plans[j].send_lo[0]:plans[j].send_lo[1]])
    fetched = np.concatenate(pieces)
    assert len(fetched) == p.fetched
    if p.index is not None:
        ext = fetched[list(p.index)] if p.index else fetched[:0]
    else:
        ext = np.concatenate([np.full(p.pad_lo, fill), fetched, np.full(p.pad_hi, fill)])
    assert len(ext) == p.extended
    return ext


def _torch_padded(x, pl, ph, mode):
    t = torch.tensor(x).view(1, 1, -1)
    return F.pad(t, (pl, ph), mode="constant" if mode == "zeros" else mode).view(-1).numpy()


@pytest.mark.parametrize("mode", ["zeros", "circular", "replicate", "reflect"])
@pytest.mark.parametrize("n", [1, 2, 5, 7, 9, 13])
def test_mode_plans_reproduce_torch_padding(mode, n):
    """Every split, kernel, stride, padding and dilation: each rank's windows over what it assembles
    (halos across the periodic faces, edge copies) concatenate to the windows over torch's padded
    input, or the geometry raises HaloError (a split too fine) or ValueError (padding torch refuses)."""
    rng = np.random.default_rng(n)
    checked = errors = 0
    for parts, k, s, pl, ph, d in itertools.product((1, 2, 3, 4), (1, 2, 3, 5), (1, 2, 3), (0, 1, 2, 3),
                                                    (0, 1, 2), (1, 2)):
        n_out = conv_output_extent(n, k, s, pl, ph, d)
        if n_out == 0:
            continue
        x = rng.random(n)
        try:
            plans = window_plans(n, parts, k, s, pl, ph, d, mode=mode)
        except HaloError:
            errors += 1
            continue
        except ValueError:
            with pytest.raises(RuntimeError):
                _torch_padded(x, pl, ph, mode)
            continue
        expected = _windows(_torch_padded(x, pl, ph, mode), k, s, d, n_out)
        got = [_windows(_assembled(x, plans, i, mode), k, s, d, p.out[1] - p.out[0])
               for i, p in enumerate(plans)]
        np.testing.assert_allclose(np.concatenate(got), expected, rtol=1e-12)
        checked += 1
    assert checked > (5 if n < 5 else 150), (checked, errors)


@pytest.mark.parametrize("mode", ["zeros", "circular", "replicate", "reflect"])
def test_pad_plans_with_cropping_match_torch(mode):
    """A pad layer is a kernel-1 window: asymmetric and negative pads (torch crops; circular crops
    before it wraps) on every split, against F.pad."""
    rng = np.random.default_rng(3)
    checked = 0
    for n, parts, pl, ph in itertools.product((4, 7, 9), (1, 2, 3, 4), range(-3, 5), range(-3, 5)):
        x = rng.random(n)
        n_out = n + pl + ph
        if n_out < 1:
            continue
        try:
            want = _torch_padded(x, pl, ph, mode)
        except RuntimeError:
            with pytest.raises((ValueError, HaloError)):
                window_plans(n, parts, 1, 1, pl, ph, mode=mode)
            continue
        try:
            plans = window_plans(n, parts, 1, 1, pl, ph, mode=mode)
        except HaloError:
            continue
        got = np.concatenate([_assembled(x, plans, i, mode) for i in range(parts)])
        np.testing.assert_allclose(got, want, rtol=1e-12)
        checked += 1
    assert checked > 200


def test_periodic_neighbours_wrap_around():
    """Two shards: the left and right neighbour are the same rank, two distinct messages; one shard:
    the rank is its own neighbour across both faces."""
    two = window_plans(8, 2, 3, 1, 1, 1, periodic=True)
    assert [p.mode for p in two] == ["circular"] * 2 and all(p.periodic for p in two)
    assert [(p.recv_lo, p.recv_hi, p.pad_lo, p.pad_hi) for p in two] == [(1, 1, 0, 0)] * 2
    assert two[0].send_lo == (0, 1) and two[0].send_hi == (3, 4)    # rank 1 gets both, one each side
    assert two[1].send_lo == (0, 1) and two[1].send_hi == (3, 4)
    one = window_plans(5, 1, 5, 1, 2, 2, periodic=True)[0]
    assert (one.recv_lo, one.recv_hi, one.send_lo, one.send_hi) == (2, 2, (0, 2), (3, 5))
    assert window_plans(8, 2, 3, 1, 1, 1, mode="circular") == two
    with pytest.raises(ValueError, match="contradicts"):
        window_plans(8, 2, 3, 1, 1, 1, periodic=True, mode="reflect")
    with pytest.raises(ValueError, match="padding mode 'mirror'"):
        window_plans(8, 2, 3, 1, 1, 1, mode="mirror")


def test_periodic_split_too_fine_names_layer_dim_and_fit():
    """A periodic halo wider than the shard across the boundary: layer, dim, the wrap, what fits."""
    with pytest.raises(HaloError) as err:
        window_plans(9, 5, 5, 1, 2, 2, periodic=True, layer="DistConv3d(enc.0)", dim="W")
    msg = str(err.value)   # shards 2, 2, 2, 2, 1: rank 0's left halo lives on the last shard
    assert msg.startswith("DistConv3d(enc.0): dim W: a halo of 2 voxels from the left neighbour (across the "
                          "periodic boundary) is wider than its shard of 1 voxels")
    assert "split 5 ways, periodic" in msg and msg.endswith("use a split of at most 4 along W")
    assert max_parts(9, 5, 1, 2, 2, periodic=True) == 4
    window_plans(9, 4, 5, 1, 2, 2, periodic=True)   # what the message says fits does fit


def test_reflect_fetches_edge_voxels_from_a_neighbour():
    """A shard thinner than the reflection: the voxels it mirrors come from its neighbour."""
    plans = window_plans(6, 3, 1, 1, 3, 0, mode="reflect")        # a ReflectionPad of 3 on the left
    assert plans[0].out == (0, 3) and plans[0].need == (-3, 0)
    assert plans[0].own == (0, 2) and plans[0].trim_lo == 1       # mirrors voxels 3, 2, 1: keeps 1
    assert plans[0].recv_hi == 2 and plans[1].send_lo == (0, 2)   # and gets 2, 3 from rank 1
    assert plans[0].index == (2, 1, 0) and plans[0].pad_lo == 3


def test_padding_torch_refuses_is_a_value_error():
    with pytest.raises(ValueError, match="reflect padding of 5/0 voxels.*extent of 5"):
        window_plans(5, 1, 1, 1, 5, 0, mode="reflect", layer="DistReflectionPad3d", dim="D")
    with pytest.raises(ValueError, match="wrap around the volume more than once"):
        window_plans(4, 1, 1, 1, 0, 5, periodic=True)


def test_interior_of_periodic_plans_excludes_halo_reads():
    for n, parts, k, p in itertools.product((9, 13), (1, 2, 3), (1, 3, 5), (0, 1, 2)):
        try:
            plans = window_plans(n, parts, k, 1, p, p, periodic=True)
        except HaloError:
            continue
        for pl in plans:
            lo, hi = interior(pl, pl.out[1] - pl.out[0], k, 1, 1)
            first_own = pl.recv_lo
            last_own = pl.extended - pl.recv_hi
            for o in range(lo, hi):
                assert o >= first_own and o + k <= last_own
