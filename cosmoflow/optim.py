"""Optimizer and learning-rate schedule of the MLPerf HPC CosmoFlow reference, and LARS.

Why: CosmoFlow's recipe scales the learning rate linearly with the global batch (0.001 per 64
samples), warms it up over the first epochs, and decays it in steps; at large batches LARS (layer-wise
trust ratios) keeps SGD stable. The schedule is a pure function of the (fractional) epoch so a resumed
run continues on the same curve.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from cosmoflow.config import OptimizerConfig


def peak_lr(cfg: OptimizerConfig, global_batch: int) -> float:
    """``base_lr`` scaled linearly from ``base_batch`` to the global batch."""
    return cfg.base_lr * global_batch / cfg.base_batch


def lr_at(cfg: OptimizerConfig, global_batch: int, epoch: float) -> float:
    """Learning rate at a fractional epoch: linear warm-up, then step decay."""
    peak = peak_lr(cfg, global_batch)
    if cfg.warmup_epochs > 0 and epoch < cfg.warmup_epochs:
        start = cfg.base_lr
        return start + (peak - start) * epoch / cfg.warmup_epochs
    factor = 1.0
    for at, f in zip(cfg.decay_epochs, cfg.decay_factors):
        if epoch >= at:
            factor = f
    return peak * factor


def lr_of_step(cfg: OptimizerConfig, global_batch: int, step: int, steps_per_epoch: int) -> float:
    """Learning rate of the optimizer step that follows ``step`` completed steps.

    The position on the schedule comes from the step count alone (``step / steps_per_epoch`` epochs),
    never from a loader's position: a loader moves to the next epoch as it hands out an epoch's last
    batch, so its index reads 0 exactly when that batch is trained on.
    """
    return lr_at(cfg, global_batch, step / steps_per_epoch)


class LARS(torch.optim.Optimizer):
    """SGD with momentum and layer-wise adaptive rate scaling (You et al., 2017).

    Each tensor's step is scaled by ``trust * ||w|| / (||g|| + wd * ||w||)``; 1-D tensors (biases,
    norms) use plain SGD, as is common practice.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, momentum: float = 0.9,
                 weight_decay: float = 0.0, trust: float = 0.001, eps: float = 1e-9) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust=trust,
                                      eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if p.dim() > 1:
                    w_norm, g_norm = p.norm(), g.norm()
                    scale = torch.where((w_norm > 0) & (g_norm > 0),
                                        group["trust"] * w_norm / (g_norm + group["weight_decay"] * w_norm
                                                                   + group["eps"]),
                                        torch.ones_like(w_norm))
                    g = (g + group["weight_decay"] * p) * scale
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = state["momentum_buffer"] = g.clone()
                else:
                    buf.mul_(group["momentum"]).add_(g)
                p.add_(buf, alpha=-group["lr"])
        return loss


def make_optimizer(cfg: OptimizerConfig, params: list[torch.nn.Parameter], global_batch: int
                   ) -> torch.optim.Optimizer:
    """The configured optimizer, starting at the schedule's epoch-0 learning rate.

    A pipeline stage of pooling and activations alone has no parameters; torch refuses an empty
    parameter list, so such a rank gets an optimizer over one empty group (its steps do nothing, and
    its schedule and state dict work like everyone else's).
    """
    lr = lr_at(cfg, global_batch, 0.0)
    params = list(params) or [{"params": []}]
    if cfg.name == "lars":
        return LARS(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.name == "adamw":  # for small synthetic sets; the MLPerf recipe is SGD
        return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr
