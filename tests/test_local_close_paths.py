"""What the local scheduler leaves when things end at a bad moment: closing while a launch is
between two chunks of spawns or while spare record files are being made, and a replica that
cannot be registered with the watchdog (found by fault injection: each failed before its fix).
Real processes; gates or patched failures widen the windows."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from _local_env import wait_for
from test_local_reliability import kill_token_procs, token_procs

from asynctorchx.schedulers._local import spawn as spawn_module
from asynctorchx.schedulers._local.guard import Watchdog
from asynctorchx.schedulers._local.spares import SparePool
from asynctorchx.schedulers.local import LocalScheduler
from asynctorchx.specs import AppDef, AppState, Role

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def token() -> Iterator[str]:
    value = uuid.uuid4().hex
    yield value
    kill_token_procs(value)


def pipe_fds() -> dict[int, str]:
    """This process's pipe descriptors: ``{fd: "pipe:[inode]"}``."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("pipe:"):
            out[int(name)] = target
    return out


async def test_closing_during_a_launch_of_many_chunks_leaves_no_record_and_nothing_running(
    tmp_path: Path, token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``close()`` while a 40-replica launch is between two chunks of spawns: the submit fails,
    and neither a record of the app (the watchdog's "launcher died" one was left) nor a replica
    is left."""
    root = tmp_path / "root"
    s = LocalScheduler("chunks", local_root=root)
    closing: list[asyncio.Task[None]] = []
    spawned = 0
    real = spawn_module.spawn

    def spawn(*args: Any) -> Any:
        nonlocal spawned
        spawned += 1
        if spawned == 16:  # the first chunk's last spawn
            closing.append(asyncio.get_running_loop().create_task(s.close()))
        return real(*args)

    monkeypatch.setattr(spawn_module, "spawn", spawn)
    role = Role(
        "r", image=".", entrypoint="sleep", args=["100"], num_replicas=40, env={"ATX_TOKEN": token}
    )
    with pytest.raises(RuntimeError, match="closed"):
        await s.submit(AppDef("chunks", [role]), {})
    with anyio.fail_after(60):
        await closing[0]
    assert token_procs(token) == []
    assert [n for n in os.listdir(root / ".apps") if n.endswith(".json")] == []


async def test_spares_being_made_when_the_scheduler_closes_are_left_to_the_next_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk of spare record files being made in a worker thread when the scheduler closes:
    ``close()`` waits for it before it releases the pool, so the released pool holds them all and
    the next scheduler of this process on the same root takes them (none is stranded)."""
    root = tmp_path / "root"
    s = LocalScheduler("spares", local_root=root)
    await s._launcher.prepare()  # (its first spares are made before the first launch)
    entered, released = threading.Event(), threading.Event()
    order: list[str] = []
    real_fill, real_release = SparePool.fill_some, SparePool.release

    def fill_some(self: SparePool, *args: Any, **kwargs: Any) -> Any:
        entered.set()
        released.wait(1.0)  # a close that does not wait for this chunk releases the pool meanwhile
        try:
            return real_fill(self, *args, **kwargs)
        finally:
            order.append("filled")

    def release(self: SparePool) -> None:
        order.append("released")
        released.set()
        real_release(self)

    monkeypatch.setattr(SparePool, "fill_some", fill_some)
    monkeypatch.setattr(SparePool, "release", release)
    await s.submit(AppDef("sp", [Role("r", image=".", entrypoint="true")]), {})
    await anyio.to_thread.run_sync(entered.wait, 20)  # the lull's fill is in the thread
    with anyio.fail_after(30):
        await s.close()
    with anyio.fail_after(10):
        while "filled" not in order:
            await asyncio.sleep(0.01)
    monkeypatch.undo()
    assert order == ["filled", "released"]
    pool = s._runtime.store.spares
    assert len(pool) == 0
    on_disk = len(os.listdir(pool.directory))
    s2 = LocalScheduler("spares2", local_root=root)
    try:
        await s2._launcher.prepare()
        assert len(s2._runtime.store.spares) >= on_disk
    finally:
        await s2.close()


async def test_a_restart_that_cannot_register_with_the_watchdog_fails_and_leaks_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watchdog died and no new one can be started (no process can be forked) when a replica
    restarts: the restart fails the app with a message naming the watchdog, the replica it had
    spawned is stopped, and none of its pipes is left open."""
    s = LocalScheduler("nowatchdog", local_root=tmp_path / "root")
    try:
        role = Role(
            "r", image=".", entrypoint="sh", args=["-c", "sleep 0.5; exit 1"], max_retries=1
        )
        app_id = await s.submit(AppDef("nw", [role]), {})
        watchdog = s._runtime.watchdog
        before = {fd: t for fd, t in pipe_fds().items() if fd != watchdog._fd}

        def no_fork(self: Watchdog) -> None:
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

        monkeypatch.setattr(Watchdog, "_spawn", no_fork)
        assert watchdog.pid is not None
        os.kill(watchdog.pid, signal.SIGKILL)
        desc = await wait_for(s, app_id)
        assert desc.state == AppState.FAILED
        assert "watchdog" in desc.msg and "Resource temporarily unavailable" in desc.msg
        leaked = {fd: t for fd, t in pipe_fds().items() if before.get(fd) != t}
        assert leaked == {}
    finally:
        monkeypatch.undo()
        await s.close()
