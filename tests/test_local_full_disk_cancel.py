"""A cancel from a process that did not launch the app (``asynctorchx cancel``, another scheduler)
on a state root that takes no more writes (full, over quota, read-only).

Such a cancel leaves a cancel marker next to the app's record (``RecordStore.mark_cancel``) before
it signals the app: the launcher reads it and records the app CANCELLED. Before the fix, a marker
that could not be written (ENOSPC) ended the cancel with a bare ``OSError: [Errno 28] No space
left on device``: no SIGTERM was sent and the app ran on. Now the app's live process groups are
signalled (and SIGKILLed after the grace period) all the same, with a warning naming the marker
and saying the app may end FAILED rather than CANCELLED; other errors still fail the cancel, and
name the marker. Every failed marker write also left its temporary file,
``.{app_id}.cancel.{pid}.tmp``, in the records directory for good; it is now removed.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from _local_env import group_members, poll_until, tiny_tmpfs, wait_for
from test_local_claim_cancel import _cli
from test_local_reliability import fill

from asynctorchx.schedulers._local import protocol
from asynctorchx.schedulers._local.records import RecordStore
from asynctorchx.schedulers.local import LocalScheduler
from asynctorchx.specs import AppDef, AppState, Role, is_terminal

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs (root only) to hold the state root; unmounted afterwards."""
    with tiny_tmpfs(tmp_path / "state", "2m") as mounted:
        yield mounted


def sleeper(name: str = "sleeper") -> AppDef:
    return AppDef(name, [Role("main", image="x", entrypoint="sleep", args=["120"])])


def leftovers(root: Path) -> list[str]:
    """The temporary files of cancel markers in the records directory."""
    return sorted(n for n in os.listdir(root / ".apps") if ".cancel." in n)


async def replica_group(s: LocalScheduler, app_id: str) -> int:
    """The process group of the app's only replica (its pid)."""
    desc = await s.describe(app_id)
    assert desc is not None
    pid = desc.roles_statuses[0].replicas[0].pid
    assert pid is not None
    return pid


async def test_a_cancel_from_the_cli_on_a_full_state_root_still_stops_the_app(
    state: Path, tmp_path: Path
) -> None:
    """With the state root full, ``asynctorchx cancel`` from another process exits 0, warns
    (naming the cancel marker it could not write, and that the app may read FAILED rather than
    CANCELLED), and the app is stopped: it ends at once, its processes gone, and no temporary
    marker file is left."""
    root = state / "root"
    s = LocalScheduler("full", local_root=root)
    filler = None
    try:
        app_id = await s.submit(sleeper(), {"log_dir": str(tmp_path / "logs")})
        await wait_for(s, app_id, lambda d: d.state == AppState.RUNNING)
        group = await replica_group(s, app_id)
        filler = fill(state)
        r = await anyio.to_thread.run_sync(_cli, root, "cancel", f"local_cwd://full/{app_id}")
        assert r.returncode == 0, r.stderr
        assert "Traceback" not in r.stderr, r.stderr
        marker = protocol.cancel_path(str(root / ".apps"), app_id)
        assert marker in r.stderr and "FAILED rather than CANCELLED" in r.stderr, r.stderr
        desc = await wait_for(s, app_id, timeout=30)
        assert desc.state in (AppState.FAILED, AppState.CANCELLED), desc
        await poll_until(lambda: group_members(group) == [], "the replica's group to be gone")
        assert leftovers(root) == []
    finally:
        if filler is not None:
            filler.unlink()
        await s.close()


async def test_a_cancel_from_another_process_on_a_full_state_root_kills_after_the_grace(
    state: Path, tmp_path: Path
) -> None:
    """With the state root full, a cancel from another process still starts the escalator: a
    replica that ignores SIGTERM is SIGKILLed once the grace period is over."""
    root, ready = state / "root", tmp_path / "ready"
    script = f"trap '' TERM; touch {ready}; sleep 120"
    app = AppDef("stubborn", [Role("main", image="x", entrypoint="sh", args=["-c", script])])
    s = LocalScheduler("full", local_root=root)
    filler = None
    try:
        app_id = await s.submit(
            app, {"log_dir": str(tmp_path / "logs"), "cancel_grace_period": 1.0}
        )
        group = await replica_group(s, app_id)
        await poll_until(ready.exists, "the trap to be set")
        filler = fill(state)
        r = await anyio.to_thread.run_sync(_cli, root, "cancel", f"local_cwd://full/{app_id}")
        assert r.returncode == 0, r.stderr
        desc = await wait_for(s, app_id, timeout=30)
        assert is_terminal(desc.state), desc
        await poll_until(lambda: group_members(group) == [], "the replica's group to be gone")
        assert leftovers(root) == []
    finally:
        if filler is not None:
            filler.unlink()
        await s.close()


async def test_a_cancel_tried_on_a_full_state_root_leaves_no_temporary_file(
    state: Path, tmp_path: Path
) -> None:
    """Cancels tried while the state root is full, one from another process (the CLI), one by the
    launcher itself: once space frees and the apps ended, no ``.{app}.cancel.{pid}.tmp`` file is
    left in the records directory (not even after a later scheduler's start-up sweep); the
    launcher's own cancel still ends its app CANCELLED."""
    root = state / "root"
    s = LocalScheduler("full", local_root=root)
    filler = None
    try:
        logs = {"log_dir": str(tmp_path / "logs")}
        theirs = await s.submit(sleeper("theirs"), logs)
        mine = await s.submit(sleeper("mine"), logs)
        for app_id in (theirs, mine):
            await wait_for(s, app_id, lambda d: d.state == AppState.RUNNING)
        filler = fill(state)
        await anyio.to_thread.run_sync(_cli, root, "cancel", f"local_cwd://full/{theirs}")
        await s.cancel(mine)
        assert (await wait_for(s, mine, timeout=30)).state == AppState.CANCELLED
        filler.unlink()
        filler = None
        assert await s._runtime.writer.flush(retry_for=10)
    finally:
        if filler is not None:
            filler.unlink()
        await s.close()
    async with LocalScheduler("later", local_root=root) as later:
        await later.list()
    assert leftovers(root) == []


async def test_a_marker_unwritable_for_another_reason_fails_the_cancel_naming_it(
    tmp_path: Path,
) -> None:
    """A cancel marker that cannot be written for another reason than a full or read-only file
    system (here its temporary file's name is taken by a directory) fails the cancel from another
    process with an error of that errno naming the marker; nothing is signalled (the app runs
    on), and the launcher's own cancel then works."""
    root = tmp_path / "root"
    s = LocalScheduler("owner", local_root=root)
    async with s:
        app_id = await s.submit(sleeper(), {})
        await wait_for(s, app_id, lambda d: d.state == AppState.RUNNING)
        # (this process's pid: the other scheduler below runs in it)
        blocker = root / ".apps" / f".{app_id}.cancel.{os.getpid()}.tmp"
        blocker.mkdir()
        try:
            async with LocalScheduler("other", local_root=root) as other:
                with pytest.raises(OSError) as raised:
                    await other.cancel(app_id)
        finally:
            blocker.rmdir()
        marker = protocol.cancel_path(str(root / ".apps"), app_id)
        assert raised.value.errno == errno.EISDIR, raised.value
        assert marker in str(raised.value), raised.value
        desc = await s.describe(app_id)
        assert desc is not None and desc.state == AppState.RUNNING, desc
        await s.cancel(app_id)
        assert (await wait_for(s, app_id)).state == AppState.CANCELLED


def test_mark_cancel_removes_its_temporary_file_when_the_replace_fails(tmp_path: Path) -> None:
    """When the marker's temporary file cannot take the marker's place (a directory is there),
    ``mark_cancel`` raises that error and removes its temporary file."""
    store = RecordStore(tmp_path / "root")
    store.ensure()
    doc = {
        "format": 1,
        "app_id": "m-1",
        "name": "n",
        "backend": "local_cwd",
        "session": "s",
        "state": "RUNNING",
        "msg": "",
        "submitted_at": 1.0,
        "app_dir": "/nowhere",
        "owner": {"pid": os.getpid(), "start_ticks": 1},
        "replicas": [],
        "app": {},
    }
    assert store.write_many({"m-1": doc}) == {}
    os.mkdir(protocol.cancel_path(str(store.records_dir), "m-1"))
    with pytest.raises(IsADirectoryError):
        store.mark_cancel("m-1", ["123:456"])
    assert leftovers(store.records_dir.parent) == []
