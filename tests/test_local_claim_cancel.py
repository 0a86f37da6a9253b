"""A local app whose id is claimed but which has no record yet (a long ``local_dir`` ship, say) is
known to every process: ``status``/``describe`` say PENDING ("being submitted"), ``list`` shows
it, and a cancel, from the CLI, another scheduler or the launching one, leaves it CANCELLED with
nothing started. A claim whose launcher and watchdog are gone is not shown as pending."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import anyio
import pytest
from _local_env import wait_for
from test_local_claim import STALE, _counting_app, _leave_stale_claim, _stale_dryrun

from asynctorchx.schedulers._local import contain, protocol, recordfile
from asynctorchx.schedulers._local.launch import AppLauncher
from asynctorchx.schedulers.local import LocalScheduler
from asynctorchx.specs import AppDef, AppState, Role

REPO = Path(__file__).resolve().parent.parent


class Gate:
    """Holds every launch of claimed apps back (``AppLauncher.launch``) until ``go`` is set, as a
    long workspace ship does; ``entered`` is set once one waits."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.go = asyncio.Event()

    def around(
        self, real: Callable[[AppLauncher, Any], Coroutine[Any, Any, None]]
    ) -> Callable[[AppLauncher, Any], Coroutine[Any, Any, None]]:
        async def launch(launcher: AppLauncher, app: Any) -> None:
            self.entered.set()
            await self.go.wait()
            await real(launcher, app)

        return launch


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Gate:
    g = Gate()
    monkeypatch.setattr(AppLauncher, "launch", g.around(AppLauncher.launch))
    return g


@contextlib.asynccontextmanager
async def claimed(
    s: LocalScheduler, gate: Gate, started: Path, go: Path
) -> AsyncIterator[tuple[str, asyncio.Task[str]]]:
    """Schedules a counting app (its image: the directory of ``started``) and yields once its id
    is claimed and its launch held back: its id and the task of its ``schedule`` (which goes on
    once ``gate.go`` is set)."""
    app = _counting_app(started, go)
    app.roles[0].image = str(started.parent)
    info = s.submit_dryrun(app, {})
    task = asyncio.ensure_future(s.schedule(info))
    try:
        with anyio.fail_after(20):
            await gate.entered.wait()
        yield info.request.app_id, task
    finally:
        gate.go.set()
        go.touch()
        with anyio.fail_after(20):
            await asyncio.wait([task])


def _cli(root: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """The real CLI (its fast path on: no config file) on the state root ``root``."""
    env = {
        **os.environ,
        "ASYNCTORCHX_LOCAL_ROOT": str(root),
        "TORCHXCONFIG": "",
        "PYTHONPATH": str(REPO),
        "NO_COLOR": "1",
    }
    env.pop("ASYNCTORCHX_CLI_FASTPATH", None)
    return subprocess.run(
        [sys.executable, "-m", "asynctorchx", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=40,
    )


def _marked(app_id: str) -> list[int]:
    prefix = protocol.app_marker_prefix(app_id)
    return [p for p, _, _ in contain.live_processes(protocol.MARKER_ENV_BYTES, [prefix])]


@pytest.mark.timeout(90)
async def test_the_cli_sees_a_claimed_app_pending_and_its_cancel_leaves_it_cancelled(
    tmp_path: Path, gate: Gate
) -> None:
    """While an app is claimed but not started, ``asynctorchx status`` says PENDING ("being
    submitted"), ``list`` shows it and ``cancel`` is accepted; the app then ends CANCELLED
    ("cancelled by another process") and none of its replicas ever starts."""
    root, started, go = tmp_path / "root", tmp_path / "started", tmp_path / "go"
    async with LocalScheduler("claimed", local_root=root) as s:
        async with claimed(s, gate, started, go) as (app_id, task):
            handle = f"local_cwd://claimed/{app_id}"
            status = await anyio.to_thread.run_sync(_cli, root, "status", handle)
            assert status.returncode == 0, status.stderr
            assert "PENDING" in status.stdout and "being submitted" in status.stdout
            listed = await anyio.to_thread.run_sync(_cli, root, "list", "-s", "local_cwd")
            assert listed.returncode == 0, listed.stderr
            assert handle in listed.stdout and "PENDING" in listed.stdout
            cancel = await anyio.to_thread.run_sync(_cli, root, "cancel", handle)
            assert cancel.returncode == 0, cancel.stderr
            gate.go.set()
            with anyio.fail_after(20):
                assert await task == app_id
            desc = await wait_for(s, app_id)
            assert desc.state == AppState.CANCELLED, desc
            assert "cancelled by another process" in desc.msg
        after = await anyio.to_thread.run_sync(_cli, root, "status", handle)
        assert after.returncode == 0 and "CANCELLED" in after.stdout, after
    assert not started.exists() and _marked(app_id) == []


OTHER = textwrap.dedent(
    """
    import asyncio, json, sys
    from asynctorchx.schedulers.local import LocalScheduler

    async def main(root, backend, app_id):
        async with LocalScheduler("other", backend, local_root=root) as s:
            desc = await s.describe(app_id)
            many = await s.describe_many([app_id])
            out = {
                "describe": None if desc is None else [desc.state.name, desc.msg],
                "many": None if many[app_id] is None else many[app_id].state.name,
                "exists": await s.exists(app_id),
                "list": [[a.app_id, a.state.name, a.app_handle] for a in await s.list()],
            }
            await s.cancel(app_id)
            print(json.dumps(out), flush=True)

    asyncio.run(main(*sys.argv[1:4]))
    """
)


@pytest.mark.timeout(90)
async def test_another_scheduler_sees_a_claimed_app_pending_and_cancels_it(
    tmp_path: Path, gate: Gate
) -> None:
    """A ``local_dir`` scheduler in another process describes an app claimed but not started as
    PENDING ("being submitted"; ``describe_many``, ``exists`` and ``list`` agree) and cancels
    it: the app ends CANCELLED with nothing started and no marker left."""
    root, started, go = tmp_path / "root", tmp_path / "started", tmp_path / "go"
    async with (
        LocalScheduler("claimed", "local_dir", local_root=root) as s,
        claimed(s, gate, started, go) as (app_id, task),
    ):
        argv = [sys.executable, "-c", OTHER, str(root), "local_dir", app_id]
        done = await anyio.to_thread.run_sync(
            lambda: subprocess.run(argv, capture_output=True, text=True, timeout=40)
        )
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout)
        assert seen["describe"] == ["PENDING", "being submitted"], seen
        assert seen["many"] == "PENDING" and seen["exists"] is True, seen
        assert seen["list"] == [[app_id, "PENDING", f"local_dir://claimed/{app_id}"]], seen
        gate.go.set()
        with anyio.fail_after(20):
            assert await task == app_id
        assert (await wait_for(s, app_id)).state == AppState.CANCELLED
    records = root / ".apps"
    assert not (records / f"{app_id}.cancel").exists()
    assert not started.exists() and _marked(app_id) == []


@pytest.mark.timeout(60)
async def test_a_cancel_in_the_launching_process_of_a_claimed_app_leaves_it_cancelled(
    tmp_path: Path, gate: Gate
) -> None:
    """The launching scheduler itself describes an app claimed but not started as PENDING
    ("being submitted"), lists it, says it exists, and cancels it: its ``schedule`` returns its
    id and it ends CANCELLED with nothing started."""
    root, started, go = tmp_path / "root", tmp_path / "started", tmp_path / "go"
    async with (
        LocalScheduler("claimed", local_root=root) as s,
        claimed(s, gate, started, go) as (app_id, task),
    ):
        desc = await s.describe(app_id)
        assert desc is not None and desc.state == AppState.PENDING, desc
        assert desc.msg == "being submitted"
        assert [(a.app_id, a.state) for a in await s.list()] == [(app_id, AppState.PENDING)]
        assert await s.exists(app_id)
        await s.cancel(app_id)
        gate.go.set()
        with anyio.fail_after(20):
            assert await task == app_id
        assert (await wait_for(s, app_id)).state == AppState.CANCELLED
    assert not started.exists() and _marked(app_id) == []


@pytest.mark.timeout(90)
async def test_a_claim_whose_launcher_died_is_not_shown_pending_and_takes_no_cancel(
    tmp_path: Path,
) -> None:
    """A claim left by a launcher killed before its watchdog knew of the app (nobody holds its
    lock) is still an unknown app: ``describe`` says None, ``status`` and ``cancel`` exit 4,
    ``list`` leaves it out and no cancel marker is made; the dry run then runs."""
    root = tmp_path / "root"
    info, dryrun, started, go = _stale_dryrun(tmp_path, root)
    await _leave_stale_claim(STALE, root, dryrun)
    app_id = info.request.app_id
    handle = f"local_cwd://doomed/{app_id}"
    for argv in (["status", handle], ["cancel", handle]):
        done = await anyio.to_thread.run_sync(_cli, root, *argv)
        assert done.returncode == 4 and "unknown app" in done.stderr, done
    listed = await anyio.to_thread.run_sync(_cli, root, "list", "-s", "local_cwd")
    assert listed.returncode == 0 and app_id not in listed.stdout, listed
    async with LocalScheduler("doomed", local_root=root) as s:
        assert await s.describe(app_id) is None
        assert not await s.exists(app_id)
        assert await s.list() == []
        await s.cancel(app_id)
        assert not (root / ".apps" / f"{app_id}.cancel").exists()
        with anyio.fail_after(20):
            assert await s.schedule(pickle.loads(dryrun.read_bytes())) == app_id
        go.touch()
        assert (await wait_for(s, app_id)).state == AppState.SUCCEEDED
    assert len(started.read_text().split()) == 1


def test_a_claim_reads_as_being_submitted_only_while_its_holder_is_locked(tmp_path: Path) -> None:
    """``recordfile.claim_holder`` gives what a live launcher says of itself through its claim,
    None once nobody holds the lock, and None for a name that is no app id (a holder file, a path
    out of the claims directory) whatever it names."""
    records = str(tmp_path)
    made = protocol.make_holder(records, "h", b'{"backend": "local_dir", "session": "s"}')
    assert made is not None
    holder, fd = made
    assert protocol.claim_app(records, "app-1", holder)
    assert recordfile.claim_holder(records, "app-1") == {"backend": "local_dir", "session": "s"}
    assert recordfile.held_claims(records, ()) == {
        "app-1": {"backend": "local_dir", "session": "s"}
    }
    assert recordfile.held_claims(records, {"app-1"}) == {}
    name = os.path.basename(holder)
    assert recordfile.claim_holder(records, name) is None
    assert recordfile.claim_holder(records, f"../{protocol.CLAIMS_DIR}/{name}") is None
    os.close(fd)
    assert recordfile.claim_holder(records, "app-1") is None
    assert protocol.take_stale_claim(records, "app-1", holder) == protocol.TAKEN
    assert recordfile.CLAIMS_DIR == protocol.CLAIMS_DIR


OTHER_CANCEL = textwrap.dedent(
    """
    import asyncio, sys
    from asynctorchx.schedulers.local import LocalScheduler
    async def main():
        async with LocalScheduler("other", local_root=sys.argv[1]) as s:
            await s.cancel(sys.argv[2])
    asyncio.run(main())
    """
)


@pytest.mark.timeout(60)
async def test_without_inotify_a_cancel_during_the_spawn_is_heard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no inotify (ASYNCTORCHX_DISABLE_INOTIFY=1, as when its limits are hit), another process
    cancels the app while its replicas are being spawned (claimed, no record yet: the cancel only
    leaves its marker): the launcher finds the marker within MARKER_POLL and the app ends
    CANCELLED (it ran on: the marker was looked for only when a replica exited)."""
    from asynctorchx.schedulers._local.spawn import Spawner

    monkeypatch.setenv("ASYNCTORCHX_DISABLE_INOTIFY", "1")
    root = tmp_path / "root"
    real_start = Spawner.start
    cancels: list[int] = []

    async def start(self: Spawner, app: Any, replicas: Any) -> None:
        if not cancels:  # the other process cancels at this very point
            proc = await anyio.run_process(
                [sys.executable, "-c", OTHER_CANCEL, str(root), app.app_id], check=False
            )
            cancels.append(proc.returncode)
        await real_start(self, app, replicas)

    monkeypatch.setattr(Spawner, "start", start)
    s = LocalScheduler("s", local_root=root)
    try:
        role = Role("main", image=".", entrypoint="sleep", args=["1000"], num_replicas=2)
        app = AppDef("a", [role])
        app_id = await s.submit(app, {})
        assert cancels == [0]
        desc = await wait_for(s, app_id, timeout=10)
        assert desc.state == AppState.CANCELLED
    finally:
        await s.close()


@pytest.mark.timeout(60)
async def test_a_fifo_in_place_of_a_cancel_marker_blocks_no_reader(tmp_path: Path) -> None:
    """A FIFO named like an app's cancel marker: the launcher reads it as a cancel (one was asked
    for) and the app ends CANCELLED, and a cancel from another process returns; neither blocks on
    the FIFO (an open to read it waited for a writer for ever)."""
    root = tmp_path / "root"
    s = LocalScheduler("s", local_root=root)
    try:
        role = Role("main", image=".", entrypoint="sleep", args=["1000"])
        app_id = await s.submit(AppDef("a", [role]), {"cancel_grace_period": 1.0})
        os.mkfifo(root / ".apps" / f"{app_id}.cancel")
        with anyio.fail_after(20):
            proc = await anyio.run_process(
                [sys.executable, "-c", OTHER_CANCEL, str(root), app_id], check=False
            )
        assert proc.returncode == 0, proc.stderr
        desc = await wait_for(s, app_id, timeout=20)
        assert desc.state == AppState.CANCELLED
    finally:
        await s.close()
