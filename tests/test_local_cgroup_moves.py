"""Moving a launched replica into its cgroup: on the event loop while the kernel's migration lock is
warm, else by a worker thread (the launch does not wait for the lock's grace period). Real processes
and real cgroups; the worker thread is held with a gate to make the window before the move wide."""

from __future__ import annotations

import asyncio
import os
import select
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from _local_env import wait_for
from conftest import engine_missing
from test_local_reliability import kill_token_procs, token_procs

from asynctorchx.schedulers._local import contain, protocol
from asynctorchx.schedulers._local.guard import CgroupMover, Containment, MoveJob, has_exited
from asynctorchx.schedulers.local import LocalScheduler
from asynctorchx.specs import AppDef, AppState, Role


@pytest.fixture
def token() -> Iterator[str]:
    value = uuid.uuid4().hex
    yield value
    kill_token_procs(value)


@pytest.fixture
def cgroups(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCTORCHX_LOCAL_CGROUPS", raising=False)
    base = contain.make_base()
    if base is None:
        engine_missing("a writable cgroup v2 hierarchy")
        return
    contain.remove_tree(base)


@pytest.fixture
def cold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every launch finds the migration lock cold: its moves go to the worker thread."""
    monkeypatch.setattr(Containment, "warm", property(lambda self: False))


@pytest.fixture
def held_moves(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[threading.Event, threading.Event]]:
    """(entered, release): the worker thread's moves wait for ``release`` once ``entered`` is set."""
    entered, release = threading.Event(), threading.Event()
    real = CgroupMover._move

    def move(self: CgroupMover, jobs: list[MoveJob]) -> None:
        if threading.current_thread() is not threading.main_thread():
            entered.set()
            release.wait(30)
        real(self, jobs)

    monkeypatch.setattr(CgroupMover, "_move", move)
    yield entered, release
    release.set()


@pytest.fixture
async def sched(tmp_path: Path, cgroups: None) -> AsyncIterator[LocalScheduler]:
    s = LocalScheduler("moves", local_root=tmp_path / "root")
    yield s
    await s.close()


def cgroup_procs(cgroup: str) -> set[int]:
    return {int(p) for p in Path(cgroup, "cgroup.procs").read_text().split()}


def app_of(script: str, token: str) -> AppDef:
    role = Role("main", image=".", entrypoint="sh", args=["-c", script], env={"ATX_TOKEN": token})
    return AppDef("mv", [role])


@pytest.mark.timeout(60)
async def test_a_cold_launch_returns_before_its_move_and_the_replica_is_moved_after(
    sched: LocalScheduler,
    token: str,
    cold: None,
    held_moves: tuple[threading.Event, threading.Event],
) -> None:
    """With the lock cold, ``schedule`` returns RUNNING while the worker thread has not moved the
    replica yet; once the thread goes on, the replica is in its app's cgroup."""
    entered, release = held_moves
    with anyio.fail_after(20):
        app_id = await sched.submit(app_of("exec sleep 30", token), {})
        await anyio.to_thread.run_sync(entered.wait)
    desc = await sched.describe(app_id)
    assert desc is not None and desc.state == AppState.RUNNING
    (pid,) = token_procs(token)
    cgroup = sched._runtime.contain.app_dir(app_id)
    assert cgroup is not None and pid not in cgroup_procs(cgroup)
    release.set()
    with anyio.fail_after(20):
        while pid not in cgroup_procs(cgroup):
            await asyncio.sleep(0.01)
    await sched.cancel(app_id)
    assert (await wait_for(sched, app_id)).state == AppState.CANCELLED
    assert token_procs(token) == []


@pytest.mark.timeout(60)
async def test_a_replica_that_exits_before_its_move_is_reaped_only_after_it(
    sched: LocalScheduler,
    token: str,
    cold: None,
    held_moves: tuple[threading.Event, threading.Event],
) -> None:
    """A replica that exits while its move waits stays unreaped (a zombie: its pid cannot be
    reused under the move) and the app stays RUNNING; once the move is done it is reaped, and the
    daemon it left before exiting is killed with its cgroup."""
    entered, release = held_moves
    script = "(setsid sleep 1000 </dev/null >/dev/null 2>&1 &); exit 0"
    with anyio.fail_after(20):
        app_id = await sched.submit(app_of(script, token), {})
        await anyio.to_thread.run_sync(entered.wait)
    replica_pid = sched._runtime.apps[app_id].replicas[0].pid
    assert replica_pid is not None
    with anyio.fail_after(20):
        while Path(f"/proc/{replica_pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z":
            await asyncio.sleep(0.01)
    assert len(token_procs(token)) == 1  # the daemon
    desc = await sched.describe(app_id)
    assert desc is not None and desc.state == AppState.RUNNING
    release.set()
    assert (await wait_for(sched, app_id)).state == AppState.SUCCEEDED
    assert not os.path.exists(f"/proc/{replica_pid}")
    assert token_procs(token) == []


@pytest.mark.timeout(60)
async def test_closing_while_moves_wait_leaves_nothing_running(
    tmp_path: Path,
    cgroups: None,
    token: str,
    cold: None,
    held_moves: tuple[threading.Event, threading.Event],
) -> None:
    """Closing the scheduler while a replica's move waits in the worker thread: close returns once
    everything is stopped, and nothing of the app (daemons included) survives."""
    entered, release = held_moves
    s = LocalScheduler("moves", local_root=tmp_path / "root")
    script = "(setsid sleep 1000 </dev/null >/dev/null 2>&1 &); exec sleep 1001"
    with anyio.fail_after(20):
        app_id = await s.submit(app_of(script, token), {})
        await anyio.to_thread.run_sync(entered.wait)
    closing = asyncio.create_task(s.close())
    await asyncio.sleep(0.1)
    release.set()
    with anyio.fail_after(40):
        await closing
    with anyio.fail_after(10):
        while token_procs(token):
            await asyncio.sleep(0.02)
    assert app_id


@pytest.mark.timeout(30)
def test_has_exited_tells_a_zombie_from_a_live_child_without_reaping_it() -> None:
    """``has_exited`` (the worker thread's check before a move) is False for a running child and
    for no pidfd, True once the child exited; the child stays a zombie for the loop to reap."""
    live = subprocess.Popen(["sleep", "30"])
    done = subprocess.Popen(["true"])
    live_fd, done_fd = os.pidfd_open(live.pid), os.pidfd_open(done.pid)
    try:
        assert not has_exited(live_fd)
        assert not has_exited(-1)
        deadline = time.monotonic() + 20
        while not has_exited(done_fd):
            assert time.monotonic() < deadline
            select.select([done_fd], [], [], 1)
        assert Path(f"/proc/{done.pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] == b"Z"
        assert done.wait(5) == 0  # not reaped by the check: the exit code is still there
    finally:
        live.kill()
        live.wait()
        os.close(live_fd)
        os.close(done_fd)


def _cmdline(pid: int) -> bytes:
    """The command line of ``pid``; empty once it is gone (the subshell that started a daemon
    exits right after: it was listed, then gone when its command line was read)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.timeout(60)
async def test_one_sweep_puts_each_replicas_early_daemon_in_that_replicas_cgroup(
    sched: LocalScheduler,
    token: str,
    cold: None,
    held_moves: tuple[threading.Event, threading.Event],
) -> None:
    """Three replicas moved in one batch, each of which left a daemon before its move: each daemon
    ends up in its own replica's cgroup, none in a sibling's (one sweep serves the batch)."""
    entered, release = held_moves
    role = Role(
        "main",
        image=".",
        entrypoint="sh",
        args=["-c", "(setsid sleep 1000 </dev/null >/dev/null 2>&1 &); exec sleep 1001"],
        env={"ATX_TOKEN": token},
        num_replicas=3,
    )
    with anyio.fail_after(20):
        app_id = await sched.submit(AppDef("mv", [role]), {})
        await anyio.to_thread.run_sync(entered.wait)
        while len(token_procs(token)) < 6:
            await asyncio.sleep(0.01)
    app_dir = sched._runtime.contain.app_dir(app_id)
    assert app_dir is not None
    release.set()
    daemons: dict[int, str | None] = {}
    with anyio.fail_after(20):
        while len(daemons) < 3:
            daemons = {
                pid: contain.marker_of(pid, protocol.MARKER_ENV_BYTES)
                for pid in token_procs(token)
                if _cmdline(pid).startswith(b"sleep\0" + b"1000")
            }
            await asyncio.sleep(0.01)
        for pid, marker in daemons.items():
            assert marker is not None
            index = int(marker.rsplit("/", 1)[1])
            want = os.path.join(app_dir, f"{index}.1")
            while pid not in cgroup_procs(want):
                await asyncio.sleep(0.01)
    await sched.cancel(app_id)
    with anyio.fail_after(20):
        await wait_for(sched, app_id)
        while token_procs(token):
            await asyncio.sleep(0.02)


def proc_state(pid: int) -> bytes | None:
    """The one-letter state of process ``pid`` (``b"Z"``: a zombie), None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


@pytest.mark.timeout(60)
async def test_a_replica_killed_during_its_move_is_reaped_only_after_the_move(
    sched: LocalScheduler, token: str, cold: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kill_now`` (an app's task that cannot go on) while the worker thread is inside a
    replica's move (past the check for cancelled moves): the replica is killed but stays a zombie,
    so that its pid cannot be freed and taken by another process before the thread writes it into
    the cgroup; once the thread is done it is reaped."""
    entered, release = threading.Event(), threading.Event()
    real = Containment.adopt_jobs

    def adopt_jobs(self: Containment, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            entered.set()
            release.wait(30)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Containment, "adopt_jobs", adopt_jobs)
    try:
        with anyio.fail_after(20):
            app_id = await sched.submit(app_of("exec sleep 100", token), {})
            await anyio.to_thread.run_sync(entered.wait)
        app = sched._runtime.apps[app_id]
        rep = app.replicas[0]
        assert rep.pid is not None
        sched._supervision.kill_now(app, "test: as abandon() does")
        with anyio.fail_after(10):
            while proc_state(rep.pid) != b"Z":
                await asyncio.sleep(0.01)
        assert rep.pidfd >= 0  # killed, not reaped: its pid is still taken
    finally:
        release.set()
    with anyio.fail_after(10):
        while rep.pidfd >= 0:
            await asyncio.sleep(0.01)
    assert proc_state(rep.pid) is None
    assert token_procs(token) == []
    app.wake.set()  # (its task, left waiting by this kill from outside, ends the app: close is quick)


@pytest.mark.timeout(90)
async def test_an_undone_launch_waits_for_the_exits_the_reaper_thread_is_reaping(
    sched: LocalScheduler, cold: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launch undone (its last replica cannot start) while its first replicas' exits, heard once
    their moves were done, are reaped by the exit reaper's thread: the undo waits for them (it
    does not close pidfds the thread is reaping), the reaper survives, and the next app whose
    replicas exit together ends."""
    from asynctorchx.schedulers._local import spawn as spawn_module
    from asynctorchx.schedulers._local.procs import LaunchError

    n = 40
    move_gates = [threading.Event(), threading.Event()]
    moves = 0
    real_move = CgroupMover._move

    def move(self: CgroupMover, jobs: list[MoveJob]) -> None:
        nonlocal moves
        if threading.current_thread() is not threading.main_thread():
            moves += 1
            move_gates[min(moves, 2) - 1].wait(30)
        real_move(self, jobs)

    reap_entered, reap_release = threading.Event(), threading.Event()
    real_reap = spawn_module.reap_batch

    def reap_batch(jobs: list[tuple[int, int, str | None]]) -> list[tuple[int | None, bool]]:
        if threading.current_thread() is not threading.main_thread():
            reap_entered.set()
            reap_release.wait(30)
        return real_reap(jobs)

    spawned = 0
    real_spawn = spawn_module.spawn

    def spawn(*args: Any) -> Any:
        nonlocal spawned
        spawned += 1
        if spawned == n:
            raise OSError(11, "Resource temporarily unavailable")
        return real_spawn(*args)

    monkeypatch.setattr(CgroupMover, "_move", move)
    monkeypatch.setattr(spawn_module, "reap_batch", reap_batch)
    monkeypatch.setattr(spawn_module, "spawn", spawn)
    try:
        app = AppDef("undo", [Role("r", image=".", entrypoint="true", num_replicas=n)])
        submit = asyncio.create_task(sched.submit(app, {}))
        with anyio.fail_after(20):
            while spawned < n:
                await asyncio.sleep(0.01)
        move_gates[0].set()  # the first chunk's moves: their exits are heard, most go to the thread
        await anyio.to_thread.run_sync(reap_entered.wait, 20)
        move_gates[1].set()  # the other moves: the undo goes on to kill and reap what is left
        await asyncio.sleep(0.1)
        reap_release.set()
        with anyio.fail_after(20), pytest.raises(LaunchError):
            await submit
    finally:
        for gate in (*move_gates, reap_release):
            gate.set()
    monkeypatch.undo()
    together = AppDef("next", [Role("r", image=".", entrypoint="true", num_replicas=8)])
    app_id = await sched.submit(together, {})
    assert (await wait_for(sched, app_id)).state == AppState.SUCCEEDED
