"""An async hyperparameter sweep: N trials, at most K at once, the worst stopped early.

    python examples/sweep.py --trials 12 --concurrency 4

Each trial runs ``examples/train_toy.py`` on the local scheduler and reports its metrics through the
tracker (``app_run_from_env().add_metadata(epoch=..., loss=...)``), never through its log. The driver

- has a run id of its own and launches every trial with it as ``parent_run_id``; the trials write to
  a file tracker under ``--tracker-root`` (a new temporary directory by default), configured as
  TorchX's launcher reads it (``TORCHX_TRACKERS`` / ``TORCHX_TRACKER_FSSPEC_CONFIG``; a
  ``.torchxconfig`` ``[torchx:tracker]`` section does the same),
- keeps at most ``--concurrency`` trials running and launches the next as soon as one finishes
  (``runner.as_completed`` over the running set),
- follows the metadata of all its trials with one ``AsyncTrackerReader.watch_metadata(
  parent_run_id=...)`` and cancels a trial whose loss at an epoch is worse than the median of what
  the finished trials had at that epoch (the median stopping rule),
- reads each finished trial's final loss and loss curve with ``reader.metadata(handle)``, and prints
  the best configurations.

``--json`` prints a machine-readable summary instead of the table. Afterwards,
``TORCHX_TRACKERS=fsspec TORCHX_TRACKER_FSSPEC_CONFIG=ROOT/tracker.conf asynctorchx tracker list runs
--parent-run-id DRIVER`` lists the trials (the summary gives both).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from asynctorchx import AsyncRunner
from asynctorchx.specs import AppDef, AppState, Role
from asynctorchx.tracker import AsyncTrackerReader, MetadataUpdate, UnknownRunError

TRAIN = Path(__file__).resolve().parent / "train_toy.py"


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


def use_tracker(root: Path) -> None:
    """Makes every app this process launches report to a file tracker under ``root``.

    TorchX's launcher reads ``TORCHX_TRACKERS`` and ``TORCHX_TRACKER_<NAME>_CONFIG`` from its own
    environment before ``.torchxconfig``; the runner passes them on to every role.
    """
    root.mkdir(parents=True, exist_ok=True)
    conf = root / "tracker.conf"
    conf.write_text(f"protocol=file\nroot_path={root}\n")
    os.environ["TORCHX_TRACKERS"] = "fsspec"
    os.environ["TORCHX_TRACKER_FSSPEC_CONFIG"] = str(conf)


async def follow_children(
    reader: AsyncTrackerReader,
    parent_run_id: str,
    on_update: Callable[[MetadataUpdate], Awaitable[None]],
) -> None:
    """Calls ``on_update`` for each metadata entry any child of ``parent_run_id`` records."""
    async with contextlib.aclosing(reader.watch_metadata(parent_run_id=parent_run_id)) as updates:
        async for update in updates:
            await on_update(update)


class Sweep:
    """Runs the trials on one AsyncRunner and follows them through one tracker reader."""

    def __init__(
        self,
        runner: AsyncRunner,
        reader: AsyncTrackerReader,
        trials: list[Trial],
        concurrency: int,
        epochs: int,
        epoch_seconds: float,
    ):
        self.runner = runner
        self.reader = reader
        self.run_id = f"sweep-{uuid.uuid4().hex[:12]}"
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

    async def on_metadata(self, update: MetadataUpdate) -> None:
        """Records a trial's loss at an epoch; cancels it when it falls far behind the median."""
        trial = self.by_handle.get(update.run_id)
        epoch, loss = update.entry.get("epoch"), update.entry.get("loss")
        if trial is None or trial.stopped_early or not isinstance(epoch, int):
            return
        if not isinstance(loss, (int, float)):
            return
        trial.losses[epoch] = float(loss)
        median = self.median_at(epoch)
        if epoch >= 2 and median is not None and loss > 10 * median:
            trial.stopped_early = True
            await self.runner.cancel(trial.handle)

    async def finished(self, trial: Trial) -> None:
        """Reads the final loss and the loss curve the trial recorded."""
        try:
            metadata = await self.reader.metadata(trial.handle)
        except UnknownRunError:
            return  # stopped before it reported anything
        final, curve = metadata.get("final_loss"), metadata.get("losses")
        if isinstance(final, (int, float)):
            trial.final_loss = float(final)
        if isinstance(curve, list):
            trial.losses = {i: float(x) for i, x in enumerate(curve)}

    async def run(self) -> None:
        queue = list(self.trials)
        running: set[str] = set()
        async with anyio.create_task_group() as tg:
            tg.start_soon(follow_children, self.reader, self.run_id, self.on_metadata)
            while queue or running:
                while queue and len(running) < self.concurrency:
                    trial = queue.pop(0)
                    trial.handle = await self.runner.run(
                        trial_app(trial, self.epochs, self.epoch_seconds),
                        "local_cwd",
                        parent_run_id=self.run_id,
                    )
                    trial.started = time.monotonic()
                    trial.state = "RUNNING"
                    self.by_handle[trial.handle] = trial
                    running.add(trial.handle)
                self.max_running = max(self.max_running, len(running))
                # the next trial to finish; the loop above then fills the freed slot
                async with contextlib.aclosing(self.runner.as_completed(running)) as finished:
                    async for handle, status in finished:
                        trial = self.by_handle[handle]
                        trial.ended = time.monotonic()
                        trial.state = status.state.name if status else AppState.UNKNOWN.name
                        running.discard(handle)
                        if trial.state == AppState.SUCCEEDED.name:
                            trial.stopped_early = False  # it ended before the cancel reached it
                            await self.finished(trial)
                        break
            tg.cancel_scope.cancel()

    def summary(self) -> dict[str, object]:
        finished = [t for t in self.trials if t.state == "SUCCEEDED" and t.final_loss is not None]
        best = sorted(
            finished, key=lambda t: t.final_loss if t.final_loss is not None else float("inf")
        )
        return {
            "driver_run_id": self.run_id,
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
    parser.add_argument(
        "--tracker-root",
        type=Path,
        default=None,
        help="where the trials' runs are recorded (default: a new temporary directory)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON summary")
    args = parser.parse_args(argv)
    if args.trials < 1 or args.concurrency < 1 or args.epochs < 1 or not args.epoch_seconds >= 0:
        parser.error(
            "--trials, --concurrency and --epochs must be at least 1, --epoch_seconds >= 0"
        )

    root = args.tracker_root or Path(tempfile.mkdtemp(prefix="sweep-runs-"))
    use_tracker(root)
    trials = [Trial(i, lr, mom) for i, (lr, mom) in enumerate(configs(args.trials))]
    async with AsyncRunner(name="sweep") as runner, AsyncTrackerReader.from_root(root) as reader:
        sweep = Sweep(runner, reader, trials, args.concurrency, args.epochs, args.epoch_seconds)
        await sweep.run()
    summary = sweep.summary()
    summary["tracker_root"] = str(root)
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
