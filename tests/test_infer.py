"""``hp.infer`` with ``hp.data.SplitHdf5`` on 4 ranks, float64 against the model on each whole volume in
one process: a periodic model with GroupNorm and a stride-2 convolution, three volumes of an odd,
uneven shape, split (2, 2, 1), data 2 × (1, 2, 1) (the replicas take the volumes in turn, 2 and 1:
the virtual dataset maps each volume to the replica that computed it), and an engine built at another
size (2, 1, 2) (it runs at the file's), of that model and of a U-Net whose calls take their arguments
from shapes."""

from __future__ import annotations

import h5py
import pytest
import torch
from torch import nn

from graph_models import SizedUNet

SPECS = {"spatial (2, 2, 1)": {"grid": {"spatial": [2, 2, 1]}},
         "data 2 x (1, 2, 1)": {"grid": {"data": 2, "spatial": [1, 2, 1]}},
         "an engine built at another size": {"grid": {"spatial": [2, 1, 2]}, "build": (1, 1, 8, 6, 8)},
         "a U-Net sized from shapes, built at another size": {"grid": {"spatial": [2, 1, 2]},
                                                              "build": (1, 1, 9, 6, 7), "model": "sized"}}
SHAPE = (3, 1, 12, 10, 6)


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Conv3d(1, 4, 3, padding=1, padding_mode="circular"), nn.GroupNorm(2, 4), nn.LeakyReLU(),
        nn.Conv3d(4, 4, 3, stride=2, padding=1, padding_mode="circular"), nn.LeakyReLU(),
        nn.Upsample(scale_factor=2, mode="trilinear"), nn.Conv3d(4, 2, 3, padding=1, padding_mode="circular"))


def _case(rank: int, world: int, spec: dict, folder: str) -> float:
    import hybridpar as hp  # noqa: PLC0415

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(1)
        x = torch.randn(SHAPE)
        if rank == 0:
            with h5py.File(f"{folder}/in.h5", "w") as f:
                f["x"] = x.numpy()
        torch.distributed.barrier()
        torch.manual_seed(0)
        model = SizedUNet(out_channels=2) if spec.get("model") == "sized" else _model()
        out_shape = (SHAPE[0], 2, *SHAPE[2:])
        with h5py.File(f"{folder}/in.h5", "r") as f, \
                hp.data.SplitHdf5(f"{folder}/out.h5", "y", out_shape, "float64") as out:
            if "build" in spec:
                engine = hp.parallelize(model, {"grid": spec["grid"]}, input_shape=spec["build"])
                hp.infer(engine, f["x"], out, dtype=torch.float64)
            else:
                hp.infer(model, f["x"], out, spec=spec, dtype=torch.float64)
        with h5py.File(f"{folder}/out.h5", "r") as f, torch.no_grad():
            return (torch.from_numpy(f["y"][...]) - model(x)).abs().max().item()
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("name", list(SPECS))
def test_infer_split_file_to_file(pools, tmp_path, name):
    errors = pools(4).run(_case, SPECS[name], str(tmp_path))
    assert max(errors) < 1e-12, errors
