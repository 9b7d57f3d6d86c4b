"""Dist layers under bf16 autocast and on channels_last_3d shards, against torch on the whole volume.

bf16: torch and the split layer both run under ``torch.autocast('cpu', dtype=torch.bfloat16)`` with
float32 parameters; the output dtype must be torch's (CPU autocast computes conv3d in bf16 but
promotes pools and some pads to float32) and output, input gradient and parameter gradients agree
within bf16 tolerances (relative to the largest entry). channels_last_3d: float64, output within
1e-10 and channels_last_3d wherever torch's is; forward and backward of a split convolution and
max pool make no copy of a whole shard (counted with a dispatch mode). Scatter, gather and
Redistribute keep dtype and format bit for bit. Marked ``cuda``: the same cases on CUDA tensors, two
ranks sharing the GPU (staged transport), CUDA autocast (which keeps pools in bf16).
"""

from __future__ import annotations

import pytest

import distributed

BF16_TOL = 3e-2


def _cases(hp, nn):
    """(name, torch layer factory, Dist layer factory(grid), input shape, output replicated)."""
    s = (2, 4, 12, 10, 8)
    return [
        ("conv k3 p1", lambda: nn.Conv3d(4, 6, 3, padding=1),
         lambda g: hp.nn.DistConv3d(4, 6, 3, padding=1, grid=g), s, False),
        ("conv k3 p1 overlap", lambda: nn.Conv3d(4, 6, 3, padding=1),
         lambda g: hp.nn.DistConv3d(4, 6, 3, padding=1, grid=g, overlap=True), s, False),
        ("conv k3 s2 circular", lambda: nn.Conv3d(4, 6, 3, 2, 1, padding_mode="circular"),
         lambda g: hp.nn.DistConv3d(4, 6, 3, 2, 1, padding_mode="circular", grid=g), s, False),
        ("conv k3 replicate", lambda: nn.Conv3d(4, 6, 3, padding=1, padding_mode="replicate"),
         lambda g: hp.nn.DistConv3d(4, 6, 3, padding=1, padding_mode="replicate", grid=g), s, False),
        ("convT k3 s2 p1 op1", lambda: nn.ConvTranspose3d(4, 3, 3, 2, 1, output_padding=1),
         lambda g: hp.nn.DistConvTranspose3d(4, 3, 3, 2, 1, output_padding=1, grid=g), s, False),
        ("maxpool 2", lambda: nn.MaxPool3d(2), lambda g: hp.nn.DistMaxPool3d(2, grid=g), s, False),
        ("avgpool 3 2 1", lambda: nn.AvgPool3d(3, 2, 1), lambda g: hp.nn.DistAvgPool3d(3, 2, 1, grid=g), s,
         False),
        ("global avgpool", lambda: nn.AdaptiveAvgPool3d(1), lambda g: hp.nn.DistGlobalAvgPool3d(grid=g), s,
         True),
        ("adaptive avgpool 3", lambda: nn.AdaptiveAvgPool3d(3),
         lambda g: hp.nn.DistAdaptiveAvgPool3d(3, grid=g), s, True),
        ("adaptive maxpool 2", lambda: nn.AdaptiveMaxPool3d(2),
         lambda g: hp.nn.DistAdaptiveMaxPool3d(2, grid=g), s, True),
        ("upsample trilinear", lambda: nn.Upsample(scale_factor=2, mode="trilinear"),
         lambda g: hp.nn.DistUpsample(scale_factor=2, mode="trilinear", grid=g), s, False),
        ("upsample nearest", lambda: nn.Upsample(scale_factor=2),
         lambda g: hp.nn.DistUpsample(scale_factor=2, grid=g), s, False),
        ("constant pad", lambda: nn.ConstantPad3d((1, 2, 0, 1, 2, 1), 0.5),
         lambda g: hp.nn.DistConstantPad3d((1, 2, 0, 1, 2, 1), 0.5, grid=g), s, False),
        ("replication pad", lambda: nn.ReplicationPad3d(1),
         lambda g: hp.nn.DistReplicationPad3d(1, grid=g), s, False),
        ("reflection pad", lambda: nn.ReflectionPad3d(2),
         lambda g: hp.nn.DistReflectionPad3d(2, grid=g), s, False),
        ("circular pad", lambda: nn.CircularPad3d(1), lambda g: hp.nn.DistCircularPad3d(1, grid=g), s, False),
    ]


def _run_case(hp, torch, grid, ref, ours, x, replicated: bool, autocast: bool):
    """(torch output, our gathered output, torch input grad, our input grad, param grad pairs)."""
    ours.load_state_dict(ref.state_dict())
    device = x.device.type
    ctx = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if autocast else \
        (lambda: torch.autocast(device, enabled=False))
    xr = x.detach().clone().requires_grad_()
    xo = x.detach().clone().requires_grad_()
    with ctx():
        yr = ref(xr)
        yl = ours(hp.scatter(xo, grid))
    y = yl if replicated else hp.gather(yl, grid)
    g = torch.randn(yr.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7)).to(yr)
    (yr * g).sum().backward()
    (y * g.to(y.dtype)).sum().backward()
    params = [(p.grad, q.grad) for p, q in zip(ours.parameters(), ref.parameters())]
    return yr, y, yl, xr.grad, xo.grad, params


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _body(rank: int, world: int, grids: list, device: str = "cpu") -> None:
    import torch
    from torch import nn

    import hybridpar as hp
    from hybridpar.device.memfmt import CL

    fails: list[str] = []
    for shape in grids:
        grid = hp.ProcessGrid(spatial=shape)
        for name, make_ref, make_ours, xshape, replicated in _cases(hp, nn):
            where = f"{name} grid {shape}"
            # bf16 autocast, float32 parameters
            torch.manual_seed(1)
            ref = make_ref().to(device)
            x = torch.randn(xshape, generator=torch.Generator().manual_seed(3)).to(device)
            yr, y, _, gr, go, params = _run_case(hp, torch, grid, ref, make_ours(grid).to(device), x,
                                                 replicated, True)
            if y.dtype != yr.dtype:
                fails.append(f"{where} bf16: output dtype {y.dtype}, torch's {yr.dtype}")
            for what, a, b in [("output", y, yr), ("input grad", go, gr)] + \
                    [(f"param {i} grad", p, q) for i, (p, q) in enumerate(params)]:
                if a.dtype != b.dtype:
                    fails.append(f"{where} bf16: {what} dtype {a.dtype} != torch's {b.dtype}")
                elif _rel(a, b) > BF16_TOL:
                    fails.append(f"{where} bf16: {what} relative error {_rel(a, b):.2e}")
            # channels_last_3d, float64
            ref = make_ref().double().to(device)
            x = torch.randn(xshape, dtype=torch.float64,
                            generator=torch.Generator().manual_seed(4)).to(device, memory_format=CL)
            yr, y, yl, gr, go, params = _run_case(hp, torch, grid, ref, make_ours(grid).double().to(device),
                                                  x, replicated, False)
            for what, a, b in [("output", y, yr), ("input grad", go, gr)] + \
                    [(f"param {i} grad", p, q) for i, (p, q) in enumerate(params)]:
                if _rel(a, b) > 1e-10:
                    fails.append(f"{where} channels_last: {what} relative error {_rel(a, b):.2e}")
            if yr.is_contiguous(memory_format=CL) and not yl.is_contiguous(memory_format=CL):
                fails.append(f"{where} channels_last: torch's output is channels_last_3d, ours is not "
                             f"(strides {yl.stride()})")
        fails += _layout_changes(hp, torch, grid, device)
        fails += _no_full_copies(hp, torch, grid, device)
    if fails:
        raise AssertionError(f"rank {rank}: {len(fails)} failures:\n" + "\n".join(fails[:40]))


def _layout_changes(hp, torch, grid, device: str) -> list[str]:
    """Scatter, Redistribute and gather move bf16 channels_last_3d tensors exactly, keeping both."""
    from hybridpar.device.memfmt import CL

    fails = []
    x = torch.randn(2, 3, 9, 8, 7, generator=torch.Generator().manual_seed(5)).bfloat16()
    x = x.to(device, memory_format=CL).requires_grad_()
    xs = hp.scatter(x, grid)
    other = grid.with_spatial((1, 1, grid.spatial_size))
    xo = hp.redistribute(xs, grid, other)
    back = hp.gather(xo, other)
    for what, t in (("scatter", xs), ("redistribute", xo), ("gather", back)):
        if t.dtype != torch.bfloat16 or not t.is_contiguous(memory_format=CL):
            fails.append(f"{what} grid {grid.spatial_shape}: dtype {t.dtype}, strides {t.stride()}")
    if not torch.equal(back, x):
        fails.append(f"scatter/redistribute/gather grid {grid.spatial_shape}: values changed")
    back.float().sum().backward()
    if x.grad.dtype != torch.bfloat16 or not torch.equal(x.grad, torch.ones_like(x)):
        fails.append(f"scatter/redistribute/gather grid {grid.spatial_shape}: wrong gradient")
    return fails


def _no_full_copies(hp, torch, grid, device: str) -> list[str]:
    """Forward and backward of a split conv and max pool on a channels_last_3d shard: no copy op
    (clone, copy_, _to_copy) of a tensor as large as the shard, and torch's format kept."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hybridpar.device.memfmt import CL, memory_format

    class Copies(TorchDispatchMode):
        def __init__(self, limit: int) -> None:
            super().__init__()
            self.limit, self.seen = limit, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in ("clone", "copy_", "_to_copy") and \
                    isinstance(out, torch.Tensor) and out.numel() >= self.limit:
                self.seen.append(f"{name} {tuple(out.shape)}")
            return out

    fails = []
    conv = torch.nn.Conv3d(4, 4, 3, padding=1).to(device)
    layers = [("conv", conv, hp.nn.DistConv3d(4, 4, 3, padding=1, grid=grid).to(device)),
              ("conv overlap", conv,
               hp.nn.DistConv3d(4, 4, 3, padding=1, grid=grid, overlap=True).to(device)),
              ("maxpool", torch.nn.MaxPool3d(3, 1, 1), hp.nn.DistMaxPool3d(3, 1, 1, grid=grid))]
    # float32, two samples: torch's CPU kernels keep channels_last_3d there (not for float64, nor
    # for conv3d on one sample), and a split layer must keep it where torch's kernel does
    x = torch.randn(2, 4, 12, 10, 8, generator=torch.Generator().manual_seed(6)).to(device, memory_format=CL)
    xs = hp.scatter(x, grid).detach()
    for name, ref, layer in layers:
        if name == "conv overlap" or (name == "maxpool" and grid.spatial_size == 1):
            # the overlapped conv assembles its output from interior and shell (copies by design); a
            # pool assembles the padding of an unsplit dim (conv pads inside its kernel)
            continue
        layer.load_state_dict(ref.state_dict())
        hp.nn.set_global_shapes(layer, x.shape)
        xr = x.clone().requires_grad_()
        yr = ref(xr)
        yr.backward(torch.ones_like(yr))
        inp = xs.clone().requires_grad_()
        mode = Copies(inp.numel())
        with mode:  # autograd.grad: no leaf accumulation, whose layout contract may copy
            y = layer(inp)
            (gx,) = torch.autograd.grad(y, inp, torch.ones_like(y))
        if mode.seen:
            fails.append(f"{name} grid {grid.spatial_shape}: full-shard copies {mode.seen}")
        for what, ours, theirs in (("output", y, yr), ("input gradient", gx, xr.grad)):
            if theirs.is_contiguous(memory_format=CL) and memory_format(ours) is not CL:
                fails.append(f"{name} grid {grid.spatial_shape}: {what} left channels_last_3d")
    return fails


GRIDS = [(1, (1, 1, 1)), (2, (2, 1, 1)), (2, (1, 1, 2)), (4, (2, 2, 1))]


@pytest.mark.parametrize("world,shape", GRIDS, ids=distributed.grid_ids(GRIDS))
def test_bf16_and_channels_last_match_torch(pools, world, shape):
    pools(world).run(_body, [shape], timeout=600)


@pytest.mark.cuda
def test_bf16_and_channels_last_match_torch_on_cuda():
    distributed.run(_body, 2, [(2, 1, 1), (1, 1, 2)], "cuda", timeout=600, env={"LOCAL_WORLD_SIZE": "2"})
