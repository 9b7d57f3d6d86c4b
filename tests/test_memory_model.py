"""The performance model's activation memory per rank against what autograd actually keeps.

Why: the advisor rejects layouts by predicted memory per rank, so the estimate of saved activations
(layer outputs, halo-extended inputs, max-pool indices, times the micro-batches in flight) must hold
on real layouts. ``hybridpar.profiling.saved_memory.SavedActivations`` counts the distinct storages
autograd keeps for backward, exactly and on any device; one 2-rank group checks data, spatial and
pipeline layouts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridpar.profiling.saved_memory import SavedActivations

import distributed

LAYOUTS = [
    {"grid": {"data": 2}},
    {"grid": {"spatial": [2, 1, 1]}},
    {"grid": {"spatial": [1, 2, 1]}, "pipeline": {"microbatches": 2}},
    {"grid": {"pipe": 2}, "pipeline": {"microbatches": 2}},
    {"grid": {"pipe": 2}, "pipeline": {"microbatches": 4, "schedule": "1f1b"}},
]


def test_saved_activations_counts_each_storage_once_while_held():
    conv, relu = nn.Conv3d(2, 3, 3, padding=1), nn.LeakyReLU(0.3)
    x = torch.randn(2, 2, 6, 6, 6)
    with SavedActivations(conv.parameters()) as saved:
        out = relu(conv(x))
        # conv keeps its input, leaky_relu its input (the conv's output); weights are skipped
        assert saved.live == x.numel() * 4 + out.numel() * 4
        out.sum().backward()
    assert saved.peak_bytes == x.numel() * 4 + out.numel() * 4
    assert saved.live == 0


def _body(rank: int, world: int) -> None:
    import cosmoflow.model as cm
    import hybridpar as hp
    from hybridpar import perfmodel as pm

    shape = (4, 4, 32, 32, 32)
    failures = []
    for layout in LAYOUTS:
        torch.manual_seed(0)
        model = cm.build_model(32, n_conv=4, base_filters=16, dropout=0)
        pred = pm.predict(model, layout, "v100", world, input_shape=shape)
        engine = hp.parallelize(model, layout, loss_fn=F.mse_loss)
        x, y = torch.randn(shape), torch.randn(4, 4)
        x_local, y_local = engine.shard_batch(x, y)
        engine.train_step(x_local, y_local)
        # the rank's input shard is the caller's (the model counts it as "inputs"); a later stage's
        # received inputs are kept by autograd, and counted there too
        with SavedActivations([*engine.parameters(), x_local]) as saved:
            engine.train_step(x_local, y_local)
        mem = pred.stages[engine.grid.pipe_index].memory
        want = mem["activations"] + (mem["inputs"] if engine.grid.pipe_index > 0 else 0)
        if not abs(saved.peak_bytes / want - 1) <= 0.03:
            failures.append(f"{layout} stage {engine.grid.pipe_index}: measured "
                            f"{saved.peak_bytes / 2**20:.3f} MiB, model {want / 2**20:.3f} MiB")
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def test_activation_memory_model_matches_autograd():
    distributed.run(_body, 2, timeout=300)
