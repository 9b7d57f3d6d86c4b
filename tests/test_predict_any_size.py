"""Prediction at any size, kept split, against one process running the plain torch model (float64,
1e-10 relative to the output's largest value).

An engine built at one size predicts inputs larger than, smaller than and of another aspect than it:
with ``gather=False`` each rank's output equals ``shard_batch(x, y)[1]`` of the single-process output
``y`` (its shard, laid out as a volume target), with ``gather=True`` the whole output. Each input is
sharded by ``shard_batch`` first and predicted afterwards, in turn, so that ``predict`` finds each size
from the shards themselves.

Models: a U-Net (average pooling, trilinear upsampling, concatenated skips, GroupNorm) with zero and
with circular (periodic) padding, a sequence with a strided convolution and an upsampling on odd
sizes, and a model torch.fx cannot trace (run by module swapping). Layouts: spatial (2,1,1), (2,2,1),
data 2 x (2,1,1), and a pipeline of two stages x (2,1,1), whose second stage passes no input (None)
and whose first stage returns None in place of the shards. Training after a prediction at another
size stays exact at the build size (losses and weights against one process), and a size the split
cannot take is refused in one line naming the layer and the largest split that fits, alike on every
rank, after which the engine still predicts exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from graph_models import Bottleneck, CheckedBottleneck, GuardedUNet, SizedUNet, UNet3d, Untraceable

TOL = 1e-10


def make_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "sized":
        return SizedUNet().double()
    if name == "guarded":
        return GuardedUNet().double()
    if name == "bottleneck":
        return Bottleneck().double()
    if name == "checked bottleneck":
        return CheckedBottleneck().double()
    if name == "swapped":
        return Untraceable().double()
    if name == "batchnorm":  # running statistics: the plan at another size runs on a meta copy of them
        bn = nn.BatchNorm3d(3)
        with torch.no_grad():
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
        layers = (nn.Conv3d(1, 3, 3, padding=1), bn, nn.ReLU(), nn.Conv3d(3, 1, 3, padding=1))
        return nn.Sequential(*layers).double()
    if name == "strided":
        model: nn.Module = nn.Sequential(
            nn.Conv3d(1, 3, 3, padding=1), nn.Conv3d(3, 4, 3, stride=2, padding=1), nn.GroupNorm(2, 4),
            nn.LeakyReLU(0.1), nn.Upsample(scale_factor=2, mode="trilinear"), nn.Conv3d(4, 1, 3, padding=1))
    else:
        model = UNet3d(1, 1, width=2, levels=2, padding_mode="circular" if name == "periodic" else "zeros")
    return model.double()


# build size, then sizes larger than, smaller than and of another aspect than it
SIZES = {"unet": [(12, 12, 12), (16, 16, 16), (8, 8, 8), (8, 16, 12)],
         "periodic": [(12, 12, 12), (16, 16, 16), (8, 8, 8), (16, 8, 12)],
         "strided": [(12, 12, 12), (17, 15, 16), (7, 9, 8), (9, 20, 5)],
         "swapped": [(12, 12, 12), (16, 16, 16), (8, 8, 8), (8, 16, 12)],
         "batchnorm": [(12, 12, 12), (17, 15, 16), (7, 9, 8)],
         "sized": [(13, 12, 11), (16, 16, 16), (9, 10, 12), (12, 17, 8)],
         "guarded": [(8, 8, 8), (16, 16, 16), (9, 10, 12), (7, 12, 9)],
         "bottleneck": [(4, 4, 8), (16, 16, 8), (8, 12, 8), (12, 8, 16)],
         "checked bottleneck": [(4, 4, 8), (16, 16, 8), (8, 12, 8), (12, 8, 16)]}


def _layout(data: int = 1, pipe: int = 1, spatial=(2, 1, 1), **layers) -> dict:
    return {"grid": {"data": data, "pipe": pipe, "spatial": list(spatial)},
            "pipeline": {"microbatches": 2 if pipe > 1 else 1},
            "layers": {name: {"spatial": list(split)} for name, split in layers.items()}}


def _volume(size: tuple[int, int, int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 1, *size, generator=g, dtype=torch.float64)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _refuse_body(rank: int, world: int) -> str:
    """An input of 2x8x8 on a split (2, 1, 1): the pooled 1x4x4 cannot be split in two along d."""
    import hybridpar as hp

    model = make_model("unet").eval()
    engine = hp.parallelize(make_model("unet"), _layout()).eval()
    x = _volume(SIZES["unet"][0], 0)
    x_local = engine.shard_batch(x)[0]
    small = engine.shard_batch(_volume((12, 12, 12), 1))[0][:, :, :1, :8, :8]  # a 2x8x8 volume's shard
    try:
        engine.predict(small, gather=False)
    except ValueError as err:
        line = str(err)
    else:
        raise AssertionError("a 2x8x8 input on a split (2, 1, 1) was not refused")
    with torch.no_grad():
        want = engine.shard_batch(x, model(x))[1]
    got = engine.predict(x_local, gather=False)
    assert _rel(got, want) <= TOL, f"after the refusal: relative error {_rel(got, want):.2e}"
    return line


class _ReflectToSixteen(torch.nn.Module):
    """A reflect pad up to 16 voxels, read from the shape: a crop (a call on the whole tensor, no split
    layer) on a larger input, where the build size's pad is a split layer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv3d(1, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 16 - x.shape[4], 0, 0, 0, 0), mode="reflect"))


def _shape_args_body(rank: int, world: int) -> None:
    """A traced call whose arguments from shapes make it another kind of layer at another size is
    refused in one line naming it (the built layer would run with the build size's pad, silently
    wrong); the build size stays exact."""
    import hybridpar as hp

    model = _ReflectToSixteen().double()
    engine = hp.parallelize(model, _layout(), input_shape=(2, 1, 12, 12, 10)).eval()
    with pytest.raises(ValueError, match=r"pad: its arguments, computed from shapes, make it the call on the "
                                         r"whole tensor at this size where the engine runs ReflectionPad3d"):
        engine.shard_batch(_volume((12, 12, 18), 0))
    x = _volume((12, 12, 10), 1)
    with torch.no_grad():
        want = model(x)
    assert _rel(engine.predict(engine.shard_batch(x)[0]), want) <= TOL


def test_a_call_whose_kind_changes_with_the_size_is_refused_there(pools):
    pools(2).run(_shape_args_body, timeout=300)


def _unmet_layer_body(rank: int, world: int) -> None:
    """A forward run by module swapping may make other calls at another size (a guard's pad, a layer called
    twice), but a layer of the model the build never ran is refused at a size that runs it, naming it."""
    import hybridpar as hp

    engine = hp.parallelize(make_model("guarded"), _layout(), input_shape=(2, 1, 8, 8, 8)).eval()
    with pytest.raises(ValueError, match=r"Engine.shard_batch: an input of 20x8x8 voxels \(C=1\): layers: "
                                         r"deep \(Conv3d\) runs at this size, where the engine never met it"):
        engine.shard_batch(_volume((20, 8, 8), 0))


def test_a_layer_the_build_never_ran_is_refused_at_a_size_that_runs_it(pools):
    pools(2).run(_unmet_layer_body, timeout=300)


def test_a_size_the_split_cannot_take_is_one_line(pools):
    lines = pools(2).run(_refuse_body, timeout=600)
    assert lines[0] == lines[1], f"the ranks refused differently:\n{lines[0]}\n{lines[1]}"
    line = lines[0]
    assert "\n" not in line, line
    assert line.startswith("Engine.predict: an input of 2x8x8 voxels"), line
    assert "pool.0" in line and "use a split of at most 1 along d" in line, line


def _predict_body(rank: int, world: int, name: str, layout: dict) -> None:
    import hybridpar as hp

    model = make_model(name).eval()
    engine = hp.parallelize(make_model(name), layout)
    engine.eval()
    sizes = SIZES[name]
    cases = []
    with torch.no_grad():
        for k, size in enumerate(sizes):
            x = _volume(size, k)
            y = model(x)
            cases.append((size, *engine.shard_batch(x, y), y))  # the first builds the engine
    per = 2 // engine.grid.data
    rows = slice(engine.grid.data_index * per, (engine.grid.data_index + 1) * per)
    failures = []
    for size, x_local, y_local, y in [*cases[1:], cases[0]]:  # each predict finds its size from the shards
        out = engine.predict(x_local if engine.first_stage else None, gather=False)  # later: no input
        if not engine.last_stage:
            if out is not None:
                failures.append(f"{size}: a stage before the last got {type(out).__name__}, not None")
        elif out.shape != y_local.shape:
            failures.append(f"{size}: gather=False shard {tuple(out.shape)} vs shard_batch's "
                            f"{tuple(y_local.shape)}")
        elif not _rel(out, y_local) <= TOL:
            failures.append(f"{size}: gather=False relative error {_rel(out, y_local):.2e}")
        if size == sizes[1]:  # gather=True at another size: the whole output on every rank
            whole = engine.predict(x_local if engine.first_stage else None)
            if whole.shape != y[rows].shape or not _rel(whole, y[rows]) <= TOL:
                failures.append(f"{size}: gather=True output {tuple(whole.shape)} vs {tuple(y[rows].shape)}")
    assert not failures, f"rank {rank} ({name}, {layout['grid']}):\n" + "\n".join(failures)


PREDICT_CASES = [
    (2, "unet", _layout()), (2, "strided", _layout()), (2, "swapped", _layout()), (2, "batchnorm", _layout()),
    (2, "strided", _layout(**{"4": (1, 2, 1)})),  # Redistributes before and after the upsampling
    (4, "periodic", _layout(spatial=(2, 2, 1))), (4, "strided", _layout(spatial=(2, 2, 1))),
    (4, "periodic", _layout(data=2)), (4, "strided", _layout(data=2)),
    (4, "unet", _layout(pipe=2)), (4, "strided", _layout(pipe=2)),
    (2, "sized", _layout()), (4, "sized", _layout(spatial=(2, 2, 1))), (4, "sized", _layout(pipe=2)),
    (2, "guarded", _layout()), (4, "guarded", _layout(spatial=(2, 2, 1))), (4, "guarded", _layout(data=2)),
    (2, "bottleneck", _layout()), (4, "bottleneck", _layout(spatial=(2, 2, 1))),
    (2, "checked bottleneck", _layout()), (4, "checked bottleneck", _layout(spatial=(2, 2, 1))),
]


def _id(world: int, name: str, layout: dict) -> str:
    g = layout["grid"]
    rules = "".join(f"-{k}s{''.join(map(str, v['spatial']))}" for k, v in layout["layers"].items())
    return f"{world}-d{g['data']}p{g['pipe']}s{''.join(map(str, g['spatial']))}{rules}-{name}"


@pytest.mark.parametrize("world,name,layout", PREDICT_CASES, ids=[_id(*c) for c in PREDICT_CASES])
def test_predict_at_any_size(pools, world, name, layout):
    pools(world).run(_predict_body, name, layout, timeout=600)


def _train_body(rank: int, world: int, name: str, layout: dict) -> None:
    """Two SGD steps at the build size with a prediction at a larger one between them."""
    import hybridpar as hp

    build, other = SIZES[name][0], SIZES[name][1]
    batches = [(_volume(build, 10 + s), _volume(build, 20 + s)) for s in range(2)]
    ref = make_model(name)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses = []
    x_big = _volume(other, 3)
    for x, y in batches:
        loss = F.mse_loss(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
        if len(ref_losses) == 1:
            with torch.no_grad():
                y_big = ref(x_big)  # what the prediction after the first step gives
    engine = hp.parallelize(make_model(name), layout, loss_fn=F.mse_loss)
    failures = []
    opt = None
    for step, (x, y) in enumerate(batches):
        x_local, y_local = engine.shard_batch(x, y)
        opt = opt or torch.optim.SGD(engine.parameters(), lr=0.1)
        loss = engine.train_step(x_local, y_local)
        opt.step()
        opt.zero_grad()
        if not abs(loss.item() - ref_losses[step]) <= TOL * abs(ref_losses[step]):
            failures.append(f"step {step}: loss {loss.item()} vs {ref_losses[step]}")
        if step == 0:  # predict at another size, with the weights after the first step
            want = engine.shard_batch(x_big, y_big)[1]
            got = engine.predict(engine.shard_batch(x_big)[0], gather=False)
            if not _rel(got, want) <= TOL:
                failures.append(f"predict at {other} after a step: relative error {_rel(got, want):.2e}")
    state = engine.full_state_dict()
    for k, v in ref.state_dict().items():
        if not _rel(state[k], v) <= TOL:
            failures.append(f"{k}: relative error {_rel(state[k], v):.2e}")
    assert not failures, f"rank {rank} ({name}, {layout['grid']}):\n" + "\n".join(failures)


TRAIN_CASES = [(4, "unet", _layout(spatial=(2, 2, 1))), (4, "strided", _layout(data=2)),
               (2, "sized", _layout()), (2, "guarded", _layout())]


@pytest.mark.parametrize("world,name,layout", TRAIN_CASES, ids=[_id(*c) for c in TRAIN_CASES])
def test_training_stays_exact_after_predict_at_another_size(pools, world, name, layout):
    pools(world).run(_train_body, name, layout, timeout=600)


def test_the_volume_is_found_from_its_shards_alone():
    """``volume_of`` (no communication): the extent of an odd volume from the shards of a (2, 3, 1)
    split as ``shard_batch`` cuts it; a shard of another extent than the volume's layout gives it, or
    a missing shard, is one line."""
    from hybridpar.geometry import shard_range
    from hybridpar.pipeline.sizes import volume_of

    parts, volume = (2, 3, 1), (9, 10, 7)
    shards = {(i, j, k): tuple(b - a for a, b in (shard_range(volume[x], parts[x], c)
                                                  for x, c in enumerate((i, j, k))))
              for i in range(2) for j in range(3) for k in range(1)}
    assert volume_of(shards, parts) == volume
    assert shards[(1, 2, 0)] == (4, 3, 7)
    with pytest.raises(ValueError, match=r"do not tile one volume .*: the shard at \[1, 2, 0\] .* holds "
                                         r"4x4x7 voxels where a volume of 9x10x7 gives it 4x3x7"):
        volume_of({**shards, (1, 2, 0): (4, 4, 7)}, parts)
    with pytest.raises(ValueError, match=r"no input shard came from the ranks at \[\[0, 1, 0\]\]"):
        volume_of({c: s for c, s in shards.items() if c != (0, 1, 0)}, parts)
