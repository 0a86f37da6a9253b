"""Workspace benchmarks: submitting with a workspace of 1000 files / 50 MB; prints one JSON object.

    bash scripts/engines/docker.sh        # engine + the local test images
    bash scripts/engines/registry.sh      # the local registry (serves the base image to TorchX)
    bash benchmarks/setup_torchx.sh       # optional: TorchX 0.7.0 in benchmarks/.venv-torchx
    python benchmarks/bench_workspace.py [--files 1000] [--mb 50] [--rounds 5]

Scenarios:

- ``local_docker``: seconds from ``await runner.run(app, "local_docker", workspace=...)`` to its
  handle, for the first submit of a new workspace content (hash + build; ``--builds`` of them)
  and for the next ones (the image exists: only the hashing, helped by its stat cache, and the
  container), next to a submit without a workspace (the container alone: Docker's start of a
  container is most of it). During each first submit the event loop is watched three ways: a task
  sleeping 2 ms in a loop (its lateness is the loop's lag: max and p99), every callback the loop
  runs timed (wall clock and the loop thread's CPU time: the longest is the longest the loop was
  blocked by code), and a second, idle process sampling its own loop's lag at the same time (the
  machine's own stalls, on a shared 2-core machine). Targets: cached submit <= 10 % of TorchX's
  submit; no stall > 20 ms.
- ``torchx``: TorchX 0.7.0's ``Runner.run(app, "local_docker", workspace=...)`` to its handle, on
  the same workspace and base image, next to its submit without a workspace. TorchX pulls the
  base image before every build and rebuilds every time. No registry on the internet is reachable
  here, so the base image is served from the local registry (``scripts/engines/registry.sh``)
  under a registry name, and both tools use that name: TorchX's pull then succeeds as it would
  against a real registry holding the image (quickly: every layer is present), instead of failing
  on DNS. TorchX keeps Docker's layer cache on (it passes no ``nocache``), so its later builds
  reuse layers: what it repeats is the tar of the context on disk, its upload, the pull and the
  build steps. ``workspace_part`` is each tool's submit with a workspace minus without one.
- ``local_dir``: the submit of the same workspace on ``local_dir``: the first makes the snapshot
  (copies; reflinks where the file system has them), the next ones only link a directory to it;
  plus the snapshot's copy and the per-app links measured alone.

Everything made here (containers, images, the base image's registry tag) is removed afterwards;
what was pushed stays in the registry, which has a data directory of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TORCHX_PY = HERE / ".venv-torchx" / "bin" / "python"
BASE = "asynctorchx-test/python:3.11"
REGISTRY = os.environ.get("ASYNCTORCHX_REGISTRY", "127.0.0.1:5000")
TARGET_CACHED_RATIO = 0.10
TARGET_STALL_MS = 20.0

TORCHX_SCRIPT = r"""
import json, sys, time
from torchx.runner import get_runner
from torchx.specs import AppDef, Role
ws, base, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
runner = get_runner("bench")
def app():
    return AppDef("wsbench", roles=[Role("trainer", image=base, entrypoint="python3", args=["train.py"])])
runner.run(app(), "local_docker", cfg={})  # warm: client, first container
plain, times = [], []
for _ in range(rounds):
    t = time.monotonic()
    runner.run(app(), "local_docker", cfg={})
    plain.append(time.monotonic() - t)
for _ in range(rounds):
    t = time.monotonic()
    runner.run(app(), "local_docker", cfg={}, workspace=ws)
    times.append(time.monotonic() - t)
print(json.dumps({"submit_s": times, "plain_s": plain}))
"""


def make_workspace(root: Path, files: int, total_mb: int) -> Path:
    root.mkdir(parents=True)
    size = total_mb * 1_000_000 // files
    for i in range(files):
        d = root / f"pkg{i // 100}"
        d.mkdir(exist_ok=True)
        (d / f"f{i}.bin").write_bytes(os.urandom(size))
    (root / "train.py").write_text("print('trained')\n")
    (root / ".nonce").write_text(uuid.uuid4().hex)
    return root


def summary(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
        "n": len(values),
    }


class LoopProbe:
    """Times every callback the event loop runs (wall clock and the loop thread's CPU time): the
    longest one is the longest the loop was blocked by code, whatever the machine's load."""

    def __init__(self) -> None:
        self.max_wall = 0.0
        self.max_cpu = 0.0
        self.worst = ""
        self._orig: Any = None

    def __enter__(self) -> LoopProbe:
        import asyncio.events

        self._orig = orig = asyncio.events.Handle._run
        probe = self

        def timed(handle: Any) -> None:
            w, c = time.perf_counter(), time.thread_time()
            try:
                orig(handle)
            finally:
                wall, cpu = time.perf_counter() - w, time.thread_time() - c
                if cpu > probe.max_cpu:
                    probe.max_cpu, probe.worst = cpu, repr(handle)[:160]
                probe.max_wall = max(probe.max_wall, wall)

        asyncio.events.Handle._run = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        import asyncio.events

        asyncio.events.Handle._run = self._orig  # type: ignore[method-assign]


#: A second process watching its own event loop: how late a sleeping task wakes on this machine
#: at that moment (other load), to tell the machine's stalls from ours.
CONTROL_SAMPLER = r"""
import asyncio, signal, sys
worst = 0.0
async def main():
    global worst
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    while not stop.is_set():
        t = loop.time()
        await asyncio.sleep(0.002)
        worst = max(worst, loop.time() - t - 0.002)
    print(round(worst * 1000, 2), flush=True)
asyncio.run(main())
"""


class LagSampler:
    """Measures how late a task sleeping ``interval`` seconds wakes up: the event loop's stalls."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    @property
    def max_lag(self) -> float:
        return max(self.lags, default=0.0)

    @property
    def samples(self) -> int:
        return len(self.lags)

    def p99(self) -> float:
        lags = sorted(self.lags)
        return lags[int(len(lags) * 0.99)] if lags else 0.0

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(self.interval)
            self.lags.append(loop.time() - t - self.interval)

    def __enter__(self) -> LagSampler:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


async def serve_base_from_registry() -> str:
    """Pushes the base image to the local registry; returns its registry name (present locally)."""
    from asynctorchx.schedulers._docker.engine import DockerEngine

    name = f"{REGISTRY}/asynctorchx-bench/python"
    engine = DockerEngine()
    try:
        await engine.tag(BASE, name, "3.11")
        await engine.push(name, "3.11")
    finally:
        await engine.close()
    return f"{name}:3.11"


async def measured_build(runner: Any, app: Any, ws: Path) -> dict[str, Any]:
    """One first submit of a new workspace content, with the event loop watched three ways."""
    from asynctorchx.schedulers.workspace import clear_hash_cache

    (ws / ".nonce").write_text(uuid.uuid4().hex)  # new content: a new hash, a real build
    clear_hash_cache()
    control = subprocess.Popen(
        [sys.executable, "-c", CONTROL_SAMPLER], stdout=subprocess.PIPE, text=True
    )
    await asyncio.sleep(0.3)  # the control sampler is running
    with LagSampler() as lag, LoopProbe() as probe:
        t = time.monotonic()
        await runner.run(app, "local_docker", workspace=str(ws))
        took = time.monotonic() - t
    control.terminate()
    control_ms = float((await asyncio.to_thread(control.communicate))[0] or "nan")
    return {
        "submit_s": round(took, 4),
        "loop_max_stall_ms": round(lag.max_lag * 1000, 2),
        "loop_p99_stall_ms": round(lag.p99() * 1000, 2),
        "loop_samples": lag.samples,
        "longest_callback_wall_ms": round(probe.max_wall * 1000, 2),
        "longest_callback_cpu_ms": round(probe.max_cpu * 1000, 2),
        "longest_callback": probe.worst,
        "control_process_max_stall_ms": control_ms,
    }


async def bench_asynctorchx(ws: Path, base: str, rounds: int, builds: int) -> dict[str, Any]:
    from asynctorchx.runner import AsyncRunner
    from asynctorchx.schedulers.docker import DockerScheduler
    from asynctorchx.schedulers.workspace import clear_hash_cache
    from asynctorchx.specs import AppDef, Role

    session = f"wsbench-{uuid.uuid4().hex[:8]}"
    sched = DockerScheduler(session)
    app = AppDef("wsbench", [Role("trainer", image=base, entrypoint="python3", args=["train.py"])])
    out: dict[str, Any] = {}
    targets: list[str] = []
    ids: list[str | None] = []
    try:
        async with AsyncRunner(
            name=session, scheduler_factories={"local_docker": lambda s, **_: sched}
        ) as runner:
            await runner.run(app, "local_docker")  # warm: client, event stream, first container
            plain = []
            for _ in range(rounds):
                t = time.monotonic()
                await runner.run(app, "local_docker")
                plain.append(time.monotonic() - t)
            first = []
            for _ in range(builds):
                first.append(await measured_build(runner, app, ws))
                info = runner.dryrun(app, "local_docker", workspace=str(ws))
                targets.append(info.workspace.target)
            cached = []
            for _ in range(rounds):
                t = time.monotonic()
                await runner.run(app, "local_docker", workspace=str(ws))
                cached.append(time.monotonic() - t)
            clear_hash_cache()
            t = time.monotonic()
            info = runner.dryrun(app, "local_docker", workspace=str(ws))
            dryrun_cold = time.monotonic() - t
            t = time.monotonic()
            runner.dryrun(app, "local_docker", workspace=str(ws))
            dryrun_warm = time.monotonic() - t
            stalls = [b["loop_max_stall_ms"] for b in first]
            out = {
                "files": info.workspace.files,
                "bytes": info.workspace.total_bytes,
                "submit_without_workspace_s": summary(plain),
                "first_submit_s": summary([b["submit_s"] for b in first]),
                "cached_submit_s": summary(cached),
                "dryrun_cold_hash_s": round(dryrun_cold, 4),
                "dryrun_warm_hash_s": round(dryrun_warm, 4),
                "builds": sched.engine.builds,
                "loop_max_stall_ms": {"median": statistics.median(stalls), "max": max(stalls)},
                "measured_builds": first,
            }
            ids = [await sched.engine.image_id(t) for t in targets]
    finally:
        await sched.close()
        await purge(session)
    for image_id in ids:
        if image_id:
            subprocess.run(["docker", "rmi", "-f", image_id], capture_output=True, check=False)
    return out


async def purge(session: str) -> None:
    import aiodocker

    from asynctorchx.schedulers._docker.request import LABEL_SESSION

    async with aiodocker.Docker() as client:
        label = json.dumps({"label": [f"{LABEL_SESSION}={session}"]})
        for c in await client.containers.list(all=True, filters=label):
            await c.delete(force=True)


def bench_torchx(ws: Path, base: str, rounds: int, python: Path) -> dict[str, Any] | None:
    if not python.exists():
        return None
    before = set(_images("torchx.pytorch.org/version"))
    proc = subprocess.run(
        [str(python), "-c", TORCHX_SCRIPT, str(ws), base, str(rounds)],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=tempfile.gettempdir(),
    )
    try:
        if proc.returncode != 0:
            return {"error": proc.stderr.strip().splitlines()[-5:]}
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        pulls = proc.stderr.count("failed to pull image")
        return {
            "submit_s": summary(result["submit_s"]),
            "first_submit_s": round(result["submit_s"][0], 4),
            "submit_without_workspace_s": summary(result["plain_s"]),
            "base_pull_failures": pulls,
        }
    finally:
        ids = subprocess.run(
            ["docker", "ps", "-aq", "--filter", "label=torchx.pytorch.org/app-id"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.split()
        if ids:
            subprocess.run(["docker", "rm", "-f", *ids], capture_output=True, check=False)
        made = set(_images("torchx.pytorch.org/version")) - before
        if made:
            subprocess.run(["docker", "rmi", "-f", *made], capture_output=True, check=False)


def _images(label: str) -> list[str]:
    out = subprocess.run(
        ["docker", "images", "-q", "--no-trunc", "--filter", f"label={label}"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.split()


async def bench_local_dir(ws: Path, rounds: int) -> dict[str, Any]:
    from asynctorchx.runner import AsyncRunner
    from asynctorchx.schedulers.workspace import (
        TORCHXIGNORE,
        copy_scan,
        link_tree,
        scan_workspace,
        snapshot,
    )
    from asynctorchx.specs import AppDef, Role, Workspace

    root = Path(tempfile.mkdtemp(prefix="wsbench-local-"))
    try:
        scan = scan_workspace(Workspace({str(ws): ""}), TORCHXIGNORE)
        (root / "copy").mkdir()
        t = time.monotonic()
        counts = copy_scan(scan, str(root / "copy"))
        copy_s = time.monotonic() - t
        path, _ = snapshot(scan, str(root / "alone"), scan.digest, read_only=True)
        links = []
        for i in range(rounds):
            t = time.monotonic()
            link_tree(path, str(root / f"links{i}"))
            links.append(time.monotonic() - t)
        app = AppDef("wsbench", [Role("trainer", image="/tmp", entrypoint="true")])
        async with AsyncRunner(name="wsbench", local_root=str(root / "state")) as runner:
            t = time.monotonic()
            first = await runner.run(app, "local_dir", workspace=str(ws))
            first_s = time.monotonic() - t
            later = []
            handles = [first]
            for _ in range(rounds):
                t = time.monotonic()
                handles.append(await runner.run(app, "local_dir", workspace=str(ws)))
                later.append(time.monotonic() - t)
            await runner.wait_all(handles, timeout=120)
        return {
            "snapshot_copy_s": round(copy_s, 4),
            "files_cloned": counts["cloned"],
            "files_copied": counts["copied"],
            "per_app_links_s": summary(links),
            "first_submit_s": round(first_s, 4),
            "later_submit_s": summary(later),
            "filesystem": _fstype(root),
        }
    finally:
        for p in root.rglob("*"):
            if p.is_file() and not p.is_symlink():
                p.chmod(0o644)
        shutil.rmtree(root, ignore_errors=True)


def _fstype(path: Path) -> str:
    out = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True)
    return out.stdout.strip()


def bench_reflink(directory: Path, files: int, total_mb: int) -> dict[str, Any]:
    """The snapshot copy of the same workspace on a file system with reflinks (FICLONE): the
    workspace and the copy both under ``directory``."""
    from asynctorchx.schedulers.workspace import TORCHXIGNORE, copy_scan, scan_workspace
    from asynctorchx.specs import Workspace

    root = Path(tempfile.mkdtemp(prefix="wsbench-reflink-", dir=directory))
    try:
        ws = make_workspace(root / "ws", files, total_mb)
        scan = scan_workspace(Workspace({str(ws): ""}), TORCHXIGNORE)
        (root / "copy").mkdir()
        t = time.monotonic()
        counts = copy_scan(scan, str(root / "copy"))
        took = time.monotonic() - t
        return {
            "snapshot_copy_s": round(took, 4),
            "files_cloned": counts["cloned"],
            "files_copied": counts["copied"],
            "filesystem": _fstype(root),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--mb", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--builds", type=int, default=3, help="first submits measured")
    parser.add_argument("--torchx-python", default=str(TORCHX_PY), help="TorchX 0.7's python")
    parser.add_argument(
        "--reflink-dir",
        default=None,
        help="a directory on a file system with reflinks (XFS with reflink=1, btrfs): the "
        "snapshot copy is measured there too",
    )
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="wsbench-"))
    try:
        ws = make_workspace(tmp / "ws", args.files, args.mb)
        base = await serve_base_from_registry()
        ours = await bench_asynctorchx(ws, base, args.rounds, args.builds)
        theirs = await asyncio.to_thread(
            bench_torchx, ws, base, args.rounds, Path(args.torchx_python)
        )
        local = await bench_local_dir(ws, args.rounds)
        if args.reflink_dir:
            local["on_reflink_fs"] = bench_reflink(Path(args.reflink_dir), args.files, args.mb)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        # the registry name was only a second tag of the base image: untag it
        subprocess.run(
            ["docker", "rmi", f"{REGISTRY}/asynctorchx-bench/python:3.11"],
            capture_output=True,
            check=False,
        )
    result: dict[str, Any] = {
        "benchmark": "workspace",
        "host": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "workspace": {"files": args.files + 2, "mb": args.mb},
        "base_image": base,
        "local_docker": ours,
        "torchx_local_docker": theirs,
        "local_dir": local,
    }
    cached = ours["cached_submit_s"]["median"]
    if theirs and "submit_s" in theirs:
        ratio = cached / theirs["submit_s"]["median"]
        ours_extra = cached - ours["submit_without_workspace_s"]["median"]
        theirs_extra = theirs["submit_s"]["median"] - theirs["submit_without_workspace_s"]["median"]
        result["cached_vs_torchx"] = {
            "ratio": round(ratio, 4),
            "target": TARGET_CACHED_RATIO,
            "met": ratio <= TARGET_CACHED_RATIO,
            "workspace_part_s": {
                "asynctorchx": round(ours_extra, 4),
                "torchx": round(theirs_extra, 4),
            },
            "workspace_part_ratio": round(max(ours_extra, 0.0) / theirs_extra, 4)
            if theirs_extra > 0
            else None,
        }
    builds = ours["measured_builds"]
    stall = ours["loop_max_stall_ms"]["median"]
    result["loop_stall"] = {
        "median_of_max_ms": stall,
        "max_p99_ms": max(b["loop_p99_stall_ms"] for b in builds),
        "longest_callback_cpu_ms": max(b["longest_callback_cpu_ms"] for b in builds),
        "longest_callback_wall_ms": max(b["longest_callback_wall_ms"] for b in builds),
        "control_process_median_of_max_ms": statistics.median(
            b["control_process_max_stall_ms"] for b in builds
        ),
        "target_ms": TARGET_STALL_MS,
        "met": stall <= TARGET_STALL_MS,
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
