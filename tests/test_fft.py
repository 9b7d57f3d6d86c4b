"""``hp.fft`` on split volumes against ``torch.fft`` on the whole, float64 to 1e-10, forward and
backward, on every grid of 1-8 ranks the layer suites use, odd and uneven extents: the spectrum's
modes, the filter contract ``irfftn(S.replace(S.data * f(k)))`` = ``irfftn(rfftn(x) * f(k))``, the
adjoint of the complex transposes (⟨A z, w⟩ = ⟨z, Aᵀ w⟩), the power spectrum and FNO's spectral
convolution against their single-process layers, and an FNO-style model trained by ``parallelize``
(three SGD steps) against one process. One pool per world size."""

from __future__ import annotations

import pytest
import torch

from distributed import GRIDS, flat_grids, grid_ids
from layer_cases import Failures
from test_user_models import _compare

MACHINE = "v100"  # a preset of the performance model
SHAPES = [(2, 2, 7, 6, 5), (1, 3, 5, 9, 8), (1, 1, 8, 8, 8), (1, 2, 3, 9, 4)]  # the last: empty pencils on 8


def _filter(kd: torch.Tensor, kh: torch.Tensor, kw: torch.Tensor) -> torch.Tensor:
    """A complex filter of all three wave numbers (a derivative along D and a smoothing)."""
    k2 = kd * kd + kh * kh + kw * kw
    return torch.exp(-k2 / 9.0) * (1 + 0.5j * kd - 0.25j * kh) + 0.1j * kw


def _body(rank: int, world: int, shape3: tuple[int, int, int]) -> None:
    import hybridpar as hp

    fails = Failures()
    grid = hp.ProcessGrid(spatial=shape3)
    group_bytes, hp.fft.GROUP_BYTES = hp.fft.GROUP_BYTES, 1  # these small fields in channel groups too
    try:
        _cases(fails, grid, shape3)
    finally:
        hp.fft.GROUP_BYTES = group_bytes
    fails.raise_if_any(rank)


def _cases(fails: Failures, grid, shape3: tuple[int, int, int]) -> None:
    import hybridpar as hp
    from hybridpar.fft import _layouts, _move

    for shape in SHAPES:
        desc = f"grid {shape3} input {shape}"
        g = torch.Generator().manual_seed(sum(shape))
        x = torch.randn(shape, dtype=torch.float64, generator=g)
        w = torch.randn(shape, dtype=torch.float64, generator=g)
        # the spectrum's modes are torch's, in the box its layout gives this rank
        spec = hp.fft.rfftn(hp.scatter(x, grid), grid)
        try:  # a global shape the shard is not part of is refused, not transformed
            hp.fft.rfftn(hp.scatter(x, grid), grid, (shape[2] + 3, *shape[3:]))
            fails.append(f"{desc}: rfftn took a wrong global shape")
        except ValueError as err:
            if "is not this rank's" not in str(err):
                raise
        whole = torch.fft.rfftn(x, dim=(-3, -2, -1))
        box = tuple(slice(a, b) for a, b in spec.box())
        fails.check(f"{desc} rfftn modes", spec.data, whole[(Ellipsis, *box)], 1e-10)
        kd, kh, kw = spec.wavenumbers()
        d, h, wd = x.shape[2:]
        want_k = [torch.fft.fftfreq(d, 1 / d)[box[0]], torch.fft.fftfreq(h, 1 / h)[box[1]],
                  torch.fft.rfftfreq(wd, 1 / wd)[box[2]]]
        for name, got, want in zip("dhw", (kd, kh, kw), want_k, strict=True):
            if not torch.equal(got.reshape(-1), want.to(got.dtype)):
                fails.append(f"{desc} wavenumbers k{name}: {got.reshape(-1).tolist()} != {want.tolist()}")
        # the filter contract, forward and backward
        xg = x.clone().requires_grad_()
        s = hp.fft.rfftn(hp.scatter(xg, grid), grid)
        y = hp.gather(hp.fft.irfftn(s.replace(s.data * _filter(*s.wavenumbers())), grid), grid)
        (y * w).sum().backward()
        xr = x.clone().requires_grad_()
        k = [torch.fft.fftfreq(d, 1 / d, dtype=torch.float64).view(-1, 1, 1),
             torch.fft.fftfreq(h, 1 / h, dtype=torch.float64).view(1, -1, 1),
             torch.fft.rfftfreq(wd, 1 / wd, dtype=torch.float64).view(1, 1, -1)]
        yr = torch.fft.irfftn(torch.fft.rfftn(xr, dim=(-3, -2, -1)) * _filter(*k), s=(d, h, wd),
                              dim=(-3, -2, -1))
        (yr * w).sum().backward()
        fails.check(f"{desc} filtered field", y.detach(), yr.detach(), 1e-10)
        fails.check(f"{desc} gradient of the input", xg.grad, xr.grad, 1e-10)
        # the complex transposes are adjoint pairs: <A z, v> = <z, A^T v> (A^T by autograd)
        a, b, c = _layouts(grid)
        modes = (d, h, wd // 2 + 1)
        zw = torch.randn((*shape[:2], *modes), dtype=torch.complex128, generator=g)
        vw = torch.randn((*shape[:2], *modes), dtype=torch.complex128, generator=g)
        z = hp.scatter(torch.view_as_real(zw).movedim(-1, -4), a)
        z = torch.complex(z.select(-4, 0), z.select(-4, 1)).requires_grad_()
        az = _move(z, modes, a, c)
        v = hp.scatter(torch.view_as_real(vw).movedim(-1, -4), c)
        v = torch.complex(v.select(-4, 0), v.select(-4, 1))
        lhs = (torch.view_as_real(az) * torch.view_as_real(v)).sum()  # this rank's part of <A z, v>
        lhs.backward()  # z.grad = A^T v
        rhs = (torch.view_as_real(z) * torch.view_as_real(z.grad)).sum()
        both = torch.stack([lhs.detach(), rhs.detach()])
        torch.distributed.all_reduce(both)
        fails.check(f"{desc} adjoint of the transposes", both[0:1], both[1:2], 1e-12)
        _layers(fails, desc, grid, x, w, g)


def _layers(fails: Failures, desc: str, grid, x: torch.Tensor, w: torch.Tensor, g: torch.Generator) -> None:
    """DistPowerSpectrum and DistSpectralConv3d against their single-process layers, fwd and bwd."""
    import hybridpar as hp

    edges = [0.0, 1.0, 1.5, 2.5, 4.0, 9.0]
    modes = (min(2, (x.shape[2] + 1) // 2), min(3, (x.shape[3] + 1) // 2), min(2, x.shape[4] // 2 + 1))
    ref_conv = hp.nn.SpectralConv3d(x.shape[1], 2, modes).double()
    ref_conv.weight.data = torch.randn(ref_conv.weight.shape, dtype=torch.float64, generator=g)
    conv = hp.nn.DistSpectralConv3d(x.shape[1], 2, modes, grid=grid).double()
    conv.load_state_dict(ref_conv.state_dict())
    wy = torch.randn((x.shape[0], 2, *x.shape[2:]), dtype=torch.float64, generator=g)
    wp = torch.randn((*x.shape[:2], len(edges) - 1), dtype=torch.float64, generator=g)
    for name, ref, ours, weight in (("power spectrum", hp.nn.PowerSpectrum(edges),
                                     hp.nn.DistPowerSpectrum(edges, grid=grid), wp),
                                    ("spectral conv", ref_conv, conv, wy)):
        xr, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
        want = ref(xr)
        got = ours(hp.scatter(xg, grid))
        got = hp.gather(got, grid) if name == "spectral conv" else got
        (want * weight).sum().backward()
        (got * weight).sum().backward()
        fails.check(f"{desc} {name} forward", got.detach(), want.detach(), 1e-10)
        fails.check(f"{desc} {name} input gradient", xg.grad, xr.grad, 1e-10)
    fails.check(f"{desc} spectral conv weight gradient", conv.weight.grad, ref_conv.weight.grad, 1e-10)


@pytest.mark.parametrize("world,shape3", flat_grids(GRIDS), ids=grid_ids(flat_grids(GRIDS)))
def test_fft_matches_torch(pools, world, shape3):
    pools(world).run(_body, shape3, timeout=300)


class FNO(torch.nn.Module):
    """An FNO-style network: a 1x1x1 lifting, two blocks of SpectralConv3d + a 1x1x1 conv, a projection."""

    def __init__(self) -> None:
        import hybridpar as hp

        super().__init__()
        self.lift = torch.nn.Conv3d(1, 4, 1)
        self.spectral = torch.nn.ModuleList([hp.nn.SpectralConv3d(4, 4, (3, 3, 2)) for _ in range(2)])
        self.local = torch.nn.ModuleList([torch.nn.Conv3d(4, 4, 1) for _ in range(2)])
        self.project = torch.nn.Conv3d(4, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lift(x)
        for spectral, local in zip(self.spectral, self.local, strict=True):
            h = torch.nn.functional.gelu(spectral(h) + local(h))
        return self.project(h)


class PkNet(torch.nn.Module):
    """A regressor with a power-spectrum branch (CNN + P(k) hybrids): P(k) of the input beside pooled
    convolution features, into one dense head."""

    def __init__(self) -> None:
        import hybridpar as hp

        super().__init__()
        self.conv = torch.nn.Conv3d(1, 3, 3, padding=1)
        self.pool = torch.nn.AdaptiveAvgPool3d(1)
        self.pk = hp.nn.PowerSpectrum([0.5, 1.5, 2.5, 3.5, 5.0])
        self.head = torch.nn.Linear(3 + 4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.pool(torch.relu(self.conv(x))).flatten(1)
        return self.head(torch.cat([features, torch.log(self.pk(x)).flatten(1)], dim=1))


def _model_body(rank: int, world: int, model: str, spec: dict) -> None:
    fails = Failures()
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 1, 9, 8, 6, dtype=torch.float64, generator=g)
    y = torch.randn((2, 2) if model == "PkNet" else (2, 1, 9, 8, 6), dtype=torch.float64, generator=g)
    _compare(fails, f"{model} {spec}", globals()[model], spec, x, y)
    fails.raise_if_any(rank)


SPECS = [{"grid": {"spatial": [2, 2, 1]}}, {"grid": {"data": 2, "spatial": [1, 1, 2]}}]


@pytest.mark.parametrize("model", ["FNO", "PkNet"])
@pytest.mark.parametrize("spec", SPECS, ids=["2x2", "data2-spatial2"])
def test_spectral_models_train_split_as_in_one_process(pools, model, spec):
    """Three SGD steps of an FNO-style model and of a P(k)-branch regressor, split 2 x 2 and data x
    spatial by ``parallelize``, equal one process (the spectral layers swapped in by the registry)."""
    pools(4).run(_model_body, model, spec, timeout=300)


class _Untraceable(torch.nn.Module):
    """The FNO behind a Python check torch.fx fixes at trace time: planned by module swapping."""

    def __init__(self) -> None:
        super().__init__()
        self.fno = FNO()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._gate(self.fno(x), x)

    def _gate(self, y: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        return y * 2 if x is not None and torch.jit.isinstance(x, torch.Tensor) else y


def test_explain_and_the_performance_model_count_the_transposes():
    """A slab transform of 8^3 on 2 ranks moves half the complex modes there and back (160 + 160 real
    numbers per sample); ``explain`` shows each spectral layer's transposes and the performance model
    costs them."""
    import hybridpar as hp
    from hybridpar import perfmodel as pm
    from hybridpar.fft import transpose_elements
    from hybridpar.planner.explain import explain

    assert transpose_elements((8, 8, 8), (2, 1, 1), 1, 1) == 320
    assert transpose_elements((8, 8, 8), (1, 1, 1), 4, 4) == 0
    spec = hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 2, 1]}})
    table = explain(spec, FNO(), (2, 1, 16, 16, 16), 4)
    assert table.count("⇄ FFT transposes") == 2
    plan = spec.plan(FNO(), (2, 1, 16, 16, 16), 4)
    moved = {r.name: r.transpose_bytes for r in plan}
    assert moved["spectral.0"] == 4 * 2 * transpose_elements((16, 16, 16), (2, 2, 1), 4, 4) > 0
    assert moved["lift"] == 0
    swapped = {r.name: r.transpose_bytes for r in spec.plan(_Untraceable(), (2, 1, 16, 16, 16), 4)}
    assert swapped["fno.spectral.0"] == moved["spectral.0"]  # module swapping plans them alike
    costs = {c.name: c for c in pm.predict(FNO(), spec, MACHINE, 4, input_shape=(2, 1, 16, 16, 16)).layers}
    assert costs["spectral.0"].redistribute_forward > 0 and costs["spectral.0"].redistribute_backward > 0
    assert costs["lift"].redistribute_forward == 0
