"""The trainer's device options (``train.precision``, ``train.channels_last``, ``train.cuda_graphs``):
launch/train.py runs an epoch in bf16 with channels_last_3d activations and in fp16 with a gradient
scaler (2 ranks, spatial split, finite losses), and asking for CUDA graphs without CUDA is a
one-line config error."""

from __future__ import annotations

import csv

import pytest
import torch
from test_train_app import _args, tiny_data  # noqa: F401 (a module fixture)

from cosmoflow.config import ConfigError, load_config
from hybridpar.device.accel import Accel

from distributed import train_script


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error given without CUDA")
def test_cuda_graphs_without_cuda_is_a_config_error():
    with pytest.raises(ConfigError, match="train.cuda_graphs: true .* needs a CUDA device"):
        load_config(None, ["train.cuda_graphs=true"])
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Accel(torch.device("cpu"), cuda_graphs=True)


def test_unknown_precision_is_a_config_error():
    with pytest.raises(ConfigError, match="train.precision: 'fp8' is not one of fp32, bf16, fp16"):
        load_config(None, ["train.precision=fp8"])


@pytest.mark.parametrize("options", [["train.precision=bf16", "train.channels_last=true"],
                                     ["train.precision=fp16"]])
def test_trains_in_reduced_precision(tiny_data, tmp_path, options):  # noqa: F811
    run = tmp_path / "run"
    res = train_script(_args(tiny_data, run, "train.epochs=1", *options))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = list(csv.DictReader((run / "metrics_steps.csv").open()))
    assert len(rows) == 8 and all(float(r["loss"]) == float(r["loss"]) for r in rows)
