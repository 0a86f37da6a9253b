"""No orphans and no lost apps: cancelling process trees, other processes, and a launcher killed by SIGKILL."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import pytest
from _local_env import group_members, wait_for

from asynctorchx.schedulers.local import LocalScheduler
from asynctorchx.specs import AppDef, AppState, Role, is_terminal

# a replica that ignores SIGTERM, with a child that inherits that; it says when the trap is set
TERM_IGNORING_TREE = "trap '' TERM; sleep 100 & touch \"$READY/$ID\"; sleep 100"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "root"


@pytest.fixture
async def sched(root: Path) -> AsyncIterator[LocalScheduler]:
    s = LocalScheduler("owner", local_root=root)
    yield s
    await s.close()


def tree_app(ready: Path, n: int = 1) -> AppDef:
    ready.mkdir(exist_ok=True)
    return AppDef(
        "tree",
        [
            Role(
                "main",
                image="x",
                entrypoint="sh",
                args=["-c", TERM_IGNORING_TREE],
                env={"READY": str(ready), "ID": "${replica_id}"},
                num_replicas=n,
            )
        ],
    )


async def until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Polls an external condition (bounded) until it holds."""
    with anyio.fail_after(timeout):
        while not condition():
            await asyncio.sleep(0.02)
    assert condition(), what


async def replica_groups(s: LocalScheduler, app_id: str) -> list[int]:
    desc = await s.describe(app_id)
    assert desc is not None
    pids = [r.pid for rs in desc.roles_statuses for r in rs.replicas]
    assert all(pid is not None for pid in pids)
    return [pid for pid in pids if pid is not None]


async def test_cancel_kills_a_term_ignoring_tree(sched: LocalScheduler, tmp_path: Path) -> None:
    """Cancelling an app whose processes ignore SIGTERM SIGKILLs the whole group after the grace period."""
    ready = tmp_path / "ready"
    app_id = await sched.submit(tree_app(ready), {"cancel_grace_period": 0.3})
    groups = await replica_groups(sched, app_id)
    await until(lambda: (ready / "0").exists(), 10, "the trap to be set")
    assert len(group_members(groups[0])) >= 2
    with anyio.fail_after(1):
        await sched.cancel(app_id)
    desc = await wait_for(sched, app_id)
    assert desc.state == AppState.CANCELLED
    assert desc.roles_statuses[0].replicas[0].exit_code == -signal.SIGKILL
    await until(lambda: group_members(groups[0]) == [], 2, "the group to be gone")


async def test_leftover_group_members_are_killed_when_a_replica_exits(
    sched: LocalScheduler,
) -> None:
    """When a replica's main process exits, what it left running in its group is killed."""
    app_id = await sched.submit(
        AppDef("bg", [Role("main", image="x", entrypoint="sh", args=["-c", "sleep 100 & exit 0"])]),
        {},
    )
    groups = await replica_groups(sched, app_id)
    desc = await wait_for(sched, app_id)
    assert desc.state == AppState.SUCCEEDED
    await until(lambda: group_members(groups[0]) == [], 2, "the group to be gone")


OBSERVER = textwrap.dedent(
    """
    import asyncio, json, sys, time
    from asynctorchx.schedulers.local import LocalScheduler

    async def main(root, app_id):
        async with LocalScheduler("observer", local_root=root) as s:
            desc = await s.describe(app_id)
            many = await s.describe_many([app_id, "missing-app-1"])
            listed = [(a.app_id, a.state.name, a.app_handle) for a in await s.list()]
            lines = [line async for line in s.log_iter(app_id, "main", 0)]
            start = time.monotonic()
            await s.cancel(app_id)
            cancel_took = time.monotonic() - start
            print(json.dumps({
                "state": desc.state.name,
                "pids": [r.pid for r in desc.roles_statuses[0].replicas],
                "many": {k: (v.state.name if v else None) for k, v in many.items()},
                "listed": listed,
                "lines": lines,
                "cancel_took": cancel_took,
            }))

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


async def test_another_process_sees_and_cancels_an_app(
    root: Path, sched: LocalScheduler, tmp_path: Path
) -> None:
    """A second process sees the status, listing and logs of an app and cancels it, SIGKILL included."""
    ready = tmp_path / "ready"
    app = tree_app(ready)
    app.roles[0].args = ["-c", "echo hello from the app; " + TERM_IGNORING_TREE]
    app_id = await sched.submit(app, {"cancel_grace_period": 0.5})
    groups = await replica_groups(sched, app_id)
    await until(lambda: (ready / "0").exists(), 10, "the trap to be set")
    proc = await anyio.run_process([sys.executable, "-c", OBSERVER, str(root), app_id], check=False)
    assert proc.returncode == 0, proc.stderr.decode()
    seen = json.loads(proc.stdout)
    assert seen["state"] == "RUNNING"
    assert seen["pids"] == groups
    assert seen["many"] == {app_id: "RUNNING", "missing-app-1": None}
    assert (app_id, "RUNNING", f"local_cwd://owner/{app_id}") in [tuple(x) for x in seen["listed"]]
    assert seen["lines"] == ["hello from the app\n"]
    desc = await wait_for(sched, app_id)
    assert desc.state == AppState.CANCELLED
    assert desc.msg == "cancelled by another process"
    await until(lambda: group_members(groups[0]) == [], 2, "the group to be gone")


LAUNCHER = textwrap.dedent(
    """
    import asyncio, json, sys
    from asynctorchx.schedulers.local import LocalScheduler
    from asynctorchx.specs import AppDef, Role

    async def main(root, ready):
        s = LocalScheduler("doomed", local_root=root)
        role = Role("main", image="x", entrypoint="sh", args=["-c", sys.argv[3]],
                    env={"READY": ready, "ID": "${replica_id}"}, num_replicas=2)
        app_id = await s.submit(AppDef("victim", [role]), {"cancel_grace_period": 1.0})
        desc = await s.describe(app_id)
        print(json.dumps({"app_id": app_id, "pids": [r.pid for r in desc.roles_statuses[0].replicas]}),
              flush=True)
        await asyncio.Event().wait()

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


@pytest.mark.timeout(60)
async def test_sigkill_of_the_launcher_leaves_no_survivor(root: Path, tmp_path: Path) -> None:
    """If the launching process is SIGKILLed, its replica groups are gone within 10 s and the record
    says why: FAILED, the launcher died (nobody asked for the stop, so it is not CANCELLED)."""
    ready = tmp_path / "ready"
    ready.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(root), str(ready), TERM_IGNORING_TREE],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        with anyio.fail_after(20):
            line = await anyio.to_thread.run_sync(proc.stdout.readline)
        info = json.loads(line)
        await until(lambda: len(os.listdir(ready)) == 2, 10, "both traps to be set")
        assert all(len(group_members(pgid)) >= 2 for pgid in info["pids"])
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    killed_at = time.monotonic()
    await until(lambda: not any(group_members(g) for g in info["pids"]), 10, "the groups to die")
    assert time.monotonic() - killed_at < 10
    async with LocalScheduler("reader", local_root=root) as reader:
        desc = None

        async def terminal() -> bool:
            nonlocal desc
            desc = await reader.describe(info["app_id"])
            return desc is not None and is_terminal(desc.state)

        with anyio.fail_after(10):
            while not await terminal():
                await asyncio.sleep(0.02)
    assert desc is not None
    assert desc.state == AppState.FAILED
    assert "launcher" in desc.msg and "died" in desc.msg and str(proc.pid) in desc.msg


async def test_closing_one_scheduler_keeps_other_launchers_apps(
    root: Path, sched: LocalScheduler
) -> None:
    """Closing a scheduler stops only its own apps, not those another scheduler launched."""
    app_id = await sched.submit(
        AppDef("keep", [Role("main", image="x", entrypoint="sleep", args=["30"])]), {}
    )
    other = LocalScheduler("other", local_root=root)
    await other.describe(app_id)
    await other.close()
    desc = await sched.describe(app_id)
    assert desc is not None and desc.state == AppState.RUNNING
