"""State a traceable forward reads besides tensors, which torch.fx would fix into the graph at trace time:

* grad mode: a ``with torch.no_grad():`` block (a mask, a std used as a scale; ``torch.inference_mode``,
  ``torch.set_grad_enabled(False)`` alike) or a branch on ``torch.is_grad_enabled()``. The graph would
  let gradients through the block, or keep the branch taken when traced in training and in predict
  alike; such a forward runs by module swapping instead, its own Python under each run's grad mode (a
  child block that does runs whole, split by module swapping inside it);
* a plain attribute (``self.tau``, annealed by the training loop): the graph holds the value read at
  ``hp.parallelize``. A change since is refused in one line naming the attribute, its two values and
  the fixes; a buffer (``self.register_buffer("tau", ...)``, updated with ``.fill_()``) is read live.

Float64 against the same model in one process: losses, every gradient, predictions; 2 ranks (2x1x1)
and 4 (2x2x1) for one case.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from layer_cases import Failures

SHAPE = (2, 1, 8, 6, 6)


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv3d(1, 3, 3, padding=1), nn.Conv3d(3, 1, 3, padding=1)


class NoGradMask(_Plain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.c1(x))
        with torch.no_grad():  # a mask that carries no gradient
            m = (h > 0.1).to(h.dtype) * h
        return self.c2(h * m)


class NoGradScale(_Plain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.c1(x))
        with torch.no_grad():  # a std over the split dims, used only as a scale
            s = h.std(dim=(2, 3, 4), keepdim=True)
        return self.c2(h / (s + 1))


class InferenceScale(_Plain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.c1(x))
        with torch.inference_mode():
            s = h.std(dim=(2, 3, 4), keepdim=True)
        return self.c2(h / (s + 1))


class SetGradMask(_Plain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.c1(x))
        with torch.set_grad_enabled(False):
            m = torch.sigmoid(h * 3)
        return self.c2(h * m)


class GradModeBranch(_Plain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.c1(x))
        if torch.is_grad_enabled():  # in training, not in predict (run under no_grad)
            h = h * 2
        return self.c2(h)


class _MaskBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(3, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        with torch.no_grad():
            m = (h > 0).to(h.dtype)
        return h * m + x


class NoGradChild(nn.Module):
    """The block with the no_grad runs whole (split by module swapping inside it); the rest is traced."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.block, self.head = nn.Conv3d(1, 3, 3, padding=1), _MaskBlock(), nn.Conv3d(3, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(torch.tanh(self.stem(x))))


class TauFloat(_Plain):
    def __init__(self) -> None:
        super().__init__()
        self.tau = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(torch.tanh(F.relu(self.c1(x)) / self.tau))


class TauBuffer(_Plain):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("tau", torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(torch.tanh(F.relu(self.c1(x)) / self.tau))


class _Scale(nn.Module):
    """A block of the user's with a plain tensor and a plain float, no children: torch.fx keeps it whole
    (one node), and it runs on shards as a copy of itself."""

    def __init__(self) -> None:
        super().__init__()
        self.s, self.tau = torch.tensor(1.0, dtype=torch.float64), 1.0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.s / self.tau


class LeafAttrs(_Plain):
    """Traced, its block's plain attributes set by the training loop (rebound, filled in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.sc = _Scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(self.sc(F.relu(self.c1(x))))

    def anneal(self, step: int) -> None:
        self.sc.tau = 2.0 + step
        self.sc.s.fill_(0.5 + step)


class SwappedAttrs(_Plain):
    """Untraceable (a branch on a shape), run by module swapping: a plain float and a plain tensor the
    training loop changes (rebound, then filled in place), read live by the forward's own Python."""

    def __init__(self) -> None:
        super().__init__()
        self.s, self.tau = torch.tensor(1.0, dtype=torch.float64), 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.c1(x))
        if h.shape[2] > 4:
            h = torch.tanh(h * self.s / self.tau)
        return self.c2(h)

    def anneal(self, step: int) -> None:
        self.tau = 2.0 + step
        if step == 0:
            self.s.fill_(0.5)
        else:
            self.s = torch.tensor(2.0, dtype=torch.float64)


def _anneal(model: nn.Module, step: int) -> None:
    """The training loop's schedule: a temperature buffer updated in place, or the model's own."""
    if hasattr(model, "anneal"):
        model.anneal(step)
    elif isinstance(getattr(model, "tau", None), torch.Tensor):
        model.tau.fill_(0.25 * (step + 1))


def _compare(fails: Failures, desc: str, make: type, spec: dict, steps: int = 2) -> None:
    """``steps`` SGD steps against one process (each loss and gradient), then predict in eval mode."""
    import hybridpar as hp

    g = torch.Generator().manual_seed(5)
    x = torch.randn(SHAPE, dtype=torch.float64, generator=g)
    y = torch.randn(SHAPE, dtype=torch.float64, generator=g)
    torch.manual_seed(0)
    ref = make().double()
    model = make().double()
    model.load_state_dict(ref.state_dict())
    engine = hp.parallelize(model, spec, loss_fn=F.mse_loss)
    x_local, y_local = engine.shard_batch(x, y)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        _anneal(model, step)
        _anneal(ref, step)
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = engine.train_step(x_local, y_local)
        ref_loss = F.mse_loss(ref(x), y)
        ref_loss.backward()
        fails.check(f"{desc} step {step} loss", loss.detach().reshape(()), ref_loss.detach())
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            fails.check(f"{desc} step {step} {name}.grad", p.grad, q.grad)
        opt.step()
        ref_opt.step()
    engine.eval()
    ref.eval()
    with torch.no_grad():
        want = ref(x)
    rows = slice(engine.grid.data_index * (x.shape[0] // engine.grid.data),
                 (engine.grid.data_index + 1) * (x.shape[0] // engine.grid.data))
    fails.check(f"{desc} predict", engine.predict(x_local), want[rows])


def _body(rank: int, world: int, desc: str, model: str, spec: dict) -> None:
    fails = Failures()
    try:
        _compare(fails, f"{desc} {spec}", globals()[model], spec)
    except Exception as err:  # name the case
        fails.append(f"{desc} {spec}: {type(err).__name__}: {err}")
    fails.raise_if_any(rank)


SPLIT2, SPLIT4 = {"grid": {"spatial": [2, 1, 1]}}, {"grid": {"spatial": [2, 2, 1]}}
CASES = [
    (2, "no_grad mask", "NoGradMask", SPLIT2),
    (2, "no_grad scale", "NoGradScale", SPLIT2),
    (4, "no_grad scale, 2x2", "NoGradScale", SPLIT4),
    (2, "inference_mode scale", "InferenceScale", SPLIT2),
    (2, "set_grad_enabled(False) mask", "SetGradMask", SPLIT2),
    (2, "is_grad_enabled branch", "GradModeBranch", SPLIT2),
    (2, "a child block with no_grad", "NoGradChild", SPLIT2),
    (2, "tau as a buffer, annealed", "TauBuffer", SPLIT2),
    (2, "a kept-whole block's plain attributes, changed", "LeafAttrs", SPLIT2),
    (2, "plain attributes of a swapped forward, changed", "SwappedAttrs", SPLIT2),
    (4, "plain attributes of a swapped forward, changed, 2x2", "SwappedAttrs", SPLIT4),
]


@pytest.mark.parametrize("world,desc,model,spec", CASES, ids=[c[1].replace(" ", "_") for c in CASES])
def test_grad_mode_and_live_state_match_one_process(pools, world, desc, model, spec):
    pools(world).run(_body, desc, model, spec, timeout=300)


def _tau_body(rank: int, world: int) -> list[str]:
    """A plain attribute changed since parallelize: train_step and predict refuse, before running."""
    import hybridpar as hp

    model = TauFloat().double()
    engine = hp.parallelize(model, SPLIT2, loss_fn=F.mse_loss)
    x = torch.randn(SHAPE, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x_local, y_local = engine.shard_batch(x, x)
    engine.train_step(x_local, y_local)  # unchanged: runs
    model.tau = 0.25
    said = []
    for call in (lambda: engine.train_step(x_local, y_local), lambda: engine.predict(x_local)):
        try:
            call()
        except hp.SpecError as err:
            said.append(str(err))
    return said


def test_a_plain_attribute_changed_since_parallelize_is_refused(pools):
    said = pools(2).run(_tau_body, timeout=120)
    assert said[0] == said[1] and len(said[0]) == 2, said
    for what, message in zip(("train_step", "predict"), said[0]):
        assert "\n" not in message
        assert message.startswith(f"Engine.{what}: the traced forward read model.tau (TauFloat) as 1.0 at "
                                  f"hp.parallelize, and it is 0.25 now"), message
        assert 'self.register_buffer("tau", torch.tensor(1.0))' in message and ".fill_()" in message
        assert "hp.parallelize again" in message


@pytest.mark.parametrize("forward", [
    "with torch.no_grad(): m = h * 2",
    "with torch.enable_grad(): m = h * 2",
    "with torch.set_grad_enabled(False): m = h * 2",
    "torch.set_grad_enabled(False); m = h * 2; torch.set_grad_enabled(True)",
    "with torch.inference_mode(): m = h * 2",
    "m = h * 2 if torch.is_grad_enabled() else h",
    "m = h * 2 if torch.is_inference_mode_enabled() else h",
    "m = _no_grad_helper(h)",
    "try:\n        with torch.no_grad(): m = h * 2\n    except Exception: m = h",  # caught: still refused
])
def test_a_forward_touching_grad_mode_is_not_traced(forward):
    """Any use of grad mode in a traced forward makes it untraceable (module swapping), named; the
    grad-mode functions are torch's own again after the trace."""
    from hybridpar.planner.graph import UntraceableError, trace

    originals = (torch.is_grad_enabled, torch._C._set_grad_enabled, torch._C._InferenceMode)
    scope = {"torch": torch, "F": F, "_no_grad_helper": _no_grad_helper}
    exec(f"def forward(self, x):\n    h = self.c1(x)\n    {forward}\n    return self.c2(h * m)", scope)
    make = type("GradModeForward", (_Plain,), {"forward": scope["forward"]})
    with pytest.raises(UntraceableError, match=r"cannot trace the model's own forward: GradModeInTrace: the "
                                               r"forward sets or reads grad mode \(torch\."):
        trace(make())
    assert (torch.is_grad_enabled, torch._C._set_grad_enabled, torch._C._InferenceMode) == originals
    assert torch.is_grad_enabled()


@torch.no_grad()
def _no_grad_helper(h: torch.Tensor) -> torch.Tensor:
    return h * 2


def test_a_child_touching_grad_mode_is_kept_whole():
    """The rest of the model stays a traced graph; the block runs as one node."""
    from hybridpar.planner.graph import trace

    graph = trace(NoGradChild())
    assert [n.name for n in graph.nodes] == ["stem", "tanh", "block", "head"]


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(3, 3, 1)
        self.scale, self.flags, self.unread = 2.0, [True, False], "never read"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) * self.scale if self.flags[0] else x


class _Outer(_Plain):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.mode, self.counter = _Inner(), "sum", 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(self.c1(x))
        return self.c2(h + 1 if self.mode == "sum" else h)


def test_attributes_the_graph_holds_are_those_the_forward_read():
    """Read by the user's forward, plain, and nothing else (not ``training``, nor an attribute never
    read); a change is named in one line with both values, a list changed in place too."""
    from hybridpar.planner.graph import trace
    from hybridpar.planner.terms import SpecError
    from hybridpar.planner.trace_state import changed_attribute, refuse_changed

    model = _Outer()
    graph = trace(model)
    assert [(a.where, a.value) for a in graph.attributes] == [
        ("model.mode", "sum"), ("model.inner.flags", [True, False]), ("model.inner.scale", 2.0)]
    model.counter, model.inner.unread, model.training = 3, "changed", False
    assert changed_attribute(graph.attributes) is None
    model.inner.flags[0] = False
    with pytest.raises(SpecError, match=r"^Engine.predict: the traced forward read model.inner.flags "
                                        r"\(_Inner\) as \[True, False\] at hp.parallelize, and it is "
                                        r"\[False, False\] now; .*call hp.parallelize again, which traces "
                                        r"the forward anew$"):
        refuse_changed(graph.attributes, "Engine.predict")
    model.inner.flags[0] = True
    model.inner.scale = 2  # the same number: what the graph holds
    assert changed_attribute(graph.attributes) is None
    del model.inner.scale
    change = changed_attribute(graph.attributes)
    assert change is not None and "model.inner.scale (_Inner) as 2.0 at hp.parallelize, and it is gone" in \
        change.message("Engine.train_step")
    assert all(cls.__dict__.get("__getattribute__") is None for cls in (_Outer, _Inner, _Plain))


class _TensorAttr(_Plain):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.tensor(2.0)  # neither a parameter nor a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(F.relu(self.c1(x)) * self.scale)


def test_a_plain_tensor_attribute_is_not_traced():
    """fx would hold the tensor a forward reads from a plain attribute as a constant of the graph (a
    get_attr of it), so a change by the training loop would be lost: such a forward is untraceable."""
    from hybridpar.planner.graph import UntraceableError, trace

    with pytest.raises(UntraceableError, match=r"its forward reads scale directly"):
        trace(_TensorAttr())
