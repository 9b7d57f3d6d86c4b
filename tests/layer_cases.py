"""Cases run on every rank of a spawned group: each Dist layer against its torch.nn counterpart.

Every case builds the torch layer from a seed, loads its state into the Dist layer (state_dict keys
must agree), runs both on the same global float64 input (scattered for the Dist layer, gathered
back), back-propagates the same random output gradient, and compares the output, the input gradient
and every parameter gradient by relative error. All ranks draw the same cases from the same seed, so
collectives line up. Failures are collected, not raised one by one, so one run reports them all.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import random
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hybridpar as hp
from hybridpar.geometry import HaloError

TOL = 1e-10


class Failures(list):
    def check(self, what: str, got: torch.Tensor | None, want: torch.Tensor | None, tol: float = TOL) -> None:
        if got is None or want is None:
            if (got is None) != (want is None):
                self.append(f"{what}: one side is None")
            return
        if got.shape != want.shape:
            self.append(f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
            return
        if not (want.is_floating_point() or want.is_complex()):  # a flag or a count: compared as numbers
            got, want = got.double(), want.double()
        # largest magnitudes as one reduction each (a whole model's state, 45M weights, is compared twice)
        scale = torch.linalg.vector_norm(want, float("inf")).item() if want.numel() else 0.0
        err = torch.linalg.vector_norm(got - want, float("inf")).item() / max(scale, 1e-30) \
            if want.numel() else 0.0
        if not err <= tol:
            self.append(f"{what}: relative error {err:.3e}")

    def raise_if_any(self, rank: int) -> None:
        if self:
            raise AssertionError(f"rank {rank}: {len(self)} failures:\n" + "\n".join(self[:40]))


def steps_match(fails: Failures, desc: str, engine, opt, ref: nn.Module | list[torch.Tensor], ref_opt,
                local: tuple, whole: tuple, loss_fn, steps: int = 3) -> None:
    """``steps`` optimizer steps of ``engine`` on this rank's ``local`` (x, y) beside ``ref`` on the
    ``whole`` (x, y) in one process; each step's loss must agree. ``ref`` may instead be the losses
    one process gave, in order (:func:`on_one_rank` of :func:`reference_steps`)."""
    for step in range(steps):
        opt.zero_grad()
        loss = engine.train_step(*local)
        opt.step()
        if isinstance(ref, list):
            ref_loss = ref[step]
        else:
            ref_opt.zero_grad()
            ref_loss = loss_fn(ref(whole[0]), whole[1])
            ref_loss.backward()
            ref_opt.step()
        fails.check(f"{desc} step {step} loss", loss.detach().reshape(()), ref_loss.detach())


def reference_steps(ref: nn.Module, ref_opt, whole: tuple, loss_fn, steps: int) -> list[torch.Tensor]:
    """The losses of ``steps`` optimizer steps of ``ref`` on the ``whole`` (x, y), in one process."""
    losses = []
    for _ in range(steps):
        ref_opt.zero_grad()
        loss = loss_fn(ref(whole[0]), whole[1])
        loss.backward()
        ref_opt.step()
        losses.append(loss.detach())
    return losses


_turns = itertools.count()  # the cases this process has computed on one rank, in order (alike on all)


def on_one_rank(compute: Callable[[], Any]) -> Any:
    """``compute()`` (the one-process reference of a case, the same on every rank) made on one rank,
    taking turns case by case, and given to every rank: the others need not spend the cores a whole
    volume's forward and backward costs, which a 2-core suite has too few of. An error it raises is
    raised on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return compute()
    owner = next(_turns) % dist.get_world_size()
    box: list[Any] = [None]
    if dist.get_rank() == owner:
        try:
            box[0] = (True, compute())
        except Exception as err:  # every rank raises it, so that the case fails alike everywhere
            box[0] = (False, f"{type(err).__name__}: {err}")
    dist.broadcast_object_list(box, src=owner)
    ok, value = box[0]
    if not ok:
        raise RuntimeError(f"the one-process reference failed: {value}")
    return value


def _same_on_all(shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def compare_layer(fails: Failures, desc: str, grid, ref: nn.Module, ours: nn.Module, shape, seed: int,
                  expect_error: bool = False, steps: int = 1, replicated_out: bool = False) -> None:
    """Run ``ref`` on the global input and ``ours`` on its shard; compare outputs and gradients."""
    ref = ref.double()
    missing = ours.load_state_dict(ref.state_dict(), strict=True)
    del missing
    ours = ours.double()
    if list(ours.state_dict()) != list(ref.state_dict()):
        fails.append(f"{desc}: state_dict keys differ")
    for step in range(steps):
        x = _same_on_all(shape, seed + step).requires_grad_()
        try:
            y = ours(hp.scatter(x, grid))
            y = y if replicated_out else hp.gather(y, grid)
        except HaloError:
            if not expect_error:
                fails.append(f"{desc}: unexpected HaloError")
            return
        if expect_error:
            fails.append(f"{desc}: expected a HaloError")
            return
        xr = x.detach().clone().requires_grad_()
        yr = ref(xr)
        g = _same_on_all(yr.shape, seed + 1000 + step)
        (y * g).sum().backward()
        (yr * g).sum().backward()
        fails.check(f"{desc} step {step} output", y.detach(), yr.detach())
        fails.check(f"{desc} step {step} input grad", x.grad, xr.grad)
        for (name, p), (_, pr) in zip(ours.named_parameters(), ref.named_parameters()):
            fails.check(f"{desc} step {step} {name}.grad", p.grad, pr.grad)
        for (name, b), (_, br) in zip(ours.named_buffers(), ref.named_buffers()):
            fails.check(f"{desc} step {step} buffer {name}", b.to(br.dtype), br)


def _fits(fn, *args) -> bool:
    """Whether a geometry call succeeds (the layer must then succeed; otherwise raise HaloError)."""
    try:
        fn(*args)
        return True
    except HaloError:
        return False


def conv_cases(grid, rng: random.Random, n_random: int):
    """Fixed cases over kernels 1-5, strides, paddings (incl. 'same'/'valid'), dilation, groups, bias,
    then a seeded random sweep."""
    fixed = []
    for k in (1, 2, 3, 4, 5):
        fixed.append(dict(k=k, s=1, p="same", d=1))
    for p in (0, 1, 2, "valid"):
        fixed.append(dict(k=3, s=1, p=p, d=1))
    for s in (2, 3):
        fixed.append(dict(k=3, s=s, p=1, d=1))
    fixed += [dict(k=3, s=1, p=2, d=2), dict(k=2, s=2, p=0, d=1), dict(k=3, s=1, p=1, d=1, groups=2),
              dict(k=3, s=1, p=1, d=1, bias=False)]
    for _ in range(n_random):
        s = rng.choice((1, 1, 2, 3))
        fixed.append(dict(k=rng.randint(1, 5), s=s, p=rng.choice((0, 1, 2) if s > 1 else (0, 1, 2, "same")),
                          d=rng.choice((1, 2)), groups=rng.choice((1, 1, 2)), bias=rng.random() < 0.8))
    for c in fixed:
        c.setdefault("groups", 1)
        c.setdefault("bias", True)
        c["shape"] = (rng.choice((1, 2)), 2 * c["groups"],
                      *[rng.choice((9, 12, 13, 17)) for _ in range(3)])
        c["overlap"] = rng.random() < 0.5
    return fixed


def run_conv(fails: Failures, grid, rng: random.Random, n_random: int = 12,
             transport: str | None = None) -> int:
    from hybridpar.geometry import same_padding, window_plans

    count = 0
    for i, c in enumerate(conv_cases(grid, rng, n_random)):
        cin, cout = c["shape"][1], 2 * c["groups"]
        kw = dict(kernel_size=c["k"], stride=c["s"], padding=c["p"], dilation=c["d"], groups=c["groups"],
                  bias=c["bias"])
        torch.manual_seed(i)
        ref = nn.Conv3d(cin, cout, **kw)
        ours = hp.nn.DistConv3d(cin, cout, **kw, grid=grid, overlap=c["overlap"], transport=transport)
        pads = (same_padding(c["k"], c["d"]) if c["p"] == "same" else (0, 0) if c["p"] == "valid"
                else (c["p"], c["p"]))
        ok = all(_fits(window_plans, c["shape"][2 + a], grid.spatial_shape[a], c["k"], c["s"], *pads, c["d"])
                 for a in range(3))
        compare_layer(fails, f"conv {c} grid {grid.spatial_shape}", grid, ref, ours, c["shape"], 10 * i,
                      expect_error=not ok)
        count += 1
    return count


def run_conv_transpose(fails: Failures, grid, rng: random.Random, n: int = 10) -> int:
    from hybridpar.geometry import transposed_plans

    cases = [dict(k=2, s=2, p=0, op=0, d=1), dict(k=3, s=2, p=1, op=1, d=1), dict(k=3, s=1, p=1, op=0, d=1),
             dict(k=4, s=3, p=1, op=2, d=1), dict(k=3, s=1, p=0, op=0, d=2)]
    for _ in range(n - len(cases)):
        s, d = rng.choice((1, 2, 3)), rng.choice((1, 2))
        cases.append(dict(k=rng.randint(1, 4), s=s, p=rng.choice((0, 1)), op=rng.randrange(max(s, d)), d=d))
    for i, c in enumerate(cases):
        shape = (rng.choice((1, 2)), 3, *[rng.choice((6, 7, 9)) for _ in range(3)])
        kw = dict(kernel_size=c["k"], stride=c["s"], padding=c["p"], output_padding=c["op"], dilation=c["d"])
        torch.manual_seed(i)
        ref = nn.ConvTranspose3d(3, 2, **kw)
        ours = hp.nn.DistConvTranspose3d(3, 2, **kw, grid=grid)
        ok = all(_fits(transposed_plans, shape[2 + a], grid.spatial_shape[a], c["k"], c["s"], c["p"], c["d"],
                       c["op"]) for a in range(3))
        compare_layer(fails, f"convT {c} grid {grid.spatial_shape}", grid, ref, ours, shape, 7 * i,
                      expect_error=not ok)
    return len(cases)


def run_pools(fails: Failures, grid, rng: random.Random, n: int = 8) -> int:
    from hybridpar.geometry import window_plans

    cases = [dict(k=2, s=2, p=0, d=1, ceil=False), dict(k=3, s=2, p=1, d=1, ceil=False),
             dict(k=3, s=1, p=1, d=1, ceil=False), dict(k=2, s=3, p=1, d=1, ceil=True),
             dict(k=3, s=2, p=0, d=2, ceil=True)]
    for _ in range(n):
        k = rng.randint(1, 3)
        cases.append(dict(k=k, s=rng.randint(1, 3), p=rng.randint(0, k // 2), d=rng.choice((1, 2)),
                          ceil=rng.random() < 0.5))
    count = 0
    for i, c in enumerate(cases):
        shape = (2, 2, *[rng.choice((8, 9, 13)) for _ in range(3)])

        def fits(d, shape=shape, c=c):
            return all(_fits(window_plans, shape[2 + a], grid.spatial_shape[a], c["k"], c["s"], c["p"],
                             c["p"], d, c["ceil"]) for a in range(3))

        ref = nn.MaxPool3d(c["k"], c["s"], c["p"], c["d"], ceil_mode=c["ceil"])
        ours = hp.nn.DistMaxPool3d(c["k"], c["s"], c["p"], c["d"], ceil_mode=c["ceil"], grid=grid)
        compare_layer(fails, f"maxpool {c} grid {grid.spatial_shape}", grid, ref, ours, shape, 3 * i,
                      expect_error=not fits(c["d"]))
        cip, div = rng.random() < 0.5, rng.choice((None, None, 5))
        ref = nn.AvgPool3d(c["k"], c["s"], c["p"], c["ceil"], count_include_pad=cip, divisor_override=div)
        ours = hp.nn.DistAvgPool3d(c["k"], c["s"], c["p"], c["ceil"], count_include_pad=cip,
                                   divisor_override=div, grid=grid)
        compare_layer(fails, f"avgpool {c} cip={cip} div={div} grid {grid.spatial_shape}", grid, ref, ours,
                      shape, 5 * i, expect_error=not fits(1))
        count += 2
    return count


def run_norms(fails: Failures, grid) -> int:
    count = 0
    for momentum in (0.1, None):
        for affine in (True, False):
            ref = nn.BatchNorm3d(3, momentum=momentum, affine=affine)
            ours = hp.nn.DistBatchNorm3d(3, momentum=momentum, affine=affine, grid=grid)
            compare_layer(fails, f"batchnorm momentum={momentum} affine={affine} grid {grid.spatial_shape}",
                          grid, ref, ours, (2, 3, 9, 13, 8), 11, steps=2)
            ref.eval()
            ours.eval()
            compare_layer(fails, f"batchnorm eval grid {grid.spatial_shape}", grid, ref, ours,
                          (2, 3, 9, 13, 8), 13)
            count += 2
    compare_layer(fails, f"global avg pool grid {grid.spatial_shape}", grid, nn.AdaptiveAvgPool3d(1),
                  hp.nn.DistGlobalAvgPool3d(grid=grid), (2, 3, 9, 13, 8), 17, replicated_out=True)
    return count + 1


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum()


def _sum_over(t: torch.Tensor, group) -> float:
    t = t.detach().clone()
    if group is not None:
        dist.all_reduce(t, group=group)
    return t.item()


def run_adjoints(fails: Failures, grid) -> int:
    """<A x, y> == <x, A^T y> for halo exchange, scatter, gather and Redistribute (A^T from autograd).

    Split tensors' inner products sum over the ranks of the split; replicated tensors count once.
    """
    group = grid.spatial_group
    count = 0
    shape = (9, 13, 11)
    for k, s, p in ((3, 1, 1), (5, 2, 2), (2, 2, 0), (4, 1, 0)):
        conv = hp.nn.DistConv3d(2, 2, k, s, p, grid=grid)
        x = hp.scatter(_same_on_all((2, 2, *shape), 1), grid).detach().requires_grad_()
        try:
            ex = conv.halo_exchanger(shape)
        except HaloError:
            continue
        hx = hp.comm.halo_exchange(x, ex)
        y = torch.randn(hx.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(grid.rank))
        _dot(hx, y).backward()
        lhs, rhs = _sum_over(_dot(hx, y), group), _sum_over(_dot(x, x.grad), group)
        fails.check(f"halo adjoint k={k} s={s} p={p}", torch.tensor(lhs), torch.tensor(rhs), 1e-12)
        count += 1
    # scatter: replicated -> split
    xg = _same_on_all((2, 3, *shape), 2).requires_grad_()
    xs = hp.scatter(xg, grid)
    y = torch.randn(xs.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(100 + grid.rank))
    _dot(xs, y).backward()
    fails.check("scatter adjoint", torch.tensor(_sum_over(_dot(xs, y), group)),
                torch.tensor(_dot(xg, xg.grad).item()), 1e-12)
    # gather: split -> replicated
    xl = xs.detach().clone().requires_grad_()
    yg = _same_on_all((2, 3, *shape), 3)
    xgat = hp.gather(xl, grid)
    _dot(xgat, yg).backward()
    fails.check("gather adjoint", torch.tensor(_dot(xgat, yg).item()),
                torch.tensor(_sum_over(_dot(xl, xl.grad), group)), 1e-12)
    count += 2
    # Redistribute between splits of the same ranks, including layouts with replicas
    n = grid.spatial_size
    targets = {(1, 1, n), (n, 1, 1), (1, n, 1), (1, 1, 1)}
    if n % 2 == 0:
        targets.add((2, 1, 1))
    for dst_shape in sorted(targets):
        dst = grid.with_spatial(dst_shape)
        xl = xs.detach().clone().requires_grad_()
        yd = hp.redistribute(xl, grid, dst)
        fails.check(f"redistribute {grid.spatial_shape}->{dst_shape} values",
                    hp.gather(yd.detach(), dst), xg.detach())
        # dst replicas hold identical copies: the inner product counts each copy once
        w = torch.randn(yd.shape, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(200 + dst.spatial_index % dst.spatial_size))
        _dot(yd, w).backward()
        lhs_local = _dot(yd, w) if dst.replica == 0 else torch.zeros((), dtype=torch.float64)
        fails.check(f"redistribute {grid.spatial_shape}->{dst_shape} adjoint",
                    torch.tensor(_sum_over(lhs_local, group)),
                    torch.tensor(_sum_over(_dot(xl, xl.grad), group)), 1e-12)
        count += 2
    return count


def run_stack(fails: Failures, grid) -> int:
    """A CosmoFlow-like stack with a dense head after a gather: every gradient matches torch."""
    torch.manual_seed(5)
    ref = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.LeakyReLU(0.3), nn.MaxPool3d(2),
                        nn.BatchNorm3d(4), nn.Conv3d(4, 4, 3, padding=1), nn.LeakyReLU(0.3),
                        nn.AvgPool3d(3, 2, 1), nn.Identity(), nn.Flatten(), nn.Linear(4 * 64, 3))
    ours = nn.Sequential(hp.nn.DistConv3d(2, 4, 3, padding=1, grid=grid, overlap=True), nn.LeakyReLU(0.3),
                         hp.nn.DistMaxPool3d(2, grid=grid), hp.nn.DistBatchNorm3d(4, grid=grid),
                         hp.nn.DistConv3d(4, 4, 3, padding=1, grid=grid), nn.LeakyReLU(0.3),
                         hp.nn.DistAvgPool3d(3, 2, 1, grid=grid), hp.nn.Gather(grid), nn.Flatten(),
                         nn.Linear(4 * 64, 3))
    ref = ref.double()
    ours.load_state_dict(ref.state_dict())
    ours.double()
    x = _same_on_all((2, 2, 16, 16, 16), 9)
    yr = ref(x)
    yr.square().sum().backward()
    # first with the global shapes inferred on every call, then told once (set_global_shapes): the
    # second pass must not infer any (each layer's shape all-gather is replaced by an error)
    for told in (False, True):
        if told:
            ours.zero_grad()
            hp.nn.set_global_shapes(ours, x.shape)
        with _no_shape_inference(told):
            y = ours(hp.scatter(x, grid))
            y.square().sum().backward()
        what = "stack, shapes set" if told else "stack"
        fails.check(f"{what} output", y.detach(), yr.detach())
        for (name, p), (_, pr) in zip(ours.named_parameters(), ref.named_parameters()):
            fails.check(f"{what} {name}.grad", p.grad, pr.grad)
    return 2


@contextlib.contextmanager
def _no_shape_inference(active: bool):
    """Make hybridpar's per-call global-shape all-gather an error while ``active``."""
    # (``hybridpar.comm.redistribute`` the attribute is the function: take the modules themselves)
    spatial_mod = importlib.import_module("hybridpar.nn.spatial")
    redistribute_mod = importlib.import_module("hybridpar.comm.redistribute")

    def boom(*_args, **_kwargs):
        raise AssertionError("the global shape was inferred although set_global_shapes had set it")

    saved = spatial_mod.infer_global_shape, redistribute_mod.infer_global_shape
    if active:
        spatial_mod.infer_global_shape = redistribute_mod.infer_global_shape = boom
    try:
        yield
    finally:
        spatial_mod.infer_global_shape, redistribute_mod.infer_global_shape = saved


FAMILIES = {
    "conv": lambda fails, grid, rng, opts: run_conv(fails, grid, rng, opts.get("n_random", 12)),
    "conv_transpose": lambda fails, grid, rng, opts: run_conv_transpose(fails, grid, rng),
    "pools": lambda fails, grid, rng, opts: run_pools(fails, grid, rng),
    "norms": lambda fails, grid, rng, opts: run_norms(fails, grid),
    "adjoints": lambda fails, grid, rng, opts: run_adjoints(fails, grid),
    "stack": lambda fails, grid, rng, opts: run_stack(fails, grid),
}
"""The case families: each ``(fails, grid, rng, opts) -> number of cases``, one pytest test per grid."""


def run_family(rank: int, world: int, cases: str, shape: tuple[int, int, int], family: str,
               opts: dict | None = None, seed: int = 0) -> int:
    """One family of a cases module (``cases``: its name, e.g. "layer_cases") on one spatial grid;
    raises naming every failing case; returns how many ran (0 where none fits the grid)."""
    fails = Failures()
    grid = hp.ProcessGrid(spatial=shape)
    # crc32, not hash(): str hashes differ between processes, and every rank must draw the same cases
    rng = random.Random(seed + zlib.crc32(f"{shape}/{family}".encode()))
    total = importlib.import_module(cases).FAMILIES[family](fails, grid, rng, opts or {})
    fails.raise_if_any(rank)
    return total
