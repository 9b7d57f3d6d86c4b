"""The user's model left as planning found it: every buffer's value, every parameter and buffer slot.

Why: planning runs the forward's Python on the real module. torch.fx traces it (and the trace of an
untraceable forward runs it up to where it fails), so a forward that updates a buffer (a warm-up step
counter, an EMA) has it updated by the planner, once per trace, on top of every real step's update;
a forward that rebinds one (``self.ema = 0.9 * self.ema + ...``) leaves the slot holding the tracer's
proxy, which the next planning run then trips on. The runs on the meta device swap the state out and
back (:mod:`hybridpar.nn.meta`); a trace does not. :func:`left_as_found` wraps the two places that
trace a user's model: :func:`hybridpar.planner.analysis.analyse` (every plan: the engine's build, the
advisor, ``explain``) and the engine's first trace (:class:`hybridpar.pipeline.building.Source`), so
that after ``parallelize`` and the build only real steps have changed the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from hybridpar.nn.buffer_state import Snapshot
from hybridpar.planner.terms import SpecError


@contextlib.contextmanager
def left_as_found(model: nn.Module) -> Iterator[None]:
    """Run planning on ``model`` (tracing, checks, the advisor) and leave its state as it was.

    Buffers (small) are copied first and every one planning changed (in place, or rebound to a new
    tensor: ``self.ema = 0.9 * self.ema + ...``) is put back, into its own tensor and slot, as is any
    buffer slot planning added. Parameters (possibly large) are not copied: the tracer sees them as
    proxies and the other runs are on the meta device, so planning cannot move them except through a
    forward that changes them in place outside the tracer's view (``for p in self.parameters():
    p.clamp_(0)``); their slots are put back and an in-place change is refused in one line, since no
    copy exists to undo it."""
    buffers = Snapshot(model.named_modules())
    names = {id(m): set(m._buffers) for m in model.modules()}
    params = [(m, name, p, _version(p), f"{k}.{name}" if k else name) for k, m in model.named_modules()
              for name, p in m._parameters.items() if p is not None]
    done = False
    try:
        yield
        done = True
    finally:  # after a failed planning too, but then its own error is the one raised
        _put_back(model, buffers, names, params, refuse=done)


def _version(t: torch.Tensor) -> int | None:
    """``t``'s in-place version counter; None for a tensor without one (made under inference mode)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _put_back(model: nn.Module, buffers: Snapshot, names: dict[int, set[str]], params: list,
              refuse: bool) -> None:
    """Undo what planning did to the buffers and parameter slots recorded by :func:`left_as_found`;
    ``refuse``: raise if a parameter was changed in place."""
    buffers.restore()  # by value: a kernel's own update (batch_norm's) keeps the version counter
    for m in model.modules():
        for name in set(m._buffers) - names.get(id(m), set(m._buffers)):
            del m._buffers[name]  # registered by a planning run of the forward
            m._non_persistent_buffers_set.discard(name)
    moved = []
    for m, name, p, version, qualified in params:
        if m._parameters.get(name) is not p:
            m._parameters[name] = p
        if version is not None and _version(p) != version:
            moved.append(qualified)
    if moved and refuse:
        raise SpecError(f"model ({type(model).__name__}): its forward changed parameter(s) "
                        f"{', '.join(moved)} in place while hybridpar planned it (planning runs the "
                        f"forward's Python), which no copy can undo; change parameters outside the "
                        f"forward (after optimizer.step())")
