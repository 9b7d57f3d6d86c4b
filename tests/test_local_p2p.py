"""Same-host point-to-point by cross-memory attach (hybridpar.comm.local_p2p), against gloo's.

Checked: every message arrives bit-exact (dtypes, odd and empty sizes, many at once); tags match
oldest first whatever order receives are posted in, including more outstanding sends than the
ring holds with receives posted in reverse (the stash path); a size mismatch is an error naming
both ranks; a send completes only once the receiver has copied; the pairs the transport covers
are the ones both ranks asked for and could read (a failed probe drops the pair); a rank that
dies is reported by its waiting peer; one engine step gives gloo's numbers bit for bit; the
segment names are gone once set up; under Yama ptrace scope 1 no rank relaxes its ptrace protection
unless asked (``allow_ptrace``), and without it no pair forms.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch
import torch.distributed as dist

from hybridpar.comm import local_p2p
from hybridpar.comm.local_channel import RING
from tests.distributed import run

pytestmark = pytest.mark.skipif(not local_p2p.available(), reason="needs Linux cross-memory attach")


def _message(rank: int, tag: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + tag)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-100, 100, (numel,), generator=g).to(dtype)


def _cases(rank: int, world: int) -> None:
    t = local_p2p.LocalP2P.create([r for r in range(world) if r != rank])
    assert t.peers == set(range(world)) - {rank}
    dist.barrier()  # every rank has unlinked what it created
    assert not glob.glob("/dev/shm/hybridpar-*"), "segment names must be unlinked once mapped"
    peer = 1 - rank if rank < 2 else None

    # 1. many messages of many dtypes and sizes, both ways at once, receives in reverse tag order
    specs = [(tag, n, dt) for tag, (n, dt) in enumerate(
        [(1, torch.float64), (0, torch.float32), (1_000_003, torch.float32), (17, torch.int64),
         (5, torch.bfloat16), (333, torch.float16), (4096, torch.int8), (2, torch.bool)])]
    if peer is not None:
        sends = [t.isend(_message(rank, tag, n, dt), peer, tag) for tag, n, dt in specs]
        bufs = {tag: torch.empty(n, dtype=dt) for tag, n, dt in specs}
        recvs = [(tag, t.irecv(bufs[tag], peer, tag)) for tag, _, _ in reversed(specs)]
        for tag, w in recvs:
            w.wait()
            n, dt = specs[tag][1:]
            assert torch.equal(bufs[tag], _message(peer, tag, n, dt)), f"tag {tag}"
        for w in sends:
            w.wait()
            assert w.is_completed()

    # 2. same tag many times: oldest first (non-overtaking); 3x the ring's descriptors outstanding
    # with receives posted newest tag first (the receiver must stash to let the sender go on)
    count = 3 * RING
    if rank == 0:
        sends = [t.isend(torch.full((3,), float(k)), 1, tag=k % 7) for k in range(count)]
        for w in sends:
            w.wait()
    elif rank == 1:
        bufs = [torch.empty(3) for _ in range(count)]
        order = sorted(range(count), key=lambda k: (-(k % 7), k))  # tag 6 first, each tag in order
        works = [t.irecv(bufs[k], 0, tag=k % 7) for k in order]
        for w in works:
            w.wait()
        assert all(bufs[k][0].item() == k for k in range(count))

    # 3. a send completes only after the receiver copied (its tensor may be freed after wait)
    dist.barrier()
    if rank == 0:
        w = t.isend(torch.arange(10.0), 1, tag=99)
        assert not w.is_completed()
        dist.barrier()  # the receiver posts only after this
        w.wait()
    elif rank == 1:
        dist.barrier()
        assert torch.equal(t.recv(torch.empty(10), 0, tag=99), torch.arange(10.0))
    else:
        dist.barrier()

    # 4. a size mismatch names both ranks and sizes
    if rank == 0:
        t.isend(torch.zeros(4), 1, tag=7).wait(timeout=30)
    elif rank == 1:
        with pytest.raises(RuntimeError, match=r"rank 0 sent 16 bytes with tag 7; rank 1 posted a "
                                               r"receive of 20"):
            t.recv(torch.empty(5), 0, tag=7)
        t.recv(torch.empty(4), 0, tag=7)  # the descriptor is still there, and still correct
    dist.barrier()

    # 5. only mutual pairs: rank 0 asks for nobody, so no rank has a channel with it
    t2 = local_p2p.LocalP2P.create([] if rank == 0 else [r for r in range(world) if r != rank])
    assert t2.peers == (set() if rank == 0 else set(range(1, world)) - {rank})
    t3 = local_p2p.LocalP2P.create([r for r in range(world) if r != rank], enabled=rank != 1)
    assert 1 not in t3.peers and (rank != 1 or not t3.peers)
    assert not t3.handles(torch.zeros(1, device="meta"), next(iter(t3.peers), 0))

    # 6. a probe read that fails (ptrace denied, say) drops the pair on both sides, nothing else
    if rank == 2:
        def denied(*args):
            raise OSError(1, "Operation not permitted")
        local_p2p.read_remote, real = denied, local_p2p.read_remote
    t4 = local_p2p.LocalP2P.create([r for r in range(world) if r != rank])
    if rank == 2:
        local_p2p.read_remote = real
    assert t4.peers == ({1 - rank} if rank < 2 else set())

    # 7. Yama scope 1 (faked): ptrace protection is relaxed only when asked, and then once per rank
    others = [r for r in range(world) if r != rank]
    calls: list[int] = []
    real = local_p2p.ptrace_scope, local_p2p.set_ptracer_any
    local_p2p.ptrace_scope, local_p2p.set_ptracer_any = (lambda: 1), (lambda: calls.append(rank))
    try:
        t5 = local_p2p.LocalP2P.create(others)
        assert (t5.peers, calls) == (set(), []), "relaxed without being asked"
        t6 = local_p2p.LocalP2P.create(others, allow_ptrace=True)
        assert (t6.peers, calls) == (set(others), [rank]), "asked, yet no pair or no relaxing"
    finally:
        local_p2p.ptrace_scope, local_p2p.set_ptracer_any = real


def test_local_p2p_cases():
    run(_cases, 3, timeout=180)


def _dies(rank: int, world: int) -> None:
    t = local_p2p.LocalP2P.create([1 - rank])
    dist.barrier()  # rank 0 hosts the rendezvous store: both are done with it
    if rank == 0:
        os._exit(0)  # no goodbye: its peer must notice, not hang
    with pytest.raises(RuntimeError, match=r"rank 0 \(pid \d+\) exited while this rank waited for its "
                                           r"receive from rank 0 \(tag 5, 8 bytes\)"):
        t.recv(torch.empty(2), 0, tag=5)


def test_peer_death_is_reported():
    run(_dies, 2, timeout=60)  # rank 1 fails the test unless it reports its dead peer


def _engine_step(rank: int, world: int) -> None:
    from torch import nn

    import hybridpar as hp

    results = []
    for local in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv3d(4, 4, 3, padding=1),
                              nn.Flatten(), nn.Linear(4 * 6 ** 3, 2)).double()
        spec = {"grid": {"data": 1, "pipe": 2, "spatial": [1, 1, 1]},
                "pipeline": {"schedule": "gpipe", "microbatches": 3, "stages": "auto"}}
        engine = hp.parallelize(model, spec, loss_fn=nn.functional.mse_loss, local_p2p=local)
        x, y = torch.randn(6, 2, 6, 6, 6, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
        xl, yl = engine.shard_batch(x, y)
        loss = engine.train_step(xl, yl)
        assert (engine.local is not None and bool(engine.local.peers)) == local
        grads = [p.grad.clone() for p in engine.parameters()]
        results.append((loss, grads, engine.predict(xl)))
    (l0, g0, p0), (l1, g1, p1) = results
    assert torch.equal(l0, l1) and torch.equal(p0, p1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))


def test_engine_step_equals_gloo():
    run(_engine_step, 2, timeout=120)
