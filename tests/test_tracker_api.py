"""The job side of tracking: AppRun, the environment contract, tracker resolution and its errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import pytest

from asynctorchx.tracker import api
from asynctorchx.tracker.api import (
    AppRun,
    InvalidMetadataError,
    Lineage,
    TrackerArtifact,
    TrackerBase,
    TrackerConfigError,
    TrackerError,
    TrackerSource,
    TrackerWriteError,
    UnknownTrackerError,
    app_run_from_env,
    build_tracker,
)
from asynctorchx.tracker.backend.fsspec import create

ROOT = Path(__file__).resolve().parent.parent


class MemoryTracker(TrackerBase):
    """A tracker keeping everything in memory (a fake for error paths)."""

    def __init__(self, config: str | None = None, fail: bool = False) -> None:
        self.config = config
        self.fail = fail
        self.md: dict[str, dict[str, object]] = {}
        self.srcs: dict[str, list[TrackerSource]] = {}
        self.arts: dict[str, dict[str, TrackerArtifact]] = {}

    def _maybe_fail(self) -> None:
        if self.fail:
            raise OSError(28, "No space left on device")

    def add_artifact(
        self, run_id: str, name: str, path: str, metadata: Mapping[str, object] | None = None
    ) -> None:
        self._maybe_fail()
        self.arts.setdefault(run_id, {})[name] = TrackerArtifact(name, path, metadata)

    def artifacts(self, run_id: str) -> Mapping[str, TrackerArtifact]:
        return self.arts.get(run_id, {})

    def add_metadata(self, run_id: str, **kwargs: object) -> None:
        self._maybe_fail()
        self.md.setdefault(run_id, {}).update(kwargs)

    def metadata(self, run_id: str) -> Mapping[str, object]:
        return self.md.get(run_id, {})

    def add_source(self, run_id: str, source_id: str, artifact_name: str | None = None) -> None:
        self._maybe_fail()
        self.srcs.setdefault(run_id, []).append(TrackerSource(source_id, artifact_name))

    def sources(self, run_id: str, artifact_name: str | None = None) -> Iterable[TrackerSource]:
        return self.srcs.get(run_id, [])

    def lineage(self, run_id: str) -> Lineage:
        raise NotImplementedError

    def run_ids(self, **kwargs: str) -> Iterable[str]:
        return list(self.md)


def make_memory_tracker(config: str | None) -> MemoryTracker:
    """A module:factory target for the resolution tests."""
    return MemoryTracker(config)


NOT_A_FACTORY = 42


@pytest.fixture(autouse=True)
def fresh_run() -> Iterator[None]:
    """AppRun.run_from_env is a per-process singleton: every test starts without one."""
    AppRun.run_from_env.cache_clear()
    yield
    AppRun.run_from_env.cache_clear()


@pytest.fixture
def tracker_conf(tmp_path: Path) -> Path:
    """A local fsspec tracker config whose root exists."""
    root = tmp_path / "runs"
    root.mkdir()
    conf = tmp_path / "tracker.conf"
    conf.write_text(f"# the runs\nprotocol=file\nroot_path={root}\n")
    return conf


def set_env(monkeypatch: pytest.MonkeyPatch, **env: str) -> None:
    for key in ("TORCHX_JOB_ID", "TORCHX_PARENT_RUN_ID", "TORCHX_TRACKERS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def test_app_run_from_env_writes_to_the_configured_fsspec_tracker(
    monkeypatch: pytest.MonkeyPatch, tracker_conf: Path
) -> None:
    """TORCHX_JOB_ID/TRACKERS/..._CONFIG build an AppRun whose writes land in the tracker's root."""
    set_env(
        monkeypatch,
        TORCHX_JOB_ID="local_cwd://s/app-1",
        TORCHX_TRACKERS="fsspec",
        TORCHX_TRACKER_FSSPEC_CONFIG=str(tracker_conf),
    )
    run = app_run_from_env()
    assert run is app_run_from_env()
    assert run.job_id() == "local_cwd://s/app-1"
    assert run.parent_run_id() is None
    run.add_metadata(lr=0.1, loss=1.0)
    run.add_metadata(loss=0.5)
    run.add_artifact("ckpt", "/ckpt/3.pt", {"epoch": 3})
    tracker = create(str(tracker_conf))
    assert tracker.metadata("local_cwd://s/app-1") == {"lr": 0.1, "loss": 0.5}
    assert tracker.artifacts("local_cwd://s/app-1") == {
        "ckpt": TrackerArtifact("ckpt", "/ckpt/3.pt", {"epoch": 3})
    }


def test_parent_run_id_is_recorded_as_the_runs_source_at_once(
    monkeypatch: pytest.MonkeyPatch, tracker_conf: Path
) -> None:
    """With TORCHX_PARENT_RUN_ID the run is listed under its parent before it writes anything."""
    set_env(
        monkeypatch,
        TORCHX_JOB_ID="local_cwd://s/trial-1",
        TORCHX_PARENT_RUN_ID="sweep-1",
        TORCHX_TRACKERS="fsspec",
        TORCHX_TRACKER_FSSPEC_CONFIG=str(tracker_conf),
    )
    run = app_run_from_env()
    assert run.parent_run_id() == "sweep-1"
    tracker = create(str(tracker_conf))
    assert tracker.run_ids(parent_run_id="sweep-1") == ["local_cwd://s/trial-1"]
    assert tracker.sources("local_cwd://s/trial-1") == [TrackerSource("sweep-1", None)]
    assert [s.parent.job_id() for s in run.sources()] == ["sweep-1"]


def test_without_a_launcher_the_run_is_undefined_and_writes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not launched as a job: run id <UNDEFINED>, no trackers, add_* are no-ops (TorchX's behaviour)."""
    set_env(monkeypatch)
    run = app_run_from_env()
    assert run.job_id() == "<UNDEFINED>"
    assert run.backends == []
    run.add_metadata(x=1)
    run.add_artifact("a", "/p")
    assert run.sources() == []


def test_module_factory_names_resolve_and_get_their_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 'module:factory' tracker name is imported and called with its config string."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    tracker = build_tracker("test_tracker_api:make_memory_tracker", "cfg-1")
    assert isinstance(tracker, TrackerBase)
    assert tracker.config == "cfg-1"  # type: ignore[attr-defined]


def test_the_factory_variable_replaces_the_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """TORCHX_TRACKER_<NAME>_FACTORY (the value in [torchx:tracker]) is resolved instead of NAME."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    set_env(
        monkeypatch,
        TORCHX_JOB_ID="local_cwd://s/app",
        TORCHX_TRACKERS="mem",
        TORCHX_TRACKER_MEM_FACTORY="test_tracker_api:make_memory_tracker",
        TORCHX_TRACKER_MEM_CONFIG="c",
    )
    run = app_run_from_env()
    run.add_metadata(a=1)
    assert run.backends[0].metadata("local_cwd://s/app") == {"a": 1}
    assert repr(run) == "AppRun(id='local_cwd://s/app', backends=['mem'])"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no_such_tracker", "unknown tracker 'no_such_tracker'"),
        ("no_such_module_xyz:create", "factory 'no_such_module_xyz:create' cannot be imported"),
        ("test_tracker_api:missing", "has no attribute 'missing'"),
        ("test_tracker_api:NOT_A_FACTORY", "is a int, not a factory"),
    ],
)
def test_unknown_or_unimportable_trackers_raise_naming_them(
    monkeypatch: pytest.MonkeyPatch, name: str, message: str
) -> None:
    """An unknown tracker name or a factory that cannot be imported fails app_run_from_env clearly."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    set_env(monkeypatch, TORCHX_JOB_ID="local_cwd://s/app", TORCHX_TRACKERS=name)
    with pytest.raises(UnknownTrackerError, match="tracker") as info:
        app_run_from_env()
    assert message in str(info.value)
    assert name.split(":")[0] in str(info.value)


def test_a_factory_that_fails_to_import_names_the_import_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A factory module that raises on import: the error names the tracker and the cause."""
    (tmp_path / "broken_tracker_mod.py").write_text("import not_installed_dependency_zz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UnknownTrackerError) as info:
        build_tracker("mine", None, "broken_tracker_mod:create")
    assert "tracker 'mine'" in str(info.value)
    assert "not_installed_dependency_zz" in str(info.value)


def test_an_unreadable_config_file_is_named(tmp_path: Path) -> None:
    """A config file that does not exist (or cannot be read) is a TrackerConfigError naming it."""
    missing = tmp_path / "nope.conf"
    with pytest.raises(TrackerConfigError, match=r"tracker 'fsspec'.*nope\.conf"):
        build_tracker("fsspec", str(missing))
    directory = tmp_path / "adir"
    directory.mkdir()
    with pytest.raises(TrackerConfigError, match="adir"):
        build_tracker("fsspec", str(directory))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("protocol=file\n", "has no root_path"),
        ("root_path=/tmp\n", "has no protocol"),
        ("protocol=file\nroot_path=/definitely/not/here\n", "does not exist"),
    ],
)
def test_invalid_fsspec_configs_are_explained(tmp_path: Path, text: str, message: str) -> None:
    """Missing protocol/root_path or a missing root directory: a one-line TrackerConfigError."""
    conf = tmp_path / "t.conf"
    conf.write_text(text)
    with pytest.raises(TrackerConfigError, match=message):
        create(str(conf))


def test_the_fsspec_tracker_without_config_says_how_to_set_it() -> None:
    """The fsspec tracker with no config names the .torchxconfig section to set."""
    with pytest.raises(TrackerConfigError, match=r"\[tracker:NAME\]"):
        build_tracker("fsspec", None)


@pytest.mark.parametrize(
    "value",
    [object(), {1, 2}, b"bytes", {"nested": object()}, 10**5000],
    ids=["obj", "set", "bytes", "nested", "int-past-the-digit-limit"],
)
def test_metadata_that_is_not_json_serialisable_is_rejected_naming_the_key(
    tracker_conf: Path, value: object
) -> None:
    """add_metadata with a non-JSON value raises InvalidMetadataError naming the key; nothing written."""
    tracker = create(str(tracker_conf))
    run = AppRun("local_cwd://s/a", [tracker], names=["fsspec"])
    with pytest.raises(InvalidMetadataError, match="metadata 'weights'"):
        run.add_metadata(ok=1, weights=value)
    with pytest.raises(InvalidMetadataError, match="artifact 'ckpt'"):
        run.add_artifact("ckpt", "/p", {"weights": value})
    assert not tracker.exists("local_cwd://s/a")
    with pytest.raises(TypeError):
        tracker.add_metadata("local_cwd://s/a", weights=value)


def test_a_failing_tracker_is_named_and_the_others_still_record(tracker_conf: Path) -> None:
    """A write error raises TrackerWriteError naming the failed tracker; healthy trackers got the data."""
    good = create(str(tracker_conf))
    bad = MemoryTracker(fail=True)
    run = AppRun("local_cwd://s/a", [bad, good], names=["flaky", "fsspec"])
    with pytest.raises(TrackerWriteError) as info:
        run.add_metadata(loss=0.5)
    assert "tracker 'flaky'" in str(info.value)
    assert "No space left on device" in str(info.value)
    assert "fsspec" not in str(info.value)
    assert info.value.failures[0][0] == "flaky"
    assert isinstance(info.value, TrackerError)
    assert good.metadata("local_cwd://s/a") == {"loss": 0.5}


def test_job_side_imports_neither_asyncio_nor_anyio(tracker_conf: Path, tmp_path: Path) -> None:
    """Importing asynctorchx.tracker and reporting metadata loads no asyncio or anyio module."""
    script = textwrap.dedent(
        """
        import sys
        from asynctorchx.tracker import app_run_from_env
        run = app_run_from_env()
        run.add_metadata(loss=0.25)
        run.add_artifact("ckpt", "/c.pt")
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("asyncio", "anyio"))
        print(heavy)
        """
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "TORCHX_JOB_ID": "local_cwd://s/light",
        "TORCHX_TRACKERS": "fsspec",
        "TORCHX_TRACKER_FSSPEC_CONFIG": str(tracker_conf),
    }
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    assert create(str(tracker_conf)).metadata("local_cwd://s/light") == {"loss": 0.25}


def test_names_match_torchx() -> None:
    """The module exposes TorchX's public names of torchx.tracker.api."""
    for name in (
        "ENV_TORCHX_TRACKERS",
        "ENV_TORCHX_PARENT_RUN_ID",
        "ENV_TORCHX_JOB_ID",
        "TrackerSource",
        "TrackerArtifact",
        "AppRunTrackableSource",
        "Lineage",
        "TrackerBase",
        "tracker_config_env_var_name",
        "build_trackers",
        "trackers_from_environ",
        "AppRun",
    ):
        assert hasattr(api, name), name
    assert api.tracker_config_env_var_name("my_tracker") == "TORCHX_TRACKER_MY_TRACKER_CONFIG"


@pytest.mark.parametrize("group", ["asynctorchx.tracker", "torchx.tracker"])
def test_entry_point_trackers_resolve_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group: str
) -> None:
    """A tracker name that is an entry point of asynctorchx.tracker or torchx.tracker is loaded."""
    dist = tmp_path / "my_trackers-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-trackers\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{group}]\nmemtrk = test_tracker_api:make_memory_tracker\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    tracker = build_tracker("memtrk", "cfg-ep")
    assert isinstance(tracker, MemoryTracker)
    assert tracker.config == "cfg-ep"
    (dist / "entry_points.txt").write_text(f"[{group}]\nmemtrk = no_such_mod_q:create\n")
    with pytest.raises(UnknownTrackerError, match="tracker 'memtrk': its entry point"):
        build_tracker("memtrk", None)
