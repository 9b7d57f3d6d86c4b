"""hybridpar's benchmark suite: ``python -m perf list`` names the benchmarks, ``python -m perf NAME --help``
their flags. Figures and their commands are in ``perf/README.md``."""
