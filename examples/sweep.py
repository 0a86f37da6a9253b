"""An async hyperparameter sweep: N trials, at most K at once, the worst stopped early.

    python examples/sweep.py --trials 12 --concurrency 4

Each trial runs ``examples/train_toy.py`` on the local scheduler. The driver

- keeps at most ``--concurrency`` trials running and launches the next as soon as one finishes
  (``runner.as_completed`` over the running set),
- follows every running trial's log (``runner.log_lines(..., should_tail=True)``) and cancels a trial
  whose loss at an epoch is worse than the median of what the finished trials had at that epoch
  (the median stopping rule),
- reads each finished trial's final ``RESULT`` line from its log, and prints the best configurations.

``--json`` prints a machine-readable summary instead of the table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from asynctorchx import AsyncRunner
from asynctorchx.specs import AppDef, AppState, Role

TRAIN = Path(__file__).resolve().parent / "train_toy.py"
LOSS_LINE = re.compile(r"epoch=(\d+) loss=([0-9.eE+-]+|nan|inf)")
RESULT_LINE = re.compile(r"RESULT loss=([0-9.eE+-]+|nan|inf)")


@dataclass
class Trial:
    """One configuration and what became of it."""

    index: int
    lr: float
    momentum: float
    handle: str = ""
    losses: dict[int, float] = field(default_factory=dict)
    final_loss: float | None = None
    state: str = "PENDING"
    started: float = 0.0
    ended: float = 0.0
    stopped_early: bool = False


def configs(n: int, seed: int = 0) -> list[tuple[float, float]]:
    """``n`` (lr, momentum) pairs from a grid, in a shuffled but fixed order (``seed``)."""
    grid = list(itertools.product([0.001, 0.003, 0.01, 0.03, 0.1, 0.3], [0.0, 0.5, 0.9]))
    random.Random(seed).shuffle(grid)
    return list(itertools.islice(itertools.cycle(grid), n))


def trial_app(trial: Trial, epochs: int, epoch_seconds: float) -> AppDef:
    args = ["-u", str(TRAIN), "--lr", str(trial.lr), "--momentum", str(trial.momentum)]
    args += [
        "--epochs",
        str(epochs),
        "--epoch_seconds",
        str(epoch_seconds),
        "--seed",
        str(trial.index),
    ]
    return AppDef(
        name=f"trial-{trial.index}",
        roles=[Role(name="trainer", image=str(TRAIN.parent), entrypoint=sys.executable, args=args)],
    )


class Sweep:
    """Runs the trials on one AsyncRunner."""

    def __init__(
        self,
        runner: AsyncRunner,
        trials: list[Trial],
        concurrency: int,
        epochs: int,
        epoch_seconds: float,
    ):
        self.runner = runner
        self.trials = trials
        self.concurrency = concurrency
        self.epochs = epochs
        self.epoch_seconds = epoch_seconds
        self.by_handle: dict[str, Trial] = {}
        self.max_running = 0

    def median_at(self, epoch: int) -> float | None:
        done = [
            t.losses[epoch] for t in self.trials if t.state == "SUCCEEDED" and epoch in t.losses
        ]
        return statistics.median(done) if len(done) >= 3 else None

    async def follow(self, trial: Trial) -> None:
        """Reads the trial's losses as it prints them; cancels it when it falls behind the median."""
        async for line in self.runner.log_lines(trial.handle, "trainer", should_tail=True):
            m = LOSS_LINE.search(line)
            if m:
                epoch, loss = int(m.group(1)), float(m.group(2))
                trial.losses[epoch] = loss
                median = self.median_at(epoch)
                if epoch >= 2 and median is not None and loss > 10 * median:
                    trial.stopped_early = True
                    await self.runner.cancel(trial.handle)
                    return
            elif r := RESULT_LINE.search(line):
                trial.final_loss = float(r.group(1))

    async def run(self) -> None:
        queue = list(self.trials)
        running: set[str] = set()
        async with anyio.create_task_group() as followers:
            while queue or running:
                while queue and len(running) < self.concurrency:
                    trial = queue.pop(0)
                    trial.handle = await self.runner.run(
                        trial_app(trial, self.epochs, self.epoch_seconds), "local_cwd"
                    )
                    trial.started = time.monotonic()
                    trial.state = "RUNNING"
                    self.by_handle[trial.handle] = trial
                    running.add(trial.handle)
                    followers.start_soon(self.follow, trial)
                self.max_running = max(self.max_running, len(running))
                # the next trial to finish; the loop above then fills the freed slot
                async with contextlib.aclosing(self.runner.as_completed(running)) as finished:
                    async for handle, status in finished:
                        trial = self.by_handle[handle]
                        trial.ended = time.monotonic()
                        trial.state = status.state.name if status else AppState.UNKNOWN.name
                        running.discard(handle)
                        break

    def summary(self) -> dict[str, object]:
        finished = [t for t in self.trials if t.state == "SUCCEEDED" and t.final_loss is not None]
        best = sorted(
            finished, key=lambda t: t.final_loss if t.final_loss is not None else float("inf")
        )
        return {
            "trials": len(self.trials),
            "succeeded": len(finished),
            "stopped_early": sum(t.stopped_early for t in self.trials),
            "states": {t.handle: t.state for t in self.trials},
            "concurrency_limit": self.concurrency,
            "max_running": self.max_running,
            "max_overlap": max_overlap(self.trials),
            "best": [{"lr": t.lr, "momentum": t.momentum, "loss": t.final_loss} for t in best[:5]],
        }


def max_overlap(trials: list[Trial]) -> int:
    """The most trials that were running at the same moment (from launch and completion times)."""
    events = sorted([(t.started, 1) for t in trials] + [(t.ended, -1) for t in trials])
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--epoch_seconds", type=float, default=0.05)
    parser.add_argument("--json", action="store_true", help="print a JSON summary")
    args = parser.parse_args(argv)

    trials = [Trial(i, lr, mom) for i, (lr, mom) in enumerate(configs(args.trials))]
    async with AsyncRunner(name="sweep") as runner:
        sweep = Sweep(runner, trials, args.concurrency, args.epochs, args.epoch_seconds)
        await sweep.run()
    summary = sweep.summary()
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"{summary['succeeded']} of {len(trials)} trials finished, {summary['stopped_early']} stopped early"
        )
        print(f"{'lr':>8} {'momentum':>9} {'final loss':>12}")
        for row in summary["best"]:  # type: ignore[attr-defined]
            print(f"{row['lr']:>8} {row['momentum']:>9} {row['loss']:>12.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
