"""The performance model's pieces against closed forms and the library's own arithmetic, no processes:
the pipeline step is (M + S - 1) stage times with bubble (S - 1)/(M + S - 1); alpha-beta links and
their fits recover known coefficients; halo bytes equal hybridpar.flops.count_sharded's on one-dim
splits (and add only corners on multi-dim ones); ring all-reduce volumes; redistribution to a
replicated head; the one planner resolving on a workload's memoised, terse analysis gives exactly
spec.plan's records; the schedules' closed forms equal their op lists; a saved machine loads back equal;
presets predict less time per rank when work is split."""

from __future__ import annotations

import math

import pytest
from torch import nn

from hybridpar import flops
from hybridpar import perfmodel as pm
from hybridpar.planner import ParallelSpec, SpecError
from hybridpar.planner.schedule import SCHEDULES, in_flight, microbatches_in_flight, schedule

GB = 1e9


def compute_only(flop_rate: float = 1e9) -> pm.Machine:
    """A machine whose only cost is matmul FLOPs (free memory traffic, free and instant network)."""
    conv = pm.Cost(flop_rate, math.inf, 0.0)
    free = pm.Cost()
    fast = pm.Link(0.0, math.inf)
    return pm.Machine("ideal", "compute only", pm.Compute(conv, conv, conv, free, free), fast, fast)


def conv_stack(n: int = 4, c: int = 4) -> nn.Sequential:
    return nn.Sequential(*[nn.Conv3d(c, c, 3, padding=1) for _ in range(n)])


def small_cnn() -> nn.Sequential:
    return nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.LeakyReLU(0.3), nn.MaxPool3d(2),
                         nn.Conv3d(4, 8, 3, padding=1), nn.LeakyReLU(0.3), nn.MaxPool3d(2),
                         nn.Flatten(), nn.Linear(8 * 4 * 4 * 4, 16), nn.LeakyReLU(0.3), nn.Linear(16, 4))


# ------------------------------------------------------------------------------------------- pipeline
@pytest.mark.parametrize("stages,micro", [(1, 1), (2, 4), (4, 8), (4, 1)])
def test_bubble_fraction_closed_form(stages, micro):
    assert pm.bubble_fraction(stages, micro) == pytest.approx((stages - 1) / (micro + stages - 1))


@pytest.mark.parametrize("name", SCHEDULES)
def test_in_flight_closed_form_equals_the_schedules_op_lists(name):
    """The model's closed form of the micro-batches a stage holds is the engine's schedule's."""
    for stages in range(1, 6):
        for micro in range(1, 9):
            for stage in range(stages):
                assert microbatches_in_flight(name, stages, micro, stage) == \
                    in_flight(schedule(name, stages, micro, stage)), (name, stages, micro, stage)


@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 8), (4, 4)])
def test_pipeline_step_is_m_plus_s_minus_1_stage_times(stages, micro):
    """S equal stages (one identical conv each, middle layers compute input gradients): the step is
    (M + S - 1) times the slowest stage's micro-batch time, and the idle share is the GPipe bubble."""
    model = conv_stack(stages)
    shape = (micro * 2, 4, 8, 8, 8)
    spec = ParallelSpec.from_dict({"grid": {"pipe": stages}, "pipeline": {"microbatches": micro}})
    pred = pm.predict(model, spec, compute_only(), stages, input_shape=shape)
    t = max(st.time for st in pred.stages)
    busy = pred.breakdown["compute"] + pred.breakdown["pipeline"]
    # the drain: stages after the first send their last input gradient before their weight gradients
    backward = [sum(lc.backward for lc in pred.layers if lc.stage == s) for s in range(stages)]
    weights = [0.0] + [sum(lc.weight_backward for lc in pred.layers if lc.stage == s)
                       for s in range(1, stages)]
    assert all(0 < w < b for w, b in zip(weights[1:], backward[1:]))
    saving = pm.drain_saving(backward, weights, [0.0] * (stages - 1))
    assert saving > 0
    expected = sum(st.time for st in pred.stages) + (micro - 1) * t - saving
    assert busy == pytest.approx(expected)
    if len({round(st.time, 12) for st in pred.stages[1:]}) == 1:  # stages 1.. are identical
        assert pred.bubble == pytest.approx(pm.bubble_fraction(stages, micro))
    assert pred.breakdown["halo"] == 0 and pred.breakdown["grad_reduce"] == 0


def test_drain_saving_runs_weight_gradients_beside_the_chain():
    # S = 2: the weights (5) of stage 1 hide under the transfer and stage 0's backward (1 + 10)
    assert pm.drain_saving([10, 11], [0, 5], [1]) == pytest.approx(5)
    # ... or only as far as those last: 1 + 2 = 3 of the 5
    assert pm.drain_saving([2, 11], [0, 5], [1]) == pytest.approx(3)
    # S = 3: the chain 3 + 1 + 3 + 1 + 5 = 13 ends last, against 17 without the split
    assert pm.drain_saving([5, 5, 5], [0, 2, 2], [1, 1]) == pytest.approx(4)
    assert pm.drain_saving([5, 5], [0, 0], [1]) == 0


def test_drain_saving_follows_the_engine_split():
    """GPipe splits stage 1's whole last backward; 1F1B's last stage holds one micro-batch, so only
    its first conv's weights wait (a smaller saving); recomputation never splits."""
    model, shape = conv_stack(4), (8, 4, 8, 8, 8)
    runs = {}
    for name, pipeline in (("gpipe", {"microbatches": 4}), ("1f1b", {"microbatches": 4, "schedule": "1f1b"}),
                           ("gpipe-recompute", {"microbatches": 4, "recompute": True})):
        spec = ParallelSpec.from_dict({"grid": {"pipe": 2}, "pipeline": pipeline})
        pred = pm.predict(model, spec, compute_only(), 2, input_shape=shape)
        stage_sum = sum(st.time for st in pred.stages) + 3 * max(st.time for st in pred.stages)
        runs[name] = stage_sum - (pred.breakdown["compute"] + pred.breakdown["pipeline"])
    assert runs["gpipe"] > runs["1f1b"] > 0
    assert runs["gpipe-recompute"] == pytest.approx(0)


def test_recompute_adds_a_forward():
    model, shape = conv_stack(4), (4, 4, 8, 8, 8)
    plain = pm.predict(model, {"pipeline": {"microbatches": 2}}, compute_only(), 1, input_shape=shape)
    again = pm.predict(model, {"pipeline": {"microbatches": 2, "recompute": True}}, compute_only(), 1,
                       input_shape=shape)
    fwd = sum(lc.forward for lc in plain.layers)
    assert again.breakdown["compute"] == pytest.approx(plain.breakdown["compute"] + 2 * fwd)
    assert again.memory["activations"] < plain.memory["activations"]


# ------------------------------------------------------------------------------------------- network
def test_link_is_alpha_plus_bytes_over_bandwidth():
    link = pm.Link(5e-6, 10 * GB)
    assert link.time(1e6) == pytest.approx(5e-6 + 1e-4)
    assert link.time(1e6, messages=3) == pytest.approx(15e-6 + 1e-4)
    assert link.time(0, messages=0) == 0


def test_fit_link_recovers_alpha_and_beta():
    truth = pm.Link(40e-6, 3 * GB)
    samples = [(n, truth.time(n)) for n in (8, 1 << 12, 1 << 16, 1 << 20, 1 << 24)]
    fitted = pm.fit_link(samples)
    assert fitted.latency == pytest.approx(truth.latency, rel=1e-6)
    assert fitted.bandwidth == pytest.approx(truth.bandwidth, rel=1e-6)


def test_link_from_noisy_samples_is_robust():
    """Small messages give alpha (median), the largest the bandwidth; one outlier does not move it."""
    truth = pm.Link(1e-3, 1 * GB)
    samples = [(n, truth.time(n)) for n in (8, 1 << 12, 1 << 15, 1 << 20)]
    samples[1] = (1 << 12, 5e-3)  # a rank descheduled once
    link = pm.link_from_samples(samples)
    assert link.latency == pytest.approx(truth.time(1 << 15), rel=1e-6)
    assert link.bandwidth == pytest.approx((1 << 20) / ((1 << 20) / GB + 1e-3 - link.latency), rel=1e-6)


def test_fit_cost_recovers_coefficients_and_stays_non_negative():
    truth = pm.Cost(50e9, 20e9, 30e-6)
    rows = [(f, b, truth.time(f, b)) for f, b in [(1e8, 1e6), (1e9, 1e8), (5e7, 4e7), (2e9, 1e7), (1e6, 1e5)]]
    fitted = pm.fit_cost(rows)
    for attr in ("flop_rate", "byte_rate", "overhead"):
        assert getattr(fitted, attr) == pytest.approx(getattr(truth, attr), rel=1e-6)
    # data that a negative overhead would fit best: the fit drops the term instead
    bent = pm.fit_cost([(1e9, 0, 0.01), (2e9, 0, 0.021), (4e9, 0, 0.043)])
    assert bent.overhead >= 0 and bent.flop_rate > 0


def test_ring_allreduce_within_and_across_nodes():
    link = pm.Link(2e-6, 100 * GB)
    nic = pm.Link(5e-6, 25 * GB)
    conv = pm.Cost(1e12)
    m = pm.Machine("m", "", pm.Compute(conv, conv, conv, conv, conv), link, nic, ranks_per_node=4)
    nbytes = 1e8
    inside = pm.allreduce_time(nbytes, [0, 1, 2, 3], m, 4)
    assert inside == pytest.approx(2 * 3 * 2e-6 + 2 * 3 / 4 * nbytes / (100 * GB))
    # 8 nodes x 4 ranks, one group: intra part + 2 (k-1)/k of the bytes through each NIC
    across = pm.allreduce_time(nbytes, list(range(32)), m, 32)
    assert across == pytest.approx(inside + 2 * 3 * 5e-6 + 2 * 7 / 8 * nbytes / (25 * GB))
    # 4 groups with one member per node share each NIC four ways
    shared = pm.allreduce_time(nbytes, list(range(0, 32, 4)), m, 32)
    assert shared == pytest.approx(2 * 3 * 5e-6 + 2 * 7 / 8 * nbytes * 4 / (25 * GB))
    assert pm.allreduce_time(nbytes, [3], m, 32) == 0


# ------------------------------------------------------------------------------------------- halos
@pytest.mark.parametrize("split", [(2, 1, 1), (4, 1, 1), (1, 3, 1), (1, 1, 4)])
def test_halo_bytes_match_count_sharded_on_one_dim_splits(split):
    model = nn.Sequential(nn.Conv3d(3, 5, 3, padding=1))
    shape = (2, 3, 12, 12, 12)
    sharded = flops.count_sharded(model, shape, {"0": split})
    rec = ParallelSpec.from_dict({"grid": {"spatial": list(split)}}).plan(model, shape, math.prod(split))[0]
    nbytes, msgs = pm.halo_bytes(rec.local_input_shape, rec.halo, rec.split, 4)
    assert nbytes == max(r.halo_bytes_forward for r in sharded.per_rank)
    assert msgs == (1 if max(split) == 2 else 2)


def test_halo_bytes_on_multi_dim_splits_add_only_corners():
    model = nn.Sequential(nn.Conv3d(2, 2, 3, padding=1))
    shape = (1, 2, 12, 12, 12)
    sharded = flops.count_sharded(model, shape, {"0": (3, 3, 1)})
    rec = ParallelSpec.from_dict({"grid": {"spatial": [3, 3, 1]}}).plan(model, shape, 9)[0]
    nbytes, msgs = pm.halo_bytes(rec.local_input_shape, rec.halo, rec.split, 4)
    corners = 2 * 2 * 12 * 2 * 4  # (lo + hi in d) x (lo + hi in h) x W x C x 4 bytes
    assert nbytes == max(r.halo_bytes_forward for r in sharded.per_rank) + corners
    assert msgs == 4


def test_gather_before_a_replicated_head():
    """Split 2x1x1 -> replicated: a rank receives the other half in one message; the backward of a
    gather is local (each rank keeps its own part of the gradient)."""
    assert pm.redistribute_volume((8, 8, 8), (2, 1, 1), (1, 1, 1), 2) == (256, 1)
    assert pm.redistribute_volume((8, 8, 8), (1, 1, 1), (2, 1, 1), 2) == (0, 0)
    assert pm.redistribute_volume((8, 8, 8), (2, 2, 1), (1, 1, 1), 4) == (384, 3)


def test_halo_and_gather_appear_in_a_spatial_prediction():
    model, shape = small_cnn(), (2, 2, 16, 16, 16)
    link = pm.Link(1e-5, 1 * GB)
    conv = pm.Cost(1e10)
    m = pm.Machine("m", "", pm.Compute(conv, conv, conv, conv, conv), link, link)
    pred = pm.predict(model, {"grid": {"spatial": [2, 1, 1]}}, m, 2, input_shape=shape)
    conv0, conv3 = pred.layers[0], pred.layers[3]
    assert conv0.halo_bytes == 2 * 2 * 16 * 16 * 4  # N x C x one 16x16 plane x 4 bytes
    assert conv0.halo_backward == 0  # the input needs no gradient
    assert conv3.halo_backward == pytest.approx(conv3.halo_forward)
    flatten = next(lc for lc in pred.layers if lc.name == "6")
    assert flatten.redistribute_forward > 0 and flatten.redistribute_backward == 0
    assert pred.breakdown["halo"] > 0


# ------------------------------------------------------------------------------------------- plan
@pytest.mark.parametrize("spec", [
    {"grid": {"data": 2}},
    {"grid": {"spatial": [2, 2, 1]}},
    {"grid": {"data": 2, "pipe": 2}, "pipeline": {"microbatches": 2}},
    {"grid": {"pipe": 2, "spatial": [2, 1, 1]}, "pipeline": {"microbatches": 4, "stages": ["0", "3"]}},
    {"grid": {"spatial": [4, 1, 1]}, "layers": {"3": {"spatial": [2, 1, 1]}, "5": {"spatial": "replicate"}}},
])
def test_one_planner_on_a_reused_analysis(spec):
    """A workload resolves every spec on one analysis whose halos are memoised per (node, split) and
    whose errors are terse; the records must still be exactly those of a fresh spec.plan, also after
    other specs filled the memo."""
    model, shape = small_cnn(), (8, 2, 16, 16, 16)
    s = ParallelSpec.from_dict(spec)
    world = math.prod(s.grid.sizes)
    w = pm.Workload(model, shape)
    for other in ({"grid": {"spatial": [2, 1, 1]}}, {"grid": {"spatial": [1, 2, 2]}}):
        w.plan(ParallelSpec.from_dict(other), math.prod(ParallelSpec.from_dict(other).grid.sizes))
    assert w.plan(s, world) == s.plan(model, shape, world)


def test_workload_plan_rejects_what_spec_plan_rejects():
    """A split too fine for a layer (4^3 after two pools, split 8 ways): both plans replicate it alike,
    and both refuse it under strict: true."""
    model, shape = small_cnn(), (2, 2, 16, 16, 16)
    s = ParallelSpec.from_dict({"grid": {"spatial": [8, 1, 1]}})
    plan = s.plan(model, shape, 8)
    assert any(r.auto_replicated for r in plan) and pm.Workload(model, shape).plan(s, 8) == plan
    strict = ParallelSpec.from_dict({"grid": {"spatial": [8, 1, 1]}, "strict": True})
    with pytest.raises(SpecError):
        strict.plan(model, shape, 8)
    with pytest.raises(SpecError):
        pm.Workload(model, shape).plan(strict, 8)


# ------------------------------------------------------------------------------------------- machines
def test_machine_round_trips_through_json(tmp_path):
    m = pm.PRESETS["v100"].with_measured({"Conv3d(...)|1x4x10x10x10|n": (1e-3, 2e-3)})
    path = pm.save_machine(m, tmp_path / "m.json", {"note": "test"})
    back = pm.load_machine(path)
    assert back == m and back.measured == {"Conv3d(...)|1x4x10x10x10|n": (1e-3, 2e-3)}
    assert pm.get_machine(path) == m
    with pytest.raises(ValueError, match="unknown machine"):
        pm.get_machine("nonesuch")
    with pytest.raises(FileNotFoundError, match="--calibrate-only"):
        pm.load_machine(tmp_path / "missing.json")


def test_measured_layer_times_replace_the_fit():
    model, shape = conv_stack(1), (1, 4, 8, 8, 8)
    w = pm.Workload(model, shape)
    spec = ParallelSpec()
    (key, *_), = pm.layer_entries(w, w.plan(spec, 1))
    assert key == "Conv3d(k3x3x3,s1x1x1,d1x1x1,w4x4x3x3x3,w4)|1x4x10x10x10|n"
    m = compute_only().with_measured({key: (0.25, 0.5)})
    pred = pm.predict(w, spec, m, 1)
    assert pred.layers[0].forward == 0.25 and pred.layers[0].backward == 0.5


def test_drift_scales_compute_only():
    """``Machine.drift`` (the host slower now than when calibrated) multiplies compute, not the
    network, on one rank and on several."""
    from dataclasses import replace

    w, spec = pm.Workload(conv_stack(2), (2, 4, 8, 8, 8)), ParallelSpec()
    m = replace(compute_only(), intra=pm.Link(1e-3, 1e9), inter=pm.Link(1e-3, 1e9))
    base, slow = pm.predict(w, spec, m, 1), pm.predict(w, spec, replace(m, drift=1.5), 1)
    assert slow.breakdown["compute"] == pytest.approx(1.5 * base.breakdown["compute"])
    data = ParallelSpec.from_dict({"grid": {"data": 2}})
    base, slow = pm.predict(w, data, m, 2), pm.predict(w, data, replace(m, drift=1.5), 2)
    assert slow.breakdown["compute"] == pytest.approx(1.5 * base.breakdown["compute"])
    assert slow.breakdown["grad_reduce"] == pytest.approx(base.breakdown["grad_reduce"])


def test_presets_split_work_and_memory():
    from cosmoflow.model import build_model

    model, shape = build_model(64, n_conv=4), (8, 4, 64, 64, 64)
    w = pm.Workload(model, shape)
    one = pm.predict(w, {"grid": {"data": 1}}, "h100", 1)
    split = pm.predict(w, {"grid": {"spatial": [2, 1, 1]}}, "h100", 2)
    conv_one = sum(lc.forward + lc.backward for lc in one.layers if lc.op == "conv")
    conv_split = sum(lc.forward + lc.backward for lc in split.layers if lc.op == "conv")
    assert conv_split < 0.6 * conv_one
    assert split.memory["activations"] < 0.6 * one.memory["activations"]
    assert one.memory["weights"] == w.params * 2  # bf16 preset
    assert one.model_flops == flops.count(model, shape).total


def test_the_model_sits_below_the_runtime():
    """No module of the performance model imports the pipeline runtime when it is imported (the
    calibration imports the engine inside the functions that time it)."""
    import ast  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    package = Path(pm.__file__).parent
    for path in sorted(package.glob("*.py")):
        for stmt in ast.parse(path.read_text()).body:
            names = [a.name for a in stmt.names] if isinstance(stmt, ast.Import) else \
                [stmt.module or ""] if isinstance(stmt, ast.ImportFrom) else []
            assert not any(n.startswith("hybridpar.pipeline") for n in names), (path.name, names)
