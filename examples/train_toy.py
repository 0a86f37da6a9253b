"""A toy "training" script for the sweep example: gradient descent with momentum on a noisy quadratic.

It reports through the tracker (``asynctorchx.tracker.app_run_from_env()``, TorchX's API): one
``add_metadata(epoch=<i>, loss=<x>)`` per epoch, which the sweep drivers follow while it runs, and at
the end ``add_metadata(final_loss=<x>, losses=[...])``. It also prints ``epoch=<i> loss=<x>`` lines
and a ``RESULT loss=<x>`` line for people reading its log. Plain Python (the tracker's job side
imports no asyncio), so the example runs anywhere in a fraction of a second.
"""

from __future__ import annotations

import argparse
import random
import time

from asynctorchx.tracker import app_run_from_env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--epoch_seconds", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    run = app_run_from_env()
    run.add_metadata(lr=args.lr, momentum=args.momentum, seed=args.seed)
    rng = random.Random(args.seed)
    losses = []
    w, velocity, target = 5.0, 0.0, 1.0
    loss = (w - target) ** 2
    for epoch in range(args.epochs):
        for _ in range(20):
            grad = 2 * (w - target) + rng.gauss(0, 0.05)
            velocity = args.momentum * velocity - args.lr * grad
            w += velocity
        loss = (w - target) ** 2 if abs(w) < 1e100 else float("inf")
        losses.append(loss)
        print(f"epoch={epoch} loss={loss:.6g}", flush=True)
        run.add_metadata(epoch=epoch, loss=loss)
        time.sleep(args.epoch_seconds)
    run.add_metadata(final_loss=loss, losses=losses)
    print(f"RESULT loss={loss:.6g}", flush=True)


if __name__ == "__main__":
    main()
