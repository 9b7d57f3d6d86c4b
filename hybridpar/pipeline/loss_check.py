"""Whether ``loss_fn`` splits the way the engine combines it: checked on a real step, once per loss.

Why: the engine never holds the whole output. It evaluates ``loss_fn`` on each rank's output shard,
on each micro-batch and on each data-parallel replica, and combines the values: shards weighted by
their share of the volume, micro-batches by their share of the batch, replicas averaged. That is the
whole output's loss only for a loss that averages over voxels and samples (torch's losses by
default). A sum (``reduction="sum"``) is the sum of its parts; any other loss (a masked mean, Dice, a
loss normalised by the target's variance, Pearson, differences between neighbouring voxels, a Fourier
term) has no combination of parts at all, and trained silently wrong (a sum x0.5 on two ranks, the
others off by 1e-3 to 40 %).

How: on the first micro-batch's output and target of every step (under no_grad, detached; every
step, as a masked or ``ignore_index`` loss may mask nothing in its first batches), each rank cuts what
it holds in two along every dim the engine cuts: each split spatial dim the shard has two voxels
along, and the batch where replicas or micro-batches cut it. It compares the loss of the whole (the
step's own value) with the parts' size-weighted mean and with their sum, and the same of the loss's
slope along a fixed random direction (its gradient in one number, where the value cannot tell: a scale
read off the values and detached, ``p.detach().std()``, multiplies the gradient and not the value).
The parts are views (``narrow``) of tensors the step holds: no copy of the volume, two loss
evaluations (and two of its gradient) per cut dim. A
part of one sample has no second sample to cut from: it is paired with a second one made of its first
half (along the first spatial dim it has two voxels along) tiled, then of its second, which counts its
labels, masked voxels, weights and extremes differently (a copy of one sample; :func:`pair`); without
such a dim it is doubled (``expand``), which tells a mean from a sum only. The ranks agree in one
all-gather of a few numbers over the stage (:func:`agree`), so a shard where the test tells nothing
(too thin, a zero loss, a non-finite value) follows the others and every rank decides alike: a mean,
a sum, or one line, the same on every rank, raised before any backward runs. What differs between
ranks, replicas or micro-batches but not between a rank's halves (a region of interest on one rank)
is :mod:`hybridpar.pipeline.loss_across`'s to find; its findings join these in the agreement, and so
do those of the loss's form (:mod:`hybridpar.pipeline.loss_form`), which decides what values leave
open: a normaliser that differs only at voxels no check reads.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from hybridpar.pipeline.form_algebra import REASONS

MEAN, SUM = "mean", "sum"
SPACE, BATCH = 0, 1  # the axes of a verdict: over the output's shards, over samples
DOUBLED = 1  # a finding's dim where one sample was doubled (the channels, never cut)
PAIRED = 5  # + the spatial dim (0-2), + 3 for the second half: a sample paired with a half of it tiled
ACROSS = 11  # pieces of several ranks or micro-batches taken together (:mod:`.loss_across`)
SLOPE = 20  # + a cut's dim: that cut of the loss's slope along a fixed direction, not of its value
FORM = 40  # the form of the loss's computation (:mod:`.loss_form`); + a reason where it fits neither
# per rank and axis: mean fits, sum fits, and the finding (dim, whole, parts' mean, parts' sum)
_NONE = (1.0, 1.0, -1.0, math.nan, math.nan, math.nan)  # nothing to tell: agrees with either


@dataclass(frozen=True)
class Verdict:
    """How the parts' losses combine along the shards (``space``) and the samples (``batch``)."""

    space: str = MEAN
    batch: str = MEAN


@dataclass(frozen=True)
class Finding:
    """What one rank found along one cut ``dim`` (0 the batch, 2-4 a spatial dim, -1 none;
    :data:`DOUBLED`: a batch of one sample doubled, ``whole`` the loss of the two; :data:`PAIRED` + d:
    a sample paired with a second, ``whole`` the loss of the pair)."""

    dim: int
    whole: float
    mean: float
    sum: float

    def fits(self, rtol: float) -> tuple[bool, bool]:
        """(mean fits, sum fits): both where the values tell nothing (nothing cut, a whole that is not
        finite, all zero), neither where the whole is finite and the parts are not (a difference
        between neighbours on a part one voxel thick, an empty mask)."""
        if self.dim < 0 or not math.isfinite(self.whole):
            return True, True
        if self.dim == ACROSS:  # pieces evaluated in float64 (:mod:`.loss_across`)
            rtol = min(rtol, rtol_of(torch.float64))
        if not (math.isfinite(self.mean) and math.isfinite(self.sum)):
            return False, False
        scale = max(abs(self.whole), abs(self.mean), abs(self.sum))
        return abs(self.whole - self.mean) <= rtol * scale, abs(self.whole - self.sum) <= rtol * scale


def rtol_of(dtype: torch.dtype) -> float:
    """How far a mean taken in two parts may stray from the one taken whole, in ``dtype``: rounding's
    reach, far below what a normalisation that differs between the parts moves (a count of ignored
    voxels one apart in a few hundred moved a float64 loss by 2e-6 and its gradient by 6e-4)."""
    return {torch.float64: 1e-10, torch.float32: 1e-4}.get(dtype, 1e-2)


def _cut(tree: Any, dim: int, pick: Callable[[torch.Tensor], bool], lo: int, n: int) -> Any:
    return tree_map(lambda t: t.narrow(dim, lo, n) if isinstance(t, torch.Tensor) and pick(t) else t, tree)


def evaluate(loss_fn: Callable, out: Any, y: Any) -> float:
    """The loss's value on views; on copies where the loss cannot take a view (``.view(-1)``)."""
    try:
        value = loss_fn(out, y)
    except RuntimeError:
        dense = functools.partial(tree_map, lambda t: t.contiguous() if isinstance(t, torch.Tensor) else t)
        value = loss_fn(dense(out), dense(y))
    return float(value.detach().double().reshape(()))


def cut_at(extent: int) -> int:
    """Where a part of ``extent`` is cut in two: near the middle, at an offset that is odd and no multiple
    of 3, so that a loss on a coarser grid of the output (pooled 2x2x2, every second or third voxel), which
    a shard starting at such an offset would see shifted, fits no mean or sum of its parts either."""
    fits = [k for k in range(1, extent) if k % 2 and k % 3]
    return min(fits, key=lambda k: abs(k - extent // 2)) if fits else extent // 2


def _halves(out: Any, y: Any, at: int, pick: Callable[[torch.Tensor], bool], extent: int) -> list[tuple]:
    """``out`` and ``y`` cut in two along dim ``at`` where :func:`cut_at` says: per part, its ``out``,
    its ``y`` and its (start, length)."""
    k = cut_at(extent)
    return [(_cut(out, at, pick, lo, n), _cut(y, at, pick, lo, n), (lo, n))
            for lo, n in ((0, k), (k, extent - k))]


def probe(loss_fn: Callable, out: Any, y: Any, whole: float, dim: int,
          pick: Callable[[torch.Tensor], bool], extent: int) -> Finding:
    """Cut every tensor of ``out`` and ``y`` that ``pick`` accepts in two along ``dim`` (of
    ``extent``; an extent of one doubled instead, the whole then being the doubled tensors) and
    compare the loss of the whole, ``whole``, with its parts' (cut where :func:`cut_at` says). A loss
    that raises on the parts (a window wider than a part) fits neither a mean nor a sum of them."""
    at = dim - 5 if dim >= 2 else dim  # a spatial dim counted from the end: a class-index target has no C
    try:
        if extent >= 2:
            (a, (_, k)), (b, _) = ((evaluate(loss_fn, o, t), part)
                                   for o, t, part in _halves(out, y, at, pick, extent))
            return Finding(dim, whole, (k * a + (extent - k) * b) / extent, a + b)
        double = functools.partial(tree_map, lambda t: t.expand(2, *t.shape[1:])
                                   if isinstance(t, torch.Tensor) and pick(t) else t)
        return Finding(DOUBLED, evaluate(loss_fn, double(out), double(y)), whole, 2 * whole)
    except (RuntimeError, ValueError, TypeError, IndexError):  # it takes the whole, not its parts (a window
        return Finding(dim if extent >= 2 else DOUBLED, whole, math.nan, math.nan)  # wider than a part)


def _directions(out: Any, pick: Callable[[torch.Tensor], bool]) -> list[torch.Tensor | None]:
    """Per leaf of ``out``: a fixed random tensor of its shape where ``pick`` accepts a floating one."""
    def one(t: Any) -> torch.Tensor | None:
        if not (isinstance(t, torch.Tensor) and t.is_floating_point() and pick(t)):
            return None
        g = torch.Generator(device=t.device).manual_seed(0)
        return torch.randn(t.shape, generator=g, device=t.device, dtype=torch.float64)
    return [one(t) for t in tree_leaves(out)]


def slope(loss_fn: Callable, out: Any, y: Any, directions: list[torch.Tensor | None]) -> float:
    """The loss's derivative at ``out`` along ``directions`` (:func:`_directions`, cut as ``out`` is):
    one number that combines over parts as the value does where the gradient does, which a term read
    off the values but not differentiated (``p.detach().std()`` scaling a gradient, ``(p - p.detach())
    * m``) does not, though its value does."""
    leaves, spec = tree_flatten(out)
    xs = [t.detach().requires_grad_() if r is not None else t
          for t, r in zip(leaves, directions, strict=True)]
    ins = [(x, r) for x, r in zip(xs, directions, strict=True) if r is not None]
    with torch.enable_grad():
        value = loss_fn(tree_unflatten(xs, spec), y)
        if not (isinstance(value, torch.Tensor) and value.requires_grad):
            return 0.0
        grads = torch.autograd.grad(value.reshape(()), [x for x, _ in ins], allow_unused=True)
    return float(sum(((g.double() * r).sum() for g, (_, r) in zip(grads, ins, strict=True) if g is not None),
                     torch.zeros((), dtype=torch.float64)))


def slope_probe(loss_fn: Callable, out: Any, y: Any, whole: float, dim: int,
                pick: Callable[[torch.Tensor], bool], extent: int, directions: list) -> Finding:
    """:func:`probe` of the loss's slope (:func:`slope`), ``whole`` the whole's, on a cut of two parts."""
    at = dim - 5 if dim >= 2 else dim
    try:
        (a, (_, k)), (b, _) = ((slope(loss_fn, o, t, [r if r is None else r.narrow(at, lo, n)
                                                      for r in directions]), (lo, n))
                               for o, t, (lo, n) in _halves(out, y, at, pick, extent))
    except (RuntimeError, ValueError, TypeError, IndexError):
        return Finding(-1, math.nan, math.nan, math.nan)
    return Finding(SLOPE + dim, whole, (k * a + (extent - k) * b) / extent, a + b)


def pair(loss_fn: Callable, out: Any, y: Any, whole: float, d: int, half: int) -> list[Finding]:
    """A batch of one sample, ``out`` and ``y``, paired with a second sample made of its first
    (``half`` 0) or second half along spatial dim ``d`` tiled to its extent (its labels, masked voxels
    and class weights counted otherwise), compared with the two samples' losses: a loss that averages (or
    sums) over samples fits, one normalised over the batch (class-weighted cross entropy,
    ``ignore_index``, a batch's variance) does not, while a sample taken twice (:data:`DOUBLED`) passes
    any such normalisation. Both halves are tried: a term of the batch's extreme (``out.amax()``) is
    the same for a pair made of the half that holds it. Volumes of the sample's spatial extent are
    tiled, other per-sample tensors taken twice, the rest left whole."""
    box = next(tuple(t.shape[-3:]) for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.dim() == 5)
    extent, k = box[d], box[d] // 2
    volume = lambda t: isinstance(t, torch.Tensor) and t.dim() >= 4 and tuple(t.shape[-3:]) == box  # noqa: E731
    sample = lambda t: isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == 1  # noqa: E731

    def second(t: Any) -> Any:
        if not (sample(t) and volume(t)):
            return t
        if half == 0:  # k and extent - k >= k voxels of the first half's start
            return torch.cat([t.narrow(d - 3, 0, k), t.narrow(d - 3, 0, extent - k)], d - 3)
        rest = t.narrow(d - 3, k, extent - k)  # extent - k and k of the second half's start
        return torch.cat([rest, rest.narrow(d - 3, 0, k)], d - 3)

    both = functools.partial(tree_map, lambda a, b: torch.cat([a, b]) if sample(a) else a)
    try:
        other_out, other_y = tree_map(second, out), tree_map(second, y)
        other = evaluate(loss_fn, other_out, other_y)
        together = evaluate(loss_fn, both(out, other_out), both(y, other_y))
        ways = _directions(out, sample)  # and the slopes, the same direction on each sample
        one, two = slope(loss_fn, out, y, ways), slope(loss_fn, other_out, other_y, ways)
        paired = slope(loss_fn, both(out, other_out), both(y, other_y),
                       [r if r is None else torch.cat([r, r]) for r in ways])
    except (RuntimeError, ValueError, TypeError, IndexError):
        return [Finding(-1, math.nan, math.nan, math.nan)]
    dim = PAIRED + d + 3 * half
    return [Finding(dim, together, (whole + other) / 2, whole + other),
            Finding(SLOPE + dim, paired, (one + two) / 2, one + two)]


def findings(loss_fn: Callable, out: Any, y: Any, loss: torch.Tensor, split_dims: list[int],
             batch_cut: bool) -> tuple[list[Finding], list[Finding]]:
    """This rank's findings along the shards' split dims (``split_dims``, spatial: 0-2) and, where
    ``batch_cut`` (replicas or micro-batches cut the batch), along the samples.

    Volumes (N, C, D, H, W, or N, D, H, W class indices) of the shard's extent are cut along space, the
    target with them where it is such a volume; every tensor with the micro-batch's samples is cut
    along the batch. Whole values (a head's (N, 4), a gathered volume) go to each part whole, as each
    shard's loss reads them."""
    if loss.numel() != 1:
        return [], []
    whole = float(loss.detach().double().reshape(()))
    leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    volume = next((t for t in leaves if t.dim() == 5), None)
    rng = [loss.device] if loss.device.type == "cuda" else []
    space: list[Finding] = []
    batch: list[Finding] = []
    with torch.no_grad(), torch.random.fork_rng(devices=rng):  # a random loss draws what it would anyway
        out, y = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, (out, y))
        if volume is not None:
            box = tuple(volume.shape[2:])
            split = lambda t: t.dim() in (4, 5) and tuple(t.shape[-3:]) == box  # noqa: E731
            cuts = [d for d in split_dims if box[d] >= 2]
            space = [probe(loss_fn, out, y, whole, 2 + d, split, box[d]) for d in cuts]
            if cuts:  # the gradient, too: a term of values read but not differentiated splits otherwise
                ways = _directions(out, split)
                at = _slope_or_none(loss_fn, out, y, ways)
                space += [] if at is None else [slope_probe(loss_fn, out, y, at, 2 + d, split, box[d], ways)
                                                for d in cuts]
        samples = y.shape[0] if isinstance(y, torch.Tensor) and y.dim() > 0 else None
        if batch_cut and samples:
            per_sample = lambda t: t.dim() > 0 and t.shape[0] == samples  # noqa: E731
            long = [d for d in range(3) if volume is not None and volume.shape[2 + d] >= 2]
            if samples == 1 and long:  # a one-sample part: paired (a sample doubled passes any count)
                found = [pair(loss_fn, out, y, whole, long[0], half) for half in (0, 1)]
                batch = [f[0] for f in found] + [f[1] for f in found if len(f) > 1]  # values named first
            else:
                batch = [probe(loss_fn, out, y, whole, 0, per_sample, samples)]
                ways = _directions(out, per_sample)
                if samples >= 2 and (at := _slope_or_none(loss_fn, out, y, ways)) is not None:
                    batch.append(slope_probe(loss_fn, out, y, at, 0, per_sample, samples, ways))
    return space, batch


def _slope_or_none(loss_fn: Callable, out: Any, y: Any, directions: list) -> float | None:
    try:
        return slope(loss_fn, out, y, directions)
    except (RuntimeError, ValueError, TypeError, IndexError):
        return None


def agree(space: list[Finding], batch: list[Finding], rtol: float, group: dist.ProcessGroup | None,
          device: torch.device) -> tuple[Verdict, tuple[int, Finding] | None]:
    """The verdict every rank of ``group`` reaches from all ranks' findings (one all-gather of a few
    numbers, on ``device``, the group's), and where it is a refusal, the axis and the finding it names
    (the first rank's that fits neither, else the first that does not fit the mean): alike on every rank."""
    rows = torch.tensor([_row(space, rtol), _row(batch, rtol)], dtype=torch.float64)
    if group is not None and dist.get_world_size(group) > 1:
        gathered = [torch.empty_like(rows, device=device) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, rows.to(device), group=group)
        rows = torch.stack(gathered).cpu()
    else:
        rows = rows.unsqueeze(0)
    kinds: list[str] = []
    for axis in (SPACE, BATCH):
        mean_ok, sum_ok = bool(rows[:, axis, 0].all()), bool(rows[:, axis, 1].all())
        if mean_ok or sum_ok:
            kinds.append(MEAN if mean_ok else SUM)
            continue
        neither = [r for r in rows[:, axis] if not (r[0] or r[1])]
        neither.sort(key=lambda r: bool(r[2] >= FORM))  # what values showed, before what the form says
        r = (neither or [r for r in rows[:, axis] if not r[0]])[0].tolist()
        return Verdict(), (axis, Finding(int(r[2]), *r[3:]))
    return Verdict(*kinds), None


def _row(found: list[Finding], rtol: float) -> list[float]:
    """One axis of this rank: whether every cut fits a mean, a sum, and the first cut that fits
    neither, else the first that does not fit the mean (nothing cut: both fit)."""
    fits = [f.fits(rtol) for f in found]
    mean_ok, sum_ok = all(m for m, _ in fits), all(s for _, s in fits)
    worst = next((f for f, (m, s) in zip(found, fits, strict=True) if not (m or s)), None)
    worst = worst or next((f for f, (m, _) in zip(found, fits, strict=True) if not m), None)
    if worst is None:
        return [float(mean_ok), float(sum_ok), *_NONE[2:]]
    return [float(mean_ok), float(sum_ok), float(worst.dim), worst.whole, worst.mean, worst.sum]


def name_of(fn: Callable) -> str:
    """A loss function as its user wrote it: ``F.mse_loss``'s name, a lambda's place, a module's class."""
    if isinstance(fn, functools.partial):
        return f"partial({name_of(fn.func)})"
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    if name.endswith("<lambda>") and code is not None:
        return f"{name} ({code.co_filename}:{code.co_firstlineno})"
    return name


def described(axis: int, found: Finding) -> str:
    """What a cut found, in words: the loss of the whole against its parts' mean and sum."""
    if found.dim >= FORM:
        what = "the output's values" if axis == SPACE else "the samples' values"
        return f"by what it computes, it {REASONS[found.dim - FORM].replace('them', what, 1)}"
    if found.dim >= SLOPE:
        inner = described(axis, Finding(found.dim - SLOPE, found.whole, found.mean, found.sum))
        return f"its gradient differs from its value's: the loss's slope along a fixed direction, {inner}"
    if found.dim == ACROSS:
        whole, parts = (("a few voxels of every output shard taken together", "each shard's")
                        if axis == SPACE else
                        ("a few voxels of every replica's and micro-batch's samples taken together",
                         "each one's"))
    elif found.dim >= PAIRED:
        half, d = divmod(found.dim - PAIRED, 3)
        whole, parts = (f"a sample paired with its {('first', 'second')[half]} half along {'DHW'[d]} tiled",
                        "the two samples")
    else:
        whole, parts = {0: ("a micro-batch", "its two parts (samples)"),
                        DOUBLED: ("a sample taken twice", "each copy")}.get(
            found.dim, ("an output shard", f"its two parts along {'DHW'[found.dim - 2]}"))
    if not (math.isfinite(found.mean) or math.isfinite(found.sum)):
        return f"on {whole} it is {found.whole:.6g}, on {parts} it raises or is not finite"
    p = next((p for p in (6, 9, 12) if f"{found.whole:.{p}g}" != f"{found.mean:.{p}g}"), 15)  # shown apart
    return (f"on {whole} it is {found.whole:.{p}g}, on {parts} {found.mean:.{p}g} as their size-weighted "
            f"mean and {found.sum:.{p}g} as their sum")


def refusal(loss_fn: Callable, axis: int, found: Finding) -> str:
    """The one line every rank raises for a loss that does not split over the samples (see module doc):
    the values found, what fits, what to do. One that does not split over the output's shards is
    evaluated on the whole output instead (:mod:`hybridpar.pipeline.loss_whole`)."""
    return (f"Engine.train_step: loss_fn {name_of(loss_fn)} does not split as the engine combines it: "
            f"{described(axis, found)}; the engine evaluates loss_fn on each micro-batch and data-parallel "
            f"replica and combines the values, which is exact for a loss that averages (or sums) over "
            f"samples, e.g. F.mse_loss, F.l1_loss or F.cross_entropy with reduction 'mean' or 'sum'; a loss "
            f"over the whole batch (normalised or correlated across samples, a class-weighted or "
            f"ignore_index mean over the batch's voxels) does not split over data-parallel replicas or "
            f"micro-batches: use grid.data 1 and pipeline.microbatches 1, or a per-sample loss")


def whole_notice(loss_fn: Callable, found: Finding, ranks: int, mib: float) -> str:
    """What rank 0 says once where the output is gathered for the loss (:mod:`.loss_whole`)."""
    return (f"Engine.train_step: loss_fn {name_of(loss_fn)} is no mean or sum over voxels "
            f"({described(SPACE, found)}): it is evaluated on the whole output and target, gathered on "
            f"each of the {ranks} ranks that share them ({mib:.1f} MiB per rank), exactly as in one "
            f"process; a loss that averages or sums over voxels (F.mse_loss, F.cross_entropy) runs on the "
            f"shards without the gather")


def encode(refused: tuple[int, Finding] | None) -> torch.Tensor:
    """A refusal as numbers, for the stages that did not compute the loss: -inf where there is none,
    so that a MAX over all ranks gives the loss stage's (its ranks agreed on one)."""
    if refused is None:
        return torch.full((6,), -math.inf, dtype=torch.float64)
    axis, f = refused
    return torch.tensor([1.0, axis, f.dim, f.whole, f.mean, f.sum], dtype=torch.float64)


def decode(t: torch.Tensor) -> tuple[int, Finding] | None:
    """The refusal :func:`encode` wrote, or None."""
    if not t[0] > 0:
        return None
    return int(t[1]), Finding(int(t[2]), float(t[3]), float(t[4]), float(t[5]))


_KINDS = ("a tensor", "a tuple", "a list", "a dict", "a Python number", "None", "an object that is no tensor")
_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
RETURNED = 11  # the numbers of a description (:func:`returned`): kind, dtype, length or ndim, 8 dims


def returned(value: Any) -> list[float] | None:
    """What ``loss_fn`` returned, as numbers every rank can be told (:func:`told`), where it is no
    scalar floating tensor (0-d or one element); None where it is one.

    Why: the engine weighs, sums and differentiates the value: a tuple or dict (a total and its terms)
    failed deep inside the check, and on a pipeline the other stages waited for a gradient until the
    transport's timeout."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and value.is_floating_point():
            return None
        dtype = float(_DTYPES.index(value.dtype)) if value.dtype in _DTYPES else -1.0
        dims = [float(n) for n in value.shape[:8]]
        return [0.0, dtype, float(value.dim()), *dims, *[-1.0] * (8 - len(dims))]
    kinds = (tuple, list, dict, (int, float), type(None))
    kind = next((i + 1 for i, k in enumerate(kinds) if isinstance(value, k)), len(_KINDS) - 1)
    length = float(len(value)) if isinstance(value, (tuple, list, dict)) else -1.0
    return [float(kind), -1.0, length, *[-1.0] * 8]


def told(description: list[float] | None) -> torch.Tensor:
    """A description (:func:`returned`) for an all-reduce MAX: -inf where there is none, so the loss
    stage's is what every rank gets (its ranks' differing shapes, if any, taken dim by dim the largest)."""
    if description is None:
        return torch.full((RETURNED + 1,), -math.inf, dtype=torch.float64)
    return torch.tensor([1.0, *description], dtype=torch.float64)


def untold(t: torch.Tensor) -> list[float] | None:
    """The description :func:`told` wrote, or None."""
    return t[1:].tolist() if t[0] > 0 else None


def returned_line(loss_fn: Callable, description: list[float]) -> str:
    """The one line every rank raises for a loss that returned no scalar: what it returned, what fits."""
    kind, dtype, n, *dims = (int(v) for v in description)
    what = _KINDS[kind]
    if kind == 0:
        shape = tuple(dims[:min(n, 8)])
        what = (f"a tensor of shape {shape}{' (more dims not shown)' if n > 8 else ''} and dtype "
                f"{_DTYPES[dtype] if dtype >= 0 else 'another'}")
    elif n >= 0:
        what = f"{what} of {n} item{'s' if n != 1 else ''}"
    return (f"Engine.train_step: loss_fn {name_of(loss_fn)} returned {what}; the engine weighs, combines and "
            f"differentiates the loss, so loss_fn must return a scalar tensor (0-d or one element, floating "
            f"point): return the sum of your terms, and log the terms outside train_step")
