"""Models with skip connections, parallelized whole: ``hp.parallelize`` on a U-Net (skip
concatenations, GroupNorm, trilinear upsampling, periodic padding) and a residual network, on data x
spatial and pipe x spatial layouts with a pipeline cut that skip tensors cross. Three SGD steps in
float64 against the same model in one process (``test_user_models._compare``): every step's loss and,
at the end, every parameter and buffer within 1e-9 (relative), and predictions. One spawned group per
world size runs every case; a failure names its case."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import distributed
import graph_models
from layer_cases import Failures
from test_user_models import _compare  # three steps, the state dict, predict: against one process

SHAPE = (4, 1, 12, 8, 8)


def _body(rank: int, world: int, cases: list[tuple[str, str, dict]]) -> None:
    fails = Failures()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(SHAPE, dtype=torch.float64, generator=g)
    y_volume = torch.randn((SHAPE[0], 1, *SHAPE[2:]), dtype=torch.float64, generator=g)
    y_params = torch.randn((SHAPE[0], 3), dtype=torch.float64, generator=g)
    for desc, model, spec in cases:
        make = getattr(graph_models, model)
        y = y_params if model == "ResNet3d" else y_volume
        try:
            _compare(fails, f"{desc} {spec}", make, spec, x, y, F.mse_loss)
        except Exception as err:  # name the case, then go on with the others
            fails.append(f"{desc} {spec}: {type(err).__name__}: {err}")
    fails.raise_if_any(rank)


# data x spatial, and pipe x spatial with cuts inside the encoder (skips cross them) and inside a residual
# block (its input crosses with the block's output); one pytest test each, a world size sharing a pool
CASES = [
    (1, "unet", "UNet3d", {"grid": {"data": 1}}),
    (1, "resnet", "ResNet3d", {"grid": {"data": 1}}),
    (4, "unet data x spatial", "UNet3d", {"grid": {"data": 2, "spatial": [2, 1, 1]}}),
    (4, "unet spatial 2x2", "UNet3d", {"grid": {"spatial": [2, 1, 2]}}),
    (4, "reconstruction U-Net spatial 2x2", "CosmoUNet", {"grid": {"spatial": [2, 2, 1]}}),
    (4, "unet pipe x spatial, skips cross the cut", "UNet3d",
     {"grid": {"pipe": 2, "spatial": [2, 1, 1]},
      "pipeline": {"microbatches": 2, "stages": ["enc.0.0", "enc.2.0"]}}),
    (4, "unet pipe x spatial 1f1b auto", "UNet3d",
     {"grid": {"pipe": 2, "spatial": [1, 2, 1]}, "pipeline": {"microbatches": 4, "schedule": "1f1b"}}),
    (4, "resnet pipe x spatial, cut inside a block", "ResNet3d",
     {"grid": {"pipe": 2, "spatial": [2, 1, 1]},
      "pipeline": {"microbatches": 1, "stages": ["stem", "block1.conv2"]}}),
    (4, "resnet spatial", "ResNet3d", {"grid": {"spatial": [2, 2, 1]}}),
    (4, "functional layers data x spatial", "FunctionalNet", {"grid": {"data": 2, "spatial": [1, 1, 2]}}),
    (4, "functional layers pipe x spatial", "FunctionalNet",
     {"grid": {"pipe": 2, "spatial": [2, 1, 1]},
      "pipeline": {"microbatches": 2, "stages": ["conv1", "interpolate"]}}),
]


@pytest.mark.parametrize("world,desc,model,spec", CASES, ids=[c[1].replace(" ", "_") for c in CASES])
def test_graph_models_match_torch(pools, world, desc, model, spec):
    pools(world).run(_body, [(desc, model, spec)], timeout=600)


def test_skip_crosses_the_cut_and_stage_holds_only_its_layers():
    """The plan carries every live tensor across a cut; each stage's module holds its layers only."""
    from hybridpar.planner import ParallelSpec
    from hybridpar.planner.analysis import analyse
    from hybridpar.planner.stages import live_across

    a = analyse(graph_models.UNet3d(), SHAPE)
    index = a.graph.index()
    cut = index["enc.2.0"] - 1
    assert "enc.0.2" in live_across(a.graph)[cut] and "enc.1.2" in live_across(a.graph)[cut]
    spec = ParallelSpec.from_dict({"grid": {"pipe": 2}, "pipeline": {"microbatches": 2,
                                                                      "stages": ["enc.0.0", "enc.2.0"]}})
    plan = spec.plan(graph_models.UNet3d(), SHAPE, 2)
    assert {r.stage for r in plan if r.name.startswith("dec")} == {1}
    from hybridpar.planner import explain

    assert "cut 0 -> 1 carries enc.0.2, enc.1.2, pool.1" in explain(spec, graph_models.UNet3d(), SHAPE, 2)


def _swapped_body(rank: int, world: int) -> None:
    import hybridpar as hp

    fails = Failures()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(SHAPE, dtype=torch.float64, generator=g)
    y = torch.randn((SHAPE[0], 1, *SHAPE[2:]), dtype=torch.float64, generator=g)
    for spec in ({"grid": {"data": 2, "spatial": [2, 1, 1]}}, {"grid": {"spatial": [1, 2, 2]}}):
        _compare(fails, f"module swapping {spec}", graph_models.Untraceable, spec, x, y, F.mse_loss)
    try:
        hp.parallelize(graph_models.Untraceable(), {"grid": {"pipe": 2, "spatial": [2, 1, 1]}},
                       loss_fn=F.mse_loss)
        fails.append("a pipeline over an untraceable model did not fail")
    except hp.SpecError as err:
        if "torch.fx cannot trace" not in str(err) or "module swapping" not in str(err):
            fails.append(f"pipeline over an untraceable model: {err}")
    fails.raise_if_any(rank)


def test_untraceable_model_runs_by_module_swapping():
    """Without a pipeline, a forward torch.fx cannot trace runs on shards with its layers swapped;
    the same three steps as one process; with a pipeline it is an error saying why."""
    distributed.run(_swapped_body, 4, timeout=300)
