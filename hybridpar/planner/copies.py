"""Tensors that in one process would be views of a split activation but in a forward run by module
swapping are copies: a box of slices (``h[:, :, a:b]``), a view of a volume gathered for a call. The
:class:`~hybridpar.planner.layout_watch.LayoutWatch` keeps one :class:`Copies`.

Why: a write through a view reaches its source in one process, and a read of a view sees a write into
its source; a copy does neither. So a copy read after its source was written in place is refused, and
a copy written in place must be written back into its source before the source is read again: Python's
augmented assignment on a box (``h[:, :, a:b] += 2``: take the box, add in place, write it back, all on
one line) does exactly that, and runs; ``v = h[:, :, a:b]; v += 2`` alone does not, and is refused.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from hybridpar.planner import calls
from hybridpar.user_lines import caller

VIEW = "in one process a view, which would see the write; here a copy"
# a reshape one process copies (h.permute(...).reshape(n, -1)), which a run makes again from its source
REMADE = "in one process a copy, which keeps the values before the write; here made again from its source"


class Copies:
    """The copies taken (-> what each is and its source's id), those whose source was written in place
    since (-> what each is), and those written in place but not yet back into their source (-> the
    refusal, should none follow, and the line of the write)."""

    def __init__(self) -> None:
        self.taken, self.stale, self.why = WeakIdKeyDictionary(), WeakIdKeyDictionary(), WeakIdKeyDictionary()
        # held, not weakly: a copy written and dropped (h.narrow(2, 1, 3).mul_(2)) is refused at the end
        self.pending: dict[int, tuple[torch.Tensor, str, str]] = {}

    def take(self, t: torch.Tensor, what: str, source: torch.Tensor | None, why: str = VIEW) -> None:
        """``t`` is ``what``, taken of ``source``; ``why``: what a read of it after ``source`` is written in
        place would get wrong."""
        self.taken[t] = (what, None if source is None else id(source))
        if why != VIEW:
            self.why[t] = why

    def before(self, name: str, tensors: list[torch.Tensor], written: torch.Tensor | None,
               value: object) -> list[str]:
        """What the call ``name`` on ``tensors`` (writing ``written`` in place, if any; ``value`` its
        third argument, what a ``__setitem__`` writes) breaks."""
        unsafe: list[str] = []  # the caller's line is read only where needed: it walks the stack
        if (stale := [t for t in tensors if t in self.stale]) and name not in calls.SAFE:
            unsafe.append(f"{name} of {self._stale(stale[0])} at {caller()}")
        if name == "__setitem__" and id(value) in self.pending and self.taken[value][1] == id(written) \
                and self.pending[id(value)][2] == caller():  # written back, as augmented assignment
            del self.pending[id(value)]
        if read := [why for t in tensors for _, why, _ in self._reading(t)]:
            unsafe.append(read[0])  # the source read before the copy was written back
        if written is not None and written in self.taken:
            what, line = self.taken[written][0], caller()
            self.pending[id(written)] = (written, f"{name} (writes in place into {what}, which the split "
                                         f"activation does not share, and no write of it back follows; write "
                                         f"into it, h[:, :, a:b] += 2) at {line}", line)
        if written is not None:  # what was taken of it before (a box, a view gathered) no longer matches
            self.stale.update((c, what) for c, (what, source) in list(self.taken.items())
                              if source == id(written))
        return unsafe

    def after(self, copied: list[tuple[str, int | None]], out: object) -> None:
        """A view of a copy (``copied``: what the call's inputs were) is one too."""
        if copied:
            self.taken.update((t, copied[0]) for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                              and t._is_view())

    def layer_reads(self, layer: str, inputs: list[torch.Tensor], in_place: bool) -> list[str]:
        """What a layer reading ``inputs`` (writing the first in place: ``ReLU(inplace=True)``) breaks: a
        copy written in place since it was taken, a copy written, a source not yet written back."""
        unsafe = []
        if stale := [a for a in inputs if a in self.stale]:
            unsafe.append(f"{layer} on {self._stale(stale[0])}")
        unsafe += [why for a in inputs for _, why, _ in self._reading(a)][:1]
        if in_place and inputs:
            unsafe += self.layer_wrote(f"{layer}(inplace=True)", inputs[0])
        return unsafe

    def layer_wrote(self, layer: str, t: torch.Tensor) -> list[str]:
        """What a layer writing its input ``t`` in place (said, or seen by its version counter) breaks: a
        copy written; and what was taken of ``t`` no longer matches it."""
        unsafe = [f"{layer} writing {self.taken[t][0]}, which the split activation does not share"] \
            if t in self.taken else []
        self.stale.update((c, what) for c, (what, source) in list(self.taken.items()) if source == id(t))
        return unsafe

    def _stale(self, t: torch.Tensor) -> str:
        return f"{self.stale[t]}, written in place since ({self.why.get(t, VIEW)})"

    def _reading(self, t: torch.Tensor) -> list[tuple[torch.Tensor, str, str]]:
        """The copies written in place, not yet back, whose source ``t`` is."""
        return [p for p in self.pending.values() if self.taken[p[0]][1] == id(t)]

    def unsettled(self) -> list[str]:
        """The copies written in place that the forward never wrote back (said at its end), forgotten."""
        left, self.pending = [why for _, why, _ in self.pending.values()], {}
        return left
