"""Bucketed gradient reduction over a stage's data × spatial ranks, overlapped with backward.

Why: Laanait et al. kept 0.93 efficiency at 27,600 GPUs by reducing gradients while backward still
runs. Micro-batches accumulate local gradients (layers' own reductions are off, see
:func:`hybridpar.comm.no_grad_sync`); during the *last* backward of the step, each bucket is
all-reduced as soon as its last gradient is accumulated, in a fixed bucket order on every rank.

Each parameter is scaled by ``split / n`` (``n`` ranks in the group, ``split`` shards contributing
partial gradients, see :func:`hybridpar.comm.reduce.reduce_gradients`), so one all-reduce sums over
shards and averages over data-parallel replicas.

A step reduces what its own backward adds, nothing else, so that ``.grad`` ends as torch leaves it:

* gradients left from before the step (accumulation over ``train_step`` calls, or zeros from
  ``zero_grad(set_to_none=False)``) are already reduced: :meth:`GradReducer.begin` takes them aside
  and :meth:`GradReducer.finish` adds them back to the reduced new ones (reducing them again would
  count them once per rank);
* the parameters that take part are those that require grad when the step starts (every rank runs
  the same user code, so the set is the same on all): a parameter frozen after the build gets no
  ``.grad`` (an optimizer would move it by momentum or weight decay), one unfrozen after it is summed
  over its shards. The buckets are made again only when that set changes;
* a trainable parameter without a local gradient takes part with zeros (the collective's shapes
  must match), and one that got no gradient on any rank ends as it was (``None``): each bucket
  carries a presence flag per parameter, read back (a host sync) only where a rank's own gradient
  was missing, and not while a CUDA graph is captured (zeros stay there).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from hybridpar.comm.reduce import grad_split, real_view
from hybridpar.device.cuda_graphs import capturing
from hybridpar.profiling import range as prange


class GradReducer:
    """All-reduces accumulated gradients of ``params`` over ``group`` in buckets of ~``bucket_bytes``.

    ``params``: every parameter of the stage, trainable or not when the engine is built; which of them
    take part is decided at each step (:meth:`begin`)."""

    def __init__(self, params: list[torch.nn.Parameter], group: dist.ProcessGroup,
                 bucket_bytes: int = 25 << 20) -> None:
        self.group = group
        self.n = dist.get_world_size(group)
        self.bucket_bytes = bucket_bytes
        self.params = list(params)
        self.live: tuple[int, ...] | None = None  # ids of the parameters the buckets were made of
        self.buckets: list[list[torch.nn.Parameter]] = []
        self.bucket_of: dict[int, int] = {}
        self._handles: dict[int, RemovableHandle] = {}
        self.stash: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self.armed = False
        self._reset()
        self._rebucket()

    def _rebucket(self) -> None:
        """Buckets of the parameters that require grad now; hooks on those not hooked yet (a hook on a
        parameter frozen since stays: it fires on no accumulation, and :meth:`_ready` skips it)."""
        params = [p for p in self.params if p.requires_grad]
        live = tuple(id(p) for p in params)
        if live == self.live:
            return
        self.live = live
        # Gradients arrive roughly last layer first: fill buckets in reverse order.
        self.buckets = []
        size = 0
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            if not self.buckets or (self.buckets[-1] and size + nbytes > self.bucket_bytes):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        for p in params:
            if id(p) not in self._handles:
                self._handles[id(p)] = p.register_post_accumulate_grad_hook(self._ready)
        self._reset()

    def _reset(self) -> None:
        self.count = [0] * len(self.buckets)
        self.pending: list[tuple[int, torch.Tensor, object, list[int]]] = []
        self.next = 0

    def begin(self) -> None:
        """A step starts (before its first backward): the buckets of the parameters that require grad
        now, and their gradients from before the step taken aside (see the module doc)."""
        self._rebucket()
        self._reset()
        self.armed = False
        self.stash = []
        for b in self.buckets:
            for p in b:
                if p.grad is not None:
                    self.stash.append((p, p.grad))
                    p.grad = None

    def abandon(self) -> None:
        """A step that failed: the gradients from before it go back as they were."""
        for p, old in self.stash:
            p.grad = old
        self.stash = []
        self.armed = False
        self._reset()

    def arm(self) -> None:
        """The next backward is the step's last: launch buckets as they fill."""
        self._reset()
        self.armed = True

    def _ready(self, p: torch.nn.Parameter) -> None:
        i = self.bucket_of.get(id(p))
        if not self.armed or i is None:
            return
        self.count[i] += 1
        while self.next < len(self.buckets) and self.count[self.next] == len(self.buckets[self.next]):
            self._launch(self.next)

    def _launch(self, i: int) -> None:
        bucket = self.buckets[i]
        missing = [j for j, p in enumerate(bucket) if p.grad is None]
        for j in missing:
            bucket[j].grad = torch.zeros_like(bucket[j])
        parts = [real_view(p.grad).reshape(-1) * (grad_split(p) / self.n) for p in bucket]
        # one presence flag per parameter: summed, zero only where no rank had a gradient of it
        flags = torch.ones(len(bucket), dtype=parts[0].dtype, device=parts[0].device)
        for j in missing:
            flags[j] = 0
        flat = torch.cat([*parts, flags])
        with prange("grad_reduce_launch", "grad_reduce"):
            work = dist.all_reduce(flat, group=self.group, async_op=True)
        self.pending.append((i, flat, work, missing))
        self.next = i + 1

    def finish(self) -> None:
        """Launch what has not been launched (in order), wait for all, write the results back, then
        add back the gradients taken aside by :meth:`begin`."""
        while self.next < len(self.buckets):
            self._launch(self.next)
        with prange("grad_reduce_wait", "grad_reduce"):
            for i, flat, work, missing in self.pending:
                work.wait()
                bucket = self.buckets[i]
                off = 0
                for p in bucket:
                    g = real_view(p.grad)  # a complex gradient travels as its real pairs
                    g.copy_(flat[off:off + g.numel()].view_as(g))
                    off += g.numel()
                if missing and not capturing(flat.device):  # a host sync: only where this rank had none
                    seen = flat[off:].tolist()
                    for j in missing:
                        if seen[j] == 0:
                            bucket[j].grad = None
        for p, old in self.stash:
            if p.grad is not None:
                old.add_(p.grad)  # in place, as autograd accumulates into an existing .grad
            p.grad = old
        self.stash = []
        self.armed = False
        self._reset()

