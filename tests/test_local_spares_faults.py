"""Faults around spare record files (``spares.py``, ``protocol._link_spare``): spares left in odd
states by killed launchers or by hand, and the pool's growth through real record writes."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
from pathlib import Path

import anyio
import pytest
from _local_env import dead_pid, tiny_tmpfs, wait_for
from test_local_record_spares import _data

from asynctorchx.schedulers._local import protocol, recordfile, spares
from asynctorchx.schedulers._local.records import RecordStore
from asynctorchx.schedulers._local.spares import SparePool
from asynctorchx.schedulers.local import LocalScheduler
from asynctorchx.specs import AppDef, AppState, Role


@pytest.fixture
def records_dir(tmp_path: Path) -> str:
    d = tmp_path / ".apps"
    d.mkdir(mode=0o700)
    return str(d)


def _dead_spare(records_dir: str) -> Path:
    """The path of a spare named for a launcher that is gone (the next pool adopts it)."""
    spare_dir = Path(records_dir, spares.SPARE_DIR)
    spare_dir.mkdir(exist_ok=True)
    return spare_dir / f"{dead_pid()}.12345.cafe0001.0"


def test_a_spare_a_killed_launcher_had_linked_does_not_overwrite_its_record(
    records_dir: str,
) -> None:
    """A spare its launcher linked to a record before being killed (it is that record) is dropped
    when adopted, never emptied and reused: the old app keeps its record, the new one gets its own."""
    spare = _dead_spare(records_dir)
    spare.write_bytes(_data("old-1") + b"\n")
    old = protocol.record_path(records_dir, "old-1")
    os.link(spare, old)  # (killed between the link and the unlink of the spare)
    pool = SparePool(records_dir)
    pool.fill_some(0)  # (adopts it)
    assert len(pool) == 1
    protocol.write_record_file(records_dir, "new-1", _data("new-1"), pool)
    new = protocol.record_path(records_dir, "new-1")
    assert recordfile.read_document(old)["app_id"] == "old-1"
    assert recordfile.read_document(new)["app_id"] == "new-1"
    assert os.stat(old).st_ino != os.stat(new).st_ino
    assert os.stat(old).st_nlink == 1  # the stale link in .spare is gone
    assert os.listdir(os.path.join(records_dir, spares.SPARE_DIR)) == []


def test_a_spare_that_is_a_symlink_is_not_written_through(records_dir: str, tmp_path: Path) -> None:
    """A spare that is a symlink is dropped, not followed: the file it names is left as it was and
    the record is a regular file of its own."""
    precious = tmp_path / "precious.txt"
    precious.write_bytes(b"keep me\n")
    _dead_spare(records_dir).symlink_to(precious)
    pool = SparePool(records_dir)
    pool.fill_some(0)
    assert len(pool) == 1
    protocol.write_record_file(records_dir, "a-1", _data("a-1"), pool)
    assert precious.read_bytes() == b"keep me\n"
    record = Path(protocol.record_path(records_dir, "a-1"))
    assert not record.is_symlink() and record.read_bytes() == protocol._with_room(
        _data("a-1")
    )  # (padded: room for later versions)
    assert os.listdir(os.path.join(records_dir, spares.SPARE_DIR)) == []


def test_a_spare_that_is_a_fifo_does_not_block_the_writer(records_dir: str) -> None:
    """A spare that is a FIFO is dropped at once (opening it for writing would block until a
    reader came): the record is written the usual way."""
    fifo = _dead_spare(records_dir)
    os.mkfifo(fifo)
    pool = SparePool(records_dir)
    pool.fill_some(0)
    assert len(pool) == 1
    adopted = pool._free[0]
    writer = threading.Thread(
        target=protocol.write_record_file,
        args=(records_dir, "a-1", _data("a-1"), pool),
        daemon=True,
    )
    writer.start()
    writer.join(10)
    blocked = writer.is_alive()
    if blocked:  # (unblock the writer: open the FIFO for reading)
        fd = os.open(adopted, os.O_RDONLY | os.O_NONBLOCK)
        writer.join(10)
        os.close(fd)
    assert not blocked
    assert recordfile.read_document(protocol.record_path(records_dir, "a-1"))["app_id"] == "a-1"


def test_a_spare_that_is_a_directory_is_skipped_for_the_next(records_dir: str) -> None:
    """A spare that is a directory is passed over and the next spare used."""
    pool = SparePool(records_dir)
    pool.fill_some(1)
    (real,) = pool._free
    weird = _dead_spare(records_dir)
    weird.mkdir()
    pool._scanned = False
    pool.fill_some(0)  # (adopts the directory, after the real one: it is taken first)
    assert len(pool) == 2 and pool._free[0] == real
    protocol.write_record_file(records_dir, "a-1", _data("a-1"), pool)
    record = protocol.record_path(records_dir, "a-1")
    assert recordfile.read_document(record)["app_id"] == "a-1"
    assert len(pool) == 0


def test_a_burst_larger_than_the_pool_grows_it_through_record_writes(records_dir: str) -> None:
    """New records written while the pool is empty count as spares asked for in vain, so the pool
    grows to the burst (as the README says), not only to the spares it had."""
    pool = SparePool(records_dir)
    pool.fill_some(10)
    burst = spares.MIN_TARGET + 36
    for n in range(burst):
        protocol.write_record_file(records_dir, f"b-{n}", _data(f"b-{n}"), pool)
    assert len(pool) == 0
    assert len(recordfile.list_ids(records_dir)) == burst
    pool.fill_some(0)
    assert pool.target == burst


async def test_a_record_another_process_links_into_place_is_announced(tmp_path: Path) -> None:
    """A subscriber is told of a new record made from a spare by another writer (a link makes no
    IN_CLOSE_WRITE in the records directory), as it is of one created the usual way."""
    root = tmp_path / "root"
    records_dir = root / ".apps"
    records_dir.mkdir(parents=True, mode=0o700)
    scheduler = LocalScheduler("faults", local_root=root)
    told: set[str] = set()
    changed = asyncio.Event()

    def on_change(app_id: str) -> None:
        told.add(app_id)
        changed.set()

    unsubscribe = scheduler.subscribe(on_change)
    try:
        pool = SparePool(str(records_dir))  # (another launcher's)
        await anyio.to_thread.run_sync(pool.fill_some, 2)
        for app_id, spares_of in (("usual-1", None), ("linked-1", pool)):
            data = _data(app_id)
            await anyio.to_thread.run_sync(
                protocol.write_record_file, str(records_dir), app_id, data, spares_of
            )
            with anyio.fail_after(10):
                while app_id not in told:
                    await changed.wait()
                    changed.clear()
        assert len(pool) == 1  # (the second record was made from a spare)
    finally:
        unsubscribe()
        await scheduler.close()


def test_names_with_non_ascii_digits_are_left_alone_not_a_crash(records_dir: str) -> None:
    """A name in .spare whose fields are digits int() does not take (superscripts) is not a spare's
    name: it is left alone, and the pool fills (it used to raise ValueError at every fill, logged as
    a failed background task after every write batch)."""
    spare_dir = Path(records_dir, spares.SPARE_DIR)
    spare_dir.mkdir()
    # (the second is read as a spare of this live process whose start time is unknown)
    odd = [spare_dir / "\u00b2.1.cafe.0", spare_dir / f"{os.getpid()}.\u00b2.cafe.0"]
    for path in odd:
        path.touch()
    pool = SparePool(records_dir)
    assert pool.fill_some(4) == spares.MIN_TARGET - 4
    assert all(path.exists() for path in odd) and len(pool) == 4


def test_a_pool_whose_spare_directory_was_removed_while_empty_makes_it_again(
    records_dir: str,
) -> None:
    """The .spare directory removed while the pool held no spare (a burst took them all): the fill
    that finds it gone fails, and the next one makes the directory again (no spare of the pool is
    left to be found missing, which is what used to reset it)."""
    pool = SparePool(records_dir)
    pool.fill_some(3)
    while pool.take() is not None:
        pass
    spare_dir = Path(records_dir, spares.SPARE_DIR)
    for name in os.listdir(spare_dir):
        os.unlink(spare_dir / name)
    spare_dir.rmdir()
    with pytest.raises(FileNotFoundError):
        pool.fill_some(2)  # (the filler backs off after this)
    pool.fill_some(2)
    assert len(pool) == 2 and len(os.listdir(spare_dir)) == 2


def test_a_pool_never_makes_the_records_directory_or_the_state_root(tmp_path: Path) -> None:
    """With the records directory (or the whole state root) removed, a fill fails rather than make
    them with the umask's mode: only the store makes them (private, checked to be this user's)."""
    root = tmp_path / "root"
    store = RecordStore(root)
    store.ensure()
    store.spares.fill_some(2)
    shutil.rmtree(root)
    store.spares.lost()
    with pytest.raises(FileNotFoundError):
        store.spares.fill_some(2)
    assert not root.exists()
    assert store.write_many({"a-1": json.loads(_data("a-1"))}) == {}  # (the store remakes them)
    assert root.stat().st_mode & 0o777 == 0o700
    assert store.records_dir.stat().st_mode & 0o777 == 0o700
    store.spares.fill_some(2)
    assert len(store.spares) == 2


def test_the_spares_of_a_released_pool_go_to_the_next_pool_of_this_process(
    records_dir: str,
) -> None:
    """A pool released (its scheduler closed) hands its spares to the next pool of its directory
    in this process, which makes none (its owner lives on: nobody would adopt them)."""
    first = SparePool(records_dir)
    first.fill_some(8)
    inodes = {os.stat(p).st_ino for p in first._free}
    first.release()
    assert len(first) == 0 and first.take() is None
    second = SparePool(records_dir)
    second.fill_some(0)
    assert len(second) == 8
    assert {os.stat(p).st_ino for p in second._free} == inodes
    assert len(os.listdir(os.path.join(records_dir, spares.SPARE_DIR))) == 8


@pytest.mark.timeout(60)
async def test_schedulers_made_and_closed_in_turn_do_not_pile_up_spares(tmp_path: Path) -> None:
    """Schedulers of one state root made and closed one after another in one process keep about
    one pool's worth of spares, not one per scheduler."""
    root = tmp_path / "root"
    spare_dir = root / ".apps" / spares.SPARE_DIR
    for n in range(3):
        s = LocalScheduler("faults", local_root=root)
        try:
            app = AppDef("q", [Role("main", image=str(tmp_path), entrypoint="true")])
            await s.submit(app, {})
            pool = s._runtime.store.spares
            with anyio.fail_after(30):
                while pool.wanted:  # (made in the lull after the launch)
                    await anyio.sleep(0.01)
        finally:
            await s.close()
        assert len(os.listdir(spare_dir)) == spares.MIN_TARGET, n


def test_a_forked_child_does_not_take_the_spares_its_parent_released(records_dir: str) -> None:
    """The spares released by a closed pool stay the parent's: a pool in a forked child makes its
    own (both taking the same spare would write two apps' records into one file)."""
    first = SparePool(records_dir)
    first.fill_some(4)
    released = set(first._free)
    first.release()
    pid = os.fork()
    if pid == 0:  # (the child: no pytest machinery, only an exit code)
        code = 1
        try:
            child = SparePool(records_dir)
            child.fill_some(4)
            code = 0 if not set(child._free) & released and len(child) == 4 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    second = SparePool(records_dir)
    second.fill_some(0)  # (also adopts the spares of the child, which is gone)
    assert released <= set(second._free)


@pytest.mark.timeout(60)
async def test_spares_leave_the_inodes_of_a_small_file_system_to_the_apps(tmp_path: Path) -> None:
    """A state root on a file system of 64 inodes: spares are not made there (they took every
    free inode before the first launch, whose claim then failed with ENOSPC, and no app could
    ever launch), and an app launches, runs and has its log."""
    with tiny_tmpfs(tmp_path / "fs", "8m", inodes=64) as fs:
        s = LocalScheduler("small", local_root=fs / "root")
        try:
            app = AppDef("a", [Role("main", image=".", entrypoint="echo", args=["hi"])])
            app_id = await s.submit(app, {})
            assert (await wait_for(s, app_id)).state == AppState.SUCCEEDED
            assert [line async for line in s.log_iter(app_id, "main", 0)] == ["hi\n"]
            spare_dir = fs / "root" / ".apps" / ".spare"
            assert not spare_dir.exists() or not os.listdir(spare_dir)
        finally:
            await s.close()
