"""Where the event loop's time goes during ``bench_sweep.py``: iteration lengths and callbacks.

    python benchmarks/profile_sweep_loop.py [--apps 1000] [--concurrency 100] [--root /dev/shm]

Runs the sweep of ``bench_sweep.py`` with the event loop instrumented: each iteration's length
(``_run_once``), and the time of each callback, labelled by what it runs (a task is labelled by the
innermost coroutines it resumes in). Prints one JSON object: the sweep's own results, the
iterations (count, median, p99, longest, share of the loop's time spent in iterations longer than
1, 5, 10, 20 and 50 ms) and the 25 costliest callback labels (total ms, calls). The instrumentation
slows the loop down (about 20 %): compare runs of this script with each other, not with
``bench_sweep.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from asyncio import base_events, events
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_sweep

ITERATIONS: list[float] = []
COST: collections.Counter[str] = collections.Counter()
CALLS: collections.Counter[str] = collections.Counter()


def _label(handle: events.Handle) -> str:
    callback = handle._callback  # type: ignore[attr-defined]
    task = getattr(callback, "__self__", None)
    if isinstance(task, asyncio.Task):
        names = []
        coro: Any = task.get_coro()
        while coro is not None and hasattr(coro, "__qualname__"):
            names.append(coro.__qualname__)
            coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
        return "task " + " > ".join(names[-3:])
    return getattr(callback, "__qualname__", type(callback).__name__)


def instrument() -> None:
    run_once = base_events.BaseEventLoop._run_once  # type: ignore[attr-defined]
    run_handle = events.Handle._run

    def timed_run_once(self: Any) -> None:
        started = time.perf_counter()
        run_once(self)
        ITERATIONS.append((time.perf_counter() - started) * 1000)

    def timed_run(self: events.Handle) -> None:
        label = _label(self)
        started = time.perf_counter()
        try:
            run_handle(self)
        finally:
            COST[label] += time.perf_counter() - started
            CALLS[label] += 1

    base_events.BaseEventLoop._run_once = timed_run_once  # type: ignore[attr-defined]
    events.Handle._run = timed_run  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--apps", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--root", help="parent of the state root (default: the temp dir)")
    args = parser.parse_args()
    instrument()
    parent = tempfile.mkdtemp(prefix="sweep-loop-", dir=args.root)
    try:
        sweep = asyncio.run(
            bench_sweep.sweep(args.apps, args.concurrency, 0.0, os.path.join(parent, "state"))
        )
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    lengths = sorted(ITERATIONS)
    total = sum(lengths)
    print(
        json.dumps(
            {
                "sweep": {k: sweep[k] for k in ("launches_per_s", "wake_latency_ms", "wall_s")},
                "iterations": {
                    "count": len(lengths),
                    "median_ms": statistics.median(lengths),
                    "p99_ms": lengths[int(len(lengths) * 0.99)],
                    "max_ms": lengths[-1],
                    "loop_busy_s": total / 1000,
                    "share_of_time_in_iterations_longer_than": {
                        f"{t}ms": sum(x for x in lengths if x > t) / total
                        for t in (1, 5, 10, 20, 50)
                    },
                },
                "top_callbacks": [
                    {"label": k, "total_ms": v * 1000, "calls": CALLS[k]}
                    for k, v in COST.most_common(25)
                ],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
