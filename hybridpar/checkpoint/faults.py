"""Fault-injection points, so tests can kill a save at the moments that matter.

Why: "a killed job never loses a step" is only believable if a test kills a real run before the
snapshot, in the middle of writing, and between the last fsync and the manifest rename. The writer calls
:func:`hit` at each of those points; nothing happens unless the environment asks for it.

``HYBRIDPAR_CKPT_FAULT="POINT:ACTION[:STEP[:RANK[:ATTEMPT]]]"``, several separated by commas. Points:
``snapshot`` (in ``save``, the previous save complete, before any copy), ``copy`` (the writer thread,
before it completes an overlapped copy), ``persist`` (after the first tensor of a file is written),
``manifest`` (manifest written to its temp name and fsynced, not yet renamed), ``flush`` (an L3 copy
half done); a training loop may add its own (the CosmoFlow trainer: ``step``, after an optimizer step,
and ``validate``, in the middle of a validation pass). Actions: ``kill`` (SIGKILL this process),
``stop`` (SIGSTOP it: it stops answering without dying, as a hung host would), ``raise`` (an OSError, as
a full disk would), ``sleepSECONDS``. ``ATTEMPT`` is torchrun's restart count
(``TORCHELASTIC_RESTART_COUNT``, 0 without torchrun), so a fault can fire in one attempt and not again in
the one that resumes from it.
"""

from __future__ import annotations

import os
import signal
import time

ENV = "HYBRIDPAR_CKPT_FAULT"
POINTS = ("snapshot", "copy", "persist", "manifest", "flush")


def hit(point: str, step: int, rank: int = 0) -> None:
    """Act on ``point`` if the environment names it (for this step and rank); otherwise return at once."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    for entry in spec.split(","):
        parts = entry.strip().split(":")
        if len(parts) < 2 or parts[0] != point:
            continue
        if len(parts) > 2 and parts[2] not in ("", "*") and int(parts[2]) != step:
            continue
        if len(parts) > 3 and parts[3] not in ("", "*") and int(parts[3]) != rank:
            continue
        if len(parts) > 4 and parts[4] not in ("", "*") and \
                int(parts[4]) != int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")):
            continue
        action = parts[1]
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif action == "raise":
            raise OSError(f"injected fault at {point} (step {step}, rank {rank}) from ${ENV}")
        elif action.startswith("sleep"):
            time.sleep(float(action[5:]))
        else:
            raise ValueError(f"${ENV}: unknown action {action!r} in {entry!r} (kill, stop, raise or "
                             "sleepSECONDS)")
