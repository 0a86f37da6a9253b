"""Faults found by probing the claim of a local app's id: hand-made app ids too long for the files
named after them, a state root that turns read-only between the claim and the launch, a watchdog
that cannot be started again right after a claim, and a launcher killed in the middle of taking a
stale claim over."""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import anyio
import pytest
from _local_env import GATE, tiny_tmpfs, wait_for
from test_local_claim import STALE, _doomed, _leave_stale_claim, _stale_dryrun, wait_started

from asynctorchx.schedulers._local import contain, guard, protocol
from asynctorchx.schedulers._local.launch import AppLauncher
from asynctorchx.schedulers._local.recordfile import MAX_APP_ID
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
