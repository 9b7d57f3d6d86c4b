"""Where a step goes: a training step and an inference pass, per layer, split over 2 ranks.

Why: to make a split step faster one must know what it spends beside the kernels. Every layer's
forward (and, in training, backward) is bracketed by a profiling range (module hooks), and the
engine's own ranges inside it say what part of it was:

* ``compute``: the layer's time less everything below;
* ``halo copies``: faces packed into messages and the extended tensor assembled (``halo_pack``,
  ``halo_unpack``: memory copies the single-device layer does not make);
* ``halo wait``: the messages themselves, posted until received (``halo_exchange``,
  ``halo_adjoint``);
* ``norm reduce``: a split norm layer's all-reduces of its statistics (``norm_reduce``);
* ``redistribute``: layout changes between layers;
* outside any layer: gradient reduction (``grad_reduce_*``) and the rest (loss, schedule, autograd's
  own bookkeeping).

It also counts, independent of the device and of timing, in one step: bytes each rank sends in halo
messages against the minimum its layout needs (the voxels of every extended input outside the own
shard: the box of the extended input less the own box, per exchange and adjoint), collectives by
kind, and copies of a whole activation (``cat``, ``copy_``, ``clone``, pads and index selections
whose output holds at least as many elements as the layer's input shard).

Workloads (float32, split (2, 1, 1), 2 ranks x 1 thread; batch 1 unless said):

* ``train``: a CosmoFlow-like stack with BatchNorm, ``Engine.train_step``;
* ``infer``: MONAI's BasicUNet with BatchNorm in eval, ``Engine.predict(gather=False)``;
* ``unet``: cosmoflow's 3-level U-Net (width 8, GroupNorm) on 2 samples, ``Engine.train_step``: the
  advisor's U-Net workload, whose split steps its model underpredicts.

    python -m perf profile                     # S = 64, 5 steps each
    python -m perf profile --workloads unet --size 32
    python -m perf profile --tiny              # seconds
"""

from __future__ import annotations

import collections
import math
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from perf import common

RANKS = 2
PARTS = ("compute", "halo copies", "halo wait", "norm reduce", "redistribute")
NAMED = {"halo_pack": "halo copies", "halo_unpack": "halo copies", "halo_exchange": "halo wait",
         "halo_adjoint": "halo wait", "norm_reduce": "norm reduce", "redistribute": "redistribute"}
COPIES = {"cat", "copy_", "clone", "constant_pad_nd", "index_select", "_to_copy", "reflection_pad3d",
          "replication_pad3d"}
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor",
               "all_to_all_single", "barrier", "batch_isend_irecv")


def cosmo_bn(size: int) -> nn.Sequential:
    """The training workload: two conv blocks with BatchNorm, pooled, and a dense head."""
    torch.manual_seed(0)
    block = lambda c_in, c_out: [nn.Conv3d(c_in, c_out, 3, padding=1), nn.BatchNorm3d(c_out),  # noqa: E731
                                 nn.LeakyReLU(0.3), nn.MaxPool3d(2)]
    return nn.Sequential(*block(4, 16), *block(16, 32), nn.Flatten(), nn.Linear(32 * (size // 4) ** 3, 4))


def group_norm_unet() -> nn.Module:
    """The ``unet`` workload: cosmoflow's U-Net with GroupNorm (10 norm layers), as the advisor runs it."""
    from cosmoflow.unet import UNet3d  # noqa: PLC0415

    torch.manual_seed(0)
    return UNet3d(1, 1, width=8, levels=3, padding_mode="zeros")


def basic_unet() -> nn.Module:
    """The inference workload: MONAI's BasicUNet (BatchNorm), in eval."""
    from monai.networks.nets import BasicUNet  # noqa: PLC0415

    torch.manual_seed(0)
    return BasicUNet(3, 1, 1, features=(8, 8, 16, 32, 64, 8), norm=("batch", {"affine": True})).eval()


class Layers:
    """Module hooks that bracket every leaf layer's forward and backward by a profiling range, and
    remember the layer running now (for the copy counter)."""

    def __init__(self, root: nn.Module, backward: bool) -> None:
        from hybridpar.profiling import range as prange  # noqa: PLC0415

        self.prange, self.open, self.current, self.handles = prange, [], [], []
        for name, m in root.named_modules():
            if next(m.children(), None) is None and name:
                label = name.removeprefix("_stage.")
                self.handles += [m.register_forward_pre_hook(self._enter(f"fwd:{label}")),
                                 m.register_forward_hook(self._leave, always_call=True)]
                if backward and any(p.requires_grad for p in m.parameters()):
                    self.handles += [m.register_full_backward_pre_hook(self._enter(f"bwd:{label}", True)),
                                     m.register_full_backward_hook(self._leave_bwd)]

    def _enter(self, name: str, backward: bool = False):
        def hook(m: nn.Module, args: Any) -> None:
            r = self.prange(name)
            r.__enter__()
            self.open.append(r)
            first = args if isinstance(args, tuple) else (args,)
            x = next((a for a in first if isinstance(a, torch.Tensor)), None)
            self.current.append((name, 0 if x is None else x.numel()))
        return hook

    def _leave(self, m: nn.Module, args: Any, out: Any) -> None:
        if self.open:
            self.open.pop().__exit__(None, None, None)
            self.current.pop()

    def _leave_bwd(self, m: nn.Module, grad_in: Any, grad_out: Any) -> None:
        self._leave(m, grad_in, grad_out)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class Copies(TorchDispatchMode):
    """Counts copies of a whole activation, per layer running (see module doc)."""

    def __init__(self, layers: Layers) -> None:
        super().__init__()
        self.layers, self.count = layers, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in COPIES and self.layers.current and isinstance(out, torch.Tensor):
            layer, numel = self.layers.current[-1]
            if numel and out.numel() >= numel:
                self.count[f"{layer} {name}"] += 1
        return out


def _count_traffic(counters: dict) -> list:
    """Wrap the halo exchanger and torch.distributed's collectives to count them; returns undo steps."""
    import torch.distributed as dist  # noqa: PLC0415

    from hybridpar.comm.halo import HaloExchanger  # noqa: PLC0415

    undo = []
    swap = HaloExchanger._swap

    def counted_swap(self, sends, wanted, like, what):
        out = sum(t.numel() * t.element_size() for peer, t, _ in sends if peer != self.rank)
        counters["halo_bytes_sent"] += out
        return swap(self, sends, wanted, like, what)

    HaloExchanger._swap = counted_swap
    undo.append(lambda: setattr(HaloExchanger, "_swap", swap))
    for direction in ("forward", "adjoint"):
        plain = getattr(HaloExchanger, direction)

        def minimum(self, x, plain=plain):
            counters["halo_bytes_minimum"] += _halo_minimum(self, x)
            return plain(self, x)

        setattr(HaloExchanger, direction, minimum)
        undo.append(lambda d=direction, p=plain: setattr(HaloExchanger, d, p))
    for name in COLLECTIVES:
        fn = getattr(dist, name)

        def counted(*a, fn=fn, name=name, **k):
            counters[f"collective {name}"] += 1
            return fn(*a, **k)

        setattr(dist, name, counted)
        undo.append(lambda n=name, f=fn: setattr(dist, n, f))
    return undo


def _halo_minimum(ex: Any, x: torch.Tensor) -> int:
    """Bytes this rank must receive for one exchange (or send back in its adjoint): the extended box
    less the kept own box, neighbours' voxels only (padding is made, not received)."""
    own = list(x.shape[2:]) if ex.dims and x.dim() == 5 else []
    if not own:
        return 0
    kept, ext = list(own), list(own)
    for d in ex.dims:
        p = d.plan
        kept[d.dim - 2] = p.kept
        ext[d.dim - 2] = p.kept + (p.recv_lo if d.lo is not None else 0) + (
            p.recv_hi if d.hi is not None else 0)
    lead = x.shape[0] * x.shape[1] * x.element_size()
    return lead * (math.prod(ext) - math.prod(kept))


def _attribute(ranges: list, duration: float) -> dict[str, dict[str, float]]:
    """Seconds per layer and part from one step's ranges (see module doc)."""
    layers = [r for r in ranges if r[0].startswith(("fwd:", "bwd:"))]
    out: dict[str, dict[str, float]] = collections.defaultdict(lambda: dict.fromkeys(PARTS, 0.0))
    inside = 0.0
    for name, _, a, b in layers:
        row = out[name]
        row["compute"] += b - a
        inside += b - a
        for other, _, c, e in ranges:
            if other in NAMED and a <= c and e <= b:
                row[NAMED[other]] += e - c
                row["compute"] -= e - c
    grad = sum(e - c for n, _, c, e in ranges if n.startswith("grad_reduce"))
    out["(outside layers) grad reduce"]["compute"] = grad
    out["(outside layers) other"]["compute"] = duration - inside - grad
    return out


def profile_job(rank: int, world: int, cfg: dict) -> dict:
    import hybridpar as hp
    from hybridpar.profiling.timer import StepTimer

    torch.set_num_threads(1)
    s = cfg["size"]
    results = {}
    for workload in cfg["workloads"]:
        train = workload != "infer"
        model, shape, target = {"train": (cosmo_bn, (1, 4, s, s, s), (1, 4)),
                                "infer": (basic_unet, (1, 1, s, s, s), None),
                                "unet": (group_norm_unet, (2, 1, s, s, s), (2, 1, s, s, s))}[workload]
        model = model(s) if workload == "train" else model()
        engine = hp.parallelize(model, {"grid": {"spatial": [world, 1, 1]}}, loss_fn=F.mse_loss,
                                input_shape=shape)
        if not train:
            engine.eval()
        torch.manual_seed(1)
        x = torch.randn(shape)
        x_local, y_local = (engine.shard_batch(x, torch.randn(target)) if train
                            else (engine.shard_batch(x)[0], None))
        layers = Layers(engine.layers[0][1] if len(engine.layers) == 1 else nn.ModuleList(
            [m for _, m in engine.layers]), backward=train)

        def step(engine=engine, x_local=x_local, y_local=y_local, train=train):
            if train:
                engine.train_step(x_local, y_local)
            else:
                engine.predict(x_local, gather=False)

        for _ in range(cfg["warmup"]):
            step()
        counters: collections.Counter = collections.Counter()
        undo = _count_traffic(counters)
        copies = Copies(layers)
        try:
            with copies:
                step()
        finally:
            for u in reversed(undo):
                u()
        timer = StepTimer(clock="cpu", record_ranges=True)
        parts, totals = [], []
        for _ in range(cfg["steps"]):
            common.barrier()
            with timer.step():
                step()
            rec = timer.records[-1]
            parts.append(_attribute(rec.ranges, rec.duration))
            totals.append(rec.duration)
        layers.remove()
        names = list(parts[0])
        median = {n: {p: statistics.median(step_parts[n][p] for step_parts in parts) for p in PARTS}
                  for n in names}
        results[workload] = {"step_s": totals, "layers": median, "counts": dict(counters),
                             "activation_copies": dict(copies.count)}
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, results)
    return {"ranks": gathered}


def _table(workload: str, ranks: list[dict]) -> tuple[str, dict]:
    """One workload's table: rank 0's parts per layer (ms), and the counts of every rank."""
    r0 = ranks[0][workload]
    rows, sums = [], dict.fromkeys(PARTS, 0.0)
    for name, part in r0["layers"].items():
        total = sum(part.values())
        for p in PARTS:
            sums[p] += part[p]
        rows.append([name, 1e3 * total, *(1e3 * part[p] for p in PARTS)])
    step = statistics.median(r0["step_s"])
    rows.append(["(step, median)", 1e3 * step, *(1e3 * sums[p] for p in PARTS)])
    title = f"{workload}: per layer on rank 0, ms (median of steps)"
    table = common.print_table(["layer", "total", *PARTS], rows, title=title)
    counts = []
    for r, res in enumerate(ranks):
        c = res[workload]["counts"]
        counts.append({"rank": r, "halo_bytes_sent": c.get("halo_bytes_sent", 0),
                       "halo_bytes_minimum": c.get("halo_bytes_minimum", 0),
                       "collectives": {k.removeprefix("collective "): v for k, v in c.items()
                                       if k.startswith("collective ")},
                       "activation_copies": sum(res[workload]["activation_copies"].values())})
    sent = sum(c["halo_bytes_sent"] for c in counts)
    need = sum(c["halo_bytes_minimum"] for c in counts)
    share = {p: sums[p] / step for p in PARTS}
    print(f"{workload}: halo bytes sent {sent} against the minimum {need} "
          f"({sent / need if need else 1:.3f}x); "
          f"collectives per step (rank 0) {counts[0]['collectives']}; whole-activation copies "
          f"{counts[0]['activation_copies']}", flush=True)
    return table, {"step_median_s": step, "share_of_step": share, "per_rank": counts,
                   "halo_sent_over_minimum": sent / need if need else 1.0,
                   "copies_by_layer_rank0": r0["activation_copies"], "layers_rank0": r0["layers"]}


TINY = {"size": 16, "steps": 1, "warmup": 1, "workloads": "train"}  # seconds: the training half


def main(argv: list[str] | None = None) -> None:
    ap = common.parser("profile", __doc__, steps=5, warmup=2, max_load=0.5)
    ap.add_argument("--size", type=int, default=64, help="edge S of the global cubic volume (default 64; "
                                                         "the U-Net pools 4 times: at least 32)")
    ap.add_argument("--workloads", default="train,infer,unet",
                    help="comma-separated: train, infer, unet (default: all three)")
    args = common.parse(ap, argv, TINY)
    cfg = {"size": args.size, "steps": args.steps, "warmup": args.warmup,
           "workloads": args.workloads.split(",")}
    load = common.wait(args)
    t0 = time.monotonic()
    out = common.launch(profile_job, RANKS, cfg, threads=1)
    tables, result = [], {}
    for workload in cfg["workloads"]:
        table, result[workload] = _table(workload, out["ranks"])
        tables.append(table)
    load_end, run_s = common.loadavg(), round(time.monotonic() - t0, 1)
    common.write_json(args, {"config": {**cfg, "ranks": RANKS, "split": [RANKS, 1, 1],
                                        "batch": {"train": 1, "infer": 1, "unet": 2},
                                        "dtype": "float32", "threads_per_process": 1,
                                        "train": "conv-BN-LeakyReLU-MaxPool x 2, Linear; train_step, mse",
                                        "infer": "MONAI BasicUNet (8,8,16,32,64,8), BatchNorm, eval; "
                                                 "predict",
                                        "unet": "cosmoflow UNet3d (width 8, 3 levels, GroupNorm), 2 samples; "
                                                "train_step, mse"},
                              "load_at_start": load["load_at_start"], "load_at_end": load_end, "run_s": run_s,
                              "result": result, "tables": tables})


if __name__ == "__main__":
    main()
