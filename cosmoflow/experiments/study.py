"""The volume study's configuration, and the training runs it implies, one per input size and seed.

Why a file of its own: what makes the comparison fair is arithmetic (how many crops a universe gives,
how deep the model is at each size, how large a batch is so that every size takes the same optimizer
steps with the same learning rate), and it must be the same arithmetic in the study, its smoke test and
the printed plan. Training itself is the application's trainer, started under torchrun with ``--set``
overrides of one shared trainer configuration (the ``training`` section), so no second training loop
exists to drift from the first.

Per input size ``S`` of universes of side ``U`` (``r = U / S``, a power of two):

* the data are the same universe files, cut by the trainer into ``r³`` crops (``data.sample_size``);
* the model has ``model.n_conv - log2(r)`` conv/pool levels: one more per doubling, so the last conv
  output has the same extent at every size (as LBANN's large-input variant does);
* the global batch is ``batch_universes · r³`` crops and ``optimizer.base_batch`` is scaled by ``r³``
  too: every size then takes the same steps per epoch, each over the same number of voxels, at the same
  learning rate schedule, and sees every training voxel once per epoch.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cosmoflow.config import Config, ConfigError, load_config, read_yaml, set_key
from cosmoflow.generate import generate
from cosmoflow.universe import VOXEL_MPC


@dataclass(frozen=True)
class Universes:
    """One set of synthetic universes, generated once by :mod:`cosmoflow.generate` and reused."""

    dir: str = "data/volume_study"
    size: int = 128
    channels: int = 4
    train: int = 64
    val: int = 32
    train_seed: int = 151
    val_seed: int = 152
    smoothing: float = 1.0
    voxel_mpc: float = VOXEL_MPC
    workers: int = 2

    def split_dir(self, split: str) -> Path:
        """Where one split lives; the name holds everything that decides its files, so a directory is
        only ever reused for exactly the set asked for."""
        n, seed = (self.train, self.train_seed) if split == "train" else (self.val, self.val_seed)
        voxel = "" if self.voxel_mpc == VOXEL_MPC else f"_vox{self.voxel_mpc:g}"
        return Path(self.dir) / f"{split}_{self.size}_n{n}_seed{seed}_sm{self.smoothing:g}{voxel}"


@dataclass(frozen=True)
class SizeRun:
    """The trainer settings of one input size (the seed is the only other thing a run varies)."""

    size: int
    crops: int            # crops per universe, r³
    n_conv: int
    batch_size: int       # global, in crops
    base_batch: int       # optimizer.base_batch, scaled with the batch: the same learning rate at every size
    data: int
    spatial: tuple[int, int, int]

    @property
    def ranks(self) -> int:
        return self.data * math.prod(self.spatial)

    def overrides(self, study: Study, seed: int, run_dir: Path) -> list[str]:
        """The trainer's ``--set`` arguments of this size and seed."""
        u = study.universes
        return [f"run_dir={run_dir}", f"data.train={u.split_dir('train')}", f"data.val={u.split_dir('val')}",
                f"data.sample_size={self.size}", f"data.channels={u.channels}", f"model.n_conv={self.n_conv}",
                f"train.batch_size={self.batch_size}", f"optimizer.base_batch={self.base_batch}",
                f"train.seed={seed}", f"parallel.grid.data={self.data}",
                f"parallel.grid.spatial=[{','.join(map(str, self.spatial))}]", "parallel.grid.pipe=1"]


@dataclass
class Study:
    """The whole study: the universes, the seeds, one :class:`SizeRun` per input size, and the trainer
    config they share (written once to ``out/train_base.yaml``, each run's ``--set`` on top)."""

    universes: Universes
    seeds: list[int]
    batch_universes: int
    runs: list[SizeRun]
    training: dict[str, Any]
    out: str = "runs/volume_study"
    results: str = "perf/results/volume_study.json"
    source: str = ""

    def run_dir(self, run: SizeRun, seed: int) -> Path:
        return Path(self.out) / "runs" / f"{run.size}_seed{seed}"

    def base_config(self) -> Path:
        return Path(self.out) / "train_base.yaml"

    def trainer_config(self, run: SizeRun, seed: int) -> Config:
        """The trainer's typed config of one run, validated as the trainer will (written base + overrides)."""
        return load_config(self.base_config(), run.overrides(self, seed, self.run_dir(run, seed)))

    def write_base_config(self) -> Path:
        path = self.base_config()
        path.parent.mkdir(parents=True, exist_ok=True)
        text = yaml.safe_dump(self.training, sort_keys=False)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
        return path


_KEYS = {"extends", "universes", "seeds", "batch_universes", "sizes", "training", "out", "results"}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``, section by section (a nested mapping merges key by key)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else copy.deepcopy(value)
    return out


def read_tree(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A study's YAML with what it ``extends`` (a path relative to it) underneath, so a variant of a study
    (another machine, another universe size) states only what differs and cannot drift from the study
    it varies. ``sizes`` is the exception: a variant's ``sizes`` replaces its base's whole, since the
    sizes a study compares are one decision, not a list to add to."""
    if not path.is_file():
        raise ConfigError(f"study config {path} does not exist (see launch/configs/volume_study.yaml)")
    if path.resolve() in seen:
        raise ConfigError(f"{path}: extends itself through {' -> '.join(map(str, seen))}")
    tree = read_yaml(path.read_text(), str(path)) or {}
    unknown = set(tree) - _KEYS
    if unknown:
        raise ConfigError(f"{path}: unknown keys {sorted(unknown)} (valid: {', '.join(sorted(_KEYS))})")
    parent = tree.pop("extends", None)
    if parent is None:
        return tree
    base = read_tree(path.parent / str(parent), (*seen, path.resolve()))
    sizes = tree.pop("sizes", None)
    merged = _merge(base, tree)
    if sizes is not None:
        merged["sizes"] = copy.deepcopy(sizes)
    return merged


def _size_run(size: int, entry: dict[str, Any], u: Universes, n_conv: int, batch_universes: int,
              base_batch: int, where: str) -> SizeRun:
    ratio = u.size // size if size > 0 else 0
    if size < 1 or u.size % size or ratio & (ratio - 1):
        fits = [u.size >> k for k in range(8) if u.size >> k >= 2 and (u.size >> k) << k == u.size]
        raise ConfigError(f"{where}: input size {size} must be the universe size {u.size} divided by a power "
                          f"of two; sizes that fit: {fits}")
    levels = n_conv - int(math.log2(ratio))
    if levels < 1:
        raise ConfigError(f"{where}: training.model.n_conv {n_conv} at {u.size}^3 leaves {levels} conv/pool "
                          f"levels at {size}^3 (one fewer per halving); raise n_conv to at least "
                          f"{n_conv - levels + 1} or drop this size")
    grid = entry.get("grid", {})
    unknown = set(entry) - {"grid"} or set(grid) - {"data", "spatial"}
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; a size takes grid: {{data: D, spatial: "
                          "[a, b, c]}}")
    data, spatial = int(grid.get("data", 1)), tuple(int(s) for s in grid.get("spatial", [1, 1, 1]))
    if len(spatial) != 3 or data < 1 or min(spatial) < 1:
        raise ConfigError(f"{where}.grid: data {data} and spatial {list(spatial)} must be positive, spatial "
                          "three entries (D, H, W)")
    crops = ratio ** 3
    batch = batch_universes * crops
    if batch % data:
        raise ConfigError(f"{where}: the global batch of {batch} crops ({batch_universes} universes' worth) "
                          f"does not divide over data={data} replicas; use a batch_universes that does")
    return SizeRun(size, crops, levels, batch, base_batch * crops, data, spatial)


def load_study(path: str | Path, out: str | None = None, results: str | None = None,
               sets: list[str] | None = None) -> Study:
    """Read and check the study's YAML; every run's trainer config is validated here, before any runs.

    ``sets``: ``key=value`` overrides of the trainer config every run shares (``model.batchnorm=true``),
    applied over the YAML's ``training`` section: a fix tried at every size at once. The keys the
    study sets per run (``data.*``, ``train.batch_size``, ``train.seed``, ``optimizer.base_batch``,
    ``parallel.grid``) still come from the study."""
    p = Path(path)
    tree = read_tree(p)
    try:
        u = Universes(**tree.get("universes", {}))
    except TypeError as err:
        raise ConfigError(f"{p}: universes: {err}") from None
    training = copy.deepcopy(tree.get("training") or {})
    for item in sets or []:
        set_key(training, item)
    training.pop("run_dir", None)  # one per run, set by the study
    n_conv = int(training.get("model", {}).get("n_conv", Config().model.n_conv))
    base_batch = int(training.get("optimizer", {}).get("base_batch", Config().optimizer.base_batch))
    batch_universes = int(tree.get("batch_universes", 1))
    sizes = tree.get("sizes") or {}
    if not sizes:
        raise ConfigError(f"{p}: sizes: name at least one input size, e.g. "
                          f"{{{u.size}: {{grid: {{data: 1}}}}}}")
    runs = [_size_run(int(s), e or {}, u, n_conv, batch_universes, base_batch, f"{p}: sizes.{s}")
            for s, e in sorted(sizes.items(), key=lambda kv: int(kv[0]))]
    seeds = [int(s) for s in tree.get("seeds", [0])]
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError(f"{p}: seeds {seeds}: give distinct seeds (two or more to measure a spread)")
    study = Study(u, seeds, batch_universes, runs, training, out or tree.get("out", Study.out),
                  results or tree.get("results", Study.results), source=str(p))
    study.write_base_config()
    for run in runs:
        try:
            study.trainer_config(run, seeds[0])
        except ConfigError as err:
            raise ConfigError(f"{p}: sizes.{run.size}: {err}") from None
    return study


def prepare_data(study: Study) -> None:
    """Generate the study's universes, or reuse those already there: the training runs and the
    classical reference (:mod:`.reference`) read the same files."""
    u = study.universes
    for split, n, seed in (("train", u.train, u.train_seed), ("val", u.val, u.val_seed)):
        out = u.split_dir(split)
        have = sorted(out.glob("*.h5")) if out.is_dir() else []
        if len(have) > n:
            raise ConfigError(f"{out}: {len(have)} universes, but the study asks for {n}; the directory "
                              "must hold exactly its set (remove the extra files or change universes.dir)")
        generate(out, n, u.size, workers=u.workers, seed=seed, smoothing=u.smoothing, linear=False,
                 voxel_mpc=u.voxel_mpc,
                 progress=len(have) < n)
