"""The cgroup directories of an app are made parents first, one ``mkdir`` each."""

from __future__ import annotations

from pathlib import Path

import pytest

from asynctorchx.schedulers._local.guard import Containment


def test_directories_are_made_parents_first_and_existing_ones_are_kept(tmp_path: Path) -> None:
    """The app's directory, then its replicas' (one existing already: a restart's): all exist."""
    app = tmp_path / "app"
    (app / "0.1").parent.mkdir()
    (app / "0.1").mkdir()
    dirs = [str(app), str(app / "0.1"), str(app / "1.1")]
    Containment._make_dirs(dirs)
    assert sorted(p.name for p in app.iterdir()) == ["0.1", "1.1"]


def test_a_missing_parent_is_made_too(tmp_path: Path) -> None:
    """A base removed under the scheduler (a cleanup) is made again rather than failing."""
    deep = tmp_path / "base" / "app" / "0.1"
    Containment._make_dirs([str(deep)])
    assert deep.is_dir()


def test_a_file_in_the_way_is_an_error(tmp_path: Path) -> None:
    """A file where a directory goes raises FileExistsError (the launch then uses markers)."""
    (tmp_path / "app").write_text("not a directory\n")
    with pytest.raises(FileExistsError):
        Containment._make_dirs([str(tmp_path / "app")])
