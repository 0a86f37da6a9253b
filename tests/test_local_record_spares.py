"""Spare record files (``spares.py``): empty files made in lulls, into which a new app's first record
is written and which are then linked into place; the spares of a launcher that is gone are adopted
by the next one."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import anyio
import pytest
from _local_env import dead_pid, poll_until

from asynctorchx.schedulers._local import launch, protocol, recordfile, spares
from asynctorchx.schedulers._local.records import RecordStore
from asynctorchx.schedulers._local.spares import SparePool
from asynctorchx.schedulers.local import LocalScheduler
from asynctorchx.specs import AppDef, Role, is_terminal

REPO = Path(__file__).resolve().parent.parent


def _data(app_id: str, state: str = "RUNNING") -> bytes:
    doc = {"app_id": app_id, "state": state, "owner": {"pid": 1}, "replicas": []}
    return json.dumps(doc, separators=(",", ":")).encode()


@pytest.fixture
def records_dir(tmp_path: Path) -> str:
    d = tmp_path / ".apps"
    d.mkdir()
    return str(d)


def _spare_names(records_dir: str) -> list[str]:
    try:
        return sorted(os.listdir(os.path.join(records_dir, spares.SPARE_DIR)))
    except FileNotFoundError:
        return []


# -- the pool --------------------------------------------------------------------------------------


def test_a_pool_makes_empty_private_spares_a_chunk_at_a_time(records_dir: str) -> None:
    pool = SparePool(records_dir)
    assert pool.wanted == spares.MIN_TARGET and len(pool) == 0
    left = pool.fill_some(10)
    assert left == spares.MIN_TARGET - 10 and len(pool) == 10
    names = _spare_names(records_dir)
    assert len(names) == 10
    for name in names:
        st = os.stat(os.path.join(records_dir, spares.SPARE_DIR, name))
        assert st.st_size == 0 and st.st_mode & 0o777 == 0o600
        assert name.startswith(f"{os.getpid()}.")
    while pool.fill_some():
        pass
    assert len(pool) == spares.MIN_TARGET == len(_spare_names(records_dir))


def test_a_fill_stops_at_its_deadline(records_dir: str) -> None:
    pool = SparePool(records_dir)
    assert pool.fill_some(8, until=time.monotonic()) == spares.MIN_TARGET  # nothing made
    assert len(pool) == 0 and _spare_names(records_dir) == []
    pool.fill_some(8, until=time.monotonic() + 60)
    assert len(pool) == 8


def test_each_spare_is_handed_out_once_and_none_when_the_pool_is_empty(records_dir: str) -> None:
    pool = SparePool(records_dir)
    pool.fill_some(5)
    taken = [pool.take() for _ in range(5)]
    assert None not in taken and len(set(taken)) == 5
    assert pool.take() is None
    assert pool.wanted == spares.MIN_TARGET


def test_the_pool_grows_to_the_largest_burst_up_to_its_bound(records_dir: str) -> None:
    pool = SparePool(records_dir)
    for _ in range(spares.MIN_TARGET + 40):  # a burst of new records (most found none)
        pool.take()
    pool.fill_some(1)
    assert pool.target == spares.MIN_TARGET + 40
    for _ in range(10 * spares.MAX_TARGET):
        pool.take()
    pool.fill_some(1)
    assert pool.target == spares.MAX_TARGET
    for _ in range(3):  # a smaller burst later does not shrink it
        pool.take()
    pool.fill_some(1)
    assert pool.target == spares.MAX_TARGET


def test_the_spares_of_a_process_that_is_gone_are_adopted_not_made_again(
    records_dir: str,
) -> None:
    """A dead launcher's spares become this pool's (same inodes, renamed); a live process's spares
    and files that are not spares are left alone."""
    spare_dir = Path(records_dir, spares.SPARE_DIR)
    spare_dir.mkdir()
    dead = dead_pid()
    theirs = [spare_dir / f"{dead}.12345.cafe0001.{n}" for n in range(3)]
    for path in theirs:
        path.touch()
    inodes = {p.stat().st_ino for p in theirs}
    parent = os.getppid()
    live = spare_dir / f"{parent}.{recordfile.proc_start_ticks(parent)}.beef0002.0"
    live.touch()
    stray = spare_dir / "notes.txt"
    stray.touch()

    pool = SparePool(records_dir)
    pool.fill_some(0)  # (adopts; makes none)
    assert len(pool) == 3
    assert not any(p.exists() for p in theirs)
    adopted = [pool.take() for _ in range(3)]
    assert {os.stat(p).st_ino for p in adopted if p is not None} == inodes
    assert all(p is not None and os.path.basename(p).startswith(f"{os.getpid()}.") for p in adopted)
    assert live.exists() and stray.exists()


def test_two_pools_on_one_directory_never_share_a_spare(records_dir: str) -> None:
    first, second = SparePool(records_dir), SparePool(records_dir)
    first.fill_some(8)
    second.fill_some(8)  # (first's owner, this process, is alive: nothing adopted)
    a = {first.take() for _ in range(8)}
    b = {second.take() for _ in range(8)}
    assert None not in a | b and not a & b
    assert first.take() is None and second.take() is None


# -- records made from spares -------------------------------------------------------------------


def test_a_new_record_is_a_spare_written_then_linked_into_place(records_dir: str) -> None:
    pool = SparePool(records_dir)
    pool.fill_some(4)
    spare_inodes = {
        os.stat(os.path.join(records_dir, spares.SPARE_DIR, n)).st_ino
        for n in _spare_names(records_dir)
    }
    protocol.write_record_file(records_dir, "a-1", _data("a-1"), pool)
    path = Path(protocol.record_path(records_dir, "a-1"))
    st = path.stat()
    assert st.st_ino in spare_inodes and st.st_nlink == 1 and st.st_mode & 0o777 == 0o600
    assert path.read_bytes() == protocol._with_room(
        _data("a-1")
    )  # (padded: room for later versions)
    assert len(pool) == 3 and len(_spare_names(records_dir)) == 3
    assert recordfile.list_ids(records_dir) == ["a-1"]


def test_a_later_version_is_appended_without_taking_a_spare(records_dir: str) -> None:
    pool = SparePool(records_dir)
    pool.fill_some(4)
    protocol.write_record_file(records_dir, "a-1", _data("a-1"), pool)
    inode = os.stat(protocol.record_path(records_dir, "a-1")).st_ino
    protocol.write_record_file(records_dir, "a-1", _data("a-1", "SUCCEEDED"), pool)
    path = protocol.record_path(records_dir, "a-1")
    assert os.stat(path).st_ino == inode and len(pool) == 3
    assert recordfile.read_document(path)["state"] == "SUCCEEDED"


class _RacingSpares:
    """Hands out a real spare, but first creates the record, as another process would meanwhile."""

    def __init__(self, pool: SparePool, records_dir: str, app_id: str) -> None:
        self.pool, self.records_dir, self.app_id = pool, records_dir, app_id
        self.lost_called = False

    def take(self) -> str | None:
        protocol.write_record_file(self.records_dir, self.app_id, _data(self.app_id, "PENDING"))
        return self.pool.take()

    def lost(self) -> None:
        self.lost_called = True


def test_a_record_made_meanwhile_is_appended_to_not_replaced(records_dir: str) -> None:
    pool = SparePool(records_dir)
    pool.fill_some(2)
    racing = _RacingSpares(pool, records_dir, "r-1")
    protocol.write_record_file(records_dir, "r-1", _data("r-1"), racing)
    lines = Path(protocol.record_path(records_dir, "r-1")).read_bytes().splitlines()
    assert [json.loads(line)["state"] for line in lines if line] == ["PENDING", "RUNNING"]
    assert len(_spare_names(records_dir)) == 1  # the written spare was not left behind
    assert not racing.lost_called


def test_a_spare_written_by_a_launcher_that_died_is_emptied_first(records_dir: str) -> None:
    pool = SparePool(records_dir)
    pool.fill_some(1)
    (name,) = _spare_names(records_dir)
    Path(records_dir, spares.SPARE_DIR, name).write_bytes(b'{"app_id": "other", "state": "FAI')
    protocol.write_record_file(records_dir, "a-1", _data("a-1"), pool)
    assert Path(protocol.record_path(records_dir, "a-1")).read_bytes() == protocol._with_room(
        _data("a-1")
    )  # (padded: room for later versions)


def test_removed_spares_are_forgotten_and_the_record_made_as_usual(records_dir: str) -> None:
    pool = SparePool(records_dir)
    pool.fill_some(3)
    for name in _spare_names(records_dir):
        os.unlink(os.path.join(records_dir, spares.SPARE_DIR, name))
    os.rmdir(os.path.join(records_dir, spares.SPARE_DIR))
    protocol.write_record_file(records_dir, "a-1", _data("a-1"), pool)
    assert recordfile.read_document(protocol.record_path(records_dir, "a-1"))["app_id"] == "a-1"
    assert len(pool) == 0  # all forgotten at the first that was gone
    pool.fill_some(2)  # the directory is made again
    assert len(_spare_names(records_dir)) == 2


def test_a_full_disk_while_writing_a_spare_leaves_neither_it_nor_a_record(
    records_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first version does not fit: the spare it was written into is removed and the usual
    creation reports ENOSPC, as without spares (an empty file is no record)."""
    pool = SparePool(records_dir)
    pool.fill_some(2)

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(protocol.os, "write", full)
    with pytest.raises(OSError) as raised:
        protocol.write_record_file(records_dir, "a-1", _data("a-1"), pool)
    assert raised.value.errno == errno.ENOSPC
    assert len(_spare_names(records_dir)) == 1
    path = Path(protocol.record_path(records_dir, "a-1"))
    assert not path.exists() or path.stat().st_size == 0
    store = RecordStore(Path(records_dir).parent)
    assert store.read("a-1") is None


def test_a_store_whose_records_directory_was_removed_remakes_it_and_its_spares(
    tmp_path: Path,
) -> None:
    store = RecordStore(tmp_path / "root")
    store.ensure()
    store.spares.fill_some(4)
    for path in sorted(store.records_dir.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    store.records_dir.rmdir()
    assert store.write_many({"a-1": json.loads(_data("a-1"))}) == {}
    assert store.read("a-1") is not None
    assert len(store.spares) == 0
    store.spares.fill_some(2)
    assert len(_spare_names(str(store.records_dir))) == 2


# -- a scheduler's spares --------------------------------------------------------------------------


def _quick(tmp_path: Path, name: str = "q") -> AppDef:
    return AppDef(name, [Role("main", image=str(tmp_path), entrypoint="sh", args=["-c", "exit 0"])])


async def _ended(s: LocalScheduler, app_id: str) -> None:
    with anyio.fail_after(30):
        while (d := await s.describe(app_id)) is None or not is_terminal(d.state):
            await anyio.sleep(0.01)


@pytest.mark.timeout(60)
async def test_a_scheduler_makes_spares_in_a_lull_and_its_records_come_from_them(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    s = LocalScheduler("sp", local_root=root)
    records_dir = str(root / ".apps")
    spare_dir = os.path.join(records_dir, spares.SPARE_DIR)
    try:
        first = await s.submit(_quick(tmp_path), {})
        await _ended(s, first)
        await poll_until(
            lambda: len(_spare_names(records_dir)) >= spares.MIN_TARGET, "the spares to be made"
        )
        before = {os.stat(os.path.join(spare_dir, n)).st_ino for n in _spare_names(records_dir)}
        second = await s.submit(_quick(tmp_path), {})
        inode = os.stat(protocol.record_path(records_dir, second)).st_ino
        assert inode in before
        await _ended(s, second)
    finally:
        await s.close()
    assert sorted(recordfile.list_ids(records_dir)) == sorted([first, second])


@pytest.mark.timeout(60)
async def test_a_schedulers_first_records_come_from_spares_made_before_its_first_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst right after the first app (no lull yet) writes its records into spares made while
    the scheduler prepared its first launch (the time allowed for them raised: a loaded file
    system may make fewer than nine in 5 ms)."""
    monkeypatch.setattr(launch, "FIRST_SPARES_TIME", 30.0)
    root = tmp_path / "root"
    s = LocalScheduler("sp", local_root=root)
    records_dir = str(root / ".apps")
    spare_dir = os.path.join(records_dir, spares.SPARE_DIR)
    made: set[int] = set()
    fill = SparePool.fill_some

    def noting(self: SparePool, count: int = spares.CHUNK, until: float | None = None) -> int:
        left = fill(self, count, until)
        made.update(os.stat(os.path.join(spare_dir, n)).st_ino for n in os.listdir(spare_dir))
        return left

    try:
        with monkeypatch.context() as mp:
            mp.setattr(SparePool, "fill_some", noting)
            first = await s.submit(_quick(tmp_path), {})
            burst = [await s.submit(_quick(tmp_path), {}) for _ in range(8)]
        inodes = {os.stat(protocol.record_path(records_dir, a)).st_ino for a in [first, *burst]}
        assert inodes <= made
        for app_id in [first, *burst]:
            await _ended(s, app_id)
    finally:
        await s.close()


@pytest.mark.timeout(60)
async def test_a_scheduler_that_cannot_make_spares_records_its_apps_as_usual(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def cannot(self: SparePool, count: int = spares.CHUNK, until: float | None = None) -> int:
        calls.append(count)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SparePool, "fill_some", cannot)
    root = tmp_path / "root"
    s = LocalScheduler("sp", local_root=root)
    try:
        app_id = await s.submit(_quick(tmp_path), {})
        await _ended(s, app_id)
        await poll_until(lambda: len(calls) >= 2, "an attempt to make spares in a lull")
        again = await s.submit(_quick(tmp_path), {})
        await _ended(s, again)
    finally:
        await s.close()
    # one attempt before the first launch, one in the lull after it; not retried at once, nor in a
    # loop
    assert len(calls) == 2
    assert _spare_names(str(root / ".apps")) == []
    for a in (app_id, again):
        doc = recordfile.read_document(root / ".apps" / f"{a}.json")
        assert doc["state"] == "SUCCEEDED"


@pytest.mark.timeout(60)
async def test_a_service_launching_every_20_ms_keeps_getting_spares(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Launches 20 ms apart never leave the 50 ms lull in which spares are made; a pool down to
    less than a chunk is refilled after a 10 ms one, so the records of such a service keep coming
    from spares once its first ones are used up (before: every record after the 16th was created in
    the writer's thread, a hop each ``run()`` waited for)."""
    monkeypatch.setattr(spares, "MIN_TARGET", spares.CHUNK)
    taken: list[bool] = []
    take = SparePool.take

    def counting(self: SparePool) -> str | None:
        got = take(self)
        taken.append(got is not None)
        return got

    root = tmp_path / "root"
    s = LocalScheduler("sp", local_root=root)
    try:
        await _ended(s, await s.submit(_quick(tmp_path), {}))
        await poll_until(lambda: len(s._runtime.store.spares) >= spares.CHUNK, "the first spares")
        monkeypatch.setattr(SparePool, "take", counting)
        for _ in range(4 * spares.CHUNK):
            await s.submit(_quick(tmp_path), {})
            await anyio.sleep(0.02)
    finally:
        await s.close()
    assert len(taken) == 4 * spares.CHUNK
    assert taken.count(False) <= spares.CHUNK // 2, taken


LAUNCHER = """
import asyncio, sys, time
from asynctorchx.schedulers.local import LocalScheduler
from asynctorchx.specs import AppDef, Role

async def main():
    s = LocalScheduler("sp", local_root=sys.argv[1])
    role = Role("main", image=sys.argv[2], entrypoint="sh", args=["-c", "exit 0"])
    await s.submit(AppDef("dying", [role]), {})
    print("launched", flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


@pytest.mark.timeout(90)
async def test_the_spares_of_a_killed_launcher_are_adopted_by_the_next(tmp_path: Path) -> None:
    root = tmp_path / "root"
    records_dir = str(root / ".apps")
    env = {**os.environ, "PYTHONPATH": str(REPO), "ATX_TEST_TOKEN": uuid.uuid4().hex}
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(root), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        with anyio.fail_after(30):
            line = await anyio.to_thread.run_sync(proc.stdout.readline)
        assert line.strip() == "launched"
        prefix = f"{proc.pid}."
        await poll_until(
            lambda: (
                sum(n.startswith(prefix) for n in _spare_names(records_dir)) >= spares.MIN_TARGET
            ),
            "the launcher's spares",
            timeout=30,
        )
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    theirs = {
        os.stat(os.path.join(records_dir, spares.SPARE_DIR, n)).st_ino
        for n in _spare_names(records_dir)
        if n.startswith(prefix)
    }
    s = LocalScheduler("sp", local_root=root)
    try:
        app_id = await s.submit(_quick(tmp_path), {})
        await _ended(s, app_id)
        await poll_until(
            lambda: not any(n.startswith(prefix) for n in _spare_names(records_dir)),
            "the dead launcher's spares to be adopted",
        )
    finally:
        await s.close()
    ours = {
        os.stat(os.path.join(records_dir, spares.SPARE_DIR, n)).st_ino
        for n in _spare_names(records_dir)
    }
    # the spares left are the dead launcher's, but for the one made to replace a spare this
    # scheduler's app record may have taken
    assert len(ours - theirs) <= 1 and len(ours & theirs) >= spares.MIN_TARGET - 1
