"""A tiny deterministic CPU training run that checkpoints and resumes: the subject of the kill tests.

    python tests/ckpt_train_script.py ROOT OUT.pt [--steps 12] [--every 3] [--overlap] [--local DIR]

It resumes from the newest complete checkpoint under ROOT if there is one, trains to ``--steps``, and
writes the final weights to OUT.pt. The batch of step s is drawn from a generator seeded with s (the
loader position is the step), dropout draws from the global RNG (restored from the checkpoint), and the
update has momentum (restored too): an interrupted-and-resumed run must end bit-identical to an
uninterrupted one. Importable: :func:`main` returns the final weights.

The update is a hand-written momentum SGD, called after ``ckpt.before_update()`` as a training loop
without ``torch.optim`` would: ``torch.optim`` imports ``torch._dynamo`` on first use, which would
double the start-up time of every killed process in the tests.
"""

from __future__ import annotations

import argparse
import sys

import torch

from hybridpar.checkpoint import Checkpointer, rng_state, set_rng_state


def main(argv: list[str] | None = None) -> dict[str, torch.Tensor]:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("out", nargs="?")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--overlap", action="store_true")
    ap.add_argument("--local", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(32, 1))
    params = dict(model.named_parameters())
    momentum = {n: torch.zeros_like(p) for n, p in params.items()}
    ckpt = Checkpointer(args.root, keep_last=2, local_dir=args.local, overlap_min_bytes=256)
    start = 0
    state = ckpt.load()
    if state is not None:
        model.load_state_dict(state["model"])
        for n, m in momentum.items():
            m.copy_(state["optimizer"]["momentum"][n])
        set_rng_state(state["rng"])
        start = state["step"] + 1
    for step in range(start, args.steps):
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(16, 8, generator=g)
        y = x.sum(dim=1, keepdim=True).sin()
        loss = torch.nn.functional.mse_loss(model(x), y)
        model.zero_grad()
        loss.backward()
        ckpt.before_update()  # with --overlap: wait for the copy of the last save, not for the disk
        with torch.no_grad():
            for n, p in params.items():
                momentum[n].mul_(0.9).add_(p.grad)
                p.sub_(0.05 * momentum[n])
        if (step + 1) % args.every == 0:
            ckpt.save(step, {"model": model.state_dict(), "optimizer": {"momentum": momentum},
                             "rng": rng_state(), "step": step},
                      {"metrics": {"loss": loss.item()}}, overlap=args.overlap)
    ckpt.close()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    if args.out:
        torch.save(weights, args.out)
    return weights


if __name__ == "__main__":
    main(sys.argv[1:])
