# torchrun --nproc-per-node 4 launch/examples/unet.py
"""A 3D U-Net (skip concatenations, GroupNorm, periodic padding) split (2, 2, 1) over 4 ranks: its
output stays split and ``shard_batch`` splits the volume target like it. One training step's loss and
gradients, checked against the same step in one process (float64)."""

import copy

import torch

import hybridpar as hp
from cosmoflow.unet import UNet3d

torch.set_default_dtype(torch.float64)           # to compare with one process to the last bits
torch.manual_seed(0)                             # every rank builds the same model and batch
x, y = torch.randn(2, 1, 24, 16, 16), torch.randn(2, 1, 24, 16, 16)
hp.init_distributed()

unet = UNet3d(1, 1, width=8, levels=3)           # from cosmoflow.unet: skip concatenations, GroupNorm
engine = hp.parallelize(unet, {"grid": {"spatial": [2, 2, 1]}}, loss_fn=torch.nn.functional.mse_loss)
x_local, y_local = engine.shard_batch(x, y)      # x, y: (N, 1, D, H, W); both split like the output
loss = engine.train_step(x_local, y_local)

one = copy.deepcopy(unet)                        # the same weights (a step leaves them), in one process
one.zero_grad(set_to_none=True)

ref = torch.nn.functional.mse_loss(one(x), y)
ref.backward()
grads = dict(one.named_parameters())             # the engine's gradients are the model's own
err = max([abs(float(loss) - ref.item())] + [(p.grad - grads[n].grad).abs().max().item()
                                              for n, p in unet.named_parameters()])
if torch.distributed.get_rank() == 0:
    print(f"U-Net loss {float(loss):.6f}; max |split - one process| over the loss and gradients = {err:.1e}")
