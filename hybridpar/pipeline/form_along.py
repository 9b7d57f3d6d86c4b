"""Calls that work along given dims, per sample, or as torch's loss functions: rules of
:class:`hybridpar.pipeline.loss_form.LossForm`, a mixin of it.

Why apart: each of these reads which dims it works along from its arguments (a ``dim``, the class
dim of cross entropy, dim 0 of a window's input) and keeps the roles of every other dim as they were,
where the mode's elementwise, reduction and reshape rules read no dim at all.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from hybridpar.pipeline import form_algebra as fa
from hybridpar.pipeline import form_calls as fc
from hybridpar.pipeline.form_algebra import BATCH, MEAN, SUM, Form
from hybridpar.planner import calls
from hybridpar.planner.calls import tensors_in


class CallsAlong:
    """The rules; the mode holds ``forms``, ``fills``, ``roles``, ``source`` and ``ignores`` and gives
    ``_operand``, ``_zero`` and ``_broken`` (:class:`~hybridpar.pipeline.loss_form.LossForm`)."""

    forms: WeakIdKeyDictionary
    fills: WeakIdKeyDictionary
    source: WeakIdKeyDictionary
    roles: set[int]
    ignores: list

    def _repeat(self, t: torch.Tensor, out: torch.Tensor) -> Form:
        form = self.forms[t]
        off = out.dim() - t.dim()
        dims = [frozenset()] * off + list(form.dims)
        broken = dict(form.broken)
        for k, d in enumerate(dims):
            if d and out.shape[k] != t.shape[k - off]:
                broken.update({r: fa.MIXES for r in d})
        return fa.made(dims, dict(form.linear), broken, form.picked)

    def _along(self, name: str, args: tuple, kwargs: dict, outs: list[torch.Tensor]) -> Form | list[Form]:
        """A call along given dims (:data:`fc.ALONG`): exact on a part along every other dim; the roles of
        those dims mix positions (``for s in x`` unbinds along the samples)."""
        at, default = fc.ALONG[name]
        given = args[at] if len(args) > at else default
        dim = kwargs.get("dim", kwargs.get("dims", kwargs.get("axis", given)))
        joined = name in calls.JOINS
        nd = (args[0][0] if joined else args[0]).dim() + (1 if name == "stack" else 0)
        if dim is None:
            return [self._broken(args, kwargs, fa.MIXES)] * len(outs)
        dims = {d % nd for d in (dim if isinstance(dim, list | tuple) else [dim])}
        operands = [a for a in args[0] if not self._zero(a)] if joined else [
            a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]
        given = [self._operand(a) for a in operands]
        if name == "stack":
            d = dims.pop()
            given = [(None if f is None else fa.made([*f.dims[:d], frozenset(), *f.dims[d:]], dict(f.linear),
                                                     dict(f.broken), f.picked), (*s[:d], 1, *s[d:]), u)
                     for f, s, u in given]
            return fa.elementwise(outs[0].shape, given, fa.LINEAR_JOIN, self.roles)
        across = {r: fa.MIXES for f, _, _ in given if f is not None for d in dims if d < len(f.dims)
                  for r in f.dims[d]}
        given = [(f if f is None or not across else fa.made(f.dims, dict(f.linear), dict(f.broken) | across,
                                                           f.picked), s, u) for f, s, u in given]
        how = fa.LINEAR_JOIN if joined else fa.OTHER
        forms = []
        for r in outs:
            if name in fc.DROPS or r.dim() < nd:
                d = min(dims)
                lifted = [(f, (*s[:d], 1, *s[d + 1:]), u) for f, s, u in given]
                full = fa.elementwise((*r.shape[:d], 1, *r.shape[d:]), lifted, how, self.roles)
                forms.append(fa.reduced(full, [d], None, False))
            else:
                ones = lambda shape: tuple(1 if k in dims else n for k, n in enumerate(shape))  # noqa: E731
                forms.append(fa.elementwise(ones(r.shape), [(f, ones(s), u) for f, s, u in given], how,
                                            self.roles))
        return forms

    def _per_sample(self, args: tuple, kwargs: dict, outs: list[torch.Tensor]) -> list[Form]:
        """A function of each sample alone (:data:`fc.PER_SAMPLE`) of its first argument: its samples
        stay along dim 0, every other role it meets is mixed (a weight of the output's, a kernel per
        sample, mixes them all)."""
        whole = self._broken(args, kwargs, fa.MIXES)
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        form = self.forms.get(x) if x is not None else None
        others = [t for t in tensors_in(args[1:], kwargs) if t in self.forms]
        if form is None or others or not x.dim() or form.dims[0] != {BATCH} or BATCH in form.picked:
            return [whole] * len(outs)
        samples = {x.shape[0]}
        broken = {r: w for r, w in whole.broken if r != BATCH}
        return [fa.made([frozenset({BATCH}), *[frozenset()] * (r.dim() - 1)], {}, broken)
                if r.dim() and r.shape[0] in samples else whole for r in outs]

    def _loss(self, func: Any, name: str, args: tuple, kwargs: dict) -> Form:
        """torch's loss functions: elementwise terms (cross entropy's per position, over the class dim),
        then their reduction: none, a sum, a mean (cross entropy's, with class weights, a ratio; with
        an ``ignore_index``, a mean where it occurs nowhere), ``batchmean`` (a sum over positions, a mean
        over the samples)."""
        bound = inspect.signature(func).bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if a.get("size_average") is not None or a.get("reduce") is not None:
            return self._broken(args, kwargs, fa.UNFOLLOWED)
        x, target, weight = a["input"], a["target"], a.get("weight")
        if name in ("cross_entropy", "nll_loss"):
            c = 1 if x.dim() >= 2 else 0
            fx = self.forms.get(x)
            if fx is not None and fx.dims[c]:
                return self._broken(args, kwargs, fa.MIXES)
            if isinstance(weight, torch.Tensor) and weight in self.forms:  # class weights of the data's
                return self._broken(args, kwargs, fa.RATIO)
            drop = lambda t: (fa.reduced(self.forms[t], [c], None, False) if t in self.forms else None,  # noqa: E731
                              (*t.shape[:c], *t.shape[c + 1:]), t in self.fills)
            index = not target.is_floating_point()
            terms = fa.elementwise((*x.shape[:c], *x.shape[c + 1:]),
                                   [drop(x), self._operand(target) if index else drop(target)], fa.OTHER,
                                   self.roles)
        else:
            extra = [a[k] for k in ("weight", "pos_weight", "var") if isinstance(a.get(k), torch.Tensor)]
            operands = [x, target, *extra]
            shape = torch.broadcast_shapes(*(t.shape for t in operands))
            terms = fa.elementwise(shape, [self._operand(t) for t in operands], fa.OTHER, self.roles)
        reduction = a.get("reduction", "mean")
        if reduction == "none":
            return terms
        everything = list(range(len(terms.dims)))
        if reduction == "sum":
            return fa.reduced(terms, everything, SUM, False)
        if reduction == "batchmean":
            summed = fa.reduced(terms, everything, SUM, False)
            first = terms.dims[0] if terms.dims else frozenset()
            return fa.made([], {r: MEAN if r in first else k for r, k in summed.linear}, dict(summed.broken))
        roles = set().union(*terms.dims) if terms.dims else set()
        if weight is not None and not name.startswith("binary_cross_entropy"):  # a mean by the weights' sum
            return fa.made([], {}, dict(terms.broken) | {r: fa.RATIO for r in roles | {
                r for r, _ in terms.linear}})
        if name in ("cross_entropy", "nll_loss") and not target.is_floating_point():
            value = int(a["ignore_index"])  # whether it occurs, as the call found it (the target may change)
            self.ignores.append(((target == value).any(), value, roles, self.source.get(target)))
        return fa.reduced(terms, everything, MEAN, False)
