# torchrun --nproc-per-node 4 launch/examples/fft_filter.py
"""A Gaussian low-pass filter of a split field with the distributed FFT (``hp.fft``), checked against
``torch.fft`` on the whole field in one process (float64)."""

import torch

import hybridpar as hp

torch.set_default_dtype(torch.float64)            # to compare with one process to the last bits
torch.manual_seed(0)                              # every rank draws the same field
x = torch.randn(1, 2, 24, 20, 16)
hp.init_distributed()
grid = hp.ProcessGrid(spatial=(2, 2, 1))
x_local = hp.scatter(x, grid)

s = hp.fft.rfftn(x_local, grid)                   # x_local: hp.scatter(x, grid)
kd, kh, kw = s.wavenumbers()
y_local = hp.fft.irfftn(s.replace(s.data * torch.exp(-(kd**2 + kh**2 + kw**2) / 50)), grid)

kd, kh, kw = hp.fft.wavenumbers(x.shape[2:], x.dtype, x.device)  # one process, the whole field:
ref = torch.fft.irfftn(torch.fft.rfftn(x, dim=(2, 3, 4)) * torch.exp(-(kd**2 + kh**2 + kw**2) / 50),
                       s=x.shape[2:], dim=(2, 3, 4))
err = (hp.gather(y_local, grid) - ref).abs().max().item()
if grid.rank == 0:
    print(f"FFT low-pass on {grid.spatial_shape}: max |split - one process| = {err:.1e}")
