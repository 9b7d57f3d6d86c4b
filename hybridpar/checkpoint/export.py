"""Weights in the ecosystem's formats: a plain PyTorch state dict and safetensors, written and read back.

Why: trained weights must go both ways between hybridpar and the rest of the ecosystem, and neither way
may trust a pickle. ``python -m hybridpar.checkpoint export`` writes what ``torch.load(path,
weights_only=True)`` reads (tensors, dicts, lists, tuples and plain values only) or, with ``--format
safetensors``, what ``safetensors.torch.load_file`` reads; :func:`load_weights` reads either, so a run can
start from weights trained elsewhere (the application's ``model.init_from``).

An export also carries the run's configuration (the checkpoint's, as the ``Checkpointer`` was given it),
so that the model can be rebuilt from the file alone (:func:`read_config`): as JSON text in the
safetensors metadata under :data:`CONFIG_KEY`, and as the same text in the torch file's state dict
attribute of that name (an ``OrderedDict`` attribute, as torch keeps ``_metadata``: ``torch.load`` with
``weights_only=True`` reads it, and ``load_state_dict`` ignores it).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridpar.checkpoint.format import CheckpointError

SAFETENSORS = "safetensors"
TORCH = "torch"
CONFIG_KEY = "hybridpar.config"
"""Where an export keeps the run's configuration (JSON text)."""
_CONFIG_ATTR = "hybridpar_config"  # the torch file's state dict attribute (an identifier)


def plain(x: Any) -> Any:
    """``x`` with numpy arrays as tensors and numpy numbers as Python numbers (what a format-1 checkpoint
    may hold), so that ``torch.load(weights_only=True)`` reads it back."""
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.array(x))
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, OrderedDict):
        return OrderedDict((k, plain(v)) for k, v in x.items())
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(plain(v) for v in x)
    return x


def tensors_only(weights: Mapping[str, Any], what: str) -> dict[str, torch.Tensor]:
    """``weights`` if it maps names to tensors, else a CheckpointError naming what is not one."""
    bad = [str(k) for k, v in weights.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"{what}: entries {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''} are not "
                              f"name -> tensor; a weights file holds tensors only")
    return dict(weights)


def output_problem(path: str | os.PathLike, overwrite: bool) -> str | None:
    """Why ``path`` cannot be written as a new export (None: it can), checked before any work.

    Why: an export must never replace a file nobody asked it to replace (``--overwrite`` asks), and a
    folder that is not there is the user's to make (a typo'd path should not grow a tree of folders).
    """
    p = Path(path)
    if not p.parent.is_dir():
        return f"output folder {p.parent} does not exist; export does not create folders (mkdir -p it first)"
    if p.is_dir():
        return f"output {p} is a directory; name a file to write"
    if os.path.lexists(p) and not overwrite:
        return f"output {p} exists; pass --overwrite to replace it"
    return None


def _umask() -> int:
    """The process's umask (read by setting it and putting it back: the CLI runs one thread)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_new(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Call ``write`` on a temporary name beside ``path``, then rename it to ``path``.

    Why: a failed or interrupted export must leave neither a half-written file under the real name nor
    the temporary one (removed on any failure), and the file gets the mode ``torch.save``'s would, 0666
    less the umask (safetensors and ``mkstemp`` make 0600, which colleagues on a shared file system cannot
    read). A failure is one CheckpointError naming ``path``.
    """
    p = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, p)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"{p}: cannot write ({e.strerror or e})") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_safetensors(weights: Mapping[str, Any], path: str | os.PathLike, metadata: dict[str, str]) -> None:
    """Write a state dict of tensors as one safetensors file (``metadata``: text that travels with it),
    through :func:`write_new`."""
    from safetensors.torch import save_file  # noqa: PLC0415 (only the CLI's export needs it)

    flat = {k: v.detach().cpu().contiguous() for k, v in tensors_only(weights, str(path)).items()}
    write_new(path, lambda tmp: save_file(flat, str(tmp), metadata={"format": "pt", **metadata}))


def save_torch(state: Mapping[str, Any], path: str | os.PathLike, config: Mapping[str, Any] | None) -> None:
    """Write ``state`` with ``torch.save`` (read back with ``weights_only=True``) through
    :func:`write_new`, ``config`` as JSON text in its attribute :data:`CONFIG_KEY` (see the module's
    docstring)."""
    out = OrderedDict(state)
    if config is not None:
        setattr(out, _CONFIG_ATTR, json.dumps(config, sort_keys=True))
    write_new(path, lambda tmp: torch.save(out, tmp))


def config_text(config: Mapping[str, Any] | None) -> dict[str, str]:
    """The safetensors metadata entry that carries ``config`` (none for None)."""
    return {} if config is None else {CONFIG_KEY: json.dumps(config, sort_keys=True)}


def read_config(path: str | os.PathLike) -> dict[str, Any] | None:
    """The run configuration an export carries (either format), or None if it carries none (an export
    written before exports carried it, or weights from elsewhere). Read as data, never run."""
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"{p}: no such weights file")
    try:
        if _is_safetensors(p):
            from safetensors import safe_open  # noqa: PLC0415

            with safe_open(str(p), framework="pt") as f:
                text = (f.metadata() or {}).get(CONFIG_KEY)
        else:
            text = getattr(torch.load(p, map_location="cpu", weights_only=True), _CONFIG_ATTR, None)
        config = json.loads(text) if isinstance(text, str) else None
    except Exception as e:  # noqa: BLE001 (one line, as load_weights)
        raise CheckpointError(f"{p}: its configuration cannot be read ({type(e).__name__}: {e})") from None
    if config is not None and not isinstance(config, dict):
        raise CheckpointError(f"{p}: its configuration is a {type(config).__name__}, not a mapping")
    return config


def _is_safetensors(p: Path) -> bool:
    """A safetensors file: an 8-byte little-endian header length, then a JSON object (a torch.save zip
    starts ``PK``)."""
    with open(p, "rb") as f:
        head = f.read(9)
    if len(head) < 9 or head[8:9] != b"{":
        return False
    return int.from_bytes(head[:8], "little") <= p.stat().st_size - 8


def load_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The state dict in a safetensors file or in a ``torch.save`` file of tensors (read with
    ``weights_only=True``: it never runs code), on the CPU, for ``model.load_state_dict``.

    Reads what ``python -m hybridpar.checkpoint export`` writes in either format, and the same files from
    elsewhere; of an ``export --all`` file, its ``model`` entry. Any failure is one CheckpointError line
    naming the file.
    """
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"{p}: no such weights file")
    try:
        if _is_safetensors(p):
            from safetensors.torch import load_file  # noqa: PLC0415

            return load_file(str(p), device="cpu")
        state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 (safetensors, zip and unpickling errors alike: one line)
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        raise CheckpointError(f"{p}: not a safetensors file or a weights-only PyTorch state dict "
                              f"({type(e).__name__}: {first})") from None
    if isinstance(state, Mapping) and isinstance(state.get("model"), Mapping) \
            and not all(isinstance(v, torch.Tensor) for v in state.values()):
        state = state["model"]  # an ``export --all`` file
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{p}: holds a {type(state).__name__}, not a state dict")
    return tensors_only(state, str(p))
