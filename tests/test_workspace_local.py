"""Workspaces on the local backends, with real processes: local_cwd runs the replicas in the
workspace itself; local_dir runs the first role from a snapshot taken at submit time."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from _fake_scheduler import FakeScheduler
from _local_env import tiny_tmpfs
from _workspace_env import make_workspace

from asynctorchx.runner import AsyncRunner
from asynctorchx.schedulers.api import WorkspaceNotSupportedException
from asynctorchx.schedulers.workspace import WorkspaceCopyError, WorkspaceEvent
from asynctorchx.specs import AppDef, AppState, InvalidWorkspaceException, Role

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
async def runner(root: Path) -> AsyncIterator[AsyncRunner]:
    """A runner whose local backends keep their state (and snapshots) under ``root``."""
    async with AsyncRunner(name="ws", local_root=str(root)) as r:
        yield r


def sh(name: str, script: str, image: str = "/tmp") -> Role:
    return Role(name, image=image, entrypoint="sh", args=["-c", script])


async def run_to_end(
    runner: AsyncRunner, app: AppDef, scheduler: str, workspace: Any, **kw: Any
) -> tuple[str, dict[str, str]]:
    """Runs the app; returns its handle and each role's stdout (it must succeed)."""
    handle = await runner.run(app, scheduler, workspace=workspace, **kw)
    status = await runner.wait(handle, timeout=60)
    out: dict[str, str] = {}
    for r in app.roles:
        out[r.name] = "".join([x async for x in runner.log_lines(handle, r.name)])
    assert status is not None and status.state == AppState.SUCCEEDED, out
    return handle, out


def snapshots(root: Path) -> list[str]:
    d = root / "workspaces" / "snapshots"
    return sorted(os.listdir(d)) if d.exists() else []


async def test_local_cwd_runs_every_role_in_the_workspace_directory(
    runner: AsyncRunner, tmp_path: Path
) -> None:
    """Every replica of every role starts in the workspace and reads its files; nothing is copied."""
    ws = make_workspace(tmp_path / "ws", {"data.txt": "from the workspace"})
    app = AppDef("cwd", [sh("a", "pwd; cat data.txt"), sh("b", "pwd; cat data.txt")])
    _, out = await run_to_end(runner, app, "local_cwd", str(ws))
    assert out == dict.fromkeys(("a", "b"), f"{ws}\nfrom the workspace")
    assert snapshots(tmp_path / "state") == []


async def test_local_dir_runs_the_first_role_from_a_snapshot_taken_at_submit(
    runner: AsyncRunner, root: Path, tmp_path: Path
) -> None:
    """Edited in place after submit, the workspace's file still reads as submitted in the app;
    the second role keeps its own image directory."""
    ws = make_workspace(tmp_path / "ws", {"data.txt": "submitted"})
    flag = tmp_path / "go"
    wait = f'while [ ! -e "{flag}" ]; do sleep 0.05; done'
    app = AppDef(
        "snap", [sh("trainer", f"{wait}; cat data.txt"), sh("ps", "pwd", image=str(tmp_path))]
    )
    handle = await runner.run(app, "local_dir", workspace=str(ws))
    with open(ws / "data.txt", "r+") as f:  # in place, as an editor that truncates and rewrites
        f.truncate(0)
        f.write("edited after submit")
    flag.touch()
    status = await runner.wait(handle, timeout=60)
    assert status is not None and status.state == AppState.SUCCEEDED
    trainer = "".join([x async for x in runner.log_lines(handle, "trainer")])
    ps = "".join([x async for x in runner.log_lines(handle, "ps")])
    assert trainer == "submitted" and ps == f"{tmp_path}\n"
    _, again = await run_to_end(
        runner, AppDef("snap", [sh("trainer", "cat data.txt")]), "local_dir", str(ws)
    )
    assert again["trainer"] == "edited after submit"
    assert len(snapshots(root)) == 2


async def test_apps_of_one_workspace_share_a_snapshot_and_keep_their_writes_apart(
    runner: AsyncRunner, root: Path, tmp_path: Path
) -> None:
    """Two apps of one workspace: one snapshot, two directories of links to it; what the first
    writes in its directory the second does not see."""
    ws = make_workspace(tmp_path / "ws", {"data.txt": "d"})
    writer = AppDef("w", [sh("trainer", "pwd; echo mine > out.txt; ls")])
    reader = AppDef(
        "r", [sh("trainer", "pwd; if [ -e out.txt ]; then echo seen; else echo unseen; fi")]
    )
    _, out1 = await run_to_end(runner, writer, "local_dir", str(ws))
    _, out2 = await run_to_end(runner, reader, "local_dir", str(ws))
    cwd1, cwd2 = out1["trainer"].split("\n")[0], out2["trainer"].split("\n")[0]
    assert cwd1 != cwd2 and out2["trainer"].endswith("unseen\n")
    [snap] = snapshots(root)
    shared = (root / "workspaces" / "snapshots" / snap / "data.txt").stat().st_ino
    assert Path(cwd1, "data.txt").stat().st_ino == Path(cwd2, "data.txt").stat().st_ino == shared
    assert not os.access(Path(cwd1, "data.txt"), os.W_OK) or os.getuid() == 0
    assert (Path(cwd1, "data.txt").stat().st_mode & 0o222) == 0


async def test_twenty_concurrent_local_dir_submits_make_one_snapshot(
    runner: AsyncRunner, root: Path, tmp_path: Path
) -> None:
    """20 apps submitted at once from one workspace: one snapshot made, no partial one left."""
    ws = make_workspace(tmp_path / "ws", {f"f{i}.txt": str(i) * 100 for i in range(30)})
    app = AppDef("many", [sh("trainer", "cat f7.txt")])
    made: list[WorkspaceEvent] = []
    handles = await asyncio.gather(
        *(runner.run(app, "local_dir", workspace=str(ws), progress=made.append) for _ in range(20))
    )
    done = await runner.wait_all(handles, timeout=60)
    assert {s.state for s in done.values() if s is not None} == {AppState.SUCCEEDED}
    assert len(snapshots(root)) == 1
    finals = [e for e in made if e.final]
    assert len(finals) == 20 and sum(not e.cached for e in finals) == 1


@pytest.mark.parametrize("inside", ["state_root", "log_dir"])
async def test_a_state_root_or_log_dir_inside_the_workspace_is_not_snapshotted(
    tmp_path: Path, inside: str
) -> None:
    """With the state root (or log_dir) inside the workspace, a second submit ships the same files
    as the first: not the first app's logs, records and snapshot (which would grow each time)."""
    ws = make_workspace(tmp_path / "ws", {"train.py": "print(1)"})
    root = ws / ".state" if inside == "state_root" else tmp_path / "state"
    cfg = {"log_dir": str(ws / "logs")} if inside == "log_dir" else {}
    app = AppDef("in", [sh("trainer", "ls -A")])
    async with AsyncRunner(name="ws", local_root=str(root)) as runner:
        first = runner.dryrun(app, "local_dir", cfg, workspace=str(ws)).workspace
        _, out = await run_to_end(runner, app, "local_dir", str(ws), cfg=cfg)
        second = runner.dryrun(app, "local_dir", cfg, workspace=str(ws)).workspace
    assert first is not None and second is not None
    assert out["trainer"].split() == [".nonce", "train.py"]
    assert second.content_hash == first.content_hash and second.files == 2
    assert len(snapshots(root)) == 1


@pytest.mark.parametrize("which", ["state_root", "log_dir"])
async def test_a_workspace_that_is_the_state_root_or_log_dir_is_refused_naming_it(
    tmp_path: Path, which: str
) -> None:
    """A workspace that is the state root (or log_dir) itself fails the dry run naming it (it was
    snapshotted with the logs of running apps, or failed saying "submit again" every time)."""
    root, logs = tmp_path / "state", tmp_path / "logs"
    cfg = {"log_dir": str(logs)}
    app = AppDef("self", [sh("trainer", "echo hi")])
    async with AsyncRunner(name="ws", local_root=str(root)) as runner:
        handle = await runner.run(app, "local_dir", cfg)
        await runner.wait(handle, timeout=60)
        ws = root if which == "state_root" else logs
        with pytest.raises(
            InvalidWorkspaceException,
            match=rf"workspace directory '{ws}' is where the backend keeps its own state",
        ):
            runner.dryrun(app, "local_dir", cfg, workspace=str(ws))
    assert snapshots(root) == []


async def test_a_snapshot_file_a_replica_rewrote_in_place_is_not_shipped_again(
    runner: AsyncRunner, root: Path, tmp_path: Path
) -> None:
    """When a replica rewrites a file of its snapshot in place (as root, or after chmod u+w), the
    next app of the unchanged workspace still gets the workspace's bytes (it got the rewritten
    file: the snapshot's content hash named bytes it no longer held)."""
    ws = make_workspace(tmp_path / "ws", {"config.txt": "original\n"})
    rewrite = "cat config.txt; chmod u+w config.txt; echo rewritten > config.txt"
    _, out = await run_to_end(runner, AppDef("rw", [sh("trainer", rewrite)]), "local_dir", ws)
    assert out["trainer"] == "original\n"
    read = AppDef("rd", [sh("trainer", "cat config.txt; ls -l config.txt")])
    _, out = await run_to_end(runner, read, "local_dir", ws)
    assert out["trainer"].startswith("original\n-r--r--r--"), out
    assert len(snapshots(root)) == 1


async def test_local_dir_snapshots_honour_torchxignore(runner: AsyncRunner, tmp_path: Path) -> None:
    """What .torchxignore excludes is not in the snapshot the app runs from."""
    ws = make_workspace(
        tmp_path / "ws",
        {"keep.py": "", "out/big.bin": "x", ".torchxignore": "out/\n*.log\n", "a.log": ""},
    )
    script = 'for f in keep.py out/big.bin a.log; do if [ -e "$f" ]; then echo "present $f"; else echo "absent $f"; fi; done'
    _, out = await run_to_end(runner, AppDef("ign", [sh("trainer", script)]), "local_dir", str(ws))
    assert out["trainer"] == "present keep.py\nabsent out/big.bin\nabsent a.log\n"


async def test_a_multi_project_workspace_maps_projects_on_local_dir_only(
    runner: AsyncRunner, tmp_path: Path
) -> None:
    """local_dir lays projects out by their sub-directories; local_cwd refuses several projects."""
    app_dir = make_workspace(tmp_path / "app", {"main.sh": "cat vendor/lib/util.txt\n"})
    lib = make_workspace(tmp_path / "lib", {"util.txt": "from lib"})
    ws = f"{app_dir}:,{lib}:vendor/lib"
    _, out = await run_to_end(
        runner, AppDef("multi", [sh("trainer", "sh main.sh")]), "local_dir", ws
    )
    assert out["trainer"] == "from lib"
    with pytest.raises(InvalidWorkspaceException, match="must be one directory"):
        runner.dryrun(AppDef("multi", [sh("trainer", "true")]), "local_cwd", workspace=ws)


async def test_the_local_dir_dry_run_shows_the_snapshot_and_makes_nothing(
    runner: AsyncRunner, root: Path, tmp_path: Path
) -> None:
    """The dry run names the snapshot directory, its files, size and hash; nothing is created."""
    ws = make_workspace(tmp_path / "ws", {"a.txt": "x" * 1000}, nonce=False)
    info = runner.dryrun(AppDef("d", [sh("trainer", "true")]), "local_dir", workspace=str(ws))
    plan = info.workspace
    text = str(info)
    assert f"target: {root}/workspaces/snapshots/{plan.content_hash}" in text
    assert "files: 1 (1.0 kB), ignore file: .torchxignore" in text
    assert info.request.roles[0].replicas[0].cwd.startswith(f"{root}/workspaces/apps/ws/")
    assert not (root / "workspaces").exists()


@pytest.mark.parametrize("scheduler", ["local_cwd", "local_dir"])
@pytest.mark.parametrize("kind", ["missing", "a-file"])
async def test_a_missing_or_file_workspace_fails_before_any_replica(
    runner: AsyncRunner, root: Path, tmp_path: Path, scheduler: str, kind: str
) -> None:
    """A workspace that does not exist, or is a file, is an error naming it; nothing starts."""
    path = tmp_path / "nope"
    if kind == "a-file":
        path.write_text("x")
    with pytest.raises(InvalidWorkspaceException, match=str(path)):
        await runner.run(AppDef("bad", [sh("trainer", "true")]), scheduler, workspace=str(path))
    assert await runner.list(scheduler) == []
    assert not (root / "ws").exists()


@pytest.mark.parametrize("scheduler", ["local_cwd", "local_dir"])
async def test_a_directory_whose_name_holds_a_colon_fails_saying_to_give_a_file_url(
    runner: AsyncRunner, tmp_path: Path, scheduler: str
) -> None:
    """runs/exp-10:30 (read as runs/exp-10 going to 30/) fails the dry run naming the file:// URL
    to give instead (it said runs/exp-10 does not exist, or that it was not one directory), and
    that URL runs."""
    exp = make_workspace(tmp_path / "runs" / "exp-10:30", {"a.py": ""}, nonce=False)
    url = "file://" + str(exp).replace(":", "%3A")
    app = AppDef("colon", [sh("trainer", "ls")])
    with pytest.raises(InvalidWorkspaceException) as info:
        runner.dryrun(app, scheduler, workspace=str(exp))
    assert f"workspace '{exp}' is a directory, but is read as DIR:SUBDIR" in str(info.value)
    assert f"give it as {url} " in str(info.value)
    _, out = await run_to_end(runner, app, scheduler, url)
    assert out["trainer"] == "a.py\n"


@pytest.mark.parametrize("scheduler", ["local_cwd", "local_dir"])
@pytest.mark.parametrize(
    ("made", "given"),
    [(["ws", "ws:30"], "ws:30"), (["exp", "v2", "exp,v2"], "exp,v2")],
)
async def test_a_workspace_string_naming_a_directory_read_otherwise_is_refused(
    runner: AsyncRunner, tmp_path: Path, scheduler: str, made: list[str], given: str
) -> None:
    """Through the API too, 'ws:30' or 'exp,v2' naming an existing directory is refused naming
    its file:// URL even when the other reading exists (ws went to 30/, exp and v2 were merged,
    silently: another directory than the one named was shipped); nothing starts."""
    for d in made:
        make_workspace(tmp_path / d, {f"{d}.txt": ""}, nonce=False)
    app = AppDef("named", [sh("trainer", "ls")])
    with pytest.raises(InvalidWorkspaceException, match="file://"):
        await runner.run(app, scheduler, workspace=str(tmp_path / given))
    assert await runner.list(scheduler) == []


async def test_a_scheduler_without_workspaces_refuses_one_naming_itself(tmp_path: Path) -> None:
    """A backend that did not opt in raises WorkspaceNotSupportedException naming it, not a silent
    drop; without a workspace its two-argument dry run is unchanged."""
    fake = FakeScheduler("s")
    async with AsyncRunner(name="s", scheduler_factories={"fake": lambda s, **_: fake}) as r:
        app = AppDef("x", [sh("trainer", "true")])
        with pytest.raises(
            WorkspaceNotSupportedException, match="the fake scheduler does not support workspaces"
        ):
            await r.run(app, "fake", workspace=str(tmp_path))
        with pytest.raises(WorkspaceNotSupportedException, match="fake"):
            r.dryrun(app, "fake", workspace=str(tmp_path))
        assert fake.submit_dryrun(app, {}).request.name == "x"
        assert r.dryrun(app, "fake", workspace="").workspace is None


async def test_run_reads_the_workspace_off_the_event_loop(
    runner: AsyncRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run() plans (walks and hashes) the workspace in a worker thread, not on the loop's."""
    from asynctorchx.schedulers._local import workspace as local_workspace

    threads: list[threading.Thread] = []
    real = local_workspace.plan_local

    def recording(*args: Any) -> Any:
        threads.append(threading.current_thread())
        return real(*args)

    monkeypatch.setattr(local_workspace, "plan_local", recording)
    ws = make_workspace(tmp_path / "ws", {"a": ""})
    await run_to_end(runner, AppDef("t", [sh("trainer", "true")]), "local_dir", str(ws))
    assert threads and threading.main_thread() not in threads


async def test_a_failed_local_dir_start_leaves_no_workspace_directory(
    runner: AsyncRunner, root: Path, tmp_path: Path
) -> None:
    """An app whose start fails after its workspace was linked (its entrypoint does not exist)
    leaves no per-app directory behind."""
    from asynctorchx.schedulers._local.procs import LaunchSpecError

    ws = make_workspace(tmp_path / "ws", {"data.txt": "x"})
    app = AppDef("bad", [Role("trainer", image="/tmp", entrypoint="./no-such-program")])
    with pytest.raises(LaunchSpecError, match="no-such-program"):
        await runner.run(app, "local_dir", workspace=str(ws))
    session_dir = root / "workspaces" / "apps" / "ws"
    assert not session_dir.exists() or not any(session_dir.iterdir()), list(session_dir.iterdir())


async def test_a_snapshot_that_does_not_fit_the_disk_fails_naming_it_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    """A local_dir snapshot that does not fit the state root's disk fails the submit with
    WorkspaceCopyError naming the snapshot and the file (it was a bare "[Errno 28] No space left
    on device"); no snapshot, app directory or app is left."""
    ws = make_workspace(tmp_path / "ws", {"main.py": "print(1)\n", "data.bin": os.urandom(3 << 20)})
    with tiny_tmpfs(tmp_path / "fs", "1m") as fs:
        root = fs / "state"
        async with AsyncRunner(name="ws", local_root=str(root)) as runner:
            app = AppDef("full", [sh("main", "true")])
            with pytest.raises(WorkspaceCopyError) as info:
                await runner.run(app, "local_dir", workspace=str(ws))
            store = root / "workspaces" / "snapshots"
            assert info.value.errno == errno.ENOSPC
            assert f"into '{store}/" in str(info.value)
            assert str(info.value).endswith(": No space left on device (writing 'data.bin')")
            assert os.listdir(store) == []
            assert not (root / "workspaces" / "apps").exists() or not any(
                files for _, _, files in os.walk(root / "workspaces" / "apps")
            )
            assert await runner.list("local_dir") == []
