"""A runner whose event loop ends without ``close()`` (``asyncio.run`` returning; a service or a
test that forgot it): its local apps are killed as the loop cancels their tasks, so they must be
recorded as ended, and what the runner held (its watchdog process, descriptors) must go once it is
collected, not at the process's exit.

Each case runs in a child interpreter, so that nothing else of the test session is counted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CHILD = textwrap.dedent(
    """
    import asyncio, gc, json, os, sys, time
    from asynctorchx import AsyncRunner, specs

    root, rounds = sys.argv[1], int(sys.argv[2])

    def fds():
        return sorted(os.listdir("/proc/self/fd"))

    def watchdogs():
        found = []
        for pid in os.listdir("/proc"):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read()
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if b"watchdog.py" in cmd and int(stat.rsplit(")", 1)[1].split()[2]) == os.getpid():
                if stat.rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(pid)
        return found

    def app(seconds):
        role = specs.Role("main", image=".", entrypoint="sleep", args=[seconds], num_replicas=2)
        return specs.AppDef("forgotten", [role])

    async def forget_to_close(i):
        runner = AsyncRunner(name=f"unclosed{i}", local_root=root)
        await runner.open()
        handles = [await runner.run(app(s), "local_cwd") for s in ("1", "1000")]
        await asyncio.sleep(0.3)
        return handles  # the loop ends here: the runner was never closed

    # what the first runner of a process sets up for the process (its reserve descriptor)
    async def closed_properly():
        async with AsyncRunner(name="warm", local_root=root) as runner:
            await runner.wait(await runner.run(app("0"), "local_cwd"))

    asyncio.run(closed_properly())
    before = fds()
    handles = [h for i in range(rounds) for h in asyncio.run(forget_to_close(i))]
    gc.collect()
    deadline = time.monotonic() + 10
    while watchdogs() and time.monotonic() < deadline:  # (they finish their work and exit)
        time.sleep(0.05)

    async def look():
        states = {}
        for h in handles:
            session = specs.parse_app_handle(h).session_name
            async with AsyncRunner(name=session, local_root=root) as runner:
                states[h] = (await runner.status(h)).state.name
        return states

    states = asyncio.run(look())
    gc.collect()
    print(json.dumps({
        "states": states,
        "leaked_fds": [os.readlink(f"/proc/self/fd/{fd}") for fd in fds() if fd not in before
                       and os.path.exists(f"/proc/self/fd/{fd}")],
        "watchdogs": watchdogs(),
    }))
    """
)


def run_child(root: Path, rounds: int) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(rounds)],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.splitlines()[-1])
    return result


@pytest.mark.timeout(120)
def test_apps_of_a_runner_whose_loop_ended_unclosed_are_recorded_ended(tmp_path: Path) -> None:
    """The replicas are killed when the loop cancels the apps' tasks: every other reader then
    sees the apps ended (they said RUNNING for as long as the launching process lived, and a
    cancel from another runner waited for ever)."""
    result = run_child(tmp_path / "state", 1)
    states = result["states"]
    assert isinstance(states, dict) and len(states) == 2
    assert set(states.values()) == {"CANCELLED"}, states
    cli = subprocess.run(
        [sys.executable, "-m", "asynctorchx", "status", *states],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "ASYNCTORCHX_LOCAL_ROOT": str(tmp_path / "state")},
    )
    assert "RUNNING" not in cli.stdout, cli.stdout


@pytest.mark.timeout(120)
def test_a_runner_whose_loop_ended_unclosed_leaves_no_watchdog_or_descriptor(
    tmp_path: Path,
) -> None:
    """Three loops ended with a runner unclosed: once collected, no descriptor of theirs is left
    open (each leaked its watchdog's pipe and pidfd, its inotify instance, its claims holder and
    its replicas' stdin: the loop itself was never collected) and no watchdog process is left."""
    result = run_child(tmp_path / "state", 3)
    assert result["leaked_fds"] == [], result
    assert result["watchdogs"] == [], result
