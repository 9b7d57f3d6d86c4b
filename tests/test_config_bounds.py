"""Upper bounds on a config's sizes (issue 46): a layer, volume or count whose weights or activations would
not fit in this machine's memory is one ConfigError line naming the key and what fits, before anything
is allocated, for a config file and for the configuration an export carries alike.

Checked against:
* ``--set`` values and a YAML file: ``model.dense=[1e9]``, ``data.sample_size=4096``, ``base_filters`` of a
  million (above ``max_filters``, and with ``max_filters`` raised too), ``n_conv`` and ``unet.levels`` of
  a million (were a ValueError formatting 2**n), ``unet.width`` of a million: one line naming the key;
* the arithmetic against a given memory: the named largest value fits and one step more does not, and
  ``parallel.grid.spatial`` divides one sample's activation;
* exports whose embedded configuration holds those values (JSON numbers, floats included): one line
  naming the file and the key, raised before the weights are read or the network is built;
* every shipped config in ``launch/configs`` still loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import cosmoflow.model as cm
from cosmoflow.config import Config, ConfigError, config_from_dict, load_config
from cosmoflow.model_size import largest_fit, memory_problem, need, size_keys, with_value
from hybridpar.checkpoint.export import CONFIG_KEY

ROOT = Path(__file__).resolve().parents[1]
RECONSTRUCT = ["task=reconstruct", "checkpoint.best_metric=val_loss"]
FITS = r"[\d,.]+ GiB, more than this machine's [\d,.]+ GiB of memory; {key} of at most \d+ fits"

CASES = {
    "dense": (["model.dense=[1000000000]"], r"model\.dense\[0\]: 1000000000 makes the network's weights "
              + FITS.format(key=r"model\.dense\[0\]")),
    "sample_size": (["data.sample_size=4096"], r"data.sample_size: 4096 makes the network's weights "
                    + FITS.format(key=r"data\.sample_size")),
    "base_filters": (["model.base_filters=1000000"], r"model.base_filters: 1000000 channels exceed "
                     r"model.max_filters \(512\), which caps every conv's channels; at most 512 has an "
                     r"effect"),
    "base_and_max_filters": (["model.base_filters=1000000", "model.max_filters=1000000"],
                             "model.base_filters: 1000000 makes the network's weights "
                             + FITS.format(key=r"model\.base_filters")),
    "n_conv": (["model.n_conv=1000000"], r"model.n_conv: 1000000 pooling layers need a sample size "
               r"divisible by 2\^1000000; data.sample_size 128 fits n_conv in \[1, 2, 3, 4, 5, 6, 7\]"),
    "unet.levels": ([*RECONSTRUCT, "unet.levels=1000000"], r"unet.levels: 1000000 levels need a sample size "
                    r"divisible by 2\^999999"),
    "unet.width": ([*RECONSTRUCT, "unet.width=1000000", "unet.max_width=1000000"],
                   "unet.width: 1000000 makes the network's weights " + FITS.format(key=r"unet\.width")),
    "unet.width above max": ([*RECONSTRUCT, "unet.width=128"], r"unet.width: 128 channels exceed "
                             r"unet.max_width \(64\)"),
}


def check_memory(cfg: Config, memory: int) -> None:
    """What ``config.validate`` does with :func:`memory_problem`, for a given memory."""
    problem = memory_problem(cfg, Config(), memory)
    if problem:
        raise ConfigError(problem)


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


def _yaml(sets: list[str]) -> str:
    """The ``--set`` assignments as a config file, one flow mapping per section."""
    sections: dict[str, list[str]] = {}
    for assignment in sets:
        key, value = assignment.split("=", 1)
        section, _, name = key.rpartition(".")
        sections.setdefault(section, []).append(f"{name}: {value}")
    top = sections.pop("", [])
    return "\n".join([*top, *(f"{sec}: {{{', '.join(items)}}}" for sec, items in sections.items())]) + "\n"


@pytest.mark.parametrize("case", list(CASES))
def test_sizes_beyond_memory_are_one_line_naming_the_key(case, tmp_path):
    sets, says = CASES[case]
    with pytest.raises(ConfigError, match=says) as err:
        load_config(None, sets)
    _one_line(err)
    (tmp_path / "cfg.yaml").write_text(_yaml(sets))
    with pytest.raises(ConfigError, match=says):
        load_config(tmp_path / "cfg.yaml")


def test_the_largest_fit_named_fits_and_one_step_more_does_not():
    memory = 1 << 30
    cfg = with_value(Config(), "model.dense[0]", 10 ** 9)
    with pytest.raises(ConfigError, match=r"model.dense\[0\]: .* of at most (\d+) fits") as err:
        check_memory(cfg, memory)
    fit = int(err.value.args[0].rsplit("at most ", 1)[1].split()[0])
    check_memory(with_value(cfg, "model.dense[0]", fit), memory)
    with pytest.raises(ConfigError):
        check_memory(with_value(cfg, "model.dense[0]", fit + 1), memory)
    key = next(k for k in size_keys(cfg, Config()) if k.name == "model.dense[0]")
    assert largest_fit(key, lambda v: v <= 7) == 7 and largest_fit(key, lambda v: False) is None


def test_the_spatial_grid_divides_one_samples_activation():
    cfg = load_config(None, ["data.sample_size=512", "model.global_pool=true"])
    assert need(cfg).activation == 32 * 512 ** 3 * 4  # the first conv's output, float32
    says = r"data.sample_size: 512 makes one sample's largest activation 16.0 GiB, more than this machine's"
    with pytest.raises(ConfigError, match=says):
        check_memory(cfg, 4 << 30)
    split = load_config(None, ["data.sample_size=512", "model.global_pool=true",
                               "parallel.grid={data: 1, spatial: [4, 2, 2]}"])
    check_memory(split, 4 << 30)  # 1 GiB on each of 16 parts


def _export(tmp_path: Path, changes: dict[str, dict]) -> Path:
    tree = Config().to_dict()
    for section, values in changes.items():
        tree[section] = {**tree[section], **values} if isinstance(tree.get(section), dict) else values
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(1)}, str(path), metadata={"format": "pt", CONFIG_KEY: json.dumps(tree)})
    return path


EXPORTS = {
    "dense": ({"model": {"dense": [1e9]}}, r"model.dense\[0\]: 1000000000 makes"),
    "base_filters": ({"model": {"base_filters": 1e6, "max_filters": 1e6}},
                     "model.base_filters: 1000000 makes"),
    "sample_size": ({"data": {"sample_size": 4096}}, "data.sample_size: 4096 makes"),
    "n_conv": ({"model": {"n_conv": 1e6}}, "model.n_conv: 1000000 pooling layers"),
}


@pytest.mark.parametrize("case", list(EXPORTS))
def test_an_exports_configuration_is_bounded_before_anything_is_built(case, tmp_path, monkeypatch):
    changes, says = EXPORTS[case]
    path = _export(tmp_path, changes)

    def never(*args, **kwargs):
        raise AssertionError("built or read before the configuration was checked")

    monkeypatch.setattr(cm, "build_network", never)
    monkeypatch.setattr("hybridpar.checkpoint.load_weights", never)
    with pytest.raises(ConfigError, match=f"{path}'s configuration: {says}") as err:
        cm.build_model_from_export(path)
    _one_line(err)


@pytest.mark.parametrize("name", ["demo.yaml", "cosmoflow_128.yaml", "reconstruct.yaml"])
def test_shipped_configs_are_within_the_bounds(name):
    cfg = load_config(ROOT / "launch/configs" / name)
    config_from_dict(cfg.to_dict())  # and as an export carries it
