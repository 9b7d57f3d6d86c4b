"""The whole training step captured once in a CUDA graph and replayed (``train.cuda_graphs: true``).

Why: a 3D CNN's step at batch 1 is hundreds of short kernels; launching them from Python costs more
than running them on an H100. Captured once, the step replays as one graph launch.

Where the halo exchange sits: *inside* the graph. Under NCCL the halo sends and receives
(``batch_isend_irecv``), the gradient all-reduces and the loss exchange are kernels on CUDA streams,
which a graph captures like any other (NCCL >= 2.9.6); the side stream the overlapped convolution
exchanges on forks from and joins the capturing stream with events, which capture allows. Putting
the exchange at the graph edges instead would cut the step into one graph per split layer, forward
and backward, each boundary a host round trip: most of what a graph saves. What cannot be captured
is communication driven by the host: gloo, the MPI transport and the pinned-memory staging used when
ranks share a GPU. Those are refused when capturing starts, naming the reason.

Requirements it relies on (true for ``Engine.train_step`` once built, see ``tests/test_sync_free``):
no host synchronisation in the step, no shape changes (the same batch shape every step: the loader
drops the last partial batch), global shapes set on every split layer (no per-call shape
all-gather), and gradients that stay the same tensors: the optimizer reads the ``.grad`` tensors the
capture wrote, so they are zeroed in place, never set to None, between steps. Warm-up: three eager
steps on a side stream before capture (torch's rule for lazy initialisation; they update BatchNorm
running statistics as ordinary steps would, and their gradients are discarded).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

from hybridpar.comm.transport import TorchP2P

WARMUP = 3


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream: no host sync may run then
    (a step's checks that read values back skip it; the warm-up steps before the capture ran them)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def capture_problem(engine: Any) -> str | None:
    """Why ``engine``'s step cannot be captured here, or None."""
    if not torch.cuda.is_available():
        return "CUDA graphs need a CUDA device"
    params = engine.parameters()
    if params and params[0].device.type != "cuda":
        return f"the model is on {params[0].device}, not on a CUDA device"
    if dist.is_initialized() and dist.get_world_size() > 1:
        if "nccl" not in str(dist.get_backend()).lower():
            return (f"the process group's backend is {dist.get_backend()!r}: only NCCL communication can "
                    f"be captured (gloo and the pinned staging of ranks sharing a GPU run on the host)")
        for _, layer in engine.layers:
            for m in layer.modules():
                for ex in getattr(m, "_exchangers", {}).values():
                    if not isinstance(ex.transport, TorchP2P):
                        return f"{m.layer_name} exchanges halos over {ex.transport.name!r}, not NCCL"
    return None


class GraphedStep:
    """``engine.train_step`` captured on first call, replayed after (see module doc)."""

    def __init__(self, engine: Any, autocast: Callable[[], AbstractContextManager]) -> None:
        self.engine, self.autocast = engine, autocast
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: dict[str, torch.Tensor | None] = {}
        self.loss: torch.Tensor | None = None

    def _run(self) -> torch.Tensor:
        s = self.static
        with self.autocast():
            return self.engine.train_step(s["x"], s["y"], loss_scale=s["scale"])

    def _capture(self, x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor | None) -> None:
        problem = capture_problem(self.engine)
        if problem:
            raise RuntimeError(f"hybridpar.device.cuda_graphs: cannot capture the training step: {problem}")
        device = self.engine.parameters()[0].device
        fmt = self.engine.memory_format if x.dim() == 5 else torch.contiguous_format
        self.static = {"x": x.to(device).contiguous(memory_format=fmt), "y": y.to(device).clone(),
                       "scale": None if scale is None else scale.clone()}
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                self._run()
        torch.cuda.current_stream(device).wait_stream(side)
        for p in self.engine.parameters():
            p.grad = None  # allocated by the captured backward, in the graph's pool
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: only this thread is held to capture's rules, so a loader's receiver thread
        # may go on moving batches to the device (on its own stream) while the step is captured
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.loss = self._run()

    def __call__(self, x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """Copy the batch into the captured inputs, replay, return the captured loss tensor."""
        if self.graph is None:
            self._capture(x, y, scale)
        s = self.static
        if tuple(x.shape) != tuple(s["x"].shape) or tuple(y.shape) != tuple(s["y"].shape):
            raise ValueError(f"hybridpar.device.cuda_graphs: the step was captured for a batch of "
                             f"{tuple(s['x'].shape)}, got {tuple(x.shape)}; a captured step needs one batch "
                             f"shape (drop the last partial batch)")
        s["x"].copy_(x, non_blocking=True)
        s["y"].copy_(y, non_blocking=True)
        if scale is not None and s["scale"] is not None:
            s["scale"].copy_(scale)
        self.graph.replay()  # type: ignore[union-attr]
        return self.loss  # type: ignore[return-value]
