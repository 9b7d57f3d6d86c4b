# torchrun --nproc-per-node 4 launch/examples/layers.py
"""Your own layers, split: one convolution over a 2 x 2 x 1 grid of ranks, checked against
``torch.nn.Conv3d`` on the whole volume, forward and backward (float64, every rank)."""

import torch
import torch.nn.functional as F

import hybridpar as hp

torch.set_default_dtype(torch.float64)              # to compare with one process to the last bits
torch.manual_seed(0)                                 # every rank draws the same volume and weights
x = torch.randn(2, 4, 19, 16, 12, requires_grad=True)

hp.init_distributed()                                # torchrun, mpirun, srun, or a plain process
grid = hp.ProcessGrid(spatial=(2, 2, 1))             # 4 ranks: depth and height split in two
x_local = hp.scatter(x, grid)                        # x: global (N, C, D, H, W), same on every rank
conv = hp.nn.DistConv3d(4, 16, kernel_size=3, padding=1, grid=grid, overlap=True)
y = hp.gather(conv(x_local), grid)                   # equals torch.nn.Conv3d on x, gradients too

y.square().sum().backward()                          # every rank: whole-volume gradients
split_grads = [x.grad.clone(), conv.weight.grad.clone()]
x.grad = None
w = conv.weight.detach().clone().requires_grad_()
ref = F.conv3d(x, w, conv.bias.detach(), padding=1)  # one process, the whole volume
ref.square().sum().backward()
pairs = [(y, ref), (split_grads[0], x.grad), (split_grads[1], w.grad)]
err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in pairs)
if grid.rank == 0:
    print(f"DistConv3d on {grid.spatial_shape}, forward and backward: "
          f"max |split - one process| = {err:.1e} of the largest value")
