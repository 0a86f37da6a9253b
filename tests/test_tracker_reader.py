# ruff: noqa: F811 - the fixtures imported from _docker_env are redefined as test parameters
"""The async tracker reader and the tracker CLI, with real jobs on local_cwd reporting through the tracker."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest
from _docker_env import docker_engine, purge_session, python_image  # noqa: F401 - pytest fixtures
from _torchx_env import run_torchx
from conftest import engine_missing

from asynctorchx import AsyncRunner
from asynctorchx.logs import _inotify
from asynctorchx.schedulers.api import Stream
from asynctorchx.specs import AppDef, AppState, Role
from asynctorchx.tracker import AsyncTrackerReader, MetadataUpdate, UnknownRunError
from asynctorchx.tracker.api import Lineage, TrackerArtifact, TrackerBase, TrackerSource
from asynctorchx.tracker.backend.fsspec import FsspecTracker, create

ROOT = Path(__file__).resolve().parent.parent

REPORT = """
import sys
import uuid
from asynctorchx.tracker import app_run_from_env
run = app_run_from_env()
run.add_metadata(lr=float(sys.argv[1]), epoch=0)
run.add_metadata(loss=float(sys.argv[1]) * 2, epoch=1)
run.add_artifact("checkpoint", "/ckpt/final.pt", {"epoch": 1})
"""


@pytest.fixture
def tracked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tracker root, its config and a .torchxconfig (TORCHXCONFIG) naming it; returns the root."""
    root = tmp_path / "runs"
    root.mkdir()
    conf = tmp_path / "tracker.conf"
    conf.write_text(f"protocol=file\nroot_path={root}\n")
    torchxconfig = tmp_path / ".torchxconfig"
    torchxconfig.write_text(f"[torchx:tracker]\nfsspec =\n\n[tracker:fsspec]\nconfig = {conf}\n")
    monkeypatch.setenv("TORCHXCONFIG", str(torchxconfig))
    monkeypatch.setenv("ASYNCTORCHX_LOCAL_ROOT", str(tmp_path / "state"))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    for key in ("TORCHX_PARENT_RUN_ID", "TORCHX_TRACKERS", "TORCHX_TRACKER_FSSPEC_CONFIG"):
        monkeypatch.delenv(key, raising=False)
    return root


def reporter(lr: float, name: str = "report") -> AppDef:
    return AppDef(
        name,
        [
            Role(
                "trainer",
                image=".",
                entrypoint=sys.executable,
                args=["-c", REPORT, str(lr)],
            )
        ],
    )


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asynctorchx", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "NO_COLOR": "1"},
    )


def require_inotify() -> None:
    if not _inotify.available():
        engine_missing("inotify")


@contextlib.asynccontextmanager
async def following(
    updates: AsyncGenerator[MetadataUpdate, None], n: int
) -> AsyncIterator[list[MetadataUpdate]]:
    """Collects ``n`` updates in a task; the body runs once the first one came (the watch is set up)."""
    got: list[MetadataUpdate] = []
    first = anyio.Event()

    async def run() -> None:
        with anyio.fail_after(10):
            async with contextlib.aclosing(updates) as it:
                async for u in it:
                    got.append(u)
                    first.set()
                    if len(got) == n:
                        break

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        with anyio.fail_after(10):
            await first.wait()
        yield got


# -- one-shot queries -----------------------------------------------------------------------------


async def test_queries_and_unknown_runs(tmp_path: Path) -> None:
    """run_ids/metadata/artifacts/sources read the tracker; an unknown run id raises UnknownRunError."""
    tracker = FsspecTracker(None, tmp_path)
    tracker.add_source("r1", "p")
    tracker.add_metadata("r1", a=1)
    tracker.add_artifact("r1", "m", "/m")
    async with AsyncTrackerReader(tracker) as reader:
        assert await reader.run_ids() == ["r1"]
        assert await reader.run_ids(parent_run_id="p") == ["r1"]
        assert await reader.run_ids(parent_run_id="q") == []
        assert await reader.metadata("r1") == {"a": 1}
        assert await reader.artifacts("r1") == {"m": TrackerArtifact("m", "/m", None)}
        assert await reader.sources("r1") == [TrackerSource("p", None)]
        assert await reader.exists("r1") and not await reader.exists("r2")
        for call in (reader.metadata, reader.artifacts, reader.sources):
            with pytest.raises(UnknownRunError, match="'local_cwd://s/nope'"):
                await call("local_cwd://s/nope")
    with pytest.raises(RuntimeError, match="closed"):
        await reader.metadata("r1")


# -- following ------------------------------------------------------------------------------------


@pytest.mark.parametrize("inotify", [True, False], ids=["inotify", "scan"])
async def test_watch_yields_existing_then_new_metadata_of_fixed_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inotify: bool
) -> None:
    """watch_metadata yields what runs have, then each new add_metadata, also of runs not yet created."""
    if inotify:
        require_inotify()
    else:
        monkeypatch.setenv(_inotify.DISABLE_ENV, "1")
    tracker = FsspecTracker(None, tmp_path)
    tracker.add_metadata("a", x=1)
    reader = AsyncTrackerReader(tracker, poll_interval=0.05)
    async with following(reader.watch_metadata(["a", "b"]), 4) as got:
        await anyio.to_thread.run_sync(lambda: tracker.add_metadata("a", x=2))
        await anyio.to_thread.run_sync(lambda: tracker.add_metadata("b", y=1))
        await anyio.to_thread.run_sync(lambda: tracker.add_metadata("c", z=1))
        await anyio.to_thread.run_sync(lambda: tracker.add_metadata("b", y=2, w=0))
    assert [(u.run_id, dict(u.entry)) for u in got] == [
        ("a", {"x": 1}),
        ("a", {"x": 2}),
        ("b", {"y": 1}),
        ("b", {"y": 2, "w": 0}),
    ]
    assert got[-1].metadata == {"y": 2, "w": 0}
    assert all(u.timestamp is not None for u in got)


async def test_watch_by_parent_picks_up_children_launched_later(tmp_path: Path) -> None:
    """watch_metadata(parent_run_id=) follows children that appear while it runs, and no others."""
    require_inotify()
    tracker = FsspecTracker(None, tmp_path)
    tracker.add_source("trial-0", "sweep")
    tracker.add_metadata("trial-0", loss=0)
    tracker.add_metadata("old-orphan", a=0)
    reader = AsyncTrackerReader(tracker)

    def write() -> None:
        tracker.add_metadata("orphan", a=0)
        for i in (1, 2):
            tracker.add_source(f"trial-{i}", "sweep")
            tracker.add_metadata(f"trial-{i}", loss=i)

    async with following(reader.watch_metadata(parent_run_id="sweep"), 3) as got:
        await anyio.to_thread.run_sync(write)
    assert sorted(u.run_id for u in got) == ["trial-0", "trial-1", "trial-2"]


class WriterBetweenLooks:
    """The reader's storage, letting a writer finish right after the reader's ``after``-th look
    (isdir, exists, listdir) into one run directory: one exact interleaving of the two."""

    def __init__(self, inner: Any, run_dir: str, after: int, write: Callable[[], None]) -> None:
        self.inner = inner
        self.run_dir = run_dir
        self.after = after
        self.write = write
        self.looks = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _looked(self, path: str, answer: Any) -> Any:
        if path == self.run_dir or path.startswith(self.run_dir + os.sep):
            self.looks += 1
            if self.looks == self.after:
                self.write()
        return answer

    def isdir(self, path: str) -> Any:
        return self._looked(path, self.inner.isdir(path))

    def exists(self, path: str) -> Any:
        return self._looked(path, self.inner.exists(path))

    def listdir(self, path: str) -> Any:
        return self._looked(path, self.inner.listdir(path))


@pytest.mark.parametrize("inotify", [True, False], ids=["inotify", "scan"])
@pytest.mark.parametrize(
    ("mode", "after"), [("parent", n) for n in range(1, 6)] + [("fixed", n) for n in (1, 2)]
)
async def test_watch_yields_a_child_that_writes_while_the_reader_looks_at_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inotify: bool, mode: str, after: int
) -> None:
    """A run that records its parent and metadata between two of the reader's looks into its
    directory (it has only an empty sources/ before) is yielded, not dropped as a non-child."""
    if inotify:
        require_inotify()
    else:
        monkeypatch.setenv(_inotify.DISABLE_ENV, "1")
    writer = FsspecTracker(None, tmp_path)
    writer.add_source("trial-0", "sweep")
    writer.add_metadata("trial-0", loss=0)
    os.makedirs(writer.category_dir("trial-1", "sources"))

    def finish_trial_1() -> None:
        writer.add_source("trial-1", "sweep")
        writer.add_metadata("trial-1", loss=1)

    tracker = FsspecTracker(None, tmp_path)
    storage = WriterBetweenLooks(tracker._fs, writer.run_dir("trial-1"), after, finish_trial_1)
    monkeypatch.setattr(tracker, "_fs", storage)
    reader = AsyncTrackerReader(tracker, poll_interval=0.05)
    if mode == "parent":
        watch = reader.watch_metadata(parent_run_id="sweep")
    else:
        watch = reader.watch_metadata(["trial-0", "trial-1"])
    async with following(watch, 2) as got:
        pass
    assert storage.looks >= after  # the write happened where the test says
    assert sorted((u.run_id, dict(u.entry)) for u in got) == [
        ("trial-0", {"loss": 0}),
        ("trial-1", {"loss": 1}),
    ]


async def test_watch_waits_for_files_written_in_place(tmp_path: Path) -> None:
    """An entry created empty and filled later (TorchX's writer) is yielded once, when complete."""
    require_inotify()
    tracker = FsspecTracker(None, tmp_path)
    tracker.add_metadata("r", a=1)
    reader = AsyncTrackerReader(tracker)
    async with following(reader.watch_metadata(["r"]), 2) as got:
        path = Path(tracker.category_dir("r", "metadata")) / "99999999999999999999"
        with open(path, "w") as f:
            f.write('{"metadata": {"b"')
            f.flush()
            await anyio.sleep(0.1)  # the reader sees the cut-off entry meanwhile
            f.write(": 2}}")
    assert [dict(u.entry) for u in got] == [{"a": 1}, {"b": 2}]


async def test_watch_goes_on_when_the_root_is_removed_and_made_again(tmp_path: Path) -> None:
    """A tracker root removed and made again while watched: runs written to the new root are
    still yielded (the watch of the removed root is replaced, not waited on forever)."""
    require_inotify()
    root = tmp_path / "runs"
    root.mkdir()
    tracker = FsspecTracker(None, root)
    tracker.add_metadata("a", x=1)
    reader = AsyncTrackerReader(tracker, poll_interval=0.05)
    async with following(reader.watch_metadata(), 2) as got:
        await anyio.to_thread.run_sync(shutil.rmtree, root)
        root.mkdir()
        await anyio.to_thread.run_sync(lambda: tracker.add_metadata("b", y=1))
    assert [(u.run_id, dict(u.entry)) for u in got] == [("a", {"x": 1}), ("b", {"y": 1})]


async def test_watch_falls_back_to_scans_when_inotify_watches_run_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With fs.inotify.max_user_watches used up after 5 watches (ENOSPC), the metadata of all 20
    runs is still yielded, the runs without a watch by scans."""
    require_inotify()
    real_add = _inotify._Hub.add
    added = [0]

    def add(hub: Any, path: str, mask: int, callback: Any) -> Any:
        added[0] += 1
        if added[0] > 5:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real_add(hub, path, mask, callback)

    monkeypatch.setattr(_inotify._Hub, "add", add)
    tracker = FsspecTracker(None, tmp_path)
    for i in range(20):
        tracker.add_metadata(f"r{i}", step=0)
    reader = AsyncTrackerReader(tracker, poll_interval=0.05)

    def write() -> None:
        for i in range(20):
            tracker.add_metadata(f"r{i}", step=1)

    async with following(reader.watch_metadata(), 40) as got:
        with anyio.fail_after(10):
            while len(got) < 20:
                await anyio.sleep(0.01)
        await anyio.to_thread.run_sync(write)
    assert sorted((u.run_id, u.entry["step"]) for u in got) == sorted(
        (f"r{i}", step) for i in range(20) for step in (0, 1)
    )


class DictTracker(TrackerBase):
    """A tracker without files (only merged metadata): followed by polling."""

    def __init__(self) -> None:
        self.md: dict[str, dict[str, object]] = {}

    def add_artifact(
        self, run_id: str, name: str, path: str, metadata: Mapping[str, object] | None = None
    ) -> None:
        raise NotImplementedError

    def artifacts(self, run_id: str) -> Mapping[str, TrackerArtifact]:
        return {}

    def add_metadata(self, run_id: str, **kwargs: object) -> None:
        self.md.setdefault(run_id, {}).update(kwargs)

    def metadata(self, run_id: str) -> Mapping[str, object]:
        return dict(self.md.get(run_id, {}))

    def add_source(self, run_id: str, source_id: str, artifact_name: str | None = None) -> None:
        raise NotImplementedError

    def sources(self, run_id: str, artifact_name: str | None = None) -> Iterable[TrackerSource]:
        return []

    def lineage(self, run_id: str) -> Lineage:
        raise NotImplementedError

    def run_ids(self, **kwargs: str) -> Iterable[str]:
        return list(self.md)


async def test_other_trackers_are_followed_by_polling_their_metadata() -> None:
    """A tracker that is not a file tracker yields the keys that changed, per poll."""
    tracker = DictTracker()
    tracker.add_metadata("r", a=1)
    reader = AsyncTrackerReader(tracker, poll_interval=0.02)
    async with following(reader.watch_metadata(["r"]), 2) as got:
        tracker.add_metadata("r", b=2)
    assert [dict(u.entry) for u in got] == [{"a": 1}, {"b": 2}]
    assert await reader.metadata("r") == {"a": 1, "b": 2}
    with pytest.raises(UnknownRunError):
        await reader.metadata("missing")


class StrictDictTracker(DictTracker):
    """A tracker that raises UnknownRunError for a run it does not have (as some backends do)."""

    def metadata(self, run_id: str) -> Mapping[str, object]:
        if run_id not in self.md:
            raise UnknownRunError(run_id, "StrictDictTracker")
        return dict(self.md[run_id])


async def test_polling_a_run_that_does_not_exist_yet_waits_for_it() -> None:
    """A polled tracker that raises UnknownRunError for a run not created yet: the watch waits for
    the run instead of ending with that error."""
    tracker = StrictDictTracker()
    tracker.add_metadata("a", x=1)
    reader = AsyncTrackerReader(tracker, poll_interval=0.02)
    async with following(reader.watch_metadata(["a", "later"]), 2) as got:
        tracker.add_metadata("later", y=2)
    assert [(u.run_id, dict(u.entry)) for u in got] == [("a", {"x": 1}), ("later", {"y": 2})]


async def test_closing_the_reader_ends_active_watches(tmp_path: Path) -> None:
    """aclose() ends a watch_metadata iteration that is waiting, with RuntimeError."""
    tracker = FsspecTracker(None, tmp_path)
    tracker.add_metadata("r", a=1)
    reader = AsyncTrackerReader(tracker)
    first = anyio.Event()
    errors: list[Exception] = []

    async def follow() -> None:
        try:
            async for _ in reader.watch_metadata(["r"]):
                first.set()
        except RuntimeError as e:
            errors.append(e)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(follow)
            await first.wait()
            await reader.aclose()
    assert [str(e) for e in errors] == ["the tracker reader is closed"]


def test_bad_reader_arguments_are_rejected(tmp_path: Path) -> None:
    """poll_interval must be positive; run_ids and parent_run_id exclude each other."""
    with pytest.raises(ValueError, match="poll_interval"):
        AsyncTrackerReader.from_root(tmp_path, poll_interval=0)
    reader = AsyncTrackerReader.from_root(tmp_path)
    with pytest.raises(ValueError, match="not both"):
        anyio.run(anext, reader.watch_metadata(["a"], parent_run_id="p"))  # type: ignore[arg-type]


# -- real jobs ------------------------------------------------------------------------------------


async def test_a_local_job_reports_and_the_reader_the_cli_and_torchx_read_it(tracked: Path) -> None:
    """A local_cwd job's app_run_from_env() metadata and artifact are read by us, the CLI and TorchX."""
    async with AsyncRunner("trk") as runner:
        handle = await runner.run(reporter(0.5), "local_cwd", parent_run_id="driver-1")
        status = await runner.wait(handle, timeout=60)
    assert status is not None and status.state == AppState.SUCCEEDED, status
    async with AsyncTrackerReader.from_root(tracked) as reader:
        assert await reader.run_ids(parent_run_id="driver-1") == [handle]
        assert await reader.metadata(handle) == {"lr": 0.5, "epoch": 1, "loss": 1.0}
        assert await reader.artifacts(handle) == {
            "checkpoint": TrackerArtifact("checkpoint", "/ckpt/final.pt", {"epoch": 1})
        }
        assert await reader.sources(handle) == [TrackerSource("driver-1", None)]

    result = cli("tracker", "list", "runs", "--parent-run-id", "driver-1", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [handle]
    result = cli("tracker", "list", "metadata", handle, "--json")
    assert json.loads(result.stdout) == {"lr": 0.5, "epoch": 1, "loss": 1.0}
    result = cli("tracker", "list", "artifacts", handle)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "ARTIFACT", "PATH", "METADATA", "checkpoint", "/ckpt/final.pt", '{"epoch":', "1}"
    ]  # fmt: skip
    result = cli("tracker", "list", "metadata", "local_cwd://trk/nope")
    assert result.returncode == 4
    assert "unknown run id 'local_cwd://trk/nope'" in result.stderr
    assert "Traceback" not in result.stderr

    code = f"""
        import json
        from torchx.tracker.backend.fsspec import FsspecTracker
        import fsspec
        t = FsspecTracker(fsspec.filesystem("file"), {str(tracked)!r})
        a = t.artifacts({handle!r})["checkpoint"]
        print(json.dumps([list(t.run_ids(parent_run_id="driver-1")), t.metadata({handle!r}),
                          [a.name, a.path, a.metadata]]))
    """
    ids, metadata, artifact = json.loads(run_torchx(code))
    assert ids == [handle]
    # TorchX merges the entries in listing order, so which "epoch" wins is TorchX's chance
    assert metadata.pop("epoch") in (0, 1)
    assert metadata == {"lr": 0.5, "loss": 1.0}
    assert artifact == ["checkpoint", "/ckpt/final.pt", {"epoch": 1}]


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_twenty_trials_are_listed_under_their_drivers_run_id(tracked: Path) -> None:
    """A driver's run id as parent_run_id of 20 trials: listed by parent, each trial's metadata seen."""
    driver = "sweep-driver-42"
    async with AsyncRunner("sweep") as runner, AsyncTrackerReader.from_root(tracked) as reader:
        seen: dict[str, float] = {}

        async def follow() -> None:
            async with contextlib.aclosing(reader.watch_metadata(parent_run_id=driver)) as it:
                async for u in it:
                    if "loss" in u.entry:
                        seen[u.run_id] = float(u.entry["loss"])  # type: ignore[arg-type]
                        if len(seen) == 20:
                            return

        async with anyio.create_task_group() as tg:
            tg.start_soon(follow)
            handles = [
                await runner.run(reporter(i / 10, f"trial-{i}"), "local_cwd", parent_run_id=driver)
                for i in range(20)
            ]
            other = await runner.run(reporter(9.0, "unrelated"), "local_cwd")
            with anyio.fail_after(150):
                done = await runner.wait_all([*handles, other])
        assert all(s is not None and s.state == AppState.SUCCEEDED for s in done.values()), done
        assert sorted(await reader.run_ids(parent_run_id=driver)) == sorted(handles)
        assert other in await reader.run_ids()
        assert seen == {h: i / 10 * 2 for i, h in enumerate(handles)}
    result = cli("tracker", "list", "runs", "--parent-run-id", driver)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split()[2:]) == sorted(handles)


@pytest.mark.docker
@pytest.mark.timeout(180)
async def test_a_docker_job_reports_through_a_bind_mounted_tracker_root(
    tracked: Path, python_image: str
) -> None:
    """A local_docker job writes through app_run_from_env() into a bind mount; we read it on the host."""
    from asynctorchx.specs import BindMount

    conf = tracked.parent / "tracker.conf"
    src = ROOT / "asynctorchx"
    role = Role(
        "trainer",
        image=python_image,
        entrypoint="python",
        args=["-c", REPORT, "0.25"],
        env={"PYTHONPATH": "/opt/src"},
        mounts=[
            BindMount(str(src), "/opt/src/asynctorchx", read_only=True),
            BindMount(str(tracked.parent), str(tracked.parent)),
        ],
    )
    session = f"trk-docker-{uuid.uuid4().hex[:8]}"
    try:
        async with AsyncRunner(session) as runner:
            handle = await runner.run(
                AppDef("docker-report", [role]), "local_docker", parent_run_id="d1"
            )
            status = await runner.wait(handle, timeout=150)
            logs = [ln async for ln in runner.log_lines(handle, "trainer")]
            await runner.cancel(handle)
    finally:
        await purge_session(session)
    assert status is not None and status.state == AppState.SUCCEEDED, (status, logs)
    reader = AsyncTrackerReader.from_config(str(conf))
    assert await reader.run_ids(parent_run_id="d1") == [handle]
    assert await reader.metadata(handle) == {"lr": 0.25, "epoch": 1, "loss": 0.5}
    assert (await reader.artifacts(handle))["checkpoint"].path == "/ckpt/final.pt"
    result = cli("tracker", "list", "metadata", handle, "--json")
    assert json.loads(result.stdout)["loss"] == 0.5
    assert create(str(conf)).exists(handle)


async def test_a_job_whose_tracker_cannot_be_imported_fails_naming_it(
    tracked: Path, tmp_path: Path
) -> None:
    """A [torchx:tracker] factory missing in the job: app_run_from_env() fails the job, naming it."""
    config = Path(os.environ["TORCHXCONFIG"])
    config.write_text("[torchx:tracker]\nbroken = no_such_tracker_module:create\n")
    async with AsyncRunner("trk-bad") as runner:
        handle = await runner.run(reporter(0.5), "local_cwd")
        status = await runner.wait(handle, timeout=60)
        stderr = "".join(
            [ln async for ln in runner.log_lines(handle, "trainer", streams=Stream.STDERR)]
        )
    assert status is not None and status.state == AppState.FAILED
    assert (
        "UnknownTrackerError: tracker 'broken': factory 'no_such_tracker_module:create' " in stderr
    )


def test_cli_tracker_errors_are_one_line(tracked: Path) -> None:
    """No tracker configured, or an unknown one: one error line, exit code 2, no traceback."""
    Path(os.environ["TORCHXCONFIG"]).write_text("")
    result = cli("tracker", "list", "runs")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "no tracker is configured" in result.stderr
    Path(os.environ["TORCHXCONFIG"]).write_text("[torchx:tracker]\nnope =\n")
    result = cli("tracker", "list", "runs", "--json")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "unknown tracker 'nope'" in result.stderr


def test_cli_json_of_non_finite_metadata_is_strict_json(tracked: Path) -> None:
    """A NaN or infinite metric (a diverged loss) is printed by --json as the strings "NaN",
    "Infinity" and "-Infinity", so that strict JSON parsers (jq, browsers) read the output."""
    tracker = FsspecTracker(None, tracked)
    md = {"loss": float("nan"), "hi": float("inf"), "lo": float("-inf"), "ok": 1.5}
    tracker.add_metadata("r", **md, nested={"grad": [float("nan")]})
    tracker.add_artifact("r", "ckpt", "/c", {"loss": float("nan")})

    def strict(text: str) -> object:
        def refuse(token: str) -> object:
            raise ValueError(f"not JSON: {token}")

        return json.loads(text, parse_constant=refuse)

    result = cli("tracker", "list", "metadata", "r", "--json")
    assert result.returncode == 0, result.stderr
    assert strict(result.stdout) == {
        "loss": "NaN",
        "hi": "Infinity",
        "lo": "-Infinity",
        "ok": 1.5,
        "nested": {"grad": ["NaN"]},
    }
    result = cli("tracker", "list", "artifacts", "r", "--json")
    assert result.returncode == 0, result.stderr
    assert strict(result.stdout) == [{"name": "ckpt", "path": "/c", "metadata": {"loss": "NaN"}}]


def test_cli_dryrun_shows_the_parent_run_id(tracked: Path) -> None:
    """run --dryrun --parent_run_id shows TORCHX_PARENT_RUN_ID in each replica's env; '' is refused."""
    result = cli("run", "--dryrun", "--parent_run_id", "sweep-5", "utils.echo", "--msg", "hi")
    assert result.returncode == 0, result.stderr
    assert "env TORCHX_PARENT_RUN_ID=sweep-5" in result.stdout
    assert "env TORCHX_TRACKERS=fsspec" in result.stdout
    result = cli("run", "--dryrun", "--parent_run_id", "", "utils.echo")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "parent_run_id" in result.stderr
