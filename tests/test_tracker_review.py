"""The tracker's fixes of a review: odd entry names, a run linked to its parent late, the merge
order of the watch, keys that collide in JSON, job ids too long to store, entries repaired after
the watch skipped them, two remote writers in one clock tick, no subprocess on the event loop, and
one wait per incomplete entry.

Names that the fixes added are imported inside the tests, so that the module also runs (and its
tests fail) against the code before them.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
from _tracker_env import watching
from anyio.streams.memory import MemoryObjectReceiveStream
from conftest import engine_missing

from asynctorchx import AsyncRunner
from asynctorchx.logs import _inotify
from asynctorchx.specs import AppDef, Role
from asynctorchx.tracker import (
    AppRun,
    AsyncTrackerReader,
    InvalidMetadataError,
    MetadataUpdate,
    TrackerError,
)
from asynctorchx.tracker import reader as reader_module
from asynctorchx.tracker.backend import fsspec as backend
from asynctorchx.tracker.backend.fsspec import FsspecTracker

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
FSSPEC_LOGGER = "asynctorchx.tracker.backend.fsspec"
READER_LOGGER = "asynctorchx.tracker.reader"
ODD_NAME = "\u00b2"  # '²': str.isdigit() accepts it, int() does not


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHX_")}
    return {**env, "PYTHONPATH": str(ROOT), "NO_COLOR": "1", **extra}


def tracker_config(tmp_path: Path) -> tuple[Path, Path]:
    """``(root of the runs, .torchxconfig naming the fsspec tracker of that root)``."""
    root = tmp_path / "runs"
    root.mkdir()
    conf = tmp_path / "tracker.conf"
    conf.write_text(f"protocol=file\nroot_path={root}\n")
    cfg = tmp_path / ".torchxconfig"
    cfg.write_text(f"[torchx:tracker]\nfsspec =\n\n[tracker:fsspec]\nconfig = {conf}\n")
    return root, cfg


def mode(monkeypatch: pytest.MonkeyPatch, inotify: bool) -> None:
    if not inotify:
        monkeypatch.setenv(_inotify.DISABLE_ENV, "1")
    elif not _inotify.available():
        engine_missing("inotify")


async def next_update(updates: MemoryObjectReceiveStream[MetadataUpdate]) -> MetadataUpdate:
    with anyio.fail_after(5):
        return await updates.receive()


async def update_where(
    updates: MemoryObjectReceiveStream[MetadataUpdate], pred: Callable[[MetadataUpdate], bool]
) -> MetadataUpdate:
    """The first update for which ``pred`` holds (within 5 s)."""
    with anyio.fail_after(5):
        while True:
            update = await updates.receive()
            if pred(update):
                return update


class LogEvent(logging.Handler):
    """Sets ``event`` when a record whose message holds ``text`` is logged (in any thread)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


@contextlib.contextmanager
def on_log(logger: str, text: str) -> Iterator[threading.Event]:
    handler = LogEvent(text)
    log = logging.getLogger(logger)
    log.addHandler(handler)
    try:
        yield handler.event
    finally:
        log.removeHandler(handler)


async def wait_event(event: threading.Event) -> None:
    assert await anyio.to_thread.run_sync(event.wait, 5), "the event did not happen in 5 s"


# -- 1. an entry name str.isdigit() accepts and int() does not --------------------------------------


def odd_run(tracker: FsspecTracker) -> Path:
    tracker.add_metadata("odd", a=1)
    odd = Path(tracker.category_dir("odd", "metadata")) / ODD_NAME
    odd.write_text('{"metadata": {"b": 2}}')
    return odd


def test_an_odd_entry_name_is_skipped_by_metadata_with_a_warning_naming_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """metadata() sorted the entries with int(name) after name.isdigit(): a bare ValueError naming
    neither the run nor the file."""
    tracker = FsspecTracker(None, tmp_path)
    odd = odd_run(tracker)
    with caplog.at_level(logging.WARNING, FSSPEC_LOGGER):
        assert tracker.metadata("odd") == {"a": 1}
    warnings = [r.getMessage() for r in caplog.records if r.name == FSSPEC_LOGGER]
    assert len(warnings) == 1 and str(odd) in warnings[0], warnings


@pytest.mark.parametrize("inotify", [True, False], ids=["inotify", "scan"])
async def test_an_odd_entry_name_does_not_end_the_watch_of_every_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, inotify: bool
) -> None:
    mode(monkeypatch, inotify)
    tracker = FsspecTracker(None, tmp_path)
    tracker.add_metadata("good", loss=1.0)
    async with (
        AsyncTrackerReader(tracker, poll_interval=0.02) as reader,
        watching(reader) as updates,
    ):
        assert (await next_update(updates)).entry == {"loss": 1.0}
        odd = await anyio.to_thread.run_sync(odd_run, tracker)
        assert (await next_update(updates)).entry == {"a": 1}
        await anyio.to_thread.run_sync(lambda: tracker.add_metadata("good", loss=0.5))
        update = await update_where(updates, lambda u: u.run_id == "good")
        assert update.entry == {"loss": 0.5}
    warnings = [r.getMessage() for r in caplog.records if r.name == READER_LOGGER]
    assert len(warnings) == 1 and str(odd) in warnings[0] and "'odd'" in warnings[0], warnings


def test_the_cli_lists_the_metadata_of_a_run_with_an_odd_entry_name(tmp_path: Path) -> None:
    root, cfg = tracker_config(tmp_path)
    odd = odd_run(FsspecTracker(None, root))
    p = subprocess.run(
        [sys.executable, "-m", "asynctorchx", "tracker", "list", "metadata", "odd", "--json"],
        capture_output=True,
        text=True,
        timeout=30,
        env=child_env(TORCHXCONFIG=str(cfg)),
    )
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == {"a": 1}
    assert str(odd) in p.stderr


def test_entry_names_are_ascii_digits() -> None:
    from asynctorchx.tracker.backend.fsspec import entry_timestamp, is_entry_name

    assert is_entry_name("1700000000000000000")
    assert not any(map(is_entry_name, [ODD_NAME, "\u0661", "12a", "", "-1", ".tmp"]))
    assert backend.entry_sort_key(ODD_NAME) > backend.entry_sort_key("9" * 19)
    assert entry_timestamp("1500000000000000000") == 1.5e9
    assert entry_timestamp(ODD_NAME) is None


# -- 2. a run linked to the watched parent after its first metadata --------------------------------


@pytest.mark.parametrize("inotify", [True, False], ids=["inotify", "scan"])
async def test_a_run_that_records_its_parent_after_its_metadata_is_watched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inotify: bool
) -> None:
    """A run with metadata but without the parent was rejected for good ('a job records its parent
    before anything else'), while run_ids(parent_run_id=) lists it once it adds the parent."""
    mode(monkeypatch, inotify)
    looked_at = threading.Event()
    real_scan = reader_module._FileFollower._scan_run

    def scan_run(self: Any, *args: Any) -> Any:
        scan = real_scan(self, *args)
        if args[1] == "trial-0":
            looked_at.set()
        return scan

    monkeypatch.setattr(reader_module._FileFollower, "_scan_run", scan_run)
    tracker = FsspecTracker(None, tmp_path)
    tracker.add_metadata("trial-0", lr=0.1)
    tracker.add_source("trial-0", "dataset-v2")
    async with (
        AsyncTrackerReader(tracker, poll_interval=0.02) as reader,
        watching(reader, parent_run_id="sweep-7") as updates,
    ):
        await wait_event(looked_at)  # the watch has looked at it: not a child (yet)
        await anyio.to_thread.run_sync(lambda: tracker.add_source("trial-0", "sweep-7"))
        await anyio.to_thread.run_sync(lambda: tracker.add_metadata("trial-0", loss=0.5))
        assert await reader.run_ids(parent_run_id="sweep-7") == ["trial-0"]
        first = await next_update(updates)
        second = await next_update(updates)
    assert (first.run_id, dict(first.entry)) == ("trial-0", {"lr": 0.1})
    assert (second.run_id, dict(second.metadata)) == ("trial-0", {"lr": 0.1, "loss": 0.5})


# -- 3. the watch merges in the order metadata() merges --------------------------------------------


@pytest.mark.parametrize("inotify", [True, False], ids=["inotify", "scan"])
async def test_an_entry_named_before_the_ones_yielded_merges_as_metadata_merges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inotify: bool
) -> None:
    """Two replicas of one job whose clocks differ by 1 ms: the entry of the replica behind arrives
    later but is named earlier, so metadata() (name order) keeps the other one's value."""
    mode(monkeypatch, inotify)
    tracker = FsspecTracker(None, tmp_path)
    run = "local_cwd://s/app"
    async with (
        AsyncTrackerReader(tracker, poll_interval=0.02) as reader,
        watching(reader, [run]) as updates,
    ):
        await anyio.to_thread.run_sync(lambda: tracker.add_metadata(run, loss=1.0, epoch=1))
        first = await next_update(updates)
        metadata_dir = Path(tracker.category_dir(run, "metadata"))
        (name,) = os.listdir(metadata_dir)
        tmp = Path(tracker.run_dir(run)) / ".tmp-behind"
        tmp.write_text(json.dumps({"metadata": {"loss": 2.0, "lr": 0.1}}))
        os.link(tmp, metadata_dir / str(int(name) - 1_000_000))  # the replica 1 ms behind
        tmp.unlink()
        late = await next_update(updates)
        stored = await reader.metadata(run)
    assert stored == {"loss": 1.0, "lr": 0.1, "epoch": 1}
    assert dict(first.metadata) == {"loss": 1.0, "epoch": 1}
    assert dict(late.entry) == {"loss": 2.0, "lr": 0.1}
    assert dict(late.metadata) == stored
    assert late.timestamp == pytest.approx((int(name) - 1_000_000) / 1e9)


async def test_a_writer_preempted_between_its_name_and_its_link_merges_as_metadata_merges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writer A takes its name and stops before linking its file; writer B writes after it. The
    watch yields B then A; metadata() orders A before B."""
    clock = itertools.count(1_700_000_000_000_000_000, 1000)
    monkeypatch.setattr(backend.time, "time_ns", lambda: next(clock))
    real_link = os.link
    a_named, release_a = threading.Event(), threading.Event()

    def link(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if threading.current_thread().name == "A":  # pre-empted between time_ns and link
            a_named.set()
            release_a.wait(10)
        real_link(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "link", link)
    tracker = FsspecTracker(None, tmp_path)
    tracker.add_metadata("r", epoch=0)
    a = threading.Thread(target=lambda: tracker.add_metadata("r", loss=2.0), name="A")
    try:
        async with (
            AsyncTrackerReader(tracker, poll_interval=0.02) as reader,
            watching(reader, ["r"]) as updates,
        ):
            assert (await next_update(updates)).entry == {"epoch": 0}
            a.start()
            await wait_event(a_named)
            await anyio.to_thread.run_sync(lambda: tracker.add_metadata("r", loss=1.0))  # B
            assert dict((await next_update(updates)).metadata) == {"epoch": 0, "loss": 1.0}
            release_a.set()
            late = await next_update(updates)
            stored = await reader.metadata("r")
    finally:
        release_a.set()
        a.join()
    assert stored == {"epoch": 0, "loss": 1.0}
    assert (dict(late.entry), dict(late.metadata)) == ({"loss": 2.0}, stored)


# -- 4. dict keys that JSON writes as one string ---------------------------------------------------


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ({1: "int key", "1": "str key"}, "per_class"),
        ({True: "bool", "true": "str"}, "per_class"),
        ({None: "none", "null": "str"}, "per_class"),
        ({1.5: "float", "1.5": "str"}, "per_class"),
        ([{"ok": 1}, {"x": {2: "a", "2": "b"}}], "per_class[1]['x']"),
    ],
    ids=["int-vs-str", "bool-vs-str", "none-vs-str", "float-vs-str", "nested"],
)
@pytest.mark.parametrize("via", ["app_run", "tracker"])
def test_keys_that_collide_in_json_are_refused_naming_the_key_path(
    tmp_path: Path, value: object, path: str, via: str
) -> None:
    """json.dumps writes 1 and "1" (True and "true", None and "null") as the same key: one of the
    two values was dropped without a word."""
    tracker = FsspecTracker(None, tmp_path)
    with pytest.raises(InvalidMetadataError) as raised:
        if via == "app_run":
            AppRun("r", [tracker]).add_metadata(per_class=value, other=1)
        else:
            tracker.add_metadata("r", per_class=value, other=1)
    assert path in str(raised.value)
    assert not tracker.exists("r")  # nothing written


def test_dicts_with_non_string_keys_that_do_not_collide_are_kept(tmp_path: Path) -> None:
    tracker = FsspecTracker(None, tmp_path)
    AppRun("r", [tracker]).add_metadata(per_class={1: 0.5, 2: 0.25, "3": 0.0}, rows=[{4: "x"}])
    assert tracker.metadata("r") == {
        "per_class": {"1": 0.5, "2": 0.25, "3": 0.0},
        "rows": [{"4": "x"}],
    }


# -- 5. a session name that makes job ids too long to store ----------------------------------------


JOB = (
    "from asynctorchx.tracker import app_run_from_env\n"
    "run = app_run_from_env()\n"
    "print('training starts', flush=True)\n"
    "run.add_metadata(loss=0.25)\n"
)


@pytest.fixture
def tracked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root, cfg = tracker_config(tmp_path)
    monkeypatch.setenv("TORCHXCONFIG", str(cfg))
    monkeypatch.setenv("ASYNCTORCHX_LOCAL_ROOT", str(tmp_path / "state"))
    for key in ("TORCHX_PARENT_RUN_ID", "TORCHX_TRACKERS", "TORCHX_TRACKER_FSSPEC_CONFIG"):
        monkeypatch.delenv(key, raising=False)
    return root


async def test_a_session_name_making_job_ids_too_long_is_refused_at_dry_run(tracked: Path) -> None:
    """The dry run passed, and every job failed at its first add_metadata, after training started."""
    app = AppDef("trainer", [Role("t", image=".", entrypoint=sys.executable, args=["-c", JOB])])
    session = "s" * 140
    async with AsyncRunner(name=session) as runner:
        with pytest.raises(ValueError, match="session name") as raised:
            runner.dryrun(app, "local_cwd")
    message = str(raised.value)
    assert session in message and str(backend.MAX_RUN_ID_BYTES) in message
    assert "'fsspec'" in message


def test_the_longest_session_name_job_ids_fit_after_is_accepted() -> None:
    from asynctorchx.tracker._launch import LONGEST_APP_ID, check_job_ids
    from asynctorchx.tracker.api import TrackerSetting

    trackers = [TrackerSetting("fsspec", "/x.conf")]
    fixed = len("local_cwd:///") + LONGEST_APP_ID["local_cwd"]
    room = backend.MAX_RUN_ID_BYTES - fixed
    check_job_ids("local_cwd", "s" * room, trackers)
    with pytest.raises(ValueError, match=f"at most {room} bytes"):
        check_job_ids("local_cwd", "s" * (room + 1), trackers)
    check_job_ids("local_cwd", "s" * (room + 1), [TrackerSetting("other", None)])  # not ours


def test_the_longest_app_ids_are_those_the_schedulers_make() -> None:
    from asynctorchx.schedulers._k8s import names
    from asynctorchx.specs import make_unique
    from asynctorchx.tracker._launch import LONGEST_APP_ID

    assert max(len(make_unique("x" * 300)) for _ in range(10)) == LONGEST_APP_ID["local_cwd"]
    assert LONGEST_APP_ID["kubernetes"] == names.MAX_LABEL + 1 + names.APP_ID_MAX_LENGTH
    assert LONGEST_APP_ID["slurm"] == len(str(2**32 - 1))


def test_a_job_whose_id_is_too_long_fails_in_app_run_from_env(
    tracked: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = f"local_cwd://{'s' * 140}/trainer-abcdefgh"
    monkeypatch.setenv("TORCHX_JOB_ID", job_id)
    monkeypatch.setenv("TORCHX_TRACKERS", "fsspec")
    monkeypatch.setenv("TORCHX_TRACKER_FSSPEC_CONFIG", str(tracked.parent / "tracker.conf"))
    AppRun.run_from_env.cache_clear()
    try:
        with pytest.raises(TrackerError, match="TORCHX_JOB_ID") as raised:
            AppRun.run_from_env()
    finally:
        AppRun.run_from_env.cache_clear()
    assert "'fsspec'" in str(raised.value) and "too long" in str(raised.value)


# -- 6. an entry repaired after the watch skipped it -----------------------------------------------


@pytest.mark.parametrize("how", ["replaced", "rewritten"])
@pytest.mark.parametrize("inotify", [True, False], ids=["inotify", "scan"])
async def test_an_entry_repaired_after_the_watch_skipped_it_is_yielded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inotify: bool, how: str
) -> None:
    """A copy of runs landing piece by piece (trailing NULs), or a file restored: its name stayed in
    the watch's `seen` for good, and metadata() had values the watch never yielded."""
    mode(monkeypatch, inotify)
    tracker = FsspecTracker(None, tmp_path)
    tracker.add_metadata("r", epoch=0)
    entry = Path(tracker.category_dir("r", "metadata")) / str(10**19 - 1)
    whole = json.dumps({"metadata": {"loss": 0.5}}).encode()
    with on_log(READER_LOGGER, str(entry)) as skipped:
        async with (
            AsyncTrackerReader(tracker, poll_interval=0.02) as reader,
            watching(reader, ["r"]) as updates,
        ):
            assert (await next_update(updates)).entry == {"epoch": 0}
            tmp = Path(tracker.run_dir("r")) / ".tmp-copy"
            tmp.write_bytes(whole + b"\0\0\0\0")
            os.replace(tmp, entry)
            await wait_event(skipped)  # the watch read it and left it out
            if how == "replaced":
                tmp.write_bytes(whole)
                os.replace(tmp, entry)
            else:
                entry.write_bytes(whole)  # in place: same inode, the directory unchanged
            assert (await reader.metadata("r"))["loss"] == 0.5
            update = await next_update(updates)
    assert (dict(update.entry), dict(update.metadata)) == ({"loss": 0.5}, {"epoch": 0, "loss": 0.5})


# -- 7. two writers of a remote store in one clock tick --------------------------------------------


def test_two_remote_writers_in_one_clock_tick_both_keep_their_entry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both writers checked exists() before either opened its file 'wb': same name, one entry lost."""
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    root = "/review-two-writers"
    fs.mkdirs(root, exist_ok=True)
    monkeypatch.setattr(backend.time, "time_ns", lambda: 1_700_000_000_000_000_000)
    both_named = threading.Barrier(2, timeout=10)
    opened = threading.local()
    real_open = fs.open

    def open_(path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "/metadata/" in path and "r" not in mode and not getattr(opened, "once", False):
            opened.once = True
            both_named.wait()  # both have their name before either writes
        return real_open(path, mode, **kwargs)

    monkeypatch.setattr(fs, "open", open_)
    try:
        tracker = FsspecTracker(fs, root)
        threads = [
            threading.Thread(target=tracker.add_metadata, args=("r",), kwargs={f"rank{i}": i})
            for i in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        monkeypatch.setattr(fs, "open", real_open)
        assert tracker.metadata("r") == {"rank0": 0, "rank1": 1}
        names = tracker.entry_names("r", "metadata")
        assert all(n.isascii() and n.isdigit() and len(n) == 19 for n in names), names
    finally:
        fs.rm(root, recursive=True)


def test_a_remote_entry_name_found_taken_is_not_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mode "xb" refuses a name taken; the writer takes another (and a writer's names increase)."""
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    root = "/review-name-taken"
    fs.mkdirs(root, exist_ok=True)
    names = iter(["1700000000000000001", "1700000000000000001", "1700000000000000002"])
    monkeypatch.setattr(backend, "_remote_entry_name", lambda: next(names))
    try:
        tracker = FsspecTracker(fs, root)
        tracker.add_metadata("r", first=1)
        tracker.add_metadata("r", second=2)
        assert tracker.entry_names("r", "metadata") == [
            "1700000000000000001",
            "1700000000000000002",
        ]
        assert tracker.metadata("r") == {"first": 1, "second": 2}
    finally:
        fs.rm(root, recursive=True)
    monkeypatch.undo()
    monkeypatch.setattr(backend.time, "time_ns", lambda: 1_700_000_000_000_000_000)
    picked = [int(backend._remote_entry_name()) for _ in range(100)]
    assert picked == sorted(set(picked))


# -- 8. no subprocess on the event loop ------------------------------------------------------------

NO_SUBPROCESS = r"""
import asyncio, subprocess, sys, threading, traceback
calls = []
real_init = subprocess.Popen.__init__
def popen(self, *args, **kwargs):
    calls.append((threading.current_thread().name, args[0] if args else kwargs.get("args")))
    return real_init(self, *args, **kwargs)
subprocess.Popen.__init__ = popen

from asynctorchx.tracker import AsyncTrackerReader
from asynctorchx.tracker.backend import fsspec

tracker = fsspec.FsspecTracker(None, sys.argv[1])
tracker.add_metadata("r", x=1)
fsspec._rename_noreplace_fn()  # a writer on a file system without hard links

async def main():
    async with AsyncTrackerReader(tracker) as reader:
        async for update in reader.watch_metadata(["r"]):
            break
asyncio.run(main())
print(calls)
"""


def test_the_first_watch_and_a_writer_run_no_subprocess(tmp_path: Path) -> None:
    """ctypes.util.find_library("c") runs `ldconfig -p` (or gcc) in a subprocess: on the event
    loop thread at the first watch of a process."""
    p = subprocess.run(
        [sys.executable, "-c", NO_SUBPROCESS, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]", f"subprocesses: {p.stdout}"


def test_inotify_is_found_without_find_library() -> None:
    if sys.platform != "linux":
        pytest.skip("inotify is Linux's")
    assert _inotify._load_inotify_libc().inotify_init1 is not None
    assert backend._libc_function("rename") is not None


# -- lesser: an incomplete entry is waited for once, not at every read ----------------------------


def test_an_incomplete_entry_is_waited_for_once_not_at_every_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Each metadata() call slept INCOMPLETE_WAIT per half entry a killed writer left: a worker
    thread of the driver blocked for half a second at every read of the run."""
    monkeypatch.setattr(backend, "INCOMPLETE_WAIT", 1.0)
    tracker = FsspecTracker(None, tmp_path)
    tracker.add_metadata("r", epoch=1)
    half = Path(tracker.category_dir("r", "metadata")) / "99999999999999999999"
    half.write_text('{"metadata": {"epoch": 2, "lo')
    with caplog.at_level(logging.WARNING, FSSPEC_LOGGER):
        t0 = time.monotonic()
        assert tracker.metadata("r") == {"epoch": 1}
        first = time.monotonic() - t0
        t0 = time.monotonic()
        assert tracker.metadata("r") == {"epoch": 1}
        second = time.monotonic() - t0
    assert first >= 1.0 and second < 0.5, (first, second)
    half.write_text('{"metadata": {"epoch": 2, "loss": 0.5}}')
    assert tracker.metadata("r") == {"epoch": 2, "loss": 0.5}
