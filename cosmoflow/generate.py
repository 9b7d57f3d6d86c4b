"""Write synthetic universes to disk in the layout of the real CosmoFlow files.

Why a CLI of its own: everything downstream (formats, packing, the loader, training) is meant to run
unchanged on the real ExaLearn files, so the generator writes exactly their layout, one HDF5 file per
universe with ``full`` (S, S, S, 4) int16 channels last and ``unitPar`` (4,) float32, and nothing
the regression task reads may rely on what it adds: the attributes (the physical parameters, box size,
seed) and ``linear`` (S, S, S) float32, the smoothed z = 0 linear density contrast that displaced the
particles, which is the truth of the reconstruction task (``--no-linear`` leaves it out)::

    python -m cosmoflow.generate --out data/universes --universes 64 --size 64 --workers 2

Universe ``i`` of base seed ``s`` is drawn from the seed ``(s, i)``, so a file does not depend on how
many workers wrote it or how many universes were asked for. Files are written under a temporary name
and renamed when complete; files already there are kept, so an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import TextIO

import h5py
import numpy as np

from cosmoflow.universe import (
    PARAM_NAMES,
    REDSHIFTS,
    SMOOTHING,
    VOXEL_MPC,
    Cosmology,
    box_size,
    draw_unit_params,
    make_universe,
    make_universe_and_linear,
)


class ProgressBar:
    """A plain-text progress bar on stderr: ``label [#####.....] 5/10 1.2 s/it ETA 6s``.

    Why not tqdm: one dependency fewer, and a carriage-return bar that degrades to one line per
    update when stderr is not a terminal (logs stay readable in batch jobs).
    """

    def __init__(self, total: int, label: str = "", unit: str = "it", width: int = 30,
                 stream: TextIO | None = None) -> None:
        self.total, self.label, self.unit, self.width = total, label, unit, width
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.start = time.perf_counter()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._draw()

    def update(self, n: int = 1) -> None:
        self.done += n
        self._draw()

    def close(self) -> None:
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self) -> None:
        frac = self.done / self.total if self.total else 1.0
        filled = int(round(frac * self.width))
        elapsed = time.perf_counter() - self.start
        per = elapsed / self.done if self.done else 0.0
        if not self.done:
            rate = f"- s/{self.unit}"
        elif per >= 1.0:
            rate = f"{per:.1f} s/{self.unit}"
        else:
            rate = f"{1.0 / max(per, 1e-9):.1f} {self.unit}/s"
        line = (f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                f"{rate} ETA {per * (self.total - self.done):.0f}s")
        if self._tty:
            self.stream.write("\r" + line)
        else:  # not a terminal: a line per tenth of the way, so logs stay short
            tenth = 10 * self.done // max(self.total, 1)
            if self.done in (0, self.total) or tenth != 10 * (self.done - 1) // max(self.total, 1):
                self.stream.write(line + "\n")
        self.stream.flush()


_CHUNK = 32
"""Side of an HDF5 chunk (checksums need a chunked layout): a sub-cube of 32³ voxels, 256 KiB of
counts, whole chunks of any sample side that is a multiple of 32."""


def universe_path(out: Path, seed: int, index: int) -> Path:
    """File name of universe ``index`` of base seed ``seed``."""
    return out / f"univ_s{seed}_{index:05d}.h5"


def write_universe(path: Path, size: int, seed: int, index: int, smoothing: float = SMOOTHING,
                   linear: bool = True, voxel_mpc: float = VOXEL_MPC) -> Path:
    """Generate universe ``index`` of base seed ``seed`` and write it atomically to ``path``."""
    unit = draw_unit_params((seed, index))
    if linear:
        full, delta = make_universe_and_linear(size, unit, (seed, index), smoothing=smoothing,
                                                voxel_mpc=voxel_mpc)
    else:
        full, delta = make_universe(size, unit, (seed, index), smoothing=smoothing, voxel_mpc=voxel_mpc), None
    cosmo = Cosmology.from_unit(unit)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    chunk = min(size, _CHUNK)
    with h5py.File(tmp, "w") as f:  # Fletcher-32 checksums: a damaged file is an error on read
        f.create_dataset("full", data=full, chunks=(chunk, chunk, chunk, full.shape[-1]), fletcher32=True)
        f.create_dataset("unitPar", data=unit.astype(np.float32), fletcher32=True)
        if delta is not None:
            ds = f.create_dataset("linear", data=delta, chunks=(chunk,) * 3, fletcher32=True)
            ds.attrs["description"] = ("z = 0 linear density contrast, smoothed as the field that displaced "
                                       "the particles (the reconstruction target)")
        f.attrs["physPar"] = np.array([cosmo.omega_m, cosmo.sigma_8, cosmo.n_s, cosmo.h0])
        f.attrs["physParNames"] = ",".join(PARAM_NAMES)
        f.attrs["redshifts"] = np.asarray(REDSHIFTS)
        f.attrs["box_mpc_h"] = box_size(size, cosmo.h0, voxel_mpc)
        f.attrs["seed"] = np.array([seed, index])
        f.attrs["smoothing_mpc_h"] = smoothing
        f.attrs["voxel_mpc"] = voxel_mpc
        f.attrs["generator"] = "hybridpar cosmoflow.universe (EH98 no-wiggle, Zel'dovich, NGP)"
    os.replace(tmp, path)
    return path


def generate(out: str | Path, universes: int, size: int, workers: int = 1, seed: int = 0,
             overwrite: bool = False, progress: bool = True, smoothing: float = SMOOTHING,
             linear: bool = True, voxel_mpc: float = VOXEL_MPC) -> list[Path]:
    """Write ``universes`` files of ``size``³ into ``out``; returns all their paths (kept ones too)."""
    if universes < 1:
        raise ValueError(f"--universes must be at least 1, got {universes}")
    if size < 2:
        raise ValueError(f"--size must be at least 2 voxels, got {size}")
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    if smoothing < 0:
        raise ValueError(f"--smoothing must be >= 0 Mpc/h, got {smoothing}")
    if voxel_mpc <= 0:
        raise ValueError(f"--voxel-mpc must be positive, got {voxel_mpc}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [universe_path(out, seed, i) for i in range(universes)]
    todo = [i for i, p in enumerate(paths) if overwrite or not p.exists()]
    bar = ProgressBar(len(todo), label=f"universes {size}^3", unit="universe") if progress else None
    if workers == 1 or len(todo) <= 1:
        for i in todo:
            write_universe(paths[i], size, seed, i, smoothing, linear, voxel_mpc)
            if bar:
                bar.update()
    else:
        with ProcessPoolExecutor(max_workers=min(workers, len(todo))) as pool:
            futures = [pool.submit(write_universe, paths[i], size, seed, i, smoothing, linear, voxel_mpc)
                       for i in todo]
            for fut in as_completed(futures):
                fut.result()
                if bar:
                    bar.update()
    if bar:
        bar.close()
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cosmoflow.generate", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory to write univ_s<seed>_<i>.h5 files into")
    parser.add_argument("--universes", type=int, required=True, help="number of universes")
    parser.add_argument("--size", type=int, required=True, help="voxels per side (the real set: 512)")
    parser.add_argument("--workers", type=int, default=1, help="processes generating in parallel")
    parser.add_argument("--seed", type=int, default=0, help="base seed; universe i uses seed (seed, i)")
    parser.add_argument("--overwrite", action="store_true", help="rewrite files that already exist")
    parser.add_argument("--smoothing", type=float, default=SMOOTHING,
                        help=f"Gaussian smoothing of the linear field, Mpc/h (default {SMOOTHING}); smaller "
                             "keeps more small-scale modes, so sigma_8 is easier to learn from small samples")
    parser.add_argument("--voxel-mpc", type=float, default=VOXEL_MPC,
                        help=f"voxel side in Mpc (default {VOXEL_MPC:.4g}, 1 Mpc/h at H_0 = 70); twice it "
                             "covers the same box with half the voxels per side")
    parser.add_argument("--no-linear", dest="linear", action="store_false",
                        help="do not write the linear density field (the reconstruction target); files "
                             "shrink by a third")
    args = parser.parse_args(argv)
    try:
        paths = generate(args.out, args.universes, args.size, args.workers, args.seed, args.overwrite,
                         smoothing=args.smoothing, linear=args.linear, voxel_mpc=args.voxel_mpc)
    except ValueError as err:
        parser.error(str(err))
    print(f"{len(paths)} universes of {args.size}^3 in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
