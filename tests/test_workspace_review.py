"""Workspaces on ``local_dir``: what a review found.

- A submit cancelled while its app's directory of hard links is made left the directory for good.
- A snapshot file rewritten in place (same size) less than a second after the workspace file was
  saved passed as intact, and the next app got the rewritten bytes.
- The app's directory lost its directories' modes (0700 became 0755).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from _workspace_env import make_workspace

import asynctorchx.schedulers._local.workspace as local_workspace
from asynctorchx.runner import AsyncRunner
from asynctorchx.schedulers.workspace import link_tree
from asynctorchx.specs import AppDef, AppState, Role


def sh(name: str, script: str) -> Role:
    return Role(name, image="/tmp", entrypoint="sh", args=["-c", script])


async def run_to_end(
    runner: AsyncRunner, app: AppDef, workspace: Any
) -> tuple[AppState | None, str]:
    """Runs ``app`` on ``local_dir`` with ``workspace``: its final state and its first role's log."""
    handle = await runner.run(app, "local_dir", workspace=workspace)
    status = await runner.wait(handle, timeout=60)
    out = "".join([line async for line in runner.log_lines(handle, app.roles[0].name)])
    return (status.state if status is not None else None), out


def app_dirs(root: Path) -> set[str]:
    """The ``local_dir`` app directories under the state root ``root``."""
    base = root / "workspaces" / "apps"
    if not base.exists():
        return set()
    return {f"{s}/{a}" for s in os.listdir(base) for a in os.listdir(base / s)}


async def wait_for(event: threading.Event, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not event.is_set():
        assert time.monotonic() < deadline, f"{what} never happened"
        await asyncio.sleep(0.005)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["while it links", "as the linking ends"])
async def test_a_submit_cancelled_while_its_app_directory_is_linked_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """schedule() promises that after any error, even a cancellation, nothing of the app is left
    on disk. A submit cancelled while its worker thread linked the app's directory (a big
    workspace takes seconds) returned at once and the thread went on linking: the directory
    stayed for good. The linking is held at a gate here (mid-way, or once it is done but before
    the thread returns) while the submit is cancelled."""
    root = tmp_path / "state"
    ws = make_workspace(tmp_path / "ws", {f"d{i % 3}/f{i}.txt": "x" for i in range(60)})
    reached, release, ended = threading.Event(), threading.Event(), threading.Event()
    real_link, real_link_tree = os.link, local_workspace.link_tree
    links = [0]

    def gated_link(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if "snapshots" in str(src):
            links[0] += 1
            if links[0] == 20:  # a third of the way
                reached.set()
                release.wait(30)
        real_link(src, dst, *args, **kwargs)

    def gated_link_tree(src: str, dest: str) -> int:
        try:
            count = real_link_tree(src, dest)
            if when == "as the linking ends":
                reached.set()
                release.wait(30)
            return count
        finally:
            ended.set()

    if when == "while it links":
        monkeypatch.setattr(os, "link", gated_link)
    monkeypatch.setattr(local_workspace, "link_tree", gated_link_tree)
    app = AppDef("lk", [sh("trainer", "true")])
    async with AsyncRunner(name="ws", local_root=str(root)) as runner:
        task = asyncio.ensure_future(runner.run(app, "local_dir", workspace=str(ws)))
        await wait_for(reached, "the linking")
        assert len(app_dirs(root)) == 1  # being linked
        task.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for(ended, "the end of the linking thread")
        await asyncio.sleep(0.1)  # (a thread that went on would have linked on meanwhile)
        assert app_dirs(root) == set(), "a cancelled submit left its app directory"
        # the next submit of the workspace runs as usual
        monkeypatch.undo()
        state, _ = await run_to_end(runner, app, str(ws))
        assert state == AppState.SUCCEEDED


@pytest.mark.timeout(120)
async def test_a_snapshot_file_rewritten_in_place_within_a_second_of_the_workspace_edit_is_not_reused(
    tmp_path: Path,
) -> None:
    """A replica (as root, the read-only bits do not stop it) rewrites a file of its snapshot in
    place, same size, its time less than a second after the workspace file's: the snapshot was
    taken as intact (times were compared to the second) and the next app read the rewritten
    bytes. The rewrite is made here as a replica would, its time set 0.4 s after the workspace
    file's so that the test does not depend on how fast the first app runs."""
    root = tmp_path / "state"
    ws = make_workspace(tmp_path / "ws", {"config.txt": "original\n"})
    read = AppDef("rd", [sh("trainer", "cat config.txt")])
    async with AsyncRunner(name="ws", local_root=str(root)) as runner:
        state, out = await run_to_end(runner, read, ws)
        assert (state, out) == (AppState.SUCCEEDED, "original\n")
        [app_dir] = app_dirs(root)
        shared = root / "workspaces" / "apps" / app_dir / "config.txt"  # a link to the snapshot's
        saved = os.stat(ws / "config.txt").st_mtime_ns
        mode = os.stat(shared).st_mode
        os.chmod(shared, 0o644)
        with open(shared, "r+b") as f:
            f.write(b"ORIGINAL\n")
        os.chmod(shared, mode)
        os.utime(shared, ns=(saved + 400_000_000, saved + 400_000_000))
        state, out = await run_to_end(runner, read, ws)
        assert (ws / "config.txt").read_text() == "original\n"
        assert (state, out) == (AppState.SUCCEEDED, "original\n"), f"the next app read {out!r}"


@pytest.mark.timeout(120)
async def test_a_local_dir_app_sees_the_workspace_directory_modes(tmp_path: Path) -> None:
    """The app's directory of links was made with os.mkdir's default mode: a 0700 workspace
    directory (0700 in the snapshot too) was 0755 to the replica, while files kept their modes."""
    root = tmp_path / "state"
    ws = make_workspace(tmp_path / "ws", {"priv/key.txt": "k", "pub/a.txt": "a"})
    os.chmod(ws / "priv", 0o700)
    os.chmod(ws / "pub", 0o750)
    async with AsyncRunner(name="ws", local_root=str(root)) as runner:
        app = AppDef("m", [sh("trainer", "stat -c %a priv pub")])
        state, out = await run_to_end(runner, app, ws)
        assert (state, out) == (AppState.SUCCEEDED, "700\n750\n")


@pytest.mark.timeout(120)
def test_link_tree_gives_a_directory_without_write_permission_its_mode_once_it_is_linked(
    tmp_path: Path,
) -> None:
    """A source directory whose mode lacks the owner's write bit is still linked whole (its mode
    is set after its contents are linked), and keeps that mode."""
    src = tmp_path / "src"
    (src / "ro" / "deep").mkdir(parents=True)
    (src / "ro" / "deep" / "f").write_text("x")
    (src / "ro" / "g").write_text("y")
    os.chmod(src / "ro" / "deep", 0o500)
    os.chmod(src / "ro", 0o550)
    dest = tmp_path / "dest"
    try:
        assert link_tree(str(src), str(dest)) == 2
        assert (dest / "ro" / "deep" / "f").read_text() == "x"
        assert oct(os.stat(dest / "ro").st_mode & 0o7777) == oct(0o550)
        assert oct(os.stat(dest / "ro" / "deep").st_mode & 0o7777) == oct(0o500)
    finally:
        for d in (src / "ro", src / "ro" / "deep", dest / "ro", dest / "ro" / "deep"):
            if d.exists():
                os.chmod(d, 0o700)
