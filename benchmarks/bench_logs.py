"""Benchmarks of asynctorchx.logs (the log files of local replicas); prints one JSON object.

Scenarios (real child processes writing to real pipes pumped by ReplicaLogWriter):

- ``read_finished``: iterate the 200 000 lines of a finished log with ``iter_log_lines`` (first read in
  this process, and the median of later reads); also with a ``since`` window (through the index);
  with each line's byte offset (``iter_log_entries``, what log cursors are made of), plus encoding
  every line's cursor as ``log_entries`` does; and the time to resume at the middle line's offset
  (to its first line).
- ``tail_latency_ms``: a child prints a time-stamped line every 100 ms +- 50 ms; latency from its
  write to the follower yielding the line, for a follower in the writing process (woken directly)
  and in a second process (woken through inotify).
- ``read_while_tailing``: follow a child printing 200 000 lines as fast as it can until it is done.
- ``index_error_ms``: recorded chunk time minus the child's own timestamp of the write.

Run: ``python benchmarks/bench_logs.py [--tail-lines 60]``. Targets (issue 3): read_finished <= 0.05 s,
tail latency median <= 10 ms and p95 <= 30 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

from asynctorchx.logs import INDEX_FILE, ReplicaLogWriter, Stream, iter_log_entries, iter_log_lines
from asynctorchx.logs._cursor import CursorEncoder
from asynctorchx.logs._files import INDEX_MAGIC, RECORD

LINES_SCRIPT = (
    "import sys\nn=int(sys.argv[1])\nw=sys.stdout.write\n"
    "for i in range(n): w(f'line {i:07d} ' + 'x'*40 + '\\n')\n"
)
TAIL_SCRIPT = (
    "import random, sys, time\n"
    "n = int(sys.argv[1]); random.seed(1)\n"
    "for i in range(n):\n"
    "    time.sleep(random.uniform(0.05, 0.15))\n"
    "    sys.stdout.write(f'ts={time.time():.6f} i={i}\\n'); sys.stdout.flush()\n"
)
REMOTE_FOLLOWER = """
import asyncio, json, pathlib, sys, time
from asynctorchx.logs import iter_log_lines
directory, done = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
async def finished():
    return done.exists()
async def main():
    lat = []
    print("ready", flush=True)
    async for line in iter_log_lines(directory, follow=True, is_finished=finished):
        now = time.time()
        if line.startswith("ts="):
            lat.append((now - float(line.split()[0][3:])) * 1000)
    print(json.dumps(lat), flush=True)
asyncio.run(main())
"""


def percentiles(values: list[float]) -> dict[str, float]:
    """median / p95 / max (and count) of ``values``, rounded."""
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {
        "n": len(values),
        "median": round(statistics.median(ordered), 3),
        "p95": round(p95, 3),
        "max": round(ordered[-1], 3),
    }


class Replica:
    """A child process with stdout/stderr pumped into ``directory`` by a ReplicaLogWriter."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.writer = ReplicaLogWriter(directory)
        self.proc: asyncio.subprocess.Process | None = None
        self.done = False

    async def start(self, code: str, *args: str) -> None:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", code, *args, stdout=out_w, stderr=err_w
            )
        finally:
            os.close(out_w)
            os.close(err_w)
        self.writer.attach(out_r, Stream.STDOUT)
        self.writer.attach(err_r, Stream.STDERR)

    async def finished(self) -> bool:
        return self.done

    async def wait(self) -> None:
        assert self.proc is not None
        await self.proc.wait()
        await self.writer.wait_drained()
        self.done = True
        self.writer.close()


async def read_finished(root: pathlib.Path, lines: int, repeats: int) -> dict[str, Any]:
    directory = root / "finished"
    replica = Replica(directory)
    await replica.start(LINES_SCRIPT, str(lines))
    await replica.wait()

    async def once(**kwargs: Any) -> tuple[float, float, int]:
        c0, t0 = time.process_time(), time.perf_counter()
        count = 0
        async for _ in iter_log_lines(directory, **kwargs):
            count += 1
        return time.perf_counter() - t0, time.process_time() - c0, count

    async def entries(encode: bool) -> tuple[float, int]:
        t0 = time.perf_counter()
        last = 0
        cursor = CursorEncoder("app", "role", 0, "combined", "file")  # as log_entries encodes
        async for offset, _ in iter_log_entries(directory):
            last = offset
            if encode:
                cursor(("combined", offset))
        return time.perf_counter() - t0, last

    async def resume(start: int) -> float:
        t0 = time.perf_counter()
        reader = iter_log_entries(directory, start=start)
        await anext(reader)
        elapsed = time.perf_counter() - t0
        await reader.aclose()
        return elapsed

    first, first_cpu, count = await once()
    assert count == lines, count
    runs = [await once() for _ in range(repeats)]
    since_runs = [await once(since=time.time() - 3600) for _ in range(repeats)]
    entry_runs = [await entries(False) for _ in range(repeats)]
    cursor_runs = [await entries(True) for _ in range(repeats)]
    middle = entry_runs[0][1] // 2
    async for offset, _ in iter_log_entries(directory):
        if offset >= middle:
            middle = offset
            break
    resumes = [await resume(middle) for _ in range(repeats)]
    return {
        "lines": count,
        "bytes": (directory / "combined.log").stat().st_size,
        "first_s": round(first, 4),
        "first_cpu_s": round(first_cpu, 4),
        "median_s": round(statistics.median(r[0] for r in runs), 4),
        "best_s": round(min(r[0] for r in runs), 4),
        "median_cpu_s": round(statistics.median(r[1] for r in runs), 4),
        "with_since_median_s": round(statistics.median(r[0] for r in since_runs), 4),
        "entries_median_s": round(statistics.median(r[0] for r in entry_runs), 4),
        "entries_with_cursors_median_s": round(statistics.median(r[0] for r in cursor_runs), 4),
        "resume_at_middle_ms": round(statistics.median(resumes) * 1000, 3),
    }


async def tail_latency(root: pathlib.Path, n: int) -> dict[str, Any]:
    directory = root / "tail"
    done = root / "tail.done"
    remote = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        REMOTE_FOLLOWER,
        str(directory),
        str(done),
        stdout=asyncio.subprocess.PIPE,
    )
    assert remote.stdout is not None
    assert await remote.stdout.readline() == b"ready\n"
    replica = Replica(directory)
    local: list[float] = []

    async def follow() -> None:
        async for line in iter_log_lines(directory, follow=True, is_finished=replica.finished):
            now = time.time()
            if line.startswith("ts="):
                local.append((now - float(line.split()[0][3:])) * 1000)

    task = asyncio.create_task(follow())
    await replica.start(TAIL_SCRIPT, str(n))
    await replica.wait()
    await task
    done.touch()
    out, _ = await remote.communicate()
    remote_lat = json.loads(out.decode().strip().splitlines()[-1])
    return {
        "writer_interval_ms": "100 +- 50",
        "same_process": percentiles(local),
        "other_process_inotify": percentiles(remote_lat),
    }


async def read_while_tailing(root: pathlib.Path, lines: int) -> dict[str, Any]:
    directory = root / "tailing"
    replica = Replica(directory)
    t0 = time.perf_counter()
    count = 0
    first_line_s = None

    async def follow() -> None:
        nonlocal count, first_line_s
        async for _ in iter_log_lines(directory, follow=True, is_finished=replica.finished):
            if first_line_s is None:
                first_line_s = time.perf_counter() - t0
            count += 1

    task = asyncio.create_task(follow())
    await replica.start(LINES_SCRIPT, str(lines))
    await replica.wait()
    child_done = time.perf_counter() - t0
    await task
    total = time.perf_counter() - t0
    assert count == lines, count
    return {
        "lines": count,
        "child_done_s": round(child_done, 4),
        "last_line_s": round(total, 4),
        "after_child_s": round(total - child_done, 4),
        "first_line_s": round(first_line_s or 0.0, 4),
    }


def index_error(root: pathlib.Path) -> dict[str, Any]:
    """Recorded chunk time minus the child's timestamp, for the tail scenario's lines (one per chunk)."""
    directory = root / "tail"
    data = (directory / INDEX_FILE).read_bytes()[len(INDEX_MAGIC) :]
    records = list(RECORD.iter_unpack(data))
    text = (directory / "stdout.log").read_bytes()
    errors = []
    for t, s_off, _c, length, stream in records:
        if stream != 0:
            continue
        line = text[s_off : s_off + length].split(b"\n", 1)[0]
        if line.startswith(b"ts="):
            errors.append((t / 1e9 - float(line.split()[0][3:])) * 1000)
    return percentiles(errors)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--tail-lines", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-logs-") as tmp:
        root = pathlib.Path(tmp)
        result: dict[str, Any] = {
            "python": sys.version.split()[0],
            "cpus": os.cpu_count(),
            "load_average_1m": os.getloadavg()[0],
        }
        result["read_finished"] = await read_finished(root, args.lines, args.repeats)
        result["tail_latency_ms"] = await tail_latency(root, args.tail_lines)
        result["index_error_ms"] = index_error(root)
        result["read_while_tailing"] = await read_while_tailing(root, args.lines)
        result["load_average_1m_after"] = os.getloadavg()[0]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
