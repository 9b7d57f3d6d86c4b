# torchrun --nproc-per-node 2 launch/examples/untraced_unet.py
"""A U-Net as users write it, with Python on shapes that torch.fx cannot trace (an odd-size guard,
``interpolate`` to the skip's size, a branch on depth), run split (2, 1, 1) over 2 ranks by its own
forward. One training step's loss and gradients, checked against the same step in one process (float64)."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

import hybridpar as hp


class MyUNet(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.enc = nn.Conv3d(1, width, 3, padding=1)
        self.mid = nn.Conv3d(width, width, 3, padding=1)
        self.dec = nn.Conv3d(2 * width, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        depth = x.shape[2]                                     # the volume's depth on every rank: 9
        if depth % 2:                                          # even out an odd depth for the pool
            x = F.pad(x, (0, 0, 0, 0, 0, 1))
        skip = F.relu(self.enc(x))
        h = F.relu(self.mid(F.max_pool3d(skip, 2)))
        if h.shape[2] > 4:                                     # deep enough: one more pass
            h = F.relu(self.mid(h))
        h = F.interpolate(h, size=skip.shape[2:], mode="trilinear")
        out = self.dec(torch.cat([h, skip], dim=1))
        return out - out.mean(dim=(2, 3, 4), keepdim=True)     # the mean over the whole volume


torch.set_default_dtype(torch.float64)           # to compare with one process to the last bits
torch.manual_seed(0)                             # every rank builds the same model and batch
x, y = torch.randn(2, 1, 9, 8, 8), torch.randn(2, 1, 10, 8, 8)
hp.init_distributed()

unet = MyUNet()
engine = hp.parallelize(unet, {"grid": {"spatial": [2, 1, 1]}}, loss_fn=F.mse_loss)
x_local, y_local = engine.shard_batch(x, y)      # depth 9 split 5 + 4; the output's 10 split 5 + 5
loss = engine.train_step(x_local, y_local)

one = copy.deepcopy(unet)                        # the same weights (a step leaves them), in one process
one.zero_grad(set_to_none=True)
ref = F.mse_loss(one(x), y)
ref.backward()
grads = dict(one.named_parameters())             # the engine's gradients are the model's own
err = max([abs(float(loss) - ref.item())] + [(p.grad - grads[n].grad).abs().max().item()
                                              for n, p in unet.named_parameters()])
if torch.distributed.get_rank() == 0:
    print(f"untraceable U-Net loss {float(loss):.6f}; max |split - one process| over the loss and gradients "
          f"= {err:.1e}")
