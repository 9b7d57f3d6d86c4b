"""Third-party 3D networks parallelized by a spec, exactly: MONAI's (a test-only dependency) on 2 and 4
ranks, two SGD steps in float64 against one process (the second runs on weights the first one's
gradients moved), the state dict key for key (``_compare`` of
``test_user_models``). Each model is the library's own class at a small width; what it needs from the
user is what the README's "any model" section says: nothing. Layers too small to split (resnet10's and
VNet's last levels at 2^3 and 1^3) are replicated by the planner, and blocks torch.fx cannot trace into
(RegUNet's) run split by module swapping inside them, with no rule."""

from __future__ import annotations

import pytest
import torch

from test_user_models import Failures, _compare

monai = pytest.importorskip("monai")

SHAPE = (2, 1, 16, 16, 16)
# resnet10's last BatchNorms see one voxel per sample: 4 samples keep them well conditioned in float64
# (with 2, a few SGD steps drift by ~1e-8 whatever the layout). VNet's too, but its fixed widths cost
# 17 GFLOPs a forward at 2 x 16^3: one step (the weights after it hold the gradient) at 2 samples. The
# BasicUNets' instance norms see one sample at a time: one sample of 32 x 32 x 16 (their last level 2 x 2 x 1)
SHAPES = {"BasicUNet": (1, 1, 32, 32, 16), "BasicUNetPlusPlus": (1, 1, 32, 32, 16),
          "resnet10": (4, 1, 16, 16, 16),
          # RegUNet's encode_pools (untraceable: they check that their input's extents are even) run split
          # by module swapping inside them: the second reads 10 voxels along d where each shard holds 5
          "RegUNet": (2, 1, 20, 16, 16)}


def _nets():
    from monai.networks import nets

    return nets


def DynUNet():  # noqa: N802 (named as the model it builds)
    return _nets().DynUNet(3, 1, 1, kernel_size=[3, 3, 3], strides=[1, 2, 2], upsample_kernel_size=[2, 2],
                           filters=[4, 8, 8], res_block=True)


def BasicUNet():  # noqa: N802
    return _nets().BasicUNet(3, 1, 1, features=(4, 4, 8, 8, 8, 4))


def BasicUNetPlusPlus():  # noqa: N802
    return _nets().BasicUNetPlusPlus(3, 1, 1, features=(4, 4, 8, 8, 8, 4), deep_supervision=True)


def RegUNet():  # noqa: N802
    return _nets().RegUNet(3, 1, num_channel_initial=4, depth=2, out_channels=1)


def VNet():  # noqa: N802
    """MONAI's VNet (fixed widths 16..256, 5^3 convs) without dropout (random masks differ between a
    shard and the whole; up_tr64 and up_tr32 fix theirs at 0.5): on 16^3 its last level is 1^3."""
    net = _nets().VNet(3, 1, 1, dropout_prob_down=0.0, dropout_prob_up=(0.0, 0.0))
    for m in net.modules():
        if isinstance(m, torch.nn.Dropout3d):
            m.p = 0.0
    return net


def resnet10():
    """MONAI's resnet10 (one basic block per level) at a small width: on 16^3 its last level (layer4)
    reads 2^3 voxels and writes 1^3."""
    return _nets().ResNet("basic", [1, 1, 1, 1], [4, 8, 8, 8], spatial_dims=3, n_input_channels=1,
                          num_classes=3)


def _loss(out, y):
    """A volume loss, or one per deep-supervision head (BasicUNet++ returns a list)."""
    import torch.nn.functional as F

    if isinstance(out, list):
        return sum(F.mse_loss(o, y) for o in out) / len(out)
    return F.mse_loss(out, y)


STEPS = {"VNet": 1}
"""SGD steps per model (default 2)."""
WEIGHTS_ONLY = ("VNet",)
"""Models whose trained weights are compared from the model itself, without the full state dict's round
trip (the code every other model goes through; 45M weights in float64 spend seconds in copies)."""


def _body(rank: int, world: int, cases: list[tuple[str, str, dict]]) -> None:
    fails = Failures()
    g = torch.Generator().manual_seed(7)
    for desc, model, spec in cases:
        shape = SHAPES.get(model, SHAPE)
        x = torch.randn(shape, dtype=torch.float64, generator=g)
        y_shape = (shape[0], 3) if model == "resnet10" else (shape[0], 1, *shape[2:])
        y = torch.randn(y_shape, dtype=torch.float64, generator=g)
        try:
            _compare(fails, f"{desc} {spec}", globals()[model], spec, x, y, _loss, STEPS.get(model, 2),
                     round_trip=model not in WEIGHTS_ONLY)
        except Exception as err:  # name the case, then go on with the others
            fails.append(f"{desc} {spec}: {type(err).__name__}: {err}")
    fails.raise_if_any(rank)


NAMES = {"DynUNet": "DynUNet aliased blocks", "BasicUNet": "BasicUNet isinstance and shape checks",
         "BasicUNetPlusPlus": "BasicUNet++ deep supervision list",
         "RegUNet": "RegUNet interpolate to a shape, untraceable even-extent check",
         "resnet10": "resnet10 2^3 last level, no rule",
         "VNet": "VNet 1^3 last level, no rule"}
# every model on the two splits, (2, 1, 1) on 2 ranks and (2, 2, 1) on 4; VNet's 17 GFLOPs a
# forward in float64 on 4 ranks oversubscribing 2 cores cost half a minute, so on (2, 2, 1) its plan is
# checked (test_function_pads_and_channel_repeats_gather_nothing) and its numbers on (2, 1, 1) only
CASES = [(world, NAMES[model], model, {"grid": {"spatial": split}})
         for world, split in ((2, [2, 1, 1]), (4, [2, 2, 1])) for model in NAMES
         if not (model == "VNet" and world == 4)]


@pytest.mark.parametrize("world,desc,model,spec", CASES, ids=[c[1].split()[0] + f"-{c[0]}" for c in CASES])
def test_monai_models_match_one_process(pools, world, desc, model, spec):
    pools(world).run(_body, [(desc, model, spec)], timeout=300)


def test_function_pads_and_channel_repeats_gather_nothing():
    """MedNeXt pads with ``F.pad`` and VNet repeats its input's channels (``x.repeat(1, 16, 1, 1, 1)``):
    both plan as split layers, with no gather."""
    import hybridpar as hp

    nets = _nets()
    spec = hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 2, 1]}})
    for model in (nets.MedNeXt(spatial_dims=3, init_filters=4, in_channels=1, out_channels=1),
                  nets.VNet(3, 1, 1)):
        plan = spec.plan(model, (2, 1, 32, 32, 32), 4)
        assert not [r.name for r in plan if r.gather or r.split == (1, 1, 1) and len(r.input_shape) == 5]
        assert {"pad", "repeat"} & {r.kind for r in plan}
