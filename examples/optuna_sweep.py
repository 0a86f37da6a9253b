"""An Optuna study driven by ask/tell on top of ``as_completed``: K trials at once, pruned as they run.

    pip install 'asynctorchx[examples]'        # Optuna
    python examples/optuna_sweep.py --trials 20 --concurrency 4

Each Optuna trial becomes an app running ``examples/train_toy.py`` on the local scheduler, with the
study's suggestions (``lr``, ``momentum``) as arguments and the driver's run id as ``parent_run_id``.
The driver

- asks the study for a new trial whenever a slot is free (``study.ask()``), and launches it;
- follows the metadata every running trial reports through the tracker (one
  ``AsyncTrackerReader.watch_metadata(parent_run_id=...)``), hands each epoch's loss to Optuna
  (``trial.report``) and cancels the app when Optuna's pruner says so (``trial.should_prune()``);
- takes the next finished app from ``runner.as_completed`` and tells the study its result: the final
  loss the trial recorded (``study.tell(trial, loss)``), PRUNED when it was cancelled by the pruner,
  FAIL otherwise.

Prints the best trial (``--json``: a JSON summary). Optuna's sampler is seeded (``--seed``), but
which trials run side by side, and so what the sampler has seen when it suggests, depends on timing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import anyio

from asynctorchx import AsyncRunner
from asynctorchx.specs import AppDef, AppState, Role
from asynctorchx.tracker import AsyncTrackerReader, MetadataUpdate, UnknownRunError

try:
    import optuna
except ImportError:  # pragma: no cover - the message is the point
    sys.exit("this example needs Optuna: pip install 'asynctorchx[examples]'")

# shared with the sibling example sweep.py
sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep import follow_children, use_tracker

TRAIN = Path(__file__).resolve().parent / "train_toy.py"


class OptunaDriver:
    """Runs an Optuna study's trials as apps, ``concurrency`` at a time."""

    def __init__(
        self,
        runner: AsyncRunner,
        reader: AsyncTrackerReader,
        study: optuna.Study,
        n_trials: int,
        concurrency: int,
        epochs: int,
        epoch_seconds: float,
    ) -> None:
        self.runner = runner
        self.reader = reader
        self.study = study
        self.n_trials = n_trials
        self.concurrency = concurrency
        self.epochs = epochs
        self.epoch_seconds = epoch_seconds
        self.run_id = f"optuna-{uuid.uuid4().hex[:12]}"
        self.trials: dict[str, optuna.trial.Trial] = {}
        self.pruned: set[str] = set()
        self.max_running = 0

    def app(self, trial: optuna.trial.Trial) -> AppDef:
        lr = trial.suggest_float("lr", 1e-3, 0.3, log=True)
        momentum = trial.suggest_float("momentum", 0.0, 0.95)
        args = ["-u", str(TRAIN), "--lr", repr(lr), "--momentum", repr(momentum)]
        args += ["--epochs", str(self.epochs), "--epoch_seconds", str(self.epoch_seconds)]
        args += ["--seed", str(trial.number)]
        return AppDef(
            f"optuna-{trial.number}",
            [Role("trainer", image=str(TRAIN.parent), entrypoint=sys.executable, args=args)],
        )

    async def on_metadata(self, update: MetadataUpdate) -> None:
        """Reports an epoch's loss to Optuna; cancels the app when the pruner says so."""
        trial = self.trials.get(update.run_id)
        epoch, loss = update.entry.get("epoch"), update.entry.get("loss")
        if trial is None or update.run_id in self.pruned or not isinstance(epoch, int):
            return
        if not isinstance(loss, (int, float)) or not math.isfinite(loss):
            loss = 1e30  # a diverged trial: the worst value Optuna can compare
        trial.report(float(loss), epoch)
        if trial.should_prune():
            self.pruned.add(update.run_id)
            await self.runner.cancel(update.run_id)

    async def result(self, handle: str) -> float | None:
        """The final loss the trial recorded, or None."""
        try:
            metadata = await self.reader.metadata(handle)
        except UnknownRunError:
            return None
        final = metadata.get("final_loss")
        return float(final) if isinstance(final, (int, float)) else None

    async def run(self) -> None:
        asked = 0
        running: set[str] = set()
        async with anyio.create_task_group() as tg:
            tg.start_soon(follow_children, self.reader, self.run_id, self.on_metadata)
            while asked < self.n_trials or running:
                while asked < self.n_trials and len(running) < self.concurrency:
                    trial = self.study.ask()
                    asked += 1
                    handle = await self.runner.run(
                        self.app(trial), "local_cwd", parent_run_id=self.run_id
                    )
                    self.trials[handle] = trial
                    running.add(handle)
                self.max_running = max(self.max_running, len(running))
                async with contextlib.aclosing(self.runner.as_completed(running)) as finished:
                    async for handle, status in finished:
                        running.discard(handle)
                        await self.tell(handle, status.state if status else AppState.UNKNOWN)
                        break
            tg.cancel_scope.cancel()

    async def tell(self, handle: str, state: AppState) -> None:
        trial = self.trials[handle]
        if handle in self.pruned:
            self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            return
        value = await self.result(handle) if state == AppState.SUCCEEDED else None
        if value is None or not math.isfinite(value):
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
        else:
            self.study.tell(trial, value)

    def summary(self) -> dict[str, Any]:
        trials = self.study.get_trials(deepcopy=False)
        complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
        best = self.study.best_trial if complete else None
        return {
            "driver_run_id": self.run_id,
            "trials": len(trials),
            "states": {
                s.name: sum(t.state == s for t in trials)
                for s in (
                    optuna.trial.TrialState.COMPLETE,
                    optuna.trial.TrialState.PRUNED,
                    optuna.trial.TrialState.FAIL,
                )
            },
            "handles": {h: t.number for h, t in self.trials.items()},
            "completed_values": [t.value for t in complete],
            "max_running": self.max_running,
            "best": None
            if best is None
            else {"number": best.number, "value": best.value, "params": best.params},
        }


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--epoch_seconds", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tracker-root", type=Path, default=None)
    parser.add_argument("--json", action="store_true", help="print a JSON summary")
    args = parser.parse_args(argv)
    if args.trials < 1 or args.concurrency < 1 or args.epochs < 1 or not args.epoch_seconds >= 0:
        parser.error(
            "--trials, --concurrency and --epochs must be at least 1, --epoch_seconds >= 0"
        )

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        direction="minimize",
        sampler=optuna.samplers.TPESampler(seed=args.seed),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=2),
    )
    root = args.tracker_root or Path(tempfile.mkdtemp(prefix="optuna-runs-"))
    use_tracker(root)
    async with AsyncRunner(name="optuna") as runner, AsyncTrackerReader.from_root(root) as reader:
        driver = OptunaDriver(
            runner, reader, study, args.trials, args.concurrency, args.epochs, args.epoch_seconds
        )
        await driver.run()
    summary = driver.summary()
    summary["tracker_root"] = str(root)
    if args.json:
        print(json.dumps(summary))
    elif summary["best"] is None:
        print("no trial completed")
        return 1
    else:
        best = summary["best"]
        print(f"{summary['states']} of {summary['trials']} trials")
        print(f"best: trial {best['number']} loss={best['value']:.4g} params={best['params']}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
