"""``launch/train.py``'s command line, read with nothing but argparse.

Why a module of its own: ``--help`` should answer at once, yet importing the trainer imports torch,
which takes seconds (20 on a cold network file system). This module imports nothing of the
application, so ``launch/train.py`` reads its arguments (and answers ``--help``) before the trainer,
and the trainer reads the same arguments through it.
"""

from __future__ import annotations

import argparse

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
