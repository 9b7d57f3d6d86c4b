"""The default process group's key-value store: the one reach into torch's private names for it.

Why: heartbeats (:mod:`.liveness`), the failure report (:mod:`hybridpar.process.failure`) and same-host
transfers talk through the store that ``init_process_group`` created, which torch hands out only
through a private function. Reaching for it here, once, keeps a change of torch's to one line.
"""

from __future__ import annotations

import torch.distributed as dist


def default_store() -> dist.Store:
    """The store of the default process group (raises if there is none)."""
    return dist.distributed_c10d._get_default_store()
