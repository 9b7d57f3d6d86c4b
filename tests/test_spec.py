"""The parallelism spec: parsing, validation messages, plan resolution, stage balancing, ``explain``.

Checked against: hand-written expected dataclasses and messages (each error says what would fit);
shapes and halos worked out by hand for a known split; FLOPs and parameter counts against the
CosmoFlow figures (68.9 GFLOP forward per 128^3 sample, 8,907,556 parameters) and against torch's
own ``FlopCounterMode``; automatic stage placement against brute force over every partition.
No process is spawned: the CLI runs in-process through ``main``.
"""

from __future__ import annotations

import itertools
import math
import sys
import types
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

from hybridpar.planner import (
    GridSpec,
    LayerRule,
    ParallelSpec,
    PipelineSpec,
    SpecError,
    balance_stages,
    explain,
    load_spec,
)
from hybridpar.planner.__main__ import main
from hybridpar.planner.analysis import forward_flops, layer_flops, sequential_layers, trace_shapes
from hybridpar.planner.explain import COLUMNS

ROOT = Path(__file__).resolve().parents[1]
COSMO = (1, 4, 128, 128, 128)
ISSUE_YAML = """
grid: {data: 2, pipe: 2, spatial: [2, 1, 1]}
pipeline:
  schedule: gpipe
  microbatches: 4
  stages: auto
  recompute: false
layers:
  "features.0*": {spatial: [2, 1, 1]}
  "features.12*": {spatial: [1, 1, 1]}
  "head.*": {spatial: replicate}
"""


def cosmoflow_like() -> nn.Sequential:
    """The MLPerf CosmoFlow model: 5 x [conv k3 'same', LeakyReLU(0.3), maxpool 2], dense head."""
    feats: list[nn.Module] = []
    cin = 4
    for cout in (32, 64, 128, 256, 512):
        feats += [nn.Conv3d(cin, cout, 3, padding=1), nn.LeakyReLU(0.3), nn.MaxPool3d(2)]
        cin = cout
    head = [nn.Flatten(), nn.Linear(32768, 128), nn.LeakyReLU(0.3), nn.Dropout(0.5), nn.Linear(128, 64),
            nn.LeakyReLU(0.3), nn.Dropout(0.5), nn.Linear(64, 4), nn.Tanh()]
    return nn.Sequential(OrderedDict(features=nn.Sequential(*feats), head=nn.Sequential(*head)))


def small(width: int = 4, kernel: int = 3) -> nn.Sequential:
    """Two conv blocks and a linear head on 2 x 16^3 inputs (16 -> 8 -> 4 voxels per dim)."""
    return nn.Sequential(OrderedDict(
        features=nn.Sequential(nn.Conv3d(2, width, kernel, padding=kernel // 2), nn.ReLU(), nn.MaxPool3d(2),
                               nn.Conv3d(width, width, kernel, padding=kernel // 2), nn.ReLU(),
                               nn.MaxPool3d(2)),
        head=nn.Sequential(nn.Flatten(), nn.Linear(width * 64, 3))))


def spec_of(grid: dict | None = None, pipeline: dict | None = None, layers: dict | None = None):
    return ParallelSpec.from_dict({"grid": grid or {}, "pipeline": pipeline or {}, "layers": layers or {}})


def raises(match_all: list[str], fn, *args, **kwargs) -> str:
    """Call ``fn``; it must raise SpecError whose message contains every string in ``match_all``."""
    with pytest.raises(SpecError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    for part in match_all:
        assert part in msg, f"{part!r} not in message: {msg}"
    return msg


# ---------------------------------------------------------------------------------------------- parsing
def test_issue_example_parses_to_typed_dataclasses():
    """The YAML of the issue gives the dataclasses written out by hand, rules in file order."""
    spec = ParallelSpec.from_yaml(ISSUE_YAML)
    assert spec == ParallelSpec(
        GridSpec(2, 2, (2, 1, 1)), PipelineSpec("gpipe", 4, "auto", False),
        (LayerRule("features.0*", (2, 1, 1)), LayerRule("features.12*", (1, 1, 1)),
         LayerRule("head.*", "replicate")))
    assert spec.layers[2].split == (1, 1, 1)


def test_round_trips_dict_and_yaml(tmp_path):
    """from_dict(to_dict()) and load_spec(to_yaml()) give back an equal spec; defaults fill gaps."""
    spec = ParallelSpec.from_dict({
        "grid": {"data": -1, "pipe": 2, "spatial": [2, 2, 1]},
        "pipeline": {"schedule": "1f1b", "microbatches": 8, "stages": ["a", "b"], "recompute": True},
        "layers": {"a*": {"spatial": [4, 1, 1]}, "b": {"spatial": "replicate"}}})
    assert ParallelSpec.from_dict(spec.to_dict()) == spec
    path = tmp_path / "s.yaml"
    path.write_text(spec.to_yaml())
    assert load_spec(path) == spec
    assert spec.to_dict()["pipeline"]["stages"] == ["a", "b"]
    assert ParallelSpec.from_dict({}) == ParallelSpec() == ParallelSpec.from_yaml("")
    assert ParallelSpec.from_dict({}).to_dict() == {
        "grid": {"data": 1, "pipe": 1, "spatial": [1, 1, 1]},
        "pipeline": {"schedule": "gpipe", "microbatches": 1, "stages": "auto", "recompute": False},
        "layers": {}}


def test_example_config_is_valid_for_four_ranks():
    """launch/configs/hybrid.yaml: data 1 x pipe 2 x spatial (2,1,1), 2 micro-batches, fits CosmoFlow."""
    spec = load_spec(ROOT / "launch" / "configs" / "hybrid.yaml")
    assert spec.grid == GridSpec(1, 2, (2, 1, 1)) and spec.pipeline.microbatches == 2
    plan = spec.plan(cosmoflow_like(), (2, 4, 128, 128, 128), world_size=4)
    assert {r.stage for r in plan} == {0, 1}


@pytest.mark.parametrize(("d", "where", "near"), [
    ({"gird": {}}, "spec", "grid"),
    ({"grid": {"spacial": [1, 1, 1]}}, "grid", "spatial"),
    ({"pipeline": {"microbatch": 2}}, "pipeline", "microbatches"),
    ({"pipeline": {"recompte": True}}, "pipeline", "recompute"),
    ({"layers": {"x": {"spatail": [1, 1, 1]}}}, "layers['x']", "spatial"),
])
def test_unknown_key_suggests_nearest_and_lists_valid(d, where, near):
    """Every level rejects unknown keys, names the nearest valid one and lists them all."""
    msg = raises([f"{where}: unknown key", f"did you mean {near!r}", "valid keys:", near],
                 ParallelSpec.from_dict, d)
    assert msg.startswith(where)


@pytest.mark.parametrize(("d", "parts"), [
    ({"pipeline": {"schedule": "pipedream"}}, ["pipeline.schedule", "'pipedream'", "gpipe, 1f1b"]),
    ({"pipeline": {"schedule": "1F1B"}}, ["did you mean '1f1b'"]),
    ({"pipeline": {"microbatches": 0}}, ["pipeline.microbatches", ">= 1", "got 0"]),
    ({"pipeline": {"microbatches": "4"}}, ["pipeline.microbatches", "got '4'"]),
    ({"pipeline": {"microbatches": True}}, ["pipeline.microbatches", "got True"]),
    ({"pipeline": {"recompute": "yes"}}, ["pipeline.recompute", "true or false"]),
    ({"pipeline": {"stages": "manual"}}, ["pipeline.stages", "'auto' or a list of layer names"]),
    ({"pipeline": {"stages": []}}, ["pipeline.stages", "'auto' or a list"]),
    ({"grid": {"pipe": 2}, "pipeline": {"stages": ["a", "a"]}}, ["a given more than once"]),
    ({"grid": {"spatial": [2, 1]}}, ["grid.spatial", "3 positive integers [d, h, w]", "[2, 1]"]),
    ({"grid": {"spatial": [0, 1, 1]}}, ["grid.spatial", "[0, 1, 1]"]),
    ({"grid": {"spatial": "replicate"}}, ["grid.spatial", "3 positive integers"]),
    ({"grid": {"data": 0}}, ["grid.data", ">= 1 or -1 (the ranks left over)", "got 0"]),
    ({"grid": {"data": -1, "pipe": -1}}, ["at most one size may be -1", "data(-1) * pipe(-1)"]),
    ({"layers": {"x": {"spatial": "replicated"}}}, ["layers['x'].spatial", "or 'replicate'"]),
    ({"layers": {"x": {"spatial": [2, 1, 1.5]}}}, ["layers['x'].spatial", "3 positive integers"]),
    ({"layers": {"x": {}}}, ["layers['x']: missing key 'spatial'", "spatial: replicate"]),
    ({"layers": ["x"]}, ["layers: expected a mapping"]),
    ({"grid": {"pipe": 2}, "pipeline": {"stages": ["a", "b", "c"]}},
     ["3 stage start(s) given (a, b, c) but grid.pipe is 2", "exactly 2 layer names"]),
    ({"grid": {"spatial": [2, 2, 1]}, "layers": {"x": {"spatial": [3, 1, 1]}}},
     ["layers['x'].spatial", "uses 3 ranks", "does not divide the 4 ranks of a stage", "divides 4"]),
])
def test_bad_values_say_what_would_fit(d, parts):
    """Bad types and values are refused when the spec is built, naming the key and the valid choices."""
    raises(parts, ParallelSpec.from_dict, d)


def test_constructors_validate_too():
    """Direct dataclass construction runs the same checks as from_dict (one validation path)."""
    raises(["pipeline.schedule"], PipelineSpec, schedule="zb")
    raises(["layers['h*'].spatial"], LayerRule, "h*", (1, 1))
    assert GridSpec(spatial=[2, 1, 1]).spatial == (2, 1, 1)


def test_load_spec_names_the_file(tmp_path):
    """Errors from a file are prefixed with its path; broken YAML is a SpecError, not a traceback."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("grid: {dta: 2}\n")
    raises([str(bad), "grid: unknown key 'dta'", "did you mean 'data'"], load_spec, bad)
    bad.write_text("grid: [1, 2\n")
    raises([str(bad), "not valid YAML"], load_spec, bad)


# ---------------------------------------------------------------------------------------------- grid
def test_resolve_grid_fills_minus_one_anywhere():
    """-1 takes the ranks left over, whichever size it is in."""
    spec = spec_of({"data": -1, "pipe": 2, "spatial": [2, 1, 1]})
    assert spec.resolve_grid(8).grid == GridSpec(2, 2, (2, 1, 1))
    assert spec_of({"data": 2, "pipe": -1}).resolve_grid(6).grid == GridSpec(2, 3, (1, 1, 1))
    assert spec_of({"spatial": [2, -1, 1]}).resolve_grid(8).grid == GridSpec(1, 1, (2, 4, 1))
    spec = spec_of({"data": 2, "pipe": 2, "spatial": [2, 1, 1]})
    assert spec.resolve_grid(8) == spec


def test_resolve_grid_prints_the_arithmetic():
    """Product != world size prints data(..) * pipe(..) * spatial(..) = P != world size W and what fits."""
    spec = spec_of({"data": 2, "pipe": 2, "spatial": [2, 1, 1]})
    raises(["data(2) * pipe(2) * spatial(2*1*1) = 8 != world size 4", "launch 8 ranks", "-1",
            "data: 1 or pipe: 1 or spatial: [1, 1, 1]"], spec.resolve_grid, 4)
    raises(["data(2) * pipe(-1) * spatial(2*1*1)", "multiply to 4", "does not divide world size 6",
            "multiple of 4"], spec_of({"data": 2, "pipe": -1, "spatial": [2, 1, 1]}).resolve_grid, 6)


def test_minus_one_resolution_rechecks_stages_and_rules():
    """Checks deferred while a size was -1 run once it is filled in."""
    spec = spec_of({"pipe": -1}, {"stages": ["features.0", "head"]})
    raises(["2 stage start(s)", "grid.pipe is 4"], spec.resolve_grid, 4)
    spec = spec_of({"spatial": [-1, 1, 1]}, layers={"x": {"spatial": [4, 1, 1]}})
    raises(["uses 4 ranks", "does not divide the 2 ranks"], spec.resolve_grid, 2)


# ---------------------------------------------------------------------------------------------- model checks
def test_glob_matching_no_layer_lists_names():
    spec = spec_of(layers={"feature.0*": {"spatial": "replicate"}})
    raises(["layers['feature.0*']: the glob matches no layer", "close: features.0",
            "features.0, features.1", "head.1 (8 layers)"], spec.plan, small(), (2, 2, 16, 16, 16))


def test_split_finer_than_halo_names_layer_input_and_split():
    """A k5 conv needs 2 halo voxels; split 8 ways its 8^3 input leaves shards of 1 voxel."""
    model = nn.Sequential(nn.Conv3d(1, 1, 5, padding=2), nn.ReLU())
    spec = spec_of({"spatial": [8, 1, 1]})
    raises(["0 (Conv3d)", "split [8, 1, 1]", "input of 8x8x8 voxels", "dim d", "halo of 2",
            "shard of 1", "use a split of at most 4 along d"], spec.plan, model, (1, 1, 8, 8, 8))
    # CosmoFlow's fourth pool turns 16^3 into 8^3: split 16 ways, its output shards would be empty;
    # strict: true refuses, as every spec did before layers too small to split were replicated
    strict = ParallelSpec.from_dict({"grid": {"spatial": [16, 1, 1]}, "strict": True})
    raises(["features.11 (MaxPool3d)", "input of 16x16x16 voxels", "split [16, 1, 1]", "output extent 8",
            "at most 8 along d"], strict.plan, cosmoflow_like(), COSMO)


def test_layers_too_small_to_split_are_replicated_until_the_volume_is_large_again():
    """Without strict, the pool whose output is thinner than the split and the volume layers after it
    run replicated (one redistribute into it), marked ``!`` in explain and the banner; the dense
    head is replicated as always; a layer rule and the first layer that splits the input still refuse."""
    from hybridpar.planner.explain import banner

    spec = spec_of({"spatial": [16, 1, 1]})
    plan = spec.plan(cosmoflow_like(), COSMO)
    auto = [r.name for r in plan if r.auto_replicated]
    assert auto == ["features.11", "features.12", "features.13", "features.14"]
    assert all(r.replicated for r in plan if r.name in auto) and not any(r.gather for r in plan)
    assert all(r.split == (16, 1, 1) for r in plan[:11])
    assert [r.name for r in plan if r.redistribute] == ["features.11"]
    assert "output of 8x8x8 voxels is fewer than the split [16, 1, 1] along d" in plan[11].auto_replicated
    table = explain(spec, cosmoflow_like(), COSMO)
    assert "  ! replicated from here (its output of 8x8x8" in table and table.count("repl!") == 4
    lines = banner(spec.resolve_grid(16), plan).splitlines()
    assert len(lines) == 3 and lines[0].startswith("layout: grid data(1) * pipe(1) * spatial(16*1*1)")
    assert "11 of 16 volume layers split 16x1x1" in lines[2] and "features.11!, features.12!" in lines[2]
    # back to split where the volume allows: a conv of 8^3 on 2 ranks after a pool too thin for 8
    model = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.MaxPool3d(4), nn.Conv3d(2, 2, 3, padding=1),
                          nn.Upsample(scale_factor=4), nn.Conv3d(2, 1, 3, padding=1))
    plan = spec_of({"spatial": [8, 1, 1]}).plan(model, (1, 1, 16, 16, 16))
    assert [(r.split, bool(r.auto_replicated)) for r in plan] == [
        ((8, 1, 1), False), ((1, 1, 1), True), ((1, 1, 1), True), ((1, 1, 1), True), ((8, 1, 1), False)]
    ruled = spec_of({"spatial": [16, 1, 1]}, layers={"features.11": {"spatial": [16, 1, 1]}})
    raises(["features.11 (MaxPool3d)", "output extent 8"], ruled.plan, cosmoflow_like(), COSMO)


def test_strict_is_a_spec_key():
    """strict: true parses from YAML and dict, round-trips, and only a bool is accepted."""
    spec = ParallelSpec.from_yaml("grid: {spatial: [2, 1, 1]}\nstrict: true\n")
    assert spec.strict and ParallelSpec.from_dict(spec.to_dict()) == spec
    assert ParallelSpec.from_yaml(spec.to_yaml()) == spec and "strict" not in ParallelSpec().to_dict()
    raises(["strict: expected true or false, got 'yes'"], ParallelSpec.from_dict, {"strict": "yes"})


def test_split_finer_than_the_volume_is_the_same_error_in_explain_and_plan():
    """A grid finer than the model input (17 parts of 16 voxels) is refused by the layer that would
    split the input, as a split that empties a shard further on is: not every layer run whole."""
    from hybridpar.planner.explain import explain

    model = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool3d(1), nn.Flatten(),
                          nn.Linear(2, 1))
    want = ["0 (Conv3d)", "split [17, 1, 1]", "input of 16x16x16 voxels", "input extent 16",
            "at most 16 along d"]
    spec = spec_of({"spatial": [17, 1, 1]})
    raises(want, spec.plan, model, (1, 1, 16, 16, 16))
    raises(want, explain, spec, model, (1, 1, 16, 16, 16))


def test_batch_arithmetic_errors():
    """Global batch vs data, micro-batches vs per-replica batch, and a pipeline asked of one sample."""
    model, vol = small(), (2, 16, 16, 16)
    raises(["global batch 6 does not split evenly over data(4)", "multiple of 4", "data in {1, 2, 3, 6}"],
           spec_of({"data": 4}).plan, model, (6, *vol))
    raises(["pipeline.microbatches: 4 does not divide the per-replica batch 6",
            "(global batch 12 / data(2))", "counts that would: 1, 2, 3, 6"],
           spec_of({"data": 2}, {"microbatches": 4}).plan, model, (12, *vol))
    for grid, pipeline in (({"pipe": 2, "data": 2}, {}), ({}, {"microbatches": 2})):
        raises(["per-replica batch of 1", "one sample per device", "spatial parallelism",
                "data parallelism"], spec_of(grid, pipeline).plan, model, (grid.get("data", 1), *vol))
    msg = raises(["grid.spatial [4, 1, 1], pipe 1"], spec_of({"pipe": 2, "spatial": [2, 1, 1]}).plan,
                 cosmoflow_like(), COSMO)
    assert "microbatches: 1" in msg


def test_stage_names_checked():
    model, shape = small(), (4, 2, 16, 16, 16)
    grid = {"pipe": 2}
    raises(["pipeline.stages: 'head.9' is not a layer of the model", "did you mean", "head.0"],
           spec_of(grid, {"stages": ["features.0", "head.9"], "microbatches": 2}).plan, model, shape)
    raises(["first stage must start at the first layer 'features.0'"],
           spec_of(grid, {"stages": ["features.3", "head"]}).plan, model, shape)
    raises(["'features.0' does not come after 'features.3'"],
           spec_of({"pipe": 3}, {"stages": ["features", "features.3", "features.0"]}).plan, model, shape)
    raises(["grid.pipe: 9 stages need at least 9 layers; the model has 8"],
           spec_of({"pipe": 9}).plan, model, (9, 2, 16, 16, 16))


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv3d(1, 1, 3), nn.ReLU()

    def forward(self, x):
        return self.b(self.a(x)) + 1


class SeqWithForward(nn.Sequential):
    def forward(self, x):
        return super().forward(x) * 2


class Branchy(nn.Module):
    """A forward with a branch on tensor values: torch.fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv3d(1, 1, 3, padding=1)

    def forward(self, x):
        return self.a(x) if x.dim() == 5 else x


def test_graphs_are_traced_and_untraceable_forwards_named():
    """Any traceable forward is a graph of nodes with their inputs; a custom module made of children
    is traced into; an untraceable forward at the top is an error naming it and saying what is
    supported, nested it runs whole as one (replicated) layer."""
    spec = ParallelSpec()
    plan = spec.plan(Custom(), (1, 1, 8, 8, 8))
    assert [(r.name, r.kind, r.inputs) for r in plan] == [
        ("a", "Conv3d", ("(input)",)), ("b", "ReLU", ("a",)), ("add", "add", ("b",))]
    nested = nn.Sequential(OrderedDict(body=SeqWithForward(nn.ReLU())))
    plan = spec.plan(nested, (1, 1, 8, 8, 8))
    assert [(r.name, r.kind) for r in plan] == [("body.0", "ReLU"), ("mul", "mul")]
    piped = ParallelSpec.from_dict({"grid": {"pipe": 2}, "pipeline": {"microbatches": 1}})
    raises(["model (Branchy)", "torch.fx cannot trace", "supported:", "module swapping"], piped.plan,
           Branchy(), (2, 1, 8, 8, 8), 2)
    # without a pipeline it runs by module swapping: its layers found by a forward on the meta device
    assert [(r.name, r.split) for r in spec_of({"spatial": [2, 1, 1]}).plan(Branchy(), (1, 1, 8, 8, 8))] \
        == [("a", (2, 1, 1))]
    raises(["model (ValueBranch)", "neither torch.fx nor a run on the meta device"], spec.plan, ValueBranch(),
           (1, 1, 8, 8, 8))
    raises(["module swapping", "per-layer rules"], spec_of({"spatial": [2, 1, 1]}, layers={"a": {"spatial":
           "replicate"}}).plan, Branchy(), (1, 1, 8, 8, 8))
    # a function that cannot run on shards, called on a split activation outside any layer: it runs on
    # the gathered volume, said once
    gathered = r"CumsumBranchy\), run by module swapping, calls cumsum at test_spec.py:\d+ on split"
    with pytest.warns(UserWarning, match=gathered):
        assert [r.split for r in spec_of({"spatial": [2, 1, 1]}).plan(CumsumBranchy(), (1, 1, 8, 8, 8))] == [
            (2, 1, 1)]
    assert len(spec.plan(CumsumBranchy(), (1, 1, 8, 8, 8))) == 1
    # nested, it runs split by module swapping inside itself (its layers checked on their extents)
    plan = spec_of({"spatial": [2, 1, 1]}).plan(nn.Sequential(Branchy()), (1, 1, 8, 8, 8))
    assert [(r.name, r.kind, r.split) for r in plan] == [("0", "Branchy", (2, 1, 1))]
    with pytest.warns(UserWarning, match=gathered):
        plan = spec_of({"spatial": [2, 1, 1]}).plan(nn.Sequential(CumsumBranchy()), (1, 1, 8, 8, 8))
    assert [r.split for r in plan] == [(2, 1, 1)]
    plan = spec_of({"spatial": [2, 1, 1]}, layers={"0": {"spatial": "replicate"}}).plan(
        nn.Sequential(CumsumBranchy()), (1, 1, 8, 8, 8))
    assert [r.split for r in plan] == [(1, 1, 1)]


def test_unregistered_layer_in_a_split_region_is_an_error():
    """A torch module nobody registered, reading a split activation, is never gathered silently; a
    module of the user's own type runs its own forward split (its calls followed one by one)."""
    model = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.LocalResponseNorm(2),
                          nn.Conv3d(2, 2, 3, padding=1))
    raises(["1 (LocalResponseNorm)", "not registered", "hybridpar.nn.register", "spatial: replicate"],
           spec_of({"spatial": [2, 1, 1]}).plan, model, (1, 1, 8, 8, 8))
    ruled = spec_of({"spatial": [2, 1, 1]}, layers={"1": {"spatial": "replicate"}})
    plan = ruled.plan(model, (1, 1, 8, 8, 8))
    assert [r.gather for r in plan] == [False, True, False]
    own = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), Branchy2(), nn.Conv3d(2, 2, 3, padding=1))
    plan = spec_of({"spatial": [2, 1, 1]}).plan(own, (1, 1, 8, 8, 8))
    assert [(r.split, r.gather) for r in plan] == [((2, 1, 1), False)] * 3


class ValueBranch(Branchy):
    def forward(self, x):
        return self.a(x) if x.sum() > 0 else x


class CumsumBranchy(Branchy):
    def forward(self, x):
        return torch.cumsum(self.a(x) * 2, 2) if x.dim() == 5 else x


class Branchy2(nn.Module):
    """A layer with a buffer of its own that nobody registered (an untraceable block made of
    registered layers alone would run split by module swapping)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("w", torch.ones(2, 1, 1, 1))

    def forward(self, x):
        return x * self.w if x.dim() == 5 else x


def test_rule_cannot_split_unsplittable_layer():
    spec = spec_of({"spatial": [2, 1, 1]}, layers={"head.1": {"spatial": [2, 1, 1]}})
    raises(["layers['head.1']: head.1 (Linear) cannot be split spatially", "input is not N, C, D, H, W",
            "spatial: replicate"], spec.plan, small(), (1, 2, 16, 16, 16))


def test_model_that_fails_on_the_shape_names_the_layer():
    raises(["does not run on input shape [1, 3, 16, 16, 16]", "at layer features.0"],
           ParallelSpec().plan, small(), (1, 3, 16, 16, 16))
    raises(["input shape must be 5 positive integers"], ParallelSpec().plan, small(), (1, 2, 16, 16))


# ---------------------------------------------------------------------------------------------- the plan
def test_exact_name_then_first_glob_and_pointwise_layers_follow():
    """A rule under a layer's exact name wins, else the first matching glob in file order; unmatched
    pointwise layers keep their input's split; Flatten/Linear replicate; a redistribute is marked
    wherever the split changes."""
    spec = spec_of({"spatial": [2, 2, 1]}, layers={
        "features.0": {"spatial": "replicate"},
        "features.*": {"spatial": [4, 1, 1]},
        "features.3": {"spatial": [1, 1, 4]},       # its exact name wins over features.*
    })
    plan = spec.plan(small(), (1, 2, 16, 16, 16))
    got = [(r.name, r.split, r.rule, r.redistribute) for r in plan]
    assert got == [
        ("features.0", (1, 1, 1), "features.0", False),
        ("features.1", (4, 1, 1), "features.*", True),
        ("features.2", (4, 1, 1), "features.*", False),
        ("features.3", (1, 1, 4), "features.3", True),
        ("features.4", (4, 1, 1), "features.*", True),
        ("features.5", (4, 1, 1), "features.*", False),
        ("head.0", (1, 1, 1), None, True),
        ("head.1", (1, 1, 1), None, False),
    ]
    plan = spec_of({"spatial": [2, 2, 1]}, layers={"features.0": {"spatial": [1, 1, 1]}}).plan(
        small(), (1, 2, 16, 16, 16))
    assert [r.split for r in plan[:4]] == [(1, 1, 1), (1, 1, 1), (2, 2, 1), (2, 2, 1)]


def test_cosmoflow_shapes_halos_params_flops():
    """Global/local shapes and halos for split (2, 2, 1) worked out by hand; params and FLOPs against
    the published CosmoFlow figures; the meta forward leaves the model on the CPU."""
    model = cosmoflow_like()
    plan = spec_of({"data": 2, "spatial": [2, 2, 1]}, {"microbatches": 2}).plan(model, (8, 4, 128, 128, 128))
    by = {r.name: r for r in plan}
    c0, p2, c12, lin = by["features.0"], by["features.2"], by["features.12"], by["head.1"]
    assert c0.input_shape == (8, 4, 128, 128, 128) and c0.output_shape == (8, 32, 128, 128, 128)
    assert c0.local_input_shape == (2, 4, 64, 64, 128)        # 8 / data 2 / 2 micro-batches
    assert c0.halo == ((1, 1), (1, 1), (0, 0))                # k3 pad 1: one voxel each side of a cut
    assert p2.halo == ((0, 0), (0, 0), (0, 0)) and p2.local_output_shape == (2, 32, 32, 32, 64)
    assert c12.input_shape == (8, 256, 8, 8, 8) and c12.local_input_shape == (2, 256, 4, 4, 8)
    assert c12.activation_bytes == 4 * 2 * 512 * 4 * 4 * 8
    assert by["head.0"].redistribute and by["head.0"].local_input_shape == (2, 512, 4, 4, 4)
    assert lin.input_shape == (8, 32768) and lin.split == (1, 1, 1) and lin.halo == ((0, 0),) * 3
    assert sum(r.params for r in plan) == 8_907_556
    assert math.isclose(sum(r.flops for r in plan) / 8, 68.9e9, rel_tol=1e-3)
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_planning_leaves_the_model_untouched():
    """The meta forward swaps parameters in functionally: BatchNorm's running stats do not move."""
    model = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.BatchNorm3d(2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = spec_of({"spatial": [2, 1, 1]}).plan(model, (2, 1, 8, 8, 8))
    assert plan[1].kind == "BatchNorm3d" and plan[1].split == (2, 1, 1) and not plan[1].redistribute
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) and after[k].device.type == "cpu" for k in before)


def test_uneven_split_reports_most_loaded_rank():
    """15 voxels over 2 ranks: the first shard holds 8 (torch.tensor_split order)."""
    model = nn.Sequential(nn.Conv3d(1, 1, 3, padding=1))
    plan = spec_of({"spatial": [2, 1, 1]}).plan(model, (1, 1, 15, 6, 6))
    assert plan[0].local_input_shape == (1, 1, 8, 6, 6) and plan[0].halo[0] == (1, 1)


def test_flops_match_torch_flop_counter():
    """Per-model forward FLOPs equal torch.utils.flop_counter on a real forward of the small model."""
    from torch.utils.flop_counter import FlopCounterMode

    model, shape = small(), (2, 2, 16, 16, 16)
    plan = ParallelSpec().plan(model, shape)
    with FlopCounterMode(display=False) as counter:
        model(torch.randn(shape))
    assert sum(r.flops for r in plan) == counter.get_total_flops()


def test_own_flop_formula_agrees_with_flops_module():
    """The fallback formula (used when a model cannot be copied to meta) gives, layer by layer, what
    hybridpar.flops.count gives; a conv inside a custom module is credited to that module's row."""
    for model, shape in ((cosmoflow_like(), COSMO), (small(), (2, 2, 16, 16, 16))):
        leaves, _ = sequential_layers(model)
        shapes = trace_shapes(model, leaves, shape)
        own = [forward_flops(m, i, o) for (_, m), (i, o) in zip(leaves, shapes, strict=True)]
        assert own == layer_flops(model, leaves, shape, shapes)
        assert any(own)
    plan = ParallelSpec().plan(nn.Sequential(Custom()), (1, 1, 8, 8, 8))
    assert plan[0].flops == 2 * 6**3 * 27


def test_balance_stages_against_brute_force():
    """The DP minimises the costliest stage (checked against every partition) and, among those,
    the bytes sent across boundaries."""
    assert balance_stages([1, 1, 1, 1], 2) == [0, 2]
    assert balance_stages([5, 1, 1, 1, 1, 1], 2) == [0, 1]
    assert balance_stages([10, 0, 0, 10, 0, 0], 2, sends=[8, 8, 1, 8, 8, 1]) == [0, 3]
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        n = int(torch.randint(3, 9, (1,), generator=gen))
        k = int(torch.randint(1, n + 1, (1,), generator=gen))
        costs = torch.randint(0, 20, (n,), generator=gen).tolist()

        def worst(starts, costs=costs):
            ends = [*starts[1:], len(costs)]
            return max(sum(costs[a:b]) for a, b in zip(starts, ends, strict=True))

        best = min(worst([0, *c]) for c in itertools.combinations(range(1, n), k - 1))
        starts = balance_stages(costs, k)
        assert len(starts) == k and starts[0] == 0 and starts == sorted(set(starts))
        assert worst(starts) == best


def test_balance_stages_memory_then_sends_against_brute_force():
    """Among the partitions with the smallest costliest stage, the fewest bytes sent win, then the
    smallest largest stage memory (checked against every partition)."""
    assert balance_stages([4, 0, 0, 4], 2, memory=[1, 5, 1, 1]) == [0, 2]
    assert balance_stages([4, 0, 0, 4], 2, sends=[9, 1, 9, 0], memory=[1, 1, 9, 1]) == [0, 2]
    gen = torch.Generator().manual_seed(1)
    for _ in range(40):
        n = int(torch.randint(3, 9, (1,), generator=gen))
        k = int(torch.randint(1, n + 1, (1,), generator=gen))
        costs, mem, sends = (torch.randint(0, 4, (n,), generator=gen).tolist() for _ in range(3))

        def key(starts, costs=costs, mem=mem, sends=sends):
            ends = [*starts[1:], len(costs)]
            return (max(sum(costs[a:b]) for a, b in zip(starts, ends, strict=True)),
                    sum(sends[s - 1] for s in starts[1:]),
                    max(sum(mem[a:b]) for a, b in zip(starts, ends, strict=True)))

        best = min(key([0, *c]) for c in itertools.combinations(range(1, n), k - 1))
        assert key(balance_stages(costs, k, sends=sends, memory=mem)) == best


def test_auto_stages_balance_training_flops():
    """Forward FLOPs 20:4:16 would cut after the first conv (20 | 20); a training step costs
    2x forward for the first conv (no input gradient) and 3x for the others (40 | 12 + 48 = 60
    against 40 + 12 | 48), so ``auto`` cuts after the second."""
    model = nn.Sequential(nn.Conv3d(5, 4, 1), nn.Conv3d(4, 1, 1), nn.Conv3d(1, 16, 1))
    plan = spec_of({"pipe": 2}, {"microbatches": 2}).plan(model, (2, 5, 4, 4, 4))
    fwd = [r.flops for r in plan]
    assert [f // fwd[1] for f in fwd] == [5, 1, 4]
    assert [r.train_flops for r in plan] == [2 * fwd[0], 3 * fwd[1], 3 * fwd[2]]
    assert balance_stages(fwd, 2) == [0, 1]
    assert [r.stage for r in plan] == [0, 0, 1]


class _SizeCarried(nn.Module):
    """A depth read first and used after the third conv: no stage may begin while it is live."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv3d(1, 8, 3, padding=1), nn.Conv3d(8, 8, 3, padding=1)
        self.c, self.d = nn.Conv3d(8, 8, 3, padding=1), nn.Conv3d(8, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[2]
        return self.d(self.c(self.b(self.a(x))) * (n / 8))


def test_auto_stages_never_cut_where_a_shape_value_would_cross():
    """The balanced cut (a, b | c, d) would carry the depth read at the start: auto cuts where it may,
    before d; no cut at all is refused with the reason of one."""
    plan = spec_of({"pipe": 2}, {"microbatches": 2}).plan(_SizeCarried(), (2, 1, 8, 8, 8))
    assert [r.name for r in plan if r.stage == 1] == ["d"]
    assert balance_stages([1, 5, 5, 1], 2, blocked={1, 2}) == [0, 3]
    with pytest.raises(SpecError, match=r"every way to cut the model into 3 stages cuts where no cut may "
                                        r"fall; e.g. the cut after .* would carry"):
        spec_of({"pipe": 3}, {"microbatches": 3}).plan(_SizeCarried(), (3, 1, 8, 8, 8))


def test_auto_and_named_stages_on_cosmoflow():
    """Auto: conv1+conv2 (43.5 GFLOP per rank) against the rest (25.4), cut after the pool where the
    activation is 8x smaller. Named: container names start at their first leaf."""
    auto = spec_of({"pipe": 2, "spatial": [2, 1, 1]}, {"microbatches": 2}).plan(
        cosmoflow_like(), (2, *COSMO[1:]))
    assert [r.name for r in auto if r.stage == 1][0] == "features.6"
    named = spec_of({"pipe": 2}, {"stages": ["features", "head"], "microbatches": 2}).plan(
        cosmoflow_like(), (2, *COSMO[1:]))
    assert [r.name for r in named if r.stage == 1][0] == "head.0"
    assert [r.stage for r in named].count(0) == 15


# ---------------------------------------------------------------------------------------------- explain
def test_explain_cli_on_cosmoflow(tmp_path, capsys):
    """The CLI table has every column, one row per layer with the right local shape and halos, the
    gather before the head, and a summary per stage; it accepts a .py path as MODULE."""
    spec = tmp_path / "s.yaml"
    spec.write_text("grid: {data: 1, pipe: 2, spatial: [2, 2, 1]}\npipeline: {microbatches: 2}\n")
    rc = main(["explain", str(spec), "--model", f"{__file__}:cosmoflow_like",
               "--input-shape", "2,4,128,128,128"])
    out = capsys.readouterr().out
    assert rc == 0
    lines = out.splitlines()
    header = next(ln for ln in lines if ln.startswith("layer"))
    cols = ["layer", "type", "stage", "split", "local input", "halo d h w", "params", "FLOPs", "act/rank"]
    assert list(COLUMNS) == cols and all(c in header for c in cols)
    row = next(ln for ln in lines if ln.startswith("features.0 "))
    assert row.split()[:5] == ["features.0", "Conv3d", "0", "2x2x1", "1x4x64x64x128"]
    assert "1/1 1/1 0/0" in row and "3.49 K" in row and "28.99 G" in row and "64.0 MiB" in row
    assert next(ln for ln in lines if ln.startswith("head.1 ")).split()[:5] == \
        ["head.1", "Linear", "1", "repl", "1x32768"]
    assert "  ~ redistribute 2x2x1 -> repl" in lines[lines.index(
        next(ln for ln in lines if ln.startswith("head.0"))) - 1]
    assert sum(1 for ln in lines if ln.startswith(("features.", "head."))) == 24
    assert "data(1) * pipe(2) * spatial(2*2*1) = 8 ranks" in out
    assert "stage 0: features.0 .. features.5" in out and "stage 1: features.6 .. head.8" in out
    assert "total: 8.91 M params, 137.72 G FLOPs forward" in out
    # 1-sample micro-batches: the convs with N*C*D*H <= 20480 (not features.3: 1x32x32x32) are named
    assert "note: on CPU, 4 conv(s) (features.0, features.6, features.9, features.12)" in out


def test_explain_warns_of_slow_cpu_convs_for_one_sample_micro_batches():
    """A 1-sample micro-batch whose local conv input has N*C*D*H <= 20480 falls onto slow_conv3d on
    CPU: explain says so and says what to change; 2-sample micro-batches or larger inputs do not."""
    spec = spec_of({"pipe": 2}, {"microbatches": 2})
    out = explain(spec, small(), (2, 2, 16, 16, 16))
    assert "note: on CPU, 2 conv(s) (features.0, features.3) get a 1-sample local input" in out
    assert "micro-batches of 2 or more samples" in out
    assert "note:" not in explain(spec_of({"pipe": 2}, {"microbatches": 1}), small(), (2, 2, 16, 16, 16))
    convs = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.Conv3d(4, 4, 3, padding=1))
    assert "note:" in explain(spec, convs, (2, 2, 64, 64, 16))            # 1*2*64*64 = 8192
    assert "note:" not in explain(spec, convs, (2, 2, 128, 128, 16))      # 1*2*128*128 = 32768


def test_explain_cli_dotted_module_world_size_and_errors(tmp_path, capsys, monkeypatch):
    """MODULE as a dotted name; --world-size fills a -1; a bad spec or model exits 2 with the message."""
    fake = types.ModuleType("fake_models")
    fake.build = lambda width=4: small(width)          # a factory with no required arguments
    monkeypatch.setitem(sys.modules, "fake_models", fake)
    spec = ParallelSpec.from_dict({"grid": {"data": -1, "spatial": [2, 1, 1]}})
    assert "data(2) * pipe(1) * spatial(2*1*1) = 4 ranks" in explain(spec, small(), (2, 2, 16, 16, 16), 4)
    path = tmp_path / "s.yaml"
    path.write_text(spec.to_yaml())
    args = ["explain", str(path), "--input-shape", "2,2,16,16,16", "--world-size"]
    assert main([*args, "4", "--model", "fake_models:build"]) == 0
    assert "features.3" in capsys.readouterr().out
    assert main([*args, "3", "--model", "fake_models:build"]) == 2
    assert capsys.readouterr().err.startswith("error: grid: data(-1) * pipe(1) * spatial(2*1*1)")
    assert main([*args, "4", "--model", "fake_models:nope"]) == 2
    assert "has no attribute 'nope'" in capsys.readouterr().err


def test_spec_yaml_is_plain_and_bounded():
    """A spec file is data: a tag constructs nothing, and nested aliases are refused before they expand."""
    raises(["spec.yaml: line 1, column 7", "the tag !!python/object/apply:os.system is not allowed"],
           ParallelSpec.from_yaml, 'grid: !!python/object/apply:os.system ["true"]\n', "spec.yaml")
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n" for p, n in zip("abcdef", "bcdefg"))
    raises(["spec.yaml: line", "its aliases expand to more than 10000 values"], ParallelSpec.from_yaml, bomb,
           "spec.yaml")
