"""Workspace faults found by a second probe: snapshots of a workspace whose files were touched,
deep trees, and what a failed copy leaves behind (asynctorchx.schedulers.workspace)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from _workspace_env import make_workspace

from asynctorchx.schedulers.workspace import (
    TORCHXIGNORE,
    link_tree,
    remove_tree,
    scan_workspace,
    snapshot,
)
from asynctorchx.specs import Workspace

# -- snapshots: a touched workspace -----------------------------------------------------------------


def test_a_touched_workspace_file_reuses_its_snapshot(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A workspace file whose time moved but whose bytes did not (touch, a checkout, an edit undone)
    keeps its snapshot: it was remade, with a warning that a replica had rewritten it, and removed
    from under the submits linking to it meanwhile."""
    ws = make_workspace(tmp_path / "ws", {"train.py": "print('hi')\n", "lib/util.py": "x = 1\n"})
    store = str(tmp_path / "store")
    scan = scan_workspace(Workspace.from_str(str(ws)), TORCHXIGNORE)
    final, made = snapshot(scan, store, scan.digest, read_only=True)
    assert made
    inode = os.stat(final).st_ino
    later = os.stat(ws / "train.py").st_mtime + 3600
    os.utime(ws / "train.py", (later, later))
    again = scan_workspace(Workspace.from_str(str(ws)), TORCHXIGNORE)
    assert again.digest == scan.digest
    with caplog.at_level(logging.WARNING, logger="asynctorchx.schedulers.workspace"):
        assert snapshot(again, store, again.digest, read_only=True) == (final, False)
    assert os.stat(final).st_ino == inode
    assert os.stat(Path(final) / "train.py").st_mtime == later  # the next submit: a stat alone
    assert not [r for r in caplog.records if "changed since it was made" in r.getMessage()]


def test_a_snapshot_file_rewritten_in_place_with_its_size_is_made_again(tmp_path: Path) -> None:
    """A snapshot file rewritten in place (same size, other bytes, time moved) is still caught:
    the snapshot is made again and holds the workspace's bytes."""
    ws = make_workspace(tmp_path / "ws", {"config.txt": "original\n"})
    store = str(tmp_path / "store")
    scan = scan_workspace(Workspace.from_str(str(ws)), TORCHXIGNORE)
    final, _ = snapshot(scan, store, scan.digest, read_only=True)
    copy = Path(final) / "config.txt"
    copy.chmod(0o644)
    copy.write_text("tampered\n")
    copy.chmod(0o444)
    later = os.stat(copy).st_mtime + 3600
    os.utime(copy, (later, later))
    assert snapshot(scan, store, scan.digest, read_only=True) == (final, True)
    assert copy.read_text() == "original\n"


# -- deep trees ---------------------------------------------------------------------------------------


def _deep_workspace(root: Path, depth: int) -> str:
    """A workspace whose one file lies ``depth`` directories down; returns its relative path."""
    rel = "/".join(["d"] * depth)
    os.makedirs(root)
    for i in range(1, depth + 1):  # os.makedirs itself recurses once per missing level
        os.mkdir(root / "/".join(["d"] * i))
    (root / rel / "f.txt").write_text("deep\n")
    return f"{rel}/f.txt"


def test_a_workspace_deeper_than_the_recursion_limit_is_snapshot_and_linked(
    tmp_path: Path,
) -> None:
    """A tree deeper than Python's recursion limit (its paths still far below PATH_MAX) is
    snapshot, linked into an app's directory and removed: the link failed with RecursionError, and
    removing the partial link tree failed the same way, leaving it behind."""
    depth = sys.getrecursionlimit() + 100
    try:
        rel = _deep_workspace(tmp_path / "ws", depth)
        scan = scan_workspace(Workspace.from_str(str(tmp_path / "ws")), TORCHXIGNORE)
        final, _ = snapshot(scan, str(tmp_path / "store"), scan.digest, read_only=True)
        app = tmp_path / "app"
        assert link_tree(final, str(app)) == scan.files
        assert (app / rel).read_text() == "deep\n"
        remove_tree(str(app))
        assert not app.exists()
    finally:  # pytest's own clean-up of tmp_path recurses too
        for name in ("ws", "store", "app"):
            remove_tree(str(tmp_path / name))


def test_a_directory_swapped_for_a_symlink_during_a_removal_removes_nothing_outside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory of the tree replaced by a symlink to another directory after its parent was
    listed (a replica still writing into its app directory while it is removed) is not followed:
    the other directory keeps its files, as with shutil.rmtree; the tree itself is removed."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me\n")
    tree = tmp_path / "tree"
    (tree / "sub" / "deeper").mkdir(parents=True)
    (tree / "sub" / "deeper" / "f.txt").write_text("x\n")
    real_scandir = os.scandir
    swapped: list[bool] = []

    def scandir_then_swap(target: Any) -> Any:
        listing = list(real_scandir(target))
        if not swapped and any(e.name == "sub" for e in listing):
            swapped.append(True)
            os.rename(tree / "sub", tmp_path / "moved")
            os.symlink(outside, tree / "sub")
        return contextlib.nullcontext(iter(listing))

    monkeypatch.setattr(os, "scandir", scandir_then_swap)
    remove_tree(str(tree))
    monkeypatch.undo()
    assert swapped == [True]
    assert (outside / "precious.txt").read_text() == "keep me\n"
    assert not tree.exists()


# -- ignore files: TorchX's trailing comments ---------------------------------------------------------


def test_a_trailing_comment_in_an_ignore_file_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """'data  # big' in .torchxignore excludes data under TorchX (the rest of a line is a comment
    there) but is one pattern under Docker's rules, which ship data: the scan says so, naming the
    file and line, instead of shipping it silently; plain patterns and 'a#b' are not warned about."""
    ws = make_workspace(
        tmp_path / "ws",
        {
            "data/big.bin": "x",
            "a#b": "",
            "keep.py": "",
            TORCHXIGNORE: "# comments on their own line\n*.tmp\na#b\ndata  # the big files\n",
        },
    )
    with caplog.at_level(logging.WARNING, logger="asynctorchx.schedulers.workspace"):
        scan = scan_workspace(Workspace.from_str(str(ws)), TORCHXIGNORE)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1, warned
    assert f"{ws / TORCHXIGNORE} line 4: 'data  # the big files' is one pattern" in warned[0]
    assert scan.get("data/big.bin") is not None and scan.get("a#b") is None


def test_files_that_torchxs_reading_of_the_ignore_file_leaves_out_are_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """'*.pt' matches top-level paths only under Docker's rules (used here), but any depth under
    TorchX's (fnmatch, whose '*' crosses '/'): the nested checkpoints are shipped as documented,
    and the scan says so once, naming the pattern, the files and the '**/' form that leaves them
    out; what both readings agree on ('!' re-includes, top-level matches) is not warned about."""
    ws = make_workspace(
        tmp_path / "ws",
        {
            "a.pt": "",
            "ckpt/step1/model.pt": "",
            "ckpt/step2/model.pt": "",
            "kept/k.pt": "",
            "src/train.py": "",
            TORCHXIGNORE: "*.pt\n!kept/*.pt\n",
        },
    )
    with caplog.at_level(logging.WARNING, logger="asynctorchx.schedulers.workspace"):
        scan = scan_workspace(Workspace.from_str(str(ws)), TORCHXIGNORE)
    assert scan.get("a.pt") is None
    assert scan.get("ckpt/step1/model.pt") is not None and scan.get("kept/k.pt") is not None
    (warned,) = [r.getMessage() for r in caplog.records]
    assert f"{ws / TORCHXIGNORE}: 2 files that TorchX would leave out are shipped" in warned
    assert "'ckpt/step1/model.pt', 'ckpt/step2/model.pt'" in warned and "kept/k.pt" not in warned
    assert "'*.pt' matches only at the top level" in warned and "write '**/*.pt'" in warned


def test_an_ignore_file_read_alike_by_torchx_and_docker_is_not_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Patterns both readings agree on (names, directories, '**/' globs, globs with nothing
    nested to match) give no warning."""
    ws = make_workspace(
        tmp_path / "ws",
        {
            "a.pt": "",
            "data/big.bin": "",
            "src/__pycache__/m.pyc": "",
            "src/m.py": "",
            "notes.txt": "",
            TORCHXIGNORE: "data\n**/*.pyc\n*.pt\n*.tmp\n",
        },
    )
    with caplog.at_level(logging.WARNING, logger="asynctorchx.schedulers.workspace"):
        scan = scan_workspace(Workspace.from_str(str(ws)), TORCHXIGNORE)
    shipped = {e.path for e in scan.entries if e.kind == "file"}
    assert {"notes.txt", "src/m.py"} <= shipped
    assert not shipped & {"a.pt", "data/big.bin", "src/__pycache__/m.pyc"}
    assert caplog.records == []
