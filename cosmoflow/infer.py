"""A trained reconstruction run on whole boxes, file to file, split over the ranks.

    torchrun --nproc-per-node 4 -m cosmoflow.infer RUN_DIR --input IN.h5[:full] --output OUT.h5[:prediction]
             [--step N] [--grid D,H,W] [--overwrite] [--truth TRUTH.h5[:linear]]
    mpirun -n 4 python -m cosmoflow.infer ...        srun python -m cosmoflow.infer ...

Why: the U-Net of a reconstruction run is trained on crops, but a simulation box is what a scientist
wants reconstructed, and a box is larger than one device holds. Here the run's model is rebuilt from
its saved config, its checkpoint loaded (the newest intact version, or ``--step``), and every box of
the input run split over the ranks by :func:`hybridpar.infer`: each rank reads only its hyperslab
of the input and writes only its shard of the output, which is the one-process output (periodic boxes
wrap around, as the model's circular padding says).

The input is what the run's data files hold: particle counts channels last, one box (D, H, W, C) or
several (N, D, H, W, C) (dataset ``full`` unless named), of which the run's first ``data.channels``
channels are read and fed as ``log1p``, as in training. The output is a new file holding the dataset
(default ``prediction``) of shape (N, 1, D, H, W), float32. One process writes it as one
self-contained file. With h5py built for MPI and ranks started by mpirun or srun, all ranks write one
file with the MPI driver; otherwise (or with ``HYBRIDPAR_HDF5_WRITER=files``) each rank writes its
shard into ``OUT.rankNNNN.h5`` beside the output and rank 0 writes the output as an HDF5 virtual
dataset of them (:class:`hybridpar.data.split_hdf5.SplitHdf5`): a reader sees one dataset either way
(keep the rank files beside it). Every file is written under a temporary name, renamed when complete
and removed on any failure; every file the write will create (rank files included) is checked before
any work, and an existing one is replaced only with ``--overwrite``. Rank files of the output that
this write does not make (``OUT.rank0003.h5`` of an earlier run on more ranks) are refused too, and
removed with ``--overwrite`` once the new output is in place (rank 0 says so in one line).

A checkpoint saved on other ranks than the inference runs on loads all the same: the model is whole in
every version, and the per-rank state (data loader position, random generators) is not needed; rank 0
says so in one line.

``--truth`` (dataset ``linear`` unless named; (D, H, W) or (N, D, H, W)) scores each box against
the true initial field: r(k) and the transfer function T(k) = sqrt(P_pred / P_truth) per shell of
the box's fundamental frequency, computed on the split volumes with ``hp.fft``.

Bad input (a missing file or dataset, a box the split or the U-Net cannot take, a checkpoint of
another model, an output or rank file that exists without ``--overwrite``, a directory in the place of
one) is one line, exit status 2.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import torch
import torch.distributed as dist

import hybridpar as hp
from cosmoflow import errors
from cosmoflow.config import Config, ConfigError, load_config
from cosmoflow.correlation import correlation, shell_centres, shell_edges
from cosmoflow.data import HDF5_SUFFIXES, log_counts
from cosmoflow.reconstruct import build_unet
from cosmoflow.validate import DataError, count_problem
from hybridpar.checkpoint import Checkpointer
from hybridpar.comm.redistribute import local_box
from hybridpar.data.hdf5 import check_datasets
from hybridpar.data.split_hdf5 import SplitHdf5, check_targets, writer_mode
from hybridpar.inference import output_grid, output_shape
from hybridpar.process import failure


def split_path(text: str, default: str) -> tuple[Path, str]:
    """``FILE.h5[:DATASET]`` -> (file, dataset): the last ':' after an HDF5 suffix names the dataset."""
    head, sep, tail = text.rpartition(":")
    if sep and head.lower().endswith(HDF5_SUFFIXES) and tail:
        return Path(head), tail
    return Path(text), default


def parse_grid(text: str | None, world: int) -> tuple[int, int, int]:
    """``--grid D,H,W`` (default: the ranks along D), which must use every rank."""
    if text is None:
        return (world, 1, 1)
    try:
        grid = tuple(int(v) for v in text.split(","))
    except ValueError:
        grid = ()
    if len(grid) != 3 or min(grid) < 1:
        raise ConfigError(f"--grid {text}: expected three positive integers D,H,W, e.g. {world},1,1")
    if grid[0] * grid[1] * grid[2] != world:
        raise ConfigError(f"--grid {text}: splits into {grid[0] * grid[1] * grid[2]} shards, but the job has "
                          f"{world} ranks; give a split of {world} (e.g. {world},1,1)")
    return grid  # type: ignore[return-value]


def run_config(run_dir: Path) -> Config:
    """The config a run directory was last started with (``config.yaml``, or the newest
    ``config.N.yaml`` when a restart changed it)."""
    if not run_dir.is_dir():
        raise ConfigError(f"run directory {run_dir} does not exist")
    found = [(0, run_dir / "config.yaml")] if (run_dir / "config.yaml").is_file() else []
    for p in run_dir.glob("config.*.yaml"):
        middle = p.name[len("config."):-len(".yaml")]
        if middle.isdigit():
            found.append((int(middle), p))
    if not found:
        raise ConfigError(f"{run_dir}: no config.yaml; is it a run directory of launch/train.py?")
    cfg = load_config(max(found)[1])
    if cfg.task != "reconstruct":
        raise ConfigError(f"{run_dir}: a '{cfg.task}' run predicts four parameters per volume; whole-box "
                          "inference writes a volume and needs a 'reconstruct' run")
    return cfg


def open_dataset(path: Path, name: str, what: str, ndims: tuple[int, ...]) -> h5py.Dataset:
    """Dataset ``name`` of ``path`` (opened read-only and checked: nothing outside its folder, every
    declared value stored), of one of ``ndims`` dimensions."""
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a directory; name an HDF5 file (FILE.h5[:DATASET])")
    if not path.is_file():
        raise ConfigError(f"{what} {path} does not exist")
    try:
        f = h5py.File(path, "r")
    except OSError as err:
        raise ConfigError(f"{what} {path} is not a readable HDF5 file ({err})") from None
    check_datasets(f, [name])
    ds = f.get(name)
    if not isinstance(ds, h5py.Dataset):
        have = sorted(k for k in f if isinstance(f.get(k), h5py.Dataset))
        f.close()
        raise ConfigError(f"{what} {path} has no dataset '{name}' (datasets: {', '.join(have) or 'none'}); "
                          f"name one as {path}:DATASET")
    if ds.ndim not in ndims:
        shape = ds.shape
        f.close()
        raise ConfigError(f"{what} {path}:{name} has shape {shape}; expected {' or '.join(map(str, ndims))} "
                          "dimensions")
    return ds


class CountsReader:
    """The run's input from a counts dataset channels last, seen as (N, C, D, H, W) float32: the first
    ``channels`` channels, ``log1p``, as training reads them; only the hyperslab asked for is read."""

    def __init__(self, ds: h5py.Dataset, channels: int) -> None:
        self.ds, self.channels = ds, channels
        lead = ds.shape[:-4] or (1,)
        if ds.shape[-1] < channels:
            raise ConfigError(f"input {ds.file.filename}:{ds.name} has {ds.shape[-1]} channels (last dim of "
                              f"{ds.shape}); the run reads {channels}")
        self.shape = (lead[0], channels, *ds.shape[-4:-1])

    def __getitem__(self, index: tuple) -> np.ndarray:
        n, _, *box = index
        sel = (*box, slice(0, self.channels))
        raw = self.ds[(n, *sel)] if self.ds.ndim == 5 else self.ds[sel]
        problem = count_problem(raw)
        if problem is not None:
            where = ", ".join(f"{s.start}:{s.stop}" for s in box)
            raise DataError(f"input {self.ds.file.filename}:{self.ds.name} box {n} [{where}]: {problem}")
        return log_counts(raw)


class TruthScore:
    """r(k) and T(k) of each predicted box against the truth, per shell of the fundamental frequency,
    from the split prediction and this rank's hyperslab of the truth (``hp.fft`` on the output's
    layout; the per-shell sums are all-reduced over it)."""

    def __init__(self, ds: h5py.Dataset, grid: hp.ProcessGrid, volume: tuple[int, int, int],
                 boxes: int) -> None:
        if len(set(volume)) != 1:
            raise ConfigError(f"--truth: shells of |k| need a cubic box, the box is {volume}")
        want = volume if boxes == 1 and ds.ndim == 3 else (boxes, *volume)
        if tuple(ds.shape) != want:
            raise ConfigError(f"--truth {ds.file.filename}:{ds.name} has shape {ds.shape}; expected {want}")
        self.ds, self.grid, self.volume = ds, grid, volume
        self.edges = shell_edges(volume[0])
        self.rows: list[tuple[int, np.ndarray, np.ndarray]] = []

    def _sums(self, a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
        """Per shell [Σ Re(a b*), Σ |a|², Σ |b|²] over the modes, each counted with its conjugate twin
        (as :func:`cosmoflow.correlation.cross_power` counts them in one process)."""
        sa, sb = hp.fft.rfftn(a, self.grid, self.volume), hp.fft.rfftn(b, self.grid, self.volume)
        fa, fb = sa.data[0, 0], sb.data[0, 0]
        kd, kh, kw = sa.wavenumbers()
        length = torch.sqrt(kd ** 2 + kh ** 2 + kw ** 2).expand(fa.shape)
        n = self.volume[2]
        twin = torch.where((kw == 0) | ((n % 2 == 0) & (kw == n // 2)), 1.0, 2.0).expand(fa.shape)
        edges = torch.as_tensor(self.edges, dtype=length.dtype, device=length.device)
        bins = len(self.edges) - 1
        shell = torch.bucketize(length, edges, right=True) - 1  # np.digitize's convention
        inside = (length > 0) & (shell >= 0) & (shell < bins)
        out = torch.zeros(3, bins, dtype=torch.float64, device=fa.device)
        x, y, w = fa[inside], fb[inside], twin[inside].double()
        for i, v in enumerate(((x * y.conj()).real, x.abs() ** 2, y.abs() ** 2)):
            out[i].index_add_(0, shell[inside], w * v.double())
        if self.grid.spatial_size > 1:
            dist.all_reduce(out, group=self.grid.spatial_group)
        return out.cpu().numpy()

    def __call__(self, n: int, y_local: torch.Tensor) -> None:
        box = local_box(self.volume, self.grid)
        sel = tuple(slice(lo, hi) for lo, hi in box)
        t = self.ds[sel] if self.ds.ndim == 3 else self.ds[(n, *sel)]
        truth = torch.from_numpy(np.asarray(t, dtype=np.float64))[None, None]
        sums = self._sums(y_local[:, :1].double(), truth.to(y_local.device))
        with np.errstate(invalid="ignore", divide="ignore"):
            transfer = np.sqrt(sums[1] / sums[2])
        self.rows.append((n, correlation(sums), transfer))

    def table(self) -> str:
        """Per box, r(k) and T(k) per shell, k in units of the fundamental frequency."""
        k = shell_centres(self.edges)
        lines = []
        for n, r, t in self.rows:
            lines.append(f"box {n}: shell k/k_f  " + " ".join(f"{v:6.1f}" for v in k))
            lines.append(f"box {n}: r(k)         " + " ".join(f"{v:6.3f}" for v in r))
            lines.append(f"box {n}: T(k)         " + " ".join(f"{v:6.3f}" for v in t))
        return "\n".join(lines)


def _say(rank: int) -> Callable[[str], None]:
    return (lambda line: print(line, flush=True)) if rank == 0 else (lambda line: None)


def load_model_state(run_dir: Path, step: int | None, rank: int) -> dict:
    """The model weights and step of the run's newest intact checkpoint (or of ``step``). What the
    checkpointer would warn about (a damaged copy skipped, per-rank state of another world size not
    needed) is one line each on rank 0, not a warning with its source line."""
    ckpt = Checkpointer(run_dir / "checkpoints", None, keep_last=None)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = ckpt.load(step, keys=("model", "step"))
    finally:
        ckpt.close()
    if rank == 0:
        for w in caught:
            print(str(w.message), file=sys.stderr, flush=True)
    if state is None:
        raise ConfigError(f"{run_dir / 'checkpoints'}: no checkpoint yet; train the run first")
    return state


def run(args: argparse.Namespace) -> None:
    """Infer every box of ``--input`` with the run's model into ``--output`` (see module doc)."""
    info = hp.init_distributed()
    say = _say(info.rank)
    run_dir = Path(args.run_dir)
    cfg = run_config(run_dir)
    grid = parse_grid(args.grid, info.world_size)
    in_path, in_name = split_path(args.input, "full")
    out_path, out_name = split_path(args.output, "prediction")
    # every file the write will create, before any work (SplitHdf5 checks again)
    check_targets(out_path, info.world_size, writer_mode(), args.overwrite)
    reader = CountsReader(open_dataset(in_path, in_name, "input", (4, 5)), cfg.data.channels)
    n_box, channels, *volume = reader.shape
    model = build_unet(cfg, channels)
    unet = getattr(model, "unet", model)
    for extent in volume:
        unet.check_extent(extent)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    state = load_model_state(run_dir, args.step, info.rank)
    errors.check_loadable(shapes, state["model"],
                          f"{run_dir / 'checkpoints'} (step {state.get('step', args.step)})")
    model.load_state_dict(state["model"], strict=True)
    spec = {"grid": {"data": 1, "pipe": 1, "spatial": list(grid)}}
    engine = hp.parallelize(model, spec, input_shape=(1, channels, *volume))
    out_shape = (n_box, *output_shape(engine)[1:])
    score = None
    if args.truth:
        t_path, t_name = split_path(args.truth, "linear")
        score = TruthScore(open_dataset(t_path, t_name, "truth", (3, 4)), output_grid(engine), tuple(volume),
                           n_box)
    started = time.monotonic()

    def progress(n: int, total: int, seconds: float) -> None:
        say(f"box {n + 1}/{total}: {seconds:.1f} s")

    with SplitHdf5(out_path, out_name, out_shape, overwrite=args.overwrite) as output:  # removed on failure
        say(f"inferring {n_box} box(es) of {'x'.join(map(str, volume))} voxels on {info.world_size} rank(s) "
            f"split {grid}, step {state.get('step', '?')} of {run_dir}, writing {output.mode}")
        hp.infer(engine, reader, output, each=score, progress=progress)
    if output.removed:
        names = ", ".join(p.name for p in output.removed)
        say(f"removed {len(output.removed)} rank file(s) of an earlier write that {out_path} no longer uses: "
            f"{names}")
    if score is not None:
        say(score.table())
    say(f"wrote {out_path}:{out_name} {out_shape} in {time.monotonic() - started:.1f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cosmoflow.infer", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a reconstruct run's directory (config.yaml, checkpoints/)")
    ap.add_argument("--input", required=True, help="IN.h5[:DATASET] (default dataset: full)")
    ap.add_argument("--output", required=True, help="OUT.h5[:DATASET] (default dataset: prediction)")
    ap.add_argument("--step", type=int, help="the checkpoint of this step (default: the newest intact one)")
    ap.add_argument("--grid", help="spatial split D,H,W over all ranks (default: the ranks along D)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace an existing output (and remove rank files of it this run does not write)")
    ap.add_argument("--truth", help="TRUTH.h5[:DATASET] (default dataset: linear): print r(k) and T(k)")
    args = ap.parse_args(argv)
    return errors.run_job(lambda: run(args))


if __name__ == "__main__":
    failure.run_main(main)  # under torchelastic's @record: torchrun's report names the root cause
