# Your own window layer split over ranks: the layer, its split version and one register call, in your file.
#   torchrun --nproc-per-node 2 launch/examples/own_layer.py
"""SoftPool3d (softmax-weighted pooling, Stergiou et al. 2021; here with a learnable sharpness per
channel) is no torch layer. Registered with its
window (one ``hp.nn.Window`` per dim) and its split version, a model using it runs split like any
other: the planner plans its halos from that window, ``explain`` and the FLOP counter show it, and
``DistSoftPool3d`` reads the same window to exchange them. Prints the largest difference from one
process (float64) of the output, the loss and the weight gradients, the sharpness's included (a split
layer's own parameters get their gradient summed over the shards, with no call of the user's)."""

import copy
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import hybridpar as hp  # noqa: E402


class SoftPool3d(nn.Module):                     # your layer: sum(e^bx x) / sum(e^bx) over each window
    def __init__(self, channels, kernel=3, stride=2, padding=1):
        super().__init__()
        self.kernel, self.stride, self.padding = kernel, stride, padding
        self.beta = nn.Parameter(torch.ones(channels))   # a learnable sharpness b per channel

    def forward(self, x):
        e = (self.beta.view(1, -1, 1, 1, 1) * x).exp()
        num, den = F.avg_pool3d(torch.cat([e * x, e], 1), self.kernel, self.stride, self.padding).chunk(2, 1)
        return num / den


class DistSoftPool3d(hp.nn.SpatialLayer, SoftPool3d):   # its split version: the layer's arguments, a grid
    def __init__(self, channels, kernel=3, stride=2, padding=1, *, grid):
        SoftPool3d.__init__(self, channels, kernel, stride, padding)
        self.init_spatial(grid)                  # its parameters: gradients summed over the shards

    def forward(self, x):                        # the same sums on the shard with its halos, unpadded
        e, w = (self.beta.view(1, -1, 1, 1, 1) * x).exp(), self.window()   # w: the registered window
        both = self.with_halos(torch.cat([e * x, e], 1))   # zeros beyond the volume's faces
        num, den = F.avg_pool3d(both, [a.kernel for a in w], [a.stride for a in w]).chunk(2, 1)
        return num / den


hp.nn.register(SoftPool3d, role="window", op="pool",
               window=lambda m: (hp.nn.Window(m.kernel, m.stride, m.padding, m.padding),) * 3,
               to_dist=lambda m, grid, overlap: DistSoftPool3d(len(m.beta), m.kernel, m.stride, m.padding,
                                                               grid=grid),
               flops=lambda m, x, y: ({"forward_other": 2 * m.kernel ** 3 * y.numel()}, None))


def main() -> None:
    info = hp.init_distributed()
    torch.manual_seed(0)                         # the same weights and batch on every rank
    model = nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), SoftPool3d(4), nn.Tanh(),
                          nn.Conv3d(4, 1, 3, padding=1)).double()
    one_process = copy.deepcopy(model)
    x = torch.randn(2, 1, 17, 16, 15, dtype=torch.float64)   # odd extents: uneven shards
    y = torch.randn(2, 1, 9, 8, 8, dtype=torch.float64)
    spec = hp.ParallelSpec.from_dict({"grid": {"spatial": [info.world_size, 1, 1]}})
    engine = hp.parallelize(model, spec, loss_fn=F.mse_loss)
    x_local, y_local = engine.shard_batch(x, y)
    loss = engine.train_step(x_local, y_local)
    want = one_process(x)
    want_loss = F.mse_loss(want, y)
    want_loss.backward()
    out_err = (engine.predict(x_local) - want).abs().max().item()
    loss_err = abs(loss.item() - want_loss.item())
    grad_err = max((p.grad - one_process.get_parameter(n).grad).abs().max().item()
                   for n, p in engine.named_parameters())
    if info.rank == 0:
        print(f"SoftPool3d split {info.world_size}x1x1: max |split - one process| = "
              f"{max(out_err, loss_err, grad_err):.1e} (output {out_err:.1e}, loss {loss_err:.1e}, "
              f"weight gradients {grad_err:.1e})")


if __name__ == "__main__":
    main()
