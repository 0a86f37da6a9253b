"""Faults found by probing the claim of a local app's id: hand-made app ids too long for the files
named after them, a state root that turns read-only between the claim and the launch, a watchdog
that cannot be started again right after a claim, a launcher killed in the middle of taking a
stale claim over, a claims directory removed while an app is being submitted, and two threads
making a launcher's holder file again at once."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import anyio
import pytest
from _local_env import GATE, poll_until, tiny_tmpfs, wait_for
from test_local_claim import (
    STALE,
    _doomed,
    _holders_open_in,
    _leave_stale_claim,
    _stale_dryrun,
    wait_started,
)

from asynctorchx.schedulers._local import contain, guard, protocol
from asynctorchx.schedulers._local.launch import AppLauncher
from asynctorchx.schedulers._local.recordfile import MAX_APP_ID
from asynctorchx.schedulers._local.records import RecordStore
from asynctorchx.schedulers.local import LaunchError, LocalScheduler
from asynctorchx.specs import AppDef, AppState, Role


def _claims_and_records(records: str) -> list[str]:
    """The claims (``claim:ID``) and record files in the records directory ``records``."""
    claims_dir = os.path.join(records, protocol.CLAIMS_DIR)
    claims = os.listdir(claims_dir) if os.path.isdir(claims_dir) else []
    found = [f"claim:{n}" for n in claims if not n.startswith(".")]  # (not the holder files)
    return sorted(found + [n for n in os.listdir(records) if n.endswith(".json")])


def _gated_app(go: Path) -> AppDef:
    """An app whose replica runs until ``go`` exists."""
    role = Role("main", image="x", entrypoint="sh", args=["-c", GATE], env={"GO": str(go)})
    return AppDef("long", [role])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("length", [MAX_APP_ID + 1, 240, 254])
async def test_a_dry_run_whose_app_id_is_too_long_for_its_files_is_refused(
    tmp_path: Path, length: int
) -> None:
    """A hand-made app id longer than ``MAX_APP_ID`` (its record, lock or cancel marker would not
    fit in a file name) is refused with a ValueError naming its length before any claim, file or
    process."""
    root, go = tmp_path / "root", tmp_path / "go"
    async with LocalScheduler("long", local_root=root) as s:
        info = s.submit_dryrun(_gated_app(go), {})
        info.request = dataclasses.replace(info.request, app_id="a" * length)
        with pytest.raises(ValueError, match=f"not a local app id .*at most {MAX_APP_ID}"):
            await s.schedule(info)
        assert s._runtime.apps == {}
    assert _claims_and_records(str(root / ".apps")) == []


CANCEL = textwrap.dedent(
    """
    import asyncio, sys
    from asynctorchx.schedulers.local import LocalScheduler

    async def main(root, app_id):
        async with LocalScheduler("other", local_root=root) as s:
            await s.cancel(app_id)

    asyncio.run(main(*sys.argv[1:3]))
    """
)


@pytest.mark.timeout(60)
async def test_an_app_id_of_the_longest_length_runs_and_is_cancelled_by_another_process(
    tmp_path: Path,
) -> None:
    """An app id of ``MAX_APP_ID`` characters is launched, recorded and cancelled from another
    process (its lock file and cancel marker fit in file names): it ends CANCELLED."""
    root, go = tmp_path / "root", tmp_path / "go"
    async with LocalScheduler("long", local_root=root) as s:
        info = s.submit_dryrun(_gated_app(go), {})
        app_id = "a" * MAX_APP_ID
        info.request = dataclasses.replace(info.request, app_id=app_id)
        assert await s.schedule(info) == app_id
        cancel = [sys.executable, "-c", CANCEL, str(root), app_id]
        done = await anyio.to_thread.run_sync(
            lambda: subprocess.run(cancel, capture_output=True, text=True, timeout=40)
        )
        assert done.returncode == 0, done.stderr
        desc = await wait_for(s, app_id)
        assert desc.state == AppState.CANCELLED, desc


def _marked(app_id: str) -> list[int]:
    prefix = protocol.app_marker_prefix(app_id)
    return [p for p, _, _ in contain.live_processes(protocol.MARKER_ENV_BYTES, [prefix])]


def _remount_ro_before(
    real: Callable[[AppLauncher, Any], Coroutine[Any, Any, None]], fs: Path
) -> Callable[[AppLauncher, Any], Coroutine[Any, Any, None]]:
    """``real`` (a step of the launch of a claimed app), run once ``fs`` was made read-only (fault
    injection: a file system remounted read-only after an I/O error)."""

    async def step(self: AppLauncher, app: Any) -> None:
        await anyio.to_thread.run_sync(
            lambda: subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
        )
        await real(self, app)

    return step


@pytest.mark.timeout(60)
@pytest.mark.parametrize("step", ["launch", "_start_app"])
async def test_a_state_root_turned_read_only_after_the_claim_fails_the_submit_with_its_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """A state root remounted read-only after the app's claim (before its log directory is
    checked, or before its replicas start and its record is written) fails the submit with the
    LaunchError of what could not be written, not the undo's "Read-only file system" on the
    record it could not remove; nothing of the app runs and its cgroup is removed."""
    go = tmp_path / "go"
    with tiny_tmpfs(tmp_path / "fs", "1m") as fs:
        monkeypatch.setattr(AppLauncher, step, _remount_ro_before(getattr(AppLauncher, step), fs))
        # (the replicas' logs elsewhere, so that the launch gets as far as ``step``)
        cfg = {"log_dir": str(tmp_path / "logs")} if step == "_start_app" else {}
        async with LocalScheduler("ro", local_root=fs / "state") as s:
            info = s.submit_dryrun(_gated_app(go), cfg)
            app_id = info.request.app_id
            with anyio.fail_after(30), pytest.raises(LaunchError, match="Read-only file system"):
                await s.schedule(info)
            assert s._runtime.apps == {} and _marked(app_id) == []
            cgroup = s._runtime.contain.app_dir(app_id)
            assert cgroup is None or not os.path.exists(cgroup)


@pytest.mark.timeout(60)
async def test_a_watchdog_that_cannot_be_restarted_after_a_claim_leaves_no_claim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submit whose claim was made but whose watchdog cannot then be started (its claims
    directory was removed, so the watchdog is restarted to hold the new claims file, and the fork
    fails: the host is out of processes) fails with a LaunchError and leaves no claim: the same
    dry run runs once processes can be started again."""
    root, go = tmp_path / "root", tmp_path / "go"
    go.touch()
    real_popen = guard.subprocess.Popen

    def no_watchdog(argv: list[str], **kw: Any) -> Any:  # fault injection: fork fails (EAGAIN)
        if str(guard.WATCHDOG_SCRIPT) in argv:
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        return real_popen(argv, **kw)

    async with LocalScheduler("fork", local_root=root) as s:
        first = await s.schedule(s.submit_dryrun(_gated_app(go), {}))
        await wait_for(s, first)
        shutil.rmtree(root / ".apps" / protocol.CLAIMS_DIR)
        info = s.submit_dryrun(_gated_app(go), {})
        app_id = info.request.app_id
        with monkeypatch.context() as m:
            m.setattr(guard.subprocess, "Popen", no_watchdog)
            with pytest.raises(LaunchError, match="Resource temporarily unavailable"):
                await s.schedule(info)
        assert not os.path.lexists(protocol.claim_path(str(root / ".apps"), app_id))
        assert s._runtime.claimed == {}
        with anyio.fail_after(20):
            assert await s.schedule(info) == app_id
        assert (await wait_for(s, app_id)).state == AppState.SUCCEEDED


def _killed_taking_over(after: str) -> str:
    """The script of a launcher that takes a stale claim over and is SIGKILLed right ``after`` its
    ``link`` (of its holder file to the claim's temporary name) or ``replace`` (of the claim by
    that name), printing its watchdog's pid first."""
    return _doomed(
        f"""
        real = getattr(os, {after!r})

        def then_die(src, dst, **kw):  # (fault injection: the kill at that step)
            real(src, dst, **kw)
            if os.path.basename(src if {after!r} == "replace" else dst).startswith(".take."):
                print(sched._runtime.watchdog.pid, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        setattr(os, {after!r}, then_die)
        """
    )


@pytest.mark.timeout(90)
@pytest.mark.parametrize("after", ["link", "replace"])
async def test_a_launcher_killed_while_taking_a_stale_claim_over_leaves_it_to_the_next(
    tmp_path: Path, after: str
) -> None:
    """A launcher SIGKILLed in the middle of taking a stale claim over (its holder linked to the
    temporary name, or the claim replaced by it) leaves a claim the next launch of the dry run
    takes over once that launcher's watchdog is gone: the app runs once."""
    root = tmp_path / "root"
    info, dryrun, started, go = _stale_dryrun(tmp_path, root)
    await _leave_stale_claim(STALE, root, dryrun)
    await _leave_stale_claim(_killed_taking_over(after), root, dryrun)
    app_id = info.request.app_id
    assert _claims_and_records(str(root / ".apps")) == [f"claim:{app_id}"]
    assert not started.exists()
    async with LocalScheduler("retry", local_root=root) as s:
        with anyio.fail_after(20):
            assert await s.schedule(info) == app_id
        await wait_started(started)
        go.touch()
        assert (await wait_for(s, app_id)).state == AppState.SUCCEEDED
    assert len(started.read_text().split()) == 1
    assert _claims_and_records(str(root / ".apps")) == [f"{app_id}.json"]


SCHEDULE = textwrap.dedent(
    """
    import asyncio, pickle, sys
    from asynctorchx.schedulers.local import LocalScheduler
    from asynctorchx.specs import is_terminal

    async def main(root, dryrun, backend):
        with open(dryrun, "rb") as f:
            info = pickle.load(f)
        async with LocalScheduler("claimed", backend, local_root=root) as s:
            try:
                app_id = await s.schedule(info)
            except ValueError as e:
                print("lost", e, flush=True)
                return
            print("won", flush=True)
            while not is_terminal((await s.describe(app_id)).state):
                await asyncio.sleep(0.02)
            print((await s.describe(app_id)).state.name, flush=True)

    asyncio.run(main(*sys.argv[1:4]))
    """
)


class Held:
    """Holds a step of every submit (``cls.name``, a coroutine method) back until ``go`` is set;
    ``entered`` is set once one waits."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> None:
        self.entered = asyncio.Event()
        self.go = asyncio.Event()
        real = getattr(cls, name)

        async def step(*args: Any) -> None:
            self.entered.set()
            await self.go.wait()
            await real(*args)

        monkeypatch.setattr(cls, name, step)


def _printing_app(tmp_path: Path, image: Path, workspace: bool) -> tuple[AppDef, Path, Path]:
    """An app (its image: ``image``, where its script ``main.sh`` is written, run from the image
    on ``local_dir`` and by its path on ``local_cwd``) whose replica notes its start in
    ``started``, prints a line (its log directory is made) and runs until ``go`` exists; with
    ``started`` and ``go``."""
    started, go = tmp_path / "started", tmp_path / "go"
    image.mkdir(exist_ok=True)
    (image / "main.sh").write_text(f"echo $$ >> {started}; echo up\n{GATE}\n")
    script = "main.sh" if workspace else str(image / "main.sh")
    role = Role("main", image=str(image), entrypoint="sh", args=[script], env={"GO": str(go)})
    return AppDef("shared", [role]), started, go


@pytest.mark.timeout(90)
@pytest.mark.parametrize("workspace", [False, True])
async def test_a_claims_directory_removed_during_a_submit_lets_one_launcher_start_the_app(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workspace: bool
) -> None:
    """A launcher whose claim was removed with the claims directory while it submitted an app
    (held before its launch, or before its ``local_dir`` workspace ship), and which another
    process then claimed and started, refuses the app when its launch or ship comes, touching
    nothing: the other's record, claim, log and workspace directories stay, and the app runs
    once, to SUCCEEDED."""
    root = tmp_path / "root"
    backend = "local_dir" if workspace else "local_cwd"
    if workspace:
        held = Held(monkeypatch, LocalScheduler, "_ship_workspace")
    else:
        held = Held(monkeypatch, AppLauncher, "launch")
    app, started, go = _printing_app(tmp_path, tmp_path / "ws", workspace)
    async with LocalScheduler("claimed", backend, local_root=root) as s:
        info = s.submit_dryrun(app, {}, workspace=str(tmp_path / "ws") if workspace else None)
        app_id = info.request.app_id
        dryrun = tmp_path / "dryrun.pickle"
        dryrun.write_bytes(pickle.dumps(info))
        task = asyncio.ensure_future(s.schedule(info))
        other = None
        try:
            with anyio.fail_after(20):
                await held.entered.wait()
            shutil.rmtree(root / ".apps" / protocol.CLAIMS_DIR)
            argv = [sys.executable, "-c", SCHEDULE, str(root), str(dryrun), backend]
            other = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            app_dir = Path(info.request.app_dir)
            await poll_until(app_dir.is_dir, "the other launcher's app to print")
            held.go.set()
            with anyio.fail_after(20), pytest.raises(ValueError, match=r"another launcher|exists"):
                await task
            records = root / ".apps"
            assert (records / f"{app_id}.json").exists()
            assert os.path.lexists(protocol.claim_path(str(records), app_id))
            assert app_dir.is_dir()
            if workspace:
                assert (root / "workspaces" / "apps" / "claimed" / app_id / "main.sh").exists()
            go.touch()
            out, err = await anyio.to_thread.run_sync(lambda: other.communicate(timeout=40))
            assert out.split() == ["won", "SUCCEEDED"], err
        finally:
            held.go.set()
            go.touch()
            if other is not None and other.poll() is None:
                other.kill()
                other.wait()
            await asyncio.wait([task])
    assert len(started.read_text().split()) == 1


@pytest.mark.timeout(90)
async def test_a_claim_removed_during_a_submit_is_made_again_before_the_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launcher whose claim was removed with the claims directory while it shipped the app's
    workspace makes the claim again when its launch comes (its watchdog holding the new claims
    file): another process scheduling the same dry run then is refused, and the app runs once."""
    root = tmp_path / "root"
    held = Held(monkeypatch, AppLauncher, "launch")
    app, started, go = _printing_app(tmp_path, tmp_path / "ws", True)
    async with LocalScheduler("claimed", "local_dir", local_root=root) as s:
        info = s.submit_dryrun(app, {}, workspace=str(tmp_path / "ws"))
        app_id = info.request.app_id
        dryrun = tmp_path / "dryrun.pickle"
        dryrun.write_bytes(pickle.dumps(info))
        task = asyncio.ensure_future(s.schedule(info))
        try:
            with anyio.fail_after(20):
                await held.entered.wait()
            shutil.rmtree(root / ".apps" / protocol.CLAIMS_DIR)
            held.go.set()
            with anyio.fail_after(20):
                assert await task == app_id
            claim = protocol.claim_path(str(root / ".apps"), app_id)
            store = s._runtime.store
            assert store.holder is not None and os.path.samefile(claim, store.holder)
            watchdog = s._runtime.watchdog.pid
            assert watchdog is not None and store.holder in _holders_open_in(watchdog)
            argv = [sys.executable, "-c", SCHEDULE, str(root), str(dryrun), "local_dir"]
            done = await anyio.to_thread.run_sync(
                lambda: subprocess.run(argv, capture_output=True, text=True, timeout=40)
            )
            assert done.stdout.startswith("lost") and "already scheduled" in done.stdout, done
        finally:
            held.go.set()
            go.touch()
            await asyncio.wait([task])
        assert (await wait_for(s, app_id)).state == AppState.SUCCEEDED
    assert len(started.read_text().split()) == 1


class _MeetingList(list[int]):
    """The list of a store's older holder locks, whose ``append`` waits (at most ``patience``
    seconds) until ``met`` is set: fault injection that keeps a ``hold`` in the middle of replacing
    the holder while another one runs."""

    def __init__(self, met: threading.Event, patience: float) -> None:
        super().__init__()
        self.met = met
        self.patience = patience

    def append(self, fd: int) -> None:
        self.met.wait(self.patience)
        super().append(fd)


def test_two_holds_at_once_keep_each_older_lock_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two threads making a store's holder file again at once (the claims directory was removed,
    and a take-over in a worker thread claims while the event loop does) keep each older lock once
    and lose none: ``release_holder`` closes every descriptor exactly once (one was kept twice and
    closed twice, the second time maybe another file's)."""
    store = RecordStore(tmp_path / "root")
    store.hold()
    first = store.holder_fd
    second_in = threading.Event()
    real = protocol.make_holder

    def make_holder(records_dir: str, name: str, says: bytes = b"") -> tuple[str, int] | None:
        made = real(records_dir, name, says)
        if threading.current_thread().name == "second":
            second_in.set()
        return made

    monkeypatch.setattr(protocol, "make_holder", make_holder)
    # (the first waits in its replacement until the second has made its holder, or 0.5 s: what a
    # lock around the replacement makes it wait for in vain)
    store._old_holder_fds = _MeetingList(second_in, 0.5)
    threads = [threading.Thread(target=store.hold, name=n) for n in ("first", "second")]
    threads[0].start()
    threads[1].start()
    for t in threads:
        t.join(20)
    fds = store.lock_fds()
    assert len(fds) == 3 and len(set(fds)) == 3 and first in fds, fds
    names = [os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) for fd in fds]
    assert all(n.startswith(protocol.HOLDER_PREFIX) for n in names), names
    store.release_holder()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
