"""The local launch makes its log directories and files in a worker thread (``LogDirMaker``, issue
17): what a launch gets, and that a cancelled, failed or closed launch leaves nothing behind."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from asynctorchx._tasks import TaskSupervisor
from asynctorchx.logs import INDEX_FILE, LOG_FILES, LogFiles, ReplicaLogWriter, Stream
from asynctorchx.schedulers._local import launch as launch_module
from asynctorchx.schedulers._local.launch import LogDirMaker
from asynctorchx.schedulers._local.procs import LaunchError
from asynctorchx.schedulers.local import LocalScheduler
from asynctorchx.specs import AppDef, AppState, Role, is_terminal, macros


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
async def maker() -> AsyncIterator[tuple[LogDirMaker, TaskSupervisor]]:
    supervisor = TaskSupervisor("test-dirs")
    yield LogDirMaker(supervisor), supervisor
    await supervisor.aclose()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Holds the worker thread inside ``LogDirMaker._make_one`` until released: (entered,
    release)."""
    entered, release = threading.Event(), threading.Event()
    real = LogDirMaker._make_one

    def held(self: LogDirMaker, job: object) -> None:
        entered.set()
        if not release.wait(10):
            raise TimeoutError("the test never released the worker thread")
        real(self, job)  # type: ignore[arg-type]

    monkeypatch.setattr(launch_module.LogDirMaker, "_make_one", held)
    yield entered, release
    release.set()


async def wait_thread_event(event: threading.Event) -> None:
    with anyio.fail_after(10):
        while not event.is_set():
            await asyncio.sleep(0.005)


async def start_held(
    dirs: LogDirMaker, tmp_path: Path, entered: threading.Event
) -> tuple[Path, asyncio.Task[None]]:
    """Asks for one app's directories and waits until the worker thread is held inside them."""
    app_dir = tmp_path / "s" / "app"
    task = asyncio.create_task(dirs.make("app", str(app_dir), [str(app_dir / "main" / "0")]))
    await wait_thread_event(entered)
    return app_dir, task


async def test_a_batch_makes_every_app_directory_and_the_directories_asked_for(
    tmp_path: Path, maker: tuple[LogDirMaker, TaskSupervisor]
) -> None:
    """Launches asking at once get their app directories and the directories below them they
    asked for, and no file (log files are made on a replica's first output)."""
    dirs, _ = maker
    apps = {f"app{i}": tmp_path / "session" / f"app{i}" for i in range(5)}
    replicas = {a: [str(d / "main" / "0"), str(d / "main" / "1")] for a, d in apps.items()}
    await asyncio.gather(*(dirs.make(a, str(apps[a]), replicas[a]) for a in apps))
    for app_id in apps:
        for d in replicas[app_id]:
            assert os.path.isdir(d) and os.listdir(d) == []


async def test_writers_asking_at_once_get_their_files_in_one_batch(
    tmp_path: Path, maker: tuple[LogDirMaker, TaskSupervisor]
) -> None:
    """Lazy writers asking for their files through the maker each get their directory, four log
    files, and the output read before they existed, written in full."""
    dirs, _ = maker
    writers = [
        ReplicaLogWriter(tmp_path / f"a{i}" / "r" / "0", opener=dirs.request) for i in range(4)
    ]
    for i, writer in enumerate(writers):
        r, w = os.pipe()
        writer.attach(r, Stream.STDOUT)
        os.write(w, f"line {i}\n".encode())
        os.close(w)
    with anyio.fail_after(10):
        for writer in writers:
            await writer.wait_drained()
    for i, writer in enumerate(writers):
        writer.close()
        assert sorted(os.listdir(writer.directory)) == sorted([*LOG_FILES.values(), INDEX_FILE])
        assert (writer.directory / "stdout.log").read_bytes() == f"line {i}\n".encode()


async def test_a_writer_over_files_made_in_a_thread_writes_like_one_that_opened_them(
    tmp_path: Path,
) -> None:
    """A ``ReplicaLogWriter`` given ``LogFiles`` opened elsewhere writes the same files, index
    included, as one that opened them itself."""
    made, own = tmp_path / "made", tmp_path / "own"
    files = await anyio.to_thread.run_sync(LogFiles.open, made)
    outputs = []
    for writer in (ReplicaLogWriter(made, files=files), ReplicaLogWriter(own)):
        r, w = os.pipe()
        writer.attach(r, Stream.STDOUT)
        os.write(w, b"hello\n")
        os.close(w)
        with anyio.fail_after(10):
            await writer.wait_drained()
        writer.close()
        outputs.append({n: (writer.directory / n).read_bytes() for n in LOG_FILES.values()})
    assert outputs[0] == outputs[1] and b"hello\n" in outputs[0].values()
    assert (made / INDEX_FILE).stat().st_size == (own / INDEX_FILE).stat().st_size


async def test_files_of_another_directory_are_refused(tmp_path: Path) -> None:
    """Log files opened for one directory cannot be given to the writer of another."""
    files = LogFiles.open(tmp_path / "a")
    try:
        with pytest.raises(ValueError, match="given for"):
            ReplicaLogWriter(tmp_path / "b", files=files)
    finally:
        files.close()


async def test_an_existing_app_directory_fails_the_launch_and_is_kept(
    tmp_path: Path, maker: tuple[LogDirMaker, TaskSupervisor]
) -> None:
    """An app directory that exists already (a dry run scheduled twice) is a ValueError, and what
    is in it stays: it is not this launch's."""
    dirs, _ = maker
    app_dir = tmp_path / "s" / "app"
    (app_dir / "main" / "0").mkdir(parents=True)
    (app_dir / "main" / "0" / "stdout.log").write_text("earlier\n")
    with pytest.raises(ValueError, match="already exists"):
        await dirs.make("app", str(app_dir), [str(app_dir / "main" / "0")])
    assert (app_dir / "main" / "0" / "stdout.log").read_text() == "earlier\n"


async def test_a_replica_directory_that_cannot_be_made_removes_the_app_directory(
    tmp_path: Path, maker: tuple[LogDirMaker, TaskSupervisor]
) -> None:
    """A failure part-way (a replica's log directory blocked by a file) is a LaunchError naming the
    app, and nothing of the app's directory or files is left, no descriptor either."""
    dirs, _ = maker
    app_dir = tmp_path / "s" / "app"
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    before = open_fds()
    with pytest.raises(LaunchError, match="app"):
        await dirs.make(
            "app", str(app_dir), [str(app_dir / "main" / "0"), str(blocker / "r" / "1")]
        )
    assert not app_dir.exists()
    assert open_fds() <= before


async def test_a_launch_cancelled_while_its_directories_are_made_leaves_nothing(
    tmp_path: Path,
    maker: tuple[LogDirMaker, TaskSupervisor],
    gate: tuple[threading.Event, threading.Event],
) -> None:
    """Cancelling a launch while the worker thread makes its directories: once the thread is done,
    the app's directory is removed."""
    dirs, _ = maker
    entered, release = gate
    before = open_fds()
    app_dir, task = await start_held(dirs, tmp_path, entered)
    task.cancel()
    await asyncio.sleep(0)  # (the launch has taken its cancellation: it waits for the removal)
    assert not task.done()
    release.set()
    with anyio.fail_after(10), pytest.raises(asyncio.CancelledError):
        await task
    assert not app_dir.exists()  # gone when the cancellation arrives
    assert open_fds() <= before


async def test_a_launch_cancelled_just_after_the_thread_made_its_directories_waits_for_removal(
    tmp_path: Path,
    maker: tuple[LogDirMaker, TaskSupervisor],
    gate: tuple[threading.Event, threading.Event],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The thread has made the directories and queued their hand-over when the launch is
    cancelled: the hand-over (first in line) finds the launch gone and has them removed, and the
    launch's cancellation goes on only once they are."""
    dirs, _ = maker
    entered, release = gate
    handed = threading.Event()
    real = LogDirMaker._make_batch

    def make_batch(self: LogDirMaker, *args: Any) -> None:
        real(self, *args)
        handed.set()

    monkeypatch.setattr(LogDirMaker, "_make_batch", make_batch)
    app_dir, task = await start_held(dirs, tmp_path, entered)
    release.set()
    assert handed.wait(10)  # (the loop is held here: the hand-over is queued, not run)
    task.cancel()
    with anyio.fail_after(10), pytest.raises(asyncio.CancelledError):
        await task
    assert not app_dir.exists()


async def test_a_launch_cancelled_once_its_directories_are_made_removes_them_first(
    tmp_path: Path, maker: tuple[LogDirMaker, TaskSupervisor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launch cancelled after its directories were handed over but before it resumed: they are
    removed before its cancellation goes on, so the same launch can be asked for again at once."""
    dirs, _ = maker
    waiting: list[asyncio.Task[None]] = []
    real = LogDirMaker._deliver

    def deliver(self: LogDirMaker, job: object) -> None:
        real(self, job)  # type: ignore[arg-type]
        if waiting:
            waiting.pop().cancel()  # made and handed over; cancelled before it resumes

    monkeypatch.setattr(LogDirMaker, "_deliver", deliver)
    app_dir = tmp_path / "s" / "app"
    asked = [str(app_dir / "main" / str(i)) for i in range(4)]
    for _ in range(5):
        task = asyncio.create_task(dirs.make("app", str(app_dir), asked))
        waiting.append(task)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not app_dir.exists()
    await dirs.make("app", str(app_dir), asked)  # asked again: not "already exists"
    assert all(os.path.isdir(d) for d in asked)


async def test_a_worker_cancelled_before_it_ran_fails_the_launch_and_serves_the_writers(
    tmp_path: Path, maker: tuple[LogDirMaker, TaskSupervisor]
) -> None:
    """The scheduler closing in the loop iteration that started a worker (cancelled before its
    first step, so its clean-up never ran): the waiting launch fails, the waiting writer gets its
    files, and a writer asking afterwards gets them at once (no queue behind a dead worker)."""
    dirs, supervisor = maker
    app_dir = tmp_path / "s" / "app"
    launch = asyncio.create_task(dirs.make("app", str(app_dir), [str(app_dir / "main" / "0")]))
    await asyncio.sleep(0)  # the launch has started the worker and waits for it
    writer = ReplicaLogWriter(tmp_path / "w" / "0", opener=dirs.request)
    writer.make_files_soon()  # queued behind the same worker
    await supervisor.aclose()  # cancels the worker before its first step
    with anyio.fail_after(10), pytest.raises(RuntimeError, match="closing"):
        await launch
    assert not app_dir.exists()
    await until_files(writer)
    later = ReplicaLogWriter(tmp_path / "w" / "1", opener=dirs.request)
    later.make_files_soon()
    assert later.has_files
    assert not dirs._tasks
    for w in (writer, later):
        w.close()


async def test_closing_while_directories_are_made_fails_the_launch_and_leaves_nothing(
    tmp_path: Path,
    maker: tuple[LogDirMaker, TaskSupervisor],
    gate: tuple[threading.Event, threading.Event],
) -> None:
    """Closing the scheduler's tasks while a batch is in the thread: the waiting launch gets a
    RuntimeError once the thread is done, and its directory is gone."""
    dirs, supervisor = maker
    entered, release = gate
    before = open_fds()
    app_dir, task = await start_held(dirs, tmp_path, entered)
    closing = asyncio.create_task(supervisor.aclose())
    await asyncio.sleep(0.05)
    release.set()
    with anyio.fail_after(10):
        await closing
        with pytest.raises(RuntimeError, match="closing"):
            await task
    assert not app_dir.exists()
    assert open_fds() <= before


async def test_a_submit_cancelled_while_its_directories_are_made_leaves_no_app(
    tmp_path: Path, gate: tuple[threading.Event, threading.Event]
) -> None:
    """Through the scheduler: a submit cancelled while its replicas' directories (for the error
    files its role sets in them) are being made leaves no record, no log directory and nothing
    listed, and the scheduler launches the next app."""
    entered, release = gate
    root = tmp_path / "root"
    async with LocalScheduler("dirs", local_root=root) as s:
        probe = AppDef("p", [Role("main", image=".", entrypoint="true")])
        session_dir = os.path.dirname(s.submit_dryrun(probe, {}).request.app_dir)
        env = {"TORCHELASTIC_ERROR_FILE": f"{session_dir}/{macros.app_id}/main/0/error.json"}
        app = AppDef("a", [Role("main", image=".", entrypoint="sleep", args=["1000"], env=env)])
        info = s.submit_dryrun(app, {})
        task = asyncio.create_task(s.schedule(info))
        await wait_thread_event(entered)
        task.cancel()
        release.set()
        with anyio.fail_after(10), pytest.raises(asyncio.CancelledError):
            await task
        assert not os.path.exists(info.request.app_dir)
        assert await s.list() == []
        assert not any(n.endswith(".json") for n in os.listdir(root / ".apps"))
        ok = await s.submit(AppDef("b", [Role("main", image=".", entrypoint="true")]), {})
        with anyio.fail_after(20):
            while (desc := await s.describe(ok)) is None or desc.state != AppState.SUCCEEDED:
                await asyncio.sleep(0.02)


async def test_asking_after_close_is_a_runtime_error_and_makes_nothing(tmp_path: Path) -> None:
    """Once the scheduler's tasks are closed, asking for directories fails at once (RuntimeError)
    and creates nothing."""
    supervisor = TaskSupervisor("closed")
    dirs = LogDirMaker(supervisor)
    await supervisor.aclose()
    app_dir = tmp_path / "s" / "app"
    with pytest.raises(RuntimeError):
        await dirs.make("app", str(app_dir), [str(app_dir / "main" / "0")])
    assert not (tmp_path / "s").exists()


async def test_a_launch_cancelled_by_a_scope_while_writers_are_made_removes_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An anyio cancel scope cancelled while a 200-replica launch hands out its log writers: the
    app's directory is removed all the same (the removal runs although the scope stays cancelled)."""
    from asynctorchx.schedulers._local import spawn as spawn_module

    scope = anyio.CancelScope()
    real = spawn_module.Spawner.new_writer
    made = 0

    def new_writer(self: spawn_module.Spawner, *args: object) -> ReplicaLogWriter:
        nonlocal made
        made += 1
        if made == 128:  # past the first of the loop's breathers (every 8 chunks)
            scope.cancel()
        return real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(spawn_module.Spawner, "new_writer", new_writer)
    async with LocalScheduler("scoped", local_root=tmp_path / "root") as s:
        app = AppDef("big", [Role("r", image=".", entrypoint="true", num_replicas=200)])
        info = s.submit_dryrun(app, {})
        with scope:
            await s.schedule(info)
        assert scope.cancelled_caught and made >= 128
        assert not os.path.exists(info.request.app_dir)
        assert await s.list() == []


@pytest.fixture
def held_open(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Holds the making of the files of a directory named ``slow`` until released (a churned file
    system): (entered, release); ``entered`` is set while the thread is held."""
    entered, release = threading.Event(), threading.Event()
    real = LogFiles.open

    def held(directory: str | os.PathLike[str]) -> LogFiles:
        if os.path.basename(os.fspath(directory)) == "slow":
            entered.set()
            released = release.wait(10)
            entered.clear()
            if not released:
                raise TimeoutError("the test never released the files")
        return real(directory)

    monkeypatch.setattr(LogFiles, "open", staticmethod(held))
    yield entered, release
    release.set()


async def start_slow_writer(
    dirs: LogDirMaker, tmp_path: Path, entered: threading.Event
) -> ReplicaLogWriter:
    """A lazy writer whose files are being made, held (``held_open``)."""
    slow = ReplicaLogWriter(tmp_path / "a" / "slow", opener=dirs.request)
    slow.make_files_soon()
    await wait_thread_event(entered)
    return slow


async def until_files(*writers: ReplicaLogWriter) -> None:
    with anyio.fail_after(10):
        while not all(w.has_files for w in writers):
            await asyncio.sleep(0.005)


@pytest.mark.parametrize("slow_batch", [0.0, 0.05], ids=["slow-when-asked", "slow-later"])
async def test_what_queues_behind_a_slow_batch_is_made_beside_it(
    tmp_path: Path,
    maker: tuple[LogDirMaker, TaskSupervisor],
    held_open: tuple[threading.Event, threading.Event],
    monkeypatch: pytest.MonkeyPatch,
    slow_batch: float,
) -> None:
    """Files asked for while a batch is slow (past ``SLOW_BATCH``: at once), or asked for while
    it was young with nothing asked after (it turns slow 50 ms later), get a second worker: they
    are made while the slow batch is still held, not after it."""
    monkeypatch.setattr(LogDirMaker, "SLOW_BATCH", slow_batch)
    dirs, _ = maker
    entered, release = held_open
    slow = await start_slow_writer(dirs, tmp_path, entered)
    quick = ReplicaLogWriter(tmp_path / "b" / "0", opener=dirs.request)
    quick.make_files_soon()
    await until_files(quick)
    assert not slow.has_files  # still held
    release.set()
    await until_files(slow)
    for writer in (slow, quick):
        writer.close()
        assert sorted(os.listdir(writer.directory)) == sorted([*LOG_FILES.values(), INDEX_FILE])


async def test_what_queues_behind_a_fast_batch_waits_for_it(
    tmp_path: Path,
    maker: tuple[LogDirMaker, TaskSupervisor],
    held_open: tuple[threading.Event, threading.Event],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Batches not yet slow keep one worker (more, smaller batches would cost the event loop more
    hand-overs): what is asked meanwhile is made next, in one more batch."""
    monkeypatch.setattr(LogDirMaker, "SLOW_BATCH", 3600.0)
    dirs, _ = maker
    entered, release = held_open
    slow = await start_slow_writer(dirs, tmp_path, entered)
    later = [ReplicaLogWriter(tmp_path / f"b{i}" / "0", opener=dirs.request) for i in range(3)]
    for writer in later:
        writer.make_files_soon()
    assert len(dirs._tasks) == 1
    release.set()
    await until_files(slow, *later)
    for writer in (slow, *later):
        writer.close()


async def test_closing_a_quiet_writer_does_not_wait_for_its_files_being_made(
    tmp_path: Path,
    maker: tuple[LogDirMaker, TaskSupervisor],
    held_open: tuple[threading.Event, threading.Event],
) -> None:
    """A replica that ended without output while a worker thread makes its files (a slow file
    system): its writer's close returns at once, on the event loop, without waiting for the
    thread; the files the thread makes afterwards are closed, not leaked."""
    dirs, _ = maker
    entered, release = held_open
    before = open_fds()
    slow = await start_slow_writer(dirs, tmp_path, entered)
    slow.close()  # nothing to write: returns while the thread is still held
    assert entered.is_set() and not slow.has_files
    release.set()
    with anyio.fail_after(10):
        while dirs._tasks:
            await asyncio.sleep(0.005)
    assert open_fds() <= before


async def test_an_app_with_an_own_error_file_and_a_default_one_gets_both_directories(
    tmp_path: Path,
) -> None:
    """One role's error file under the app's directory, another's the default one (in the
    session's ``.errors``): both directories exist when the replicas start, in a new session."""
    check = 'test -d "${TORCHELASTIC_ERROR_FILE%/*}"'
    async with LocalScheduler("mixed", local_root=tmp_path / "root") as s:
        probe = AppDef("p", [Role("x", image=".", entrypoint="true")])
        session_dir = os.path.dirname(s.submit_dryrun(probe, {}).request.app_dir)
        env = {"TORCHELASTIC_ERROR_FILE": f"{session_dir}/{macros.app_id}/own/error.json"}
        own = Role("own", image=".", entrypoint="sh", args=["-c", check], env=env)
        default = Role("default", image=".", entrypoint="sh", args=["-c", check])
        app_id = await s.submit(AppDef("a", [own, default]), {})
        with anyio.fail_after(20):
            while (desc := await s.describe(app_id)) is None or not is_terminal(desc.state):
                await asyncio.sleep(0.02)
        assert desc.state == AppState.SUCCEEDED, desc.msg
