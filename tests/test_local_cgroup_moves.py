"""Moving a launched replica into its cgroup: on the event loop while the kernel's migration lock is
warm, else by a worker thread (the launch does not wait for the lock's grace period). Real processes
and real cgroups; the worker thread is held with a gate to make the window before the move wide."""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest
from _local_env import wait_for
from conftest import engine_missing
from test_local_reliability import kill_token_procs, token_procs

from asynctorchx.schedulers._local import contain
from asynctorchx.schedulers._local.guard import Containment
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
    real = Containment.adopt

    def adopt(self: Containment, *args: object, **kw: object) -> str | None:
        if threading.current_thread() is not threading.main_thread():
            entered.set()
            release.wait(30)
        return real(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Containment, "adopt", adopt)
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
