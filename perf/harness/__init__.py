"""The scaling harness, ``python -m perf harness``: strong and weak sweeps over ranks and layouts, measured
and predicted by :mod:`hybridpar.perfmodel` (:mod:`perf.harness.cli` says what it runs and how).

Why a package: a sweep has parts that change for different reasons (the models and configurations, the
rank jobs, the machine's calibration and state probe, the analysis, the plots, the extrapolation to
published setups), and each is read and checked on its own.
"""

from perf.harness.cli import main

__all__ = ["main"]
