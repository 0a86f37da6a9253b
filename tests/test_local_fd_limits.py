"""The local backend at the process's descriptor limit (found by review): a replica's daemons must
not outlive its app when the app is stopped, or its submit undone, while no descriptor is left to
open the cgroup's files with (one is kept in reserve for that; a cgroup that cannot be read is
taken as populated and killed, never as empty)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest

# the processes carrying the test's token (ATX=...) that are not zombies, in the child scripts
MINE = textwrap.dedent(
    """
    import os

    def mine(tok):
        out = []
        for p in os.listdir("/proc"):
            if p.isdigit():
                try:
                    env = open(f"/proc/{p}/environ", "rb").read().split(b"\\0")
                    st = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0]
                except OSError:
                    continue
                if f"ATX={tok}".encode() in env and st not in "ZX":
                    out.append(int(p))
        return out
    """
)

SCRIPT = MINE + textwrap.dedent(
    """
    import asyncio, json, os, resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
    from asynctorchx.schedulers.local import LocalScheduler
    from asynctorchx.specs import AppDef, Role
    root, tok = sys.argv[1], sys.argv[2]


    async def main():
        async with LocalScheduler("s", local_root=root) as s:
            app = AppDef("a", [Role("main", image=".", entrypoint="sh",
                                    args=["-c", "setsid sleep 1000 & exec sleep 1000"],
                                    env={"ATX": tok})])
            a = await s.submit(app, {"cancel_grace_period": 0.5})
            def in_cgroup(pid):
                try:
                    return "/asynctorchx-" in open(f"/proc/{pid}/cgroup").read()
                except OSError:
                    return False

            # both the replica and its daemon run, moved into the replica's cgroup (cgroup mode)
            while len(m := mine(tok)) < 2 or (
                s.containment == "cgroup" and not all(in_cgroup(p) for p in m)
            ):
                await asyncio.sleep(0.05)
            # the process is at its descriptor limit (log readers, sockets...) for a moment
            held = []
            try:
                while True:
                    held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                pass
            await s.cancel(a)
            while (d := await s.describe(a)).state.name not in ("CANCELLED", "FAILED"):
                await asyncio.sleep(0.1)
            for fd in held:
                os.close(fd)
            terminal_left = mine(tok)
            for _ in range(50):  # (bounded: a survivor fails the test after 5 s)
                if not terminal_left:
                    break
                await asyncio.sleep(0.1)
                terminal_left = mine(tok)
        print(json.dumps({"state": d.state.name, "left": terminal_left, "after_close": mine(tok),
                          "mode": s.containment}))

    asyncio.run(main())
    """
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cgroups", ["1", "0"])
def test_no_survivor_when_an_app_is_stopped_at_the_descriptor_limit(
    tmp_path: Path, cgroups: str
) -> None:
    """The process has no descriptor left while it cancels an app whose replica started a setsid
    daemon: the app ends CANCELLED with nothing left (with cgroups, the daemon survived: the
    cgroup's events could not be opened, which was read as "empty", so nothing was killed)."""
    tok = uuid.uuid4().hex
    env = dict(os.environ, ASYNCTORCHX_LOCAL_CGROUPS=cgroups)
    if cgroups == "1":
        env.pop("ASYNCTORCHX_LOCAL_CGROUPS")
    try:
        out, stderr = _run(SCRIPT, tmp_path / "root", tok, env)
        assert out["state"] == "CANCELLED"
        # no survivor: the setsid'd daemon must be gone once the app is terminal
        assert out["left"] == [] and out["after_close"] == [], (out, stderr[-600:])
    finally:
        _kill_token(tok)


MIDLAUNCH = MINE + textwrap.dedent(
    """
    import asyncio, json, os, resource, sys, time
    resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))
    from asynctorchx.schedulers.local import LocalScheduler
    from asynctorchx.specs import AppDef, Role
    root, tok = sys.argv[1], sys.argv[2]


    async def main():
        async with LocalScheduler("s", local_root=root) as s:
            await s.submit(AppDef("w", [Role("main", image=".", entrypoint="true")]), {})
            held = []

            def daemons():  # the replicas' setsid'd children (their parent is not us)
                n = 0
                for pid in mine(tok):
                    try:
                        ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
                    except OSError:
                        continue
                    n += ppid != os.getpid()
                return n

            async def grab():  # other code takes every descriptor while the app still spawns,
                while daemons() < 3:  # once a few replicas have started their daemons
                    await asyncio.sleep(0)
                try:
                    while True:
                        held.append(os.open(os.devnull, os.O_RDONLY))
                except OSError:
                    pass

            g = asyncio.create_task(grab())
            app = AppDef("a", [Role("main", image=".", entrypoint="sh",
                                    args=["-c", "setsid sleep 1000 & exec sleep 1000"],
                                    num_replicas=200, env={"ATX": tok})])
            try:
                await s.submit(app, {})
                error = None
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
            await g
            for fd in held:
                os.close(fd)
            left = mine(tok)  # (the submit raised: nothing of it may be left)
            listed = [(x.app_id, x.state.name) for x in await s.list()]
        print(json.dumps({"error": error, "left": left, "list": listed}))

    asyncio.run(main())
    """
)


@pytest.mark.timeout(60)
def test_a_launch_failed_by_emfile_midway_leaves_no_process(tmp_path: Path) -> None:
    """Other code of the process takes the last descriptors while a 200-replica app spawns: the
    submit fails clearly (EMFILE, `ulimit -n`) and its undo leaves nothing running (it could not
    open cgroup.kill and left the replicas' setsid'd children running)."""
    tok = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != "ASYNCTORCHX_LOCAL_CGROUPS"}
    try:
        out, _ = _run(MIDLAUNCH, tmp_path / "root", tok, env)
        assert out["error"] and "file descriptors" in out["error"], out
        assert [a for a, _ in out["list"] if a.startswith("a-")] == []
        assert out["left"] == [], f"{len(out['left'])} processes of the failed submit left: {out}"
    finally:
        _kill_token(tok)


def _kill_token(tok: str) -> None:
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if f"ATX={tok}".encode() in Path(f"/proc/{p}/environ").read_bytes():
                    os.kill(int(p), signal.SIGKILL)
            except OSError:
                pass


def _run(script: str, root: Path, tok: str, env: dict[str, str]) -> tuple[dict[str, Any], str]:
    """Runs a child script with ``root`` and ``tok``; its JSON line and its stderr."""
    proc = subprocess.run(
        [sys.executable, "-c", script, str(root), tok],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


WAIT_EMPTY = MINE + textwrap.dedent(
    """
    import asyncio, json, os, resource, subprocess, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
    from asynctorchx._tasks import TaskSupervisor
    from asynctorchx.schedulers._local import contain
    from asynctorchx.schedulers._local.guard import Containment
    root, tok = sys.argv[1], sys.argv[2]


    async def main():
        guard = Containment(TaskSupervisor("t"))
        guard.probe()
        if guard.base is None:
            print(json.dumps({"mode": "marker"}))
            return
        cg = guard.app_dir("a-" + tok[:8])
        await guard.prepare([cg])
        proc = subprocess.Popen(["sleep", "1000"], env=dict(os.environ, ATX=tok))
        contain.move(cg, proc.pid)
        # no descriptor left, and the guard has not made its epoll yet (its first wait)
        held = []
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        try:
            fut = guard.wait_empty(cg)
            error = None
        except OSError as e:
            fut, error = None, repr(e)
        early = fut is not None and fut.done()
        contain.kill(cg)
        for fd in held:  # (the descriptors come back: the wait must still end)
            os.close(fd)
        emptied = False
        if fut is not None:
            try:
                await asyncio.wait_for(fut, 10)
                emptied = True
            except asyncio.TimeoutError:
                pass
        proc.wait()
        await guard.aclose()
        print(json.dumps({"mode": "cgroup", "error": error, "early": early, "emptied": emptied}))

    asyncio.run(main())
    """
)


@pytest.mark.timeout(60)
def test_waiting_for_a_cgroup_to_empty_with_no_descriptor_left(tmp_path: Path) -> None:
    """The first wait for a cgroup to empty comes when the process has no descriptor left: the
    cgroup's events file takes the reserved one, so the epoll to be told with cannot be made (this
    raised EMFILE out of the app's supervision, in CI, and the cancelled app never ended); the wait
    must still end once the cgroup is empty, and not before."""
    tok = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != "ASYNCTORCHX_LOCAL_CGROUPS"}
    try:
        out, stderr = _run(WAIT_EMPTY, tmp_path / "root", tok, env)
        if out["mode"] == "marker":
            pytest.fail(f"no cgroup v2 delegation here: {stderr[-400:]}")
        assert out["error"] is None, out
        assert not out["early"], "the wait ended while the cgroup was still populated"
        assert out["emptied"], out
    finally:
        _kill_token(tok)
