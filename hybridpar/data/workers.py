"""Reader processes that prefetch batches while the model computes.

Why processes and not threads: h5py holds one global lock, so reader threads take turns; separate
processes read in parallel. Each worker unpickles its own copy of the dataset, which opens its files
lazily inside the worker (h5py handles cannot cross a fork). Batches come back through
``torch.multiprocessing`` queues, which move tensor storage through shared memory rather than
copying it through a pipe.

Tasks carry a *generation*: when an iteration stops early (``break``, an exception) and a new one
begins, unread tasks are withdrawn and late results of the old generation are dropped, so the pool
can be reused without restarting processes. Workers exit on a sentinel, and also on their own when
the parent process disappears, so a crashed trainer leaves no orphans.

Workers start by ``forkserver`` where the platform has it (as Python 3.14 does by default), not by
``fork``: a trainer is multi-threaded by the time it reads (the process group's threads, a heartbeat,
other loaders' receivers), and a thread of a C library that takes a Python thread state while the
trainer forks (gloo's, dropping a finished transfer's tensors) leaves CPython's thread-state lock held
in the child, which then hangs inside ``fork`` before it runs a line. The server forks from a clean
process that preloaded torch, h5py and the dataset's module, so a worker still starts in milliseconds.

A receiver thread in the trainer takes results off the queue as they arrive. Rebuilding a batch
from shared memory (receiving its file descriptors, mapping the storage) is work of the trainer's
process; done when asked for, it would count as data wait. The thread does it while the main thread
computes or waits for the network.
"""

from __future__ import annotations

import os
import pickle
import queue
import threading
import time
import traceback
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

import torch
import torch.multiprocessing as tmp

from hybridpar.data.dataset import Region, read_batch, read_stored_into, take_skipped
from hybridpar.data.host_slots import HostSlots

_POLL_S = 0.5


class SlotRef(NamedTuple):
    """A batch a worker wrote into host slot ``slot`` (its first ``n`` samples): what crosses the queue
    instead of the batch itself (:mod:`~hybridpar.data.host_slots`)."""

    slot: int
    n: int


def _free_slot(free, parent: int) -> int | None:
    """A free slot's number, waited for; None when the pool closes or the trainer is gone."""
    while True:
        try:
            return free.get(timeout=_POLL_S)
        except queue.Empty:
            if not _alive(parent):
                return None


def _worker_main(payload: bytes, region: Region | None, tasks, results, parent: int, stored: bool,
                 slots: list[torch.Tensor] | None = None, free=None) -> None:
    """Loop of one worker: read the batches named on ``tasks`` and put them on ``results`` (with
    ``slots``: write each into a free slot and put its :class:`SlotRef`)."""
    torch.set_num_threads(1)  # stacking a batch needs no thread pool; the trainer owns the cores
    try:
        dataset = pickle.loads(payload)
    except Exception:
        results.put(("fatal", -1, -1, traceback.format_exc()))
        return
    seen = getattr(dataset, "bytes_read", None)
    while True:
        try:
            task = tasks.get(timeout=_POLL_S)
        except queue.Empty:
            if not _alive(parent):  # the trainer died without closing us
                return
            continue
        if task is None:
            return
        generation, k, indices = task
        slot = None
        if slots is not None:
            slot = _free_slot(free, parent)
            if slot is None:
                return
        try:
            if slot is not None:
                # the targets as numpy: a tensor would cross in a shared-memory segment of its own
                y = read_stored_into(dataset, indices, region, slots[slot]).numpy()
                x = SlotRef(slot, len(indices))
            else:
                # Into shared memory here, not in the queue's feeder thread: a full /dev/shm must come
                # back as an error, not leave the trainer waiting for a batch that was dropped.
                x, y = read_batch(dataset, indices, region, shared=True, stored=stored)
                x.share_memory_()  # no-op unless the batch was empty
                y.share_memory_()
        except Exception as err:
            if slot is not None:
                free.put(slot)
            results.put(("error", generation, k, (traceback.format_exc(), _portable(err))))
            seen = getattr(dataset, "bytes_read", None)
            continue
        now = getattr(dataset, "bytes_read", None)
        nbytes = now - seen if isinstance(now, int) and isinstance(seen, int) else 0
        seen = now
        results.put(("ok", generation, k, (x, y, nbytes, take_skipped(dataset))))


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (a forkserver's child is not its trainer's child)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def context(start_method: str | None, dataset: object) -> object:
    """The multiprocessing context workers start in: ``start_method`` if given, else ``forkserver``
    (preloading what every worker imports) where the platform has it, else its default."""
    if start_method is not None or "forkserver" not in tmp.get_all_start_methods():
        return tmp.get_context(start_method)
    ctx = tmp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "h5py", "hybridpar.data.workers", type(dataset).__module__])
    return ctx


def _portable(err: BaseException) -> BaseException | None:
    """``err`` if it survives pickling (to cross to the trainer), else None."""
    try:
        return pickle.loads(pickle.dumps(err))
    except Exception:
        return None


class WorkerError(RuntimeError):
    """A reader process failed; the message carries its traceback, ``original`` the exception itself
    (None if it could not cross processes), so that a caller can report it as if read in-process."""

    def __init__(self, message: str, original: BaseException | None = None) -> None:
        super().__init__(message)
        self.original = original


class WorkerPool:
    """``workers`` processes reading batches of one dataset region; results handed out in order.

    ``stored``: the workers read the stored form (:class:`~hybridpar.data.dataset.StoredForm`).
    ``on_arrival(x, y)``, if given, runs in the receiver thread on every batch of the current
    generation as it arrives (the device stage: :mod:`~hybridpar.data.device_stage`); what it
    returns is what :meth:`get` hands out in place of ``x`` and ``y``. With ``slots``
    (:class:`~hybridpar.data.host_slots.HostSlots`, which the pool then owns) the workers write the
    stored form into those buffers, and ``on_arrival`` must have copied ``x`` out when it returns:
    the buffer goes back to the workers right after.
    """

    def __init__(self, dataset: object, region: Region | None, workers: int,
                 start_method: str | None = None, stored: bool = False,
                 on_arrival: Callable[[torch.Tensor, torch.Tensor], tuple[object, object]] | None = None,
                 slots: HostSlots | None = None) -> None:
        try:
            payload = pickle.dumps(dataset)
        except Exception as err:
            raise TypeError(
                f"the dataset must pickle to be sent to loader worker processes ({err}); open files "
                f"lazily inside read() and leave handles out of __getstate__, or use workers=0"
            ) from err
        ctx = context(start_method, dataset)
        self._tasks = ctx.Queue()
        self._results = ctx.Queue()
        self._generation = 0
        self._ready: dict[Hashable, tuple[str, object]] = {}  # key -> ("ok", batch) | ("error", tb)
        self._failure: str | None = None  # a fatal worker error, or a result that could not be rebuilt
        self._cond = threading.Condition()
        self._closed = self._stopping = False
        self._on_arrival = on_arrival
        self._slots = slots
        self._free = None
        if slots is not None:
            self._free = ctx.Queue()
            for i in range(len(slots.buffers)):
                self._free.put(i)
        self._procs = [
            ctx.Process(target=_worker_main, name=f"hybridpar-loader-{i}", daemon=True,
                        args=(payload, region, self._tasks, self._results, os.getpid(), stored,
                              None if slots is None else slots.buffers, self._free))
            for i in range(workers)]
        for p in self._procs:
            p.start()
        self._receiver = threading.Thread(target=self._receive, name="hybridpar-loader-receiver", daemon=True)
        self._receiver.start()

    def _receive(self) -> None:
        """Move results from the queue into ``_ready`` until the pool stops (see the module doc)."""
        while not self._stopping:
            try:
                kind, gen, j, body = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            except (OSError, EOFError, ValueError):  # the queue was closed under us
                return
            except Exception:
                with self._cond:
                    if not self._stopping:
                        self._failure = f"a batch could not be received:\n{traceback.format_exc()}"
                    self._cond.notify_all()
                continue
            if kind == "ok" and isinstance(body[0], SlotRef):
                kind, body = self._from_slot(gen, body)
            elif kind == "ok" and self._on_arrival is not None and gen == self._generation:
                kind, body = self._arrived(body)
            with self._cond:
                if kind == "fatal":
                    self._failure = f"a loader worker could not unpickle the dataset:\n{body}"
                elif gen == self._generation:  # else a late result of an abandoned iteration
                    self._ready[j] = (kind, body)
                self._cond.notify_all()

    def _from_slot(self, gen: int, body: tuple) -> tuple[str, object]:
        """A batch written into a host slot: moved out by ``on_arrival`` (or copied), the slot freed."""
        ref, y, nbytes, skipped = body
        try:
            if gen != self._generation:
                return "ok", None  # a late result of an abandoned iteration: dropped below
            x = self._slots.buffers[ref.slot][:ref.n]  # type: ignore[union-attr]
            y = torch.from_numpy(y)
            if self._on_arrival is None:
                return "ok", (x.clone(), y, nbytes, skipped)
            return self._arrived((x, y, nbytes, skipped))
        finally:
            self._free.put(ref.slot)  # type: ignore[union-attr]

    def _arrived(self, body: tuple) -> tuple[str, object]:
        """``on_arrival`` applied to an ok result; its failure (say, the device out of memory) is
        that batch's error, raised when the batch is due."""
        x, y, nbytes, skipped = body
        try:
            x, y = self._on_arrival(x, y)  # type: ignore[misc]
        except Exception as err:
            return "error", (traceback.format_exc(), _portable(err))
        return "ok", (x, y, nbytes, skipped)

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers (for tests and monitoring)."""
        return [p.pid for p in self._procs if p.pid is not None]

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (also after a worker failure)."""
        return self._closed

    @property
    def generation(self) -> int:
        """The current generation (tasks of older ones are dropped)."""
        return self._generation

    def begin(self) -> int:
        """Start a new generation: withdraw queued tasks of the previous one, forget its results."""
        with self._cond:
            self._generation += 1
            self._ready.clear()
        while True:
            try:
                self._tasks.get_nowait()
            except (queue.Empty, OSError, EOFError):
                break
        return self._generation

    def submit(self, generation: int, k: Hashable, indices: Sequence[int]) -> None:
        """Ask for batch ``k`` (any key, e.g. (epoch, index)) of ``generation``: ``indices`` to read."""
        self._tasks.put((generation, k, list(indices)))

    def get(self, generation: int, k: Hashable) -> tuple[torch.Tensor, torch.Tensor, int, list[str]]:
        """Block until batch ``k`` of ``generation`` arrives: ``(x, y, bytes the worker read, samples it
        skipped)``."""
        if generation != self._generation or self._closed:
            raise RuntimeError(f"batch {k} of an abandoned loader iteration (or a closed pool) "
                               f"will never arrive")
        while True:
            with self._cond:
                if k in self._ready:
                    kind, body = self._ready.pop(k)
                    break
                if self._failure is None:
                    self._cond.wait(timeout=_POLL_S)
                failure, arrived = self._failure, k in self._ready
            if failure is not None:
                self.close()
                raise WorkerError(failure)
            if not arrived:
                self._check_alive()
        if kind == "error":  # raised when the failed batch is due, not when a look-ahead hits it
            self.close()
            tb, original = body  # type: ignore[misc]
            raise WorkerError(f"a loader worker failed reading batch {k}:\n{tb}", original)
        return body  # type: ignore[return-value]

    def _check_alive(self) -> None:
        for p in self._procs:
            if p.exitcode is not None:
                code = p.exitcode
                self.close()
                raise WorkerError(
                    f"loader worker {p.name} (pid {p.pid}) exited unexpectedly with code {code} "
                    f"(killed for memory? a signal is shown as a negative code)")

    def close(self, timeout: float = 5.0) -> None:
        """Stop the workers and wait for them: sentinel first, then terminate, then kill."""
        if self._closed:
            return
        self._closed = True
        for q in (self._tasks, self._free):  # the sentinel, also for a worker waiting for a slot
            for _ in self._procs if q is not None else ():
                try:
                    q.put(None)
                except (OSError, ValueError):
                    break
        deadline = time.monotonic() + timeout
        for p in self._procs:
            while p.is_alive() and time.monotonic() < deadline:
                p.join(0.05)  # the receiver keeps the pipe empty: a worker cannot exit while it is full
            if p.is_alive():
                p.terminate()
                p.join(1.0)
            if p.is_alive():
                p.kill()
                p.join()
        self._stopping = True
        if self._receiver is not threading.current_thread():
            self._receiver.join(2 * _POLL_S + 1.0)
        self._drain()
        for q in (self._tasks, self._results, self._free):
            if q is not None:
                q.cancel_join_thread()
                q.close()
        if self._slots is not None:
            self._slots.close()
        with self._cond:
            self._ready.clear()

    def _drain(self) -> None:
        """Discard whatever results are waiting (bounded: a broken queue must not spin forever)."""
        for _ in range(10_000):
            try:
                self._results.get_nowait()
            except queue.Empty:
                return
            except Exception:  # a result whose sender already exited cannot be rebuilt; skip it
                continue
