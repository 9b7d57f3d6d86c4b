"""Against torch's own sharded convolution: DTensor ``Shard`` on the last dim (W) vs DistConv3d.

Why: ``torch.distributed.tensor`` ships a sharded convolution (``_tp_conv``: a ring exchange of the
W-edge columns, then the local conv) that a user might reach for first. This script answers two
questions on 2 ranks (gloo, CPU, 1 thread each):

1. *Speed where it applies* (W split, stride 1, odd kernel, padding k//2): forward + backward of a
   Conv3d on the same shapes with four implementations, alternated in one job, medians over rounds:
   hybridpar ``DistConv3d`` on the grid (1, 1, 2) with ``overlap=False`` / ``overlap=True``; torch's
   ``_tp_conv`` functions called on the local shards (the algorithm DTensor runs when it works; the
   weight gradient is then summed over the ranks, as ours is); and ``F.conv3d`` on DTensors (the
   public API). Every implementation is first checked against ``torch.nn.Conv3d`` on the whole volume.
   The input needs no gradient (a first layer), because ``_tp_conv`` returns no input gradient in 3-D.
   Two more rows time the local conv on the own shard alone, no communication, with ``padding=1``
   (the kernel ``_tp_conv`` calls) and on an explicitly padded shard with ``padding=0`` (the kernel
   the overlapped DistConv3d calls; the non-overlapped one pads W explicitly and H, D in the kernel):
   torch's CPU conv speed depends a lot on that argument on some shapes, and these floors tell
   kernel choice apart from communication.
2. *Cases*: stride 2, padding 0/'valid'/'same', dilation 2, even kernels, a split on D or H, an
   uneven split, a 2-D split (4 ranks), MaxPool3d. For each: what DTensor does (exception, wrong
   result, silent all-gather) and what ours does, both checked against torch.nn in float64 (forward
   output, input, weight and bias gradients). Each DTensor case runs in a fresh process group, since a
   failed ring exchange can leave unmatched messages behind.

    python -m perf dtensor                       # 3 shapes, 3 rounds x 5 steps, cases
    python -m perf dtensor --scale 0.25 --rounds 2 --steps 2 --no-wait --out /tmp/dtensor.json
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from perf import common

RANKS = 2
# (C_in, C_out, (D, H, W)) of the timed Conv3d k3 p1: the first three CosmoFlow layers at 128 wide.
SHAPES = [(4, 32, (64, 64, 128)), (32, 64, (32, 32, 64)), (64, 128, (16, 16, 32))]
IMPLS = ["ours overlap=False", "ours overlap=True", "torch _tp_conv (direct)", "DTensor F.conv3d",
         "no comm: own shard, padding=1", "no comm: own shard, F.pad + padding=0"]


# ---------------------------------------------------------------------------- torch's algorithm, direct
class TpConv(torch.autograd.Function):
    """torch's ``tp_convolution`` / ``tp_convolution_backward`` on local W shards (stride 1, no dilation).

    This is what ``F.conv3d`` on a ``Shard(4)`` DTensor is meant to run. The weight and bias gradients
    are local contributions; they are summed over the ranks here (one all-reduce), as DistConv3d does.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, padding: int):
        from torch.distributed.tensor import _tp_conv

        args = (x, weight, bias, [1, 1, 1], [padding] * 3, [1, 1, 1], False, [0, 0, 0], 1)
        ctx.save_for_backward(x, weight)
        ctx.padding, ctx.has_bias = padding, bias is not None
        return _tp_conv.tp_convolution(torch.ops.aten.convolution.default, args, {}, [-1, -1, -1, -1, 0])

    @staticmethod
    def backward(ctx, gy):
        from torch.distributed.tensor import _tp_conv

        x, weight = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], True, ctx.has_bias]
        args = (gy.contiguous(), x, weight, [weight.shape[0]] if ctx.has_bias else None, [1, 1, 1],
                [ctx.padding] * 3, [1, 1, 1], False, [0, 0, 0], 1, mask)
        gx, gw, gb = _tp_conv.tp_convolution_backward(torch.ops.aten.convolution_backward.default, args,
                                                      {}, [-1, -1, -1, -1, 0])
        flat = torch.cat([gw.reshape(-1)] + ([gb] if gb is not None else []))
        dist.all_reduce(flat)
        gw = flat[:gw.numel()].view_as(gw)
        gb = flat[gw.numel():] if gb is not None else None
        return gx, gw, gb, None


# ---------------------------------------------------------------------------- 1. timing
def _impl_steps(name: str, ref: nn.Conv3d, x: torch.Tensor, x_local: torch.Tensor, grid, mesh):
    """(step, check): one fwd+bwd of implementation ``name``, and its max errors against torch.nn."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    import hybridpar as hp

    y_ref = ref(x)
    y_ref.sum().backward()
    gw_ref = ref.weight.grad
    if name.startswith("ours"):
        conv = hp.nn.DistConv3d(ref.in_channels, ref.out_channels, 3, padding=1, grid=grid,
                                overlap=name.endswith("True"))
        conv.load_state_dict(ref.state_dict())
        step = common.train_step(conv, x_local)

        def check():
            y = conv(x_local)
            y.sum().backward()
            return hp.gather(y.detach(), grid), conv.weight.grad
    elif name.startswith("torch _tp_conv"):
        w = ref.weight.detach().clone().requires_grad_()
        b = ref.bias.detach().clone().requires_grad_()

        def step():
            w.grad = b.grad = None
            TpConv.apply(x_local, w, b, 1).sum().backward()

        def check():
            step()
            y = TpConv.apply(x_local, w, b, 1).detach()
            parts = [torch.empty_like(y) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, y)  # even shards: every rank's W extent is the same
            return torch.cat(parts, dim=4), w.grad
    elif name.startswith("no comm"):  # floor: the local conv alone, with each kernel choice
        w = ref.weight.detach().clone().requires_grad_()
        b = ref.bias.detach().clone().requires_grad_()
        prepad = name.endswith("padding=0")

        def step():
            w.grad = b.grad = None
            xin = F.pad(x_local, (1,) * 6) if prepad else x_local
            F.conv3d(xin, w, b, padding=0 if prepad else 1).sum().backward()

        return step, lambda: {"reference": "no halo exchange: not the same result, only a time floor"}
    else:
        mesh_w = nn.Parameter(distribute_tensor(ref.weight.detach().clone(), mesh, [Replicate()]))
        mesh_b = nn.Parameter(distribute_tensor(ref.bias.detach().clone(), mesh, [Replicate()]))
        xd = DTensor.from_local(x_local, mesh, [Shard(4)])

        def step():
            mesh_w.grad = mesh_b.grad = None
            F.conv3d(xd, mesh_w, mesh_b, padding=1).sum().backward()

        def check():
            y = F.conv3d(xd, mesh_w, mesh_b, padding=1)
            y.sum().backward()
            return y.full_tensor().detach(), mesh_w.grad.full_tensor()

    def errors() -> dict:
        try:
            y, gw = check()
        except Exception as err:  # noqa: BLE001 (recorded, not hidden)
            return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
        if y.shape != y_ref.shape:
            return {"output_shape": list(y.shape), "expected_shape": list(y_ref.shape), "correct": False}
        ey = (y - y_ref).abs().max().item() / y_ref.abs().max().item()
        ew = (gw - gw_ref).abs().max().item() / gw_ref.abs().max().item()
        return {"rel_err_output": ey, "rel_err_weight_grad": ew, "correct": ey < 1e-4 and ew < 1e-4}

    return step, errors


def timing_job(rank: int, world: int, cfg: dict) -> dict:
    from torch.distributed.device_mesh import DeviceMesh

    import hybridpar as hp

    grid = hp.ProcessGrid(spatial=(1, 1, world))
    mesh = DeviceMesh("cpu", list(range(world)))
    out = {}
    for cin, cout, vol in cfg["shapes"]:
        torch.manual_seed(0)
        ref = nn.Conv3d(cin, cout, 3, padding=1)
        x = torch.randn(1, cin, *vol)
        x_local = hp.scatter(x, grid).detach()
        steps, checks = {}, {}
        for name in IMPLS:
            ref.zero_grad(set_to_none=True)
            step, errors = _impl_steps(name, ref, x, x_local, grid, mesh)
            checks[name] = errors()
            steps[name] = step
        times: dict[str, list[float]] = {n: [] for n in IMPLS}
        for r in range(cfg["rounds"]):
            for name in IMPLS if r % 2 == 0 else IMPLS[::-1]:
                t = common.time_steps(steps[name], cfg["warmup"], cfg["steps"], before=common.barrier)
                times[name].append(statistics.median(common.slowest_rank(t)))
        out[f"{cin}->{cout} k3 p1 on {vol[0]}x{vol[1]}x{vol[2]}"] = {"round_medians_s": times,
                                                                    "check": checks}
    return {"shapes": out, "tp_conv_input_grad": _tp_conv_input_grad()}


def _tp_conv_input_grad() -> str:
    """What torch's ``_tp_conv`` gives as the input gradient of a 3-D convolution (W split, k3 p1)."""
    torch.manual_seed(0)
    x = torch.randn(1, 2, 4, 4, 8 * dist.get_world_size())
    w, b = torch.randn(3, 2, 3, 3, 3), torch.randn(3)
    xl = x.tensor_split(dist.get_world_size(), dim=4)[dist.get_rank()].clone().requires_grad_()
    try:
        TpConv.apply(xl, w.requires_grad_(), b.requires_grad_(), 1).sum().backward()
    except Exception as err:  # noqa: BLE001 (reported)
        return f"raises {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    return "None (no input gradient)" if xl.grad is None else "a tensor"


# ---------------------------------------------------------------------------- 2. cases
# name, layer ("conv"/"maxpool"), layer kwargs, global (D, H, W), split (d, h, w), input needs grad
CASES = [
    ("supported case: k3 p1, W split", "conv", dict(kernel_size=3, padding=1), (8, 8, 16), (1, 1, 2), False),
    ("k3 p1, W split, input gradient", "conv", dict(kernel_size=3, padding=1), (8, 8, 16), (1, 1, 2), True),
    ("k5 p2, W split", "conv", dict(kernel_size=5, padding=2), (8, 8, 16), (1, 1, 2), False),
    ("stride 2 (k3 p1)", "conv", dict(kernel_size=3, padding=1, stride=2), (8, 8, 16), (1, 1, 2), False),
    ("padding 0 (k3)", "conv", dict(kernel_size=3, padding=0), (8, 8, 16), (1, 1, 2), False),
    ("padding 'valid' (k3)", "conv", dict(kernel_size=3, padding="valid"), (8, 8, 16), (1, 1, 2), False),
    ("padding 'same' (k3)", "conv", dict(kernel_size=3, padding="same"), (8, 8, 16), (1, 1, 2), False),
    ("dilation 2 (k3 p2)", "conv", dict(kernel_size=3, padding=2, dilation=2), (8, 8, 16), (1, 1, 2), False),
    ("even kernel k2 p0", "conv", dict(kernel_size=2, padding=0), (8, 8, 16), (1, 1, 2), False),
    ("even kernel k2 s2 p0", "conv", dict(kernel_size=2, stride=2), (8, 8, 16), (1, 1, 2), False),
    ("even kernel k4 'same'", "conv", dict(kernel_size=4, padding="same"), (8, 8, 16), (1, 1, 2), False),
    ("split on D (k3 p1)", "conv", dict(kernel_size=3, padding=1), (16, 8, 8), (2, 1, 1), False),
    ("split on H (k3 p1)", "conv", dict(kernel_size=3, padding=1), (8, 16, 8), (1, 2, 1), False),
    ("uneven split W=15 (k3 p1)", "conv", dict(kernel_size=3, padding=1), (8, 8, 15), (1, 1, 2), False),
    ("2-D split H x W, 4 ranks (k3 p1)", "conv", dict(kernel_size=3, padding=1), (8, 16, 16), (1, 2, 2),
     False),
    ("MaxPool3d(2), W split", "maxpool", dict(kernel_size=2), (8, 8, 16), (1, 1, 2), True),
    ("MaxPool3d(3, stride 1, padding 1), W split", "maxpool", dict(kernel_size=3, stride=1, padding=1),
     (8, 8, 16), (1, 1, 2), True),
]
CIN, COUT, TOL = 3, 5, 1e-10


def _reference(case) -> tuple[nn.Module, torch.Tensor, torch.Tensor, dict]:
    """The torch.nn layer, global input, output gradient and the reference results (float64)."""
    _, layer, kw, vol, _, _ = case
    torch.manual_seed(0)
    mod = nn.Conv3d(CIN, COUT, **kw).double() if layer == "conv" else nn.MaxPool3d(**kw)
    x = torch.randn(2, CIN, *vol, dtype=torch.float64, requires_grad=True)
    y = mod(x)
    g = torch.randn_like(y)
    y.backward(g)
    ref = {"y": y.detach(), "x": x.grad.clone()}
    ref.update({k: p.grad.clone() for k, p in mod.named_parameters()})
    mod.zero_grad()
    return mod, x.detach(), g, ref


def _rel(a: torch.Tensor | None, b: torch.Tensor) -> float:
    if a is None or a.shape != b.shape:
        return float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def ours_job(rank: int, world: int, indices: list[int]) -> dict:
    """hybridpar on each case: scatter, layer, gather; errors against torch.nn."""
    import hybridpar as hp

    out = {}
    for i in indices:
        name, layer, kw, _, split, _ = CASES[i]
        mod, x, g, ref = _reference(CASES[i])
        grid = hp.ProcessGrid(spatial=split)
        try:
            if layer == "conv":
                dmod = hp.nn.DistConv3d(CIN, COUT, grid=grid, **kw).double()
                dmod.load_state_dict(mod.state_dict())
            else:
                dmod = hp.nn.DistMaxPool3d(grid=grid, **kw)
            xg = x.clone().requires_grad_()
            y = hp.gather(dmod(hp.scatter(xg, grid)), grid)
            y.backward(g)
            errs = {"y": _rel(y.detach(), ref["y"]), "x": _rel(xg.grad, ref["x"])}
            errs.update({k: _rel(p.grad, ref[k]) for k, p in dmod.named_parameters()})
            worst = max(errs.values())
            verdict = (f"correct (max rel err {worst:.1e})" if worst <= TOL
                       else f"WRONG: rel errors {errs}")
        except Exception as err:  # noqa: BLE001 (a failure here is a result to report)
            errs, verdict = {}, f"raises {type(err).__name__}: {str(err).splitlines()[0][:200]}"
        out[name] = {"verdict": verdict, "rel_err": errs}
    return out


def dtensor_job(rank: int, world: int, i: int) -> dict:
    """DTensor on one case: distribute, F.conv3d / F.max_pool3d, backward; what came out where."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    name, layer, kw, _, split, needs_gx = CASES[i]
    mod, x, g, ref = _reference(CASES[i])
    axes = [2 + a for a in range(3) if split[a] > 1]
    if len(axes) == 1:
        mesh = DeviceMesh("cpu", list(range(world)))
    else:
        mesh = DeviceMesh("cpu", torch.arange(world).view(*(split[a - 2] for a in axes)).tolist())
    placements = [Shard(a) for a in axes]
    rep = [Replicate()] * len(axes)
    res: dict = {"placements_in": str(placements)}
    phase = "distribute"
    try:
        xd = distribute_tensor(x.clone(), mesh, placements).requires_grad_(needs_gx)
        phase = "forward"
        if layer == "conv":
            wd = nn.Parameter(distribute_tensor(mod.weight.detach().clone(), mesh, rep))
            bd = nn.Parameter(distribute_tensor(mod.bias.detach().clone(), mesh, rep))
            y = F.conv3d(xd, wd, bd, stride=kw.get("stride", 1), padding=kw.get("padding", 0),
                         dilation=kw.get("dilation", 1))
        else:
            y = F.max_pool3d(xd, **kw)
        res["placements_out"] = str(y.placements)
        res["local_out_shape"] = list(y.to_local().shape)
        phase = "gather output"
        full = y.full_tensor().detach()
        res["y"] = _rel(full, ref["y"])
        phase = "backward"
        y.backward(distribute_tensor(g, mesh, y.placements) if y.placements != tuple(rep)
                   else DTensor.from_local(g, mesh, rep))
        phase = "gather gradients"
        if needs_gx:
            res["x"] = _rel(None if xd.grad is None else xd.grad.full_tensor(), ref["x"])
        if layer == "conv":
            res["weight"] = _rel(wd.grad.full_tensor(), ref["weight"])
            res["bias"] = _rel(bd.grad.full_tensor(), ref["bias"])
    except Exception as err:  # noqa: BLE001 (DTensor's refusals are the point)
        res["error"] = f"{phase}: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    return res


def _dtensor_verdict(per_rank: list[dict]) -> str:
    """One line: what DTensor did with a case, forward first, then backward."""
    r0 = per_rank[0]
    err = r0.get("error", "")
    if "y" not in r0:  # nothing came out of the forward
        return f"raises in {err}"
    gathered = "Replicate" in r0.get("placements_out", "") and "Shard" in r0["placements_in"]
    if any(r["y"] > 1e-8 for r in per_rank if "y" in r):
        how = (f"local shape {r0['local_out_shape']}" if r0["y"] == float("inf")
               else f"rel err {max(r['y'] for r in per_rank if 'y' in r):.2g}")
        lab = f", labelled {r0['placements_out']}" if gathered else ""
        verdict = f"WRONG output, silently ({how}{lab})"
    elif gathered:
        verdict = f"output right but all-gathered ({r0['placements_out']} on every rank)"
    else:
        verdict = "output right"
    if err:
        return f"{verdict}; then raises in {err}"
    wrong = [k for k in ("x", "weight", "bias") if any(r.get(k, 0.0) > 1e-8 for r in per_rank)]
    if wrong:
        return f"{verdict}; WRONG gradient(s) of {', '.join(wrong)}, silently"
    return verdict + "; gradients right"


def cases_run(timeout: float, limit: int | None = None) -> list[dict]:
    """The first ``limit`` cases (all by default), ours and DTensor's, each DTensor case in fresh ranks."""
    cases = CASES[:limit]
    small = [i for i, c in enumerate(cases) if c[4].count(1) == 2]
    rows = []
    ours = common.launch(ours_job, RANKS, small, timeout=timeout)
    big = [i for i in range(len(cases)) if i not in small]
    if big:
        ours.update(common.launch(ours_job, 4, big, timeout=timeout))
    for i, case in enumerate(cases):
        world = 4 if i in big else RANKS
        try:
            per_rank = common.launch(dtensor_job, world, i, timeout=timeout, every_rank=True)
            verdict = _dtensor_verdict(per_rank)
        except TimeoutError:
            per_rank, verdict = [], f"hangs (killed after {timeout:.0f} s)"
        except Exception as err:  # noqa: BLE001 (a crashed rank is a result too)
            per_rank, verdict = [], f"process crashed: {str(err).splitlines()[0][:160]}"
        rows.append({"case": case[0], "ranks": world, "dtensor": verdict, "ours": ours[case[0]]["verdict"],
                     "dtensor_detail": per_rank, "ours_rel_err": ours[case[0]]["rel_err"]})
        print(f"  {case[0]}: DTensor {verdict} | ours {ours[case[0]]['verdict']}", flush=True)
    return rows


# ---------------------------------------------------------------------------- main
TINY = {"scale": 0.25, "rounds": 1, "steps": 1, "warmup": 1, "cases": 1}  # --tiny: seconds


def main(argv: list[str] | None = None) -> None:
    ap = common.parser("dtensor", __doc__, rounds=3, steps=5, warmup=2, max_load=0.5)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every timed volume's edges")
    ap.add_argument("--skip-timing", action="store_true", help="only the cases")
    ap.add_argument("--skip-cases", action="store_true", help="only the timing")
    ap.add_argument("--cases", type=int, default=None, help="only the first N cases (default: all)")
    ap.add_argument("--case-timeout", type=float, default=120, help="seconds before a case counts as hung")
    args = common.parse(ap, argv, TINY)
    shapes = [(ci, co, tuple(max(4, int(round(e * args.scale))) for e in vol)) for ci, co, vol in SHAPES]
    cfg = {"shapes": shapes, "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup}
    payload: dict = {"config": {**cfg, "ranks": RANKS, "split": [1, 1, RANKS], "dtype_timing": "float32",
                                "dtype_cases": "float64", "threads_per_rank": 1, "batch_timing": 1,
                                "batch_cases": 2, "case_tolerance": TOL,
                                "conv": "Conv3d k3 p1 with bias; input needs no gradient (timing)"}}
    tables = []
    if not args.skip_timing:
        load = common.wait(args)
        print(f"load average at start: {load['load_at_start']}", flush=True)
        t0 = time.monotonic()
        timing = common.launch(timing_job, RANKS, cfg, threads=1)
        load_end, run_s = common.loadavg(), round(time.monotonic() - t0, 1)
        noisy = common.disturbed([load_end[0]], RANKS)
        print(f"torch _tp_conv input gradient in 3-D: {timing['tp_conv_input_grad']}", flush=True)
        rows = []
        for shape, res in timing["shapes"].items():
            med = {n: statistics.median(v) * 1e3 for n, v in res["round_medians_s"].items()}
            base = med["torch _tp_conv (direct)"]
            for n in IMPLS:
                c = res["check"][n]
                ok = ("yes" if c.get("correct") else "raises" if "error" in c
                      else "n/a (time floor)" if "reference" in c else "NO (wrong result)")
                rows.append([shape, n, med[n], med[n] / base, ok])
            res["median_ms"] = med
            res["ours_vs_tp_conv"] = {n: med[n] / base for n in IMPLS[:2]}
        tables.append(common.print_table(
            ["Conv3d (2 ranks x 1 thread, W split)", "implementation", "median ms", "T/T_tp_conv",
             "matches torch.nn"], rows,
            title=f"DTensor vs hybridpar: fwd+bwd, float32, batch 1 ({args.rounds} rounds x {args.steps} "
                  f"steps; 1-min load {load['load_at_start'][0]:.2f} -> {load_end[0]:.2f}"
                  f"{'; DISTURBED by other work' if noisy else ''})"))
        payload.update(timing=timing, load={**load, "load_at_end": load_end, "timing_run_s": run_s,
                                            "disturbed": noisy})
    if not args.skip_cases:
        print("cases (float64, checked against torch.nn):", flush=True)
        cases = cases_run(args.case_timeout, args.cases)
        tables.append(common.print_table(["case", "ranks", "DTensor (torch " + torch.__version__ + ")",
                                          "hybridpar"],
                                         [[c["case"], c["ranks"], c["dtensor"], c["ours"]] for c in cases]))
        payload["cases"] = cases
    payload["tables"] = tables
    common.write_json(args, payload)


if __name__ == "__main__":
    main()
