# ruff: noqa: F811 - the fixtures imported from _slurm_env are redefined as test parameters
"""slurm: a replica that ignores SIGTERM is stopped with its app, by a cancel or a sibling's failure.

Found by a review of "an app that reads ended has nothing of it running": the replica wrapper ran
the replica in the foreground without handling SIGTERM, so Slurm's SIGTERM (scancel, srun's
``--kill-on-bad-exit``) killed the wrapper and left the replica, reparented to init, outside the
step's process tracking (``proctrack/linuxproc`` follows parentage): Slurm's SIGKILL after
``KillWait`` (5 s on the test clusters) never reached it. The app read COMPLETING for as long as it
ran, for good. The wrapper now outlives the signal, waiting for its replica.

Each replica is ``trap '' TERM; sleep N & wait`` with a number N no other process uses, found in
``/proc``; the test SIGKILLs what is left at its end, well within Slurm's UnkillableStepTimeout
(60 s), so that no node is drained.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path

import pytest
from _slurm_env import (  # noqa: F401 - pytest fixtures, used as test parameters
    job_dir,
    sh_app,
    slurm,
    slurm_cluster,
    slurm_runner,
    slurm_session,
    wait_for_state,
)

from asynctorchx.schedulers.slurm import SlurmScheduler
from asynctorchx.specs import AppDef, AppState, is_terminal, macros

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(120)]

#: Seconds within which nothing of a stopped app may run: KillWait (5 s) and a margin.
BOUND = 20.0


def processes_running(token: str) -> list[int]:
    """The pids of the processes whose command line holds ``token``."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmd = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if token in cmd:
                found.append(int(name))
    return found


def kill_all(token: str) -> None:
    for pid in processes_running(token):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def stubborn(script: str) -> AppDef:
    """Two replicas (each its own het component) running ``script``."""
    return sh_app(script, "stubborn", replicas=2)


async def gone_and_ended(slurm_session: str, app_id: str, token: str) -> AppState:
    """Waits (at most ``BOUND`` s) until nothing of the app runs and another scheduler reads it
    ended; asserts that it never reads ended while something of it runs."""
    deadline = time.monotonic() + BOUND
    seen = []
    while True:
        reader = SlurmScheduler(slurm_session)
        try:
            d = await reader.describe(app_id)
        finally:
            await reader.close()
        assert d is not None
        left = processes_running(token)
        seen.append(d.state.name)
        assert not (is_terminal(d.state) and left), f"reads {d.state.name} while {left} run"
        if is_terminal(d.state) and not left:
            return d.state
        assert time.monotonic() < deadline, (
            f"{BOUND:g} s on, the app reads {d.state.name} ({d.msg}) and {left} still run "
            f"(read: {sorted(set(seen))})"
        )
        await asyncio.sleep(0.2)


async def test_a_cancel_stops_replicas_that_ignore_sigterm(
    slurm: SlurmScheduler, job_dir: Path, slurm_session: str
) -> None:
    """A plain cancel of an app whose two replicas ignore SIGTERM: within KillWait and a margin
    nothing of it runs and it reads CANCELLED (before: its replicas ran on, reading COMPLETING)."""
    token = f"sleep {500000 + random.randrange(100000)}"
    app = stubborn(f"trap '' TERM; {token} & {token} & wait")
    app_id = await slurm.schedule(slurm.submit_dryrun(app, {"job_dir": str(job_dir)}))
    try:
        deadline = time.monotonic() + 60
        while len(processes_running(token)) < 4:
            assert time.monotonic() < deadline, "the replicas did not start"
            await asyncio.sleep(0.1)
        await slurm.cancel(app_id)
        assert await gone_and_ended(slurm_session, app_id, token) == AppState.CANCELLED
    finally:
        kill_all(token)


async def test_a_failure_stops_a_sibling_that_ignores_sigterm(
    slurm: SlurmScheduler, job_dir: Path, slurm_session: str
) -> None:
    """Replica 0 fails (exit 3) while replica 1 ignores SIGTERM: srun's --kill-on-bad-exit stops
    replica 1 within KillWait and a margin, and the app reads FAILED with replica 0's exit code
    (before: replica 1 ran on and the app read RUNNING)."""
    token = f"sleep {600000 + random.randrange(100000)}"
    script = f"[ {macros.replica_id} = 0 ] && sleep 3 && exit 3; trap '' TERM; {token} & wait"
    app_id = await slurm.schedule(slurm.submit_dryrun(stubborn(script), {"job_dir": str(job_dir)}))
    try:
        await wait_for_state(slurm, app_id, {AppState.RUNNING})
        deadline = time.monotonic() + 60
        while not processes_running(token):
            assert time.monotonic() < deadline, "replica 1 did not start"
            await asyncio.sleep(0.1)
        assert await gone_and_ended(slurm_session, app_id, token) == AppState.FAILED
        d = await slurm.describe(app_id)
        assert d is not None
        assert d.roles_statuses[0].replicas[0].exit_code == 3, d
    finally:
        kill_all(token)
