"""What a traced forward reads besides tensors: grad mode, and the plain Python attributes of its modules.

Why: ``torch.fx`` records the tensor operations a forward makes and evaluates the rest of its Python
once, when it traces. Two kinds of state the forward reads then are fixed into the graph, silently:

* grad mode. A ``with torch.no_grad():`` block (a mask, a std used only as a scale) is not recorded,
  so its gradient flows in the graph; a branch on ``torch.is_grad_enabled()`` keeps the branch taken
  at trace time, in training and in ``predict`` alike. A forward that sets or reads grad mode while
  it is traced (``torch.no_grad``, ``torch.enable_grad``, ``torch.set_grad_enabled``,
  ``torch.inference_mode``, ``torch.is_grad_enabled``) is therefore not traceable
  (:class:`GradModeInTrace`): it runs by module swapping, its own Python under the grad mode of each
  run. Only the user's Python between layers runs while tracing (fx does not run leaf modules, the
  split layers and norms among them), so their own reads of grad mode are not caught.
* a plain attribute (``self.tau``, an annealed temperature the training loop sets). The graph holds
  the value read at ``hp.parallelize``; a later change would be ignored. The attributes the traced
  forward read, and their values, are kept (:class:`TracedAttribute`) so that the engine can refuse,
  before a step or a prediction, a graph whose attributes have changed since (:func:`refuse_changed`).

A third kind the trace leaves behind: fx keeps on the module it traces the tensors the forward computed
from real ones (a weight penalty), which :func:`forget_constants` takes off the user's model again.

Both are found by watching the trace: the grad-mode functions are wrapped, and ``__getattribute__`` of
the model's own module classes records reads, while the tracing thread traces, and put back after.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_leaves

from hybridpar.nn.sharing import TORCH_OWN  # torch's bookkeeping; ``training`` is graph.mode_dependent's
from hybridpar.planner import applied
from hybridpar.planner.terms import SpecError

_GRAD_MODE = {  # (namespace, name): what a grad-mode context or check calls, and the name a user knows
    (torch, "is_grad_enabled"): "torch.is_grad_enabled",
    (torch._C, "is_grad_enabled"): "torch.is_grad_enabled",
    (torch._C, "_set_grad_enabled"): "torch.set_grad_enabled",
    (torch, "is_inference_mode_enabled"): "torch.is_inference_mode_enabled",
    (torch._C, "is_inference_mode_enabled"): "torch.is_inference_mode_enabled",
    (torch._C, "_InferenceMode"): "torch.inference_mode"}
_MACHINERY = ("torch.", "hybridpar.planner.", "hybridpar.nn.")  # code whose reads are the tracer's own
_PLAIN = (bool, int, float, complex, str, type(None))

_local = threading.local()  # .traces: what each open trace on this thread saw, the innermost last
_lock = threading.Lock()
_open = 0  # traces open on any thread: the grad-mode functions are wrapped while there are some
_originals: list[tuple[Any, str, Any]] = []  # (namespace, name, function) of the wrapped ones


class GradModeInTrace(RuntimeError):
    """The forward set or read grad mode while torch.fx traced it, which the traced graph cannot hold."""


class FunctionInTrace(RuntimeError):
    """The forward applied an autograd.Function of its own to a traced value: torch.fx records the
    operations of its forward, and its own backward (a straight-through estimator, a gradient scale or
    reversal) would be replaced by the derivative of those."""


@dataclass
class _Seen:
    """What one trace (one ``fx.Tracer.trace`` call) saw: the grad-mode calls its forward made, and the
    autograd.Functions it applied to traced values."""

    grad_mode: list[str]
    functions: list[str] = field(default_factory=list)


def _traces() -> list[_Seen]:
    if not hasattr(_local, "traces"):
        _local.traces = []
    return _local.traces


def _watching(name: str, original: Any) -> Any:
    """``original`` that, called from a forward being traced on this thread, refuses: the forward is
    then not traced (the caller's trace fails), and its trace remembers it even if the forward catches
    the error."""

    def call(*args: Any, **kwargs: Any) -> Any:
        traces = getattr(_local, "traces", None)
        if traces:
            traces[-1].grad_mode.append(name)
            raise GradModeInTrace(_why(name))
        return original(*args, **kwargs)

    return call


def _function_watcher(seen: _Seen) -> applied.Watcher:
    """A watcher (:mod:`hybridpar.planner.applied`) that refuses a Function of the user's applied to a
    traced value (:class:`FunctionInTrace`): the forward then runs by module swapping, the Function's
    own backward with it."""

    def watcher(cls: type, apply: Any, args: tuple, kwargs: dict) -> Any:
        if any(isinstance(a, torch.fx.Proxy) for a in tree_leaves((args, kwargs))):
            name = f"{cls.__qualname__}.apply"
            seen.functions.append(name)
            raise FunctionInTrace(_why_function(name))
        return applied.PASS

    return watcher


@contextlib.contextmanager
def _grad_mode_wrapped() -> Iterator[None]:
    """The grad-mode functions (:func:`_watching`) wrapped while any trace is open on any thread."""
    global _open
    with _lock:
        if _open == 0:
            _originals.clear()
            for (space, name), known in _GRAD_MODE.items():
                original = getattr(space, name)
                _originals.append((space, name, original))
                setattr(space, name, _watching(known, original))
        _open += 1
    try:
        yield
    finally:
        with _lock:
            _open -= 1
            if _open == 0:
                for space, name, original in _originals:
                    setattr(space, name, original)
                _originals.clear()


@contextlib.contextmanager
def watched_trace() -> Iterator[_Seen]:
    """Around one ``fx.Tracer.trace`` call: what its forward did with grad mode (a nested trace, of a
    child fx may keep whole, sees its own). A caller whose trace succeeded still refuses if the
    forward touched grad mode (:func:`refuse_grad_mode`): the forward may have caught the error."""
    seen = _Seen([])
    traces = _traces()
    with _grad_mode_wrapped(), applied.watching(_function_watcher(seen)):
        traces.append(seen)
        try:
            yield seen
        finally:
            traces.pop()


def refuse_grad_mode(seen: _Seen) -> None:
    """Raise :class:`GradModeInTrace` if the traced forward set or read grad mode, and
    :class:`FunctionInTrace` if it applied an autograd.Function of its own to a traced value (the
    forward may have caught the error)."""
    if seen.grad_mode:
        raise GradModeInTrace(_why(seen.grad_mode[0]))
    if seen.functions:
        raise FunctionInTrace(_why_function(seen.functions[0]))


def _why_function(name: str) -> str:
    return (f"the forward applies an autograd.Function ({name}), whose own backward a traced graph "
            f"would not keep")


def _why(name: str) -> str:
    return (f"the forward sets or reads grad mode ({name}: a torch.no_grad, torch.enable_grad, "
            f"torch.set_grad_enabled or torch.inference_mode block, or a torch.is_grad_enabled check), "
            f"which a traced graph does not keep")


@contextlib.contextmanager
def attribute_reads(model: nn.Module) -> Iterator[set[tuple[int, str]]]:
    """The plain instance attributes (module id, name) of ``model``'s own modules that its forward reads
    while the outermost trace opened inside this context runs: its own classes' ``__getattribute__``
    records reads by the user's code (not fx's, nor the planner's), on this thread."""
    reads: set[tuple[int, str]] = set()
    ids = {id(m) for m in model.modules()}
    thread = threading.get_ident()
    classes = list(dict.fromkeys(type(m) for m in model.modules()
                                 if not type(m).__module__.startswith("torch.")))
    originals = {cls: cls.__getattribute__ for cls in classes}
    own = {cls: cls.__dict__.get("__getattribute__") for cls in classes}

    def recording(original: Any) -> Any:
        def __getattribute__(self: Any, name: str) -> Any:  # noqa: N807 (the slot it stands in)
            value = original(self, name)
            if (id(self) in ids and name not in TORCH_OWN and threading.get_ident() == thread
                    and len(getattr(_local, "traces", ())) == 1
                    and name in object.__getattribute__(self, "__dict__")
                    and not sys._getframe(1).f_globals.get("__name__", "").startswith(_MACHINERY)):
                reads.add((id(self), name))
            return value

        return __getattribute__

    patched = []
    try:
        for cls in classes:
            try:
                cls.__getattribute__ = recording(originals[cls])
                patched.append(cls)
            except TypeError:  # a class that takes no new attributes: its reads go unwatched
                continue
        yield reads
    finally:
        for cls in patched:
            if own[cls] is None:
                del cls.__getattribute__
            else:
                cls.__getattribute__ = own[cls]


def _plain(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, tuple | list):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return False


@dataclass(frozen=True)
class TracedAttribute:
    """A plain attribute the traced forward read: ``model.<path>.<name>`` (``path`` empty for the model
    itself, of class ``owner``), its value then, and its module (weakly: a pipeline frees the modules
    of other stages)."""

    path: str
    owner: str
    name: str
    value: Any
    module: weakref.ReferenceType

    @property
    def where(self) -> str:
        return f"model.{self.path}.{self.name}" if self.path else f"model.{self.name}"


def traced_attributes(model: nn.Module, reads: set[tuple[int, str]]) -> tuple[TracedAttribute, ...]:
    """The reads :func:`attribute_reads` recorded whose values are plain (numbers, bools, strings, and
    tuples, lists and dicts of them), with those values (copied: a list may change in place)."""
    found = []
    for path, m in model.named_modules():  # a module under two names: its first
        for name in sorted(name for key, name in reads if key == id(m)):
            value = vars(m).get(name)
            if _plain(value):
                kept = copy.deepcopy(value)
                found.append(TracedAttribute(path, type(m).__name__, name, kept, weakref.ref(m)))
    return tuple(found)


_GONE = object()


class AttributeChange(NamedTuple):
    """An attribute the traced graph read (``attribute``) whose value is now ``now``."""

    attribute: TracedAttribute
    now: Any

    def message(self, what: str) -> str:
        """One line, alike on every rank that changed it alike: what changed, and the two fixes."""
        a = self.attribute
        now = "gone" if self.now is _GONE else f"{self.now!r} now"
        fix = (f"store it as a buffer (self.register_buffer(\"{a.name}\", torch.tensor({a.value!r})) in "
               f"{a.owner}.__init__, updated in place with .fill_()), which is read live, or call "
               f"hp.parallelize again" if isinstance(a.value, int | float) and not isinstance(a.value, bool)
               else "call hp.parallelize again, which traces the forward anew")
        return (f"{what}: the traced forward read {a.where} ({a.owner}) as {a.value!r} at hp.parallelize, "
                f"and it is {now}; the traced graph holds the value it read then, so the change would be "
                f"silently ignored: {fix}")


def _same(now: Any, then: Any) -> bool:
    """Whether ``now`` is the value the graph holds (``1`` and ``1.0`` alike; a NaN kept is itself)."""
    return _plain(now) and (now is then or now == then)


def changed_attribute(attributes: Sequence[TracedAttribute]) -> AttributeChange | None:
    """The first attribute of ``attributes`` (``ModelGraph.attributes``) whose value differs from the
    one the graph holds, or None. Cheap (a dict read per attribute): meant before each step and each
    prediction. A module freed since (another pipeline stage's) is not checked."""
    for a in attributes:
        m = a.module()
        if m is None:
            continue
        now = vars(m).get(a.name, _GONE)
        if not _same(now, a.value):
            return AttributeChange(a, now)
    return None


def refuse_changed(attributes: Sequence[TracedAttribute], what: str) -> None:
    """Raise :class:`SpecError` (its message one line, beginning with ``what``, e.g.
    ``"Engine.train_step"``) if an attribute the traced graph holds has changed since it was traced."""
    change = changed_attribute(attributes)
    if change is not None:
        raise SpecError(change.message(what))


def forget_constants(model: nn.Module, before: set[str]) -> None:
    """Take off the user's model the tensors fx keeps on the module it traces (``_tensor_constant0``:
    what the forward computed from real tensors while traced, ``sum(p.square().sum() for p in
    self.parameters())``); the graph module holds its own references. Left there, they would be the
    model's: a non-leaf tensor no deep copy takes, read again by nothing."""
    for key in set(vars(model)) - before:
        if key.startswith("_tensor_constant"):
            delattr(model, key)
