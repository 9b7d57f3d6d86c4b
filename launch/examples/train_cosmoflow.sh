#!/usr/bin/env bash
# bash launch/examples/train_cosmoflow.sh [--set key=value ...]
# Train CosmoFlow on 4 CPU ranks (2 data-parallel replicas x a 2-way spatial split, launch/configs/demo.yaml)
# from synthetic universes generated into data/example on the first run. Run it with the project's
# environment active (source .venv/bin/activate after make venv); extra --set options override the config.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ ! -d data/example ]; then
    python -m cosmoflow.generate --out data/example/train --universes 64 --size 64 --seed 1 --smoothing 0.5 \
        --workers 2
    python -m cosmoflow.generate --out data/example/val --universes 16 --size 64 --seed 2 --smoothing 0.5 \
        --workers 2
fi
torchrun --standalone --nproc-per-node 4 --max-restarts 3 launch/train.py --config launch/configs/demo.yaml \
    --set data.train=data/example/train --set data.val=data/example/val "$@"
# The same job under MPI, and under Slurm (srun, one rank per GPU):
#   mpirun -n 4 python launch/train.py --config launch/configs/demo.yaml --set data.train=... --set data.val=...
#   sbatch launch/slurm.sbatch
