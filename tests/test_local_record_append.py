"""App record files written once and appended: one JSON document per line, the last complete line
being the record (``protocol.write_record_file``, ``recordfile.read_document``), bounded by
compaction, read by every reader (the store, the CLI's fast path, a second scheduler, the
watchdog), and compatible with files of the single-document layout."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from _local_env import GATE, dead_pid, wait_for

from asynctorchx.schedulers._local import guard, protocol, recordfile, watchdog
from asynctorchx.schedulers._local.records import AppRecord, RecordStore
from asynctorchx.schedulers.local import LocalScheduler
from asynctorchx.specs import AppDef, AppState, Role

REPO = Path(__file__).resolve().parent.parent


def _doc(app_id: str, state: str = "RUNNING", owner_pid: int = 1, **extra: Any) -> dict[str, Any]:
    return {
        "format": 1,
        "app_id": app_id,
        "name": "n",
        "backend": "local_cwd",
        "session": "s",
        "state": state,
        "msg": "",
        "submitted_at": 1.0,
        "app_dir": "/nowhere",
        "owner": {"pid": owner_pid, "start_ticks": 1},
        "replicas": [],
        "app": {},
        **extra,
    }


def _dumps(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


@pytest.fixture
def store(tmp_path: Path) -> RecordStore:
    s = RecordStore(tmp_path / "root")
    s.ensure()
    return s


@pytest.fixture
def warned() -> list[str]:
    return []


def _read(path: Path, warned: list[str]) -> AppRecord | None:
    return recordfile.read_record(
        path, AppRecord.from_json, lambda msg, *args: warned.append(msg % args)
    )


# -- format --------------------------------------------------------------------------------------


def test_versions_are_appended_to_one_file_and_the_last_wins(store: RecordStore) -> None:
    """Each version is one more line of the same file (same inode); the last one is the record."""
    path = store.records_dir / "a-1.json"
    assert store.write_many({"a-1": _doc("a-1", "PENDING")}) == {}
    inode = path.stat().st_ino
    for state in ("RUNNING", "SUCCEEDED"):
        assert store.write_many({"a-1": _doc("a-1", state)}) == {}
    lines = [line for line in path.read_bytes().split(b"\n") if line]
    assert [json.loads(line)["state"] for line in lines] == ["PENDING", "RUNNING", "SUCCEEDED"]
    assert path.stat().st_ino == inode and path.read_bytes().endswith(b"\n")
    record = store.read("a-1")
    assert record is not None and record.state == AppState.SUCCEEDED
    assert sorted(os.listdir(store.records_dir)) == ["a-1.json"]


def test_a_torn_last_line_is_ignored_by_readers(store: RecordStore, warned: list[str]) -> None:
    """A last line without its newline (a write cut short) is skipped: the version before wins,
    and nothing is reported."""
    store.write_many({"a-1": _doc("a-1", "RUNNING")})
    path = store.records_dir / "a-1.json"
    with open(path, "ab") as f:
        f.write(b"\n" + _dumps(_doc("a-1", "SUCCEEDED"))[:-7])
    record = _read(path, warned)
    assert record is not None and record.state == AppState.RUNNING
    assert warned == []


def test_the_next_writer_starts_a_fresh_line_after_a_torn_one(
    store: RecordStore, warned: list[str]
) -> None:
    """A version written after a torn line is read (the torn line, now ended, is skipped)."""
    store.write_many({"a-1": _doc("a-1", "RUNNING")})
    path = store.records_dir / "a-1.json"
    with open(path, "ab") as f:
        f.write(b"\n" + _dumps(_doc("a-1", "CANCELLED"))[:-7])
    assert store.write_many({"a-1": _doc("a-1", "FAILED")}) == {}
    record = _read(path, warned)
    assert record is not None and record.state == AppState.FAILED
    assert warned == []
    # and when the newest complete line is the torn one, the one before it wins
    with open(path, "ab") as f:
        f.write(b'{"app_id": "a-1", "sta\n')
    record = _read(path, warned)
    assert record is not None and record.state == AppState.FAILED


def test_a_file_of_the_single_document_layout_is_read(
    store: RecordStore, warned: list[str]
) -> None:
    """A record written by an older version (one document, no newline) is read whole."""
    path = store.records_dir / "old-1.json"
    path.write_bytes(_dumps(_doc("old-1", "SUCCEEDED")))
    record = _read(path, warned)
    assert record is not None and record.state == AppState.SUCCEEDED
    assert warned == []


def test_a_file_of_the_single_document_layout_is_appended_to(
    store: RecordStore, warned: list[str]
) -> None:
    """A version appended to an old single-document file becomes the record, and the old document
    stays readable as the line before it."""
    path = store.records_dir / "old-1.json"
    path.write_bytes(
        _dumps(_doc("old-1", "RUNNING")) + b"   "
    )  # (as padded by an in-place rewrite)
    assert store.write_many({"old-1": _doc("old-1", "CANCELLED")}) == {}
    record = _read(path, warned)
    assert record is not None and record.state == AppState.CANCELLED
    first, second = path.read_bytes().split(b"\n")[:2]
    assert json.loads(first)["state"] == "RUNNING" and json.loads(second)["state"] == "CANCELLED"
    assert warned == []


def test_an_empty_record_file_is_no_record(store: RecordStore, warned: list[str]) -> None:
    """An empty file (created, its first version not written) is no record and no warning."""
    path = store.records_dir / "e-1.json"
    path.write_bytes(b"")
    assert _read(path, warned) is None
    assert warned == []


def test_a_file_with_no_document_is_reported_corrupt(store: RecordStore, warned: list[str]) -> None:
    """A file whose only content is not a document (a torn first version, or garbage) is no
    record, reported as corrupt."""
    path = store.records_dir / "t-1.json"
    path.write_bytes(_dumps(_doc("t-1"))[:40])
    assert _read(path, warned) is None
    assert len(warned) == 1 and "ignoring corrupt app record" in warned[0]


def test_a_record_with_a_newline_is_refused(store: RecordStore) -> None:
    """A document holding a raw newline could not be one line: the writer refuses it."""
    with pytest.raises(ValueError, match="one line"):
        protocol.write_record_file(str(store.records_dir), "n-1", b'{"a":\n1}')
    assert not (store.records_dir / "n-1.json").exists()


def test_a_full_disk_rewrites_the_record_in_place_when_it_fits(
    store: RecordStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An append cut short by a full disk is replaced by the new version written over the file in
    place (it fits in the file's blocks); one whose message does not fit is written with it cut,
    saying so; one that does not fit even so raises ENOSPC, the old version standing."""
    import errno

    records_dir = str(store.records_dir)
    path = store.records_dir / "f-1.json"
    protocol.write_record_file(records_dir, "f-1", _dumps(_doc("f-1", "RUNNING", msg="x" * 300)))
    real_write = os.write

    def full(fd: int, data: bytes) -> int:
        if os.fstat(fd).st_size >= 400:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, bytes(data)[:50])  # a part, then the disk is full

    monkeypatch.setattr(protocol.os, "write", full)
    protocol.write_record_file(records_dir, "f-1", _dumps(_doc("f-1", "SUCCEEDED")))
    record = store.read("f-1")
    assert record is not None and record.state == AppState.SUCCEEDED
    long_msg = _dumps(_doc("f-1", "FAILED", msg="y" * 10000))
    protocol.write_record_file(records_dir, "f-1", long_msg)
    record = store.read("f-1")
    assert record is not None and record.state == AppState.FAILED
    assert record.msg.startswith("y" * protocol.CUT_TEXT) and "cut: the state root" in record.msg
    huge = _dumps(_doc("f-1", "CANCELLED", app={"pad": "z" * 10000}))
    with pytest.raises(OSError) as raised:
        protocol.write_record_file(records_dir, "f-1", huge)
    assert raised.value.errno == errno.ENOSPC
    record = store.read("f-1")
    assert record is not None and record.state == AppState.FAILED
    assert path.read_bytes().endswith(b"\n")


# -- bounds ----------------------------------------------------------------------------------------


def test_a_file_is_compacted_before_it_grows_past_its_bound(store: RecordStore) -> None:
    """Many versions never make the file larger than its bound: it is replaced by its latest."""
    path = store.records_dir / "c-1.json"
    inodes = set()
    for i in range(300):
        doc = _doc("c-1", msg=f"update {i}", pad="x" * 1000)
        assert store.write_many({"c-1": doc}) == {}
        line = len(_dumps(doc)) + 2
        assert path.stat().st_size <= max(protocol.COMPACT_SIZE, protocol.COMPACT_FACTOR * line)
        inodes.add(path.stat().st_ino)
    record = store.read("c-1")
    assert record is not None and record.msg == "update 299"
    assert len(inodes) > 1  # (it was compacted)
    assert sorted(os.listdir(store.records_dir)) == ["c-1.json"]  # (no temporary file left)


def test_a_large_record_is_read_from_the_tail(
    store: RecordStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading a 2000-replica record from a file of several versions reads about one version,
    not the file."""
    replicas = [
        {"role": "trainer", "id": k, "state": "RUNNING", "pid": 1000 + k, "log_dir": f"/l/{k}"}
        for k in range(2000)
    ]
    path = store.records_dir / "big-1.json"
    for i in range(3):
        store.write_many({"big-1": _doc("big-1", msg=f"v{i}", replicas=replicas)})
    size = path.stat().st_size
    doc_size = len(path.read_bytes().rstrip(b"\n").rsplit(b"\n", 1)[1])
    assert size > 2.5 * doc_size
    read = []
    real_pread = os.pread

    def counting_pread(fd: int, n: int, offset: int) -> bytes:
        data = real_pread(fd, n, offset)
        read.append(len(data))
        return data

    monkeypatch.setattr(recordfile.os, "pread", counting_pread)
    record = store.read("big-1")
    assert record is not None and record.msg == "v2" and len(record.replicas) == 2000
    assert sum(read) <= 2 * doc_size + recordfile.TAIL


# -- concurrency -----------------------------------------------------------------------------------


def _waiting_lock_on(inode: int) -> bool:
    """True when /proc/locks lists a blocked lock request on ``inode``."""
    with open("/proc/locks") as f:
        for line in f:
            if "->" in line and line.split()[6].endswith(f":{inode}"):
                return True
    return False


def test_an_append_racing_a_compaction_lands_in_the_new_file(store: RecordStore) -> None:
    """A writer that opened the file a compaction then replaces appends its version to the new
    file, not to the replaced one (the compactor holds the file's exclusive lock until then)."""
    import fcntl

    records_dir = str(store.records_dir)
    path = store.records_dir / "r-1.json"
    store.write_many({"r-1": _doc("r-1", "RUNNING")})
    old = os.open(path, os.O_RDONLY)
    errors: list[BaseException] = []
    try:
        fcntl.flock(old, fcntl.LOCK_EX)  # a compaction in progress

        def append() -> None:
            try:
                protocol.write_record_file(records_dir, "r-1", _dumps(_doc("r-1", "SUCCEEDED")))
            except BaseException as e:
                errors.append(e)

        writer = threading.Thread(target=append)
        writer.start()
        deadline = time.monotonic() + 10
        while not _waiting_lock_on(os.fstat(old).st_ino):
            assert time.monotonic() < deadline, "the writer never waited for the lock"
            time.sleep(0.005)
        tmp = store.records_dir / ".r-1.compact.tmp"
        tmp.write_bytes(_dumps(_doc("r-1", "RUNNING", msg="compacted")) + b"\n")
        os.replace(tmp, path)
    finally:
        os.close(old)
    writer.join(10)
    assert not writer.is_alive() and errors == []
    record = store.read("r-1")
    assert record is not None and record.state == AppState.SUCCEEDED


WRITER = """
import json, sys
from asynctorchx.schedulers._local import protocol
records_dir, name, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
for seq in range(count):
    doc = {"app_id": "race-1", "writer": name, "seq": seq, "pad": name * 9000}
    protocol.write_record_file(records_dir, "race-1", json.dumps(doc).encode())
"""


def test_readers_see_whole_versions_while_two_processes_append_and_compact(
    store: RecordStore,
) -> None:
    """Two processes writing large versions (compacting every few) never leave a reader without a
    whole version, and each writer's versions are seen in order."""
    records_dir = str(store.records_dir)
    path = store.records_dir / "race-1.json"
    protocol.write_record_file(records_dir, "race-1", b'{"writer":"-","seq":-1}')
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, records_dir, name, "300"], env=env)
        for name in ("a", "b")
    ]
    last_seen = {"a": -1, "b": -1}
    reads = 0
    try:
        deadline = time.monotonic() + 120
        while any(w.poll() is None for w in writers):
            assert time.monotonic() < deadline, "the writers did not finish"
            doc = recordfile.read_document(path)
            reads += 1
            name = doc["writer"]
            if name != "-":
                assert doc["seq"] >= last_seen[name], (name, doc["seq"], last_seen)
                last_seen[name] = doc["seq"]
    finally:
        for w in writers:
            if w.poll() is None:
                w.kill()
            w.wait()
    assert [w.returncode for w in writers] == [0, 0]
    final = recordfile.read_document(path)
    assert final["seq"] == 299 and reads > 0
    # 600 versions of 9 KB went through a file that stayed within its bound: it was compacted
    assert path.stat().st_size <= protocol.COMPACT_SIZE + len(_dumps(final)) + 2
    assert sorted(os.listdir(store.records_dir)) == ["race-1.json"]


# -- the watchdog ----------------------------------------------------------------------------------


def test_the_watchdog_script_finishes_an_appended_record(store: RecordStore) -> None:
    """The watchdog, run as its standalone script (escalate mode, launcher gone), appends the
    CANCELLED version to a record of several versions; the store reads it."""
    app_id = "w-1"
    dead = dead_pid()
    for msg in ("starting", "running"):
        store.write_many({app_id: _doc(app_id, "RUNNING", owner_pid=dead, msg=msg)})
    path = store.records_dir / f"{app_id}.json"
    inode = path.stat().st_ino
    proc = guard.start_escalator(store.records_dir, app_id, 0.0, None, [])
    assert proc.wait(30) == 0
    deadline = time.monotonic() + 30
    while (record := store.read(app_id)) is not None and record.state == AppState.RUNNING:
        assert time.monotonic() < deadline, "the watchdog never finished the record"
        time.sleep(0.02)
    assert record is not None and record.state == AppState.CANCELLED
    assert path.stat().st_ino == inode
    lines = [line for line in path.read_bytes().split(b"\n") if line]
    assert [json.loads(line)["state"] for line in lines] == ["RUNNING", "RUNNING", "CANCELLED"]


def test_the_watchdog_writes_its_fallback_over_a_record_never_written(store: RecordStore) -> None:
    """A record file left empty (the launcher died right after creating it) gets the watchdog's
    fallback record, marked FAILED."""
    app_id = "w-2"
    (store.records_dir / f"{app_id}.json").write_bytes(b"")
    fallback = _doc(app_id, "RUNNING", owner_pid=dead_pid())
    watchdog.finish_record(
        str(store.records_dir), app_id, "launcher died", False, "FAILED", fallback
    )
    record = store.read(app_id)
    assert record is not None and record.state == AppState.FAILED
    assert record.msg == "launcher died"


def test_the_watchdog_appends_to_a_record_of_the_single_document_layout(
    store: RecordStore,
) -> None:
    """A record of the old layout whose launcher is gone is finished by the watchdog, readably."""
    app_id = "w-3"
    path = store.records_dir / f"{app_id}.json"
    path.write_bytes(_dumps(_doc(app_id, "RUNNING", owner_pid=dead_pid())))
    watchdog.finish_record(str(store.records_dir), app_id, "why", only_if_owner_gone=True)
    record = store.read(app_id)
    assert record is not None and record.state == AppState.CANCELLED and record.msg == "why"


# -- real apps: a second scheduler and the CLI ---------------------------------------------------


DRIVER = """
import sys
from asynctorchx.cli.main import main
code = main(sys.argv[1:])
print("IMPORTED=" + ",".join(m for m in ("asyncio", "anyio") if m in sys.modules), file=sys.stderr)
sys.exit(code)
"""


async def test_a_second_scheduler_and_the_cli_read_appended_records(tmp_path: Path) -> None:
    """An app's record of several appended versions is read by a second scheduler on the same
    root, which is told of the appended versions by inotify, and by the CLI's fast path (no event
    loop)."""
    root = tmp_path / "root"
    go = tmp_path / "go"
    first = LocalScheduler("rec", local_root=root)
    second = LocalScheduler("rec", local_root=root)
    told: list[str] = []
    changed = asyncio.Event()

    def on_change(app_id: str) -> None:
        told.append(app_id)
        changed.set()

    unsubscribe = second.subscribe(on_change)
    try:
        role = Role(
            "main", image=str(tmp_path), entrypoint="sh", args=["-c", GATE], env={"GO": str(go)}
        )
        app_id = await first.submit(AppDef("gated", [role]), {})
        running = await wait_for(second, app_id, lambda d: d.state == AppState.RUNNING)
        assert running.state == AppState.RUNNING
        changed.clear()
        told.clear()
        go.touch()
        with anyio.fail_after(30):
            while (
                desc := await second.describe(app_id)
            ) is None or desc.state != AppState.SUCCEEDED:
                await changed.wait()  # (only a pushed change wakes this)
                changed.clear()
        assert app_id in told
    finally:
        unsubscribe()
        await first.close()
        await second.close()
    path = root / ".apps" / f"{app_id}.json"
    lines = [line for line in path.read_bytes().split(b"\n") if line]
    assert len(lines) >= 2 and json.loads(lines[-1])["state"] == "SUCCEEDED"
    env = {
        **os.environ,
        "ASYNCTORCHX_LOCAL_ROOT": str(root),
        "TORCHXCONFIG": "",
        "PYTHONPATH": str(REPO),
    }
    env.pop("ASYNCTORCHX_CLI_FASTPATH", None)
    with anyio.fail_after(60):
        proc = await anyio.run_process(
            [sys.executable, "-c", DRIVER, "status", "--json", f"local_cwd://rec/{app_id}"],
            env=env,
            cwd=tmp_path,
            check=False,
        )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["state"] == "SUCCEEDED"
    assert proc.stderr.decode().splitlines()[-1] == "IMPORTED="


def _state_of(path: Path) -> str | None:
    try:
        return str(recordfile.read_document(path)["state"])
    except (FileNotFoundError, recordfile.NoDocument):  # (not written yet)
        return None


async def test_the_watchdog_appends_failed_after_the_launcher_is_killed(tmp_path: Path) -> None:
    """When the launcher is SIGKILLed, its watchdog appends the FAILED version to the app's record
    file (the same file the launcher appended to), which every reader then takes."""
    import uuid

    from test_local_reliability import kill_token_procs, launcher_argv, read_json_line, sigkill

    root = tmp_path / "root"
    token = uuid.uuid4().hex
    spec = {"entrypoint": "sh", "args": ["-c", "sleep 600"], "n": 2, "env": {"ATX_TOKEN": token}}
    proc = subprocess.Popen(
        launcher_argv(root, spec),
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        info = await read_json_line(proc)
        path = root / ".apps" / f"{info['app_id']}.json"
        with anyio.fail_after(30):
            while _state_of(path) != "RUNNING":
                await asyncio.sleep(0.02)
        inode, before = path.stat().st_ino, path.read_bytes()
        sigkill(proc)
        with anyio.fail_after(30):
            while _state_of(path) == "RUNNING":
                await asyncio.sleep(0.02)
        after = path.read_bytes()
        assert path.stat().st_ino == inode and after.startswith(before)
        last = json.loads(after.rstrip(b"\n").rsplit(b"\n", 1)[-1])
        assert last["state"] == "FAILED" and "launcher" in last["msg"]
        assert all(r["state"] == "FAILED" for r in last["replicas"])
    finally:
        if proc.poll() is None:
            sigkill(proc)
        kill_token_procs(token)


@pytest.mark.timeout(30)
async def test_a_flush_after_every_queued_record_was_forgotten_returns(tmp_path: Path) -> None:
    """Records queued and then forgotten before the writer took them (submits undone at once, e.g.
    a burst of launches cancelled) leave nothing to write: the writes awaiting them and a flush
    return, rather than waiting for the next record to come."""
    from asynctorchx._tasks import TaskSupervisor

    store = RecordStore(tmp_path)
    await anyio.to_thread.run_sync(store.ensure)
    supervisor = TaskSupervisor("test")
    writer = guard.RecordWriter(store, supervisor)
    try:
        writes = [
            asyncio.create_task(
                writer.write(f"app-{i}", {"app_id": f"app-{i}", "state": "RUNNING"})
            )
            for i in range(3)
        ]
        await asyncio.sleep(0)  # queued; the writer task has not taken them yet
        for i in range(3):
            writer.forget(f"app-{i}")
        with anyio.fail_after(5):
            assert await writer.flush() is True
            await asyncio.gather(*writes)
        assert not any((tmp_path / ".apps").glob("app-*"))
    finally:
        await supervisor.aclose()


@pytest.mark.timeout(30)
async def test_a_first_record_made_from_a_spare_is_written_without_a_thread_hop(
    tmp_path: Path,
) -> None:
    """With a spare file at hand, a new app's first record is on disk as soon as its write starts
    (one step of the writing task, no hop to the writer's thread and back: ~1 ms of a launch on a
    busy loop), made from the spare; without one it goes through the thread as before."""
    from asynctorchx._tasks import TaskSupervisor

    store = RecordStore(tmp_path)
    await anyio.to_thread.run_sync(store.ensure)
    supervisor = TaskSupervisor("test")
    writer = guard.RecordWriter(store, supervisor)
    try:
        await anyio.to_thread.run_sync(store.spares.fill_some, 2)
        spares = len(store.spares)
        assert spares == 2
        write = asyncio.create_task(writer.write("app-1", {"app_id": "app-1", "state": "RUNNING"}))
        await asyncio.sleep(0)
        assert write.done() and write.exception() is None
        assert json.loads((tmp_path / ".apps" / "app-1.json").read_text())["state"] == "RUNNING"
        assert len(store.spares) == spares - 1
        many = [{"index": i, "state": "RUNNING"} for i in range(writer.FIRST_INLINE_REPLICAS + 1)]
        big = {"app_id": "app-big", "state": "RUNNING", "replicas": many}
        write = asyncio.create_task(writer.write("app-big", big))
        await asyncio.sleep(0)  # too many replicas to read their start times on the loop
        assert not write.done() and not (tmp_path / ".apps" / "app-big.json").exists()
        with anyio.fail_after(5):
            await write
        assert (tmp_path / ".apps" / "app-big.json").exists()
        while len(store.spares):
            store.spares.take()  # the pool is empty now: the next first record goes to the thread
        assert len(store.spares) == 0
        write = asyncio.create_task(writer.write("app-2", {"app_id": "app-2", "state": "RUNNING"}))
        await asyncio.sleep(0)
        assert not write.done() and not (tmp_path / ".apps" / "app-2.json").exists()
        with anyio.fail_after(5):
            await write
        assert (tmp_path / ".apps" / "app-2.json").exists()
    finally:
        await supervisor.aclose()


@pytest.mark.timeout(30)
async def test_a_first_record_that_cannot_be_written_at_once_goes_through_the_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first record whose immediate write fails is queued for the writer's thread, which
    retries it as any record: the write still succeeds, nothing is lost."""
    from asynctorchx._tasks import TaskSupervisor

    store = RecordStore(tmp_path)
    await anyio.to_thread.run_sync(store.ensure)
    await anyio.to_thread.run_sync(store.spares.fill_some, 2)
    real = store.write_many
    calls: list[str] = []

    def fail_once(docs: Any) -> dict[str, BaseException]:
        calls.append(",".join(docs))
        if len(calls) == 1:
            return dict.fromkeys(docs, OSError(28, "No space left on device"))
        return real(docs)

    monkeypatch.setattr(store, "write_many", fail_once)
    supervisor = TaskSupervisor("test")
    writer = guard.RecordWriter(store, supervisor)
    try:
        with anyio.fail_after(5):
            await writer.write("app-1", {"app_id": "app-1", "state": "RUNNING"})
        assert calls == ["app-1", "app-1"]
        assert json.loads((tmp_path / ".apps" / "app-1.json").read_text())["state"] == "RUNNING"
    finally:
        await supervisor.aclose()


@pytest.fixture
async def gated_writer(
    tmp_path: Path,
) -> Any:
    """A RecordWriter over a store whose first ``write_many`` waits in the thread until released,
    and whose calls numbered in ``fail`` (1 for the first) fail with ENOSPC: (writer, store,
    entered, release, fail)."""
    from asynctorchx._tasks import TaskSupervisor

    store = RecordStore(tmp_path)
    await anyio.to_thread.run_sync(store.ensure)
    real = store.write_many
    entered, release = threading.Event(), threading.Event()
    fail: set[int] = set()
    calls = 0

    def write_many(docs: dict[str, Any]) -> dict[str, BaseException]:
        nonlocal calls
        calls += 1
        if calls == 1:
            entered.set()
            release.wait(10)
        if calls in fail:
            return dict.fromkeys(docs, OSError(28, "No space left on device"))
        return real(docs)

    store.write_many = write_many  # type: ignore[method-assign]
    supervisor = TaskSupervisor("test")
    yield guard.RecordWriter(store, supervisor), store, entered, release, fail
    release.set()
    await supervisor.aclose()


async def test_a_version_forgotten_while_its_write_fails_in_the_thread_is_not_retried(
    gated_writer: Any,
) -> None:
    """An undone submit (``forget``, ``flush``, then the record removed) while its version is in
    the writer's thread and that write fails: the write is not retried, so no record of the app
    appears after its removal."""
    writer, store, entered, release, fail = gated_writer
    fail.add(1)
    writer.put("app-1", _doc("app-1"))
    await anyio.to_thread.run_sync(entered.wait, 10)
    writer.forget("app-1")
    release.set()
    await writer.flush()
    await anyio.to_thread.run_sync(store.remove, "app-1")
    assert writer.failing == []
    writer.put("other", _doc("other"))  # (a later batch: a retry would go with it)
    await writer.flush()
    assert store.read("other") is not None
    assert not (store.records_dir / "app-1.json").exists()


async def test_a_callback_runs_once_its_own_version_is_written_not_an_older_one(
    gated_writer: Any,
) -> None:
    """A version queued (with ``on_written``) while an older one of the app is in the thread: the
    callback waits for its own version (the watchdog is told to forget an app only once its end is
    on disk); if that write fails, it is not called, and it is once a retry succeeds."""
    writer, store, entered, release, fail = gated_writer
    fail.add(2)  # the end's first attempt
    called: list[str] = []
    writer.put("app-1", _doc("app-1", "RUNNING"), on_written=lambda: called.append("running"))
    await anyio.to_thread.run_sync(entered.wait, 10)
    writer.put("app-1", _doc("app-1", "SUCCEEDED"), on_written=lambda: called.append("end"))
    release.set()
    await writer.flush()
    assert called == ["running"]
    record = store.read("app-1")
    assert record is not None and record.state == AppState.RUNNING
    assert writer.failing == ["app-1"]
    assert await writer.flush(retry_for=10) is True
    assert called == ["running", "end"]
    record = store.read("app-1")
    assert record is not None and record.state == AppState.SUCCEEDED


@pytest.mark.parametrize("with_spares", [False, True], ids=["created", "from-a-spare"])
def test_a_record_removed_while_a_writer_compacts_it_stays_removed(
    store: RecordStore, monkeypatch: pytest.MonkeyPatch, with_spares: bool
) -> None:
    """The record is removed (an undone submit) after a writer found it due for compaction and
    before the compaction took its lock: the writer stops, as it does when the removal comes
    before an append; it does not make the record again."""
    from asynctorchx.schedulers._local.spares import SparePool

    records = str(store.records_dir)
    path = store.records_dir / "r-1.json"
    i = 0
    while path.stat().st_size + 1100 <= protocol.COMPACT_SIZE if path.exists() else True:
        protocol.write_record_file(records, "r-1", _dumps(_doc("r-1", msg=f"{i}", pad="x" * 1000)))
        i += 1
    spares = SparePool(records) if with_spares else None
    if spares is not None:
        spares.fill_some()
    real = protocol._compact
    compacted: list[bool] = []

    def removed_first(*args: Any) -> bool:
        os.unlink(path)  # the undo's removal lands here
        compacted.append(real(*args))
        return compacted[-1]

    monkeypatch.setattr(protocol, "_compact", removed_first)
    data = _dumps(_doc("r-1", "FAILED", pad="x" * 1000))
    protocol.write_record_file(records, "r-1", data, spares)
    assert compacted == [False]
    assert not path.exists()


def test_what_a_writer_killed_during_a_compaction_left_is_removed_later(
    store: RecordStore,
) -> None:
    """A compaction's temporary file left by a writer killed before its rename is removed by the
    store's lull work once it is over a minute old; a fresh one (a compaction under way), a
    record and other dot-files are left alone."""
    records = store.records_dir
    protocol.write_record_file(str(records), "a-1", _dumps(_doc("a-1")))
    old = records / f".a-1.{dead_pid()}.140000000000.tmp"
    fresh = records / ".a-1.1.140000000001.tmp"
    other = records / ".not-a-compaction.tmp"
    for path in (old, fresh, other):
        path.write_bytes(b'{"partial":')
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    os.utime(other, (time.time() - 3600, time.time() - 3600))
    store.drop_dead_holders()
    assert not old.exists()
    assert fresh.exists() and other.exists()
    assert store.read("a-1") is not None


def test_leftover_temporary_files_of_compactions_and_cancel_markers_are_swept(
    store: RecordStore,
) -> None:
    """A compaction's or a cancel marker's temporary file left by a killed writer (older than a
    minute) is removed by the sweep; fresh ones, records and other dot files stay."""
    records = store.records_dir
    old = time.time() - 3600
    leftovers = [".a-1.123.456.tmp", ".b-2.cancel.789.tmp"]
    kept = [".c-3.cancel.x1.tmp", ".d-4.lock", "e-5.json", ".f-6.cancel.tmp"]
    for name in [*leftovers, *kept]:
        (records / name).write_bytes(b"x")
        os.utime(records / name, (old, old))
    (records / ".g-7.cancel.42.tmp").write_bytes(b"fresh")
    assert protocol.drop_compaction_leftovers(str(records)) == 2
    assert sorted(p.name for p in records.iterdir() if p.name in [*leftovers, *kept]) == sorted(
        kept
    )
    assert (records / ".g-7.cancel.42.tmp").exists()
