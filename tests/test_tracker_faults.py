"""The file tracker and its reader facing faults: odd files among a run's entries, killed writers,
moved directories, a full disk, input the tracker cannot store."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from _local_env import tiny_tmpfs as local_tmpfs
from _tracker_env import watching
from anyio.streams.memory import MemoryObjectReceiveStream
from conftest import engine_missing

from asynctorchx import AsyncRunner
from asynctorchx.logs import _inotify
from asynctorchx.specs import AppDef, Role
from asynctorchx.tracker import (
    AsyncTrackerReader,
    InvalidMetadataError,
    MetadataUpdate,
    TrackerError,
    UnknownRunError,
)
from asynctorchx.tracker.api import MAX_JSON_DEPTH, AppRun, TrackerWriteError
from asynctorchx.tracker.backend import fsspec
from asynctorchx.tracker.backend.fsspec import FsspecTracker, encode_run_id

ROOT = Path(__file__).resolve().parent.parent
FSSPEC_LOGGER = "asynctorchx.tracker.backend.fsspec"
READER_LOGGER = "asynctorchx.tracker.reader"


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHX_")}
    return {**env, "PYTHONPATH": str(ROOT), "NO_COLOR": "1", **extra}


def torchxconfig(tmp_path: Path, config: Path) -> Path:
    """A .torchxconfig whose fsspec tracker has the config file ``config``."""
    path = tmp_path / ".torchxconfig"
    path.write_text(f"[torchx:tracker]\nfsspec =\n\n[tracker:fsspec]\nconfig = {config}\n")
    return path


def nest(depth: int) -> object:
    value: object = 0
    for _ in range(depth):
        value = [value]
    return value


def require_inotify() -> None:
    if not _inotify.available():
        engine_missing("inotify")


async def next_update(updates: MemoryObjectReceiveStream[MetadataUpdate]) -> tuple[str, object]:
    with anyio.fail_after(5):
        u = await updates.receive()
    return u.run_id, dict(u.entry)


# -- 1. a config file that is a FIFO ---------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("who", ["job", "cli"])
def test_a_tracker_config_that_is_a_fifo_is_an_error_naming_it(tmp_path: Path, who: str) -> None:
    """A job's app_run_from_env() and 'tracker list runs' used to wait forever (deaf to Ctrl+C) for
    a writer of a config FIFO."""
    fifo = tmp_path / "tracker.conf"
    os.mkfifo(fifo)
    if who == "job":
        args = ["-c", "from asynctorchx.tracker import app_run_from_env; app_run_from_env()"]
        env = child_env(TORCHX_TRACKERS="fsspec", TORCHX_TRACKER_FSSPEC_CONFIG=str(fifo))
    else:
        args = ["-m", "asynctorchx", "tracker", "list", "runs"]
        env = child_env(TORCHXCONFIG=str(torchxconfig(tmp_path, fifo)))
    try:
        p = subprocess.run(
            [sys.executable, *args], capture_output=True, text=True, timeout=20, env=env
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {who} hung reading a tracker config that is a FIFO")
    assert p.returncode != 0
    assert str(fifo) in p.stderr and "FIFO" in p.stderr, p.stderr


# -- 2, 3. a FIFO or a directory among a run's entries ---------------------------------------------

READ_ALL = """
import json, sys
from asynctorchx.tracker.backend.fsspec import FsspecTracker
t = FsspecTracker(None, sys.argv[1])
print(json.dumps({
    "metadata": t.metadata("r"),
    "artifacts": sorted(t.artifacts("r")),
    "sources": [s.source_run_id for s in t.sources("r")],
    "entry_names": t.entry_names("r", sys.argv[2]),
}))
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "directory"])
@pytest.mark.parametrize("category", ["metadata", "artifacts", "sources"])
def test_a_fifo_or_directory_among_a_runs_entries_is_skipped_with_a_warning(
    tmp_path: Path, kind: str, category: str
) -> None:
    """metadata(), artifacts() and sources() (so 'tracker list' and the reader) used to hang for
    ever on a FIFO among a run's entries, and to raise a bare IsADirectoryError on a directory."""
    tracker = FsspecTracker(None, tmp_path)
    tracker.add_metadata("r", a=1)
    tracker.add_artifact("r", "ckpt", "/c.pt")
    tracker.add_source("r", "parent")
    odd = Path(tracker.category_dir("r", category)) / (
        encode_run_id("other") if category == "sources" else "99999999999999999999"
    )
    if kind == "fifo":
        os.mkfifo(odd)
    else:
        odd.mkdir()
    try:
        p = subprocess.run(
            [sys.executable, "-c", READ_ALL, str(tmp_path), category],
            capture_output=True,
            text=True,
            timeout=20,
            env=child_env(),
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"reading run 'r' hung on a {kind} among its {category}")
    assert p.returncode == 0, p.stderr
    found = json.loads(p.stdout)
    assert found["metadata"] == {"a": 1}
    assert found["artifacts"] == ["ckpt"]
    assert found["sources"] == ["parent"]
    if kind == "directory":
        assert odd.name not in found["entry_names"]  # only files are entries
    else:
        assert f"skipping {odd}: a FIFO, not a regular file" in p.stderr, p.stderr


# -- 4. one bad run and the watch of the others ----------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("inotify", [True, False], ids=["inotify", "scan"])
async def test_a_corrupt_entry_is_skipped_by_the_watch_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, inotify: bool
) -> None:
    """An entry that is not JSON in one run used to end watch_metadata() for every run."""
    if inotify:
        require_inotify()
    else:
        monkeypatch.setenv(_inotify.DISABLE_ENV, "1")
    tracker = FsspecTracker(None, tmp_path)
    tracker.add_metadata("bad", a=1)
    bad_entry = Path(tracker.category_dir("bad", "metadata")) / "1"
    bad_entry.write_text("{not json}")
    tracker.add_metadata("good", a=1)
    async with (
        AsyncTrackerReader(tracker, poll_interval=0.05) as reader,
        watching(reader) as updates,
    ):
        got = sorted([await next_update(updates), await next_update(updates)], key=str)
        assert got == [("bad", {"a": 1}), ("good", {"a": 1})]
        await anyio.to_thread.run_sync(lambda: tracker.add_metadata("bad", a=2))
        assert await next_update(updates) == ("bad", {"a": 2})
    warnings = [r.getMessage() for r in caplog.records if r.name == READER_LOGGER]
    assert len(warnings) == 1 and str(bad_entry) in warnings[0], warnings


@pytest.mark.timeout(60)
@pytest.mark.parametrize("inotify", [True, False], ids=["inotify", "scan"])
async def test_a_run_that_cannot_be_read_is_logged_once_and_the_others_are_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, inotify: bool
) -> None:
    """A run whose directory could not be listed (EACCES) used to end the watch of every run; it
    is scanned again until it can be read."""
    if inotify:
        require_inotify()
    else:
        monkeypatch.setenv(_inotify.DISABLE_ENV, "1")
    tracker = FsspecTracker(None, tmp_path)
    tracker.add_metadata("locked", a=1)
    tracker.add_metadata("good", a=1)
    real = FsspecTracker.entry_names
    locked = True

    def entry_names(self: FsspecTracker, run_id: str, category: str) -> list[str]:
        if run_id == "locked" and locked:
            raise PermissionError(errno.EACCES, "Permission denied", self.run_dir(run_id))
        return real(self, run_id, category)

    monkeypatch.setattr(FsspecTracker, "entry_names", entry_names)
    async with (
        AsyncTrackerReader(tracker, poll_interval=0.02) as reader,
        watching(reader) as updates,
    ):
        assert await next_update(updates) == ("good", {"a": 1})
        await anyio.to_thread.run_sync(lambda: tracker.add_metadata("good", a=2))
        assert await next_update(updates) == ("good", {"a": 2})
        locked = False
        assert await next_update(updates) == ("locked", {"a": 1})
    warnings = [r.getMessage() for r in caplog.records if r.name == READER_LOGGER]
    assert len(warnings) == 1, warnings
    assert "'locked'" in warnings[0] and tracker.run_dir("locked") in warnings[0]


# -- 5. an entry cut off inside a string -----------------------------------------------------------

WHOLE = '{"metadata": {"epoch": 2, "loss": 0.4, "name": "h\u00e9llo", "ok": true, "u": "\\u00e9"}}'


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "cut",
    ['{"metadata": {"epoch": 2, "lo', '"name": "h', '"name": "h\u00e9', "0.", "tr", '"\\u0'],
)
def test_an_entry_cut_off_anywhere_is_in_progress_not_corrupt(tmp_path: Path, cut: str) -> None:
    """An entry a non-atomic writer has written up to inside a string (or a number, a literal, a
    character of several bytes) used to be called 'not valid JSON', ending the watch."""
    tracker = FsspecTracker(None, tmp_path)
    tracker.add_metadata("r", epoch=1)
    data = WHOLE.encode()
    end = data.index(cut.encode()) + len(cut.encode())
    if cut == '"name": "h\u00e9':
        end -= 1  # inside the two bytes of the é
    path = Path(tracker.category_dir("r", "metadata")) / "99999999999999999999"
    path.write_bytes(data[:end])
    assert tracker.read_entry("r", "metadata", path.name) is None
    path.write_bytes(data)
    assert tracker.read_entry("r", "metadata", path.name) == json.loads(WHOLE)


@pytest.mark.timeout(60)
def test_an_entry_with_junk_after_its_cut_is_still_corrupt(tmp_path: Path) -> None:
    """What is not a prefix of JSON is reported naming the file, not waited for."""
    tracker = FsspecTracker(None, tmp_path)
    path = Path(tracker.category_dir("r", "metadata")) / "1"
    path.parent.mkdir(parents=True)
    for junk in ('{"metadata": {"a": 1.}}', '{"metadata": {"a": tru }}', "{not json}"):
        path.write_text(junk)
        with pytest.raises(TrackerError, match=f"{path} is not valid JSON"):
            tracker.read_entry("r", "metadata", "1")


# -- 6. a writer killed half-way through an entry --------------------------------------------------


@pytest.mark.timeout(60)
def test_an_entry_a_killed_writer_left_incomplete_is_skipped_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A half entry left by a writer SIGKILLed mid-write used to fail every later read of the run
    (and 'tracker list metadata') with 'stays empty or incomplete'."""
    monkeypatch.setattr(fsspec, "INCOMPLETE_WAIT", 0.05)
    tracker = FsspecTracker(None, tmp_path)
    tracker.add_metadata("r", epoch=1)
    half = Path(tracker.category_dir("r", "metadata")) / "99999999999999999999"
    half.write_text('{"metadata": {"epoch": 2, "lo')
    tracker.add_artifact("r", "ckpt", "/c.pt")
    (Path(tracker.category_dir("r", "artifacts")) / "99999999999999999999").write_text("")
    with caplog.at_level(logging.WARNING, FSSPEC_LOGGER):
        assert tracker.metadata("r") == {"epoch": 1}
        assert list(tracker.artifacts("r")) == ["ckpt"]
    warnings = [r.getMessage() for r in caplog.records if r.name == FSSPEC_LOGGER]
    assert len(warnings) == 2 and f"skipping {half}: still empty or incomplete" in warnings[0]


KILLED_WRITER = """
import builtins, errno, os, signal, sys
from asynctorchx.tracker.backend.fsspec import FsspecTracker

def no_link(*args, **kwargs):  # a file system without hard links (vfat, exfat, CIFS, some FUSE)
    raise OSError(errno.EPERM, "Operation not permitted")

class DiesHalfWay:
    def __init__(self, f):
        self.f = f
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.f.close()
    def write(self, data):
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

real_open, real_fdopen = builtins.open, os.fdopen

def open_(path, mode="r", *args, **kwargs):
    f = real_open(path, mode, *args, **kwargs)
    hidden = os.path.basename(os.fspath(path)).startswith(".")
    return f if hidden or "b" not in mode or "r" in mode else DiesHalfWay(f)

os.link = no_link
builtins.open = open_
os.fdopen = lambda fd, mode="r", *args, **kwargs: DiesHalfWay(real_fdopen(fd, mode, *args, **kwargs))
FsspecTracker(None, sys.argv[1]).add_metadata("r", epoch=2, loss="x" * 40)
"""


@pytest.mark.timeout(60)
def test_a_writer_killed_mid_write_without_hard_links_leaves_no_half_entry(tmp_path: Path) -> None:
    """On a file system refusing hard links the entry used to be written in place, under its final
    name: a writer SIGKILLed half-way left a half entry there for good."""
    tracker = FsspecTracker(None, tmp_path)
    tracker.add_metadata("r", epoch=1)
    subprocess.run(
        [sys.executable, "-c", KILLED_WRITER, str(tmp_path)], timeout=30, env=child_env()
    )
    metadata = Path(tracker.category_dir("r", "metadata"))
    for entry in metadata.iterdir():
        assert "metadata" in json.loads(entry.read_text()), f"{entry} is not a whole entry"
    assert tracker.metadata("r")["epoch"] in (1, 2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("renameat2", [True, False], ids=["renameat2", "exclusive-name"])
def test_entries_written_without_hard_links_in_one_nanosecond_are_all_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, renameat2: bool
) -> None:
    """Without hard links, entries are renamed into place without replacing one of the same name
    (renameat2 RENAME_NOREPLACE, or an exclusively created name where it is missing)."""

    def no_link(src: str, dst: str) -> None:
        raise OSError(errno.EPERM, "Operation not permitted", src, None, dst)

    monkeypatch.setattr(os, "link", no_link)
    if not renameat2:
        monkeypatch.setattr(fsspec, "_rename_noreplace", lambda src, dst: False)
    monkeypatch.setattr(fsspec.time, "time_ns", lambda: 1_700_000_000_000_000_000)
    tracker = FsspecTracker(None, tmp_path)
    for i in range(3):
        tracker.add_metadata("r", **{f"k{i}": i})
    assert tracker.entry_names("r", "metadata") == [
        str(1_700_000_000_000_000_000 + i) for i in range(3)
    ]
    assert tracker.metadata("r") == {"k0": 0, "k1": 1, "k2": 2}
    assert not [p for p in Path(tracker.run_dir("r")).iterdir() if p.name.startswith(".tmp-")]


# -- 7. a run deleted while it is read -------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("removed", ["run", "entry"])
async def test_a_run_deleted_while_it_is_read_is_unknown_not_incomplete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, removed: str
) -> None:
    """A run (or one entry) removed between the listing of its entries and their read used to be
    reported, after a 0.5 s stall, as a file that 'stays empty or incomplete'."""
    tracker = FsspecTracker(None, tmp_path)
    tracker.add_metadata("r", epoch=1)
    tracker.add_metadata("r", loss=2)
    real = FsspecTracker.entry_names

    def list_then_remove(self: FsspecTracker, run_id: str, category: str) -> list[str]:
        names = real(self, run_id, category)
        if removed == "run":
            shutil.rmtree(self.run_dir(run_id))
        else:
            os.unlink(os.path.join(self.category_dir(run_id, category), names[-1]))
        return names

    monkeypatch.setattr(FsspecTracker, "entry_names", list_then_remove)
    async with AsyncTrackerReader(tracker) as reader:
        with anyio.fail_after(0.4):  # no wait for a file being written
            if removed == "run":
                with pytest.raises(UnknownRunError, match="'r'"):
                    await reader.metadata("r")
            else:
                assert await reader.metadata("r") == {"epoch": 1}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# -- 8. directories moved away under the watch -----------------------------------------------------


@pytest.mark.timeout(60)
async def test_watch_goes_on_when_the_root_is_moved_away_and_made_again(tmp_path: Path) -> None:
    """The watch of a root moved away (not removed) used to follow the moved directory: runs
    written to the new root were never yielded."""
    require_inotify()
    root = tmp_path / "runs"
    root.mkdir()
    tracker = FsspecTracker(None, root)
    tracker.add_metadata("a", x=1)
    async with (
        AsyncTrackerReader(tracker, poll_interval=0.05) as reader,
        watching(reader) as updates,
    ):
        assert await next_update(updates) == ("a", {"x": 1})
        root.rename(tmp_path / "runs.old")
        root.mkdir()
        await anyio.to_thread.run_sync(lambda: tracker.add_metadata("b", y=1))
        assert await next_update(updates) == ("b", {"y": 1})
        await anyio.to_thread.run_sync(lambda: tracker.add_metadata("a", x=2))
        assert await next_update(updates) == ("a", {"x": 2})
        await anyio.to_thread.run_sync(lambda: tracker.add_metadata("a", x=3))
        assert await next_update(updates) == ("a", {"x": 3})


@pytest.mark.timeout(60)
async def test_watch_goes_on_when_a_run_directory_is_moved_away_and_made_again(
    tmp_path: Path,
) -> None:
    """The watches of a run directory moved away used to follow it: once the run was made again,
    only its first new entry (seen through the root's watch) was yielded."""
    require_inotify()
    tracker = FsspecTracker(None, tmp_path)
    tracker.add_metadata("a", x=1)
    async with (
        AsyncTrackerReader(tracker, poll_interval=0.05) as reader,
        watching(reader) as updates,
    ):
        assert await next_update(updates) == ("a", {"x": 1})
        Path(tracker.run_dir("a")).rename(tmp_path / "a.old")
        await anyio.to_thread.run_sync(lambda: tracker.add_metadata("a", x=2))
        assert await next_update(updates) == ("a", {"x": 2})
        await anyio.to_thread.run_sync(lambda: tracker.add_metadata("a", x=3))
        assert await next_update(updates) == ("a", {"x": 3})


# -- 9. a full disk --------------------------------------------------------------------------------


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs (needs root: where it cannot be mounted, the test fails in CI, as engines do)."""
    with local_tmpfs(tmp_path / "full", "64k") as mnt:
        yield mnt


@pytest.mark.timeout(60)
def test_a_full_disk_fails_the_write_naming_the_file_and_leaves_no_temporary_file(
    tiny_tmpfs: Path,
) -> None:
    """A write on a full disk used to leave its '.tmp-*' file behind and to raise an OSError naming
    no file."""
    tracker = FsspecTracker(None, tiny_tmpfs)
    run = AppRun("r", [tracker], names=["fsspec"])
    run.add_metadata(ok=1)
    with pytest.raises(TrackerWriteError) as e:
        for i in range(20):
            run.add_metadata(**{f"k{i}": "x" * 20000})
    assert str(tiny_tmpfs) in str(e.value) and "No space left on device" in str(e.value)
    assert [f for _, _, files in os.walk(tiny_tmpfs) for f in files if f.startswith(".tmp-")] == []
    assert tracker.metadata("r")["ok"] == 1


# -- 10. deeply nested metadata --------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 990, 5000])
def test_metadata_nested_too_deeply_is_refused_naming_the_key(tmp_path: Path, depth: int) -> None:
    """Metadata nested ~5000 deep used to raise a bare RecursionError, and ~990 deep was written
    though no reader could load it back."""
    tracker = FsspecTracker(None, tmp_path)
    run = AppRun("r", [tracker], names=["fsspec"])
    with pytest.raises(
        InvalidMetadataError, match=f"metadata 'deep' is nested more than {MAX_JSON_DEPTH}"
    ):
        run.add_metadata(ok=1, deep=nest(depth))
    with pytest.raises(InvalidMetadataError, match="'deep'"):
        tracker.add_metadata("r", deep=nest(depth))
    with pytest.raises(InvalidMetadataError, match="artifact 'ckpt', 'deep'"):
        run.add_artifact("ckpt", "/c.pt", {"deep": nest(depth)})
    run.add_metadata(deep=nest(MAX_JSON_DEPTH))
    assert tracker.metadata("r") == {"deep": nest(MAX_JSON_DEPTH)}


@pytest.mark.timeout(60)
async def test_an_entry_too_deep_to_read_is_a_tracker_error_naming_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An entry another writer nested deeper than Python's parser can read used to fail every read
    of the run with a bare RecursionError (and end the watch)."""
    tracker = FsspecTracker(None, tmp_path)
    tracker.add_metadata("r", ok=1)
    path = Path(tracker.category_dir("r", "metadata")) / "99999999999999999999"
    path.write_text(json.dumps({"metadata": {"deep": "x"}}).replace('"x"', "[" * 5000 + "]" * 5000))
    async with AsyncTrackerReader(tracker) as reader:
        with pytest.raises(TrackerError, match=f"{path} holds JSON nested too deeply"):
            await reader.metadata("r")
        async with watching(reader, run_ids=["r"]) as updates:
            assert await next_update(updates) == ("r", {"ok": 1})
    assert any(str(path) in r.getMessage() for r in caplog.records if r.name == READER_LOGGER)


# -- 11. a parent run id the file tracker cannot store ---------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "parent", ["sweep-" + "x" * 200, "sweep-\ud800"], ids=["long", "surrogate"]
)
def test_a_parent_run_id_the_file_tracker_cannot_store_is_refused_at_dry_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, parent: str
) -> None:
    """A parent run id over the file tracker's 155 bytes, or not text, used to pass the dry run;
    then every job failed in app_run_from_env()."""
    conf = tmp_path / "tracker.conf"
    conf.write_text(f"protocol=file\nroot_path={tmp_path}\n")
    monkeypatch.setenv("TORCHXCONFIG", str(torchxconfig(tmp_path, conf)))
    monkeypatch.delenv("TORCHX_PARENT_RUN_ID", raising=False)
    app = AppDef("app", [Role("r", image=".", entrypoint="python")])
    with pytest.raises(ValueError, match="parent_run_id"):
        AsyncRunner("s").dryrun(app, "local_cwd", parent_run_id=parent)


@pytest.mark.timeout(60)
def test_a_long_parent_run_id_is_kept_when_no_file_tracker_is_configured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the file tracker limits the length of a run id: other trackers get it unchanged."""
    monkeypatch.setenv("TORCHXCONFIG", "")  # no .torchxconfig: no tracker
    monkeypatch.delenv("TORCHX_PARENT_RUN_ID", raising=False)
    app = AppDef("app", [Role("r", image=".", entrypoint="python")])
    parent = "sweep-" + "x" * 200
    info = AsyncRunner("s").dryrun(app, "local_cwd", parent_run_id=parent)
    assert info.app is not None and info.app.roles[0].env["TORCHX_PARENT_RUN_ID"] == parent


# -- 12. an empty parent filter --------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_an_empty_parent_run_id_filter_is_an_error_naming_it(tmp_path: Path) -> None:
    """run_ids(parent_run_id='') used to list every run (and 'tracker list runs --parent-run-id ""'
    too), while watch_metadata(parent_run_id='') raised an error about a run id."""
    tracker = FsspecTracker(None, tmp_path)
    tracker.add_metadata("unrelated", x=1)
    with pytest.raises(ValueError, match="parent_run_id must be a non-empty string, got ''"):
        tracker.run_ids(parent_run_id="")
    async with AsyncTrackerReader(tracker) as reader:
        with pytest.raises(ValueError, match="parent_run_id"):
            await reader.run_ids(parent_run_id="")
        with pytest.raises(ValueError, match="parent_run_id"):
            async for _ in reader.watch_metadata(parent_run_id=""):
                pass
    conf = tmp_path / "tracker.conf"
    conf.write_text(f"protocol=file\nroot_path={tmp_path}\n")
    p = subprocess.run(
        [sys.executable, "-m", "asynctorchx", "tracker", "list", "runs", "--parent-run-id", ""],
        capture_output=True,
        text=True,
        timeout=30,
        env=child_env(TORCHXCONFIG=str(torchxconfig(tmp_path, conf))),
    )
    assert p.returncode != 0 and "--parent-run-id" in p.stderr, (p.stdout, p.stderr)
    assert "unrelated" not in p.stdout


# -- 13. artifact metadata that is not a mapping ---------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("metadata", ["abc", 5, [("epoch", 1)]])
def test_artifact_metadata_that_is_not_a_mapping_is_a_type_error_naming_the_artifact(
    tmp_path: Path, metadata: object
) -> None:
    """A string, a number or a list as an artifact's metadata used to fail with an error naming
    neither the artifact nor the field (or, for pairs, to be stored as a dict)."""
    tracker = FsspecTracker(None, tmp_path)
    run = AppRun("r", [tracker], names=["fsspec"])
    with pytest.raises(TypeError, match="artifact 'ckpt': metadata must be a mapping"):
        run.add_artifact("ckpt", "/c.pt", metadata)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="artifact 'ckpt': metadata must be a mapping"):
        tracker.add_artifact("r", "ckpt", "/c.pt", metadata)  # type: ignore[arg-type]
    assert tracker.artifacts("r") == {}


@pytest.mark.timeout(60)
def test_a_fifo_in_place_of_a_descendants_file_fails_add_source_naming_it(tmp_path: Path) -> None:
    """add_source of a run whose source keeps a descendants directory, where the run's file is a
    FIFO: an error naming it (opening the FIFO to append blocked the writer for ever)."""
    tracker = FsspecTracker(None, tmp_path)
    tracker.add_metadata("parent", a=1)
    descendants = Path(tracker.category_dir("parent", fsspec.DESCENDANTS))
    descendants.mkdir(parents=True)
    fifo = descendants / encode_run_id("child")
    os.mkfifo(fifo)
    with pytest.raises(OSError) as info:
        tracker.add_source("child", "parent")
    assert str(fifo) in str(info.value)
