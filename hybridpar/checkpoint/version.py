"""What a version is to the user: its record, and the lineage facts stamped into every save.

Why its own module: ``Checkpointer.versions``, the CLI and the tests list versions the same way, and the
code version and config hash must be computed once, identically, for every save of a run.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Version:
    """One complete version as this process sees it.

    ``metadata`` holds what ``save`` was given (e.g. ``epoch``, ``metrics``) plus ``config_hash``,
    ``code_version`` and ``parent`` (the version this run resumed from or saved before: its lineage).
    ``levels`` are the levels at which this process sees every file of the version.
    """

    name: str
    step: int
    time: float
    bytes: int
    levels: tuple[str, ...]
    metadata: dict[str, Any]

    @property
    def epoch(self) -> int | None:
        return self.metadata.get("epoch")

    @property
    def metrics(self) -> dict[str, Any]:
        return self.metadata.get("metrics", {})

    @property
    def parent(self) -> str | None:
        return self.metadata.get("parent")



def code_version() -> str:
    """hybridpar's version, plus the git commit of the checkout it runs from, read without running git."""
    import hybridpar  # noqa: PLC0415 (avoid an import cycle at module load)

    version = getattr(hybridpar, "__version__", "unknown")
    here = Path(__file__).resolve()
    for d in here.parents:
        git = d / ".git"
        if git.is_dir():
            try:
                head = (git / "HEAD").read_text().strip()
                if head.startswith("ref:"):
                    ref = head[4:].strip()
                    p = git / ref
                    if p.exists():
                        head = p.read_text().strip()
                    else:
                        packed = (git / "packed-refs").read_text().splitlines()
                        head = next(line.split()[0] for line in packed if line.endswith(" " + ref))
                return f"{version}+g{head[:12]}"
            except (OSError, StopIteration):
                return version
    return version


def config_hash(config: Mapping[str, Any] | None) -> str | None:
    """A short, stable hash of a run's configuration (None without one)."""
    if config is None:
        return None
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


