"""A module's forward on the meta device: shapes and operations, no memory, no FLOPs.

Why one place: the planner, the trace check, module swapping's plan and ``set_global_shapes`` all run
a user's model with its state swapped for meta tensors (``torch.func.functional_call``). A model may
hold one module under two names (MONAI's DynUNet), or one tensor in two modules; swapping by tensor
(torch's ``tie_weights``) then restores the wrong tensor into a slot it visited twice, and the model
is left holding meta tensors. Here the state has one entry per module slot (each module object once),
tied slots sharing one meta tensor, and the swap is made slot by slot. A ``SyncBatchNorm`` runs as
the batch norm it is within one process: its own forward would reduce over the job's ranks, which a
meta tensor cannot.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from hybridpar.nn.families import BATCH_NORM, reduces_over_job
from hybridpar.nn.meta_kernels import ShapeOnlyResampling
from hybridpar.nn.sharing import TORCH_OWN
from hybridpar.nn.sound_values import UNKNOWN, SoundValues
from hybridpar.nn.torch_args import complete


def meta_state(module: nn.Module, grads: bool = False) -> tuple[dict[str, torch.Tensor], torch.dtype]:
    """``module``'s parameters and buffers as meta tensors, one entry per slot (see the module doc),
    and the floating dtype its input should have. ``grads``: each parameter's requires a gradient
    where the module's does, so that a forward followed on them meets autograd as a training step
    does (``h.requires_grad``, ``h.register_hook``, an autograd.Function's ``grad_fn``)."""
    metas: dict[int, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    for prefix, m in module.named_modules():
        for name, t in [*m._parameters.items(), *m._buffers.items()]:
            if t is not None:
                key = f"{prefix}.{name}" if prefix else name
                state[key] = metas.setdefault(id(t), t.detach().clone() if keeps_value(t) else
                                              torch.empty_like(t, device="meta").requires_grad_(
                                                  grads and t.requires_grad and name in m._parameters))
    floats = [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]
    return state, floats[0].dtype if floats else torch.get_default_dtype()


def keeps_value(t: torch.Tensor) -> bool:
    """Whether a run on the meta device reads ``t`` with its value, on a copy: a counter or flag
    (BatchNorm's ``num_batches_tracked``, read as ``float()`` when momentum is None; a ``ready`` flag a
    forward branches on), which a meta tensor has no value for. Such a 0-d integer or boolean buffer
    is the model's configuration, alike on every rank, not a value computed from the volume."""
    return t.dim() == 0 and not t.is_floating_point() and not t.is_meta


class CarriedState(ValueError):
    """A forward carries a tensor from one call to the next in a plain attribute (the planner raises it
    as its ``SpecError``; defined here, below the planner, which imports this module)."""


FACTORIES = ("zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange", "linspace", "eye")


class OnMeta(TorchFunctionMode):
    """A tensor the forward makes from sizes alone (``torch.zeros(n, c, *x.shape[2:])``), without a
    device, is made on the meta device beside the forward's own, as on the device it runs on."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []  # what the forward called, in order (meta_call compares two runs)
        self.read = WeakIdKeyDictionary()  # every tensor a call was given
        self.sound = SoundValues()  # what checks of finiteness read: answered as a sound run answers them
        self.moved = WeakIdKeyDictionary()  # a tensor -> the one it converts (x.to(device), x.float())

    def __enter__(self) -> OnMeta:
        self._kernels = None if _EXACT else ShapeOnlyResampling()  # interpolation at the cost of its shape
        if self._kernels is not None:
            self._kernels.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self._kernels is not None:
                self._kernels.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = complete(func, kwargs or {})
        self.calls.append(getattr(func, "__name__", ""))
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                self.read[t] = True
        if getattr(func, "__name__", "") in FACTORIES and kwargs.get("device") is None \
                and not any(isinstance(a, torch.Tensor) for a in args) and _users_call():
            kwargs = {**kwargs, "device": "meta"}
        with torch._C.DisableTorchFunction():  # its reads are not the forward's: modes below see none
            args, kwargs = _beside_meta(func, args, kwargs)
        if (known := self.sound.read(func, args)) is not UNKNOWN:  # a check of finiteness: as if sound
            return known
        out = func(*args, **kwargs)
        self.sound.after(func, args, out)
        if getattr(func, "__name__", "") in _CONVERSIONS and args and isinstance(args[0], torch.Tensor) \
                and isinstance(out, torch.Tensor) and out is not args[0]:
            self.moved[out] = args[0]
        return out

    def converts(self, t: torch.Tensor, source: torch.Tensor) -> bool:
        """Whether ``t`` is ``source`` converted (moved to a device, cast), in one call or a chain."""
        while t is not None and t is not source:
            t = self.moved.get(t)
        return t is source


_CONVERSIONS = ("to", "cpu", "cuda", "float", "double", "half", "bfloat16", "type", "type_as", "contiguous")
"""Calls whose result holds its input's values (here on the meta device, on one process the same tensor
where nothing moves): an attribute rebound to one (``self.grid = self.grid.to(x.device)``, as MONAI's
``AffineHead`` does) keeps no state."""


_EXACT: list[bool] = []  # within exact_operations(): each operation runs as written


@contextlib.contextmanager
def exact_operations() -> Iterator[None]:
    """Meta runs within run every ATen operation as written (none swapped by
    :mod:`hybridpar.nn.meta_kernels`): for a check that watches the operations a run makes."""
    _EXACT.append(True)
    try:
        yield
    finally:
        _EXACT.pop()


def _beside_meta(func: Any, args: tuple, kwargs: dict) -> tuple:
    """``args`` and ``kwargs`` with a constant the forward made on its own device (an index,
    ``torch.tensor([0, 3, 12])``), given beside the forward's meta tensors, read on the meta device: on
    the device the model runs on both are there. A tensor the call writes in place stays where it is."""
    leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not any(t.is_meta for t in leaves) or all(t.is_meta or t.dim() == 0 for t in leaves) \
            or not _users_call(3):  # the library's own (a module copied for a check) as it comes
        return args, kwargs
    name = getattr(func, "__name__", "")
    written = args[0] if args and (name.endswith("_") and not name.startswith("__")
                                   or name.startswith("__i") or name == "__setitem__") else None
    move = lambda t: t.to("meta") if isinstance(t, torch.Tensor) and t is not written and \
        not t.is_meta and t.dim() > 0 else t  # noqa: E731
    return tree_map(move, args), tree_map(move, kwargs)


def _users_call(depth: int = 2) -> bool:
    """Whether the innermost frame outside torch, from ``depth`` frames up (a mode's caller; a subclass's
    ``__torch_function__`` passed), is the user's (the library's own arithmetic, a halo plan's taps,
    keeps the default device)."""
    f = sys._getframe(depth)
    while f is not None and (f"{os.sep}torch{os.sep}" in f.f_code.co_filename
                             or f.f_code.co_name == "__torch_function__"):
        f = f.f_back
    return f is not None and f"{os.sep}hybridpar{os.sep}" not in f.f_code.co_filename


def meta_call(module: nn.Module, state: dict[str, torch.Tensor], *args: Any) -> Any:
    """``module(*args)`` with ``state`` (from :func:`meta_state`) in place of its own. A forward that
    keeps state on the model in plain attributes is refused, naming it: a tensor left in one (read by the
    next call, which no split plan follows, or by the user's loss, which the engine's run never feeds), a
    value rebound on every call (:func:`_refuse_moving`). The attributes are put back as they were
    either way. (Buffers are the engine's to follow: :mod:`hybridpar.pipeline.step_state`.)"""
    before, plain = _tensor_attrs(module), _plain_attrs(module)
    values = {(prefix, k): v for prefix, m in module.named_modules() for k, v in vars(m).items()}
    held, run = containers(module), OnMeta()
    out = _call(module, state, args, run)
    _refuse_filled(module, held, run.read)
    _refuse_moving(module, state, args, values, plain)
    kept = _changed(module, before)
    converted = [key for key in kept if key in before and run.converts(_attr(module, key), before[key])]
    _put_back(module, values, converted)  # the values it held, not their meta copies
    kept = [key for key in kept if key not in converted]
    if not kept:
        return out
    runs = [OnMeta(), OnMeta()]  # from the state before the call, then from what the first kept
    try:
        _put_back(module, values, kept)
        with unwatched(module):
            for run in runs:
                _call(module, state, args, run)
    finally:
        _put_back(module, values, _changed(module, before))
    prefix, k = kept[0]
    where = _where(module, prefix)
    if runs[0].calls != runs[1].calls:
        raise CarriedState(f"{where}: its forward keeps a tensor in self.{k} and reads it in the next call, "
                           f"which a split run cannot follow as one process does; keep it in a buffer "
                           f"(self.register_buffer) updated in place, or pass it as an input")
    raise CarriedState(f"{where}: its forward keeps a tensor in self.{k} after the call (an auxiliary loss, "
                       f"a cache), which your model would not hold: the engine runs the forward split (a "
                       f"traced graph keeps no such step at all); return it from the forward (a tuple or "
                       f"dict of outputs reaches loss_fn), or keep it in a local variable")


Held = dict[tuple[str, str], tuple[list | dict, list | dict]]


def containers(module: nn.Module) -> Held:
    """Each list or dict a module keeps in a plain attribute, with a shallow copy of its contents."""
    return {(prefix, k): (v, copy.copy(v)) for prefix, m in module.named_modules() for k, v in vars(m).items()
            if k not in TORCH_OWN and type(v) in (list, dict)}


def _tensors_in(value: list | dict) -> list[int]:
    return [id(t) for t in tree_leaves(value) if isinstance(t, torch.Tensor | fx.Proxy)]


def put_back_contents(held: Held) -> list[tuple[str, str]]:
    """Put back each container's contents as :func:`containers` found them; the containers a run
    filled with tensors (or a trace's proxies) since, first."""
    filled = [key for key, (now, then) in held.items() if _tensors_in(now) != _tensors_in(then)]
    for now, then in held.values():
        if isinstance(now, list):
            now[:] = then
        else:
            now.clear()
            now.update(then)
    return filled


def _refuse_filled(module: nn.Module, held: Held, read: WeakIdKeyDictionary) -> None:
    """Refuse a forward that leaves tensors in a list or dict it keeps on the model that it never reads
    itself (``self.reg.append(h.abs().mean())``, for the loss to read): the engine's runs of the forward
    (on the meta device, on shards) would fill it, never one process's values. One the forward reads
    back within the call (MONAI DynUNet's deep-supervision heads, gathered into its output) is its
    scratch. Each container's contents are put back first."""
    before = {key: set(_tensors_in(then)) for key, (_, then) in held.items()}
    left = {key: [t for t in tree_leaves(now) if isinstance(t, torch.Tensor) and t not in read
                  and id(t) not in before[key]] for key, (now, _) in held.items()}
    filled = [key for key in put_back_contents(held) if left[key]]
    if filled:
        prefix, k = filled[0]
        raise _left_in(module, prefix, k, held[filled[0]][0])


def _left_in(module: nn.Module, prefix: str, k: str, value: object) -> CarriedState:
    return CarriedState(f"{_where(module, prefix)}: its forward leaves tensors in self.{k} (a "
                        f"{type(value).__name__}) after the call (auxiliary losses, side outputs, a cache), "
                        f"which the engine's split runs fill with their own: return them from the forward "
                        f"(a tuple or dict of outputs reaches loss_fn), or keep them in local variables")


def _where(module: nn.Module, prefix: str) -> str:
    return f"{prefix} ({type(module.get_submodule(prefix)).__name__})" if prefix else \
        f"model ({type(module).__name__})"


def _plain_attrs(module: nn.Module) -> dict[tuple[str, str], Any]:
    """The values a forward may rebind in plain attributes (numbers, flags, strings...), not tensors,
    modules or torch's bookkeeping."""
    return {(prefix, k): v for prefix, m in module.named_modules() for k, v in vars(m).items()
            if k not in TORCH_OWN and not isinstance(v, torch.Tensor | nn.Module)}


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or (type(a) is type(b) and bool(a == b))
    except Exception:  # noqa: BLE001 - values that do not compare (arrays): not the same
        return False


def _refuse_moving(module: nn.Module, state: dict[str, torch.Tensor], args: tuple,
                   values: dict[tuple[str, str], Any], plain: dict[tuple[str, str], Any]) -> None:
    """Refuse a forward that rebinds a plain attribute to a new value on every call (``self.calls += 1``,
    a warm-up counter): a traced graph keeps the value it had when traced, a swapped copy counts its own
    calls and the planner's, so no split run follows it. One set alike on each call (``self.size =
    x.shape``) passes. The attributes are put back as they were either way."""
    first = _plain_attrs(module)
    changed = [key for key, v in first.items() if key not in plain or not _same(v, plain[key])]
    gone = [(prefix, k) for prefix, k in plain if k not in vars(module.get_submodule(prefix))]  # del self.tmp
    _put_back(module, values, gone)
    if not changed:
        return
    try:
        with unwatched(module):
            _call(module, state, args, OnMeta())  # again, from what the first call left
        second = _plain_attrs(module)
        moving = [key for key in changed if not _same(second.get(key), first[key])]
    finally:
        now = _plain_attrs(module)
        _put_back(module, values, [key for key, v in now.items()
                                   if key not in plain or not _same(v, plain[key])])
    if moving:
        prefix, k = moving[0]
        if any(isinstance(t, torch.Tensor) for t in tree_leaves(first[moving[0]])):  # self.sides = [s]
            raise _left_in(module, prefix, k, first[moving[0]])
        raise CarriedState(f"{_where(module, prefix)}: its forward changes self.{k} on every call, which a "
                           f"split run cannot follow as one process does (a traced graph keeps its value at "
                           f"the trace); keep it in a buffer updated in place (self.register_buffer('{k}', "
                           f"torch.zeros((), dtype=torch.long)); self.{k} += 1), or pass it as an input")


@contextlib.contextmanager
def unwatched(module: nn.Module) -> Iterator[None]:
    """A run that no one else sees: no other torch-function mode (a planner's watch), no module hooks
    (its records of the layers), both put back after."""
    modes = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
    hooks = [(m, m._forward_hooks, m._forward_pre_hooks) for m in module.modules()]
    for m, _, _ in hooks:
        m._forward_hooks, m._forward_pre_hooks = OrderedDict(), OrderedDict()
    try:
        yield
    finally:
        for m, post, pre in hooks:
            m._forward_hooks, m._forward_pre_hooks = post, pre
        for mode in reversed(modes):
            torch._C._push_on_torch_function_stack(mode)


def run_unseen(module: nn.Module, state: dict[str, torch.Tensor], args: tuple, mode: OnMeta) -> None:
    """``module(*args)`` with ``state`` (from :func:`meta_state`) under ``mode`` alone (what it called is
    the mode's), seen by no watch or hook, its tensors in plain attributes put back after."""
    values = {(prefix, k): v for prefix, m in module.named_modules() for k, v in vars(m).items()}
    before = _tensor_attrs(module)
    try:
        with unwatched(module):
            _call(module, state, args, mode)
    finally:
        _put_back(module, values, _changed(module, before))


def _call(module: nn.Module, state: dict[str, torch.Tensor], args: tuple, mode: OnMeta) -> Any:
    """One run; buffer slots ``state`` has no entry for (registered empty, ``register_buffer("prev",
    None)``, or registered by the forward) are left as they were: a meta tensor left there would reach
    the first real step."""
    empty = {(m, slot) for m in module.modules() for slot, t in m._buffers.items() if t is None}
    named = {id(m): set(m._buffers) for m in module.modules()}
    with contextlib.ExitStack() as stack:
        stack.callback(_empty_again, module, empty, named)
        stack.enter_context(mode)
        for m in module.modules():
            if reduces_over_job(m):
                m.forward = BATCH_NORM.forward.__get__(m)  # type: ignore[method-assign]
                stack.callback(vars(m).pop, "forward", None)
        return torch.func.functional_call(module, state, args, tie_weights=False)


def _tensor_attrs(module: nn.Module) -> dict[tuple[str, str], torch.Tensor]:
    return {(prefix, k): v for prefix, m in module.named_modules() for k, v in vars(m).items()
            if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)}


def _attr(module: nn.Module, key: tuple[str, str]) -> Any:
    return getattr(module.get_submodule(key[0]), key[1], None)


def _changed(module: nn.Module, before: dict[tuple[str, str], torch.Tensor]) -> list[tuple[str, str]]:
    return [key for key, v in _tensor_attrs(module).items() if before.get(key) is not v]


def _put_back(module: nn.Module, values: dict[tuple[str, str], Any], kept: list[tuple[str, str]]) -> None:
    for prefix, k in kept:
        m = module.get_submodule(prefix)
        if (prefix, k) in values:
            setattr(m, k, values[(prefix, k)])
        else:
            delattr(m, k)


def _empty_again(module: nn.Module, empty: set[tuple[nn.Module, str]], named: dict[int, set[str]]) -> None:
    for m in module.modules():
        for slot in set(m._buffers) - named.get(id(m), set(m._buffers)):
            del m._buffers[slot]
            m._non_persistent_buffers_set.discard(slot)
    for m, slot in empty:
        m._buffers[slot] = None


def no_meta_kernel(message: str) -> bool:
    """Whether torch's ``message`` says a call has no implementation on the meta device
    (``torch.unique``, ``torch.bincount``): the model runs on values, a plan's run on shapes cannot."""
    return "Meta kernel" in message or "fake impl" in message


def reads_values(message: str) -> bool:
    """Whether torch's ``message`` says a forward read a meta tensor's values (``item()``, a branch on
    one, a copy out of one), which hold none."""
    return "meta tensors" in message or "out of meta tensor" in message


def message(err: BaseException) -> str:
    """``err``'s message without the note fx adds of the graph node that ran (its caller names it)."""
    return str(err).split("\n\nWhile executing")[0]


def meta_stop(err: BaseException) -> tuple[str, str] | None:
    """Why a plan's run on the meta device stopped in a forward, and what to do, where torch's error
    says the plan cannot follow a call the model itself can make (a read of values, a tensor whose
    size its values set, a call without a meta kernel); None for any other error (the model's own)."""
    said = message(err)
    sized = next((op for op in ("nonzero", "masked_select", "unique") if f"torch.{op}()" in said), None)
    if sized is not None:
        return (f"{sized} makes a tensor whose size its values set (h[h > 0])",
                "use a masked sum, (h * m).sum() / m.sum(), or torch.where")
    if reads_values(said) or no_meta_kernel(said):
        return f"{type(err).__name__}: {said}", meta_hint(said)
    return None


def meta_hint(err: str) -> str:
    """What to do about a forward the plan's run on the meta device stopped in, from torch's message."""
    if reads_values(err):
        return "branch on configuration or on shapes, not on tensor values"
    if no_meta_kernel(err):
        return "that call has no meta implementation: write it with other torch calls"
    return "the plan's run on meta tensors (no values, no gradients) cannot make that call"
