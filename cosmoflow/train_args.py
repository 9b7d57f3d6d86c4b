"""``launch/train.py``'s command line, read with nothing but argparse.

Why a module of its own: ``--help`` should answer at once, yet importing the trainer imports torch,
which takes seconds (20 on a cold network file system). This module imports nothing of the
application, so ``launch/train.py`` reads its arguments (and answers ``--help``) before the trainer,
and the trainer reads the same arguments through it.

``--help-config`` answers at once too: the reference is generated from :mod:`cosmoflow.config`, whose
imports (the spec's checks in :mod:`hybridpar.planner`) bring torch, so its text is committed beside
this module (``config_reference.txt``, kept current by ``tests/test_config_reference.py``) and read
from there; only where that file is missing is it generated.
"""

from __future__ import annotations

import argparse
from pathlib import Path

DESCRIPTION = "Train CosmoFlow (or the reconstruction U-Net) with hybridpar, as the config says."


def parser() -> argparse.ArgumentParser:
    """``--config FILE [--set key=value ...]``, or ``--help-config``."""
    ap = argparse.ArgumentParser(prog="launch/train.py", description=DESCRIPTION)
    ap.add_argument("--config", help="YAML config (see launch/configs/)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config entry, e.g. --set train.epochs=4 (repeatable); the value is "
                         "YAML: --set 'parallel.grid={data: 1, spatial: [1, 2, 1]}'")
    ap.add_argument("--help-config", action="store_true",
                    help="print every config key with its type, default, range and meaning, and exit")
    return ap


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments of ``argv`` (default: the command line); ``--help`` prints and exits here."""
    return parser().parse_args(argv)


REFERENCE = Path(__file__).with_name("config_reference.txt")
"""``--help-config``'s text (``python -m cosmoflow.config_reference > cosmoflow/config_reference.txt``)."""


def help_config() -> str:
    """Every config key with its type, default, range and meaning (``--help-config``), without torch."""
    try:
        return REFERENCE.read_text(encoding="utf-8")
    except OSError:  # an installation without the file: generate it (imports the config, and torch)
        from cosmoflow.config_reference import text  # noqa: PLC0415

        return text()
