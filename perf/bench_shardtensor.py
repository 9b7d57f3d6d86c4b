"""Against NVIDIA PhysicsNeMo's ShardTensor: the same split CosmoFlow-like stack, trained both ways.

Why: ShardTensor (``physicsnemo.domain_parallel``) is the spatial-parallel tensor a PhysicsNeMo user
reaches for: a ``torch.Tensor`` subclass whose ``F.conv3d`` / ``F.max_pool3d`` patches exchange
halos, so that an unchanged ``nn.Module`` runs on a sharded input. hybridpar does the same job by
rewriting the model (``hp.parallelize``). This benchmark puts them side by side on one job:

* model: 4 x [Conv3d k3 p1 -> LeakyReLU(0.3)], channels 4 -> 16 -> 16 -> 16 -> 16, MaxPool3d(2)
  after each of the first three (both support k2 s2 pooling of an even shard); input 1 x 4 x S^3
  (S = 64), split in depth over 2 ranks (gloo, 1 thread each); loss: mean squared error against a
  target of the output's shape (split like the output);
* hybridpar: ``hp.parallelize(model, {"grid": {"spatial": [2, 1, 1]}}, loss_fn=F.mse_loss,
  input_shape=...)``, a step ``engine.train_step(*engine.shard_batch(x, y))``, with ``overlap=False``
  and ``overlap=True``;
* ShardTensor: the same model replicated on each rank, the input and target
  ``ShardTensor.from_local(local, mesh, [Shard(2)], sharding_shapes="chunk", global_shape=...)``, a
  step ``((model(x) - y) ** 2).mean().backward()``. Its conv patch all-reduces the weight and bias
  gradients itself (``GradReducer``), so no manual all-reduce is needed: the check below proves it.
  Not ``F.mse_loss``: on ShardTensors it returns a ``Partial(avg)`` loss whose backward gives every
  gradient times the world size (the check records that too); the written-out mean goes through
  ShardTensor's own ``mean`` handler (``Partial(sum)``) and is exact.

First both are checked in float64 against the single-process model on the whole volume: the forward
output (gathered) and every parameter's gradient, max|a - b| / max|b| < 1e-10. Then forward +
backward steps are timed in float32, the three variants ALTERNATED in the same 2 processes (``--rounds``
rounds of ``--steps`` steps each, order reversed every other round; a step lasts as long as its
slowest rank). Reported: per-round medians, the ratio ShardTensor / hybridpar as the median of the
per-round ratios with its IQR, and the peak heap per rank of one step above the heap before it
(``perf/heapcount.py``, glibc's allocator counted through ``LD_PRELOAD``: parameters' gradients,
activations, halos, workspaces, communication buffers; the same counter for both).

Installation. PhysicsNeMo is never installed into the project's environment: this module makes a
throwaway virtual environment (:data:`VENV`, under the temp dir) that sees the project's torch
through a ``.pth`` file, installs the wheel there without its dependencies, and re-runs itself with
that interpreter. By hand, that is::

    V=/tmp/hybridpar-peers/physicsnemo-venv
    .venv/bin/python -m venv --without-pip $V
    .venv/bin/python -m pip --python $V/bin/python install --no-deps \\
        nvidia-physicsnemo==2.2.2 warp-lang==1.19.0 tensordict==0.15.3
    .venv/bin/python -m pip --python $V/bin/python install requests s3fs tqdm treelib termcolor \\
        einops jaxtyping cloudpickle pyvers
    echo 'import site; site.addsitedir("'$PWD'/.venv/lib/python3.11/site-packages")' \\
        > $V/lib/python3.11/site-packages/zz-hybridpar-main-venv.pth
    PYTHONPATH=$PWD $V/bin/python -m perf shardtensor --tiny

The ``.pth`` file is written last, so that pip, while installing, sees an empty environment and can
neither count the project's packages as installed nor uninstall one of them. The extra packages are
what ``import physicsnemo.domain_parallel`` needs, found by trying (``physicsnemo/__init__`` imports
``warp``; ``physicsnemo.core`` imports ``requests``, ``s3fs``, ``tqdm``; ``physicsnemo.distributed``
imports ``treelib``, ``tensordict``, ``termcolor``; the shard patches ``einops`` and ``jaxtyping``).
Two workarounds make it run on CPU: (1) ``physicsnemo.domain_parallel`` registers its patches only
``if torch.cuda.is_available()``, and its own ``register_shard_wrappers`` imports ``knn`` and with it
``physicsnemo.nn`` -> ``timm`` -> ``torchvision`` (a binary build tied to one torch), so the patch
modules this stack needs (``custom_ops``, ``shard_utils.conv_patches``, ``pooling_patches``) are
imported by hand (:func:`register_patches`): importing one registers its ``__torch_function__``
handlers; (2) ``DistributedManager`` (which ``scatter_tensor`` uses) wants its own initialisation,
so the mesh is ``init_device_mesh("cpu", (2,))`` over hybridpar's existing process group and the
shards are made with ``from_local`` (no communication).

    python -m perf shardtensor --record     # S=64, 7 rounds x 5 steps (a few minutes)
    python -m perf shardtensor --tiny       # S=16, 2 rounds (seconds once the venv exists)
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from perf import common, heapcount

RANKS = 2
CHANNELS = (4, 16, 16, 16, 16)
POOLS = 3  # MaxPool3d(2) after each of the first POOLS blocks
HP, HP_OVERLAP, ST = "hybridpar", "hybridpar overlap=True", "ShardTensor"
VARIANTS = [HP, HP_OVERLAP, ST]
TOL = 1e-10
STACK = ("4 x [Conv3d(k3, p1) LeakyReLU(0.3)], channels 4-16-16-16-16, MaxPool3d(2) after the first 3; "
         "loss: mean squared error against a target of the output's shape")

VENV = Path(tempfile.gettempdir()) / "hybridpar-peers" / "physicsnemo-venv"
"""The throwaway environment PhysicsNeMo is installed into (never the project's own)."""
NO_DEPS = ["nvidia-physicsnemo==2.2.2", "warp-lang==1.19.0", "tensordict==0.15.3"]
"""Installed without their dependencies: theirs would pull a second torch (and torchvision, timm)."""
EXTRA = ["requests", "s3fs", "tqdm", "treelib", "termcolor", "einops", "jaxtyping", "cloudpickle", "pyvers"]
"""What ``import physicsnemo.domain_parallel`` needs beyond the project's packages (found by trying)."""
_READY = ".hybridpar-ready"  # written once every step of install() succeeded


# ---------------------------------------------------------------------------- the peer environment
def peer_python() -> Path:
    return VENV / "bin" / "python"


def ready() -> bool:
    """Whether :data:`VENV` is fully set up (a test runs the benchmark only then: no download)."""
    return (VENV / _READY).exists() and peer_python().exists()


def install() -> Path:
    """Create :data:`VENV` with PhysicsNeMo (the commands of the module doc); its interpreter."""
    main_site = Path(torch.__file__).resolve().parent.parent
    site = VENV / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    pip = [sys.executable, "-m", "pip", "--python", str(peer_python()), "install", "-q",
           "--disable-pip-version-check"]
    steps = [[sys.executable, "-m", "venv", "--clear", "--without-pip", str(VENV)],
             [*pip, "--no-deps", *NO_DEPS], [*pip, *EXTRA]]
    for cmd in steps:
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    # last, so that pip never saw the project's packages (it could have uninstalled one)
    (site / "zz-hybridpar-main-venv.pth").write_text(f'import site; site.addsitedir("{main_site}")\n')
    (VENV / _READY).write_text(" ".join(NO_DEPS + EXTRA) + "\n")
    return peer_python()


def _has_physicsnemo() -> bool:
    return importlib.util.find_spec("physicsnemo") is not None


def register_patches() -> None:
    """Import the ShardTensor patches this stack needs; importing a patch module registers its handlers.

    Not ``physicsnemo.domain_parallel.register_custom_ops()``: it runs only with CUDA and imports every
    patch, ``knn`` among them, which pulls in torchvision (see the module doc)."""
    import physicsnemo.domain_parallel.custom_ops  # noqa: F401, PLC0415 (sum / mean handlers)
    from physicsnemo.domain_parallel.shard_utils import conv_patches, pooling_patches  # noqa: F401, PLC0415


# ---------------------------------------------------------------------------- the model
def stack(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """The CosmoFlow-like stack of :data:`STACK` (plain torch.nn; the same seed, the same weights)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (cin, cout) in enumerate(zip(CHANNELS[:-1], CHANNELS[1:])):
        layers += [nn.Conv3d(cin, cout, 3, padding=1), nn.LeakyReLU(0.3)]
        if i < POOLS:
            layers.append(nn.MaxPool3d(2))
    return nn.Sequential(*layers).to(dtype)


def batch(size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The global input (1, 4, S, S, S) and a target of the output's shape, alike on every rank."""
    g = torch.Generator().manual_seed(1)
    out = size // 2 ** POOLS
    return (torch.randn(1, CHANNELS[0], size, size, size, generator=g, dtype=dtype),
            torch.randn(1, CHANNELS[-1], out, out, out, generator=g, dtype=dtype))


# ---------------------------------------------------------------------------- the two implementations
def hybridpar_step(size: int, dtype: torch.dtype, overlap: bool):
    """(engine, step, x_local): hp.parallelize on a depth split; a step zeroes the grads and trains."""
    import hybridpar as hp  # noqa: PLC0415

    x, y = batch(size, dtype)
    engine = hp.parallelize(stack(dtype=dtype), {"grid": {"spatial": [RANKS, 1, 1]}}, loss_fn=F.mse_loss,
                            input_shape=tuple(x.shape), overlap=overlap)
    x_local, y_local = engine.shard_batch(x, y)
    return engine, common.engine_step(engine, x_local, y_local), x_local


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error written out: on ShardTensors, ``F.mse_loss`` gives the world size times the
    gradients (its mean is a ``Partial(avg)`` loss whose backward is not averaged), this one
    (``Partial(sum)`` through ShardTensor's own ``mean`` handler) the single-process ones."""
    return ((out - target) ** 2).mean()


def shardtensor_step(size: int, dtype: torch.dtype, mesh, loss_fn=mse):
    """(model, step, x_st, y_st): the model replicated, input and target ShardTensors split on depth."""
    import torch.distributed as dist  # noqa: PLC0415
    from physicsnemo.domain_parallel import ShardTensor  # noqa: PLC0415
    from torch.distributed.tensor import Shard  # noqa: PLC0415

    x, y = batch(size, dtype)
    rank = dist.get_rank()

    def split(t: torch.Tensor):
        local = t.chunk(RANKS, dim=2)[rank].contiguous()
        return ShardTensor.from_local(local, mesh, [Shard(2)], sharding_shapes="chunk",
                                      global_shape=tuple(t.shape))

    model = stack(dtype=dtype)
    x_st, y_st = split(x), split(y)
    params = list(model.parameters())

    def step() -> None:
        for p in params:
            p.grad = None
        loss_fn(model(x_st), y_st).backward()

    return model, step, x_st, y_st


# ---------------------------------------------------------------------------- checks (float64)
def _rel(a: torch.Tensor | None, b: torch.Tensor) -> float:
    if a is None or tuple(a.shape) != tuple(b.shape):
        return float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def check(size: int, mesh) -> dict:
    """Both against the single-process model on the whole volume, float64: output and every gradient."""
    dtype = torch.float64
    x, y = batch(size, dtype)
    ref = stack(dtype=dtype)
    out_ref = ref(x)
    F.mse_loss(out_ref, y).backward()
    grads = {k: p.grad for k, p in ref.named_parameters()}
    result = {}
    for overlap in (False, True):
        engine, step, x_local = hybridpar_step(size, dtype, overlap)
        step()
        errs = {"output": _rel(engine.predict(x_local), out_ref.detach())}
        errs.update({k: _rel(p.grad, grads[k]) for k, p in engine.named_parameters()})
        result[HP_OVERLAP if overlap else HP] = errs
    model, step, x_st, _ = shardtensor_step(size, dtype, mesh)
    step()
    with torch.no_grad():
        out = model(x_st).full_tensor()
    errs = {"output": _rel(out, out_ref.detach())}
    errs.update({k: _rel(p.grad, grads[k]) for k, p in model.named_parameters()})
    result[ST] = errs
    # F.mse_loss, the loss hybridpar is given: what it does on ShardTensors (not timed)
    model, step, _, _ = shardtensor_step(size, dtype, mesh, F.mse_loss)
    step()
    ratios = [(p.grad / grads[k]).median().item() for k, p in model.named_parameters()]
    for name, errs in result.items():
        if set(errs) != {"output", *grads}:
            raise AssertionError(f"{name}: gradients of {sorted(errs)} against {sorted(grads)}")
    out = {name: {"max_rel_err": max(errs.values()), "exact": max(errs.values()) < TOL, "rel_err": errs}
           for name, errs in result.items()}
    out[ST]["f_mse_loss_grad_over_reference"] = [min(ratios), max(ratios)]
    return out


# ---------------------------------------------------------------------------- the job
def job(rank: int, world: int, cfg: dict) -> dict:
    """Every rank: the float64 check, then the three variants alternated, then one step each counted."""
    import torch.distributed as dist  # noqa: PLC0415
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    register_patches()
    mesh = init_device_mesh("cpu", (world,))  # over hybridpar's group; no DistributedManager
    checks = check(cfg["check_size"], mesh)
    s, dtype = cfg["size"], torch.float32
    steps = {HP: hybridpar_step(s, dtype, False)[1], HP_OVERLAP: hybridpar_step(s, dtype, True)[1],
             ST: shardtensor_step(s, dtype, mesh)[1]}
    rounds = []
    for r in range(cfg["rounds"]):
        rnd = {}
        for name in common.swap(VARIANTS, r):
            rnd[name] = common.slowest_rank(common.time_steps(steps[name], cfg["warmup"], cfg["steps"],
                                                              before=common.barrier))
        rnd["load"] = common.loadavg()
        rounds.append(rnd)
        if rank == 0:
            meds = ", ".join(f"{n} {1e3 * statistics.median(rnd[n]):.1f} ms" for n in VARIANTS)
            print(f"round {r + 1}/{cfg['rounds']}: {meds}  (load {rnd['load'][0]:.2f})", flush=True)
    heap = {}
    if heapcount.active():
        for name in VARIANTS:  # after the timing: every variant warm, its buffers made
            common.barrier()
            base = heapcount.current()
            heapcount.reset()
            steps[name]()
            heap[name] = heapcount.peak() - base
    common.barrier()
    dist.barrier()
    return {"checks": checks, "rounds": rounds, "heap_peak_bytes": heap}


# ---------------------------------------------------------------------------- main
TINY = {"size": 16, "rounds": 2, "steps": 2, "warmup": 1}  # --tiny: seconds


def _iqr(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not _has_physicsnemo() and not any(a in ("-h", "--help") for a in argv):
        # the project's interpreter: run again with the peer environment's (made the first time)
        python = peer_python() if ready() else install()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(common.ROOT), os.environ.get("PYTHONPATH")) if p)}
        return subprocess.run([str(python), "-m", "perf", "shardtensor", *argv], env=env,
                              cwd=common.ROOT).returncode
    ap = common.parser("shardtensor", __doc__, rounds=7, steps=5, warmup=1, max_load=1.5, max_wait=600)
    ap.add_argument("--size", type=int, default=64, help="edge S of the global S^3 input (default 64)")
    ap.add_argument("--check-size", type=int, default=None,
                    help="edge of the float64 exactness check (default: --size)")
    args = common.parse(ap, argv, TINY)
    cfg = {"size": args.size, "check_size": args.check_size or args.size, "rounds": args.rounds,
           "steps": args.steps, "warmup": args.warmup}
    load = common.wait(args)
    print(f"load average at start: {load['load_at_start']}", flush=True)
    t0 = time.monotonic()
    per_rank = common.launch(job, RANKS, cfg, threads=1, every_rank=True, env=heapcount.preload_env(),
                             timeout=1800)
    load_end, run_s = common.loadavg(), round(time.monotonic() - t0, 1)
    res = per_rank[0]
    round_loads = [rd["load"][0] for rd in res["rounds"]]
    noisy = common.disturbed(round_loads, RANKS)
    return _report(args, cfg, load, load_end, run_s, round_loads, noisy, res,
                   [r["heap_peak_bytes"] for r in per_rank])


def _report(args, cfg: dict, load: dict, load_end: list[float], run_s: float, round_loads: list[float],
            noisy: bool, res: dict, heaps: list[dict]) -> int:
    """The exactness lines, the timing table and the JSON."""
    checks = res["checks"]
    for name, c in checks.items():
        print(f"float64 check at {cfg['check_size']}^3, {name}: max rel err {c['max_rel_err']:.1e} over the "
              f"output and {len(c['rel_err']) - 1} gradients ({'exact' if c['exact'] else 'NOT EXACT'})",
              flush=True)
    lo, hi = checks[ST]["f_mse_loss_grad_over_reference"]
    print(f"ShardTensor with F.mse_loss instead (not timed): gradients / single-process gradients "
          f"{lo:.6g} .. {hi:.6g}", flush=True)
    med = {n: [statistics.median(rd[n]) for rd in res["rounds"]] for n in VARIANTS}
    stats = {n: common.summarize([t for rd in res["rounds"] for t in rd[n]]) for n in VARIANTS}
    result = {}
    rows = []
    for n in VARIANTS:
        ratios = [st / h for st, h in zip(med[ST], med[n])]  # ShardTensor / this, per round
        q1, q3 = _iqr(ratios)
        mib = [h[n] / 2**20 for h in heaps if n in h]
        result[n] = {"round_medians_ms": [1e3 * t for t in med[n]],
                     "median_of_round_medians_ms": 1e3 * statistics.median(med[n]),
                     "shardtensor_over_this_per_round": ratios,
                     "shardtensor_over_this": statistics.median(ratios), "ratio_iqr": [q1, q3],
                     "heap_peak_mib_per_rank": mib, "exact_float64": checks[n]["exact"],
                     "max_rel_err_float64": checks[n]["max_rel_err"]}
        rows.append([n, 1e3 * statistics.median(med[n]),
                     " ".join(f"{1e3 * t:.0f}" for t in med[n]),
                     "1" if n == ST else f"{statistics.median(ratios):.3f}",
                     "" if n == ST else f"{q1:.3f}-{q3:.3f}",
                     " / ".join(f"{m:.1f}" for m in mib) or "n/a",
                     f"{checks[n]['max_rel_err']:.1e}"])
    s = cfg["size"]
    table = common.print_table(
        ["implementation (2 ranks x 1 thread, depth split)", "median ms", "per-round medians ms",
         "T_ShardTensor / T", "ratio IQR", "heap peak MiB rank 0 / 1", "float64 max rel err"], rows,
        title=f"ShardTensor (PhysicsNeMo {_physicsnemo_version()}) vs hybridpar: {STACK}; input 1x4x{s}^3, "
              f"fwd+bwd, float32 ({cfg['rounds']} rounds x {cfg['steps']} steps, alternated; 1-min load "
              f"{load['load_at_start'][0]:.2f} -> {load_end[0]:.2f}, the benchmark's own 2 processes "
              f"included){'; DISTURBED by other work' if noisy else ''}")
    common.write_json(args, {
        "config": {**cfg, "ranks": RANKS, "split": [RANKS, 1, 1], "global_volume": [s, s, s],
                   "channels": list(CHANNELS), "pools": POOLS, "batch": 1, "dtype": "float32",
                   "dtype_check": "float64", "tolerance": TOL, "threads_per_rank": 1, "stack": STACK,
                   "physicsnemo": _physicsnemo_version(), "torch": torch.__version__,
                   "peer_venv": str(VENV), "installed_no_deps": NO_DEPS, "installed_extra": EXTRA,
                   "memory": "heap peak of one step above the heap before it (perf/heapcount.py)"
                             if any(heaps) else "not measured (no C compiler for perf/heapcount.py)"},
        **common.round_record(load, load_end, run_s, round_loads, noisy),
        "checks": checks, "stats": stats, "result": result, "rounds": res["rounds"], "table": table})
    return 0 if all(c["exact"] for c in checks.values()) else 1


def _physicsnemo_version() -> str:
    from importlib.metadata import version  # noqa: PLC0415

    return version("nvidia-physicsnemo")


if __name__ == "__main__":
    sys.exit(main())
