"""Waiting on many Slurm apps: asynctorchx's one-status-round-per-tick vs TorchX's thread per app.

    bash scripts/engines/slurm.sh                     # the test cluster
    bash benchmarks/setup_torchx.sh                   # TorchX 0.7.0 in benchmarks/.venv-torchx
    python benchmarks/bench_slurm.py [--apps 50] [--torchx-wait-interval 1]

Both sides submit the same ``--apps`` single-replica apps to the real cluster; app ``i`` sleeps
``3 + (i % 10) * 0.5`` seconds, then writes the time it ended to a file (so the ends spread over ~5 s).

- asynctorchx: ``AsyncRunner.run`` for each app, then one task per app awaiting ``runner.wait``; every
  Slurm command goes through a counting wrapper of the real command runner.
- TorchX 0.7.0 (in its own virtual environment): ``Runner.run`` for each app, then one thread per app
  in ``Runner.wait(handle, wait_interval)``; ``squeue``/``sacct`` are counted by wrapper scripts put
  first on its PATH.

Per side the JSON has: the Slurm status commands run while waiting (``squeue``, ``sacct``) and per
minute, and the end-to-wake latency (from the moment an app's command ended to the moment its waiter
returned) as median/p90/max in ms. Apps must all succeed, or the run is reported as failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from asynctorchx.runner import AsyncRunner  # noqa: E402
from asynctorchx.schedulers.slurm import CommandResult, SubprocessRunner  # noqa: E402
from asynctorchx.specs.api import AppDef, AppState, Resource, Role  # noqa: E402

STATUS_COMMANDS = ("squeue", "sacct")


def sleep_seconds(i: int) -> float:
    return 3 + (i % 10) * 0.5


def app_script(i: int, out_dir: Path) -> str:
    return f"sleep {sleep_seconds(i)}; date +%s.%N > {out_dir}/end-{i}"


def summarize(latencies_ms: Sequence[float]) -> dict[str, float]:
    ordered = sorted(latencies_ms)
    return {
        "median": round(statistics.median(ordered), 1),
        "p90": round(ordered[int(0.9 * (len(ordered) - 1))], 1),
        "max": round(ordered[-1], 1),
    }


def latencies(out_dir: Path, wakes: dict[int, float]) -> list[float]:
    result = []
    for i, woke in wakes.items():
        ended = float((out_dir / f"end-{i}").read_text().strip())
        result.append((woke - ended) * 1000)
    return result


class CountingRunner:
    """The real command runner, counting each Slurm command by program name."""

    def __init__(self) -> None:
        self.inner = SubprocessRunner()
        self.counts: Counter[str] = Counter()

    async def __call__(self, argv: Sequence[str], *, stdin: str | None = None) -> CommandResult:
        self.counts[argv[0]] += 1
        return await self.inner(argv, stdin=stdin)


async def run_asynctorchx(n: int, work: Path) -> dict[str, Any]:
    out_dir = work / "asynctorchx"
    out_dir.mkdir()
    counter = CountingRunner()
    async with AsyncRunner("bench", slurm_runner=counter) as runner:
        apps = [
            AppDef(
                f"bench-{i}",
                [
                    Role(
                        "w",
                        "/tmp",
                        entrypoint="sh",
                        args=["-c", app_script(i, out_dir)],
                        resource=Resource(cpu=1, gpu=0, memMB=64),
                    )
                ],
            )
            for i in range(n)
        ]
        cfg = {"job_dir": str(out_dir)}
        handles = await asyncio.gather(*(runner.run(app, "slurm", cfg) for app in apps))
        before = Counter(counter.counts)
        wakes: dict[int, float] = {}
        states: dict[int, AppState | None] = {}

        async def waiter(i: int, handle: str) -> None:
            status = await runner.wait(handle, timeout=300)
            wakes[i] = time.time()
            states[i] = None if status is None else status.state

        started = time.monotonic()
        await asyncio.gather(*(waiter(i, h) for i, h in enumerate(handles)))
        waited = time.monotonic() - started
        rounds = runner.hub("slurm").rounds
    calls = {c: counter.counts[c] - before[c] for c in STATUS_COMMANDS}
    ok = all(s == AppState.SUCCEEDED for s in states.values())
    return {
        "succeeded": ok,
        "wait_seconds": round(waited, 2),
        "status_rounds": rounds,
        "calls": calls,
        "calls_per_minute": {c: round(v * 60 / waited, 1) for c, v in calls.items()},
        "end_to_wake_ms": summarize(latencies(out_dir, wakes)),
    }


TORCHX_WORKER = r"""
import json, sys, threading, time
from torchx.runner import get_runner
from torchx.specs import AppDef, Resource, Role

n, out_dir, wait_interval = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
def script(i):
    return f"sleep {3 + (i % 10) * 0.5}; date +%s.%N > {out_dir}/end-{i}"
runner = get_runner()
handles = []
for i in range(n):
    app = AppDef(f"bench-{i}", roles=[Role("w", image="/tmp", entrypoint="sh", args=["-c", script(i)],
                                            resource=Resource(cpu=1, gpu=0, memMB=64))])
    handles.append(runner.run(app, scheduler="slurm", cfg={}))
print(json.dumps({"event": "submitted", "t": time.monotonic()}), flush=True)
wakes, states = {}, {}
def wait(i, h):
    st = runner.wait(h, wait_interval=wait_interval)
    wakes[i] = time.time()
    states[i] = None if st is None else st.state.name
threads = [threading.Thread(target=wait, args=(i, h)) for i, h in enumerate(handles)]
start = time.monotonic()
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps({"event": "done", "wait_seconds": time.monotonic() - start, "wakes": wakes, "states": states}), flush=True)
"""


def run_torchx(n: int, work: Path, python: str, wait_interval: float) -> dict[str, Any]:
    out_dir = work / "torchx"
    out_dir.mkdir()
    shims = work / "shims"
    shims.mkdir()
    for cmd in STATUS_COMMANDS:
        real = subprocess.run(
            ["which", cmd], capture_output=True, text=True, check=True
        ).stdout.strip()
        shim = shims / cmd
        shim.write_text(f'#!/bin/sh\necho >> "{work}/count-{cmd}"\nexec {real} "$@"\n')
        shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{shims}:{os.environ['PATH']}"}
    proc = subprocess.Popen(
        [python, "-c", TORCHX_WORKER, str(n), str(out_dir), str(wait_interval)],
        cwd=out_dir,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    counts_at_submit: dict[str, int] = {}
    done: dict[str, Any] = {}
    for line in proc.stdout:
        event = json.loads(line)
        if event["event"] == "submitted":
            counts_at_submit = {c: _count(work, c) for c in STATUS_COMMANDS}
        elif event["event"] == "done":
            done = event
    if proc.wait() != 0 or not done:
        return {"succeeded": False, "error": f"the TorchX worker exited {proc.returncode}"}
    calls = {c: _count(work, c) - counts_at_submit.get(c, 0) for c in STATUS_COMMANDS}
    waited = done["wait_seconds"]
    wakes = {int(i): t for i, t in done["wakes"].items()}
    return {
        "succeeded": all(s == "SUCCEEDED" for s in done["states"].values()),
        "wait_interval": wait_interval,
        "wait_seconds": round(waited, 2),
        "calls": calls,
        "calls_per_minute": {c: round(v * 60 / waited, 1) for c, v in calls.items()},
        "end_to_wake_ms": summarize(latencies(out_dir, wakes)),
    }


def _count(work: Path, cmd: str) -> int:
    path = work / f"count-{cmd}"
    return len(path.read_text().splitlines()) if path.exists() else 0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--apps", type=int, default=50)
    parser.add_argument("--torchx-wait-interval", type=float, default=1.0)
    parser.add_argument("--torchx-python", default="")
    args = parser.parse_args()
    python = args.torchx_python
    if not python:
        for candidate in (
            HERE / ".venv-torchx" / "bin" / "python",
            Path("/tmp/torchx-venv/bin/python"),
        ):
            if candidate.exists():
                python = str(candidate)
                break
    with tempfile.TemporaryDirectory(prefix="bench-slurm-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)
        result: dict[str, Any] = {
            "apps": args.apps,
            "asynctorchx": asyncio.run(run_asynctorchx(args.apps, work)),
        }
        if python:
            result["torchx"] = run_torchx(args.apps, work, python, args.torchx_wait_interval)
        else:
            result["torchx"] = {
                "skipped": "TorchX 0.7.0 not installed (bash benchmarks/setup_torchx.sh)"
            }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
