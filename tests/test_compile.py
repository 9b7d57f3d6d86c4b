"""torch.compile through Dist layers: graph breaks only at communication, numbers unchanged.

A model of split convolutions (one overlapped), pooling, a gather and a dense head is compiled with
``backend="aot_eager"`` (CPU inductor compiles correctly but takes minutes on a 2-core machine:
``python -m perf gpu_check`` runs it). ``torch._dynamo.explain`` counts the graph breaks and dynamo's
counters list them: on one rank there are none, one graph (nothing is exchanged); on a (2, 1, 1)
split every break is a call of a communication function (halo exchange, gradient synchronisation,
the overlapped convolution, redistribution). The model then reads [comm] relu pool [comm] relu pool
[comm] flatten linear: three graphs, two breaks between them (the first layer starts with
communication, so no graph precedes it). Outputs and gradients of the
compiled model equal the eager model's (float64, 1e-10), and an engine compiled by
``Engine.compile`` trains a step to the same loss and gradients.
"""

from __future__ import annotations

import re

import pytest

COMMUNICATION = {"halo_exchange", "_synced", "_overlapped", "_redistribute", "sum_to_replicated",
                 "replicated_into_shards", "infer_global_shape"}


def _model(hp, nn, grid):
    return nn.Sequential(
        hp.nn.DistConv3d(2, 4, 3, padding=1, grid=grid), nn.LeakyReLU(0.3), hp.nn.DistMaxPool3d(2, grid=grid),
        hp.nn.DistConv3d(4, 4, 3, padding=1, grid=grid, overlap=True), nn.LeakyReLU(0.3),
        hp.nn.DistAvgPool3d(2, grid=grid), hp.nn.Gather(grid), nn.Flatten(), nn.Linear(4 * 8, 3)).double()


def _breaks() -> list[str]:
    """Names of the functions dynamo skipped (``torch.compiler.disable``) since the counters were
    cleared, one entry per graph break it recorded, and any other break reason verbatim."""
    from torch._dynamo.utils import counters

    out = []
    for reason, n in counters["graph_break"].items():
        m = re.search(r"Skip calling function `<function (\w+) at", reason)
        out += [m.group(1) if m else reason.splitlines()[0]] * n
    return out


def _layers_case(rank: int, world: int, expected_graphs: int, expected_breaks: int) -> None:
    """Graph breaks of the compiled Dist layers, and their outputs and gradients against eager."""
    import torch
    from torch import nn

    import hybridpar as hp

    fails = []
    grid = hp.ProcessGrid(spatial=(world, 1, 1))
    x = torch.randn(2, 2, 8, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    eager = _model(hp, nn, grid)
    compiled = _model(hp, nn, grid)
    compiled.load_state_dict(eager.state_dict())
    for m in (eager, compiled):
        hp.nn.set_global_shapes(m, x.shape)
    xs = hp.scatter(x, grid)
    compiled(xs)  # one eager call builds the halo plans, as an engine's first step would
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    explained = torch._dynamo.explain(compiled)(xs)
    names = _breaks()
    if (explained.graph_count, explained.graph_break_count) != (expected_graphs, expected_breaks):
        fails.append(f"grid {grid.spatial_shape}: {explained.graph_count} graphs and "
                     f"{explained.graph_break_count} breaks, expected {expected_graphs} and "
                     f"{expected_breaks} "
                     f"({names})")
    if set(names) - COMMUNICATION:
        fails.append(f"grid {grid.spatial_shape}: graph breaks outside communication: "
                     f"{sorted(set(names) - COMMUNICATION)}")
    if rank == 0:
        print(f"grid {grid.spatial_shape}: {explained.graph_count} graphs, {explained.graph_break_count} "
              f"breaks at {sorted(set(names))}")
    compiled.compile(backend="aot_eager")
    ran = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        xi = xs.detach().clone().requires_grad_()
        y = model(xi)
        y.square().sum().backward()
        ran[name] = (y.detach(), xi.grad)
    pairs = [("output", ran["compiled"][0], ran["eager"][0]),
             ("input grad", ran["compiled"][1], ran["eager"][1])]
    pairs += [(f"{k}.grad", p.grad, q.grad)
              for (k, p), q in zip(compiled.named_parameters(), eager.parameters())]
    for what, a, b in pairs:
        err = ((a - b).abs().max() / b.abs().max()).item()
        if not err <= 1e-10:
            fails.append(f"grid {grid.spatial_shape} compiled {what}: relative error {err:.2e}")
    if fails:
        raise AssertionError(f"rank {rank}: " + "\n".join(fails))


def _engine_case(rank: int, world: int) -> None:
    """parallelize, Engine.compile, three steps against the uncompiled engine's. The first step runs
    eagerly (it builds the halo plans), the second compiles, the third reuses: on one rank the stage is
    one graph with no break; on two, breaks only at communication; the third step compiles nothing."""
    import torch
    import torch.nn.functional as F
    from test_engine import make_model
    from torch._dynamo.utils import counters

    import hybridpar as hp

    fails, losses, grads = [], [], []
    xb = torch.randn(2, 2, 16, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    yb = torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for compile_it in (False, True):
        torch.manual_seed(0)
        engine = hp.parallelize(make_model(), {"grid": {"spatial": [world, 1, 1]}}, loss_fn=F.mse_loss)
        x_local, y_local = engine.shard_batch(xb, yb)
        if compile_it:
            torch._dynamo.reset()
            counters.clear()
            engine.compile(backend="aot_eager")
        opt = torch.optim.SGD(engine.parameters(), lr=0.1)
        run = []
        for step in range(3):
            if step == 2:
                graphs = counters["stats"]["unique_graphs"]
            run.append((engine.train_step(x_local, y_local), [p.grad.clone() for p in engine.parameters()]))
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append([loss for loss, _ in run])
        grads.append([g for _, gs in run for g in gs])
    if compile_it:
        names = _breaks()
        if counters["stats"]["unique_graphs"] != graphs:
            fails.append(f"the third compiled step compiled again ({graphs} graphs before it, "
                         f"{counters['stats']['unique_graphs']} after)")
        if world == 1 and (graphs != 1 or names):
            fails.append(f"one rank: {graphs} graphs and breaks at {names}, expected one graph, no break")
        if set(names) - COMMUNICATION:
            fails.append(f"graph breaks outside communication: {sorted(set(names) - COMMUNICATION)}")
    for k, (a, b) in enumerate(zip(losses[1], losses[0])):
        if not torch.allclose(a, b, rtol=1e-10, atol=0):
            fails.append(f"engine compiled, step {k + 1}: loss {a.item()} vs {b.item()}")
    if any(not torch.allclose(a, b, rtol=1e-9, atol=1e-12) for a, b in zip(grads[1], grads[0])):
        fails.append("engine compiled: gradients differ from the uncompiled engine's")
    if fails:
        raise AssertionError(f"rank {rank}: " + "\n".join(fails))


@pytest.mark.parametrize("world,graphs,breaks", [(1, 1, 0), (2, 3, 2)])
def test_compiles_with_breaks_only_at_communication(pools, world, graphs, breaks):
    pools(world).run(_layers_case, graphs, breaks, timeout=300)


@pytest.mark.parametrize("world", [1, 2])
def test_compiled_engine_trains_the_same_step(pools, world):
    pools(world).run(_engine_case, timeout=300)


def _untraced_case(rank: int, world: int) -> None:
    """A forward torch.fx cannot trace, compiled: its calls are followed in Python state
    (hybridpar.pipeline.split_forward) that a compiled graph would not consult again, so that forward
    runs eagerly; three steps equal the uncompiled engine's (they differed from the second step on)."""
    import torch
    import torch.nn.functional as F
    from test_untraced_forwards import SHAPE, DeepBranch

    import hybridpar as hp

    g = torch.Generator().manual_seed(4)
    xb = torch.randn(SHAPE, dtype=torch.float64, generator=g)
    yb = torch.randn((SHAPE[0], 1, *SHAPE[2:]), dtype=torch.float64, generator=g)
    losses = []
    for compile_it in (False, True):
        torch.manual_seed(0)
        spec = {"grid": {"spatial": [world, 1, 1]}}
        engine = hp.parallelize(DeepBranch().double(), spec, loss_fn=F.mse_loss)
        x_local, y_local = engine.shard_batch(xb, yb)
        if compile_it:
            torch._dynamo.reset()
            engine.compile(backend="aot_eager")
        opt = torch.optim.SGD(engine.parameters(), lr=0.1)
        run = []
        for _ in range(3):
            run.append(engine.train_step(x_local, y_local).item())
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(run)
    if any(abs(a - b) > 1e-10 * abs(b) for a, b in zip(losses[1], losses[0])):
        raise AssertionError(f"rank {rank}: compiled {losses[1]} != eager {losses[0]}")


def test_a_compiled_untraceable_forward_trains_the_same_steps(pools):
    pools(2).run(_untraced_case, timeout=300)
