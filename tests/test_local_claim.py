"""The claim of a local app's id (a hard link under ``.apps/.claims``): one dry run scheduled at
once by two schedulers or two processes starts once, the other submit fails cleanly and leaves
nothing; a launcher killed after claiming leaves a FAILED app and no claim; claims go with failed
submits and terminal records, and work where hard links do not."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest
from _local_env import wait_for

from asynctorchx.schedulers._local import contain, protocol
from asynctorchx.schedulers.local import LaunchSpecError, LocalScheduler
from asynctorchx.specs import AppDef, AppState, Role


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
    found = [f"claim:{n}" for n in claims if n != protocol.CLAIM_FILE]
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
    import asyncio, os, pickle, sys
    from asynctorchx.schedulers.local import LaunchSpecError, LocalScheduler
    from asynctorchx.specs import AppDef, Role

    async def main(root, dryrun, ready, fifo):
        with open(dryrun, "rb") as f:
            info = pickle.load(f)
        async with LocalScheduler("race", local_root=root) as s:
            warm = s.submit_dryrun(AppDef("warm", [Role("main", image="x", entrypoint="true")]), {})
            await until_done(s, await s.schedule(warm))  # the state root and session are ready
            open(os.path.join(ready, str(os.getpid())), "w").close()
            with open(fifo, "rb") as f:  # the barrier: both read one byte of one write
                f.read(1)
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


@pytest.mark.timeout(90)
async def test_two_processes_scheduling_one_pickled_dry_run_at_once_start_it_once(
    tmp_path: Path,
) -> None:
    """Two processes released by one barrier schedule the same pickled dry run: one wins, the
    other gets the "already scheduled" ValueError, and the app's replica started once."""
    root, started, go = tmp_path / "root", tmp_path / "started", tmp_path / "go"
    ready, fifo, dryrun = tmp_path / "ready", tmp_path / "barrier", tmp_path / "dryrun.pickle"
    ready.mkdir()
    os.mkfifo(fifo)
    info = LocalScheduler("race", local_root=root).submit_dryrun(_counting_app(started, go), {})
    dryrun.write_bytes(pickle.dumps(info))
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
    verdicts = sorted(out.split()[0] for out, _ in outs)
    assert verdicts == ["lost", "won"], outs
    assert "already scheduled" in next(o for o, _ in outs if o.startswith("lost"))
    assert len(started.read_text().split()) == 1
    record = root / ".apps" / f"{info.request.app_id}.json"
    assert {v["owner"]["pid"] for v in _versions(record)} == {  # type: ignore[index]
        next(p.pid for p, (o, _) in zip(procs, outs, strict=True) if o.startswith("won"))
    }


async def wait_started(started: Path) -> None:
    """Waits (bounded polling of a file the replica writes) until a replica noted its start."""
    while not started.exists() or not started.read_text().strip():
        await asyncio.sleep(0.01)


DOOMED = textwrap.dedent(
    """
    import asyncio, os, pickle, signal, sys
    from asynctorchx.schedulers._local.launch import AppLauncher
    from asynctorchx.schedulers.local import LaunchSpecError, LocalScheduler

    async def die(self, app):  # between the claim (and registration) and the first spawn
        os.kill(os.getpid(), signal.SIGKILL)

    AppLauncher.launch = die

    async def main(root, dryrun):
        with open(dryrun, "rb") as f:
            info = pickle.load(f)
        async with LocalScheduler("doomed", local_root=root) as s:
            await s.schedule(info)

    asyncio.run(main(*sys.argv[1:3]))
    """
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
            while (desc := await reader.describe(app_id)) is None:  # (bounded: the watchdog)
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


def test_without_hard_links_a_claim_is_a_file_of_its_own_and_still_exclusive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a file system that refuses hard links (EPERM) a claim is made as a file of its own:
    the first claim of an id wins, the second is refused."""

    def no_links(src: str, dst: str) -> None:  # fault injection: a file system without links
        raise PermissionError(errno.EPERM, "Operation not permitted", src)

    monkeypatch.setattr(os, "link", no_links)
    records = str(tmp_path)
    assert protocol.claim_app(records, "app-1") is True
    assert protocol.claim_app(records, "app-1") is False
    assert os.path.isfile(protocol.claim_path(records, "app-1"))
    protocol.drop_claim(records, "app-1")
    assert protocol.claim_app(records, "app-1") is True


def test_a_shared_claim_file_with_too_many_links_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the shared file has as many links as the file system allows (EMLINK), the claim links
    a new shared file; the claims made before stay."""
    records = str(tmp_path)
    assert protocol.claim_app(records, "old")
    shared = os.path.join(records, protocol.CLAIMS_DIR, protocol.CLAIM_FILE)
    first = os.stat(shared).st_ino
    real_link = os.link

    def full(src: str, dst: str) -> None:  # fault injection: the first inode is full
        if os.stat(src).st_ino == first:
            raise OSError(errno.EMLINK, "Too many links", src)
        real_link(src, dst)

    monkeypatch.setattr(os, "link", full)
    assert protocol.claim_app(records, "new") is True
    assert protocol.claim_app(records, "old") is False
    assert os.stat(shared).st_ino != first
    assert os.stat(protocol.claim_path(records, "new")).st_ino == os.stat(shared).st_ino
