"""Cases run on every rank of a spawned group: padding modes on split volumes against torch.nn.

``DistConv3d`` with every ``padding_mode`` (periodic boxes: ``'circular'``; edge copies:
``'replicate'``, ``'reflect'``; and ``'zeros'``), the four Dist pad layers with asymmetric and negative
(cropping) pads, and adjoint tests of the exchangers behind them: ⟨A x, y⟩ = ⟨x, Aᵀ y⟩ over the ranks,
Aᵀ from autograd. Float64; output, input gradient, weight and bias gradients within 1e-10 relative
(``layer_cases.compare_layer``). Where the geometry says a split is too fine, the layer must raise
HaloError instead. All ranks draw the same cases from the same seed, so collectives line up; every
failure names its case.
"""

from __future__ import annotations

import random

import torch
from torch import nn

import hybridpar as hp
from hybridpar.comm.transport import TorchP2P
from hybridpar.geometry import HaloError, same_padding, window_plans

from layer_cases import Failures, _dot, _fits, _same_on_all, _sum_over, compare_layer

MODES = ("circular", "replicate", "reflect", "zeros")
EXTENTS = (7, 9, 13)


def _pads(c: dict) -> tuple[int, int]:
    if c["p"] == "same":
        return same_padding(c["k"], c["d"])
    return (0, 0) if c["p"] == "valid" else (c["p"], c["p"])


def conv_cases(rng: random.Random, n_random: int) -> list[dict]:
    """Per mode: kernels 1-5 with 'same' (even kernels pad one more on the right), explicit padding,
    strides 2-3, dilation 2, groups, no bias; then a seeded random sweep over all modes."""
    cases = []
    for mode in MODES[:3]:
        cases += [dict(mode=mode, k=k, s=1, p="same", d=1) for k in (1, 2, 3, 4, 5)]
        cases += [dict(mode=mode, k=3, s=2, p=1, d=1), dict(mode=mode, k=3, s=3, p=2, d=1),
                  dict(mode=mode, k=4, s=2, p=1, d=1), dict(mode=mode, k=3, s=1, p=2, d=2),
                  dict(mode=mode, k=3, s=1, p="same", d=2), dict(mode=mode, k=2, s=1, p=1, d=1, groups=2),
                  dict(mode=mode, k=5, s=1, p=2, d=1, bias=False)]
    cases += [dict(mode="zeros", k=3, s=1, p="same", d=1), dict(mode="zeros", k=4, s=2, p=2, d=1)]
    for _ in range(n_random):
        s = rng.choice((1, 1, 2, 3))
        k, d = rng.randint(1, 5), rng.choice((1, 2))
        cases.append(dict(mode=rng.choice(MODES), k=k, s=s, d=d,
                          p=rng.choice((0, 1, 2) if s > 1 else (0, 1, 2, "same")), groups=rng.choice((1, 2)),
                          bias=rng.random() < 0.8))
    for c in cases:
        c.setdefault("groups", 1)
        c.setdefault("bias", True)
        c["shape"] = (rng.choice((1, 2)), 2 * c["groups"], *[rng.choice(EXTENTS) for _ in range(3)])
        c["overlap"] = rng.random() < 0.5
    return cases


def run_conv_modes(fails: Failures, grid, rng: random.Random, n_random: int, every: int = 1) -> int:
    """DistConv3d(padding_mode=...) against nn.Conv3d, or HaloError where the geometry says so;
    ``every``: run every so many of the cases only (many ranks on few cores)."""
    for i, c in enumerate(conv_cases(rng, n_random)[::every]):
        cin = c["shape"][1]
        kw = dict(kernel_size=c["k"], stride=c["s"], padding=c["p"], dilation=c["d"], groups=c["groups"],
                  bias=c["bias"], padding_mode=c["mode"])
        torch.manual_seed(i)
        ref = nn.Conv3d(cin, 2 * c["groups"], **kw)
        ours = hp.nn.DistConv3d(cin, 2 * c["groups"], **kw, grid=grid, overlap=c["overlap"])
        ok = all(_fits(window_plans, c["shape"][2 + a], grid.spatial_shape[a], c["k"], c["s"], *_pads(c),
                       c["d"], False, None, "layer", "dim", False, c["mode"]) for a in range(3))
        compare_layer(fails, f"conv {c} grid {grid.spatial_shape}", grid, ref, ours, c["shape"], 10 * i,
                      expect_error=not ok)
    return i + 1


PAD_CASES = [(1, 2, 0, 3, 2, 1), (3, 0, 1, 1, 0, 2), (-1, 2, 1, -2, 0, 1), (2, -1, -1, 1, 1, 0),
             (3, -2, 0, 0, -1, 2), (4, 4, 5, 0, 0, 5)]


def _pad_layers(padding: tuple[int, ...], grid, value: float = 0.5) -> list[tuple[str, nn.Module, nn.Module]]:
    return [("constant", nn.ConstantPad3d(padding, value),
             hp.nn.DistConstantPad3d(padding, value, grid=grid)),
            ("replicate", nn.ReplicationPad3d(padding), hp.nn.DistReplicationPad3d(padding, grid=grid)),
            ("reflect", nn.ReflectionPad3d(padding), hp.nn.DistReflectionPad3d(padding, grid=grid)),
            ("circular", nn.CircularPad3d(padding), hp.nn.DistCircularPad3d(padding, grid=grid))]


def run_pads(fails: Failures, grid, rng: random.Random) -> int:
    """The four Dist pads against torch with asymmetric and negative pads on uneven extents; the
    torch layers converted by the registry (``to_distributed``) on every other case."""
    from hybridpar.pipeline.convert import to_distributed

    count = 0
    for i, padding in enumerate(PAD_CASES):
        shape = (rng.choice((1, 2)), 2, *[rng.choice(EXTENTS) for _ in range(3)])
        pads = [(padding[4], padding[5]), (padding[2], padding[3]), (padding[0], padding[1])]
        for mode, ref, ours in _pad_layers(padding, grid):
            if mode == "reflect" and any(max(p) >= n for p, n in zip(pads, shape[2:])):
                continue  # torch refuses a reflection as wide as the volume
            if i % 2:
                ours = to_distributed(ref, grid)
            ok = all(_fits(window_plans, shape[2 + a], grid.spatial_shape[a], 1, 1, *pads[a], 1, False, None,
                           "layer", "dim", False, mode) for a in range(3))
            compare_layer(fails, f"{mode} pad {padding} shape {shape} grid {grid.spatial_shape}", grid, ref,
                          ours, shape, 100 + 7 * i, expect_error=not ok)
            count += 1
    return count


def run_stack(fails: Failures, grid) -> int:
    """Pads and convolutions in one model, global shapes told once (``set_global_shapes`` traces the
    Dist pads as their torch layers): a periodic pad then an unpadded conv, a reflecting conv, a
    replicating pad with a crop."""
    torch.manual_seed(7)
    ref = nn.Sequential(nn.CircularPad3d((1, 1, 2, 0, 1, 1)), nn.Conv3d(2, 3, 3), nn.Tanh(),
                        nn.Conv3d(3, 2, 3, padding=1, padding_mode="reflect"),
                        nn.ReplicationPad3d((0, 2, -1, 1, 2, -1)))
    ours = nn.Sequential(hp.nn.DistCircularPad3d((1, 1, 2, 0, 1, 1), grid=grid),
                         hp.nn.DistConv3d(2, 3, 3, grid=grid), nn.Tanh(),
                         hp.nn.DistConv3d(3, 2, 3, padding=1, padding_mode="reflect", grid=grid),
                         hp.nn.DistReplicationPad3d((0, 2, -1, 1, 2, -1), grid=grid))
    shape = (2, 2, 9, 13, 7)
    hp.nn.set_global_shapes(ours, shape)
    compare_layer(fails, f"pad/conv stack grid {grid.spatial_shape}", grid, ref, ours, shape, 21)
    return 1


def run_adjoints(fails: Failures, grid) -> int:
    """⟨A x, y⟩ = ⟨x, Aᵀ y⟩ for the exchangers of periodic, replicate and reflect convolutions and of
    the pads (halos across the faces, edge copies): split tensors' inner products sum over the ranks."""
    group = grid.spatial_group
    shape = (9, 13, 7)
    layers = [(f"{mode} conv k={k} s={s} p={p}",
               hp.nn.DistConv3d(2, 2, k, s, p, padding_mode=mode, grid=grid))
              for mode in MODES[:3] for k, s, p in ((3, 1, 1), (5, 2, 2), (4, 1, 2))]
    # (a constant pad is linear with a zero fill only)
    layers += [(f"{name} pad", m) for name, _, m in _pad_layers((2, 1, 0, 3, 1, 2), grid, value=0.0)]
    count = 0
    for what, layer in layers:
        try:
            ex = layer.halo_exchanger(shape)
        except HaloError:
            continue
        x = hp.scatter(_same_on_all((2, 2, *shape), 1), grid).detach().requires_grad_()
        hx = hp.comm.halo_exchange(x, ex)
        y = torch.randn(hx.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(grid.rank))
        _dot(hx, y).backward()
        lhs, rhs = _sum_over(_dot(hx, y), group), _sum_over(_dot(x, x.grad), group)
        fails.check(f"halo adjoint {what} grid {grid.spatial_shape}", torch.tensor(lhs), torch.tensor(rhs),
                    1e-12)
        count += 1
    return count


class TaglessP2P(TorchP2P):
    """Pairs messages as NCCL does, per peer in posting order, ignoring tags (gloo pairs messages of
    one tag in posting order): with two shards along a periodic dim both neighbours are one rank,
    and only the posting order keeps its two messages apart."""

    def exchange(self, sends, recvs) -> None:
        super().exchange([(p, t, 0) for p, t, _ in sends], [(p, t, 0) for p, t, _ in recvs])


def _tagless(grid) -> TaglessP2P:
    return TaglessP2P(grid.halo_group if grid.spatial_size > 1 else None)


def run_tagless(fails: Failures, grid, rng: random.Random) -> int:
    """Periodic convolutions and pads over a transport that ignores tags (see :class:`TaglessP2P`)."""
    count = 0
    shape = (1, 2, *[rng.choice(EXTENTS) for _ in range(3)])
    for i, (k, p, overlap) in enumerate(((4, "same", False), (4, "same", True), (3, 1, False))):
        torch.manual_seed(i)
        ref = nn.Conv3d(2, 2, k, padding=p, padding_mode="circular")
        ours = hp.nn.DistConv3d(2, 2, k, padding=p, padding_mode="circular", grid=grid, overlap=overlap)
        ours.halo_exchanger(shape[2:]).transport = _tagless(grid)
        compare_layer(fails, f"tagless circular conv k={k} p={p} overlap={overlap} grid {grid.spatial_shape}",
                      grid, ref, ours, shape, 300 + i)
        count += 1
    padding = (1, 2, 2, 1, 3, 1)
    ours = hp.nn.DistCircularPad3d(padding, grid=grid)
    ours.halo_exchanger(shape[2:]).transport = _tagless(grid)
    compare_layer(fails, f"tagless circular pad {padding} grid {grid.spatial_shape}", grid,
                  nn.CircularPad3d(padding), ours, shape, 310)
    return count + 1


FAMILIES = {  # layer_cases.run_family runs one per pytest test; opts: n_random, every
    "conv_modes": lambda fails, grid, rng, opts: run_conv_modes(fails, grid, rng, opts.get("n_random", 8),
                                                                opts.get("every", 1)),
    "pads": lambda fails, grid, rng, opts: run_pads(fails, grid, rng),
    # its first meta-device trace costs each rank about a second of CPU: not where every other is run
    "stack": lambda fails, grid, rng, opts: run_stack(fails, grid) if opts.get("every", 1) == 1 else 0,
    "adjoints": lambda fails, grid, rng, opts: run_adjoints(fails, grid),
    "tagless": lambda fails, grid, rng, opts: run_tagless(fails, grid, rng) if 2 in grid.spatial_shape else 0,
}
