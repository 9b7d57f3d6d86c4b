"""Linear probing before training: a ridge-started model (``model.ridge_start``) gets the reference's
closed-form solution on the training set before its first step.

Why a file in the run directory: the fit reads every training input once (the reference's features,
:mod:`cosmoflow.experiments.reference`), which one rank does while the others wait; they then load the
same numbers, so every replica starts identical. The file is JSON (numbers only, checked for shape
before use) and is reused when the run resumes or is started again in the same directory; a resumed
checkpoint's weights replace what it set anyway.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist

from cosmoflow.config import Config
from cosmoflow.experiments.reference import RidgeFit, ridge_start
from cosmoflow.model import RidgeStarted, start_at_ridge

FILE = "ridge_start.json"


def start(cfg: Config, model: RidgeStarted, run_dir: Path, rank: int) -> RidgeFit:
    """Fit (rank 0, unless the run directory has the fit already), share through ``run_dir``, load."""
    path = run_dir / FILE
    cross = cfg.model.ridge_cross
    if rank == 0 and not path.exists():
        fit = ridge_start(cfg.data.train, cfg.data.sample_size, cfg.data.channels, cross=cross)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"size": cfg.data.sample_size, "channels": cfg.data.channels,
                                   "cross": cross, "train": cfg.data.train, **fit.to_dict()}) + "\n")
        os.replace(tmp, path)
        print(f"ridge start: the reference fitted on {cfg.data.train} ({cfg.data.sample_size}^3), strengths "
              + ", ".join(f"{p} {v:g}" for p, v in fit.strength.items()), flush=True)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    doc = json.loads(path.read_text())
    theirs = (doc.get("size"), doc.get("channels"), bool(doc.get("cross", False)))
    if theirs != (cfg.data.sample_size, cfg.data.channels, cross):
        what = {False: "", True: " and cross spectra"}
        raise ValueError(f"{path}: a ridge fit of {theirs[0]}^3 inputs with {theirs[1]} channels"
                         f"{what[theirs[2]]}, but this run reads {cfg.data.sample_size}^3 with "
                         f"{cfg.data.channels}{what[cross]}; remove the file or use another run directory")
    fit = RidgeFit.from_dict(doc)
    start_at_ridge(model, fit)
    return fit
