"""One precedence rule for per-layer settings: an exact name wins, else the first matching glob, in
order; the planner and ``count_sharded`` resolve the same YAML the same way."""

from __future__ import annotations

from torch import nn

import hybridpar as hp
from hybridpar import globs


def test_exact_name_wins_then_first_glob():
    patterns = ["features.*", "features.3", "*"]
    assert globs.rule_for("features.3", patterns) == 1
    assert globs.rule_for("features.0", patterns) == 0
    assert globs.rule_for("head.1", patterns) == 2
    assert globs.rule_for("head.1", ["features.*"]) is None


def test_planner_and_count_sharded_agree():
    model = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.ReLU(), nn.Conv3d(2, 2, 3, padding=1))
    rules = {"*": (1, 2, 1), "2": (2, 1, 1)}  # a glob first, the exact name after it: the name wins
    spec = hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 1, 1]},
                                      "layers": {k: {"spatial": list(v)} for k, v in rules.items()}})
    plan = {r.name: r.split for r in spec.plan(model, (2, 1, 8, 8, 8), 2)}
    sharded = {s.layer.name: s.split for s in hp.flops.count_sharded(model, (2, 1, 8, 8, 8), rules).per_layer}
    assert plan["0"] == sharded["0"] == (1, 2, 1)
    assert plan["2"] == sharded["2"] == (2, 1, 1)
