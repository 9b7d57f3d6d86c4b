"""Hooks of the user's (on a layer, on a block, on a parameter, global; torch's old-style weight_norm,
which is one) are refused in one line naming the module or parameter, at ``hp.parallelize`` or, when
registered later, at the next step: the split model would not run them as one process does (a forward
hook on a layer its Dist counterpart replaces was dropped, and the answer came out wrong)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module

SHAPE = (2, 1, 8, 6, 6)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv3d(1, 2, 3, padding=1)
        self.block = nn.Sequential(nn.Tanh(), nn.Conv3d(2, 1, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.c1(x))


def _scale(m, inputs, out):
    return out * 2.0


def _old_weight_norm(m: Net) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nn.utils.weight_norm(m.c1)


CASES = {  # name: (what is done to the model before parallelize, what after it)
    "forward hook": (lambda m: m.c1.register_forward_hook(_scale), None),
    "pre-hook on a block": (lambda m: m.block.register_forward_pre_hook(lambda mod, i: (i[0] + 1,)), None),
    "backward hook": (lambda m: m.block[1].register_full_backward_hook(lambda mod, gi, go: None), None),
    "old weight_norm": (_old_weight_norm, None),
    "gradient hook": (lambda m: m.c1.weight.register_hook(lambda g: g.clamp(-1, 1)), None),
    "hook on the model": (lambda m: m.register_forward_hook(_scale), None),
    "hook after parallelize": (None, lambda m: m.c1.register_forward_hook(_scale)),
    "removed before": (lambda m: m.c1.register_forward_hook(_scale).remove(), None),
}


def _attempt(before, after) -> str:
    import hybridpar as hp

    torch.manual_seed(0)
    model = Net()
    if before is not None:
        before(model)
    try:
        engine = hp.parallelize(model, {"grid": {"spatial": [2, 1, 1]}}, loss_fn=F.mse_loss)
        if after is not None:
            after(model)
        engine.train_step(*engine.shard_batch(torch.randn(SHAPE), torch.randn(SHAPE)))
    except hp.SpecError as err:
        return str(err)
    return "ran"


def _body(rank: int, world: int) -> dict[str, str]:
    said = {name: _attempt(*case) for name, case in CASES.items()}
    handle = torch_module.register_module_forward_hook(_scale)
    try:
        said["global hook"] = _attempt(None, None)
    finally:
        handle.remove()
    return said


def test_hooks_are_refused_naming_them(pools):
    said = pools(2).run(_body, timeout=120)
    assert said[0] == said[1], said  # the same line on every rank
    said = said[0]
    want = {
        "forward hook": "hp.parallelize: c1 (Conv3d) has a forward hook (_scale), which the split model "
                        "would not run as one process does; remove it (handle.remove())",
        "pre-hook on a block": "hp.parallelize: block (Sequential) has a forward pre-hook (",
        "backward hook": "hp.parallelize: block.1 (Conv3d) has a backward hook (",
        "old weight_norm": "hp.parallelize: c1 (Conv3d) has a forward pre-hook (WeightNorm), which the "
                           "split model would not run as one process does; it is torch's old-style "
                           "weight_norm: use torch.nn.utils.parametrizations.weight_norm",
        "gradient hook": "hp.parallelize: parameter c1.weight has a gradient hook (register_hook) (",
        "hook on the model": "hp.parallelize: the model (Net) has a forward hook (_scale)",
        "hook after parallelize": "Engine.train_step: c1 (Conv3d) has a forward hook (_scale)",
        "global hook": "hp.parallelize: a global module forward hook (_scale) would run on every split",
    }
    for name, start in want.items():
        assert said[name].startswith(start), (name, said[name])
    assert said["removed before"] == "ran", said["removed before"]


def test_a_scripted_module_is_refused_naming_it():
    """A torch.jit module's compiled forward calls nothing the engine could follow or swap."""
    from hybridpar.pipeline.user_hooks import refuse_unfollowed_forwards
    from hybridpar.planner.terms import SpecError

    model = nn.Sequential(nn.Conv3d(1, 2, 3), torch.jit.script(nn.Sequential(nn.Conv3d(2, 2, 3), nn.ReLU())))
    with pytest.raises(SpecError, match=r"^hp.parallelize: 1 \(Sequential\) is a torch.jit.ScriptModule"):
        refuse_unfollowed_forwards(model, "hp.parallelize")
    refuse_unfollowed_forwards(nn.Sequential(nn.Conv3d(1, 2, 3)), "hp.parallelize")  # none: nothing said


def _doubled(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return 2 * nn.Conv3d.forward(self, x)


def test_a_forward_set_on_a_layer_itself_is_refused_naming_it():
    """``conv.forward = MethodType(f, conv)``: the split Conv3d would run its class's forward instead."""
    from types import MethodType

    from hybridpar.pipeline.user_hooks import refuse_unfollowed_forwards
    from hybridpar.planner.terms import SpecError

    model = nn.Sequential(nn.Conv3d(1, 2, 3), nn.Conv3d(2, 2, 3))
    model[1].forward = MethodType(_doubled, model[1])
    with pytest.raises(SpecError, match=r"^hp.parallelize: 1 \(Conv3d\) has a forward set on the layer "):
        refuse_unfollowed_forwards(model, "hp.parallelize")
