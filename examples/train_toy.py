"""A toy "training" script for the sweep example: gradient descent with momentum on a noisy quadratic.

It prints one ``epoch=<i> loss=<x>`` line per epoch (what the sweep driver reads while it runs) and a
final ``RESULT loss=<x>`` line. Plain Python, so the example runs anywhere in a fraction of a second.
"""

from __future__ import annotations

import argparse
import random
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--epoch_seconds", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    w, velocity, target = 5.0, 0.0, 1.0
    loss = (w - target) ** 2
    for epoch in range(args.epochs):
        for _ in range(20):
            grad = 2 * (w - target) + rng.gauss(0, 0.05)
            velocity = args.momentum * velocity - args.lr * grad
            w += velocity
        loss = (w - target) ** 2
        print(f"epoch={epoch} loss={loss:.6g}", flush=True)
        time.sleep(args.epoch_seconds)
    print(f"RESULT loss={loss:.6g}", flush=True)


if __name__ == "__main__":
    main()
