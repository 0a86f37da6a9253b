"""Workspaces without an engine: the model (specs), the ignore rules, scanning and hashing, the tar
stream, directory copies and snapshots (asynctorchx.schedulers.workspace)."""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest
from _workspace_env import make_workspace, run_as_unprivileged_reader

from asynctorchx.schedulers._docker.image import _recipe
from asynctorchx.schedulers.workspace import (
    DOCKERIGNORE,
    TORCHX_DOCKERFILE,
    TORCHXIGNORE,
    IgnoreRules,
    WorkspaceChangedError,
    _check_cancelled,
    copy_scan,
    image_key,
    link_tree,
    run_in_thread,
    scan_workspace,
    snapshot,
    write_tar,
)
from asynctorchx.specs import InvalidWorkspaceException, Workspace

# -- the model --------------------------------------------------------------------------------------


def test_a_path_is_one_unmapped_project_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative path becomes absolute against the current directory; '~' is expanded."""
    monkeypatch.chdir(tmp_path)
    ws = Workspace.from_str("proj/./sub/")
    assert ws.projects == {str(tmp_path / "proj" / "sub"): ""}
    assert ws.is_unmapped_single_project() and ws.root == str(tmp_path / "proj" / "sub")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert Workspace.from_str("~/x").projects == {str(tmp_path / "x"): ""}


@pytest.mark.parametrize(
    ("url", "path"),
    [
        ("file:///srv/my%20code", "/srv/my code"),
        ("file://localhost/srv/code", "/srv/code"),
        ("file:///srv/a:b", "/srv/a:b"),
        ("file:///srv/a%3Ab%2Cc", "/srv/a:b,c"),
    ],
)
def test_a_file_url_names_its_local_path(url: str, path: str) -> None:
    """file:// URLs are decoded; a ':' in one URL is part of its path, a ',' must be encoded."""
    assert Workspace.from_str(url).projects == {path: ""}


def test_the_multi_project_form_maps_directories_to_subdirectories() -> None:
    """'a:x,b:y' (optionally in braces, as TorchX's YAML) maps each directory to its sub-directory."""
    ws = Workspace.from_str("/src/app:, /src/lib : vendor/lib/ ,file:///src/data:data")
    assert ws.projects == {"/src/app": "", "/src/lib": "vendor/lib", "/src/data": "data"}
    assert not ws.is_unmapped_single_project() and ws.root is None
    assert Workspace.from_str("{/a: x, /b: y}").projects == {"/a": "x", "/b": "y"}
    assert str(ws) == "/src/app,/src/lib:vendor/lib,/src/data:data"


def test_of_accepts_every_form_and_empty_means_no_workspace(tmp_path: Path) -> None:
    """None and '' disable the workspace; paths, PathLikes, mappings and Workspaces are accepted."""
    assert Workspace.of(None) is None
    assert Workspace.of("") is None and Workspace.of("  ") is None
    assert Workspace.of(tmp_path) == Workspace({str(tmp_path): ""})
    assert Workspace.of({str(tmp_path): "sub"}) == Workspace({str(tmp_path): "sub"})
    ws = Workspace({str(tmp_path): None})  # type: ignore[dict-item]
    assert Workspace.of(ws) is ws and ws.projects == {str(tmp_path): ""}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("s3://bucket/code", "not a local directory"),
        ("file://otherhost/code", "not a local directory"),
        ("/a:../up", "leaves the workspace"),
        ("/a:/abs", "must be relative"),
        ("/a\0b", "NUL"),
        ("/a:x,/a:y", "twice"),
        ("/a,,/b", "empty item"),
        ({}, "at least one directory"),
        (42, "must be a path"),
    ],
)
def test_bad_workspaces_are_rejected_naming_the_value(value: object, message: str) -> None:
    """Each malformed workspace is an InvalidWorkspaceException that says what is wrong."""
    with pytest.raises(InvalidWorkspaceException, match=message):
        Workspace.of(value)  # type: ignore[arg-type]


# -- ignore rules (dockerignore semantics) ---------------------------------------------------------


def _excluded(lines: list[str], paths: list[str]) -> list[str]:
    rules = IgnoreRules(lines, ".dockerignore")
    return [p for p in paths if rules.excluded(p)]


def test_patterns_are_anchored_at_the_root_as_docker_does() -> None:
    """'*.pyc' matches top-level files only; '**/*.pyc' matches at any depth."""
    paths = ["a.pyc", "pkg/b.pyc", "pkg/deep/c.pyc", "a.py"]
    assert _excluded(["*.pyc"], paths) == ["a.pyc"]
    assert _excluded(["**/*.pyc"], paths) == ["a.pyc", "pkg/b.pyc", "pkg/deep/c.pyc"]
    assert _excluded(["pkg/**/c.pyc"], paths) == ["pkg/deep/c.pyc"]


def test_comments_blank_lines_leading_slashes_and_trailing_slashes() -> None:
    """'#' starts a comment only at the start of a line; '/x' and 'x/' both mean x and below."""
    lines = ["# a comment", "", "   ", "/build/", "  dist  ", " # not a comment"]
    paths = ["build", "build/x.o", "dist", "dist/w.whl", "# not a comment", "src/build"]
    assert _excluded(lines, paths) == [
        "build",
        "build/x.o",
        "dist",
        "dist/w.whl",
        "# not a comment",
    ]


def test_negation_re_includes_and_the_last_matching_pattern_wins() -> None:
    """'!' re-includes what an earlier pattern excluded; a later pattern can exclude it again."""
    assert _excluded(["*.md", "!README.md"], ["a.md", "README.md"]) == ["a.md"]
    assert _excluded(["*.md", "!README.md", "README*"], ["a.md", "README.md"]) == [
        "a.md",
        "README.md",
    ]


def test_character_classes_and_single_character_wildcards() -> None:
    """'?' is one character, '[a-c]' a class, '[!a]' a negated class, within one component."""
    paths = ["f1", "f12", "fa", "fb", "fd", "x/f1"]
    assert _excluded(["f?"], paths) == ["f1", "fa", "fb", "fd"]
    assert _excluded(["f[a-c]"], paths) == ["fa", "fb"]
    assert _excluded(["f[!a-c]"], paths) == ["f1", "fd"]


def test_an_excluded_directory_is_entered_only_for_a_negation_that_starts_with_it() -> None:
    """As the Docker CLI: '!build/keep' re-includes inside an excluded build/, '!**/keep' does not."""
    assert IgnoreRules(["build", "!build/keep"]).may_include_below("build")
    assert not IgnoreRules(["build", "!**/keep"]).may_include_below("build")
    assert not IgnoreRules(["build"]).may_include_below("build")


def test_a_byte_order_mark_on_the_first_line_is_ignored() -> None:
    """An ignore file saved with a BOM still excludes its first pattern."""
    assert _excluded(["\ufeffsecret"], ["secret"]) == ["secret"]


# -- scanning and hashing ---------------------------------------------------------------------------


def _tree(root: Path, files: dict[str, str | bytes]) -> Path:
    return make_workspace(root, files, nonce=False)


def _ws(path: Path) -> Workspace:
    return Workspace({str(path): ""})


def _paths(scan: object) -> list[str]:
    return [e.path for e in scan.entries]  # type: ignore[attr-defined]


def test_a_scan_lists_the_included_files_with_their_sizes(tmp_path: Path) -> None:
    """Files, directories and symlinks are listed by path; ignored ones are not; sizes add up."""
    root = _tree(
        tmp_path / "ws",
        {
            "train.py": "print(1)\n",
            "data/x.bin": b"\0" * 100,
            "data/skip.log": "x",
            ".torchxignore": "**/*.log\n",
        },
    )
    (root / "link").symlink_to("train.py")
    scan = scan_workspace(_ws(root), TORCHXIGNORE)
    assert _paths(scan) == [".torchxignore", "data", "data/x.bin", "link", "train.py"]
    assert scan.files == 3 and scan.total_bytes == 9 + 100 + 9
    link = scan.get("link")
    assert link is not None and link.kind == "symlink" and link.link == "train.py"


def test_the_ignore_file_depends_on_the_target(tmp_path: Path) -> None:
    """Images honour .dockerignore, directory copies .torchxignore; Dockerfile.torchx is always sent."""
    root = _tree(
        tmp_path / "ws",
        {
            "a": "a",
            "b": "b",
            DOCKERIGNORE: f"a\n{TORCHX_DOCKERFILE}\n",
            TORCHXIGNORE: "b\n",
            TORCHX_DOCKERFILE: "FROM x\n",
        },
    )
    image = scan_workspace(_ws(root), DOCKERIGNORE, keep=(TORCHX_DOCKERFILE,))
    copy = scan_workspace(_ws(root), TORCHXIGNORE)
    assert "a" not in _paths(image) and "b" in _paths(image) and TORCHX_DOCKERFILE in _paths(image)
    assert "b" not in _paths(copy) and "a" in _paths(copy)


def test_files_re_included_inside_an_excluded_directory_are_scanned(tmp_path: Path) -> None:
    """'build' + '!build/keep.txt' ships build/keep.txt and nothing else of build/."""
    root = _tree(
        tmp_path / "ws",
        {"build/keep.txt": "k", "build/drop.o": "d", DOCKERIGNORE: "build\n!build/keep.txt\n"},
    )
    scan = scan_workspace(_ws(root), DOCKERIGNORE)
    assert _paths(scan) == [DOCKERIGNORE, "build/keep.txt"]


def test_the_digest_covers_paths_modes_and_bytes_but_not_times(tmp_path: Path) -> None:
    """A changed byte, mode or name changes the digest; touching a file or ignored files do not."""
    root = _tree(tmp_path / "ws", {"a.py": "A", "b.py": "B", TORCHXIGNORE: "*.tmp\n"})

    def digest() -> str:
        return scan_workspace(_ws(root), TORCHXIGNORE).digest

    first = digest()
    os.utime(root / "a.py", (1, 1))
    (root / "x.tmp").write_text("ignored")
    assert digest() == first
    (root / "a.py").chmod(0o755)
    assert digest() != first
    (root / "a.py").chmod(0o644)
    assert digest() == first
    (root / "b.py").rename(root / "c.py")
    assert digest() != first
    (root / "c.py").rename(root / "b.py")
    (root / "b.py").write_text("C")
    assert digest() != first


@pytest.mark.parametrize("trust_recent", [False, True], ids=["racy-rehashed", "ctime-checked"])
def test_an_in_place_edit_that_keeps_size_and_mtime_is_still_seen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trust_recent: bool
) -> None:
    """A same-size edit with the old mtime put back changes the digest: a recently changed file is
    hashed again, and a remembered hash is dropped when the file's ctime moves."""
    if trust_recent:  # remember hashes of files changed just now too, to reach the ctime check
        monkeypatch.setattr("asynctorchx.schedulers.workspace._RACY_SECONDS", -1.0)
    root = _tree(tmp_path / "ws", {"a.py": "AAAA"})
    old = 1_000_000_000
    os.utime(root / "a.py", (old, old))
    first = scan_workspace(_ws(root), TORCHXIGNORE)
    assert first.entries[0].racy is not trust_recent
    with open(root / "a.py", "r+") as f:
        f.write("BBBB")
    os.utime(root / "a.py", (old, old))
    second = scan_workspace(_ws(root), TORCHXIGNORE)
    assert second.digest != first.digest


def test_multi_project_workspaces_map_each_project_to_its_subdirectory(tmp_path: Path) -> None:
    """Each project's files go under its sub-directory, each with its own ignore file."""
    app = _tree(tmp_path / "app", {"main.py": "m", TORCHXIGNORE: "*.log\n", "x.log": "l"})
    lib = _tree(tmp_path / "lib", {"util.py": "u", "x.log": "kept"})
    scan = scan_workspace(Workspace({str(app): "", str(lib): "vendor/lib"}), TORCHXIGNORE)
    assert _paths(scan) == [
        TORCHXIGNORE,
        "main.py",
        "vendor",
        "vendor/lib",
        "vendor/lib/util.py",
        "vendor/lib/x.log",
    ]


def test_projects_that_put_two_files_at_one_path_are_rejected(tmp_path: Path) -> None:
    """Two projects shipping the same path is an error naming both files."""
    a = _tree(tmp_path / "a", {"x.py": "a"})
    b = _tree(tmp_path / "b", {"x.py": "b"})
    with pytest.raises(InvalidWorkspaceException, match=r"collide.*x\.py"):
        scan_workspace(Workspace({str(a): "", str(b): ""}), TORCHXIGNORE)


@pytest.mark.parametrize("symlink_first", [True, False], ids=["symlink-first", "dir-first"])
def test_a_project_below_another_projects_symlink_is_rejected(
    tmp_path: Path, symlink_first: bool
) -> None:
    """A project mapped below a symlink of another project is a collision, whatever the order:
    a copy would otherwise write through the symlink, outside the target."""
    outside = tmp_path / "outside"
    outside.mkdir()
    a = _tree(tmp_path / "a", {"main.py": "m"})
    (a / "lib").symlink_to(outside)
    b = _tree(tmp_path / "b", {"evil.py": "e"})
    projects = {str(a): "", str(b): "lib"} if symlink_first else {str(b): "lib", str(a): ""}
    with pytest.raises(InvalidWorkspaceException, match=r"collide.*'lib"):
        scan_workspace(Workspace(projects), TORCHXIGNORE)
    assert os.listdir(outside) == []


@pytest.mark.parametrize("when", ["before-stat", "after-listing"])
@pytest.mark.parametrize("what", ["file", "symlink", "directory"])
def test_what_is_removed_while_the_scan_lists_it_is_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str, when: str
) -> None:
    """A file, symlink or directory removed while the scan lists its directory (an editor's swap
    or test file) is left out of the scan instead of failing it as unreadable."""
    root = _tree(tmp_path / "ws", {"a.py": "a", "gone/x.py": "x"})
    ghost = root / "4913"
    if what == "file":
        ghost.write_text("")
    elif what == "symlink":
        ghost.symlink_to("a.py")
    else:
        ghost = root / "gone"
    real_scandir = os.scandir

    def remove() -> None:
        if ghost.is_dir() and not ghost.is_symlink():
            shutil.rmtree(ghost)
        else:
            ghost.unlink()

    class Listing:
        """os.scandir's iterator, removing the ghost as it lists the workspace's root."""

        def __init__(self, path: str) -> None:
            self.path = path
            self.it = real_scandir(path)

        def __enter__(self) -> Listing:
            return self

        def __exit__(self, *exc: object) -> None:
            self.it.close()

        def __iter__(self) -> Iterator[os.DirEntry[str]]:
            for entry in self.it:
                if when == "before-stat" and entry.path == str(ghost):
                    remove()
                yield entry
            if when == "after-listing" and self.path == str(root):
                remove()

    monkeypatch.setattr(os, "scandir", Listing)
    scan = scan_workspace(_ws(root), TORCHXIGNORE)
    if what != "directory":
        expected = ["a.py", "gone", "gone/x.py"]
    else:  # listed and stat'ed, then removed: shipped as the empty directory it was seen as
        expected = ["a.py"] + (["gone"] if when == "after-listing" else [])
    assert [e.path for e in scan.entries if e.path != ".nonce"] == expected


def test_a_missing_directory_and_a_file_are_rejected_naming_them(tmp_path: Path) -> None:
    """A workspace that does not exist, or is a file, is a clear error naming the path."""
    with pytest.raises(InvalidWorkspaceException, match=r"'.*/nope' does not exist"):
        scan_workspace(_ws(tmp_path / "nope"), TORCHXIGNORE)
    (tmp_path / "f.py").write_text("x")
    with pytest.raises(InvalidWorkspaceException, match=r"'.*/f\.py' is not a directory"):
        scan_workspace(_ws(tmp_path / "f.py"), TORCHXIGNORE)


def test_the_root_of_the_file_system_is_refused_by_any_path_before_it_is_read(
    tmp_path: Path,
) -> None:
    """A workspace of '/' (or a symlink to it) is refused naming it, before anything is read (it
    read every file of the machine for 25 s, then failed on one of /proc)."""
    (tmp_path / "root").symlink_to("/")
    for path in ("/", str(tmp_path / "root")):
        with pytest.raises(
            InvalidWorkspaceException, match=rf"'{path}' is the root of the file system"
        ):
            scan_workspace(_ws(Path(path)), TORCHXIGNORE)


def test_an_unreadable_file_is_rejected_naming_it(tmp_path: Path) -> None:
    """A file the submitting user cannot read is a clear error naming the file."""
    root = _tree(tmp_path / "ws", {"ok.py": "ok", "secret.py": "s"})
    (root / "secret.py").chmod(0o000)
    code = (
        "from asynctorchx.schedulers.workspace import scan_workspace\n"
        "from asynctorchx.specs import Workspace, InvalidWorkspaceException\n"
        f"try:\n    scan_workspace(Workspace({{{str(root)!r}: ''}}), '.torchxignore')\n"
        "except InvalidWorkspaceException as e:\n    print(e)\n"
    )
    out = run_as_unprivileged_reader(code)
    assert (
        f"workspace file '{root / 'secret.py'}' cannot be read: Permission denied" in out.stdout
    ), out


def test_a_bad_ignore_pattern_names_the_file_and_line(tmp_path: Path) -> None:
    """An ignore pattern pathspec cannot compile is an error naming the ignore file and line."""
    root = _tree(tmp_path / "ws", {TORCHXIGNORE: "ok\n\\\n"})
    with pytest.raises(InvalidWorkspaceException, match=r"\.torchxignore line 2: bad pattern"):
        scan_workspace(_ws(root), TORCHXIGNORE)


def _errors_unless_blocked(call: Callable[[], object], fifo: Path) -> list[BaseException]:
    """What ``call()`` raised, run in a thread; fails the test if it blocks on the FIFO ``fifo``."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():
        with open(fifo, "wb"):  # lets the blocked open() return
            pass
        thread.join(10)
        pytest.fail(f"blocked on the FIFO {fifo}")
    return errors


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_an_ignore_file_that_is_not_a_regular_file_is_an_error(tmp_path: Path, kind: str) -> None:
    """A FIFO, device or directory as the ignore file is an error naming it, never a blocked read."""
    root = _tree(tmp_path / "ws", {"a.py": "x"})
    if kind == "fifo":
        os.mkfifo(root / TORCHXIGNORE)
    elif kind == "device":
        os.symlink("/dev/null", root / TORCHXIGNORE)
    else:
        (root / TORCHXIGNORE).mkdir()
    errors = _errors_unless_blocked(
        lambda: scan_workspace(_ws(root), TORCHXIGNORE), root / TORCHXIGNORE
    )
    assert len(errors) == 1 and isinstance(errors[0], InvalidWorkspaceException), errors
    assert f"ignore file '{root / TORCHXIGNORE}' is not a regular file" in str(errors[0])


def test_the_image_key_covers_base_recipe_and_build_args(tmp_path: Path) -> None:
    """Another base image id, recipe or build argument gives another image key."""
    scan = scan_workspace(_ws(_tree(tmp_path / "ws", {"a": "a"})), DOCKERIGNORE)
    key = image_key(scan, base="sha256:1", recipe=b"FROM x", build_args={"IMAGE": "x"})
    assert key == image_key(scan, base="sha256:1", recipe=b"FROM x", build_args={"IMAGE": "x"})
    assert key != image_key(scan, base="sha256:2", recipe=b"FROM x", build_args={"IMAGE": "x"})
    assert key != image_key(scan, base="sha256:1", recipe=b"FROM y", build_args={"IMAGE": "x"})
    assert key != image_key(scan, base="sha256:1", recipe=b"FROM x", build_args={"IMAGE": "y"})


# -- tar streams, copies, snapshots -----------------------------------------------------------------


def test_the_tar_holds_exactly_the_scanned_files_with_their_modes(tmp_path: Path) -> None:
    """The tar has every scanned entry (bytes, modes, symlinks) plus the extra files."""
    root = _tree(tmp_path / "ws", {"run.sh": "#!/bin/sh\n", "d/data": b"\1\2\3"})
    (root / "run.sh").chmod(0o755)
    (root / "ln").symlink_to("d/data")
    buf = io.BytesIO()
    write_tar(scan_workspace(_ws(root), DOCKERIGNORE), buf, {"Dockerfile.torchx": b"FROM x\n"})
    buf.seek(0)
    with tarfile.open(fileobj=buf) as tf:
        members = {m.name: m for m in tf.getmembers()}
        assert set(members) == {"d", "d/data", "ln", "run.sh", "Dockerfile.torchx"}
        assert members["run.sh"].mode == 0o755 and members["ln"].linkname == "d/data"
        assert tf.extractfile("d/data").read() == b"\1\2\3"  # type: ignore[union-attr]


@pytest.mark.parametrize("trust_recent", [False, True], ids=["racy-rehashed", "stat-checked"])
def test_a_file_changed_after_the_scan_fails_the_tar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trust_recent: bool
) -> None:
    """A file rewritten after the scan stops the tar with WorkspaceChangedError, whether it is
    hashed again (changed just before the scan) or vouched for by its stat."""
    if trust_recent:
        monkeypatch.setattr("asynctorchx.schedulers.workspace._RACY_SECONDS", -1.0)
    root = _tree(tmp_path / "ws", {"a": "same size"})
    scan = scan_workspace(_ws(root), DOCKERIGNORE)
    (root / "a").write_text("SAME SIZE")
    with pytest.raises(WorkspaceChangedError, match="changed after it was hashed"):
        write_tar(scan, io.BytesIO())


@pytest.mark.parametrize("stage", ["scan", "tar", "copy"])
def test_a_file_that_is_always_being_written_fails_saying_to_leave_it_out(
    tmp_path: Path, stage: str
) -> None:
    """A file written to while the workspace is read or shipped (a job's log in the project) fails
    saying it can be left out with the ignore file of the target ("submit again" alone, which
    failed the same way every time)."""
    root = _tree(tmp_path / "ws", {"train.py": "x", "train.log": "step 1\n"})
    ignore_file = DOCKERIGNORE if stage == "tar" else TORCHXIGNORE
    stop = threading.Event()

    def write_log() -> None:
        with open(root / "train.log", "a") as log:
            while not stop.is_set():
                log.write("step\n")
                log.flush()

    scan = None if stage == "scan" else scan_workspace(_ws(root), ignore_file)
    writer = threading.Thread(target=write_log)
    writer.start()
    try:
        with pytest.raises(WorkspaceChangedError) as info:
            for _ in range(1000):  # bounded: the writer changes the file within a few rounds
                if scan is None:
                    scan_workspace(_ws(root), ignore_file)
                elif stage == "tar":
                    write_tar(scan, io.BytesIO())
                else:
                    dest = tmp_path / "copy"
                    shutil.rmtree(dest, ignore_errors=True)
                    dest.mkdir()
                    copy_scan(scan, str(dest))
    finally:
        stop.set()
        writer.join()
    assert "train.log" in str(info.value)
    assert str(info.value).endswith(
        f"(a file that is always being written, a log say, can be left out with {ignore_file})"
    )


@pytest.mark.parametrize("ship", ["tar", "copy", "recipe"])
def test_a_file_replaced_by_a_fifo_after_the_scan_fails_instead_of_blocking(
    tmp_path: Path, ship: str
) -> None:
    """A file swapped for a FIFO after the scan is a WorkspaceChangedError, not an open() that
    waits forever for a writer (the recipe, Dockerfile.torchx, was opened so)."""
    name = TORCHX_DOCKERFILE if ship == "recipe" else "a.py"
    root = _tree(tmp_path / "ws", {name: "FROM x"})
    scan = scan_workspace(_ws(root), DOCKERIGNORE)
    (root / name).unlink()
    os.mkfifo(root / name)
    dest = tmp_path / "copy"
    dest.mkdir()
    ships: dict[str, Callable[[], object]] = {
        "tar": lambda: write_tar(scan, io.BytesIO()),
        "copy": lambda: copy_scan(scan, str(dest)),
        "recipe": lambda: _recipe(scan),
    }
    errors = _errors_unless_blocked(ships[ship], root / name)
    assert len(errors) == 1 and isinstance(errors[0], WorkspaceChangedError), errors
    assert "no longer a regular file" in str(errors[0])


def test_a_copy_keeps_its_bytes_when_the_source_is_edited_in_place(tmp_path: Path) -> None:
    """copy_scan makes real copies (or clones), never links: in-place edits do not reach them."""
    root = _tree(tmp_path / "ws", {"a.py": "v1", "sub/b.txt": "b"})
    dest = tmp_path / "copy"
    dest.mkdir()
    counts = copy_scan(scan_workspace(_ws(root), TORCHXIGNORE), str(dest))
    assert counts["cloned"] + counts["copied"] == 2
    with open(root / "a.py", "r+") as f:
        f.write("v2")
    assert (dest / "a.py").read_text() == "v1" and (dest / "sub/b.txt").read_text() == "b"


def test_a_copy_of_a_sparse_file_stays_sparse(tmp_path: Path) -> None:
    """copy_scan copies a sparse file's data only: same bytes, and its holes take no disk space."""
    root = tmp_path / "ws"
    root.mkdir()
    size = 64 << 20
    with open(root / "sparse.bin", "wb") as f:
        f.write(b"head")
        f.seek(40 << 20)
        f.write(b"middle")
        f.truncate(size)
    if os.stat(root / "sparse.bin").st_blocks * 512 >= size // 2:
        pytest.skip("this file system does not keep holes")
    dest = tmp_path / "copy"
    dest.mkdir()
    copy_scan(scan_workspace(_ws(root), TORCHXIGNORE), str(dest), clone=False)
    copied = dest / "sparse.bin"
    assert copied.read_bytes() == (root / "sparse.bin").read_bytes()
    assert os.stat(copied).st_blocks * 512 < 4 << 20


@pytest.mark.parametrize("how", ["task.cancel", "cancel scope"])
async def test_a_cancelled_caller_stops_its_workspace_thread(how: str) -> None:
    """Cancelling the caller of run_in_thread (asyncio- or anyio-style) stops the worker thread at
    its next check, instead of leaving it reading (or copying) the rest of the workspace."""
    started, stopped = threading.Event(), threading.Event()

    def read_forever() -> None:
        started.set()
        try:
            deadline = time.monotonic() + 30  # bounded, should the check never raise
            while time.monotonic() < deadline:
                _check_cancelled()
                time.sleep(0.001)
        finally:
            stopped.set()

    if how == "task.cancel":
        task = asyncio.ensure_future(run_in_thread(read_forever))
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_in_thread, read_forever)
            while not started.is_set():
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    with anyio.fail_after(10):
        while not stopped.is_set():
            await anyio.sleep(0.01)


def test_concurrent_snapshots_of_one_scan_make_one_directory(tmp_path: Path) -> None:
    """Eight threads snapshotting the same content end up with one directory; exactly one made it."""
    root = _tree(tmp_path / "ws", {f"f{i}": str(i) * 1000 for i in range(50)})
    scan = scan_workspace(_ws(root), TORCHXIGNORE)
    store = tmp_path / "store"
    results: list[tuple[str, bool]] = []

    def make() -> None:
        results.append(snapshot(scan, str(store), scan.digest))

    threads = [threading.Thread(target=make) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {p for p, _ in results} == {str(store / scan.digest)}
    assert sum(made for _, made in results) == 1
    assert sorted(os.listdir(store)) == [scan.digest]


def test_a_failed_snapshot_leaves_no_directory(tmp_path: Path) -> None:
    """A snapshot whose source changed is abandoned: neither it nor its temporary directory stays."""
    root = _tree(tmp_path / "ws", {"a": "x"})
    scan = scan_workspace(_ws(root), TORCHXIGNORE)
    (root / "a").write_text("y")
    with pytest.raises(WorkspaceChangedError):
        snapshot(scan, str(tmp_path / "store"), scan.digest)
    assert os.listdir(tmp_path / "store") == []


def test_what_a_snapshot_maker_killed_midway_left_is_removed_by_the_next(tmp_path: Path) -> None:
    """The partial copy of a snapshot whose maker was SIGKILLed midway is removed when the next
    snapshot is made in that store (it stayed forever); a live maker's is left alone."""
    root = _tree(tmp_path / "ws", {"a.py": "x", "b.py": "y", "c.py": "z"})
    store = tmp_path / "store"
    code = (
        "import os, signal\n"
        "from asynctorchx.schedulers import workspace as w\n"
        "from asynctorchx.specs import Workspace\n"
        f"scan = w.scan_workspace(Workspace({{{str(root)!r}: ''}}), '.torchxignore')\n"
        "copy_entry, copied = w._copy_entry, []\n"
        "def copy_then_die(*args):\n"
        "    copy_entry(*args)\n"
        "    copied.append(args)\n"
        "    if len(copied) == 2:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "w._copy_entry = copy_then_die\n"
        f"w.snapshot(scan, {str(store)!r}, scan.digest)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    [left] = os.listdir(store)
    assert sorted(os.listdir(store / left)) == ["a.py", "b.py"]
    live = store / f".tmp-{'0' * 16}-{os.uname().nodename}-{os.getpid()}-{'0' * 8}"
    live.mkdir()  # named as a maker of this process names its directory
    snapshot(scan_workspace(_ws(root), TORCHXIGNORE), str(store), "next")
    assert sorted(os.listdir(store)) == sorted([live.name, "next"])


def test_link_tree_links_files_and_recreates_directories(tmp_path: Path) -> None:
    """link_tree hard-links each file (same inode) under fresh directories; symlinks stay symlinks."""
    src = _tree(tmp_path / "src", {"a": "a", "d/b": "b"})
    (src / "l").symlink_to("a")
    assert link_tree(str(src), str(tmp_path / "dst")) == 2
    assert (tmp_path / "dst/d/b").stat().st_ino == (src / "d/b").stat().st_ino
    assert os.readlink(tmp_path / "dst/l") == "a"


def test_link_tree_fails_on_a_directory_it_cannot_list_instead_of_leaving_it_out(
    tmp_path: Path,
) -> None:
    """A directory of the snapshot link_tree cannot list is an error naming it (os.walk left it
    out: the app ran from a tree missing its files)."""
    src = _tree(tmp_path / "src", {"a": "a", "d/b": "b"})
    (src / "d").chmod(0o000)
    code = (
        "from asynctorchx.schedulers.workspace import link_tree\n"
        f"try:\n    print(link_tree({str(src)!r}, {str(tmp_path / 'dst')!r}))\n"
        "except OSError as e:\n    print(type(e).__name__, e.filename)\n"
    )
    try:
        out = run_as_unprivileged_reader(code)
    finally:
        (src / "d").chmod(0o755)
    assert out.stdout == f"PermissionError {src / 'd'}\n", out


# -- engine helpers: repositories and registry credentials -------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "app",
        "team/app",
        "registry.example.com/team/app",
        "127.0.0.1:5000/a/b-c",
        "localhost/x__y.z",
    ],
)
def test_valid_image_repositories_are_accepted(name: str) -> None:
    """Repository names as the distribution grammar has them, with or without a registry."""
    from asynctorchx.schedulers._docker.engine import check_repository

    assert check_repository(name) == name


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("team/App", ""),
        ("reg.io/app:v1", "without a tag or digest"),
        ("app@sha256:00", "without a tag or digest"),
        ("reg.io//app", ""),
        ("", ""),
        ("reg.io/app/", ""),
    ],
)
def test_invalid_image_repositories_are_rejected_naming_the_value(name: str, hint: str) -> None:
    """A bad repository is a ValueError naming image_repo and the value (and a tag, if given one)."""
    from asynctorchx.schedulers._docker.engine import check_repository

    with pytest.raises(ValueError, match=r"image_repo must be an image repository") as err:
        check_repository(name)
    assert repr(name) in str(err.value) and hint in str(err.value)


def test_the_registry_of_a_repository_is_its_first_component_when_it_looks_like_a_host() -> None:
    """'host.tld/...', 'host:port/...' and 'localhost/...' name a registry; others are Docker Hub."""
    from asynctorchx.schedulers._docker.engine import registry_of

    assert registry_of("127.0.0.1:5000/a/b") == "127.0.0.1:5000"
    assert registry_of("ghcr.io/org/app") == "ghcr.io"
    assert registry_of("localhost/app") == "localhost"
    assert registry_of("team/app") == "docker.io" and registry_of("app") == "docker.io"


async def test_registry_credentials_come_from_the_docker_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """'auths' entries (base64 auth, username/password, identity token) are found by registry
    host, with or without a scheme; an unknown registry gets an anonymous push (None)."""
    import base64
    import json

    from asynctorchx.schedulers._docker.engine import DOCKER_HUB_AUTH_KEY, registry_auth

    config = {
        "auths": {
            "https://reg.example.com/v1/": {"auth": base64.b64encode(b"ann:pw1").decode()},
            "other.io": {"username": "bob", "password": "pw2"},
            "tok.io": {"identitytoken": "tkn"},
            DOCKER_HUB_AUTH_KEY: {"auth": base64.b64encode(b"hub:pw3").decode()},
        }
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    assert await registry_auth("reg.example.com") == {
        "username": "ann",
        "password": "pw1",
        "serveraddress": "reg.example.com",
    }
    assert (await registry_auth("other.io") or {}).get("password") == "pw2"
    assert await registry_auth("tok.io") == {"identitytoken": "tkn", "serveraddress": "tok.io"}
    assert (await registry_auth("docker.io") or {}).get("serveraddress") == DOCKER_HUB_AUTH_KEY
    assert await registry_auth("unknown.io") is None


async def test_registry_credentials_from_a_credential_helper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """credHelpers/credsStore run docker-credential-NAME get with the registry on stdin."""
    import json

    from asynctorchx.schedulers._docker.engine import registry_auth

    helper = tmp_path / "bin" / "docker-credential-fake"
    helper.parent.mkdir()
    helper.write_text(
        "#!/bin/sh\nread server\n"
        'if [ "$server" = "reg.example.com" ]; then\n'
        '  echo \'{"ServerURL": "reg.example.com", "Username": "helped", "Secret": "s"}\'\n'
        "else echo 'credentials not found in native keychain'; exit 1; fi\n"
    )
    helper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{helper.parent}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "config.json").write_text(
        json.dumps({"credHelpers": {"reg.example.com": "fake"}, "credsStore": "fake"})
    )
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    assert await registry_auth("reg.example.com") == {
        "username": "helped",
        "password": "s",
        "serveraddress": "reg.example.com",
    }
    assert await registry_auth("elsewhere.io") is None


async def test_a_credential_helper_that_never_answers_fails_the_submit_and_is_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A helper stuck (e.g. on a keyring prompt) fails after the timeout, naming it, and is
    killed: it does not outlive the submit."""
    import json

    from asynctorchx.schedulers._docker import engine

    pid_file = tmp_path / "helper.pid"
    helper = tmp_path / "bin" / "docker-credential-stuck"
    helper.parent.mkdir()
    helper.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 600\n")
    helper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{helper.parent}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "config.json").write_text(json.dumps({"credsStore": "stuck"}))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    monkeypatch.setattr(engine, "CREDENTIAL_HELPER_TIMEOUT", 0.5)
    with anyio.fail_after(20), pytest.raises(engine.DockerSchedulerError, match="did not answer"):
        await engine.registry_auth("reg.example.com")
    pid = int(pid_file.read_text())
    stat = Path(f"/proc/{pid}/stat")
    assert not stat.exists() or stat.read_text().split()[2] == "Z"  # gone, or dead and unreaped


async def test_a_broken_docker_config_is_an_error_that_quotes_no_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config file that is not JSON fails with its path and the kind of error, not its text."""
    from asynctorchx.schedulers._docker.engine import DockerSchedulerError, registry_auth

    (tmp_path / "config.json").write_text('{"auths": {"r.io": {"auth": "c2VjcmV0"}}')
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    with pytest.raises(DockerSchedulerError, match="cannot be read") as err:
        await registry_auth("r.io")
    assert "c2VjcmV0" not in str(err.value)


# -- single flight ----------------------------------------------------------------------------------


async def test_single_flight_runs_one_job_per_key_and_every_caller_hears_its_events() -> None:
    """Ten callers of one key share one run and its result; each caller's callback gets the
    events; a failure reaches every caller; a later call runs again."""
    import asyncio

    from asynctorchx._tasks import TaskSupervisor
    from asynctorchx.schedulers.workspace import SingleFlight, WorkspaceEvent

    supervisor = TaskSupervisor("test")
    flights = SingleFlight(supervisor)
    release = asyncio.Event()
    runs = 0

    async def job(report: object) -> str:
        nonlocal runs
        runs += 1
        await release.wait()
        report(WorkspaceEvent("build", "t", "done", final=True))  # type: ignore[operator]
        return "image"

    heard: list[list[WorkspaceEvent]] = [[] for _ in range(10)]
    tasks = [asyncio.ensure_future(flights.run("k", job, heard[i].append)) for i in range(10)]
    await asyncio.sleep(0)
    assert flights.in_flight("k")
    release.set()
    assert await asyncio.gather(*tasks) == ["image"] * 10
    assert runs == 1 and all(len(h) == 1 and h[0].final for h in heard)

    async def failing(report: object) -> str:
        raise RuntimeError("no")

    results = await asyncio.gather(
        *(flights.run("f", failing) for _ in range(3)), return_exceptions=True
    )
    assert [str(r) for r in results] == ["no"] * 3
    assert await flights.run("k", job) == "image" and runs == 2
    await supervisor.aclose()
