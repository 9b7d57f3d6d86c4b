"""The layer registry: every layer type the library converts has a complete entry (role, FLOPs,
window arguments the geometry accepts, a Dist class with the torch layer's state-dict keys), every
exported Dist class is reachable from an entry, and a layer a user registers works end to end:
``explain`` shows it split with its halos, the FLOP counter counts it, and ``parallelize`` runs it on
two ranks with the single-process numbers (float64)."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

import distributed
from layer_cases import Failures


class Blur3d(nn.Module):
    """A user's layer: a 3x3x3 box filter (no parameters)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.avg_pool3d(x, 3, 1, 1)


def _register_blur() -> None:
    import hybridpar as hp
    from hybridpar.nn import registry

    hp.nn.register(Blur3d, role="window", op="pool",
                   to_dist=lambda m, grid, overlap=False: hp.nn.DistAvgPool3d(3, 1, 1, grid=grid),
                   window=lambda m: (hp.nn.Window(3, 1, 1, 1),) * 3,
                   flops=lambda m, x, y: ({"forward_other": 27 * y.numel()},
                                          registry.LayerGeometry("window")))


def _samples() -> list[nn.Module]:
    """One instance of every torch 3D layer type hybridpar splits (and of its own spectral layers)."""
    import hybridpar as hp

    return [hp.nn.SpectralConv3d(2, 2, (2, 2, 2)), hp.nn.PowerSpectrum([0.5, 1.5, 2.5]),
            nn.Conv3d(2, 4, 3, padding=1), nn.Conv3d(2, 2, 3, padding=1, padding_mode="circular"),
            nn.ConvTranspose3d(2, 2, 2, 2), nn.MaxPool3d(2), nn.AvgPool3d(3, 2, 1), nn.BatchNorm3d(2),
            nn.AdaptiveAvgPool3d(1), nn.AdaptiveAvgPool3d(2), nn.AdaptiveMaxPool3d(2),
            nn.Upsample(scale_factor=2, mode="trilinear"), nn.GroupNorm(1, 2),
            nn.InstanceNorm3d(2, affine=True),
            nn.ConstantPad3d(1, 0.5), nn.ReplicationPad3d(1), nn.ReflectionPad3d(1),
            nn.CircularPad3d(1), nn.LPPool3d(2, 2), nn.Dropout(0.2), nn.AlphaDropout(0.2), nn.RReLU()]


def _complete_entries(rank: int, world: int) -> None:
    import hybridpar as hp
    from hybridpar.nn import registry
    from hybridpar.pipeline.convert import to_distributed

    fails = Failures()
    grid = hp.ProcessGrid(spatial=(1, 1, 1))
    built: set[type] = set()
    for m in _samples():
        entry = registry.lookup(m)
        what = repr(m)
        if entry is None or entry.to_dist is None:
            fails.append(f"{what}: no entry with a Dist class")
            continue
        if entry.role not in registry.ROLES or entry.op not in registry.OPS:
            fails.append(f"{what}: role {entry.role} / op {entry.op}")
        x = torch.empty(2, 2, 8, 8, 8, device="meta")
        y = m.to("meta")(x)
        work, _ = entry.flops(m, x, y)
        if not isinstance(work, dict):
            fails.append(f"{what}: flops gives {type(work).__name__}")
        if entry.role in ("window", "transposed"):
            ws = entry.windows_of(m)
            try:
                ws[0].plans(8, 2)
            except Exception as err:
                fails.append(f"{what}: window {ws[0]} refused by geometry: {err}")
        entry.halo_widths(m, "x", (2, 2, 8, 8, 8), tuple(y.shape), (2, 1, 1))
        d = to_distributed(m, grid)
        built.add(type(d))
        if list(d.state_dict()) != list(m.state_dict()):
            fails.append(f"{what}: state dict keys {list(d.state_dict())} != {list(m.state_dict())}")
    exported = {getattr(hp.nn, n) for n in hp.nn.__all__ if n.startswith("Dist")}
    # DistGlobalAvgPool3d stays for hand-built models; AdaptiveAvgPool3d(1) converts to the adaptive one
    missing = {c.__name__ for c in exported} - {c.__name__ for c in built} - {"DistGlobalAvgPool3d"}
    if missing:
        fails.append(f"exported Dist classes no entry builds: {sorted(missing)}")
    if registry.lookup(Blur3d) is not None:
        fails.append("Blur3d registered before the user did")
    fails.raise_if_any(rank)


def test_every_converted_layer_has_a_complete_entry():
    distributed.run(_complete_entries, 1, timeout=120)


def _user_layer(rank: int, world: int) -> None:
    import hybridpar as hp
    from hybridpar.planner import explain

    _register_blur()
    fails = Failures()
    torch.manual_seed(1)  # the same weights on every rank
    model = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), Blur3d(), nn.ReLU(), nn.Conv3d(2, 1, 3, padding=1))
    spec = hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 1, 1]}})
    table = explain(spec, model, (2, 1, 9, 8, 8))
    row = next(line for line in table.splitlines() if line.startswith("1 "))
    if "Blur3d" not in row or "2x1x1" not in row or "1/1" not in row:
        fails.append(f"explain row of the user's layer: {row!r}")
    counted = hp.flops.count(model, (2, 1, 9, 8, 8)).by_name()
    if counted["1"].forward_other != 27 * 2 * 2 * 9 * 8 * 8:
        fails.append(f"FLOPs of the user's layer: {counted['1'].forward_other}")
    ref = model.double()
    engine = hp.parallelize(nn.Sequential(*[m for m in ref]), spec, loss_fn=F.mse_loss)
    x = torch.randn(2, 1, 9, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y = torch.randn(2, 1, 9, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    loss = engine.train_step(*engine.shard_batch(x, y))
    ref_loss = F.mse_loss(ref(x), y)
    ref_loss.backward()
    fails.check("user layer loss", loss.reshape(()), ref_loss.detach())
    for name, p in engine.named_parameters():
        fails.check(f"user layer model grad {name}", p.grad, ref.get_parameter(name).grad)
    # a gather inside a split region is said once per job (rank 0), never silently
    ruled = hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 1, 1]},
                                       "layers": {"2": {"spatial": "replicate"}}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hp.parallelize(nn.Sequential(*[m for m in ref]), ruled, loss_fn=F.mse_loss,
                       input_shape=(2, 1, 9, 8, 8))
    said = [str(w.message) for w in caught if "gather a split activation" in str(w.message)]
    if len(said) != (1 if rank == 0 else 0) or (said and "2 (ReLU)" not in said[0]):
        fails.append(f"gather warning on rank {rank}: {said}")
    fails.raise_if_any(rank)


def test_user_registered_layer_end_to_end():
    distributed.run(_user_layer, 2, timeout=120)


def test_grad_split_marks_leave_the_parameter_alone():
    """A parameter's split is kept beside it: no attribute on the tensor, nothing in the state dict,
    and a deep copy (a new parameter) starts unmarked."""
    import copy

    from hybridpar.comm.reduce import grad_split, mark_grad_split

    lin = nn.Linear(2, 2)
    before = dict(vars(lin.weight))
    mark_grad_split(lin.parameters(), 4)
    assert (grad_split(lin.weight), grad_split(lin.bias)) == (4, 4)
    assert dict(vars(lin.weight)) == before
    assert list(lin.state_dict()) == ["weight", "bias"]
    assert grad_split(copy.deepcopy(lin).weight) == 1
    assert grad_split(nn.Linear(2, 2).weight) == 1
