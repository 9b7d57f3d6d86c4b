"""hybridpar.nn.set_global_shapes on a one-rank grid (no processes to spawn): every split layer and
layout module gets the global shape of its input from one meta-device forward, the model's own
forward is restored, and the model then computes what the plain torch model computes. The
multi-rank behaviour (no shape all-gather, same results) is checked in tests/test_dist_layers.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hybridpar as hp
from hybridpar.nn import (
    DistAvgPool3d,
    DistBatchNorm3d,
    DistConv3d,
    DistConvTranspose3d,
    DistGlobalAvgPool3d,
    DistMaxPool3d,
    Gather,
    set_global_shapes,
)


@pytest.fixture(scope="module")
def grid():
    started = not dist.is_initialized()
    hp.init_distributed()
    yield hp.ProcessGrid(data=1, pipe=1, spatial=(1, 1, 1))
    if started:  # later tests expect no group
        dist.destroy_process_group()


def test_shapes_recorded_and_forward_restored(grid):
    model = nn.Sequential(
        DistConv3d(2, 4, 3, padding=1, stride=(2, 1, 1), grid=grid), DistBatchNorm3d(4, grid=grid),
        nn.LeakyReLU(0.3), DistMaxPool3d(2, grid=grid), DistAvgPool3d(3, stride=1, padding=1, grid=grid),
        DistConvTranspose3d(4, 4, 2, stride=2, grid=grid), DistGlobalAvgPool3d(grid=grid),
        Gather(grid), nn.Flatten(), nn.Linear(4, 3))
    got = set_global_shapes(model, (2, 2, 13, 10, 9))
    assert got == {"0": (13, 10, 9), "1": (7, 10, 9), "3": (7, 10, 9), "4": (3, 5, 4), "5": (3, 5, 4),
                   "6": (6, 10, 8)}
    assert [getattr(m, "global_input_shape", None) for m in model][:7] == \
        [(13, 10, 9), (7, 10, 9), None, (7, 10, 9), (3, 5, 4), (3, 5, 4), (6, 10, 8)]
    assert model[7].shape == (1, 1, 1)
    assert all("forward" not in vars(m) for m in model)  # the class forward is back
    assert model[1].num_batches_tracked.item() == 0       # the meta pass touched no real buffer
    x = torch.randn(2, 2, 13, 10, 9)
    ref = nn.Sequential(*[m for m in model if not isinstance(m, Gather)])
    torch.testing.assert_close(model(x), ref(x))


def test_bad_shape_is_refused(grid):
    with pytest.raises(ValueError, match="5 positive ints N, C, D, H, W"):
        set_global_shapes(nn.Sequential(DistMaxPool3d(2, grid=grid)), (2, 13, 10, 9))


class _Resample(nn.Module):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__()
        self.args, self.kwargs = args, kwargs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.interpolate(x, *self.args, **self.kwargs)


@pytest.mark.parametrize("args,kwargs", [
    ((None, 1.7), {"mode": "trilinear", "align_corners": True}),
    (((5, 4, 9),), {"mode": "trilinear"}),
    ((None, (0.5, 2.0, 1.3)), {"mode": "area"}),
    ((None, 2.5, "trilinear", False, True), {}),  # the mode and recompute_scale_factor given by position
    ((None, 0.6), {"mode": "nearest-exact"}),
])
def test_a_meta_run_of_interpolate_gives_the_shape_a_run_gives(args, kwargs):
    """A meta run makes the linear modes' upsampling as nearest (nn/meta_kernels: their meta kernels are
    slow decompositions); the extents and layout must be those the mode itself gives, and the graph
    autograd records the mode's own."""
    from hybridpar.nn.meta import exact_operations, meta_call, meta_state

    x, m = torch.randn(1, 2, 7, 5, 6), _Resample(*args, **kwargs)
    state, _ = meta_state(m)
    for xs in (x, x.to(memory_format=torch.channels_last_3d)):
        out, want = meta_call(m, state, xs.to("meta").requires_grad_()), m(xs.requires_grad_())
        assert (out.shape, out.stride(), type(out.grad_fn)) == (want.shape, want.stride(), type(want.grad_fn))
        with exact_operations():
            assert meta_call(m, state, xs.to("meta")).shape == want.shape
