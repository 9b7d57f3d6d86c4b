# torchrun --nproc-per-node 2 launch/examples/infer_whole_box.py
"""Your own fully convolutional model on whole periodic boxes, HDF5 file to HDF5 file, split over the
ranks: each rank reads only its hyperslab of the input and writes only its shard of the output, which
any reader sees as one dataset. Checked against the model on the whole boxes in one process (float64).
Files go to runs/infer_whole_box/."""

import os

import h5py
import torch
from torch import nn

import hybridpar as hp

torch.set_default_dtype(torch.float64)           # to compare with one process to the last bits
torch.manual_seed(0)                             # every rank builds the same model and boxes
hp.init_distributed()
rank = torch.distributed.get_rank()
folder = "runs/infer_whole_box"
boxes = torch.randn(2, 1, 40, 24, 24)            # two periodic boxes, (N, C, D, H, W)
if rank == 0:
    os.makedirs(folder, exist_ok=True)
    with h5py.File(f"{folder}/in.h5", "w") as f:
        f["x"] = boxes.numpy()
torch.distributed.barrier()

model = nn.Sequential(                           # periodic: halos wrap around the box's faces
    nn.Conv3d(1, 8, 3, padding=1, padding_mode="circular"), nn.GroupNorm(2, 8), nn.LeakyReLU(),
    nn.Conv3d(8, 8, 3, stride=2, padding=1, padding_mode="circular"), nn.LeakyReLU(),
    nn.Upsample(scale_factor=2, mode="trilinear"), nn.Conv3d(8, 1, 3, padding=1, padding_mode="circular"))
engine = hp.parallelize(model, {"grid": {"spatial": [2, 1, 1]}}, input_shape=(1, 1, 40, 24, 24))
with h5py.File(f"{folder}/in.h5", "r") as f, \
        hp.data.SplitHdf5(f"{folder}/out.h5", "y", (2, 1, 40, 24, 24), "float64", overwrite=True) as out:
    hp.infer(engine, f["x"], out, dtype=torch.float64)   # reads f["x"][n, :, box], writes out[n, :, box]

if rank == 0:                                    # out.h5 reads as one (2, 1, 40, 24, 24) dataset
    with h5py.File(f"{folder}/out.h5", "r") as f, torch.no_grad():
        err = (torch.from_numpy(f["y"][...]) - model(boxes)).abs().max().item()
    print(f"whole-box inference on 2 ranks: max |split - one process| = {err:.1e}")
