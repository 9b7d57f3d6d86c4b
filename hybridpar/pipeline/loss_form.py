"""Whether ``loss_fn`` is, by the form of what it computes, a mean or a sum along each dim the engine cuts:
a ``TorchFunctionMode`` that follows the step's own loss evaluation call by call.

Why: the checks on values (:mod:`hybridpar.pipeline.loss_check`, :mod:`hybridpar.pipeline.loss_across`)
evaluate the loss on parts and pieces of what a rank holds; a normaliser that differs only at voxels
they leave out (a mask that differs between the ranks' shards there, a target's extreme there) passed
them, and the engine combined the parts' losses into a wrong one (gradients 0.24 off, a loss 1.5x).
The form decides it for every value: a loss that is an affine function of sums or means of per-position
terms (:mod:`hybridpar.pipeline.form_algebra`) combines exactly from its parts, and any other is no
combination of them, whatever the values.

How: the output's and the target's tensors are followed from the loss's first call: along each cut
dim a value is local, linear (a sum or a mean), broken, or absent. Every call on a followed value is
read from its name and arguments: elementwise calls (torch's tag and the one list the planners share,
:func:`hybridpar.planner.elementwise.elementwise`), reductions, reshapes and permutations, indexing,
work along one dim, cat and stack, torch's loss functions with their reductions (cross entropy's mean
with ``ignore_index``: a mean over the voxels it does not ignore, exact where it ignores none, which the
step's targets are checked for); any other call breaks what it touches, as does a read of a value into
Python or of a split extent. :meth:`LossForm.findings` turns the loss's form into
:class:`~hybridpar.pipeline.loss_check.Finding` s that join the value checks in the agreement: a form
that fits only a mean or only a sum, or one that fits neither (then the loss is evaluated on the whole
output, or refused along the samples).
"""

from __future__ import annotations

import math
import sys
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from hybridpar.nn.torch_args import complete
from hybridpar.pipeline import form_algebra as fa
from hybridpar.pipeline import form_calls as fc
from hybridpar.pipeline.form_algebra import BATCH, MEAN, SUM, Form
from hybridpar.pipeline.form_along import CallsAlong
from hybridpar.pipeline.form_index import Indexing
from hybridpar.pipeline.loss_check import FORM, Finding
from hybridpar.pipeline.loss_params import is_alias
from hybridpar.pipeline.read_dims import dims_read
from hybridpar.planner.calls import SAFE, VALUE_READS, carriers_of, reads_shape, tensors_in
from hybridpar.planner.elementwise import elementwise, name_of


class LossForm(Indexing, CallsAlong, TorchFunctionMode):
    """Follows one evaluation of ``loss_fn`` on ``(out, y)`` (see module doc). ``spatial``: the spatial
    dims (0-2) the output's shards cut; ``batch``: whether replicas or micro-batches cut the samples."""

    def __init__(self, out: Any, y: Any, spatial: Sequence[int], batch: bool) -> None:
        super().__init__()
        self.roles = {d + 1 for d in spatial} | ({BATCH} if batch else set())
        self.forms: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.fills: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor of one value -> it (None: unknown)
        self.source: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> the leaf of y it holds
        self.storages: dict[int, list[weakref.ref]] = {}  # a storage's address -> tensors on it
        self.seen: WeakIdKeyDictionary = WeakIdKeyDictionary()  # every tensor a call here returned
        self.depth = 0  # calls of this mode under way
        self._reader = None  # the frame of the line reading a shape (see read_dims)
        self.unseen = ""  # an operation that ran outside them (the first's name), or none
        self.read: dict[int, int] = {}  # role -> why: values or split extents read into Python
        self.counted = False  # the samples' count read (a mean written by hand: the values tell)
        self.ignores: list[tuple[torch.Tensor, int, set[int], int | None]] = []
        volume = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.dim() == 5), None)
        box = tuple(volume.shape[2:]) if volume is not None else None
        first = next((t for t in tree_leaves((y, out)) if isinstance(t, torch.Tensor) and t.dim()), None)
        samples = first.shape[0] if first is not None else None  # a dict or tuple target's, or none
        for t in (t for t in tree_leaves((out, y)) if isinstance(t, torch.Tensor)):
            self.seen[t] = True  # given, not computed out of sight (a penalty the forward returns)
        for t in (t for t in tree_leaves(out) if isinstance(t, torch.Tensor)):
            self._start(t, box, samples, spatial, batch)
        for i, t in enumerate(t for t in tree_leaves(y) if isinstance(t, torch.Tensor)):
            self._start(t, box, samples, spatial, batch)
            self.source[t] = i

    def _start(self, t: torch.Tensor, box: tuple | None, samples: int | None, spatial: Sequence[int],
               batch: bool) -> None:
        dims: list[set[int]] = [set() for _ in range(t.dim())]
        if batch and t.dim() and t.shape[0] == samples:
            dims[0].add(BATCH)
        if box is not None and t.dim() in (4, 5) and tuple(t.shape[-3:]) == box and t.shape[0] == samples:
            for d in spatial:
                dims[t.dim() - 3 + d].add(d + 1)
        if any(dims):
            self.forms[t] = fa.made([frozenset(d) for d in dims], {}, {})
            self._share(t)

    # ------------------------------------------------------------------ following
    def __enter__(self) -> LossForm:
        self._below = _Unseen(self).__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._below.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = complete(func, kwargs or {})
        if _transforming() and not self.unseen:  # vmap, grad: on wrapped values
            self.unseen = f"{name_of(func)} under a torch.func transform"
        self._reader = sys._getframe(1) if reads_shape(func) else None  # the line reading a shape
        self.depth += 1
        try:
            result = func(*args, **kwargs)
            try:
                self._follow(func, args, kwargs, result)
            except Exception:  # noqa: BLE001 (a call read wrongly breaks what it touches: never a wrong form)
                self._give(result, self._broken(args, kwargs, fa.UNFOLLOWED))
        finally:
            self.depth -= 1
        for r in _tensors(result):
            self.seen[r] = True
        return result

    def _escaped(self, t: Any) -> bool:
        """Whether ``t`` was computed where this mode could not see, from what may be the output: it has a
        gradient's history but no call here made it (a ``torch.jit.script`` function, a block with
        torch functions disabled, an activation the model kept on itself)."""
        return (isinstance(t, torch.Tensor) and t.grad_fn is not None and t not in self.forms
                and t not in self.seen and not is_alias(t))

    def _broken(self, args: tuple, kwargs: dict, why: int) -> Form:
        forms = [self.forms[t] for t in tensors_in(args, kwargs) if t in self.forms]
        broken: dict[int, int] = {}
        for f in forms:
            broken.update(fa.broken_all(f, why).broken)
        return fa.made([], {}, broken)

    def _give(self, result: Any, form: Form | list[Form]) -> None:
        outs = _tensors(result)
        forms = form if isinstance(form, list) else [form] * len(outs)
        for r, f in zip(outs, forms, strict=False):
            if f.roles():
                if len(f.dims) != r.dim():
                    f = fa.broken_all(f, f.broken[0][1] if f.broken else fa.UNFOLLOWED, r.dim())
                self.forms[r] = f
            self._share(r)

    def _share(self, t: torch.Tensor) -> None:
        """Note ``t`` among the tensors on its storage (a view, ``x.detach()``, ``x.data``: a write
        through one changes the others)."""
        at = _storage(t)
        if at:
            self.storages.setdefault(at, []).append(weakref.ref(t))

    def _sharing(self, t: torch.Tensor) -> list[torch.Tensor]:
        """The tensors noted on ``t``'s storage, but ``t``."""
        at = _storage(t)
        refs = self.storages.get(at, []) if at else []
        return [u for ref in refs if (u := ref()) is not None and u is not t]

    def _follow(self, func: Any, args: tuple, kwargs: dict, result: Any) -> None:
        name = name_of(func)
        if name == "__set__":  # an attribute set: x.data = v writes v's values into x
            if getattr(getattr(func, "__self__", None), "__name__", "") == "data":
                self._set_data(*args[:2])
            return
        tensors = tensors_in(args, kwargs)
        if any(self._escaped(t) for t in tensors):  # what it computes from there: nothing to vouch for
            unfollowed = fa.made([], {}, {r: fa.UNFOLLOWED for r in self.roles})
            target = args[0] if fc.in_place(name) and args and isinstance(args[0], torch.Tensor) else result
            self._give(target, unfollowed)
            return
        number = _number(args[1] if name == "new_tensor" and len(args) > 1 else args[0] if args else None)
        if name in fc.FROM_NUMBER and number is not None and isinstance(result, torch.Tensor):
            self.fills[result] = number  # torch.tensor(0.0): an accumulator's start
            self._share(result)
            return
        if name in fc.SCALE and not fc.in_place(name) and any(_number(a) == 0.0 for a in args) and isinstance(
                result, torch.Tensor) and result.dim() == 0:  # 0 * o.sum(): DDP's unused-output trick, a zero
            self.fills[result] = 0.0  # (a scalar: a zero volume has the part's extents, which a sum counts)
            return
        like = name.startswith("new_") or name.endswith("_like")
        if name in fc.FILLS and isinstance(result, torch.Tensor) and not any(
                t in self.forms for t in (tensors[1:] if like else tensors)) \
                and not (name.endswith("_like") and tensors and tensors[0] in self.forms):
            # (a value of the output's filled in, or a part's extents: followed, not a fill)
            value = fc.FILLS[name]
            self.fills[result] = value if value is not None else fc.fill_value(name, args, kwargs)
            self._share(result)
            return
        followed = [t for t in tensors if t in self.forms]
        if not followed:
            written = [args[0]] if args and isinstance(args[0], torch.Tensor) and fc.in_place(name) else []
            written += [kwargs["out"]] if isinstance(kwargs.get("out"), torch.Tensor) else []
            for t in written:  # a constant written, itself or through a view: no longer of one value
                for u in (t, *self._sharing(t)):
                    self.fills.pop(u, None)
            return
        if name in VALUE_READS:
            for t in followed:  # a branch on it may take another path on each part
                for r in self.forms[t].roles():
                    self.read.setdefault(r, fa.VALUES)
            return
        if reads_shape(func) or name in fc.EXTENT_READS:
            self._extents(name, args, kwargs)
            return
        if name in fc.FILLS and not name.endswith("_like"):  # of a value of the output's (new_full(s, m))
            self._give(result, fa.made([], {}, {r: fa.UNFOLLOWED for r in self.roles}))
            return
        if name in SAFE:
            return
        if result is not None and not _tensors(result):  # torch.equal, allclose, is_nonzero: read as values
            for t in followed:
                for r in self.forms[t].roles():
                    self.read.setdefault(r, fa.VALUES)
            return
        before = self.forms.get(args[0]) if args and isinstance(args[0], torch.Tensor) else None
        form = self._rule(func, name, args, kwargs, result)
        if fc.in_place(name) and args and isinstance(args[0], torch.Tensor):
            target = args[0]
            new = form[0] if isinstance(form, list) else form
            self.forms[target] = new
            self.fills.pop(target, None)
            self.source.pop(target, None)  # its values are no longer the target's leaf's
            self._written(target, before, new)
            return
        self._give(result, form)
        out = kwargs.get("out")
        if isinstance(out, torch.Tensor):  # written as in place: what shares its storage changes too
            self.fills.pop(out, None)
            written = self.forms.get(out) or fa.made([], {}, {r: fa.MIXES for r in self.roles})
            self._written(out, None, written)
        if name in fc.KEEPS_VALUES and args and args[0] in self.source and isinstance(result, torch.Tensor):
            self.source[result] = self.source[args[0]]

    def _written(self, target: torch.Tensor, before: Form | None, form: Form) -> None:
        """``target`` written in place, its form now ``form``: the tensors that share its storage hold
        other values than their forms say unless its form stayed as it was and whole (a write through
        ``x[:, :, 0]`` or ``y.detach()[:, :, 0]`` changes ``x`` or ``y`` at one plane)."""
        sharing = self._sharing(target)
        for t in sharing:  # their values changed: no longer a target leaf's (an ignore_index may be new)
            self.source.pop(t, None)
        if form == before and not form.broken:
            return
        for t in sharing:
            old = self.forms.get(t)
            roles = form.roles() | (old.roles() if old is not None else set())
            self.forms[t] = fa.made([frozenset()] * t.dim(), {}, {r: fa.MIXES for r in roles})
            self.fills.pop(t, None)

    def _set_data(self, target: torch.Tensor, value: torch.Tensor) -> None:
        before, new = self.forms.get(target), self.forms.get(value)
        self.fills.pop(target, None)
        if value in self.fills:
            self.fills[target] = self.fills[value]
        if new is not None:
            self.forms[target] = new
        elif before is not None:
            del self.forms[target]
        self._written(target, before, new or fa.made([frozenset()] * target.dim(), {}, {}))
        self._share(target)

    def _extents(self, name: str, args: tuple, kwargs: dict) -> None:
        """A shape read: the extents read along cut roles (a split one breaks it; the samples' count
        leaves the kind to the checks on values), or of a value broken along one."""
        t = args[0]
        form = self.forms[t]
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if name == "__len__":
            dim = 0
        if dim is not None and name not in fc.EXTENT_READS:
            dims = [dim % t.dim()]
        elif name in ("numel", "nelement", *fc.EXTENT_READS):
            dims = list(range(t.dim()))
        else:  # x.shape, x.size(): the dims its line indexes
            dims = dims_read(self._reader, t.dim())
        for i in dims:
            for r in form.dims[i]:
                if r == BATCH:
                    self.counted = True
                else:
                    self.read.setdefault(r, fa.EXTENTS)
        for r, _ in form.broken:  # an extent that data along it decides (argwhere, unique, a selection)
            self.read.setdefault(r, fa.EXTENTS)

    # ------------------------------------------------------------------ the rules
    def _operand(self, a: Any) -> tuple[Form | None, tuple[int, ...], bool]:
        if isinstance(a, torch.Tensor):
            return self.forms.get(a), tuple(a.shape), a in self.fills or a.numel() == 1
        return None, (), True

    def _zero(self, a: Any) -> bool:
        if isinstance(a, torch.Tensor):
            return a not in self.forms and self.fills.get(a, 1.0) == 0.0
        return _number(a) == 0.0

    def _rule(self, func: Any, name: str, args: tuple, kwargs: dict, result: Any) -> Form | list[Form]:
        outs = _tensors(result)
        if name in fc.LOSSES:
            return self._loss(func, name, args, kwargs)
        if name in fc.REDUCTIONS and not (name in ("max", "min") and len(args) > 1
                                       and isinstance(args[1], torch.Tensor)):
            return self._reduction(name, args, kwargs, outs[0] if outs else None)
        if name in fc.RESHAPES:
            return fa.regrouped(self.forms[args[0]], args[0].shape, outs[0].shape)
        if name in fc.PERMUTES:
            probe = torch.empty([2 + i for i in range(args[0].dim())], device="meta")
            order = [s - 2 for s in func(probe, *args[1:], **kwargs).shape]
            return fa.permuted(self.forms[args[0]], order)
        if name == "__getitem__" or name == "__setitem__":
            return self._index(name, args)
        if name == "one_hot":
            f = self.forms[args[0]]
            if (args[1] if len(args) > 1 else kwargs.get("num_classes", -1)) == -1:  # as many as the data's
                return fa.broken_all(f, fa.VALUES, outs[0].dim())
            return fa.made([*f.dims, frozenset()], {}, fa.broken_all(f, fa.RATIO).broken
                           if f.linear else dict(f.broken), f.picked)
        if name in ("repeat", "tile"):
            return self._repeat(args[0], outs[0])
        if name in fc.ALONG:
            return self._along(name, args, kwargs, outs)
        if name in fc.PER_SAMPLE or name.endswith("_with_indices"):
            return self._per_sample(args, kwargs, outs)
        if elementwise(func) or name in fc.JOIN or name in fc.SCALE or name in fc.NUMERATOR:
            return self._elementwise(func, name, args, kwargs, outs[0].shape if outs else ())
        return [self._broken(args, kwargs, fa.UNFOLLOWED)] * len(outs)

    def _elementwise(self, func: Any, name: str, args: tuple, kwargs: dict, shape: Sequence[int]) -> Form:
        how = fa.LINEAR_JOIN if name in fc.JOIN else fa.SCALE if name in fc.SCALE else fa.NUMERATOR if (
            name in fc.NUMERATOR and kwargs.get("rounding_mode") is None) else fa.OTHER
        if name == "__rtruediv__":
            how = fa.OTHER
        values = [*args, *(v for k, v in kwargs.items() if k != "alpha")]  # alpha scales: linear
        tensors = [a for a in values if not isinstance(a, list | tuple)]
        tensors += [a for v in values if isinstance(v, list | tuple) for a in v]
        carriers = carriers_of(func, [t for t in tensors if isinstance(t, torch.Tensor)])
        kept = {id(t) for t in carriers}
        given = [a for a in tensors if (name not in fc.UNARY and _number(a) is not None) or (
            isinstance(a, torch.Tensor) and (id(a) in kept or a in self.forms))]  # in order: which divides
        if how == fa.LINEAR_JOIN:
            given = [a for a in given if not self._zero(a)]
        return fa.elementwise(shape, [self._operand(a) for a in given], how, self.roles)

    def _reduction(self, name: str, args: tuple, kwargs: dict, out: torch.Tensor | None) -> Form:
        """A reduction over the dims it names (all where none), kept where the result keeps them (read
        off the result: ``std(x, 1, True)``'s third argument is no keepdim)."""
        t = args[0]
        at = fc.DIM_AT.get(name, 1)
        dim = kwargs.get("dim", kwargs.get("axis", args[at] if len(args) > at and not isinstance(
            args[at], bool) else None))
        if dim is None or (isinstance(dim, list | tuple) and not dim):
            dims = list(range(t.dim()))
        else:
            dims = sorted({d % t.dim() for d in (dim if isinstance(dim, list | tuple) else [dim])})
        keep = out is not None and out.dim() == t.dim() and bool(dims)
        return fa.reduced(self.forms[t], dims, fc.LINEAR.get(name), keep)

    # ------------------------------------------------------------------ the verdict
    def findings(self, loss: Any, others: Sequence[Any] = ()) -> tuple[list[Finding], list[Finding]]:
        """The loss's form as findings along the output's shards and along the samples (see module doc).
        ``others``: the step's other micro-batches' targets, checked for a cross entropy's
        ``ignore_index`` as this one's was (a sync: in the check, once per step)."""
        form = self.forms.get(loss) if isinstance(loss, torch.Tensor) else None
        ignored: dict[int, int] = {}
        for hit, value, roles, leaf in self.ignores:
            if bool(hit):
                ignored.update({r: fa.SELECTION for r in roles})
            if BATCH in roles and others:
                leaves = [[t for t in tree_leaves(o) if isinstance(t, torch.Tensor)] for o in others]
                if leaf is None or any(bool((ls[leaf] == value).any()) for ls in leaves if leaf < len(ls)):
                    ignored[BATCH] = fa.SELECTION
        if (form is None and self._escaped(loss)) or self.unseen:
            form = fa.made([], {}, {r: fa.UNFOLLOWED for r in self.roles})
        broken, counted = ignored | self.read, {BATCH} if self.counted else set()

        def found(roles: set[int]) -> list[Finding]:
            why, kind = fa.judged(form, roles, broken, counted)
            if why is not None:
                return [Finding(FORM + why, 1.0, math.nan, math.nan)]
            return [Finding(FORM, 1.0, float(kind == MEAN), float(kind == SUM))] if kind else []

        return found(self.roles - {BATCH}), found(self.roles & {BATCH})


def _tensors(result: Any) -> list[torch.Tensor]:
    """The tensors a call returned (itself, or those of a tuple or list)."""
    return [r for r in (result if isinstance(result, tuple | list) else [result])
            if isinstance(r, torch.Tensor)]


class _Unseen(TorchDispatchMode):
    """Below autograd, every operation the loss runs: one outside any call :class:`LossForm` saw ran
    where torch functions do not reach (a ``torch.jit.script`` function, a block with them disabled,
    ``x.set_(v)``, a transform), on values the form then knows nothing of."""

    def __init__(self, form: LossForm) -> None:
        super().__init__()
        self.form = form

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.form.depth and not self.form.unseen:
            self.form.unseen = str(func)
        return func(*args, **(kwargs or {}))


def _storage(t: torch.Tensor) -> int:
    """The address of ``t``'s storage; 0 where it has none to share (empty, or a transform's wrapper)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def _number(a: Any) -> float | None:
    """``a`` as a float where it is a Python number (not a bool)."""
    return float(a) if isinstance(a, int | float) and not isinstance(a, bool) else None


def _transforming() -> bool:
    """Whether a ``torch.func`` transform (vmap, grad) is running: its values are wrappers of others."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(active()) if active is not None else False
