"""Deprecated name of :mod:`hybridpar.planner` (the per-layer spec and its planner), kept importable
for one release: ``import hybridpar.spec`` and ``python -m hybridpar.spec explain`` still work, with a
``DeprecationWarning``.
"""

import sys
import warnings

from hybridpar.planner import *  # noqa: F403
from hybridpar.planner import __all__  # noqa: F401

warnings.warn("hybridpar.spec is now hybridpar.planner; the old name goes in the next release",
              DeprecationWarning, stacklevel=2)

if __name__ == "__main__":
    from hybridpar.planner.__main__ import main

    sys.exit(main())
