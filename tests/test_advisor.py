"""The layout advisor (python -m hybridpar.advisor) against what the performance model implies, no processes:
data parallelism when the model fits and the network is fast; a spatial split when a sample's
activations do not fit one rank (data parallelism listed as too big); the YAML it writes loads with
load_spec and plans on the model; an impossible memory limit fails with the smallest need and what
would fit; memory sizes parse."""

from __future__ import annotations

import pytest

from cosmoflow.model import build_model
from hybridpar import load_spec
from hybridpar import perfmodel as pm
from hybridpar.advisor import advise, main, parse_bytes
from hybridpar.planner import SpecError

MODEL = f"{__file__}:cosmoflow_64"


def cosmoflow_64():
    """The MLPerf CosmoFlow network resized for 64^3 inputs (4 conv blocks)."""
    return build_model(64, n_conv=4)


def test_parse_bytes():
    assert parse_bytes("80GB") == 80e9
    assert parse_bytes("16GiB") == 16 * 2**30
    assert parse_bytes("512 mb") == 512e6
    assert parse_bytes("1024") == 1024
    with pytest.raises(ValueError, match="80GB"):
        parse_bytes("lots")


def test_data_parallel_when_the_model_fits_and_the_network_is_fast():
    advice = advise(cosmoflow_64(), (32, 4, 64, 64, 64), 8, 80e9, "h100")
    g = advice.best.spec.grid
    assert (g.data, g.pipe, g.spatial) == (8, 1, (1, 1, 1))
    assert advice.best.prediction.breakdown["halo"] == 0
    assert len(advice.fits) > 5 and all(c.time >= advice.best.time for c in advice.fits)


def test_spatial_split_when_memory_forbids_data_parallelism():
    model, shape = build_model(64, n_conv=4), (8, 4, 64, 64, 64)
    roomy = advise(model, shape, 8, 1e12, "h100")
    data = next(c for c in roomy.fits if c.spec.grid.data == 8)
    assert roomy.best is data or roomy.best.time == pytest.approx(data.time)
    limit = 0.7 * data.memory  # one sample per rank no longer fits
    tight = advise(pm.Workload(model, shape), None, 8, limit, "h100")
    best = tight.best.spec.grid
    assert best.stage_size > 1, tight.best.describe()
    assert tight.best.memory <= limit
    assert any(c.spec.grid.data == 8 and c.spec.grid.stage_size == 1 for c in tight.too_big)


def test_yaml_loads_and_validates(tmp_path, capsys):
    out = tmp_path / "spec.yaml"
    rc = main(["--model", MODEL, "--input-shape", "8,4,64,64,64", "--world-size", "4", "--device-memory",
               "80GB", "--machine", "v100", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "why not chosen" in text and "chosen:" in text
    spec = load_spec(out)
    assert spec.plan(cosmoflow_64(), (8, 4, 64, 64, 64), 4)
    assert spec.grid.is_resolved and spec.grid.data * spec.grid.pipe * spec.grid.stage_size == 4


def test_second_split_rules_round_trip(tmp_path):
    """A candidate with per-layer rules for the deeper layers writes YAML that plans the same."""
    model, shape = build_model(64, n_conv=4), (4, 4, 64, 64, 64)
    advice = advise(model, shape, 4, 1e12, "h100")
    ruled = next(c for c in advice.fits if c.spec.layers)
    path = tmp_path / "ruled.yaml"
    path.write_text(ruled.spec.to_yaml())
    again = load_spec(path)
    assert again == ruled.spec
    assert again.plan(model, shape, 4) == pm.Workload(model, shape).plan(ruled.spec, 4)


def test_impossible_memory_says_what_would_fit(capsys):
    with pytest.raises(SpecError, match=r"smallest need is .* per rank .*--device-memory .*GiB or more"):
        advise(build_model(64, n_conv=4), (8, 4, 64, 64, 64), 2, 50e6, "h100")
    rc = main(["--model", MODEL, "--input-shape", "8,4,64,64,64", "--world-size", "2", "--device-memory",
               "50MB"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "no layout of 2 ranks fits" in err and "would fit" in err and "ranks (e.g." in err
