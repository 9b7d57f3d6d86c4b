"""The model given to parallelize stays the user's: its mode governs the engine
(hybridpar.pipeline.model_mode), and planning leaves its state alone (hybridpar.planner.untouched).

``model.eval()`` then ``engine.predict`` gives one process's eval output and leaves BatchNorm's running
statistics where they were; ``train_step`` in eval mode keeps them frozen, as torch does, with every
gradient one process's (the split BatchNorm's weights' too, summed over the shards);
``model.train()`` back, every step is one process's again. A forward that reads
``self.training`` runs by module swapping and takes the model's branch (with per-layer rules, which
keep the traced graph, the graph of the other mode is refused). A counter and an EMA the forward
updates (in place, or rebound) read after one and two steps what one process reads: the planner's runs
of the forward (the trace) leave them as they were. Float64, on 2 ranks [2,1,1] and 4 ranks [2,2,1],
several cases per call.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridpar as hp

from layer_cases import Failures

SHAPE = (2, 1, 12, 10, 8)


class BNNet(nn.Module):
    """Traced: a BatchNorm and an InstanceNorm with running statistics between convolutions (both
    normalise with their running statistics in eval mode, their affine weights still trained)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.BatchNorm3d(4), nn.ReLU(),
                                  nn.Conv3d(4, 4, 3, padding=1),
                                  nn.InstanceNorm3d(4, affine=True, track_running_stats=True),
                                  nn.Conv3d(4, 1, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class BNCumulative(BNNet):
    """BNNet with cumulative averages (``momentum=None``: running statistics averaged over every batch
    seen, a weight read from the ``num_batches_tracked`` counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.body[1].momentum = self.body[4].momentum = None


class ModeUntraced(nn.Module):
    """Untraceable (a branch on the input's depth), reading ``self.training``, with a BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn = nn.Conv3d(1, 4, 3, padding=1), nn.BatchNorm3d(4)
        self.c2 = nn.Conv3d(4, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.c1(x)))
        if x.shape[2] > 4:
            h = h - h.mean(dim=(2, 3, 4), keepdim=True)
        if self.training:
            h = 2 * h + 0.5
        return self.c2(h)


class ModeTraced(nn.Module):
    """Traced, its forward differing between the modes: the graph holds the traced mode's branch."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(1, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        return h * 2 if self.training else h


def _mode_case(fails: Failures, desc: str, make: type, x: torch.Tensor, y: torch.Tensor, split: list[int]
               ) -> None:
    """model.eval(): predict and a frozen-statistics step; model.train(): steps; engine.eval() sets
    the model's flag too."""
    torch.manual_seed(0)
    ref, model = make().double(), make().double()
    model.load_state_dict(ref.state_dict())
    engine = hp.parallelize(model, {"grid": {"spatial": split}}, loss_fn=F.mse_loss)
    xl, yl = engine.shard_batch(x, y)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)

    def step(what: str) -> None:
        """One step beside one process: the loss and every gradient (one scale for all: a bias before a
        BatchNorm has none), then the update."""
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = engine.train_step(xl, yl)
        want = F.mse_loss(ref(x), y)
        want.backward()
        fails.check(f"{desc} {what} loss", loss.detach().reshape(()), want.detach())
        pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters(), strict=True)]
        fails.check(f"{desc} {what} gradients", torch.cat([g.flatten() for g, _ in pairs]),
                    torch.cat([g.flatten() for _, g in pairs]))
        opt.step()
        ref_opt.step()

    def state(what: str) -> None:
        got = engine.full_state_dict()
        for k, v in ref.state_dict().items():
            fails.check(f"{desc} {what} {k}", got[k], v)

    step("training step")
    model.eval()
    ref.eval()
    with torch.no_grad():
        want = ref(x)
    fails.check(f"{desc} predict after model.eval()", engine.predict(xl), want)
    state("after predict in eval mode: state")
    step("eval-mode step (frozen statistics)")
    state("after an eval-mode step: state")
    model.train()
    ref.train()
    step("training step after model.train()")
    step("second training step")
    state("after model.train() and two steps: state")
    for m in (*model.modules(), *ref.modules()):  # fine-tuning: the norms frozen by their own eval()
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
    step("a step with each BatchNorm frozen by its own eval()")
    state("after a step with frozen BatchNorms: state")
    model.train()
    ref.train()
    engine.eval()
    if model.training:
        fails.append(f"{desc}: engine.eval() left the model in training mode")
    engine.train()
    if not model.training:
        fails.append(f"{desc}: engine.train() left the model in eval mode")


def _refused_case(fails: Failures, desc: str, x: torch.Tensor, split: list[int]) -> None:
    """With per-layer rules (which keep the traced graph) a graph of one mode is refused in the other,
    model.eval() as engine.eval(); model.train() puts it back."""
    from hybridpar.planner.terms import SpecError

    torch.manual_seed(0)
    ref, model = ModeTraced().double(), ModeTraced().double()
    model.load_state_dict(ref.state_dict())
    ruled = {"grid": {"spatial": split}, "layers": {"conv": {"spatial": split}}}  # rules keep the graph
    engine = hp.parallelize(model, ruled, loss_fn=F.mse_loss)
    xl, _ = engine.shard_batch(x, x)
    model.eval()
    try:
        engine.predict(xl)
        fails.append(f"{desc}: predict after model.eval() ran the graph traced in training mode")
    except SpecError as err:
        if "differs between training and eval" not in str(err) or "model.train(True)" not in str(err):
            fails.append(f"{desc}: refusal says {err}")
    model.train()
    with torch.no_grad():
        fails.check(f"{desc} predict after model.train()", engine.predict(xl), ref(x))
    nested = nn.Sequential(ModeTraced().double())  # traced into: its own flag chose the branch
    engine = hp.parallelize(nested, {"grid": {"spatial": split}, "layers": {"0.conv": {"spatial": split}}},
                            loss_fn=F.mse_loss)
    xl, _ = engine.shard_batch(x, x)
    nested[0].eval()
    try:
        engine.predict(xl)
        fails.append(f"{desc}: predict after a traced-into module's eval() ran its training graph")
    except SpecError as err:
        if "0's mode has changed since the engine traced it" not in str(err):
            fails.append(f"{desc}: refusal says {err}")


def _mode_body(rank: int, world: int, split: list[int]) -> None:
    fails = Failures()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(SHAPE, dtype=torch.float64, generator=g)
    y = torch.randn(SHAPE, dtype=torch.float64, generator=g)
    for desc, make in (("BatchNorm, traced", BNNet), ("cumulative BatchNorm (momentum None)", BNCumulative),
                       ("self.training and BatchNorm, untraceable", ModeUntraced),
                       ("self.training, traceable: run by module swapping", ModeTraced)):
        try:
            _mode_case(fails, f"{desc} {split}", make, x, y, split)
        except Exception as err:  # name the case, then go on with the others
            fails.append(f"{desc} {list(split)}: {type(err).__name__}: {err}")
    try:
        _refused_case(fails, f"self.training, traced {split}", x, split)
    except Exception as err:
        fails.append(f"self.training, traced {split}: {type(err).__name__}: {err}")
    fails.raise_if_any(rank)


class RootCounter(nn.Module):
    """A warm-up counter and an EMA updated in place in the model's own forward (fx runs it while
    tracing; the graph then reads the buffers between layers, so the model runs by module swapping)."""

    branch = False

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv3d(1, 4, 3, padding=1), nn.Conv3d(4, 1, 3, padding=1)
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(1, 4, 1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        h = F.relu(self.c1(x))
        if self.branch and x.shape[2] > 4:  # untraceable
            h = h * 1.5
        self.ema.mul_(0.9).add_(0.1 * h.mean(dim=(0, 2, 3, 4), keepdim=True).detach())
        return self.c2(h - self.ema) * torch.clamp(self.steps / 4, max=1)


class BranchCounter(RootCounter):
    """RootCounter untraceable from its start: a branch on the input's depth."""

    branch = True


class RootRebound(RootCounter):
    """The counter and the EMA rebound to new tensors in the model's own forward (``self.ema = ...``),
    the slot planning must put the model's own tensor back into."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps = self.steps + 1
        h = F.relu(self.c1(x))
        self.ema = 0.9 * self.ema + 0.1 * h.mean(dim=(0, 2, 3, 4), keepdim=True).detach()
        return self.c2(h - self.ema) * torch.clamp(self.steps / 4, max=1)


class Ema(nn.Module):
    """A layer of the user's own: a counter in place, an EMA rebound (``self.ema = ...``)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(1, 4, 1, 1, 1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.ema = 0.9 * self.ema + 0.1 * h.mean(dim=(0, 2, 3, 4), keepdim=True).detach()
        return h - self.ema


class LayerCounter(nn.Module):
    """Traced: the user's Ema layer between two convolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.ReLU(), Ema(),
                                  nn.Conv3d(4, 1, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class VolumeEma(nn.Module):
    """Untraceable: buffers of the volume's extents rebound by the forward, which split runs hold
    whole (gathered) as one process does: an EMA of the features' channel mean, a mask made once from
    the input's extents behind a flag, the last batch's features kept (registered empty) and added to
    the next one's."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv3d(1, 4, 3, padding=1), nn.Conv3d(4, 1, 3, padding=1)
        self.register_buffer("ema", torch.zeros(1, 1, *SHAPE[2:]))
        self.register_buffer("mask", torch.ones(1, 1, 1, 1, 1))
        self.register_buffer("ready", torch.zeros((), dtype=torch.bool))
        self.register_buffer("prev", None)

    def masked(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.c1(x))
        if not self.ready:
            mask = torch.ones(1, 1, *h.shape[2:], dtype=h.dtype)
            mask[:, :, :2] = 0.5
            self.mask = mask
            self.ready.fill_(True)
        return h * self.mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.masked(x)
        if self.prev is not None:
            h = h + 0.1 * self.prev
        self.ema = 0.9 * self.ema + 0.1 * h.detach().mean((0, 1), keepdim=True)
        self.prev = h.detach().mean(1, keepdim=True)
        return self.c2(h - self.ema)


class VolumeMask(VolumeEma):
    """VolumeEma's mask alone: alike on every data-parallel replica."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(self.masked(x))


class KeptFeatures(VolumeEma):
    """VolumeEma's last features alone: each data-parallel replica's own samples."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.c1(x))
        if self.prev is not None:
            h = h + 0.1 * self.prev
        self.prev = h.detach().mean(1, keepdim=True)
        return self.c2(h)


def _buffer_case(fails: Failures, desc: str, make: type, x: torch.Tensor, y: torch.Tensor,
                 split: list[int] | dict) -> None:
    """Buffers as one process has them: untouched by parallelize and the build, then after 1 and 2
    steps, in the engine's state and in the model's own (``model.state_dict()``), whether the forward
    updates them in place or rebinds them; then after a prediction."""
    torch.manual_seed(0)
    ref, model = make().double(), make().double()
    model.load_state_dict(ref.state_dict())
    start = {k: (v, v.clone()) for k, v in model.state_dict(keep_vars=True).items()}

    def untouched(what: str) -> None:
        for k, v in model.state_dict(keep_vars=True).items():
            fails.check(f"{desc} {what}: model {k}", v.detach(), start[k][1])
            if v is not start[k][0]:
                fails.append(f"{desc} {what}: model {k} is another tensor than the model's own")

    spec = split if isinstance(split, dict) else {"grid": {"spatial": split}}
    engine = hp.parallelize(model, spec, loss_fn=F.mse_loss)
    untouched("after parallelize")
    xl, yl = engine.shard_batch(x, y)
    untouched("after shard_batch (the build)")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for i in (1, 2):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = engine.train_step(xl, yl)
        opt.step()
        want = F.mse_loss(ref(x), y)
        want.backward()
        ref_opt.step()
        fails.check(f"{desc} step {i} loss", loss.detach().reshape(()), want.detach())
        got = engine.full_state_dict()
        for k, v in ref.state_dict().items():
            fails.check(f"{desc} after {i} step(s): engine {k}", got[k], v)
            fails.check(f"{desc} after {i} step(s): model {k}", model.state_dict()[k], v)
    rows = slice(engine.grid.data_index * (x.shape[0] // engine.grid.data),
                 (engine.grid.data_index + 1) * (x.shape[0] // engine.grid.data))  # this replica's
    with torch.no_grad():
        fails.check(f"{desc} prediction", engine.predict(xl), ref(x)[rows])
    for k, v in ref.state_dict().items():
        fails.check(f"{desc} after the prediction: model {k}", model.state_dict()[k], v)


def _buffer_body(rank: int, world: int, split: list[int]) -> None:
    fails = Failures()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(SHAPE, dtype=torch.float64, generator=g)
    y = torch.randn(SHAPE, dtype=torch.float64, generator=g)
    cases = (("counter and EMA in the forward, traced then swapped", RootCounter),
             ("counter and EMA in an untraceable forward", BranchCounter),
             ("counter and EMA rebound in the forward", RootRebound),
             ("counter and rebound EMA in a layer of a traced model", LayerCounter),
             ("buffers of the volume's extents rebound", VolumeEma))
    for desc, make in cases:
        try:
            _buffer_case(fails, f"{desc} {split}", make, x, y, split)
        except Exception as err:  # name the case, then go on with the others
            fails.append(f"{desc} {split}: {type(err).__name__}: {err}")
    fails.raise_if_any(rank)


def _replicas_body(rank: int, world: int, split: list[int]) -> None:
    """Data x spatial: a mask of the volume made from shapes, alike on every replica, is held whole; a
    buffer of each replica's own features is refused at the step that makes it, alike on every rank."""
    from hybridpar.planner.terms import SpecError

    fails = Failures()
    g = torch.Generator().manual_seed(4)
    x, y = (torch.randn(SHAPE, dtype=torch.float64, generator=g) for _ in range(2))
    spec = {"grid": {"data": 2, "spatial": split}}
    try:
        _buffer_case(fails, "a mask of the volume, data x spatial", VolumeMask, x, y, spec)
    except Exception as err:
        fails.append(f"a mask of the volume, data x spatial: {type(err).__name__}: {err}")
    engine = hp.parallelize(KeptFeatures().double(), spec, loss_fn=F.mse_loss)
    try:
        engine.train_step(*engine.shard_batch(x, y))
        fails.append("features of each replica kept in a buffer: not refused")
    except SpecError as err:
        if "rebinds the buffer prev to a value of the split volume that each data-parallel replica" \
                not in str(err):
            fails.append(f"features of each replica kept in a buffer: {err}")
    fails.raise_if_any(rank)


def test_left_as_found_puts_back_what_a_forward_moves():
    """In one process: a kernel's own update (batch_norm's running statistics, which keeps the version
    counter), a rebound and an added buffer are undone; a parameter changed in place is refused."""
    from hybridpar.planner.terms import SpecError
    from hybridpar.planner.untouched import left_as_found

    m = nn.Sequential(nn.Conv3d(1, 2, 3), nn.BatchNorm3d(2))
    mean, start = m[1].running_mean, {k: v.clone() for k, v in m.state_dict().items()}
    with left_as_found(m):
        m(torch.randn(2, 1, 5, 5, 5))
        m[1].running_var = torch.full((2,), 3.0)
        m[1].register_buffer("extra", torch.zeros(1))
    assert m[1].running_mean is mean and "extra" not in m[1]._buffers
    assert all(torch.equal(v, start[k]) for k, v in m.state_dict().items())
    with pytest.raises(SpecError, match=r"changed parameter\(s\) 0.weight in place"), left_as_found(m):
        with torch.no_grad():
            m[0].weight.mul_(0.5)


class Scaled(nn.Module):
    """A conv, a BatchNorm and a buffer the forward reads: what a training loop may change between steps."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.n, self.c2 = nn.Conv3d(1, 4, 3, padding=1), nn.BatchNorm3d(4), nn.Conv3d(4, 1, 1)
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(F.relu(self.n(self.c1(x)))) * self.scale


def _changes_body(rank: int, world: int, split: list[int]) -> None:
    """A layer's setting changed, a submodule replaced, a buffer rebound after the build: each refused
    at the next step, naming it (the split layers hold what the build saw); a buffer filled in place
    (shared) is followed."""
    from hybridpar.planner.terms import SpecError

    fails = Failures()
    x = torch.randn(SHAPE, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    changes = {"momentum": (lambda m: setattr(m.n, "momentum", 0.6),
                            r"model.n \(BatchNorm3d\).momentum is 0.6, 0.1 when the engine was built"),
               "replaced": (lambda m: setattr(m, "c2", nn.Conv3d(4, 1, 1).double()),
                            r"model.c2 \(Conv3d\) is not the module the engine was built from"),
               "rebound": (lambda m: setattr(m, "scale", torch.full((1,), 0.5, dtype=torch.float64)),
                           r"model.scale is another tensor than the engine was built on"),
               "in place": (lambda m: m.scale.fill_(0.5), None)}
    for desc, (change, said) in changes.items():
        torch.manual_seed(0)
        ref, model = Scaled().double(), Scaled().double()
        model.load_state_dict(ref.state_dict())
        engine = hp.parallelize(model, {"grid": {"spatial": split}}, loss_fn=F.mse_loss)
        xl, yl = engine.shard_batch(x, x)
        engine.train_step(xl, yl)
        F.mse_loss(ref(x), x)
        change(model)
        change(ref)
        try:
            loss = engine.train_step(xl, yl)
        except SpecError as err:
            if said is None or not re.search(said, str(err)):
                fails.append(f"{desc}: {err}")
            continue
        if said is not None:
            fails.append(f"{desc}: a step ran after the change")
        want = F.mse_loss(ref(x), x).detach()
        fails.check(f"{desc}: the loss after the change", loss.detach().reshape(()), want)
    fails.raise_if_any(rank)


CALLS = [(2, "_mode_body", [2, 1, 1]), (2, "_buffer_body", [2, 1, 1]),  # one pool size after the other
         (2, "_changes_body", [2, 1, 1]),
         (4, "_mode_body", [2, 2, 1]), (4, "_buffer_body", [2, 2, 1]), (4, "_replicas_body", [2, 1, 1])]


@pytest.mark.parametrize("world,body,split", CALLS, ids=[f"{b[1:-5]}-{w}_ranks" for w, b, _ in CALLS])
def test_model_state_matches_one_process(pools, world, body, split):
    pools(world).run(globals()[body], split, timeout=300)
