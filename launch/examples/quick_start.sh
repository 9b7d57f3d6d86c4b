#!/usr/bin/env bash
# bash launch/examples/quick_start.sh
# The quick start, on a fresh machine with Python >= 3.10 and make (no GPU needed).
set -euo pipefail
cd "$(dirname "$0")/../.."
make demo   # sets up .venv, generates synthetic universes, trains CosmoFlow on 4 CPU ranks
make test   # runs the test suite
make reconstruct   # the second task: a U-Net reconstructs initial density fields (4 CPU ranks, 24 min)
