"""Bad input gets a clear error naming the layer, the dimension and what would fit; in one process
(a plain process gets a one-rank group without any launcher)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridpar as hp


@pytest.fixture(scope="module", autouse=True)
def grid():
    """A one-rank group for this module only: later tests must not inherit an initialised group.
    Before it exists, a grid or an engine is an error that says how to join one (never joined
    behind the program's back)."""
    if not torch.distributed.is_initialized():
        for make in (hp.ProcessGrid, lambda: hp.parallelize(_model(), {"grid": {}}, loss_fn=F.mse_loss)):
            with pytest.raises(RuntimeError, match=r"no process group yet; call hybridpar.init_distributed"):
                make()
    hp.init_distributed()
    yield hp.ProcessGrid()
    hp.process.launchers.shutdown()


def test_single_process_needs_no_launcher(grid):
    assert (grid.world_size, grid.spatial_shape) == (1, (1, 1, 1))
    conv = hp.nn.DistConv3d(2, 3, 3, padding=1, grid=grid)
    x = torch.randn(1, 2, 5, 6, 7)
    ref = nn.Conv3d(2, 3, 3, padding=1)
    ref.load_state_dict(conv.state_dict())
    torch.testing.assert_close(conv(x), ref(x))


def test_layer_errors_name_layer_and_fix(grid):
    with pytest.raises(TypeError, match="DistConv3d: pass grid=hybridpar.ProcessGrid"):
        hp.nn.DistConv3d(2, 3, 3)
    with pytest.raises(ValueError, match=r"DistConv3d: expected a 5-D \(N, C, D, H, W\) shard"):
        hp.nn.DistConv3d(2, 3, 3, grid=grid)(torch.randn(2, 5, 5, 5))
    with pytest.raises(NotImplementedError, match="return_indices"):
        hp.nn.DistMaxPool3d(2, return_indices=True, grid=grid)
    with pytest.raises(ValueError, match="padding 2 should be at most half"):
        hp.nn.DistMaxPool3d(3, padding=2, grid=grid)
    with pytest.raises(ValueError, match="stats must be 'spatial' or 'stage'"):
        hp.nn.DistBatchNorm3d(3, grid=grid, stats="global")
    with pytest.raises(ValueError, match=r"DistConvTranspose3d: on an input of global extents \[3, 3, 3\], "
                                          r"requested an output size of \[9, 6, 6\]"):
        hp.nn.DistConvTranspose3d(2, 2, 2, 2, grid=grid)(torch.randn(1, 2, 3, 3, 3), output_size=(9, 6, 6))
    with pytest.raises(ValueError, match="expected more than 1 value per channel"):
        hp.nn.DistBatchNorm3d(2, grid=grid)(torch.randn(1, 2, 1, 1, 1))
    with pytest.raises(ValueError, match="unknown transport 'tcp'"):
        hp.nn.DistConv3d(2, 2, 3, grid=grid, transport="tcp")(torch.randn(1, 2, 4, 4, 4))


def test_a_layer_without_a_split_form_is_refused_by_its_name(grid):
    """A model's layer whose Dist counterpart refuses its arguments: the refusal names the model's layer,
    not only the Dist class (a user reads their own module names)."""
    from hybridpar.pipeline.convert import to_distributed
    from hybridpar.planner import SpecError

    with pytest.raises(SpecError, match=r"^enc\.pool \(MaxPool3d\): DistMaxPool3d: return_indices=True "
                                        r"is not supported: .* ConvTranspose3d"):
        to_distributed(nn.MaxPool3d(2, return_indices=True), grid, name="enc.pool")


def test_grid_with_spatial_must_divide_the_stage(grid):
    with pytest.raises(ValueError, match=r"must divide the 1 ranks of a stage"):
        grid.with_spatial((2, 1, 1))


def _model():
    return nn.Sequential(OrderedDict(features=nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.ReLU()),
                                     head=nn.Sequential(nn.Flatten(), nn.Linear(2 * 64, 1))))


def test_engine_errors():
    class Branch(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Conv3d(1, 1, 3, padding=1)

        def forward(self, x):
            return x + self.a(x) if x.dim() == 5 else x

    with pytest.raises(hp.SpecError, match="torch.fx cannot trace the model's own forward.*module swapping"):
        hp.parallelize(Branch(), {"grid": {"data": 1, "pipe": 2}}, loss_fn=F.mse_loss)
    engine = hp.parallelize(_model(), {"grid": {"data": 1}}, loss_fn=F.mse_loss)
    for call in (engine.parameters, engine.full_state_dict, engine.local_state_dict):  # before any batch
        with pytest.raises(RuntimeError, match=r"Engine.\w+: the engine is built .* call shard_batch"):
            call()
    x, y = torch.randn(4, 1, 4, 4, 4), torch.randn(4, 1)
    x_local, y_local = engine.shard_batch(x, y)
    assert torch.isfinite(engine.train_step(x_local, y_local))
    for call in (lambda: engine.shard_batch(x, (y, y)), lambda: engine.train_step(x_local, {"y": y_local})):
        with pytest.raises(ValueError, match=r"^Engine.(shard_batch|train_step): the target must be one "
                                             r"tensor \(N, ...\), got (tuple|dict); targets of several"):
            call()
    for call in (lambda: engine.shard_batch(x, y[-1]), lambda: engine.train_step(x_local, y_local[-1])):
        with pytest.raises(ValueError, match=r"^Engine.(shard_batch|train_step): the target holds 1 along "
                                             r"dim 0 where the input holds 4 samples; the engine cuts the"):
            call()  # a model giving its last sample (h[-1]): one process trains it, a cut batch cannot
    with pytest.raises(hp.SpecError, match="micro"):
        hp.parallelize(_model(), {"grid": {"data": 1}, "pipeline": {"microbatches": 3}}, loss_fn=F.mse_loss,
                       input_shape=(4, 1, 4, 4, 4))
    with pytest.raises(hp.SpecError, match="per-replica batch of 1"):
        hp.parallelize(_model(), {"grid": {"data": 1}, "pipeline": {"microbatches": 2}}, loss_fn=F.mse_loss,
                       input_shape=(1, 1, 4, 4, 4))
    # a traced call across the samples of a batch that micro-batches split: each part would answer alone
    class WholeMean(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv3d(1, 1, 3, padding=1)

        def forward(self, x):
            h = self.conv(x)
            return h / h.abs().mean()

    with pytest.raises(hp.SpecError,
                       match=r"mean: mean \(over the samples. dim\) at test_errors.py:\d+: works across"):
        hp.parallelize(WholeMean(), {"grid": {"data": 1}, "pipeline": {"microbatches": 2}},
                       loss_fn=F.mse_loss, input_shape=(4, 1, 4, 4, 4))
    # BatchNorm on micro-batches: their statistics are not the batch's, refused unless accepted
    bn = lambda: nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.BatchNorm3d(2), nn.Flatten(),  # noqa: E731
                               nn.Linear(128, 1))
    for accept in (False, True):
        pipeline = {"microbatches": 2, **({"micro_batch_stats": True} if accept else {})}
        engine = hp.parallelize(bn(), {"grid": {"data": 1}, "pipeline": pipeline}, loss_fn=F.mse_loss)
        x_local, y_local = engine.shard_batch(x, y)
        if accept:
            assert torch.isfinite(engine.train_step(x_local, y_local))
        else:
            with pytest.raises(hp.SpecError, match=r"1 is a BatchNorm, which would normalise each of the 2 "):
                engine.train_step(x_local, y_local)
