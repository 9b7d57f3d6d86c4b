# torchrun --nproc-per-node 4 launch/examples/spec_model.py
"""A whole model from a spec: an ordinary CNN regressor on 4 ranks laid out by
``launch/configs/hybrid.yaml`` (2 pipeline stages, each split in two along depth), one SGD step,
checked against the same step in one process (float64: the loss and every updated weight)."""

import copy

import torch
from torch import nn

import hybridpar as hp

torch.set_default_dtype(torch.float64)                # to compare with one process to the last bits
torch.manual_seed(0)                                  # every rank builds the same model and batch
model = nn.Sequential(
    nn.Conv3d(4, 8, 3, padding=1), nn.ReLU(), nn.MaxPool3d(2),
    nn.Conv3d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool3d(2),
    nn.Flatten(), nn.Linear(16 * 4 ** 3, 4))
x, y = torch.randn(4, 4, 16, 16, 16), torch.randn(4, 4)
one = copy.deepcopy(model)                            # the same model, run in one process below

hp.init_distributed()
spec = hp.load_spec("launch/configs/hybrid.yaml")     # grid, pipeline schedule, per-layer splits
engine = hp.parallelize(model, spec, loss_fn=torch.nn.functional.mse_loss)
x_local, y_local = engine.shard_batch(x, y)           # global batch -> this rank's piece
loss = engine.train_step(x_local, y_local)            # micro-batched fwd+bwd; global mean loss
opt = torch.optim.SGD(engine.parameters(), lr=0.01)
opt.step()
opt.zero_grad()
state = engine.full_state_dict()                      # the original model's state dict

ref = torch.nn.functional.mse_loss(one(x), y)
ref.backward()
torch.optim.SGD(one.parameters(), lr=0.01).step()
err = max([abs(float(loss) - ref.item())] + [(state[k] - v).abs().max().item()
                                              for k, v in one.state_dict().items()])
if torch.distributed.get_rank() == 0:
    print(f"loss {float(loss):.6f}; max |split - one process| over the loss and updated weights = {err:.1e}")
