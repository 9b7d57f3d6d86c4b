"""What each failure of a training run says, in one line, and which exit code it gets.

Why a module of its own: the loop (:mod:`cosmoflow.trainer`) should read as a loop. Here are the
messages that make a failure actionable (a resume with another model names the keys that differ; a NaN
loss names its batch's files and the newest good checkpoint) and the split of failures into
configuration errors (exit 2: fix the command line) and runtime faults (exit 1), which
:func:`hybridpar.process.failure.report` prints once per job.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

import hybridpar as hp
from cosmoflow.config import ConfigError
from cosmoflow.data import CosmoDataset
from cosmoflow.validate import DataError
from hybridpar.checkpoint import Checkpointer
from hybridpar.checkpoint.format import CheckpointError
from hybridpar.comm import liveness
from hybridpar.data import WorkerError
from hybridpar.process import failure


class Stop(Exception):
    """The run ends early (NaN loss); the message says why."""


class IncompatibleCheckpoint(ConfigError):
    """The run directory's checkpoint holds another model than this config builds."""


def _differences(shapes: dict[str, tuple[int, ...]], saved: dict[str, Any]) -> list[str]:
    """The keys in which a saved state dict differs from a model's (a few of each kind, and how many)."""
    have = {k: tuple(v.shape) for k, v in saved.items() if hasattr(v, "shape")}
    wrong = [f"{k} {have[k]} saved, {shapes[k]} now" for k in shapes if k in have and have[k] != shapes[k]]
    parts = []
    missing, unexpected = sorted(set(shapes) - set(have)), sorted(set(have) - set(shapes))
    for what, keys in (("shape mismatches", wrong), ("missing from the file", missing),
                       ("unexpected (not in this model)", unexpected)):
        if keys:
            more = f", and {len(keys) - 3} more" if len(keys) > 3 else ""
            parts.append(f"{len(keys)} {what} ({'; '.join(keys[:3])}{more})")
    return parts


def check_resumable(shapes: dict[str, tuple[int, ...]], saved: dict[str, Any], where: str) -> None:
    """Raise :class:`IncompatibleCheckpoint` naming the keys that differ (a few, and how many), instead of
    torch's one ``size mismatch`` line per tensor."""
    parts = _differences(shapes, saved)
    if parts:
        raise IncompatibleCheckpoint(
            f"cannot resume: {where} holds another model than this config builds: {'; '.join(parts)}. The "
            f"model settings changed since it was saved; start afresh with --set checkpoint.resume=false "
            f"or use a new run_dir")


def check_initial(shapes: dict[str, tuple[int, ...]], saved: dict[str, Any], where: str) -> None:
    """As :func:`check_resumable`, for the weights ``model.init_from`` names."""
    parts = _differences(shapes, saved)
    if parts:
        raise ConfigError(f"model.init_from: {where} holds another model than this config builds: "
                          f"{'; '.join(parts)}")


def check_loadable(shapes: dict[str, tuple[int, ...]], saved: dict[str, Any], where: str) -> None:
    """As :func:`check_resumable`, for inference: the run's config must build the model ``where`` holds."""
    parts = _differences(shapes, saved)
    if parts:
        raise IncompatibleCheckpoint(f"{where} holds another model than the run's config builds: "
                                     f"{'; '.join(parts)}")


def newest_checkpoint(ckpt: Checkpointer) -> str:
    """"step N in DIR" for the newest complete checkpoint (waiting for a save in flight), or none."""
    try:
        ckpt.wait()
    except Exception:  # a failed save: the newest complete one is still named below
        pass
    step = ckpt.latest()
    return f"step {step} in {ckpt.root}" if step is not None else f"none yet (in {ckpt.root})"


def diverged(value: float, step: int, epoch: int, ds: CosmoDataset, indices: list[int], ckpt: Checkpointer,
             bad_input: bool) -> Stop:
    """The stop for a non-finite loss of ``step`` (counted from 1, as the progress line counts; ``epoch``:
    the epochs done before it): the step, the files of its batch (every data replica's: a
    collective), the newest good checkpoint, and what to try (the data if the batch held non-finite
    values, the learning rate otherwise)."""
    mine = [ds.describe(i) for i in indices]
    files = mine
    if dist.is_initialized() and dist.get_world_size() > 1:
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        files = list(dict.fromkeys(d for part in every for d in part))
    more = f" and {len(files) - 4} more" if len(files) > 4 else ""
    hint = ("the batch holds non-finite values: check the data (python -m cosmoflow.check)" if bad_input
            else "the batch's values are finite: lower optimizer.base_lr")
    return Stop(f"loss is {value} at step {step} (epoch {epoch + 1}) on the batch of {'; '.join(files[:4])}"
                f"{more}; stopping. The newest good checkpoint: {newest_checkpoint(ckpt)}; {hint}")


def note_skipped(new: list[str], seen: set[str]) -> None:
    """Move the bad samples a loader skipped (``new``) into ``seen``; warn at the first, once per job."""
    if new and not seen and failure.first("skip_bad"):
        print(f"warning: data.skip_bad: skipping bad samples (counted in the summary); the first: {new[0]}",
              file=sys.stderr, flush=True)
    seen.update(new)
    new.clear()


def skipped_everywhere(mine: set[str]) -> int:
    """How many distinct bad samples the ranks skipped (a spatial group's ranks skip the same ones)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return len(mine)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, sorted(mine))
    return len({s for part in every for s in part})


_FAULTS = (Stop, DataError, CheckpointError, liveness.CollectiveTimeout)
"""Failures of a running job (exit 1); checked before the configuration errors, of which ValueError is
the widest."""
_CONFIG_ERRORS = (ConfigError, hp.SpecError, FileNotFoundError, ValueError)


def failure_line(err: BaseException) -> tuple[str, int]:
    """The one line that reports ``err``, and the exit code (see :mod:`hybridpar.process.failure`)."""
    if isinstance(err, WorkerError) and err.original is not None:
        err = err.original  # a loader worker's error, reported as if read here
    if liveness.is_timeout(err):
        err = liveness.explain(err)  # which operation waited, and which ranks stopped answering
    if isinstance(err, _FAULTS):
        return f"error: {err}", failure.RUNTIME_FAULT
    if isinstance(err, _CONFIG_ERRORS):
        return f"error: {err}", failure.CONFIG_ERROR
    tb = "".join(traceback.format_exception(err)).rstrip()  # a bug: its traceback, printed once
    return f"error: {type(err).__name__}: {err}\n{tb}", failure.RUNTIME_FAULT


def run_job(job: Callable[[], None]) -> int:
    """Run an entry point's ``job`` (training, inference) and return its exit status: 0, or its failure
    reported once per job as :func:`failure_line` says; the process group is torn down either way."""
    try:
        job()
    except Exception as err:
        return failure.report(*failure_line(err))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
