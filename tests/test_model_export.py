"""A model rebuilt from its export alone (``cosmoflow.model.build_model_from_export``): the checkpoint
CLI's export carries the run's configuration in both formats, and the model it rebuilds gives outputs
identical to the model that was saved, for the regressor (BatchNorm statistics moved, a P(k) branch with
running statistics) and the reconstruction U-Net; an export without a configuration is one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from cosmoflow.config import ConfigError, load_config
from cosmoflow.model import build_model_from_export, build_network
from hybridpar.checkpoint import Checkpointer, read_config
from hybridpar.checkpoint.__main__ import main as cli

CASES = {
    "regress": ["data.sample_size=16", "data.channels=2", "model.n_conv=2", "model.base_filters=4",
                "model.dense=[8]", "model.batchnorm=true", "model.power_spectrum=true",
                "model.spectrum_stats=running", "model.padding_mode=circular", "train.cuda_graphs=false"],
    "reconstruct": ["task=reconstruct", "data.sample_size=8", "data.channels=1", "unet.levels=3",
                    "unet.width=4", "unet.max_width=8", "unet.groups=2", "checkpoint.best_metric=val_loss"],
}


@pytest.mark.parametrize("task", list(CASES))
def test_rebuilt_from_the_export_alone_gives_identical_outputs(task, tmp_path, capsys):
    cfg = load_config(None, CASES[task])
    torch.manual_seed(1)
    model = build_network(cfg)
    S, C = cfg.data.sample_size, cfg.data.channels
    with torch.no_grad():  # move running statistics away from their initial values
        for _ in range(2):
            model(torch.rand(2, C, S, S, S) * 3)
    run = tmp_path / "run"
    with Checkpointer(run / "checkpoints", config=cfg.to_dict()) as ck:
        ck.save(5, {"model": model.state_dict(), "step": 5})
    model.eval()
    x = torch.randn(3, C, S, S, S)
    with torch.no_grad():
        want = model(x)
    for name in ("m.pt", "m.safetensors"):
        assert cli(["export", str(run), str(tmp_path / name)]) == 0
        assert "with its run configuration" in capsys.readouterr().out
        assert read_config(tmp_path / name) == json.loads(json.dumps(cfg.to_dict()))
        rebuilt = build_model_from_export(tmp_path / name).eval()
        with torch.no_grad():
            assert torch.equal(rebuilt(x), want), (task, name)


def test_an_export_without_a_configuration_is_one_line(tmp_path):
    weights = {"w": torch.zeros(2)}
    save_file(weights, str(tmp_path / "bare.safetensors"))
    torch.save(weights, tmp_path / "bare.pt")
    for name in ("bare.safetensors", "bare.pt"):
        assert read_config(tmp_path / name) is None
        with pytest.raises(ConfigError, match=f"{name}: carries no run configuration"):
            build_model_from_export(tmp_path / name)
    save_file(weights, str(tmp_path / "odd.safetensors"), metadata={"hybridpar.config": "[1, 2]"})
    with pytest.raises(ConfigError, match="odd.safetensors: its configuration is a list, not a mapping"):
        build_model_from_export(tmp_path / "odd.safetensors")
    typo = '{"model": {"n_cnv": 1}}'
    save_file(weights, str(tmp_path / "other.safetensors"), metadata={"hybridpar.config": typo})
    with pytest.raises(ConfigError, match=r"other.safetensors's configuration: model: unknown key 'n_cnv'"):
        build_model_from_export(tmp_path / "other.safetensors")
