"""``python -m perf.harness``: the same command as ``python -m perf harness``."""

import sys

from perf.harness.cli import main

sys.exit(main())
