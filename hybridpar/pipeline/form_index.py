"""How ``x[index]`` and ``x[index] = v`` meet a loss's form: the indexing rules of
:class:`hybridpar.pipeline.loss_form.LossForm`, a mixin of it.

Why apart: an index is the one call whose effect on positions depends on the shape of its argument
(slices, ints, ``None``, ``...``, a mask), and a write through it changes the tensor it indexes;
the mode's other rules read a dim or two from the call's arguments. Along a dim the engine cuts only a
full slice keeps positions where they are: ``x[:, :, 1:]`` on a part drops the part's first plane, not
the whole's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from hybridpar.pipeline import form_algebra as fa
from hybridpar.pipeline.form_algebra import Form


class Indexing:
    """The index rules; the mode holds ``forms`` and ``roles`` and gives ``_operand``, ``_zero`` and
    ``_broken`` (:class:`~hybridpar.pipeline.loss_form.LossForm`)."""

    forms: WeakIdKeyDictionary
    roles: set[int]

    def _index(self, name: str, args: tuple) -> Form:
        """``x[index]`` (and ``x[index] = v``): slices, ints, ``None`` and ``...`` along dims the engine
        does not cut, full slices along those it does, one list of positions along a dim it does not
        cut (``o[:, [0, 2]]``), one mask of ``x``'s leading dims (a selection), or a constant table
        looked up at the output's values (``weights[y]``: one entry per position)."""
        t, index = args[0], args[1]
        form = self.forms.get(t) or fa.made([frozenset()] * t.dim(), {}, {})
        items = list(index) if isinstance(index, tuple) else [index]
        masks = [i for i in items if isinstance(i, torch.Tensor) and i.dtype == torch.bool]
        if masks:
            return self._masked(name, args, form, items, masks[0])
        if name == "__getitem__" and t not in self.forms and len(items) == 1 and isinstance(
                index, torch.Tensor) and index in self.forms and not index.is_floating_point():
            looked = self.forms[index]
            broken = dict(looked.broken) | {r: fa.RATIO for r, _ in looked.linear}
            return fa.made([*looked.dims, *[frozenset()] * (t.dim() - 1)], {}, broken, looked.picked)
        listed = [k for k, i in enumerate(items) if isinstance(i, torch.Tensor | list)]
        if len(listed) == 1 and _positions(items[listed[0]]) and not (
                isinstance(items[listed[0]], torch.Tensor) and items[listed[0]] in self.forms):
            k = listed[0]
            named = sum(1 for i in items if i is not None and i is not Ellipsis)
            at = sum(t.dim() - named if i is Ellipsis else i is not None for i in items[:k])
            if at >= t.dim() or form.dims[at]:
                return self._index_failed(name, args, form)
            items = [*items[:k], slice(None), *items[k + 1:]]  # the dim stays, not cut: as a full slice
        if any(isinstance(i, torch.Tensor | list) for i in items) or items.count(Ellipsis) > 1:
            return self._index_failed(name, args, form)
        named = sum(1 for i in items if i is not None and i is not Ellipsis)
        per: list = []
        for i in items:
            per += [slice(None)] * (t.dim() - named) if i is Ellipsis else [i]
        dims, at, region, picks = [], 0, [], {}
        for j in per:
            if j is None:
                dims.append(frozenset())
                region.append(None)
                continue
            if isinstance(j, bool) or not isinstance(j, int | slice) or at >= t.dim():
                return self._index_failed(name, args, form)
            whole = isinstance(j, slice) and j.start in (None, 0) and j.stop is None and j.step in (None, 1)
            if form.dims[at] and not whole:  # positions picked along a cut dim: the part's, not the whole's
                if name == "__setitem__":
                    return self._index_failed(name, args, form)
                picks.update({r: fa.MIXES for r in form.dims[at]})
            if isinstance(j, slice):
                dims.append(form.dims[at])
                region.append(at)
            at += 1
        for k in range(at, t.dim()):
            dims.append(form.dims[k])
            region.append(k)
        if name == "__getitem__":
            return fa.made(dims, dict(form.linear), dict(form.broken) | picks, form.picked)
        return self._assigned(t, form, args[2], region)

    def _masked(self, name: str, args: tuple, form: Form, items: list, mask: torch.Tensor) -> Form:
        t = args[0]
        if len(items) != 1 or tuple(mask.shape) != tuple(t.shape[:mask.dim()]):
            return self._index_failed(name, args, form)
        k = mask.dim()
        mf, ms, mu = self._operand(mask)  # a mask indexes the leading dims: laid from the left
        pad = t.dim() - k
        laid = (None if mf is None else fa.made([*mf.dims, *[frozenset()] * pad], dict(mf.linear),
                                                dict(mf.broken), mf.picked), (*ms, *[1] * pad), mu)
        both = fa.elementwise(t.shape, [self._operand(t), laid], fa.OTHER, self.roles)
        if name == "__setitem__":
            value = args[2]
            if isinstance(value, torch.Tensor) and value in self.forms:
                return self._index_failed(name, args, form)
            return both
        picked = frozenset().union(*both.dims[:k])
        return fa.made([picked, *both.dims[k:]], dict(both.linear), dict(both.broken), both.picked | picked)

    def _index_failed(self, name: str, args: tuple, form: Form) -> Form:
        others = self._broken(args[1:], {}, fa.MIXES)
        broken = dict(others.broken) | dict(fa.broken_all(form, fa.MIXES).broken)
        n = args[0].dim() if name == "__setitem__" else 0
        return fa.made([frozenset()] * n, {}, broken)

    def _assigned(self, t: torch.Tensor, form: Form, value: Any, region: list[int | None]) -> Form:
        """``t[box] = value`` where the box keeps every cut dim whole: ``value`` laid into ``t``'s dims."""
        vf, vs, uniform = self._operand(value)
        if vf is None:  # a constant written: a term of its own
            written = [] if self._zero(value) else [(None, (), True)]
            return fa.elementwise(t.shape, [self._operand(t), *written], fa.LINEAR_JOIN, self.roles)
        placed = [frozenset()] * t.dim()
        shape = [1] * t.dim()
        for k, (dims_k, size) in enumerate(zip(vf.dims, vs, strict=True)):
            pos = len(region) - len(vs) + k
            target = region[pos] if pos >= 0 else None
            if target is None:
                if dims_k:
                    return self._index_failed("__setitem__", (t, None, value), form)
                continue
            placed[target], shape[target] = dims_k, size
        moved = fa.made(placed, dict(vf.linear), dict(vf.broken), vf.picked)
        operands = [(moved, tuple(shape), uniform)]
        if not self._zero(t):
            operands.append(self._operand(t))
        return fa.elementwise(t.shape, operands, fa.LINEAR_JOIN, self.roles)


def _positions(index: Any) -> bool:
    """A list of ints or a 1-D integer tensor: positions along one dim."""
    if isinstance(index, list):
        return all(isinstance(i, int) and not isinstance(i, bool) for i in index)
    return index.dim() == 1 and not index.is_floating_point() and index.dtype != torch.bool
