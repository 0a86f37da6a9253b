"""The tracker's fixes of a second review: what it found.

1. ``tracker list metadata|artifacts|runs`` printed control characters of job data raw: ESC
   sequences recoloured or cleared the terminal, a line break forged a row (``describe`` escaped
   them already; both now share ``_output.shown``).
2. A TorchX config with ``root_path=~/runs`` or ``root_path=local:///abs`` was refused (TorchX 0.7
   accepts both: fsspec's local file system strips ``local://`` and expands ``~``).
3. A tracker named twice in ``TORCHX_TRACKERS`` recorded every call twice (TorchX builds it once),
   and the launcher passed it twice.
4. ``watch_metadata`` kept the keys of a deleted run once it was made again: its updates disagreed
   with ``metadata()`` for good.
5. After the wall clock stepped back, a later ``add_metadata`` of one process lost to an earlier one
   on a local root (the remote path already kept one writer's names increasing).
6. A run id too long to store raised ``TrackerError`` on reads (``metadata()``, ``run_ids(
   parent_run_id=...)``, the reader, the CLI exiting 1): TorchX finds no such run, and neither do we
   now (the CLI exits 4, as for any unknown run); writes still raise.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
from _torchx_env import run_torchx, torchx_python
from _tracker_env import watching
from anyio.streams.memory import MemoryObjectReceiveStream

from asynctorchx.runner.config import configured_trackers
from asynctorchx.tracker import (
    AppRun,
    AsyncTrackerReader,
    MetadataUpdate,
    TrackerError,
    UnknownRunError,
)
from asynctorchx.tracker.api import tracker_names_from_environ
from asynctorchx.tracker.backend import fsspec as backend
from asynctorchx.tracker.backend.fsspec import FsspecTracker, create

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
RUN = "local_cwd://sess/app-1"
LONG = "local_cwd://sweep/" + "t" * 300


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHX_")}
    return {**env, "PYTHONPATH": str(ROOT), "NO_COLOR": "1", **extra}


def setup_root(tmp_path: Path) -> tuple[Path, Path]:
    """``(root of the runs, directory whose .torchxconfig names the fsspec tracker of it)``."""
    root = tmp_path / "runs"
    root.mkdir()
    conf = tmp_path / "tracker.conf"
    conf.write_text(f"protocol=file\nroot_path={root}\n")
    project = tmp_path / "proj"
    project.mkdir()
    (project / ".torchxconfig").write_text(
        f"[torchx:tracker]\nfsspec =\n\n[tracker:fsspec]\nconfig = {conf}\n"
    )
    return root, project


def cli(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asynctorchx", *args],
        cwd=project,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


# -- 1. control characters in the CLI's tables ------------------------------------------------------


def test_the_metadata_table_escapes_control_characters(tmp_path: Path) -> None:
    """A key with ESC/BEL sequences and a value with a line break were printed raw: the terminal
    was cleared and retitled, and the value forged a row of its own."""
    root, project = setup_root(tmp_path)
    key = "loss\x1b[2J\x1b]0;pwned\x07"
    FsspecTracker(None, root).add_metadata(RUN, **{key: "a\nFAKE_KEY  fake_value", "ok": 1})
    p = cli(project, "tracker", "list", "metadata", RUN)
    assert p.returncode == 0, p.stderr
    assert "\x1b" not in p.stdout and "\x07" not in p.stdout, repr(p.stdout)
    assert "\nFAKE_KEY" not in p.stdout, repr(p.stdout)
    assert "loss\\x1b[2J\\x1b]0;pwned\\x07" in p.stdout and "a\\nFAKE_KEY" in p.stdout


def test_the_artifact_table_escapes_control_characters(tmp_path: Path) -> None:
    """An artifact's name and path were printed raw (ESC, CR LF forging a row)."""
    root, project = setup_root(tmp_path)
    FsspecTracker(None, root).add_artifact(
        RUN, "ckpt\x1b[31m", "/path\r\nFORGED  /etc/passwd", {"k": "v"}
    )
    p = cli(project, "tracker", "list", "artifacts", RUN)
    assert p.returncode == 0, p.stderr
    assert "\x1b" not in p.stdout and "\r" not in p.stdout, repr(p.stdout)
    assert "\nFORGED" not in p.stdout, repr(p.stdout)


def test_the_runs_table_escapes_control_characters(tmp_path: Path) -> None:
    """A run id holding ESC and a line break was printed raw, the break forging another run."""
    root, project = setup_root(tmp_path)
    FsspecTracker(None, root).add_metadata("local_cwd://s/a\x1b[2Jb\nlocal_cwd://s/forged", x=1)
    p = cli(project, "tracker", "list", "runs")
    assert p.returncode == 0, p.stderr
    assert "\x1b" not in p.stdout, repr(p.stdout)
    assert "\nlocal_cwd://s/forged" not in p.stdout, repr(p.stdout)


def test_describe_and_the_tracker_share_one_escaping_helper() -> None:
    """The helper moved to ``_output`` (one regex for both commands)."""
    from asynctorchx.cli import _output, cmd_describe

    assert _output.shown("a\x1b[31mb\n\x9b") == "a\\x1b[31mb\\n\\x9b"
    assert not hasattr(cmd_describe, "_CONTROLS")


# -- 2. root_path as fsspec's local file system takes it -------------------------------------------


def test_a_root_path_with_a_tilde_is_accepted_as_torchx_accepts_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``root_path=~/runs`` was refused as a directory that does not exist (named ``~``)."""
    home = tmp_path / "home"
    (home / "runs").mkdir(parents=True)
    conf = tmp_path / "tracker.conf"
    conf.write_text("protocol=file\nroot_path=~/runs\n")
    run_torchx(
        f"""
        from torchx.tracker.backend.fsspec import create
        create({str(conf)!r}).add_metadata("local_cwd://s/a", x=1)
        """,
        HOME=str(home),
    )
    assert list((home / "runs").iterdir())  # TorchX wrote under the expanded path
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    tracker = create(str(conf))
    assert tracker.root == str(home / "runs")
    assert tracker.metadata("local_cwd://s/a") == {"x": 1}


@pytest.mark.parametrize("prefix", ["local://", "local:", "file:"])
def test_a_root_path_with_a_local_protocol_prefix_is_accepted_as_torchx_accepts_it(
    tmp_path: Path, prefix: str
) -> None:
    """``root_path=local:///abs`` was refused: only ``file://`` was stripped."""
    root = tmp_path / "runs"
    root.mkdir()
    conf = tmp_path / "tracker.conf"
    conf.write_text(f"protocol=file\nroot_path={prefix}{root}\n")
    run_torchx(
        f"""
        from torchx.tracker.backend.fsspec import create
        create({str(conf)!r}).add_metadata("local_cwd://s/a", x=1)
        """
    )
    tracker = create(str(conf))
    assert tracker.root == str(root)
    assert tracker.metadata("local_cwd://s/a") == {"x": 1}


# -- 3. a tracker named twice ----------------------------------------------------------------------

JOB = (
    "from {module} import app_run_from_env\n"
    "run = app_run_from_env()\n"
    "run.add_metadata(x=1)\n"
    "run.add_artifact('ckpt', '/c')\n"
)


def entry_files(root: Path) -> int:
    return len(
        [p for p in root.rglob("*") if p.is_file() and p.parent.name in ("metadata", "artifacts")]
    )


@pytest.mark.parametrize("names", ["fsspec,fsspec", "fsspec, fsspec,"])
def test_a_tracker_named_twice_writes_each_entry_once_as_torchx(tmp_path: Path, names: str) -> None:
    """Each add_metadata and add_artifact was written twice (two trackers of one name)."""
    counts = {}
    for label in ("torchx", "ours"):
        if label == "torchx" and names.endswith(","):
            continue  # TorchX would look up a tracker of empty name
        root = tmp_path / label
        root.mkdir()
        conf = tmp_path / f"{label}.conf"
        conf.write_text(f"protocol=file\nroot_path={root}\n")
        env = child_env(
            TORCHX_JOB_ID="local_cwd://s/a",
            TORCHX_TRACKERS=names,
            TORCHX_TRACKER_FSSPEC_CONFIG=str(conf),
        )
        if label == "torchx":
            python, module = torchx_python(), "torchx.tracker"
            env["PYTHONPATH"] = ""
        else:
            python, module = sys.executable, "asynctorchx.tracker"
        p = subprocess.run(
            [python, "-c", JOB.format(module=module)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 0, p.stderr
        counts[label] = entry_files(root)
    assert counts["ours"] == 2, counts  # one metadata entry, one artifact entry
    assert counts.get("torchx", 2) == counts["ours"]


def test_the_launcher_passes_a_tracker_named_twice_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``configured_trackers`` (what the dry run puts in TORCHX_TRACKERS) listed it twice."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCHX_TRACKERS", "fsspec,other,fsspec")
    monkeypatch.setenv("TORCHX_TRACKER_FSSPEC_CONFIG", "/x.conf")
    assert [t.name for t in configured_trackers([tmp_path])] == ["fsspec", "other"]
    assert tracker_names_from_environ({"TORCHX_TRACKERS": " b, a ,b,,a"}) == ["b", "a"]


# -- 4. the watch of a run deleted and made again ----------------------------------------------------


async def next_update(
    updates: MemoryObjectReceiveStream[MetadataUpdate], timeout: float = 10.0
) -> MetadataUpdate:
    with anyio.fail_after(timeout):
        return await updates.receive()


async def test_the_watch_of_a_deleted_and_recreated_run_merges_as_metadata(tmp_path: Path) -> None:
    """The trial cleaned up and launched again: the watch yielded {'a': 3, 'stale': 2} while
    metadata() returned {'a': 3}."""
    tracker = FsspecTracker(None, tmp_path)
    run = "local_cwd://sweep/trial-0"
    async with AsyncTrackerReader(tracker) as reader, watching(reader, [run]) as updates:
        tracker.add_metadata(run, a=1, stale=2)
        assert (await next_update(updates)).metadata == {"a": 1, "stale": 2}
        shutil.rmtree(tracker.run_dir(run))
        await anyio.sleep(0.2)
        tracker.add_metadata(run, a=3)
        update = await next_update(updates)
        assert update.entry == {"a": 3}
        assert update.metadata == await reader.metadata(run) == {"a": 3}


async def test_a_run_replaced_between_two_scans_is_read_from_its_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deleted and made again while the watch was not looking (scans only, no inotify event
    between): its old keys are forgotten and the new directory's entries all yielded."""
    monkeypatch.setenv("ASYNCTORCHX_DISABLE_INOTIFY", "1")
    tracker = FsspecTracker(None, tmp_path)
    run = "r"
    tracker.add_metadata(run, a=1, stale=2)
    async with (
        AsyncTrackerReader(tracker, poll_interval=0.5) as reader,
        watching(reader, [run]) as updates,
    ):
        assert (await next_update(updates)).metadata == {"a": 1, "stale": 2}
        old = tmp_path / "old"
        os.rename(tracker.run_dir(run), old)  # the old inode is kept alive: a new one for the run
        tracker.add_metadata(run, a=3)
        tracker.add_metadata(run, b=4)
        got = [await next_update(updates), await next_update(updates)]
        assert [dict(u.entry) for u in got] == [{"a": 3}, {"b": 4}]
        assert got[-1].metadata == await reader.metadata(run) == {"a": 3, "b": 4}


@pytest.mark.timeout(120)
async def test_the_watch_of_200_runs_written_deleted_and_recreated_ends_as_metadata(
    tmp_path: Path,
) -> None:
    """200 runs written, 50 of them deleted and written again, three times over: every run's last
    update equals its metadata()."""
    tracker = FsspecTracker(None, tmp_path)
    runs = [f"local_cwd://sweep/trial-{i}" for i in range(200)]
    last: dict[str, dict[str, object]] = {}

    def churn() -> None:
        rnd = random.Random(7)
        for step in range(3):
            for r in runs:
                tracker.add_metadata(r, step=step, rid=r)
            for r in rnd.sample(runs, 50):
                shutil.rmtree(tracker.run_dir(r), ignore_errors=True)
            for r in runs:
                tracker.add_metadata(r, final=step)

    async with AsyncTrackerReader(tracker) as reader, watching(reader) as updates:
        await anyio.to_thread.run_sync(churn)
        with anyio.move_on_after(20):
            while len(last) < 200 or any(v.get("final") != 2 for v in last.values()):
                u = await updates.receive()
                last[u.run_id] = dict(u.metadata)
        with anyio.move_on_after(1):  # anything later
            while True:
                u = await updates.receive()
                last[u.run_id] = dict(u.metadata)
        assert len(last) == 200
        bad = [(r, last[r], md) for r in runs if last[r] != (md := await reader.metadata(r))]
        assert not bad, f"{len(bad)} runs: watch != metadata(), e.g. {bad[:2]}"


# -- 5. one writer's entries in order when the clock steps back -------------------------------------


def test_a_later_add_metadata_wins_when_the_clock_steps_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NTP stepped CLOCK_REALTIME back 5 s between two add_metadata of one process: the earlier
    value won on a local root."""
    tracker = FsspecTracker(None, tmp_path)
    run = AppRun("local_cwd://s/a", [tracker])
    base = time.time_ns()
    clock = iter([base, base + 1] + [base - 5_000_000_000 + i for i in range(100)])
    monkeypatch.setattr(backend.time, "time_ns", lambda: next(clock))
    run.add_metadata(loss=1.0)
    run.add_metadata(loss=0.5)
    monkeypatch.undo()
    assert tracker.metadata("local_cwd://s/a") == {"loss": 0.5}
    names = tracker.entry_names("local_cwd://s/a", "metadata")
    assert [int(n) for n in names] == [base + 1, base + 2]


# -- 6. run ids too long to store ------------------------------------------------------------------


def test_reading_a_run_id_too_long_to_store_is_an_unknown_run_like_torchx(tmp_path: Path) -> None:
    """metadata(), artifacts(), sources(), exists() and run_ids(parent_run_id=) raised
    TrackerError; TorchX finds nothing. Writing one still raises."""
    out = run_torchx(
        f"""
        import fsspec
        from torchx.tracker.backend.fsspec import FsspecTracker
        t = FsspecTracker(fsspec.filesystem("file"), {str(tmp_path)!r})
        print(dict(t.metadata({LONG!r})), list(t.run_ids(parent_run_id={LONG!r})))
        """
    )
    assert out.strip() == "{} []"
    tracker = FsspecTracker(None, tmp_path)
    tracker.add_metadata("child", x=1)
    assert tracker.run_ids(parent_run_id=LONG) == []
    assert tracker.metadata(LONG) == {}
    assert tracker.artifacts(LONG) == {}
    assert tracker.sources(LONG) == []
    assert not tracker.exists(LONG)
    with pytest.raises(TrackerError, match="too long"):
        tracker.add_metadata(LONG, x=1)
    with pytest.raises(TrackerError, match="too long"):
        tracker.add_source("child", LONG)


async def test_the_reader_takes_a_run_id_too_long_to_store_for_an_unknown_run(
    tmp_path: Path,
) -> None:
    """The reader raised TrackerError; now UnknownRunError, and a watch of it (or of its
    children) yields nothing instead of failing."""
    tracker = FsspecTracker(None, tmp_path)
    async with AsyncTrackerReader(tracker, poll_interval=0.1) as reader:
        assert not await reader.exists(LONG)
        with pytest.raises(UnknownRunError):
            await reader.metadata(LONG)
        assert await reader.run_ids(parent_run_id=LONG) == []
        async with watching(reader, [LONG, "r"]) as updates:
            tracker.add_metadata("r", x=1)
            assert (await next_update(updates)).run_id == "r"
        async with watching(reader, parent_run_id=LONG) as updates:
            tracker.add_source("c", "p")
            tracker.add_metadata("c", x=1)
            with anyio.move_on_after(0.5):
                pytest.fail(f"yielded {await updates.receive()}")


def test_the_cli_exit_code_for_a_run_id_too_long_is_that_of_an_unknown_run(tmp_path: Path) -> None:
    """``tracker list metadata LONG`` exited 1 with a TrackerError; ``list runs --parent-run-id
    LONG`` failed too."""
    _, project = setup_root(tmp_path)
    p = cli(project, "tracker", "list", "metadata", LONG)
    assert p.returncode == 4, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr
    p = cli(project, "tracker", "list", "runs", "--parent-run-id", LONG)
    assert p.returncode == 0, (p.returncode, p.stderr)
    assert p.stdout == ""
