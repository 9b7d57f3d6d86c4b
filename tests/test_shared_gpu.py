"""Ranks sharing one GPU: the selection of the staged transport (no processes), its CPU path inside
the layer parity cases (2 gloo ranks), and, marked ``cuda``, its data path with 2 ranks on one GPU:
split layers on CUDA tensors against torch and an engine step with a pipeline cut."""

from __future__ import annotations

import random

import pytest

from hybridpar.comm import devices, transport

import distributed


def test_local_world_size_from_each_launcher():
    assert devices.local_world_size({"LOCAL_WORLD_SIZE": "4"}) == 4
    assert devices.local_world_size({"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}) == 2
    assert devices.local_world_size({"MPI_LOCALNRANKS": "3"}) == 3
    assert devices.local_world_size({"SLURM_NTASKS_PER_NODE": "8"}) == 8
    assert devices.local_world_size({}) is None


def test_sharing_is_more_local_ranks_than_devices():
    assert devices.will_share(4, 1) and devices.will_share(3, 2)
    assert not devices.will_share(2, 2) and not devices.will_share(None, 1) and not devices.will_share(4, 0)


def test_collisions_are_same_host_and_device():
    placements = [("a", 0), ("a", 0), ("b", 0), ("a", 1), ("a", -1), ("a", -1)]
    assert devices.collisions(placements, 0) == [1]
    assert devices.collisions(placements, 2) == [] and devices.collisions(placements, 3) == []
    assert devices.collisions(placements, 4) == []  # no GPU: nothing shared


def test_choice_is_staged_only_where_shared(capsys):
    assert transport.choose(None, None, shared=False) == "torch"
    assert transport.choose(None, "mpi", shared=False) == "mpi"
    assert transport.choose(None, None, shared=True) == "staged"
    assert transport.choose("staged", None, shared=False) == "staged"  # asked for by name
    with pytest.raises(ValueError, match="cannot move CUDA tensors between ranks that share a GPU"):
        transport.choose(None, "torch", shared=True)
    with pytest.raises(ValueError, match="unknown transport 'nccl'"):
        transport.choose("nccl", None, shared=False)
    try:
        assert devices.record([("h", 0), ("h", 0)], 0) == [1]
        assert isinstance(transport.get_transport(None, None), transport.StagedP2P)
        assert isinstance(transport.get_transport(None, None), transport.StagedP2P)
        said = capsys.readouterr().err
        assert said.count("transport 'staged'") == 1, said  # one line, once
    finally:
        devices.record([("h", 0)], 0)
    assert isinstance(transport.get_transport(None, None), transport.TorchP2P)


def _cpu_staged(rank: int, world: int) -> None:
    import hybridpar as hp

    import layer_cases

    fails = layer_cases.Failures()
    grid = hp.ProcessGrid(spatial=(2, 1, 1))
    layer_cases.run_conv(fails, grid, random.Random(3), n_random=2, transport="staged")
    fails.raise_if_any(rank)


def test_staged_transport_moves_cpu_halos():
    distributed.run(_cpu_staged, 2, timeout=300)


def _on_shared_gpu(rank: int, world: int) -> None:
    import torch
    import torch.nn.functional as F

    import hybridpar as hp
    from hybridpar.comm import devices as devs

    assert devs.shares_device(), "two ranks on one GPU were not recognised as sharing it"
    grid = hp.ProcessGrid(spatial=(2, 1, 1))
    torch.manual_seed(0)
    ref = torch.nn.Conv3d(3, 4, 3, padding=1).cuda().double()
    ours = hp.nn.DistConv3d(3, 4, 3, padding=1, grid=grid, overlap=True).cuda().double()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 10, 9, 8, dtype=torch.float64, device="cuda",
                    generator=torch.Generator("cuda").manual_seed(1))
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(xr).square().sum().backward()
    hp.gather(ours(hp.scatter(xo, grid)), grid).square().sum().backward()
    assert torch.allclose(xo.grad, xr.grad, rtol=1e-10, atol=1e-12)
    assert torch.allclose(ours.weight.grad, ref.weight.grad, rtol=1e-10, atol=1e-12)
    from test_engine import make_model

    losses = []
    for layout in ({"grid": {"pipe": 2}}, {"grid": {"spatial": [2, 1, 1]}}):
        engine = hp.parallelize(make_model().cuda(), layout, loss_fn=F.mse_loss)
        xb = torch.randn(4, 2, 16, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        yb = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        losses.append(engine.train_step(*engine.shard_batch(xb.cuda(), yb.cuda())))
    model = make_model().cuda()
    want = F.mse_loss(model(xb.cuda()), yb.cuda())
    for got in losses:
        assert torch.allclose(got, want, rtol=1e-10), (got.item(), want.item())


@pytest.mark.cuda
def test_two_ranks_share_one_gpu():
    distributed.run(_on_shared_gpu, 2, timeout=300, env={"LOCAL_WORLD_SIZE": "2"})
