"""What a value computed from a split output is, along each dim the engine cuts: the algebra a loss's
calls are followed by (:mod:`hybridpar.pipeline.loss_form`), apart from the calls themselves.

Why: the engine evaluates ``loss_fn`` on each rank's output shard, micro-batch and replica and combines
the values by their share (a mean) or by adding them (a sum). That is one process's loss exactly when
the loss is an affine function of sums or means, over every position along the cut dims, of terms each
computed at one position: then the parts' shares recombine the means and the parts' sums the sums. A
loss normalised by a count or a sum that differs between the parts (a masked mean, Dice, ``y.amax()``)
is no such function whatever values the parts hold, so a check on sample values cannot prove it; the
form of the computation can.

A *role* is one cut dim of the output: :data:`BATCH` (the samples, where replicas or micro-batches cut
them) or a spatial dim (1-3: D, H, W, where the grid splits it). Along each role a value is:

- *local* (the role is one of its dims: each entry computed from the data at one position along it),
- *linear* of kind ``sum`` or ``mean`` (the role was summed or averaged away and only linear steps
  followed: adding terms of the same kind, scaling by what does not depend on that role; where the
  loss also read the samples' count, a hand-written ``s / x.size(0)``, the checks on values tell
  which),
- *broken*, with the reason (:data:`REASONS`): nothing the engine can combine,
- or absent: it does not depend on data along that role.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

BATCH = 0  # the role of the samples; spatial dim d (0-2 of D, H, W) is role d + 1
SUM, MEAN = "sum", "mean"

RATIO, EXTREME, MIXES, VALUES, EXTENTS, UNFOLLOWED, SELECTION, OFFSET, KINDS, KEPT = range(10)
REASONS = (
    "combines sums or means of them otherwise than linearly (a ratio or a product of them: a masked mean, "
    "Dice, a normalisation by the data)",
    "reduces them other than by a sum or a mean (an extreme, a norm, a variance)",
    "mixes values at different positions along a cut dim (a window, a shift, an index or slice along it)",
    "reads them into Python (.item(), a branch on them)",
    "reads their extent along a split dim (x.shape, x.numel()), which a part holds otherwise",
    "passes them to a function whose effect on positions the engine does not follow",
    "averages over a selection of them (x[mask].mean(), cross entropy where ignore_index occurs)",
    "adds a term that does not depend on them to a sum over them (once per part)",
    "mixes a mean and a sum over the dims the engine cuts",
    "keeps a dim the engine cuts (it is no scalar over it)",
)
"""Why a value is broken along a role, by code (:data:`RATIO` ...); the codes travel between ranks."""


@dataclass(frozen=True)
class Form:
    """One value's form (see module doc): ``dims`` the roles each of its dims holds (local along
    them), ``linear`` the roles reduced linearly and how, ``broken`` the roles broken and why,
    ``picked`` roles whose positions a mask selected (their count is the data's)."""

    dims: tuple[frozenset[int], ...]
    linear: tuple[tuple[int, str], ...] = ()
    broken: tuple[tuple[int, int], ...] = ()
    picked: frozenset[int] = field(default_factory=frozenset)

    def roles(self) -> set[int]:
        """Every role this value depends on."""
        return {r for d in self.dims for r in d} | {r for r, _ in self.linear} | {r for r, _ in self.broken}

    def local_at(self, role: int) -> int | None:
        return next((i for i, d in enumerate(self.dims) if role in d), None)

    def kind(self, role: int) -> str | None:
        return dict(self.linear).get(role)

    def why(self, role: int) -> int | None:
        return dict(self.broken).get(role)


def made(dims: Sequence[frozenset[int]], linear: dict[int, str], broken: dict[int, int],
         picked: set[int] | frozenset[int] = frozenset()) -> Form:
    """A :class:`Form`, its parts sorted (equal forms compare equal); a role broken is nothing else."""
    dims = tuple(frozenset(r for r in d if r not in broken) for d in dims)
    lin = tuple(sorted((r, k) for r, k in linear.items() if r not in broken))
    return Form(dims, lin, tuple(sorted(broken.items())), frozenset(r for r in picked if r not in broken))


def broken_all(form: Form | None, why: int, ndim: int = 0) -> Form:
    """Every role ``form`` depends on broken (by ``why`` where not already), as a value of ``ndim`` dims."""
    broken = dict(form.broken) if form is not None else {}
    for r in form.roles() if form is not None else ():
        broken.setdefault(r, why)
    return made([frozenset()] * ndim, {}, broken)


def combine(kinds: Sequence[str]) -> str | None:
    """The kind of a sum of terms of these kinds; None where a mean meets a sum."""
    known = set(kinds)
    return known.pop() if len(known) == 1 else None


LINEAR_JOIN, SCALE, NUMERATOR, OTHER = "join", "scale", "numerator", "other"
"""How an elementwise call treats a linear operand: adds it (``+``, ``-``, a stack), multiplies it by
the others, divides it by them, or none of these (any other function of it)."""


def elementwise(shape: Sequence[int], operands: Sequence[tuple[Form | None, Sequence[int], bool]],
                how: str, roles: set[int]) -> Form:
    """The form of an elementwise call's result of ``shape`` from its ``operands``: (form or None for
    a value that depends on no cut data, its shape, whether it holds one value throughout: a Python
    number, a fill), broadcast from the right; a literal zero added is no operand. ``how``: the call's
    way with linear operands (:data:`LINEAR_JOIN` ...). ``roles``: the cut roles."""
    n = len(shape)
    placed = [(f, s, uniform, n - len(s)) for f, s, uniform in operands]  # offset of each into the result
    dims: list[set[int]] = [set() for _ in range(n)]
    linear: dict[int, str] = {}
    broken: dict[int, int] = {}
    picked: set[int] = set()
    for f, _, _, _ in placed:
        if f is not None:
            broken.update({r: w for r, w in f.broken if r not in broken})
    for role in sorted(roles - set(broken)):
        at = {off + i for f, _, _, off in placed if f is not None and (i := f.local_at(role)) is not None}
        kinds = [k for f, _, _, _ in placed if f is not None and (k := f.kind(role)) is not None]
        if len(at) > 1:
            broken[role] = MIXES
        elif at and kinds:
            broken[role] = RATIO
        elif at:
            j = at.pop()
            if any(_misplaced(f, s, uniform, j - off, role, shape[j]) for f, s, uniform, off in placed):
                broken[role] = MIXES
            else:
                dims[j].add(role)
                picked |= {role for f, _, _, _ in placed if f is not None and role in f.picked}
        elif kinds:
            why = _linear(how, role, placed, kinds)
            if isinstance(why, int):
                broken[role] = why
            else:
                linear[role] = why
    return made([frozenset(d) for d in dims], linear, broken, picked)


def _misplaced(form: Form | None, shape: Sequence[int], uniform: bool, k: int, role: int, extent: int
               ) -> bool:
    """Whether an operand of ``shape`` meets the result's dim holding ``role`` (its dim ``k``) other than
    position by position: a part one position thick broadcast along it, or values that do not depend
    on the cut data laid along it (the whole's positions, not the part's)."""
    if not 0 <= k < len(shape):
        return False
    if shape[k] not in (1, extent):  # more positions than the result keeps (a gather's smaller index)
        return True
    if form is not None and form.local_at(role) == k:
        return shape[k] == 1 and extent != 1
    return shape[k] != 1 and not uniform


def _linear(how: str, role: int, placed: list, kinds: list[str]) -> str | int:
    """The kind of an elementwise call's result along ``role`` where some operands are linear along it,
    or the reason it is broken."""
    lin = [i for i, (f, *_) in enumerate(placed) if f is not None and f.kind(role) is not None]
    if how == LINEAR_JOIN:
        kind = combine(kinds)
        if kind is None:
            return KINDS
        return OFFSET if kind == SUM and len(lin) < len(placed) else kind  # a term added once per part
    if how in (SCALE, NUMERATOR) and len(lin) == 1 and (how == SCALE or lin[0] == 0):
        return kinds[0]
    return RATIO


def reduced(form: Form, dims: Sequence[int], kind: str | None, keepdim: bool) -> Form:
    """The form of a reduction of ``form``'s value over ``dims`` (sorted, non-negative), linear of
    ``kind`` (``sum``, ``mean``) or not (None: an extreme, a norm, a count)."""
    out_dims: list[frozenset[int]] = []
    linear, broken = dict(form.linear), dict(form.broken)
    for i, d in enumerate(form.dims):
        if i not in dims:
            out_dims.append(d)
            continue
        if keepdim:
            out_dims.append(frozenset())
        for r in d:
            if kind is None:
                broken[r] = EXTREME
            elif kind == MEAN and r in form.picked:
                broken[r] = SELECTION
            else:
                linear[r] = kind
    if kind is None:  # an extreme of values already summed: no sum of the parts' extremes
        broken.update({r: RATIO for r, _ in form.linear if r not in broken})
    return made(out_dims, {r: k for r, k in linear.items() if r not in broken}, broken, form.picked)


def regrouped(form: Form, before: Sequence[int], after: Sequence[int]) -> Form:
    """The form of a reshape of ``form``'s value from shape ``before`` to ``after``: dims merged carry
    all their roles; a dim with roles spread over several (other than beside dims of one) breaks them."""
    groups = _groups(list(before), list(after))
    if groups is None:
        return broken_all(form, MIXES, len(after))
    dims: list[frozenset[int]] = [frozenset()] * len(after)
    broken = dict(form.broken)
    for ins, outs in groups:
        roles = frozenset().union(*(form.dims[i] for i in ins)) if ins else frozenset()
        if not roles:
            continue
        wide = [j for j in outs if after[j] != 1]
        if len(wide) == 1:
            dims[wide[0]] = roles
        elif len(outs) == 1:
            dims[outs[0]] = roles
        else:
            broken.update({r: MIXES for r in roles})
    return made(dims, dict(form.linear), broken, form.picked)


def _groups(a: list[int], b: list[int]) -> list[tuple[list[int], list[int]]] | None:
    """Dims of shape ``a`` and of shape ``b`` grouped where their products meet (a reshape maps each
    group onto the other); None where the numbers of elements differ or are zero."""
    if math.prod(a) != math.prod(b) or math.prod(a) == 0:
        return None
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) or j < len(b):
        gi, gj, pa, pb = [], [], 1, 1
        if i < len(a):
            pa, i = a[i], i + 1
            gi.append(i - 1)
        if j < len(b):
            pb, j = b[j], j + 1
            gj.append(j - 1)
        while pa != pb:
            if pa < pb and i < len(a):
                pa, i = pa * a[i], i + 1
                gi.append(i - 1)
            elif pb < pa and j < len(b):
                pb, j = pb * b[j], j + 1
                gj.append(j - 1)
            else:
                return None
        groups.append((gi, gj))
    return groups


def permuted(form: Form, order: Sequence[int]) -> Form:
    """The form of a permutation of ``form``'s dims: result dim ``k`` is dim ``order[k]``."""
    return made([form.dims[i] for i in order], dict(form.linear), dict(form.broken), form.picked)


def judged(form: Form | None, roles: set[int], broken: dict[int, int], counted: set[int]
           ) -> tuple[int | None, str | None]:
    """What a loss of ``form`` is along ``roles`` (those of one axis: the shards' or the samples'):
    the reason it fits no combination of its parts (the first code), else the kind it fits (``sum``
    or ``mean``; None where the checks on values tell). ``broken``: roles broken besides the form
    (values read into Python, an ``ignore_index`` met); ``counted``: roles whose extent the loss read
    (its kind is the values' to tell)."""
    whys, kinds = [], set()
    for r in sorted(roles):
        why = broken.get(r, form.why(r) if form is not None else None)
        if why is None and form is not None and form.local_at(r) is not None:
            why = KEPT
        if why is not None:
            whys.append(why)
            continue
        kind = form.kind(r) if form is not None else None
        if kind is None:
            kinds.add(MEAN)  # the same on every part: their shares recombine it
        elif r not in counted:
            kinds.add(kind)
    if whys or len(kinds) > 1:
        return min(whys) if whys else KINDS, None
    return None, kinds.pop() if kinds else None
