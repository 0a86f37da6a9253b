"""A local replica's log directory and files are made on its first output (issue 17): a quiet app
creates nothing, its logs read as empty; output that arrives while the files are made is kept,
in order, with the time it was read; a failure to make them neither blocks nor fails the app."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import pytest
from _local_env import GATE, wait_for

from asynctorchx.logs import INDEX_FILE, LOG_FILES, LogFiles, ReplicaLogWriter
from asynctorchx.schedulers._local.request import SPACE_RESERVE, SPACE_RESERVE_SIZE
from asynctorchx.schedulers.api import Stream
from asynctorchx.schedulers.local import LaunchError, LocalScheduler
from asynctorchx.specs import AppDef, AppState, Role, macros

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "root"


@pytest.fixture
async def sched(root: Path) -> AsyncIterator[LocalScheduler]:
    s = LocalScheduler("lazy", local_root=root)
    yield s
    await s.close()


def role(script: str, tmp_path: Path, **env: str) -> Role:
    """A role running ``sh -c script`` whose torchelastic error file is outside its log directory
    (so nothing of the app's log directory is needed before its first output)."""
    env = {"TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.json"), **env}
    return Role("main", image="ignored", entrypoint="sh", args=["-c", script], env=env)


def app(*roles: Role) -> AppDef:
    return AppDef("app", list(roles))


async def read(s: LocalScheduler, app_id: str, **kw: Any) -> list[str]:
    with anyio.fail_after(20):
        return [line async for line in s.log_iter(app_id, "main", 0, **kw)]


@pytest.fixture
def held_files(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Holds the making of log files (``LogFiles.open``) until released: (entered, release)."""
    entered, release = threading.Event(), threading.Event()
    real = LogFiles.open

    def held(directory: str | os.PathLike[str]) -> LogFiles:
        entered.set()
        if not release.wait(20):
            raise TimeoutError("the test never released the log files")
        return real(directory)

    monkeypatch.setattr(LogFiles, "open", staticmethod(held))
    yield entered, release
    release.set()


async def wait_thread_event(event: threading.Event) -> None:
    with anyio.fail_after(20):
        while not event.is_set():
            await asyncio.sleep(0.005)


async def test_a_quiet_app_leaves_no_directory_and_its_logs_are_empty(
    sched: LocalScheduler, tmp_path: Path
) -> None:
    """An app that writes nothing and ends at once creates no log directory at all (app, role,
    replica), and every read of its logs is empty: all, stdout, stderr, since/until, entries,
    follow."""
    app_id = await sched.submit(app(role("true", tmp_path)), {})
    info = sched.submit_dryrun(app(role("true", tmp_path)), {})
    session_dir = Path(info.request.app_dir).parent
    assert (await wait_for(sched, app_id)).state == AppState.SUCCEEDED
    assert not (session_dir / app_id).exists()
    assert await read(sched, app_id) == []
    assert await read(sched, app_id, should_tail=True) == []
    assert await read(sched, app_id, streams=Stream.STDOUT) == []
    assert await read(sched, app_id, streams=Stream.STDERR) == []
    now = datetime.now()
    assert await read(sched, app_id, since=datetime.fromtimestamp(0), until=now) == []
    with anyio.fail_after(20):
        assert [e async for e in sched.log_entries(app_id, "main", 0)] == []
    assert not (session_dir / app_id).exists()


async def test_a_quiet_replica_that_runs_a_while_gets_its_files_before_its_output(
    sched: LocalScheduler, tmp_path: Path
) -> None:
    """A replica still running EARLY_LOG_FILES after its start gets its (empty) log files then,
    before any output, so that its first output does not wait for them; a follower waiting on it
    meanwhile ends with exactly what it printed."""
    go = tmp_path / "go"
    app_id = await sched.submit(app(role(f"{GATE}; echo last", tmp_path, GO=str(go))), {})
    info = sched.submit_dryrun(app(role("true", tmp_path)), {})
    replica_dir = Path(info.request.app_dir).parent / app_id / "main" / "0"
    follow = asyncio.create_task(read(sched, app_id, should_tail=True))
    with anyio.fail_after(20):
        while not (replica_dir / "combined.log").exists():
            await asyncio.sleep(0.01)
    assert sorted(os.listdir(replica_dir)) == sorted([*LOG_FILES.values(), INDEX_FILE])
    assert (replica_dir / "combined.log").read_bytes() == b""
    assert not follow.done()
    go.touch()
    assert (await wait_for(sched, app_id)).state == AppState.SUCCEEDED
    assert await follow == ["last\n"]


async def test_a_quiet_replica_with_the_default_error_file_makes_no_directory(
    sched: LocalScheduler,
) -> None:
    """The default torchelastic error file is in the session's ``.errors`` directory, which exists
    when the replica starts (it may write the file at any time): a quiet replica makes no
    directory of its own, and the session's ``.errors`` (with the space set aside for loss
    markers), if removed, is made again."""
    script = 'test -d "${TORCHELASTIC_ERROR_FILE%/*}"'
    quiet = Role("main", image="ignored", entrypoint="sh", args=["-c", script])
    session_dir = Path(sched.submit_dryrun(app(quiet), {}).request.app_dir).parent
    for _ in range(2):
        app_id = await sched.submit(app(quiet), {})
        assert (await wait_for(sched, app_id)).state == AppState.SUCCEEDED
        assert not (session_dir / app_id).exists()
        assert await read(sched, app_id) == []
        assert sorted(os.listdir(session_dir)) == [".errors"]
        reserve = (session_dir / ".errors" / SPACE_RESERVE).stat()
        assert reserve.st_blocks * 512 >= SPACE_RESERVE_SIZE  # allocated, not sparse
        shutil.rmtree(session_dir / ".errors")


async def test_output_after_a_delay_is_followed_in_process_and_from_another_process(
    sched: LocalScheduler, root: Path, tmp_path: Path
) -> None:
    """An app that prints only after a while (its directory missing until then) is followed by a
    reader of this process and one of another process, each getting every line exactly once."""
    go = tmp_path / "go"
    script = f"{GATE}; for i in 1 2 3; do echo line $i; echo err $i >&2; sleep 0.05; done"
    app_id = await sched.submit(app(role(script, tmp_path, GO=str(go))), {})
    other = (
        "import asyncio, sys\n"
        "from asynctorchx.schedulers.local import LocalScheduler\n"
        "async def main():\n"
        f"    s = LocalScheduler('other', local_root={str(root)!r})\n"
        "    print('ready', flush=True)\n"
        f"    async for line in s.log_iter({app_id!r}, 'main', 0, should_tail=True):\n"
        "        print(line, end='', flush=True)\n"
        "    await s.close()\n"
        "asyncio.run(main())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", other, stdout=subprocess.PIPE, env=env
    )
    try:
        assert proc.stdout is not None
        with anyio.fail_after(20):
            assert await proc.stdout.readline() == b"ready\n"
        follow = asyncio.create_task(read(sched, app_id, should_tail=True))
        await asyncio.sleep(0.3)  # both followers wait on a missing directory
        go.touch()
        assert (await wait_for(sched, app_id)).state == AppState.SUCCEEDED
        expected = [f"{s} {i}\n" for i in (1, 2, 3) for s in ("line", "err")]
        assert sorted(await follow) == sorted(expected)
        with anyio.fail_after(20):
            out, _ = await proc.communicate()
        assert sorted(out.decode().splitlines(keepends=True)) == sorted(expected)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_output_read_while_the_files_are_made_is_kept_in_order_with_its_read_time(
    sched: LocalScheduler, tmp_path: Path, held_files: tuple[threading.Event, threading.Event]
) -> None:
    """Output read before the files exist is written once they do, in order, each chunk timed
    when it was read (not when written): since/until select it within 10 ms."""
    entered, release = held_files
    script = 'echo first; while [ ! -e "$GO" ]; do sleep 0.01; done; seq 1 20000'
    go = tmp_path / "go"
    app_id = await sched.submit(app(role(script, tmp_path, GO=str(go))), {})
    await wait_thread_event(entered)
    first_read_by = time.time()
    go.touch()  # 20000 lines more than a pipe holds: the replica waits for the files too
    await asyncio.sleep(0.3)
    released_at = time.time()
    release.set()
    assert (await wait_for(sched, app_id)).state == AppState.SUCCEEDED
    expected = ["first\n"] + [f"{i}\n" for i in range(1, 20001)]
    assert await read(sched, app_id) == expected
    assert await read(sched, app_id, streams=Stream.STDOUT) == expected
    early = await read(sched, app_id, until=datetime.fromtimestamp(first_read_by + 0.01))
    assert early == ["first\n"]
    late = await read(sched, app_id, since=datetime.fromtimestamp(released_at - 0.01))
    assert late and "first\n" not in late


async def test_logs_that_cannot_be_made_keep_the_app_running_and_say_so(
    sched: LocalScheduler, tmp_path: Path
) -> None:
    """When the replica's log directory cannot be made (a file where it goes), the app still
    runs to its end without blocking on a full pipe, its record says the output was lost and
    how much, and its logs read as empty."""
    go = tmp_path / "go"
    script = f"{GATE}; seq 1 100000; echo done >&2"
    app_id = await sched.submit(app(role(script, tmp_path, GO=str(go))), {})
    app_dir = Path(sched.submit_dryrun(app(role("true", tmp_path)), {}).request.app_dir).parent
    (app_dir / app_id).write_text("in the way\n")
    go.touch()
    desc = await wait_for(sched, app_id)
    assert desc.state == AppState.SUCCEEDED
    lost = sum(len(f"{i}\n") for i in range(1, 100001)) + len("done\n")
    assert "log output lost" in desc.msg and f"{lost} bytes of combined.log" in desc.msg
    assert await read(sched, app_id) == []
    assert (app_dir / app_id).read_text() == "in the way\n"


async def test_a_quiet_app_scheduled_twice_is_refused_without_a_directory(
    sched: LocalScheduler, root: Path, tmp_path: Path
) -> None:
    """A dry run of an app that left no directory cannot be scheduled again, by this scheduler
    (ValueError) or by another one over the same state root (its record exists)."""
    info = sched.submit_dryrun(app(role("true", tmp_path)), {})
    app_id = await sched.schedule(info)
    assert (await wait_for(sched, app_id)).state == AppState.SUCCEEDED
    assert not os.path.exists(info.request.app_dir)
    with pytest.raises(ValueError, match="already scheduled"):
        await sched.schedule(info)
    async with LocalScheduler("lazy", local_root=root) as other:
        with pytest.raises(ValueError, match="already scheduled"):
            await other.schedule(info)
    assert not os.path.exists(info.request.app_dir)


async def test_a_restarted_replica_appends_to_the_files_made_by_its_first_output(
    sched: LocalScheduler, tmp_path: Path
) -> None:
    """A replica retried after it failed (max_retries) writes its second attempt after the first
    one's output, in the same files, made once."""
    marker = tmp_path / "once"
    script = f"if [ -e {marker} ]; then echo second; else touch {marker}; echo first; exit 1; fi"
    r = role(script, tmp_path)
    r.max_retries = 1
    app_id = await sched.submit(app(r), {})
    assert (await wait_for(sched, app_id)).state == AppState.SUCCEEDED
    assert await read(sched, app_id) == ["first\n", "second\n"]
    app_dir = Path(sched.submit_dryrun(app(r), {}).request.app_dir).parent / app_id
    assert sorted(os.listdir(app_dir / "main" / "0")) == sorted([*LOG_FILES.values(), INDEX_FILE])


async def test_a_writer_closed_before_its_files_are_made_writes_what_it_read(
    tmp_path: Path,
) -> None:
    """A lazy writer closed while its files were asked for but not made yet makes them itself and
    writes everything read (held and left in the pipe); the late ``make_files``/``files_made``
    then do nothing."""
    asked: list[ReplicaLogWriter] = []
    directory = tmp_path / "app" / "main" / "0"
    writer = ReplicaLogWriter(directory, opener=asked.append)
    r, w = os.pipe()
    writer.attach(r, Stream.STDOUT)
    os.write(w, b"one\n")
    with anyio.fail_after(20):
        while not asked:
            await asyncio.sleep(0.005)
    os.write(w, b"two\n")  # left in the pipe: reading paused
    os.close(w)
    assert not directory.exists()
    writer.close()
    assert (directory / "stdout.log").read_bytes() == b"one\ntwo\n"
    assert (directory / "combined.log").read_bytes() == b"one\ntwo\n"
    writer.make_files()
    writer.files_made()
    assert (directory / "stdout.log").read_bytes() == b"one\ntwo\n"
    assert writer.lost_bytes == {}


async def test_a_quiet_writer_closes_without_making_anything(tmp_path: Path) -> None:
    """A lazy writer whose pipes end without output never asks for its files and makes none."""
    asked: list[ReplicaLogWriter] = []
    writer = ReplicaLogWriter(tmp_path / "app" / "main" / "0", opener=asked.append)
    r, w = os.pipe()
    writer.attach(r, Stream.STDERR)
    os.close(w)
    with anyio.fail_after(20):
        await writer.wait_drained()
    writer.close()
    assert asked == [] and not (tmp_path / "app").exists()


@pytest.mark.parametrize("ending", ["files made", "files failed", "closed quiet"])
async def test_a_lazy_writer_says_once_when_it_no_longer_needs_descriptors_for_its_files(
    tmp_path: Path, ending: str
) -> None:
    """``on_files`` (the launch's promise of descriptors for the files) is called exactly once,
    when the files were made, when they could not be made, or when the writer closed without
    them; never before."""
    asked: list[ReplicaLogWriter] = []
    settled: list[str] = []
    parent = tmp_path / "app"
    if ending == "files failed":
        parent.write_text("a file where the directory should be")
    writer = ReplicaLogWriter(
        parent / "main" / "0", opener=asked.append, on_files=lambda: settled.append(ending)
    )
    r, w = os.pipe()
    writer.attach(r, Stream.STDOUT)
    if ending != "closed quiet":
        os.write(w, b"out\n")
        with anyio.fail_after(20):
            while not asked:
                await asyncio.sleep(0.005)
        assert settled == []  # asked for, not made yet
        writer.make_files()
        assert settled == []  # (made in a worker thread: handed over on the event loop)
        writer.files_made()
        assert settled == [ending]
    os.close(w)
    with anyio.fail_after(20):
        await writer.wait_drained()
    assert settled == ([] if ending == "closed quiet" else [ending])
    writer.close()
    writer.close()
    assert settled == [ending]
    assert bool(writer.lost_bytes) == (ending == "files failed")


async def test_an_unwritable_log_dir_fails_the_submit_without_an_early_directory(
    sched: LocalScheduler, tmp_path: Path
) -> None:
    """A log_dir that cannot be created fails the submit (LaunchError naming log_dir) also when
    nothing of the app's directory is made before its first output; nothing is listed."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(LaunchError, match="log_dir") as info:
        await sched.submit(app(role("sleep 30", tmp_path)), {"log_dir": str(blocker / "logs")})
    assert str(blocker) in str(info.value)
    assert await sched.list() == []


async def test_an_app_directory_removed_while_quiet_is_made_again_on_output(
    sched: LocalScheduler, tmp_path: Path
) -> None:
    """A replica whose directory (made before its start for the error file its role sets in it)
    was removed before it wrote gets it made again on its first output, and its output is all
    kept."""
    go = tmp_path / "go"
    script = f"{GATE}; echo after"
    probe = Role("main", image="ignored", entrypoint="true")
    session_dir = Path(sched.submit_dryrun(app(probe), {}).request.app_dir).parent
    error_file = f"{session_dir}/{macros.app_id}/main/0/error.json"
    env = {"GO": str(go), "TORCHELASTIC_ERROR_FILE": error_file}
    quiet = Role("main", image="ignored", entrypoint="sh", args=["-c", script], env=env)
    app_id = await sched.submit(app(quiet), {})
    app_dir = session_dir / app_id
    assert (app_dir / "main" / "0").is_dir()
    shutil.rmtree(app_dir)
    go.touch()
    assert (await wait_for(sched, app_id)).state == AppState.SUCCEEDED
    assert await read(sched, app_id) == ["after\n"]
    assert (app_dir / "main" / "0" / "combined.log").read_text() == "after\n"


async def test_a_follower_sees_a_directory_made_just_before_it_watched_the_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follower whose log directory is made between its lookup and the inotify watch of the
    parent (so no event of the parent's comes) goes on to watch the directory itself, without
    polling, and reads what is then written."""
    from asynctorchx.logs import _inotify, iter_log_lines

    directory = tmp_path / "app" / "main" / "0"
    real = _inotify.watch
    watched: list[str] = []

    def watch(path: str, *args: Any, **kw: Any) -> Any:
        if path == str(tmp_path) and not directory.exists():
            directory.mkdir(parents=True)  # made meanwhile, its files not yet
        w = real(path, *args, **kw)
        watched.append(path)
        return w

    monkeypatch.setattr(_inotify, "watch", watch)
    lines = iter_log_lines(directory, follow=True, poll_interval=3600)
    first = asyncio.create_task(anext(lines))
    try:
        with anyio.fail_after(10):
            while str(directory) not in watched:
                await asyncio.sleep(0.01)
            (directory / "combined.log").write_bytes(b"written later\n")
            assert await first == "written later\n"
    finally:
        first.cancel()
        await asyncio.wait([first])
        await lines.aclose()
