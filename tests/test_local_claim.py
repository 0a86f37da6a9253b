"""The claim of a local app's id (a hard link under ``.apps/.claims``): one dry run scheduled at
once by two schedulers or two processes starts once, the other submit fails cleanly and leaves
nothing; a launcher killed after registering the app leaves a FAILED app and no claim, one killed
before leaves a claim the next launch of the dry run takes over; claims go with failed submits and
terminal records, and work where hard links do not."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from _local_env import poll_until, wait_for

from asynctorchx.schedulers._local import contain, protocol
from asynctorchx.schedulers.local import LaunchError, LaunchSpecError, LocalScheduler
from asynctorchx.specs import AppDef, AppDryRunInfo, AppState, Role, is_terminal


def _counting_app(started: Path, go: Path) -> AppDef:
    """An app whose replica notes its start in ``started``, then waits for ``go`` to exist."""
    script = f"echo $$ >> {started}; while [ ! -e {go} ]; do sleep 0.01; done"
    return AppDef("twice", [Role("main", image="x", entrypoint="sh", args=["-c", script])])


def _versions(record: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in record.read_bytes().splitlines() if line.strip()]


def _claims_and_records(records: str) -> list[str]:
    """The claims (``claim:ID``) and record files in the records directory ``records``."""
    claims_dir = os.path.join(records, protocol.CLAIMS_DIR)
    claims = os.listdir(claims_dir) if os.path.isdir(claims_dir) else []
    found = [f"claim:{n}" for n in claims if not n.startswith(".")]  # (not the holder files)
    return sorted(found + [n for n in os.listdir(records) if n.endswith(".json")])


def _marked(app_id: str) -> list[int]:
    prefix = protocol.app_marker_prefix(app_id)
    return [p for p, _, _ in contain.live_processes(protocol.MARKER_ENV_BYTES, [prefix])]


async def test_two_schedulers_scheduling_one_dry_run_at_once_start_it_once(tmp_path: Path) -> None:
    """Two schedulers of one state root scheduling the same dry run concurrently: exactly one
    starts it, the other raises the "already scheduled" ValueError, and the record is the
    winner's alone."""
    root, started, go = tmp_path / "root", tmp_path / "started", tmp_path / "go"
    async with (
        LocalScheduler("race", local_root=root) as a,
        LocalScheduler("race", local_root=root) as b,
    ):
        info = a.submit_dryrun(_counting_app(started, go), {})
        twin = pickle.loads(pickle.dumps(info))
        with anyio.fail_after(20):
            results = await asyncio.gather(
                a.schedule(info), b.schedule(twin), return_exceptions=True
            )
        errors = [r for r in results if isinstance(r, BaseException)]
        assert len(errors) == 1, results
        assert isinstance(errors[0], ValueError) and "already scheduled" in str(errors[0])
        winner, loser = (a, b) if isinstance(results[1], BaseException) else (b, a)
        app_id = info.request.app_id
        await wait_for(winner, app_id, lambda d: d.state == AppState.RUNNING)
        await wait_started(started)  # (RUNNING once spawned: the shell may not have run yet)
        assert len(started.read_text().split()) == 1
        go.touch()
        desc = await wait_for(winner, app_id)
        assert desc.state == AppState.SUCCEEDED
        assert len(started.read_text().split()) == 1
        assert app_id not in loser._runtime.apps
        record = root / ".apps" / f"{app_id}.json"
        watchdogs = {v["owner"]["watchdog_pid"] for v in _versions(record)}  # type: ignore[index]
        assert watchdogs <= {None, winner._runtime.watchdog.pid}


CHILD = textwrap.dedent(
    """
    import asyncio, os, pickle, select, sys
    from asynctorchx.schedulers.local import LaunchSpecError, LocalScheduler
    from asynctorchx.specs import AppDef, Role

    async def main(root, dryrun, ready, fifo):
        with open(dryrun, "rb") as f:
            info = pickle.load(f)
        async with LocalScheduler("race", local_root=root) as s:
            warm = s.submit_dryrun(AppDef("warm", [Role("main", image="x", entrypoint="true")]), {})
            await until_done(s, await s.schedule(warm))  # the state root and session are ready
            # the barrier: both read one byte of one write (the FIFO opened before saying ready: a
            # reader opening it after the write would wait for another writer for ever)
            barrier = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
            open(os.path.join(ready, str(os.getpid())), "w").close()
            select.select([barrier], [], [])
            os.read(barrier, 1)
            try:
                app_id = await s.schedule(info)
            except ValueError as e:
                print("lost", e, flush=True)
                return
            print("won", flush=True)
            await until_done(s, app_id)

    async def until_done(s, app_id):
        while (await s.describe(app_id)).state.name not in ("SUCCEEDED", "FAILED", "CANCELLED"):
            await asyncio.sleep(0.02)

    asyncio.run(main(*sys.argv[1:5]))
    """
)


async def _schedule_in_two_processes(
    tmp_path: Path, root: Path, dryrun: Path, go: Path, started: Path
) -> list[tuple[int, str]]:
    """Has two processes, released by one barrier, schedule the pickled dry run ``dryrun``; once a
    replica noted its start in ``started``, lets it end (``go``); returns each one's pid and
    output ("won" or "lost" and the error)."""
    ready, fifo = tmp_path / "ready", tmp_path / "barrier"
    ready.mkdir()
    os.mkfifo(fifo)
    args = [str(root), str(dryrun), str(ready), str(fifo)]
    procs = [
        subprocess.Popen([sys.executable, "-c", CHILD, *args], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        with anyio.fail_after(40):
            while len(os.listdir(ready)) < 2:  # (bounded polling of the children's progress)
                assert all(p.poll() is None for p in procs), "a child died before the barrier"
                await asyncio.sleep(0.01)
            await anyio.to_thread.run_sync(fifo.write_bytes, b"go")
            await wait_started(started)
            go.touch()
            outs = [await anyio.to_thread.run_sync(p.communicate) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.pid, out) for p, (out, _) in zip(procs, outs, strict=True)]


@pytest.mark.timeout(90)
async def test_two_processes_scheduling_one_pickled_dry_run_at_once_start_it_once(
    tmp_path: Path,
) -> None:
    """Two processes released by one barrier schedule the same pickled dry run: one wins, the
    other gets the "already scheduled" ValueError, and the app's replica started once."""
    root, started, go = tmp_path / "root", tmp_path / "started", tmp_path / "go"
    dryrun = tmp_path / "dryrun.pickle"
    info = LocalScheduler("race", local_root=root).submit_dryrun(_counting_app(started, go), {})
    dryrun.write_bytes(pickle.dumps(info))
    outs = await _schedule_in_two_processes(tmp_path, root, dryrun, go, started)
    verdicts = sorted(out.split()[0] for _, out in outs)
    assert verdicts == ["lost", "won"], outs
    assert "already scheduled" in next(o for _, o in outs if o.startswith("lost"))
    assert len(started.read_text().split()) == 1
    record = root / ".apps" / f"{info.request.app_id}.json"
    assert {v["owner"]["pid"] for v in _versions(record)} == {  # type: ignore[index]
        next(pid for pid, o in outs if o.startswith("won"))
    }


async def wait_started(started: Path) -> None:
    """Waits (bounded polling of a file the replica writes) until a replica noted its start."""
    with anyio.fail_after(20):
        while not started.exists() or not started.read_text().strip():
            await asyncio.sleep(0.01)


def _doomed(patch: str, launch_by: str = "") -> str:
    """The script of a launcher that schedules the pickled dry run ``argv[2]`` in the state root
    ``argv[1]`` (``sched``: its scheduler) with ``patch`` applied (which kills it on its way);
    ``launch_by``: the function of ``patch`` that replaces ``AppLauncher.launch``."""
    head = "import asyncio, os, pickle, signal, sys\nsched = None\n"
    if launch_by:
        patch += f"""
    from asynctorchx.schedulers._local.launch import AppLauncher
    AppLauncher.launch = {launch_by}
    """
    launch = """
    from asynctorchx.schedulers.local import LocalScheduler

    async def main(root, dryrun):
        global sched
        with open(dryrun, "rb") as f:
            info = pickle.load(f)
        async with LocalScheduler("doomed", local_root=root) as sched:
            await sched.schedule(info)

    asyncio.run(main(*sys.argv[1:3]))
    """
    return head + textwrap.dedent(patch) + textwrap.dedent(launch)


DOOMED = _doomed(
    """
    async def die(self, app):  # between the claim (and registration) and the first spawn
        os.kill(os.getpid(), signal.SIGKILL)
    """,
    launch_by="die",
)


@pytest.mark.timeout(60)
async def test_a_launcher_killed_between_claim_and_spawn_leaves_a_failed_app(
    tmp_path: Path,
) -> None:
    """A launcher SIGKILLed after claiming an app id, before starting anything, leaves nothing
    running and, once its watchdog has noticed, an app that reads FAILED (its launcher died), no
    claim, and a dry run that cannot be scheduled again."""
    root, started, go = tmp_path / "root", tmp_path / "started", tmp_path / "go"
    dryrun = tmp_path / "dryrun.pickle"
    info = LocalScheduler("doomed", local_root=root).submit_dryrun(_counting_app(started, go), {})
    dryrun.write_bytes(pickle.dumps(info))
    proc = await anyio.to_thread.run_sync(
        lambda: subprocess.run(
            [sys.executable, "-c", DOOMED, str(root), str(dryrun)], capture_output=True, timeout=40
        )
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    app_id = info.request.app_id
    records = str(root / ".apps")
    async with LocalScheduler("reader", local_root=root) as reader:
        with anyio.fail_after(20):
            # (bounded: the watchdog; PENDING while it holds the claim, before it records it)
            while (desc := await reader.describe(app_id)) is None or not is_terminal(desc.state):
                assert desc is None or desc.state == AppState.PENDING, desc
                await asyncio.sleep(0.02)
        assert desc.state == AppState.FAILED and "launcher" in desc.msg and "died" in desc.msg
        assert not os.path.lexists(protocol.claim_path(records, app_id))
        with pytest.raises(ValueError, match="already scheduled"):
            await reader.schedule(info)
    assert not started.exists() and _marked(app_id) == []


async def test_the_claim_goes_with_a_failed_submit_and_with_the_app_s_end(tmp_path: Path) -> None:
    """A submit that fails after its claim (a missing program) leaves no claim and no record, and
    the claim of an app that ran is removed once its record is terminal."""
    root = tmp_path / "root"
    records = str(root / ".apps")
    async with LocalScheduler("claims", local_root=root) as s:
        bad = s.submit_dryrun(AppDef("bad", [Role("main", image="x", entrypoint="no-such-x")]), {})
        with pytest.raises(LaunchSpecError):
            await s.schedule(bad)
        assert _claims_and_records(records) == []
        good = s.submit_dryrun(AppDef("good", [Role("main", image="x", entrypoint="true")]), {})
        app_id = await s.schedule(good)
        assert os.path.lexists(protocol.claim_path(records, app_id))
        assert (await wait_for(s, app_id)).state == AppState.SUCCEEDED
        with anyio.fail_after(20):
            while os.path.lexists(protocol.claim_path(records, app_id)):  # (the record writer)
                await asyncio.sleep(0.01)
        assert _claims_and_records(records) == [f"{app_id}.json"]


def _holder(records: str) -> str:
    """A holder file for the claims of this test (``protocol.make_holder``), its lock kept."""
    os.makedirs(records, exist_ok=True)
    made = protocol.make_holder(records, f"test.{os.getpid()}")
    assert made is not None
    return made[0]


def test_without_hard_links_a_claim_is_a_file_of_its_own_and_still_exclusive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a file system that refuses hard links (EPERM) a claim is made as a file of its own:
    the first claim of an id wins, the second is refused."""
    records = str(tmp_path)
    holder = _holder(records)

    def no_links(src: str, dst: str) -> None:  # fault injection: a file system without links
        raise PermissionError(errno.EPERM, "Operation not permitted", src)

    monkeypatch.setattr(os, "link", no_links)
    assert protocol.claim_app(records, "app-1", holder) is True
    assert protocol.claim_app(records, "app-1", holder) is False
    assert os.path.isfile(protocol.claim_path(records, "app-1"))
    protocol.drop_claim(records, "app-1")
    assert protocol.claim_app(records, "app-1", holder) is True


def test_a_holder_file_with_too_many_links_gives_claims_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the holder file has as many links as the file system allows (EMLINK), a claim is a
    file of its own, still exclusive; the claims made before stay."""
    records = str(tmp_path)
    holder = _holder(records)
    assert protocol.claim_app(records, "old", holder)

    def full(src: str, dst: str) -> None:  # fault injection: the holder's inode is full
        raise OSError(errno.EMLINK, "Too many links", src)

    monkeypatch.setattr(os, "link", full)
    assert protocol.claim_app(records, "new", holder) is True
    assert protocol.claim_app(records, "new", holder) is False
    assert protocol.claim_app(records, "old", holder) is False
    assert os.stat(protocol.claim_path(records, "new")).st_ino != os.stat(holder).st_ino
    assert os.stat(protocol.claim_path(records, "old")).st_ino == os.stat(holder).st_ino


STALE = _doomed(
    """
    from asynctorchx.schedulers._local.records import RecordStore

    real_claim = RecordStore.claim

    def claim_then_die(self, app_id):  # between the claim's link and the watchdog's registration
        claimed = real_claim(self, app_id)
        print(claimed, sched._runtime.watchdog.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    RecordStore.claim = claim_then_die
    """
)


REPLACED = _doomed(
    """
    async def replace_watchdog_then_die(self, app):  # claimed, not started (a long ship, say)
        watchdog = self._rt.watchdog
        old = watchdog.pid
        os.kill(old, signal.SIGKILL)
        while watchdog.pid in (old, None):  # (replaced on the event loop, through its pidfd)
            await asyncio.sleep(0.01)
        print(watchdog.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """,
    launch_by="replace_watchdog_then_die",
)


def _gone(pid: int) -> bool:
    """True when ``pid`` exited (a zombie counts: it holds no file any more)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return True
    return data[data.rindex(b")") + 2 :].split()[0] in (b"Z", b"X")


async def _leave_stale_claim(script: str, root: Path, dryrun: Path) -> int:
    """Runs ``script`` (a launcher that SIGKILLs itself on its way) on the pickled dry run; returns
    the pid it printed last (its watchdog's) once that has exited."""
    proc = await anyio.to_thread.run_sync(
        lambda: subprocess.run(
            [sys.executable, "-c", script, str(root), str(dryrun)], capture_output=True, timeout=40
        )
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    watchdog = int(proc.stdout.split()[-1])
    await poll_until(lambda: _gone(watchdog), "the dead launcher's watchdog to exit")
    return watchdog


def _stale_dryrun(tmp_path: Path, root: Path) -> tuple[AppDryRunInfo[Any], Path, Path, Path]:
    """A counting app's dry run, pickled; with its ``started`` and ``go`` files."""
    started, go, dryrun = tmp_path / "started", tmp_path / "go", tmp_path / "dryrun.pickle"
    info = LocalScheduler("doomed", local_root=root).submit_dryrun(_counting_app(started, go), {})
    dryrun.write_bytes(pickle.dumps(info))
    return info, dryrun, started, go


@pytest.mark.timeout(60)
async def test_a_launcher_killed_between_its_claim_and_its_watchdog_leaves_a_dry_run_that_runs(
    tmp_path: Path,
) -> None:
    """A launcher SIGKILLed right after its claim's link, before its watchdog knew of the app,
    leaves a claim and no record; once its watchdog has exited, scheduling the dry run again takes
    the claim over and runs the app once, and no claim or holder file is left."""
    root = tmp_path / "root"
    info, dryrun, started, go = _stale_dryrun(tmp_path, root)
    await _leave_stale_claim(STALE, root, dryrun)
    app_id = info.request.app_id
    records = str(root / ".apps")
    assert _claims_and_records(records) == [f"claim:{app_id}"]
    async with LocalScheduler("retry", local_root=root) as s:
        with anyio.fail_after(20):
            assert await s.schedule(info) == app_id
        await wait_started(started)
        go.touch()
        assert (await wait_for(s, app_id)).state == AppState.SUCCEEDED
    assert len(started.read_text().split()) == 1
    assert _claims_and_records(records) == [f"{app_id}.json"]
    assert os.listdir(os.path.join(records, protocol.CLAIMS_DIR)) == []


@pytest.mark.timeout(90)
async def test_two_processes_retrying_one_stale_claim_at_once_start_the_app_once(
    tmp_path: Path,
) -> None:
    """Two processes released by one barrier schedule a dry run whose launcher died between its
    claim and its watchdog: one takes the claim over and runs the app, the other is told it is
    already scheduled."""
    root = tmp_path / "root"
    _, dryrun, started, go = _stale_dryrun(tmp_path, root)
    await _leave_stale_claim(STALE, root, dryrun)
    outs = await _schedule_in_two_processes(tmp_path, root, dryrun, go, started)
    assert sorted(out.split()[0] for _, out in outs) == ["lost", "won"], outs
    assert "already scheduled" in next(o for _, o in outs if o.startswith("lost"))
    assert len(started.read_text().split()) == 1


@pytest.mark.timeout(60)
async def test_a_stale_claim_whose_app_left_processes_is_refused_until_they_are_gone(
    tmp_path: Path,
) -> None:
    """A stale claim is not taken over while a process marked as a replica of the app runs: the
    submit fails naming its pid and starts nothing; once it is gone the dry run runs."""
    root = tmp_path / "root"
    info, dryrun, started, go = _stale_dryrun(tmp_path, root)
    await _leave_stale_claim(STALE, root, dryrun)
    app_id = info.request.app_id
    env = {**os.environ, protocol.MARKER_ENV: protocol.replica_marker(app_id, "main", 0)}
    left = subprocess.Popen(["sleep", "60"], env=env)
    try:
        async with LocalScheduler("retry", local_root=root) as s:
            with pytest.raises(ValueError, match=rf"processes of it are left \(pids {left.pid}\)"):
                await s.schedule(info)
            assert not started.exists()
            left.kill()
            left.wait()
            app_id = await s.schedule(info)
            go.touch()
            assert (await wait_for(s, app_id)).state == AppState.SUCCEEDED
    finally:
        if left.poll() is None:
            left.kill()
            left.wait()
    assert len(started.read_text().split()) == 1


@pytest.mark.timeout(60)
async def test_a_watchdog_replaced_while_an_app_is_claimed_records_it_when_the_launcher_dies(
    tmp_path: Path,
) -> None:
    """A watchdog that replaced a dead one while an app was claimed but not started knows of the
    app: the launcher SIGKILLed then leaves an app that reads FAILED (its launcher died) in
    ``describe`` and ``list``, no claim, and nothing started."""
    root = tmp_path / "root"
    info, dryrun, started, _ = _stale_dryrun(tmp_path, root)
    await _leave_stale_claim(REPLACED, root, dryrun)
    app_id = info.request.app_id
    async with LocalScheduler("reader", local_root=root) as reader:
        desc = await reader.describe(app_id)
        assert desc is not None and desc.state == AppState.FAILED, desc
        assert "launcher" in desc.msg and "died" in desc.msg
        assert [(a.app_id, a.state) for a in await reader.list()] == [(app_id, AppState.FAILED)]
        assert not os.path.lexists(protocol.claim_path(str(root / ".apps"), app_id))
    assert not started.exists() and _marked(app_id) == []


async def test_a_claim_of_an_older_version_is_refused_saying_what_to_remove(
    tmp_path: Path,
) -> None:
    """A claim that links the older versions' shared file cannot be told stale: the submit fails
    naming the claim to remove if no launcher runs; once it is removed the dry run runs."""
    root = tmp_path / "root"
    claims = root / ".apps" / protocol.CLAIMS_DIR
    claims.mkdir(parents=True)
    (claims / protocol.CLAIM_FILE).touch()
    async with LocalScheduler("legacy", local_root=root) as s:
        info = s.submit_dryrun(AppDef("old", [Role("main", image="x", entrypoint="true")]), {})
        claim = claims / info.request.app_id
        os.link(claims / protocol.CLAIM_FILE, claim)
        with pytest.raises(ValueError, match=f"remove {claim} and schedule it again"):
            await s.schedule(info)
        claim.unlink()
        app_id = await s.schedule(info)
        assert (await wait_for(s, app_id)).state == AppState.SUCCEEDED


def test_a_claim_is_taken_over_only_once_nobody_holds_its_lock(tmp_path: Path) -> None:
    """``take_stale_claim`` leaves a claim whose holder's lock is held, takes it over once the
    lock is let go, and then reports it held by its new holder."""
    records = str(tmp_path)
    os.makedirs(os.path.join(records, protocol.CLAIMS_DIR))
    first = protocol.make_holder(records, "first")
    second = protocol.make_holder(records, "second")
    assert first is not None and second is not None
    assert protocol.claim_app(records, "app-1", first[0])
    assert protocol.take_stale_claim(records, "app-1", second[0]) == protocol.HELD
    os.close(first[1])  # its launcher and watchdog are gone
    assert protocol.take_stale_claim(records, "app-1", second[0], lambda: False) == protocol.HELD
    assert protocol.take_stale_claim(records, "app-1", second[0]) == protocol.TAKEN
    assert os.stat(protocol.claim_path(records, "app-1")).st_ino == os.stat(second[0]).st_ino
    assert protocol.take_stale_claim(records, "app-1", first[0]) == protocol.HELD
    assert protocol.drop_dead_holders(records, None) == 1
    assert not os.path.exists(first[0]) and os.path.exists(second[0])
    os.close(second[1])


@pytest.mark.parametrize("err", [errno.EACCES, errno.ENOSPC, errno.EROFS])
async def test_a_claim_that_cannot_be_made_fails_the_submit_and_starts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int
) -> None:
    """A claims directory that cannot be written (no permission, a full disk, a read-only file
    system) fails the submit with a LaunchError naming the claim and the error; nothing starts
    and no claim or record is left."""
    root, started, go = tmp_path / "root", tmp_path / "started", tmp_path / "go"
    records = str(root / ".apps")
    claims = os.path.join(records, protocol.CLAIMS_DIR)
    real_link = os.link

    def failing(src: str, dst: str, **kw: Any) -> None:  # fault injection: the claims directory
        if os.path.dirname(dst) == claims:
            raise OSError(err, os.strerror(err), dst)
        real_link(src, dst, **kw)

    monkeypatch.setattr(os, "link", failing)
    async with LocalScheduler("nolink", local_root=root) as s:
        info = s.submit_dryrun(_counting_app(started, go), {})
        with pytest.raises(LaunchError, match=rf"the app's claim.*{os.strerror(err)}"):
            await s.schedule(info)
        assert info.request.app_id not in s._runtime.apps
    assert not started.exists() and _claims_and_records(records) == []


@pytest.mark.parametrize("bad", ["a/b", "../escaped", "a\0b", ".hidden", ""])
async def test_a_dry_run_whose_app_id_cannot_be_a_file_name_is_refused(
    tmp_path: Path, bad: str
) -> None:
    """A dry run whose request names an app id with a ``/``, a NUL or a leading dot (made by hand,
    not by ``submit_dryrun``) is refused naming the id, before any claim, file or process."""
    root, started, go = tmp_path / "root" / "state", tmp_path / "started", tmp_path / "go"
    async with LocalScheduler("bad", local_root=root) as s:
        info = s.submit_dryrun(_counting_app(started, go), {})
        info.request = dataclasses.replace(info.request, app_id=bad)
        with pytest.raises(ValueError, match=f"app id {re.escape(repr(bad))} .*not a local app id"):
            await s.schedule(info)
    assert not started.exists()
    assert _claims_and_records(str(root / ".apps")) == []
    assert sorted(os.listdir(tmp_path / "root")) == ["state"]


def _holders_open_in(pid: int) -> set[str]:
    """The holder files (``protocol.HOLDER_PREFIX``) process ``pid`` has open."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if os.path.basename(target).startswith(protocol.HOLDER_PREFIX):
                found.add(target)
    return found


async def test_the_watchdog_holds_the_claims_lock_even_after_the_claims_directory_is_made_again(
    tmp_path: Path,
) -> None:
    """The watchdog keeps the lock of its launcher's claims open (so no claim is taken over while
    it may still record the app); when the claims directory was removed under a running scheduler
    its next launch makes a new holder file and the replacement watchdog holds that one too."""
    root = tmp_path / "root"
    claims = root / ".apps" / protocol.CLAIMS_DIR
    app = AppDef("held", [Role("main", image="x", entrypoint="true")])
    async with LocalScheduler("held", local_root=root) as s:
        app_id = await s.schedule(s.submit_dryrun(app, {}))
        await wait_for(s, app_id)
        watchdog = s._runtime.watchdog
        holder = s._runtime.store.holder
        assert holder is not None and watchdog.pid is not None
        assert _holders_open_in(watchdog.pid) == {holder}
        shutil.rmtree(claims)
        app_id = await s.schedule(s.submit_dryrun(app, {}))
        assert (await wait_for(s, app_id)).state == AppState.SUCCEEDED
        new_holder = s._runtime.store.holder
        assert new_holder is not None and new_holder != holder and os.path.exists(new_holder)
        assert watchdog.restarts == 1 and watchdog.pid is not None
        assert new_holder in _holders_open_in(watchdog.pid)
    assert os.listdir(claims) == []


def test_temporary_claim_names_left_by_a_killed_process_are_removed_after_a_minute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The names a holder being made (``.new.``) or a claim being taken over (``.take.``) has for
    microseconds are removed by ``drop_dead_holders`` once over a minute old, not before."""
    records = str(tmp_path)
    holder = _holder(records)
    claims = os.path.join(records, protocol.CLAIMS_DIR)
    os.link(holder, os.path.join(claims, ".take.1.2"))
    Path(claims, ".new.1.2.ab").touch()
    protocol.drop_dead_holders(records, holder)
    assert sorted(os.listdir(claims)) == sorted(
        [".new.1.2.ab", ".take.1.2", os.path.basename(holder)]
    )
    now = time.time()
    monkeypatch.setattr(protocol.time, "time", lambda: now + 61)  # fake clock: a minute later
    protocol.drop_dead_holders(records, holder)
    assert os.listdir(claims) == [os.path.basename(holder)]


@pytest.mark.timeout(60)
async def test_a_cancel_asked_of_a_launcher_that_died_does_not_cancel_the_retried_dry_run(
    tmp_path: Path,
) -> None:
    """Another process cancels an app while it is being submitted (a marker is left), and its
    launcher dies before its watchdog knew of it (a stale claim, no record): scheduling the dry
    run again takes the claim over without the old cancel, and the app runs to its end."""
    from asynctorchx.schedulers._local.records import RecordStore

    root, go = tmp_path / "root", tmp_path / "go"
    script = f"while [ ! -e {go} ]; do sleep 0.01; done"
    app = AppDef("twice", [Role("main", image="x", entrypoint="sh", args=["-c", script])])
    info = LocalScheduler("doomed", local_root=root).submit_dryrun(app, {})
    app_id = info.request.app_id
    launcher = RecordStore(root, {"backend": "local_cwd", "session": "doomed"})
    launcher.hold()
    assert launcher.claim(app_id)  # being submitted (a long local_dir ship, say)
    async with LocalScheduler("other", local_root=root) as other:
        desc = await other.describe(app_id)
        assert desc is not None and desc.state == AppState.PENDING
        await other.cancel(app_id)
    assert (root / ".apps" / f"{app_id}.cancel").exists()
    for fd in launcher.lock_fds():  # the launcher dies: its locks go with its descriptors
        os.close(fd)
    launcher.holder_fd, launcher._old_holder_fds = -1, []
    async with LocalScheduler("retry", local_root=root) as s:
        assert await s.describe(app_id) is None
        with anyio.fail_after(20):
            assert await s.schedule(info) == app_id
        go.touch()
        final = await wait_for(s, app_id)
        assert final.state == AppState.SUCCEEDED, final.msg
