"""The fsspec tracker: TorchX's on-disk layout, read and written by TorchX 0.7 itself, fsspec protocols."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from base64 import b32encode
from pathlib import Path

import pytest
from _torchx_env import run_torchx

from asynctorchx.tracker.api import TrackerArtifact, TrackerError, TrackerSource
from asynctorchx.tracker.backend.fsspec import FsspecTracker, create, decode_run_id, encode_run_id

ROOT = Path(__file__).resolve().parent.parent
RUN = "local_cwd://session/trial-3-abc"


@pytest.fixture
def conf(tmp_path: Path) -> Path:
    """A TorchX-format config of a local tracker root."""
    root = tmp_path / "runs"
    root.mkdir()
    path = tmp_path / "tracker.conf"
    path.write_text(f"protocol=file\nroot_path={root}\n")
    return path


def test_layout_is_torchxs(conf: Path) -> None:
    """Runs are Base32 directories with metadata/artifacts files named by time and sources files."""
    tracker = create(str(conf))
    tracker.add_metadata(RUN, lr=0.1)
    tracker.add_artifact(RUN, "ckpt", "/c.pt", {"epoch": 1})
    tracker.add_source(RUN, "sweep-1", "best")
    run_dir = Path(tracker.root) / b32encode(RUN.encode()).decode()
    assert sorted(p.name for p in run_dir.iterdir() if not p.name.startswith(".")) == [
        "artifacts",
        "metadata",
        "sources",
    ]
    [md] = list((run_dir / "metadata").iterdir())
    assert md.name.isdigit()
    assert json.loads(md.read_text()) == {"metadata": {"lr": 0.1}}
    [art] = list((run_dir / "artifacts").iterdir())
    assert json.loads(art.read_text()) == {
        "name": "ckpt",
        "path": "/c.pt",
        "metadata": {"epoch": 1},
    }
    src = run_dir / "sources" / b32encode(b"sweep-1").decode()
    assert src.read_text() == "best\n"
    assert not list(run_dir.glob(".tmp-*")), "no temporary file is left behind"
    assert decode_run_id(encode_run_id(RUN)) == RUN
    assert decode_run_id("lost+found") is None


def test_later_metadata_wins_in_write_order(conf: Path) -> None:
    """Metadata merges in the order of the files' names (write times), whatever the listing order."""
    tracker = create(str(conf))
    for i in range(30):
        tracker.add_metadata(RUN, step=i, **{f"k{i}": i})
    md = tracker.metadata(RUN)
    assert md["step"] == 29
    assert len(md) == 31


def test_unknown_runs_and_filters(conf: Path) -> None:
    """Unknown runs read as empty (TorchX's contract) but exists() says so; unknown filters raise."""
    tracker = create(str(conf))
    assert tracker.metadata("nope") == {}
    assert not tracker.exists("nope")
    with pytest.raises(TypeError, match="'owner'"):
        tracker.run_ids(owner="me")
    (Path(tracker.root) / "lost+found").mkdir()
    (Path(tracker.root) / "stray-file").write_text("x")
    tracker.add_metadata(RUN, a=1)
    assert tracker.run_ids() == [RUN]


def test_a_corrupt_entry_is_an_error_naming_the_file(conf: Path) -> None:
    """A metadata file that is not an entry raises TrackerError naming the file, not a traceback."""
    tracker = create(str(conf))
    tracker.add_metadata(RUN, a=1)
    bad = Path(tracker.category_dir(RUN, "metadata")) / "1"
    bad.write_text('["not", "an", "entry"]')
    with pytest.raises(TrackerError, match=str(bad)):
        tracker.metadata(RUN)
    bad.write_text("garbage that is not json")
    with pytest.raises(TrackerError, match="not valid JSON"):
        tracker.metadata(RUN)


def test_a_run_id_too_long_for_a_file_name_is_a_clear_error(conf: Path) -> None:
    """A run id whose Base32 name exceeds the file-name limit raises TrackerError naming it."""
    tracker = create(str(conf))
    with pytest.raises(TrackerError, match="too long"):
        tracker.add_metadata("x" * 200, a=1)


def test_an_artifact_name_with_a_line_break_is_refused_not_split(conf: Path) -> None:
    """A source's artifact name holding a newline raises TrackerError; it is never read back as two."""
    tracker = create(str(conf))
    for name in ("a\nb", "a\rb"):
        with pytest.raises(
            TrackerError, match=r"artifact name 'a\\[nr]b' of source 'src'.*line break"
        ):
            tracker.add_source(RUN, "src", name)
    assert tracker.sources(RUN) == []


def test_a_run_id_of_bytes_that_are_not_utf8_is_a_clear_error(conf: Path) -> None:
    """A run id from an environment holding non-UTF-8 bytes raises TrackerError naming it."""
    tracker = create(str(conf))
    run_id = os.fsdecode(b"trial-\xff")
    for call in (
        lambda: tracker.add_metadata(run_id, a=1),
        lambda: tracker.metadata(run_id),
        lambda: tracker.run_ids(parent_run_id=run_id),
    ):
        with pytest.raises(TrackerError, match=r"run id 'trial-\\udcff' is not valid text"):
            call()


def test_an_empty_run_id_is_refused_instead_of_writing_into_the_root(
    conf: Path, tmp_path: Path
) -> None:
    """An empty run id raises TrackerError naming it; nothing lands in the root's own directory."""
    tracker = create(str(conf))
    before = sorted(os.listdir(tracker.root))
    for write in (
        lambda: tracker.add_metadata("", a=1),
        lambda: tracker.add_artifact("", "m", "/m"),
        lambda: tracker.add_source("", "parent"),
        lambda: tracker.add_source("child", ""),
    ):
        with pytest.raises(TrackerError, match="non-empty string, got ''"):
            write()
    assert sorted(os.listdir(tracker.root)) == before


def test_concurrent_writers_keep_every_entry(conf: Path) -> None:
    """Four processes writing 200 entries each to one run lose none (exclusive names, no overwrite)."""
    script = textwrap.dedent(
        f"""
        import sys
        from asynctorchx.tracker.backend.fsspec import create
        t = create({str(conf)!r})
        for i in range(200):
            t.add_metadata({RUN!r}, **{{f"w{{sys.argv[1]}}_{{i}}": i}})
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(w)], env=env) for w in range(4)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0, 0]
    tracker = create(str(conf))
    assert len(tracker.metadata(RUN)) == 800
    assert len(tracker.entry_names(RUN, "metadata")) == 800


def test_fsspec_protocols_work_through_fsspec(tmp_path: Path) -> None:
    """A non-local protocol (fsspec's memory file system) stores and reads runs in the same layout."""
    import fsspec  # the dev extra installs it (asynctorchx[tracker] for users)

    fs = fsspec.filesystem("memory")
    fs.makedirs("/trk", exist_ok=True)
    conf = tmp_path / "mem.conf"
    conf.write_text("protocol=memory\nroot_path=/trk\n")
    tracker = create(str(conf))
    assert not tracker.is_local
    tracker.add_metadata(RUN, a=1)
    tracker.add_metadata(RUN, a=2, b=3)
    tracker.add_source(RUN, "parent-run")
    tracker.add_artifact(RUN, "model", "memory://trk/model.pt")
    assert tracker.metadata(RUN) == {"a": 2, "b": 3}
    assert tracker.run_ids(parent_run_id="parent-run") == [RUN]
    assert tracker.sources(RUN) == [TrackerSource("parent-run", None)]
    assert tracker.artifacts(RUN)["model"].path == "memory://trk/model.pt"
    assert fs.exists(f"/trk/{encode_run_id(RUN)}/metadata")


def test_local_fsspec_filesystem_objects_use_the_local_path(tmp_path: Path) -> None:
    """FsspecTracker(fsspec LocalFileSystem, root) writes the local layout (atomic publication)."""
    import fsspec  # the dev extra installs it (asynctorchx[tracker] for users)

    tracker = FsspecTracker(fsspec.filesystem("file"), str(tmp_path))
    assert tracker.is_local
    tracker.add_metadata(RUN, a=1)
    assert tracker.metadata(RUN) == {"a": 1}


# -- TorchX 0.7 itself ------------------------------------------------------------------------------


def test_torchx_reads_runs_written_by_asynctorchx(conf: Path) -> None:
    """TorchX 0.7's FsspecTracker reads our runs: ids, parent filter, metadata, artifacts, sources."""
    tracker = create(str(conf))
    tracker.add_source(RUN, "sweep-9")
    tracker.add_metadata(RUN, lr=0.01, loss=[1.0, 0.5])
    tracker.add_artifact(RUN, "ckpt", "/ckpt/final.pt", {"epoch": 9})
    tracker.add_metadata("local_cwd://session/other", x=1)
    out = run_torchx(
        f"""
        import json
        from torchx.tracker.backend.fsspec import create
        t = create({str(conf)!r})
        arts = {{k: [a.name, a.path, a.metadata] for k, a in t.artifacts({RUN!r}).items()}}
        print(json.dumps({{
            "runs": sorted(t.run_ids()),
            "children": list(t.run_ids(parent_run_id="sweep-9")),
            "metadata": t.metadata({RUN!r}),
            "artifacts": arts,
            "sources": [[s.source_run_id, s.artifact_name] for s in t.sources({RUN!r})],
        }}))
        """
    )
    assert json.loads(out) == {
        "runs": ["local_cwd://session/other", RUN],
        "children": [RUN],
        "metadata": {"lr": 0.01, "loss": [1.0, 0.5]},
        "artifacts": {"ckpt": ["ckpt", "/ckpt/final.pt", {"epoch": 9}]},
        "sources": [["sweep-9", None]],
    }


def test_asynctorchx_reads_runs_written_by_torchx_jobs(conf: Path) -> None:
    """A run written by TorchX's job side (app_run_from_env in TorchX 0.7) reads back identically."""
    run_torchx(
        """
        from torchx.tracker import app_run_from_env
        run = app_run_from_env()
        run.add_metadata(lr=0.3, momentum=0.9)
        run.add_metadata(loss=0.125)
        run.add_artifact("tb", "/logs/tb", {"kind": "tensorboard"})
        run.add_source("dataset-v2", "train")
        """,
        TORCHX_JOB_ID=RUN,
        TORCHX_PARENT_RUN_ID="sweep-2",
        TORCHX_TRACKERS="fsspec",
        TORCHX_TRACKER_FSSPEC_CONFIG=str(conf),
    )
    tracker = create(str(conf))
    assert tracker.run_ids() == [RUN]
    assert tracker.run_ids(parent_run_id="sweep-2") == [RUN]
    assert tracker.metadata(RUN) == {"lr": 0.3, "momentum": 0.9, "loss": 0.125}
    assert tracker.artifacts(RUN) == {
        "tb": TrackerArtifact("tb", "/logs/tb", {"kind": "tensorboard"})
    }
    assert sorted(tracker.sources(RUN), key=lambda s: s.source_run_id) == [
        TrackerSource("dataset-v2", "train"),
        TrackerSource("sweep-2", None),
    ]
    assert tracker.sources(RUN, "train") == [TrackerSource("dataset-v2", "train")]
