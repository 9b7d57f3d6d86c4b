"""How much training time a checkpoint costs: torch.save vs torch.distributed.checkpoint.async_save vs
hybridpar's Checkpointer (plain snapshot, overlapped snapshot, and L1 + L3), and how long a restart takes.

    python -m perf checkpoint                # 1 GiB state, 1 s steps, a save every 5
    python -m perf checkpoint --gib 0.25 --steps 12 --every 3   # quick look

The state is a model and its momentum (float32, 64 MiB tensors) that every step updates in place, as an
optimizer would; a step is ``--step-s`` of simulated compute (``--compute sleep``: the host idles as it
does while an accelerator runs the forward/backward; ``matmul``: a one-thread matmul loop keeps a core
busy) followed by that update. Per mode it reports the *stall*: the time the training loop spends on a
checkpoint (inside the save call, waiting for the previous save, and for the overlapped mode, waiting in
``before_update``), as the median over the saves after the first (which also allocates buffers), and the
end-to-end slowdown of the loop against a run without checkpoints. Restart times read a 1-rank version
back with a cold page cache (``posix_fadvise(DONTNEED)`` after fsync). Writes ``perf/results/
checkpoint.json`` and prints a table. Everything is written under ``--dir`` and removed afterwards.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import hybridpar
from hybridpar.checkpoint import Checkpointer
from hybridpar.checkpoint.format import evict
from perf import common

TENSOR_MIB = 64


def make_state(gib: float, tensor_mib: float = TENSOR_MIB) -> dict:
    n = max(2, round(gib * 1024 / tensor_mib))
    numel = int(tensor_mib * (1 << 20)) // 4
    g = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.weight": torch.randn(numel, generator=g) for i in range(n // 2)}
    mom = {f"layers.{i}.weight": {"momentum_buffer": torch.zeros(numel)} for i in range(n - n // 2)}
    return {"model": model, "optimizer": {"state": mom}, "step": 0}


def update(state: dict) -> None:
    """An optimizer step: every tensor changed in place (bumps the version counters, as SGD would)."""
    with torch.no_grad():
        for t in state["model"].values():
            t.mul_(0.9999)
        for s in state["optimizer"]["state"].values():
            s["momentum_buffer"].add_(1e-4)


def compute_fn(kind: str, seconds: float) -> Callable[[], None]:
    if kind == "sleep":
        return lambda: time.sleep(seconds)
    a = torch.randn(384, 384)
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    per = (time.perf_counter() - t0) / 20
    reps = max(1, round(seconds / per))

    def run() -> None:
        for _ in range(reps):
            a @ a

    return run


class Saver:
    """One way of checkpointing, as the training loop sees it."""

    name = "none"

    def save(self, step: int, state: dict) -> None: ...

    def before_update(self) -> None: ...

    def finish(self) -> None: ...


class TorchSave(Saver):
    name = "torch.save"

    def __init__(self, d: Path) -> None:
        self.path = d / "state.pt"

    def save(self, step: int, state: dict) -> None:
        torch.save(state, self.path)


class DcpAsync(Saver):
    name = "dcp.async_save"

    def __init__(self, d: Path) -> None:
        self.d, self.fut, self.dirs = d, None, []

    def save(self, step: int, state: dict) -> None:
        if self.fut is not None:
            self.fut.result()  # DCP asks for the previous save to be done before the next
        while len(self.dirs) > 2:
            shutil.rmtree(self.dirs.pop(0), ignore_errors=True)
        path = self.d / f"step{step}"
        self.dirs.append(path)
        self.fut = dcp.async_save(state, checkpoint_id=str(path))

    def finish(self) -> None:
        if self.fut is not None:
            self.fut.result()


class Ours(Saver):
    def __init__(self, d: Path, overlap: bool, local: bool) -> None:
        self.overlap = overlap
        self.name = "hybridpar" + (" overlap" if overlap else "") + (" L1+L3" if local else "")
        self.ckpt = Checkpointer(d / "shared", keep_last=2, local_dir=d / "local" if local else None,
                                 keep_local=1)

    def save(self, step: int, state: dict) -> None:
        self.ckpt.save(step, state, {"epoch": 0}, overlap=self.overlap)

    def before_update(self) -> None:
        self.ckpt.before_update()

    def finish(self) -> None:
        self.ckpt.close()


def train(saver: Saver, state: dict, args: argparse.Namespace, compute: Callable[[], None]) -> dict:
    step_times, stalls = [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        compute()
        tb = time.perf_counter()
        saver.before_update()
        waited = time.perf_counter() - tb
        if stalls:
            stalls[-1] += waited
        update(state)
        if (step + 1) % args.every == 0:
            state["step"] = step
            ts = time.perf_counter()
            saver.save(step, state)
            stalls.append(time.perf_counter() - ts)
        step_times.append(time.perf_counter() - t0)
    tf = time.perf_counter()
    saver.finish()
    tail = time.perf_counter() - tf
    steady = stalls[1:] or stalls
    return {"steps": args.steps, "loop_s": sum(step_times), "tail_s": tail, "stalls_s": stalls,
            "stall_first_s": stalls[0] if stalls else 0.0,
            "stall_median_s": statistics.median(steady) if steady else 0.0}


def _cold(paths: list[Path]) -> None:
    for root in paths:
        for p in sorted(root.rglob("*")) if root.is_dir() else [root]:
            if p.is_file():
                with open(p, "rb+") as f:
                    os.fsync(f.fileno())
                evict(p)


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    del out
    gc.collect()
    return dt


def restart_times(d: Path, state: dict) -> dict:
    """Cold-cache restart from each mode's last checkpoint (written by the runs above, kept for this)."""
    out = {}
    _cold([d / "ours-local"])
    out["hybridpar L1"] = _timed(lambda: Checkpointer(d / "ours-local" / "shared",
                                                      local_dir=d / "ours-local" / "local").load())
    _cold([d / "ours-local"])
    out["hybridpar L3"] = _timed(lambda: Checkpointer(d / "ours-local" / "shared").load())
    _cold([d / "torch"])
    out["torch.load"] = _timed(lambda: torch.load(d / "torch" / "state.pt"))
    dirs = sorted((d / "dcp").iterdir(), key=lambda p: p.stat().st_mtime)
    _cold([dirs[-1]])
    target = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()},
              "optimizer": {"state": {k: {"momentum_buffer": torch.empty_like(v["momentum_buffer"])}
                                      for k, v in state["optimizer"]["state"].items()}}, "step": 0}
    out["dcp.load"] = _timed(lambda: dcp.load(target, checkpoint_id=str(dirs[-1])))
    return out


TINY = {"gib": 1 / 1024, "tensor_mib": 0.25, "step_s": 0.01, "steps": 4, "every": 2}  # --tiny: seconds


def main(argv: list[str] | None = None) -> None:
    ap = common.parser("checkpoint", __doc__)
    ap.add_argument("--steps", type=int, default=30, help="training steps per mode")
    ap.add_argument("--gib", type=float, default=1.0, help="state size")
    ap.add_argument("--tensor-mib", type=float, default=TENSOR_MIB, help="size of each state tensor")
    ap.add_argument("--step-s", type=float, default=1.0, help="simulated compute per step")
    ap.add_argument("--compute", choices=("sleep", "matmul"), default="sleep")
    ap.add_argument("--every", type=int, default=5, help="a checkpoint every this many steps")
    ap.add_argument("--dir", default="/tmp/hybridpar_bench_checkpoint")
    args = common.parse(ap, argv, TINY)
    hybridpar.init_distributed()  # a 1-rank gloo group: DCP wants one; ours does not need it
    d = Path(args.dir)
    shutil.rmtree(d, ignore_errors=True)
    info = {"hybridpar": hybridpar.__version__, "torch_threads": torch.get_num_threads(),
            "loadavg_start": os.getloadavg()}
    state = make_state(args.gib, args.tensor_mib)
    nbytes = sum(t.nbytes for t in state["model"].values()) + \
        sum(s["momentum_buffer"].nbytes for s in state["optimizer"]["state"].values())
    compute = compute_fn(args.compute, args.step_s)
    print(f"state {nbytes / 2**30:.2f} GiB, step {args.step_s} s ({args.compute}) + update, a save every "
          f"{args.every} steps, {args.steps} steps per mode", flush=True)
    savers: list[tuple[str, Callable[[], Saver]]] = [
        ("baseline", lambda: Saver()),
        ("torch", lambda: TorchSave(d / "torch")),
        ("dcp", lambda: DcpAsync(d / "dcp")),
        ("ours", lambda: Ours(d / "ours", overlap=False, local=False)),
        ("ours-overlap", lambda: Ours(d / "ours-overlap", overlap=True, local=False)),
        ("ours-local", lambda: Ours(d / "ours-local", overlap=True, local=True)),
    ]
    results = {}
    try:
        for key, make in savers:
            (d / key).mkdir(parents=True, exist_ok=True)
            saver = make()
            r = train(saver, state, args, compute)
            r["mode"] = saver.name
            results[key] = r
            del saver
            gc.collect()
            base = results["baseline"]["loop_s"]
            print(f"  {r['mode']:26s} stall median {r['stall_median_s'] * 1e3:8.1f} ms (first "
                  f"{r['stall_first_s'] * 1e3:7.1f} ms), loop {r['loop_s']:6.1f} s "
                  f"({(r['loop_s'] / base - 1) * 100:+.1f} %)", flush=True)
        restart = restart_times(d, state)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    base = results["baseline"]["loop_s"]
    ref = results["torch"]["stall_median_s"]
    rows = []
    for r in results.values():
        if r["mode"] == "none":
            continue
        rows.append({"mode": r["mode"], "stall_median_ms": round(r["stall_median_s"] * 1e3, 1),
                     "stall_first_ms": round(r["stall_first_s"] * 1e3, 1),
                     "stall_vs_torch_save": round(r["stall_median_s"] / ref, 4),
                     "slowdown_pct": round((r["loop_s"] / base - 1) * 100, 2),
                     "tail_s": round(r["tail_s"], 2)})
    print()
    print(f"{'mode':26s} {'stall/ckpt':>11s} {'first':>9s} {'vs torch.save':>14s} {'slowdown':>9s}")
    for row in rows:
        print(f"{row['mode']:26s} {row['stall_median_ms']:9.1f}ms {row['stall_first_ms']:7.1f}ms "
              f"{row['stall_vs_torch_save'] * 100:13.1f}% {row['slowdown_pct']:+8.2f}%")
    print()
    for k, v in restart.items():
        print(f"restart {k:14s} {v:6.2f} s (cold page cache)")
    info["loadavg_end"] = os.getloadavg()
    out = {"run": info, "config": {"state_bytes": nbytes, "tensor_mib": args.tensor_mib},
           "baseline_loop_s": base, "modes": rows, "raw": results,
           "restart_s": {k: round(v, 3) for k, v in restart.items()},
           "goals": {"ours_overlap_stall_le_10pct_of_torch_save":
                     results["ours-overlap"]["stall_median_s"] <= 0.1 * ref,
                     "ours_overlap_stall_below_dcp":
                     results["ours-overlap"]["stall_median_s"] < results["dcp"]["stall_median_s"],
                     "ours_plain_stall_le_10pct_of_torch_save":
                     results["ours"]["stall_median_s"] <= 0.1 * ref,
                     "ours_overlap_slowdown_le_2pct":
                     results["ours-overlap"]["loop_s"] / base - 1 <= 0.02}}
    common.write_json(args, out)


if __name__ == "__main__":
    main()
