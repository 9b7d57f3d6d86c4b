#!/usr/bin/env python
"""Train CosmoFlow with hybridpar.

    torchrun --nproc-per-node 4 --max-restarts 3 launch/train.py --config launch/configs/demo.yaml
    mpirun -n 4 python launch/train.py --config launch/configs/demo.yaml
    srun python launch/train.py --config launch/configs/cosmoflow_128.yaml   (see launch/slurm.sbatch)

Override any entry with ``--set key=value`` (e.g. ``--set train.epochs=2 --set run_dir=runs/try``);
``--help-config`` lists every key with its type, default, range and meaning (as ``docs/config.md`` does).
Starting again on the same ``run_dir`` resumes from its newest complete checkpoint. Exit status: 0 done,
1 a runtime fault, 2 a configuration error (see :mod:`hybridpar.process.failure`).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    from cosmoflow.train_args import help_config, parse  # argparse only: --help answers before torch

    if parse().help_config:
        sys.stdout.write(help_config())  # the committed reference, read without torch
        sys.exit(0)
    from cosmoflow.trainer import main
    from hybridpar.process import failure

    failure.run_main(main)  # under torchelastic's @record: torchrun's report names the root cause
