"""Asynchronous, multi-level, versioned checkpoints that survive a killed job and a changed layout.

Why: CosmoFlow-scale training runs for hours under batch-system time limits on nodes that fail; it must
checkpoint often without slowing down, restart from the newest step that really made it to storage, and
keep a browsable history of models. The package, one idea per module:

* :mod:`.checkpointer` the :class:`Checkpointer` (save / before_update / wait / latest / versions / load);
* :mod:`.writer` its background threads (files, partner copies, manifest, L3 flush, retention);
* :mod:`.version` the :class:`Version` record and the lineage stamped into every save;
* :mod:`.snapshot` host buffers and the copy that may overlap the next forward/backward;
* :mod:`.format` the per-rank file (raw tensor bytes, header, footer, crc32 per piece); :mod:`.header`
  its JSON header and every check on it (reading never runs code); :mod:`.legacy` format-1 files, whose
  numpy values :mod:`.legacy_numpy` rebuilds from an allow-list of dtypes;
* :mod:`.export` weights as a ``torch.load(weights_only=True)`` state dict or safetensors, written
  through a temporary name and never over a file unasked, and :func:`load_weights` to read either back;
* :mod:`.manifest` the manifest written last and atomically: a version exists once it is there;
* :mod:`.placement` who writes which file and who keeps which partner copy (pure geometry);
* :mod:`.levels` L1 node-local / L2 partner / L3 shared directories and what is visible in them;
* :mod:`.restore` reading a version back from whichever copy is intact, under any layout;
* :mod:`.retention` keep-last / keep-every / best;
* :mod:`.state` RNG states and optimizer state keyed by parameter name (layout-independent);
* :mod:`.group` the writer threads' private gloo groups; :mod:`.tree` nested states as flat keys;
* :mod:`.faults` fault injection for the kill tests; ``python -m hybridpar.checkpoint`` the CLI.

What a training loop does (see :mod:`.checkpointer` for more)::

    from hybridpar.checkpoint import (Checkpointer, keys_for, load_optimizer_state, optimizer_state,
                                      rng_state, set_rng_state)

    ckpt = Checkpointer(root, grid, keep_last=3, keep_every=1000, local_dir="/local/ckpt")
    ckpt.attach(optimizer)                     # each optimizer.step() waits for an overlapped copy
    state = ckpt.load(keys=keys_for(model.state_dict()))   # resume; None on a fresh start
    if state is not None:
        model.load_state_dict(state["model"])
        load_optimizer_state(model, optimizer, state["optimizer"])
        set_rng_state(state["rng"])
        loader.load_state_dict(state["loader"])
        start = state["step"] + 1
    ...
        ckpt.save(step, {"model": model.state_dict(), "optimizer": optimizer_state(model, optimizer),
                         "rng": rng_state(), "loader": loader.state_dict(), "step": step},
                  {"epoch": epoch, "metrics": {"val_mae": mae}}, overlap=True)
    ...
    ckpt.close()                               # before destroy_process_group: waits for the writes

Under pipeline parallelism a stage's module must name its parameters by their full-model names (the
stage holding layers 3-4 has ``layers.3.weight``, not ``0.weight``), so that the stages' files merge
into one model and any other split picks its own part back out.
"""

from hybridpar.checkpoint.checkpointer import Checkpointer
from hybridpar.checkpoint.export import load_weights, read_config
from hybridpar.checkpoint.format import CheckpointError, CorruptFile
from hybridpar.checkpoint.train_state import load_optimizer_state, optimizer_state, rng_state, set_rng_state
from hybridpar.checkpoint.tree import keys_for, keys_of
from hybridpar.checkpoint.version import Version

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "CorruptFile",
    "Version",
    "keys_for",
    "keys_of",
    "load_optimizer_state",
    "load_weights",
    "read_config",
    "optimizer_state",
    "rng_state",
    "set_rng_state",
]
