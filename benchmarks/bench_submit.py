"""Where a ``local_docker`` submit's time goes: every engine call of a submit, timed; prints JSON.

    bash scripts/engines/docker.sh        # engine + the local test images
    python benchmarks/bench_submit.py [--rounds 7]

Scenarios, each submitted ``--rounds`` times through ``AsyncRunner.run`` (after one warm-up):

- ``one_replica``: a one-container app (no network of its own: the default bridge);
- ``two_replicas``: two replicas (the app's own network; the other starts once rank 0 has joined it);
- ``cached_workspace``: one replica with an unchanged one-file workspace (its image exists).

For each: the submit's median total, and per call of the engine wrapper (``DockerEngine``'s
methods) how many were made per submit and their median duration and start (ms from the
submit's start; a second call in one submit is ``name #2``). ``engine_floor`` is what the engine
costs with nothing of asynctorchx around it: a container created and started with aiodocker on
the default bridge, on no network and on a user network, and a network created. Every
container, network and image made here is removed afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
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
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
IMAGE = "asynctorchx-test/python:3.11"
TIMED = (
    "image_id",
    "inspect_image",
    "list_containers",
    "volume_exists",
    "network_exists",
    "cpu_count",
    "create_network",
    "list_networks",
    "network_joins",
    "create_container",
    "start_container",
)


class CallLog:
    """Times the engine wrapper's calls (patched on the class: every instance is timed)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.calls: list[tuple[str, float, float]] = []

    def patch(self) -> None:
        from asynctorchx.schedulers._docker.engine import DockerEngine

        for name in TIMED:
            original = getattr(DockerEngine, name, None)
            if original is None:
                continue
            if name == "network_joins":  # a context manager: time its opening
                setattr(DockerEngine, name, self._timed_cm(name, original))
            else:
                setattr(DockerEngine, name, self._timed(name, original))

    def _timed(self, name: str, original: Any) -> Any:
        @functools.wraps(original)
        async def timed(engine: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            try:
                return await original(engine, *args, **kwargs)
            finally:
                self.calls.append((name, start - self.t0, time.monotonic() - self.t0))

        return timed

    def _timed_cm(self, name: str, original: Any) -> Any:
        log = self

        class Timed:
            def __init__(self, engine: Any, *args: Any) -> None:
                self.cm = original(engine, *args)

            async def __aenter__(self) -> Any:
                start = time.monotonic()
                try:
                    return await self.cm.__aenter__()
                finally:
                    log.calls.append((name + " (open)", start - log.t0, time.monotonic() - log.t0))

            async def __aexit__(self, *exc: Any) -> Any:
                return await self.cm.__aexit__(*exc)

        def timed(engine: Any, *args: Any) -> Timed:
            return Timed(engine, *args)

        return timed

    def reset(self) -> None:
        self.t0 = time.monotonic()
        self.calls = []


def _ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 1)


async def scenario(runner: Any, app: Any, log: CallLog, rounds: int, **kw: Any) -> dict[str, Any]:
    await runner.run(app, "local_docker", **kw)  # warm-up
    totals: list[float] = []
    per_call: dict[str, list[tuple[float, float]]] = defaultdict(list)
    counts: dict[str, int] = defaultdict(int)
    for _ in range(rounds):
        log.reset()
        await runner.run(app, "local_docker", **kw)
        totals.append(time.monotonic() - log.t0)
        seen: dict[str, int] = defaultdict(int)
        for name, start, end in sorted(log.calls, key=lambda c: c[1]):
            if start > totals[-1]:  # the reconciler's clean-ups of earlier apps run meanwhile
                continue
            seen[name] += 1
            key = name if seen[name] == 1 else f"{name} #{seen[name]}"
            per_call[key].append((start, end - start))
            counts[key] += 1
    return {
        "total_ms": {"median": _ms(totals), "min": _ms([min(totals)]), "max": _ms([max(totals)])},
        "calls": {
            name: {
                "per_submit": round(counts[name] / rounds, 2),
                "duration_ms": _ms([d for _, d in v]),
                "starts_at_ms": _ms([s for s, _ in v]),
            }
            for name, v in sorted(
                per_call.items(), key=lambda kv: statistics.median(s for s, _ in kv[1])
            )
        },
    }


async def engine_floor(rounds: int) -> dict[str, Any]:
    import aiodocker

    out: dict[str, Any] = {}
    async with aiodocker.Docker() as client:
        net_name = f"bench-submit-{uuid.uuid4().hex[:8]}"
        net = await client.networks.create({"Name": net_name})
        try:
            for mode in ("bridge", "none", net_name):
                creates, starts = [], []
                for _ in range(rounds):
                    t = time.monotonic()
                    c = await client.containers.create(
                        {"Image": IMAGE, "Cmd": ["true"], "HostConfig": {"NetworkMode": mode}}
                    )
                    t1 = time.monotonic()
                    try:
                        await c.start()
                        starts.append(time.monotonic() - t1)
                        creates.append(t1 - t)
                    finally:
                        await c.delete(force=True)
                key = "user_network" if mode == net_name else mode
                out[key] = {"create_ms": _ms(creates), "start_ms": _ms(starts)}
            made = []
            for _ in range(rounds):
                t = time.monotonic()
                n = await client.networks.create({"Name": f"{net_name}-{len(made)}"})
                made.append(time.monotonic() - t)
                await n.delete()
            out["network_create_ms"] = _ms(made)
        finally:
            await net.delete()
    return out


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE.parent))
    from bench_workspace import purge

    from asynctorchx.runner import AsyncRunner
    from asynctorchx.schedulers.docker import DockerScheduler
    from asynctorchx.specs import AppDef, Role

    log = CallLog()
    log.patch()
    session = f"bench-submit-{uuid.uuid4().hex[:8]}"
    sched = DockerScheduler(session)
    result: dict[str, Any] = {
        "benchmark": "docker_submit",
        "host": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load": os.getloadavg(),
        },
        "rounds": args.rounds,
    }
    workspace = Path(tempfile.mkdtemp(prefix="bench-submit-"))
    (workspace / "train.py").write_text("print('trained')\n")
    (workspace / ".nonce").write_text(uuid.uuid4().hex)  # an image of its own, removed after

    def app(n: int) -> AppDef:
        role = Role("trainer", image=IMAGE, entrypoint="python3", args=["train.py"], num_replicas=n)
        return AppDef("benchsubmit", [role])

    image = None
    try:
        async with AsyncRunner(
            name=session, scheduler_factories={"local_docker": lambda s, **_: sched}
        ) as runner:
            result["one_replica"] = await scenario(runner, app(1), log, args.rounds)
            result["two_replicas"] = await scenario(runner, app(2), log, args.rounds)
            result["cached_workspace"] = await scenario(
                runner, app(1), log, args.rounds, workspace=str(workspace)
            )
            image = runner.dryrun(app(1), "local_docker", workspace=str(workspace)).workspace
        result["engine_floor"] = await engine_floor(args.rounds)
    finally:
        await sched.close()
        await purge(session)
        shutil.rmtree(workspace, ignore_errors=True)
        subprocess.run(
            [
                "docker",
                "network",
                "prune",
                "-f",
                "--filter",
                f"label=asynctorchx.io/session={session}",
            ],
            capture_output=True,
            check=False,
        )
        if image is not None and image.target:
            subprocess.run(["docker", "rmi", image.target], capture_output=True, check=False)
    result["host"]["load_after"] = os.getloadavg()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
