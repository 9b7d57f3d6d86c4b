"""The two-pass backward (input gradient, then deferred weight gradients) against one backward:
bit-identical gradients in float64, over layer mixes that stress it (in-place activations after a
deferred layer, a linear layer as the stage's output, shared weights, frozen and unused
parameters)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridpar.pipeline import deferred


def _stack(kind: str) -> list[nn.Module]:
    torch.manual_seed(0)
    if kind == "conv-inplace-linear":
        return [nn.Conv3d(2, 3, 3, padding=1), nn.LeakyReLU(0.3, inplace=True), nn.Conv3d(3, 2, 3, stride=2),
                nn.Flatten(), nn.Linear(2 * 1 * 1 * 2, 5)]
    if kind == "transposed-norm":
        return [nn.ConvTranspose3d(2, 3, 2, stride=2), nn.BatchNorm3d(3), nn.ReLU(), nn.Conv3d(3, 1, 1)]
    if kind == "shared":
        lin = nn.Linear(7, 7)
        return [nn.Flatten(), nn.Linear(2 * 5 * 5 * 7, 7), lin, nn.Tanh(), lin]
    if kind == "frozen":
        conv = nn.Conv3d(2, 2, 3, padding=1)
        conv.weight.requires_grad_(False)
        return [conv, nn.Conv3d(2, 2, 3, padding=1, bias=False), nn.ReLU()]
    raise ValueError(kind)


def _input(kind: str) -> torch.Tensor:
    shape = (3, 2, 4, 4, 6) if kind != "shared" else (3, 2, 5, 5, 7)
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("prefix", [False, True], ids=["whole", "prefix"])
@pytest.mark.parametrize("kind", ["conv-inplace-linear", "transposed-norm", "shared", "frozen"])
def test_two_passes_equal_one_backward(kind, prefix):
    """The whole stage split, or a prefix up to its first deferrable layer (the rest first, in an
    ordinary backward): the same gradients, to the bit, as one backward."""
    mods = [m.double() for m in _stack(kind)]
    params = list(dict.fromkeys(p for m in mods for p in m.parameters()))
    x = _input(kind)

    def seed(out: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(out) * 0.5 + out.detach()

    def once() -> tuple[torch.Tensor, list]:
        for p in params:
            p.grad = None
        xi = x.clone().requires_grad_()
        out = xi
        for m in mods:
            out = m(out)
        out.backward(seed(out))
        return xi.grad, [None if p.grad is None else p.grad.clone() for p in params]

    want_x, want_p = once()
    for p in params:
        p.grad = None
    defer = deferred.deferrable(mods)
    upto = deferred.prefix_end(mods, defer) if prefix else len(mods)
    xi = x.clone().requires_grad_()
    out, kept, pre = deferred.run_keeping(mods, defer, xi, upto)
    assert (pre is not None) == (upto < len(mods))
    root, grad = out, seed(out)
    if pre is not None:
        rest = [p for m in mods[upto:] for p in m.parameters() if p.requires_grad]
        root, grad = deferred.rest_pass(out, grad, pre, rest)
    others = [p for m, d in zip(mods[:upto], defer) if not d for p in m.parameters() if p.requires_grad]
    deferred.input_pass(root, grad, xi, kept, others)
    deferred_params = {id(p) for _, ps in kept for p in ps}
    assert deferred_params, "nothing deferred"
    assert all(p.grad is None for p in params if id(p) in deferred_params), "pass 1 ran a deferred weight"
    assert torch.equal(xi.grad, want_x)
    deferred.weight_pass(kept)
    for p, w in zip(params, want_p):
        assert (p.grad is None) == (w is None)
        if w is not None:
            assert torch.equal(p.grad, w)
    if kind == "shared":
        assert defer == [False, True, False, False, False]  # the shared linear waits for nothing
    if kind == "transposed-norm":
        assert defer == [True, False, False, True]
    if kind == "conv-inplace-linear":  # the in-place activation after the conv joins the prefix
        assert deferred.prefix_end(mods, defer) == 2


def test_no_prefix_before_a_container():
    mods = [nn.Conv3d(2, 2, 1), nn.Sequential(nn.ReLU(inplace=True))]
    assert deferred.prefix_end(mods, deferred.deferrable(mods)) is None
    assert deferred.prefix_end([nn.ReLU()], [False]) is None
