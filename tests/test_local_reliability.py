"""Fault injection on the local backends (issue 12): killed launchers and watchdogs, escaping
daemons, signals, bad input, file descriptor limits, full disks, mass exits. Real processes; every
wait is bounded and every test cleans up what it started."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import math
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from _local_env import GATE, tiny_tmpfs, wait_for
from conftest import engine_missing

from asynctorchx.schedulers._local import recordfile
from asynctorchx.schedulers._local import records as records_module
from asynctorchx.schedulers.api import Stream
from asynctorchx.schedulers.local import LaunchError, LocalScheduler
from asynctorchx.specs import (
    AppDef,
    AppState,
    InvalidAppDefException,
    InvalidRunConfigException,
    Role,
    is_terminal,
)

# -- helpers -------------------------------------------------------------------------------------


def _stat(pid: str) -> list[str] | None:
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return data.rsplit(")", 1)[1].split()


_PF_KTHREAD = 0x00200000


def _environ(pid: str) -> bytes | None:
    """``/proc/{pid}/environ``, or None once the process is gone.

    A process in the middle of an ``execve`` reads as an empty environment for a moment (the new
    image's strings are in place, their addresses not yet): an empty read of a process that is not
    a kernel thread is read again, so a daemon caught mid-exec is not missed.
    """
    for _ in range(200):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            return None
        if env:
            return env
        fields = _stat(pid)
        if fields is None or fields[0] in ("Z", "X") or int(fields[6]) & _PF_KTHREAD:
            return env
        time.sleep(0.001)
    return b""


def token_procs(token: str) -> list[int]:
    """The live (non-zombie) processes whose environment has ``ATX_TOKEN={token}``."""
    found = []
    needle = f"ATX_TOKEN={token}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        env = _environ(name)
        if env is not None and needle in env.split(b"\0"):
            fields = _stat(name)
            if fields is not None and fields[0] not in ("Z", "X"):
                found.append(int(name))
    return found


def kill_token_procs(token: str) -> None:
    for pid in token_procs(token):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


async def until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Polls an external condition (bounded) until it holds."""
    try:
        with anyio.fail_after(timeout):
            while not condition():
                await asyncio.sleep(0.02)
    except TimeoutError:
        pytest.fail(f"timed out after {timeout} s waiting for {what}")


def python_app(name: str, script: str, env: dict[str, str]) -> AppDef:
    """An app of one replica running ``script`` with this Python."""
    role = Role("main", image="x", entrypoint=sys.executable, args=["-c", script], env=env)
    return AppDef(name, [role])


def read_record(root: Path, app_id: str) -> dict[str, Any] | None:
    try:
        return recordfile.read_document(root / ".apps" / f"{app_id}.json")  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


def record_ids(root: Path) -> list[str]:
    try:
        names = os.listdir(root / ".apps")
    except FileNotFoundError:
        return []
    return [n[:-5] for n in names if n.endswith(".json") and not n.startswith(".")]


def cgroups_usable() -> bool:
    from asynctorchx.schedulers._local import contain

    base = contain.make_base()
    if base is None:
        return False
    contain.remove_tree(base)
    return True


@pytest.fixture(params=["cgroup", "marker"])
def containment(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs the test in cgroup mode (required where the machine offers cgroups) and marker mode."""
    mode: str = request.param
    if mode == "cgroup":
        monkeypatch.delenv("ASYNCTORCHX_LOCAL_CGROUPS", raising=False)
        if not cgroups_usable():
            engine_missing("a writable cgroup v2 hierarchy")
    else:
        monkeypatch.setenv("ASYNCTORCHX_LOCAL_CGROUPS", "0")
    return mode


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "root"


@pytest.fixture
async def sched(root: Path) -> AsyncIterator[LocalScheduler]:
    s = LocalScheduler("rel", local_root=root)
    yield s
    await s.close()


@pytest.fixture
def token() -> Iterator[str]:
    """A unique value the test's processes carry in ``ATX_TOKEN``; leftovers are killed after."""
    value = uuid.uuid4().hex
    yield value
    kill_token_procs(value)


LAUNCHER = textwrap.dedent(
    """
    import asyncio, json, sys
    from asynctorchx.schedulers._local import guard
    from asynctorchx.schedulers.local import LocalScheduler
    from asynctorchx.specs import AppDef, Role

    async def main(root, spec):
        spec = json.loads(spec)
        if "watchdog_max_grace" in spec:
            guard.WATCHDOG_MAX_GRACE = spec["watchdog_max_grace"]
        s = LocalScheduler("doomed", local_root=root)
        role = Role("main", image="x", entrypoint=spec["entrypoint"], args=spec["args"],
                    env=spec["env"], num_replicas=spec["n"])
        app_id = await s.submit(AppDef("victim", [role]), {"cancel_grace_period": spec["grace"]})
        desc = await s.describe(app_id)
        print(json.dumps({"app_id": app_id, "watchdog": s.watchdog_pid,
                          "pids": [r.pid for r in desc.roles_statuses[0].replicas]}), flush=True)
        await asyncio.Event().wait()

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


def launcher_argv(root: Path, spec: dict[str, Any]) -> list[str]:
    spec = {"grace": 1.0, "env": {}, "args": [], "n": 1, **spec}
    return [sys.executable, "-c", LAUNCHER, str(root), json.dumps(spec)]


async def read_json_line(proc: subprocess.Popen[str], timeout: float = 30) -> dict[str, Any]:
    assert proc.stdout is not None
    with anyio.fail_after(timeout):
        line = await anyio.to_thread.run_sync(proc.stdout.readline)
    assert line, "the launcher exited before reporting its app"
    return json.loads(line)  # type: ignore[no-any-return]


def sigkill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()


async def terminal_record(root: Path, app_id: str, timeout: float) -> dict[str, Any]:
    found: dict[str, Any] = {}

    def terminal() -> bool:
        doc = read_record(root, app_id)
        if doc is not None and doc.get("state") in ("SUCCEEDED", "FAILED", "CANCELLED"):
            found.update(doc)
            return True
        return False

    await until(terminal, timeout, f"the record of {app_id} to be terminal")
    return found


# -- 1, 2, 4: the launcher or its watchdog dies ---------------------------------------------------


@pytest.mark.timeout(120)
async def test_sigkill_during_a_big_start_leaves_no_replica(root: Path, token: str) -> None:
    """SIGKILL of the launcher while it starts 400 replicas: none survives, and the app's record
    ends FAILED saying the launcher died."""
    n = 400
    proc = subprocess.Popen(
        launcher_argv(
            root, {"entrypoint": "sleep", "args": ["1000"], "n": n, "env": {"ATX_TOKEN": token}}
        ),
        stdout=subprocess.PIPE,
        text=True,
    )
    seen = 0
    try:

        def started() -> bool:
            nonlocal seen
            seen = len(token_procs(token))
            return seen >= 20

        await until(started, 60, "the start to be under way")
    finally:
        sigkill(proc)
    assert seen < n, "the start was over before the launcher was killed"
    await until(lambda: not token_procs(token), 30, "every replica to be gone")
    await until(lambda: bool(record_ids(root)), 30, "the app's record")
    (app_id,) = record_ids(root)
    doc = await terminal_record(root, app_id, 30)
    assert doc["state"] == "FAILED"
    assert f"launcher (pid {proc.pid}) died" in doc["msg"]
    assert not token_procs(token)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("cgroups", ["1", "0"], ids=["cgroup", "marker"])
async def test_a_cancel_stops_what_an_app_lost_with_its_launcher_and_watchdog_left(
    root: Path, token: str, cgroups: str
) -> None:
    """Launcher and watchdog SIGKILLed together; the replica's main process then exits, leaving a
    child: the app reads FAILED (lost) from another process, and a plain cancel from there stops
    the child within the grace period and a margin. Without cgroups (containment by the replica
    marker) the child ran on: the cancel found no live group and started no escalator."""
    proc = subprocess.Popen(
        launcher_argv(
            root,
            {
                "entrypoint": "sh",
                "args": ["-c", "sleep 300 & sleep 2; exit 0"],
                "env": {"ATX_TOKEN": token},
            },
        ),
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "ASYNCTORCHX_LOCAL_CGROUPS": cgroups},
    )
    try:
        info = await read_json_line(proc)
        os.kill(info["watchdog"], signal.SIGKILL)
    finally:
        sigkill(proc)
    app_id = info["app_id"]
    async with LocalScheduler("other", local_root=root) as s:
        with anyio.fail_after(30):
            while (d := await s.describe(app_id)) is None or not is_terminal(d.state):
                await asyncio.sleep(0.05)  # (another process's record: polled)
        assert d.state == AppState.FAILED and "lost" in d.msg, d
        assert token_procs(token), "the replica's child should still run"
        await s.cancel(app_id)
        await until(lambda: not token_procs(token), 15, "the replica's child to be stopped")


@pytest.mark.timeout(120)
async def test_a_dead_watchdog_is_replaced_and_still_stops_everything(
    root: Path, token: str
) -> None:
    """SIGKILL of the watchdog, then of the launcher: a new watchdog was started and registered
    everything, so no replica survives and the record says the launcher died."""
    proc = subprocess.Popen(
        launcher_argv(
            root,
            {
                "entrypoint": "sh",
                "args": ["-c", "trap '' TERM; sleep 1000"],
                "n": 3,
                "env": {"ATX_TOKEN": token},
            },
        ),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        info = await read_json_line(proc)
        os.kill(info["watchdog"], signal.SIGKILL)

        def replaced() -> bool:
            doc = read_record(root, info["app_id"]) or {}
            pid = (doc.get("owner") or {}).get("watchdog_pid")
            return pid not in (None, info["watchdog"]) and _stat(str(pid)) is not None

        await until(replaced, 20, "the record to name a new, live watchdog")
    finally:
        sigkill(proc)
    await until(lambda: not token_procs(token), 30, "every replica to be gone")
    doc = await terminal_record(root, info["app_id"], 30)
    assert doc["state"] == "FAILED" and f"launcher (pid {proc.pid}) died" in doc["msg"]


STUCK_WATCHDOG_LAUNCHER = textwrap.dedent(
    """
    import asyncio, json, sys
    from asynctorchx.schedulers._local import guard
    from asynctorchx.schedulers.local import LocalScheduler
    from asynctorchx.specs import AppDef, Role

    guard._PIPE_SIZE = 4096  # one page: a few hundred registrations fill it
    guard.SEND_TIMEOUT = 0.5

    async def main(root, token):
        s = LocalScheduler("doomed", local_root=root)
        env = {"ATX_TOKEN": token}
        first = await s.submit(AppDef("first", [Role("main", image="x", entrypoint="sleep",
                                                     args=["1000"], env=env)]), {})
        print(json.dumps({"watchdog": s.watchdog_pid}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        big = Role("main", image="x", entrypoint="sleep", args=["1000"], env=env, num_replicas=300)
        second = await s.submit(AppDef("second", [big]), {})
        print(json.dumps({"watchdog": s.watchdog_pid, "apps": [first, second]}), flush=True)
        await asyncio.Event().wait()

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


@pytest.mark.timeout(120)
async def test_a_stuck_watchdog_with_a_full_pipe_is_replaced_without_losing_a_line(
    root: Path, token: str
) -> None:
    """When the watchdog stops reading and its pipe fills up, the launcher waits boundedly, replaces
    it and registers everything again: a later SIGKILL of the launcher leaves no survivor."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK_WATCHDOG_LAUNCHER, str(root), token],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    stuck = 0
    try:
        stuck = (await read_json_line(proc))["watchdog"]
        os.kill(stuck, signal.SIGSTOP)
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        info = await read_json_line(proc, timeout=60)
        assert info["watchdog"] != stuck
        assert len(token_procs(token)) == 301
    finally:
        sigkill(proc)
        if stuck:
            with contextlib.suppress(OSError):
                os.kill(stuck, signal.SIGKILL)
    await until(lambda: not token_procs(token), 30, "every replica to be gone")
    for app_id in info["apps"]:
        assert (await terminal_record(root, app_id, 30))["state"] == "FAILED"


UNREPLACEABLE_WATCHDOG_LAUNCHER = textwrap.dedent(
    """
    import asyncio, json, subprocess, sys
    from asynctorchx.schedulers._local import guard
    from asynctorchx.schedulers.local import LocalScheduler
    from asynctorchx.specs import AppDef, Role

    real_popen = subprocess.Popen

    def no_more_watchdogs(args, *rest, **kwargs):
        if str(guard.WATCHDOG_SCRIPT) in args:
            raise BlockingIOError(11, "Resource temporarily unavailable")  # fork: EAGAIN
        return real_popen(args, *rest, **kwargs)

    async def main(root, token):
        s = LocalScheduler("doomed", local_root=root)
        role = Role("main", image="x", entrypoint="sleep", args=["1000"],
                    env={"ATX_TOKEN": token}, num_replicas=2)
        app_id = await s.submit(AppDef("victim", [role]), {"cancel_grace_period": 1.0})
        before = s.watchdog_pid
        guard.subprocess.Popen = no_more_watchdogs
        try:
            s._runtime.watchdog.restart("the test asks for a new one")
        except BlockingIOError:
            pass  # (the caller learns it; the running watchdog stays)
        else:
            raise AssertionError("the restart did not say it failed")
        print(json.dumps({"app_id": app_id, "before": before, "after": s.watchdog_pid}), flush=True)
        await asyncio.Event().wait()

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


@pytest.mark.timeout(120)
async def test_a_watchdog_whose_successor_cannot_start_keeps_guarding(
    root: Path, token: str
) -> None:
    """A restart of the watchdog (its launcher's claims file was made again) that cannot start the
    new one (fork fails) keeps the old one running: a later SIGKILL of the launcher still stops
    every replica and records the app FAILED."""
    proc = subprocess.Popen(
        [sys.executable, "-c", UNREPLACEABLE_WATCHDOG_LAUNCHER, str(root), token],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        info = await read_json_line(proc)
        assert info["after"] == info["before"]
        assert _stat(str(info["before"])) is not None
        assert len(token_procs(token)) == 2
    finally:
        sigkill(proc)
    await until(lambda: not token_procs(token), 30, "every replica to be gone")
    doc = await terminal_record(root, info["app_id"], 30)
    assert doc["state"] == "FAILED" and f"launcher (pid {proc.pid}) died" in doc["msg"]


@pytest.mark.timeout(60)
async def test_a_replaced_watchdog_is_killed_before_its_pipe_is_closed(
    sched: LocalScheduler, token: str
) -> None:
    """The watchdog being replaced is SIGKILLed while its pipe is still open (at the end of its
    input it would stop every app), and the apps run on under its successor."""
    role = Role("main", image="x", entrypoint="sleep", args=["1000"], env={"ATX_TOKEN": token})
    app_id = await sched.submit(AppDef("kept", [role]), {})
    watchdog = sched._runtime.watchdog
    old, pipe = watchdog._proc, watchdog._fd
    assert old is not None and pipe >= 0
    pipe_open_at_kill: list[bool] = []
    real_kill = old.kill

    def kill() -> None:
        try:
            os.fstat(pipe)
            pipe_open_at_kill.append(True)
        except OSError:
            pipe_open_at_kill.append(False)
        real_kill()

    old.kill = kill  # type: ignore[method-assign]
    watchdog.restart("the test asks for a new one")
    assert pipe_open_at_kill == [True]
    assert sched.watchdog_pid not in (None, old.pid)
    assert old.returncode == -signal.SIGKILL
    desc = await sched.describe(app_id)
    assert desc is not None and desc.state == AppState.RUNNING
    assert len(token_procs(token)) == 1
    await sched.cancel(app_id)


SUBREAPER = textwrap.dedent(
    """
    import ctypes, subprocess, sys
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER: orphans become our children
    child = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, text=True)
    print(child.stdout.readline(), end="", flush=True)
    sys.stdin.read()  # never reaps anything until told to exit
    """
)


@pytest.mark.timeout(120)
async def test_record_turns_terminal_while_the_dead_replicas_are_unreaped_zombies(
    root: Path, token: str
) -> None:
    """After the launcher's death the record is terminal as soon as the replicas have exited, even
    while nobody reaps them (zombies are not alive), though the watchdog could wait 600 s."""
    launcher = launcher_argv(
        root,
        {
            "entrypoint": "sleep",
            "args": ["1000"],
            "n": 3,
            "env": {"ATX_TOKEN": token},
            "grace": 600.0,
            "watchdog_max_grace": 600.0,
        },
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", SUBREAPER, *launcher],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        info = await read_json_line(holder)
        launcher_pid = int(read_record(root, info["app_id"])["owner"]["pid"])  # type: ignore[index]
        os.kill(launcher_pid, signal.SIGKILL)
        doc = await terminal_record(root, info["app_id"], 30)
        states = {pid: (_stat(str(pid)) or ["gone"])[0] for pid in info["pids"]}
        assert set(states.values()) == {"Z"}, states  # still unreaped: the subreaper holds them
        assert doc["state"] == "FAILED" and f"(pid {launcher_pid}) died" in doc["msg"]
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        with anyio.fail_after(10):
            await anyio.to_thread.run_sync(holder.wait)
        if holder.stdout is not None:
            holder.stdout.close()


# -- 3: descendants that leave the process group ---------------------------------------------------

# a daemon that leaves the group (setsid), a double-forked one, and one that keeps writing to the
# replica's stdout; the replica says when all three run
DAEMONS = (
    "setsid sh -c 'sleep 1000' </dev/null >/dev/null 2>&1 & "
    "(sleep 1001 </dev/null >/dev/null 2>&1 &) ; "
    "(setsid sh -c 'while :; do echo tick; sleep 0.05; done' &) ; "
    'sleep 0.2; touch "$READY"; '
)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["main_exits", "cancel", "close"])
async def test_daemons_of_a_replica_die_with_it(
    root: Path, tmp_path: Path, token: str, containment: str, how: str
) -> None:
    """setsid and double-forked descendants are gone by the time the app is terminal, whether its
    main process exits, it is cancelled or its scheduler closes; a writing daemon does not keep the
    app finishing."""
    ready = tmp_path / "ready"
    tail = "exit 0" if how == "main_exits" else "sleep 1000"
    app = AppDef(
        "daemons",
        [
            Role(
                "main",
                image="x",
                entrypoint="sh",
                args=["-c", DAEMONS + tail],
                env={"ATX_TOKEN": token, "READY": str(ready)},
            )
        ],
    )
    s = LocalScheduler("rel", local_root=root)
    try:
        app_id = await s.submit(app, {"cancel_grace_period": 0.5})
        await until(ready.exists, 20, "the daemons to start")
        if how == "cancel":
            await s.cancel(app_id)
        if how == "close":
            with anyio.fail_after(30):
                await s.close()
            desc = await s.describe(app_id)
        else:
            desc = await wait_for(s, app_id)
        alive_at_end = token_procs(token)
        assert desc is not None
        expected = {"main_exits": AppState.SUCCEEDED}.get(how, AppState.CANCELLED)
        assert desc.state == expected
        assert alive_at_end == []
    finally:
        await s.close()


@pytest.mark.timeout(60)
def test_a_daemon_double_forked_before_the_move_is_adopted_too(tmp_path: Path, token: str) -> None:
    """A replica that double-forks a daemon before it is moved into its cgroup (the launcher was
    slow to run, as on a busy machine): the daemon is moved in too, although it is nobody's child
    any more, and the cgroup's kill stops it."""
    from asynctorchx.schedulers._local import contain

    base = contain.make_base()
    if base is None:
        engine_missing("a writable cgroup v2 hierarchy")
        return
    cgroup = os.path.join(base, "replica")
    os.mkdir(cgroup)
    ready = tmp_path / "ready"
    marker = f"app-{token}/main/0"
    env = dict(os.environ, ASYNCTORCHX_REPLICA=marker, ATX_TOKEN=token, READY=str(ready))
    script = '(setsid sleep 1000 </dev/null >/dev/null 2>&1 &); touch "$READY"; exec sleep 1001'
    proc = subprocess.Popen(["sh", "-c", script], env=env)
    try:
        deadline = time.monotonic() + 20
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        daemons = [pid for pid in token_procs(token) if pid != proc.pid]
        assert len(daemons) == 1 and daemons[0] not in contain.children(proc.pid)
        contain.adopt(
            cgroup, proc.pid, os.path.dirname(base), f"ASYNCTORCHX_REPLICA={marker}".encode()
        )
        inside = {int(p) for p in Path(cgroup, "cgroup.procs").read_text().split()}
        assert inside == {proc.pid, daemons[0]}
        contain.kill(cgroup)
        assert proc.wait(10) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while token_procs(token) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert token_procs(token) == []
    finally:
        kill_token_procs(token)
        proc.kill()
        proc.wait()
        contain.remove_tree(base)


@pytest.mark.timeout(90)
async def test_launcher_death_stops_daemons_of_its_replicas(
    root: Path, tmp_path: Path, token: str, containment: str
) -> None:
    """SIGKILL of the launcher: the setsid and double-forked daemons of its replicas die too."""
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        launcher_argv(
            root,
            {
                "entrypoint": "sh",
                "args": ["-c", DAEMONS + "sleep 1000"],
                "env": {"ATX_TOKEN": token, "READY": str(ready)},
            },
        ),
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ},
    )
    try:
        info = await read_json_line(proc)
        await until(ready.exists, 20, "the daemons to start")
        assert len(token_procs(token)) >= 4
    finally:
        sigkill(proc)
    await until(lambda: not token_procs(token), 30, "the replica and its daemons to be gone")
    doc = await terminal_record(root, info["app_id"], 30)
    assert doc["state"] == "FAILED"


# -- 5, 6: signals and grace periods ---------------------------------------------------------------

# counts the SIGTERMs it receives: the C-level handler writes one byte per delivery to $OUT; it
# runs real-time (when allowed) so that each signal is handled before the next one can merge with it
COUNT_TERMS = textwrap.dedent(
    """
    import os, signal, time
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except OSError:
        pass
    fd = os.open(os.environ["OUT"], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK)
    signal.signal(signal.SIGTERM, lambda *a: None)
    signal.set_wakeup_fd(fd, warn_on_full_buffer=False)
    open(os.environ["READY"], "w").close()
    while True:
        time.sleep(1)
    """
)


@pytest.mark.timeout(60)
async def test_cancel_sends_exactly_one_sigterm(sched: LocalScheduler, tmp_path: Path) -> None:
    """One cancel delivers exactly one SIGTERM to each replica, then SIGKILL after the grace period."""
    out, ready = tmp_path / "terms", tmp_path / "ready"
    app = python_app("terms", COUNT_TERMS, {"OUT": str(out), "READY": str(ready)})
    app_id = await sched.submit(app, {"cancel_grace_period": 1.0})
    await until(ready.exists, 20, "the handler to be installed")
    await sched.cancel(app_id)
    desc = await wait_for(sched, app_id)
    assert desc.state == AppState.CANCELLED
    assert desc.roles_statuses[0].replicas[0].exit_code == -signal.SIGKILL
    assert out.read_bytes() == bytes([signal.SIGTERM])


@pytest.mark.timeout(60)
async def test_an_app_whose_supervision_fails_twice_still_ends_failed(
    sched: LocalScheduler, token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The app's supervision raises, and so does the settling of its replicas on the way out (the
    cause — e.g. no descriptor left — still there): the app is recorded FAILED with its replicas
    killed (it stayed RUNNING for ever, and every wait with it, as seen in CI)."""
    from asynctorchx.schedulers._local.supervise import AppSupervision

    async def broken(*_: object) -> None:
        raise OSError(24, "Too many open files (injected)")

    app = AppDef(
        "twice",
        [Role("main", image="x", entrypoint="sleep", args=["1000"], env={"ATX_TOKEN": token})],
    )
    monkeypatch.setattr(AppSupervision, "_loop", broken)
    monkeypatch.setattr(AppSupervision, "settle", broken)
    app_id = await sched.submit(app, {})
    desc = await wait_for(sched, app_id)
    assert desc.state == AppState.FAILED
    await until(lambda: not token_procs(token), 10, "the replica to be killed")


def cli_cancel(root: Path, handle: str) -> subprocess.Popen[str]:
    env = {**os.environ, "ASYNCTORCHX_LOCAL_ROOT": str(root)}
    return subprocess.Popen(
        [sys.executable, "-m", "asynctorchx", "cancel", handle],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("first", ["another CLI", "the launcher"])
async def test_two_cancels_at_once_send_one_sigterm(
    sched: LocalScheduler, root: Path, tmp_path: Path, first: str
) -> None:
    """Two cancels of one app, from two CLI processes at once or from its launcher and then a CLI
    process: each replica gets one SIGTERM (the second canceller finds the first one's marker and
    sends none), and the app ends CANCELLED."""
    out, ready = tmp_path / "terms", tmp_path / "ready"
    app = python_app("terms", COUNT_TERMS, {"OUT": str(out), "READY": str(ready)})
    app_id = await sched.submit(app, {"cancel_grace_period": 2.0})
    await until(ready.exists, 20, "the handler to be installed")
    handle = f"local_cwd://rel/{app_id}"
    if first == "the launcher":
        await sched.cancel(app_id)
        procs = [cli_cancel(root, handle)]
    else:
        procs = [cli_cancel(root, handle), cli_cancel(root, handle)]
    outs = [await anyio.to_thread.run_sync(p.communicate) for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), outs
    desc = await wait_for(sched, app_id)
    assert desc.state == AppState.CANCELLED
    assert out.read_bytes() == bytes([signal.SIGTERM])


# another process, ready to cancel the moment it reads a line on its stdin
CANCELLER = textwrap.dedent(
    """
    import asyncio, sys
    from asynctorchx.schedulers.local import LocalScheduler
    async def main(root, app_id):
        s = LocalScheduler("other", local_root=root)
        await s.exists(app_id)  # (warmed up: its first look at the state root is done)
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        await s.cancel(app_id)
        await s.close()
    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


async def armed_canceller(root: Path, app_id: str) -> subprocess.Popen[str]:
    """A process that cancels ``app_id`` when a line is written to its stdin (``fire``)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CANCELLER, str(root), app_id],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert await anyio.to_thread.run_sync(proc.stdout.readline) == "ready\n"
    return proc


def fire(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


@pytest.mark.timeout(60)
async def test_another_process_cancel_then_the_launchers_own_before_it_heard_sends_one_sigterm(
    sched: LocalScheduler, root: Path, tmp_path: Path
) -> None:
    """Another process cancels the app (marker written, SIGTERM sent); the launcher's own cancel
    comes before its event loop has heard of that marker (the loop busy meanwhile): the launcher
    lists its groups in the marker before signalling, finds them listed, and sends none."""
    out, ready = tmp_path / "terms", tmp_path / "ready"
    app = python_app("terms", COUNT_TERMS, {"OUT": str(out), "READY": str(ready)})
    app_id = await sched.submit(app, {"cancel_grace_period": 2.0})
    await until(ready.exists, 20, "the handler to be installed")
    other = await armed_canceller(root, app_id)
    marker = root / ".apps" / f"{app_id}.cancel"
    fire(other)
    # the launcher's loop does not run until the other process's SIGTERM has been received
    deadline = time.monotonic() + 20
    while not (marker.exists() and out.exists() and out.stat().st_size >= 1):
        assert time.monotonic() < deadline, "the other process never cancelled"
    await sched.cancel(app_id)
    await anyio.to_thread.run_sync(other.communicate)
    assert other.returncode == 0
    desc = await wait_for(sched, app_id)
    assert desc.state == AppState.CANCELLED
    assert out.read_bytes() == bytes([signal.SIGTERM])


@pytest.mark.timeout(120)
async def test_the_launchers_cancel_and_another_process_cancel_at_the_same_moment_send_one_sigterm(
    sched: LocalScheduler, root: Path, tmp_path: Path
) -> None:
    """The launcher's cancel and another process's at the same moment (the other process's a few
    milliseconds either side, the launcher's loop free): one SIGTERM per replica every time (it
    was two in a fifth of the trials when the launcher signalled before writing its marker)."""
    doubles = []
    for trial in range(10):
        out, ready = tmp_path / f"terms{trial}", tmp_path / f"ready{trial}"
        app = python_app("terms", COUNT_TERMS, {"OUT": str(out), "READY": str(ready)})
        app_id = await sched.submit(app, {"cancel_grace_period": 0.5})
        await until(ready.exists, 20, "the handler to be installed")
        other = await armed_canceller(root, app_id)
        fire(other)
        await anyio.sleep(trial * 0.0005)
        await sched.cancel(app_id)
        await anyio.to_thread.run_sync(other.communicate)
        assert other.returncode == 0
        desc = await wait_for(sched, app_id)
        assert desc.state == AppState.CANCELLED
        if out.read_bytes() != bytes([signal.SIGTERM]):
            doubles.append((trial, out.read_bytes()))
    assert not doubles, f"replicas signalled other than once: {doubles}"


@pytest.mark.timeout(60)
async def test_a_cancel_whose_marker_is_slow_to_write_still_sends_sigterm_before_sigkill(
    sched: LocalScheduler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher lists its groups in the cancel marker before it signals them; a marker slow to
    write (a busy or locked state root: 3 s here) must not hold the SIGTERM back past the grace
    period (2 s), or the replica would get its SIGKILL without one: it is signalled after at most
    half the grace period, once."""
    out, ready = tmp_path / "terms", tmp_path / "ready"
    app = python_app("terms", COUNT_TERMS, {"OUT": str(out), "READY": str(ready)})
    app_id = await sched.submit(app, {"cancel_grace_period": 2.0})
    await until(ready.exists, 20, "the handler to be installed")
    store = sched._runtime.store
    mark_cancel = store.mark_cancel
    marked = threading.Event()

    def slow_mark_cancel(*args: Any) -> Any:
        time.sleep(3.0)  # (a worker thread: the state root is slow)
        try:
            return mark_cancel(*args)
        finally:
            marked.set()

    monkeypatch.setattr(store, "mark_cancel", slow_mark_cancel)
    await sched.cancel(app_id)
    desc = await wait_for(sched, app_id)
    assert desc.state == AppState.CANCELLED
    # the marking lands after the app ended: it signals nothing more
    assert await anyio.to_thread.run_sync(marked.wait, 20)
    await anyio.sleep(0.1)
    assert out.read_bytes() == bytes([signal.SIGTERM])


@pytest.mark.timeout(60)
async def test_a_cancel_whose_caller_is_cancelled_at_once_still_sends_sigterm(
    sched: LocalScheduler, tmp_path: Path
) -> None:
    """The caller of cancel() is cancelled right after the stop began (a request timing out):
    the SIGTERM still goes out (the marking and the signals are the scheduler's task), and the
    app ends CANCELLED."""
    out, ready = tmp_path / "terms", tmp_path / "ready"
    app = python_app("terms", COUNT_TERMS, {"OUT": str(out), "READY": str(ready)})
    app_id = await sched.submit(app, {"cancel_grace_period": 2.0})
    await until(ready.exists, 20, "the handler to be installed")
    live = sched._runtime.apps[app_id]
    caller = asyncio.create_task(sched.cancel(app_id))
    while live.cancel_reason is None:
        await asyncio.sleep(0)
    caller.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await caller
    await until(lambda: out.exists() and out.stat().st_size >= 1, 20, "the SIGTERM")
    assert out.read_bytes() == bytes([signal.SIGTERM])
    desc = await wait_for(sched, app_id)  # (SIGKILLed after the grace period)
    assert desc.state == AppState.CANCELLED


# exits at its second SIGTERM: the watchdog's (its launcher died), then a canceller's
EXITS_AT_SECOND_TERM = textwrap.dedent(
    """
    import os, signal, time
    terms = 0
    def on_term(*_):
        global terms
        terms += 1
        with open(os.environ["OUT"], "a") as f:
            f.write("TERM\\n")
        if terms >= 2:
            os._exit(143)
    signal.signal(signal.SIGTERM, on_term)
    open(os.environ["READY"], "w").close()
    while True:
        time.sleep(0.05)
    """
)


@pytest.mark.timeout(90)
async def test_a_cancel_accepted_after_the_launcher_died_ends_cancelled(
    root: Path, tmp_path: Path, token: str
) -> None:
    """The launcher is SIGKILLed and its watchdog is stopping the app (SIGTERM sent) when another
    process cancels it: the cancel is accepted (its SIGTERM ends the replica), so the watchdog,
    finding the cancel's marker, records the app CANCELLED, not FAILED."""
    out, ready = tmp_path / "terms", tmp_path / "ready"
    env = {"OUT": str(out), "READY": str(ready), "ATX_TOKEN": token}
    spec = {"entrypoint": sys.executable, "args": ["-c", EXITS_AT_SECOND_TERM], "env": env}
    proc = subprocess.Popen(
        launcher_argv(root, {**spec, "grace": 30.0}), stdout=subprocess.PIPE, text=True
    )
    try:
        info = await read_json_line(proc)
        await until(ready.exists, 20, "the handler to be installed")
    finally:
        sigkill(proc)
    await until(lambda: out.exists() and out.read_text().count("TERM") == 1, 20, "its SIGTERM")
    assert (read_record(root, info["app_id"]) or {}).get("state") == "RUNNING"
    other = LocalScheduler("other", local_root=root)
    try:
        await other.cancel(info["app_id"])
        assert out.read_text().count("TERM") == 2, "the cancel sent no SIGTERM"
        doc = await terminal_record(root, info["app_id"], 30)
    finally:
        await other.close()
    assert doc["state"] == "CANCELLED", doc["msg"]
    assert doc["msg"].startswith("cancelled"), doc["msg"]


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0, 1e9, 3601.0])
def test_absurd_grace_periods_are_rejected_at_dry_run(root: Path, value: float) -> None:
    """A cancel_grace_period that is not a number of seconds in [0, 3600] fails the dry run,
    naming the option and the value."""
    s = LocalScheduler("rel", local_root=root)
    app = AppDef("g", [Role("main", image="x", entrypoint="true")])
    with pytest.raises(InvalidRunConfigException, match="cancel_grace_period") as info:
        s.submit_dryrun(app, {"cancel_grace_period": value})
    assert repr(value) in str(info.value)


@pytest.mark.timeout(60)
async def test_close_caps_the_grace_period(
    root: Path, token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() gives a SIGTERM-ignoring app at most CLOSE_MAX_GRACE, whatever its grace period."""
    from asynctorchx.schedulers import local

    monkeypatch.setattr(local, "CLOSE_MAX_GRACE", 0.5, raising=False)
    s = LocalScheduler("rel", local_root=root)
    app = AppDef(
        "stubborn",
        [
            Role(
                "main",
                image="x",
                entrypoint="sh",
                args=["-c", "trap '' TERM; sleep 1000"],
                env={"ATX_TOKEN": token},
            )
        ],
    )
    app_id = await s.submit(app, {"cancel_grace_period": 3600.0})
    await until(lambda: len(token_procs(token)) >= 2, 20, "the replica to run")
    with anyio.fail_after(20):
        await s.close()
    desc = await s.describe(app_id)
    assert desc is not None and desc.state == AppState.CANCELLED
    assert token_procs(token) == []


# -- 7: bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "role"),
    [
        ("entrypoint", Role("main", image="x", entrypoint="s\0h")),
        ("args[1]", Role("main", image="x", entrypoint="sh", args=["-c", "echo a\0b"])),
        ("env['A']", Role("main", image="x", entrypoint="sh", env={"A": "x\0y"})),
        ("image", Role("main", image="/img\0", entrypoint="sh")),
    ],
)
def test_nul_bytes_are_rejected_naming_role_field_and_value(
    root: Path, field: str, role: Role
) -> None:
    """A NUL byte in the entrypoint, an arg, an env value or the image fails the dry run with the
    role, the field and the value."""
    s = LocalScheduler("rel", local_root=root)
    with pytest.raises(InvalidAppDefException) as info:
        s.submit_dryrun(AppDef("nul", [role]), {})
    message = str(info.value)
    assert "role 'main'" in message and field in message and "\\x00" in message


def sleepers(name: str, token: str, replicas: int) -> Role:
    """A role of ``replicas`` long ``sleep`` processes marked with ``token``."""
    return Role(
        name,
        image="x",
        entrypoint="sleep",
        args=["1000"],
        num_replicas=replicas,
        env={"ATX_TOKEN": token},
    )


@pytest.mark.timeout(60)
async def test_any_failure_during_a_launch_leaves_nothing(
    root: Path, sched: LocalScheduler, token: str
) -> None:
    """An unexpected error in the middle of a launch (here a request altered after its dry run)
    stops the replicas already started and removes the app's directory and record."""
    app = AppDef("half", [sleepers("ok", token, 3), sleepers("bad", token, 1)])
    info = sched.submit_dryrun(app, {})
    request = info.request
    bad = request.roles[1]
    broken = dataclasses.replace(
        bad,
        replicas=(dataclasses.replace(bad.replicas[0], env={**bad.replicas[0].env, "X": "a\0b"}),),
    )
    info.request = dataclasses.replace(request, roles=(request.roles[0], broken))
    with pytest.raises(ValueError):
        await sched.schedule(info)
    await until(lambda: not token_procs(token), 10, "the started replicas to be gone")
    assert not os.path.exists(request.app_dir)
    assert record_ids(root) == []
    assert await sched.list() == []


@pytest.mark.timeout(60)
async def test_a_launch_cut_short_by_a_cancel_scope_is_undone_before_it_returns(
    root: Path, sched: LocalScheduler, token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submit whose anyio cancel scope is cancelled once its replicas run returns only when
    they are gone and the app is forgotten (the scope's repeated cancellation does not cut the
    wait for the undo short)."""
    info = sched.submit_dryrun(AppDef("cut", [sleepers("main", token, 8)]), {})
    spawner = sched._launcher._spawner
    start = spawner.start
    with anyio.CancelScope() as scope:

        async def start_then_cancel(*args: Any) -> None:
            await start(*args)
            scope.cancel()
            # (the launch's next checkpoint; its record may be written without one, from a spare)
            await anyio.lowlevel.checkpoint()

        monkeypatch.setattr(spawner, "start", start_then_cancel)
        with anyio.fail_after(30):
            await sched.schedule(info)
    assert scope.cancelled_caught
    assert token_procs(token) == []
    assert await sched.describe(info.request.app_id) is None
    assert record_ids(root) == []


# -- 8: file descriptors -----------------------------------------------------------------------------

FD_LIMITED = textwrap.dedent(
    """
    import asyncio, json, os, resource, sys
    limit, root, apps, replicas = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    from asynctorchx.schedulers.local import LocalScheduler
    from asynctorchx.specs import AppDef, Role

    def fds():
        return len(os.listdir("/proc/self/fd"))

    async def main():
        async with LocalScheduler("s", local_root=root) as s:
            await s.submit(AppDef("warm", [Role("main", image=".", entrypoint="true")]), {})
            await asyncio.sleep(0.3)
            before = fds()
            app = AppDef("a", [Role("main", image=".", entrypoint="sleep", args=["0.5"],
                                    num_replicas=replicas)])
            results = await asyncio.gather(*(s.submit(app, {}) for _ in range(apps)),
                                           return_exceptions=True)
            ok = [r for r in results if isinstance(r, str)]
            errors = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
            for app_id in ok:
                while not (await s.describe(app_id)).state.name in ("SUCCEEDED", "FAILED"):
                    await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
            after = fds()
            dirs = os.listdir(os.path.join(root, "s"))
        print(json.dumps({"ok": ok, "errors": errors, "before": before, "after": after,
                          "dirs": dirs}))

    asyncio.run(main())
    """
)


async def run_fd_limited(root: Path, limit: int, apps: int, replicas: int) -> dict[str, Any]:
    with anyio.fail_after(120):
        proc = await anyio.run_process(
            [sys.executable, "-c", FD_LIMITED, str(limit), str(root), str(apps), str(replicas)],
            check=False,
        )
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


@pytest.mark.timeout(150)
async def test_an_app_that_cannot_fit_the_fd_limit_is_refused_clearly(root: Path) -> None:
    """An app needing more file descriptors than RLIMIT_NOFILE leaves is refused before it starts,
    saying what ran out; no directory is left and no descriptor leaks."""
    out = await run_fd_limited(root, limit=128, apps=1, replicas=40)
    assert out["ok"] == []
    (error,) = out["errors"]
    assert "file descriptors" in error and "ulimit -n" in error and "log_dir" not in error
    assert out["dirs"] == [".errors"]  # (no app's: quiet replicas make no log directory)
    assert out["after"] == out["before"]


@pytest.mark.timeout(150)
async def test_concurrent_starts_under_a_small_fd_limit_leave_nothing_behind(root: Path) -> None:
    """Many concurrent starts under a small RLIMIT_NOFILE: those that do not fit fail saying so,
    and leave no directory, no record and no descriptor behind."""
    out = await run_fd_limited(root, limit=256, apps=60, replicas=2)
    assert out["ok"] and out["errors"]
    assert all("file descriptors" in e and "log_dir" not in e for e in out["errors"])
    assert set(out["dirs"]) - {".errors"} <= set(out["ok"])
    assert len(record_ids(root)) == len(out["ok"]) + 1
    assert out["after"] == out["before"]


FD_LAZY_FILES = textwrap.dedent(
    """
    import asyncio, json, os, resource, sys
    limit, root, go = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    from asynctorchx.schedulers.local import LocalScheduler
    from asynctorchx.specs import AppDef, Role

    # quiet until "$GO" exists, then writes to both streams and stays until "$GO.end" exists
    WAIT = ('until [ -e "$GO" ]; do sleep 0.05; done; echo "out of $ID"; echo "err of $ID" >&2; '
            'until [ -e "$GO.end" ]; do sleep 0.05; done')

    async def lines(s, app_id):
        return [line async for line in s.log_iter(app_id, "main", 0)]

    async def main():
        async with LocalScheduler("s", local_root=root) as s:
            ok, errors = [], []
            for i in range(limit):  # quiet replicas: no log file yet, 3 descriptors each
                app = AppDef("q", [Role("main", image=".", entrypoint="sh", args=["-c", WAIT],
                                        env={"GO": go, "ID": str(i)})])
                try:
                    ok.append(await s.submit(app, {}))
                except Exception as e:
                    errors.append(f"{type(e).__name__}: {e}")
                    break
            open(go, "w").close()  # every replica prints now: its log files are made
            for app_id in ok:  # (all of them running, with their files open at once)
                while len(await lines(s, app_id)) < 2 and "lost" not in (
                    await s.describe(app_id)
                ).msg:
                    await asyncio.sleep(0.05)
            open(go + ".end", "w").close()
            for app_id in ok:
                while not (d := await s.describe(app_id)).state.name in ("SUCCEEDED", "FAILED"):
                    await asyncio.sleep(0.05)
            msgs = [(await s.describe(a)).msg for a in ok]
            logs = [await lines(s, a) for a in ok]
        print(json.dumps({"ok": ok, "errors": errors, "msgs": msgs, "logs": logs}))

    asyncio.run(main())
    """
)


@pytest.mark.timeout(150)
async def test_quiet_replicas_keep_the_descriptors_of_their_log_files(
    root: Path, tmp_path: Path
) -> None:
    """A quiet replica's log files are opened at its first output, after its launch returned: the
    descriptors they need stay promised to it meanwhile. Launches that would take them are refused
    (saying so) and every replica that started writes its whole output, however late it prints."""
    with anyio.fail_after(120):
        proc = await anyio.run_process(
            [sys.executable, "-c", FD_LAZY_FILES, "160", str(root), str(tmp_path / "go")],
            check=False,
        )
    assert proc.returncode == 0, proc.stderr.decode()
    out = json.loads(proc.stdout)
    assert out["ok"], out
    (error,) = out["errors"]
    assert "file descriptors" in error and "ulimit -n" in error
    assert [m for m in out["msgs"] if "lost" in m] == []
    for i, lines in enumerate(out["logs"]):
        assert sorted(lines) == sorted([f"out of {i}\n", f"err of {i}\n"]), (i, lines)


# -- 9: full disks -----------------------------------------------------------------------------------


def fill(path: Path, leave: int = 0) -> Path:
    """Fills the file system of ``path`` with a file until at most ``leave`` bytes are free."""
    filler = path / f"filler-{uuid.uuid4().hex}"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            st = os.statvfs(path)
            free = st.f_bavail * st.f_frsize
            if free <= leave:
                break
            try:
                os.write(fd, b"\0" * min(1 << 16, max(free - leave, 4096)))
            except OSError:
                break
    finally:
        os.close(fd)
    return filler


LOUD = textwrap.dedent(
    """
    import os, sys, time
    line = b"a" * 99 + b"\\n"
    for _ in range(1000):
        os.write(1, line)
    while not os.path.exists(os.environ["GO"]):
        time.sleep(0.01)
    os.write(1, b"after\\n")
    """
)


@pytest.mark.timeout(60)
async def test_log_bytes_lost_on_a_full_disk_are_counted_and_marked(
    sched: LocalScheduler, tmp_path: Path
) -> None:
    """Output that does not fit on the disk is counted per file, reported in the app's status
    message, and marked in each log where it is missing; nothing is lost silently. (Which files
    lose bytes depends on where the disk filled: the chunk that filled it may have fitted in
    stdout.log and not in combined.log, and the space may come back before stdout's next chunk;
    a file without a marker must then hold every byte.)"""
    go = tmp_path / "go"
    with tiny_tmpfs(tmp_path / "fs", "256k") as fs:
        filler = fill(fs, leave=48 * 1024)
        app = python_app("loud", LOUD, {"GO": str(go)})
        app_id = await sched.submit(app, {"log_dir": str(fs / "logs")})
        desc = await wait_for(sched, app_id, lambda d: "lost" in d.msg)
        filler.unlink()
        go.touch()
        desc = await wait_for(sched, app_id)
        assert desc.state == AppState.SUCCEEDED
        assert "log output lost (No space left on device)" in desc.msg
        log_dir = fs / "logs" / "rel" / app_id / "main" / "0"
        marked = []
        for name in ("stdout.log", "combined.log"):
            data = (log_dir / name).read_bytes()
            markers = re.findall(
                rb"\[asynctorchx: (\d+) bytes of output could not be written here: "
                rb"No space left on device\]\n",
                data,
            )
            lost = sum(int(m) for m in markers)
            if markers:
                marked.append(name)
                assert f"{lost} bytes of {name}" in desc.msg
            else:
                assert f"of {name}" not in desc.msg, name
            body = re.sub(rb"\n?\[asynctorchx: \d+ bytes [^\]]*\]\n", b"", data)
            assert len(body) + lost == 1000 * 100 + len(b"after\n"), name
            assert data.endswith(b"after\n")
        assert marked, "no log was marked although the status says output was lost"


@pytest.mark.timeout(90)
async def test_the_logs_of_a_disk_that_stays_full_say_what_they_lost(
    sched: LocalScheduler, tmp_path: Path
) -> None:
    """The log file system fills up and stays full until the replica has exited: each log a user
    reads (stdout, stderr, combined) ends with the marker of what it lost (written in the space
    set aside in the session's directory), never cut mid-line with no sign of loss (the status
    message said so, the logs did not: there was no room for their markers)."""
    with tiny_tmpfs(tmp_path / "fs", "2m") as fs:
        code = (
            "import sys\n"
            "for i in range(100000): print(f'line {i:06d} ' + 'x' * 40)\n"
            "print('END', file=sys.stderr)\n"
        )
        app = python_app("full", code, {})
        app_id = await sched.submit(app, {"log_dir": str(fs)})
        desc = await wait_for(sched, app_id, timeout=60)
        assert desc.state == AppState.SUCCEEDED
        assert "log output lost (No space left on device)" in desc.msg
        marker = re.compile(r"\[asynctorchx: (\d+) bytes of output could not be written here")
        for stream in ("combined", "stdout", "stderr"):
            lines = [line async for line in sched.log_iter(app_id, "main", streams=Stream(stream))]
            found = [m for line in lines[-2:] if (m := marker.search(line))]
            assert found, f"{stream}: {len(lines)} lines, no marker at the end: {lines[-2:]!r}"
            assert f"{found[-1].group(1)} bytes of {stream}.log" in desc.msg, (stream, desc.msg)


@pytest.mark.timeout(60)
async def test_a_session_on_a_disk_without_room_for_the_reserve_makes_its_dirs_once(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log file system without 256 KiB to spare: the space reserve is not made, and is not
    tried again at every launch (each launch made the session's directories again in a worker
    thread, creating and removing a file)."""
    from asynctorchx.schedulers._local import launch as launch_module

    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    calls: list[tuple[str, ...]] = []
    real = launch_module._make_session_dir

    def counting(*args: str) -> None:
        calls.append(args)
        real(*args)

    monkeypatch.setattr(launch_module, "_make_session_dir", counting)
    sched = LocalScheduler("reserve", local_root=root)
    try:
        for _ in range(4):
            app = AppDef("q", [Role("main", image="x", entrypoint="true")])
            app_id = await sched.submit(app, {})
            assert (await wait_for(sched, app_id, timeout=30)).state == AppState.SUCCEEDED
    finally:
        await sched.close()
    assert len(calls) == 1, f"the session's directories were made {len(calls)} times"


@pytest.mark.timeout(60)
async def test_output_after_the_log_files_could_not_be_made_is_written_once_they_can(
    sched: LocalScheduler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The log file system has no free inode when a replica's first line comes: the line is
    counted lost; inodes come back, then the replica prints again: its log holds the marker of
    the lost line, then the new one (the files were never tried again: all its later output was
    discarded, for its whole life)."""
    from asynctorchx.schedulers._local import launch

    monkeypatch.setattr(launch, "EARLY_LOG_FILES", 60.0)  # (the files are made at the first line)
    filled, go = tmp_path / "filled", tmp_path / "go"
    script = (
        'until [ -e "$FILLED" ]; do sleep 0.01; done; echo before; '
        'until [ -e "$GO" ]; do sleep 0.01; done; echo after'
    )
    env = {"FILLED": str(filled), "GO": str(go)}
    with tiny_tmpfs(tmp_path / "fs", "8m", inodes=400) as fs:
        role = Role("main", image=".", entrypoint="sh", args=["-c", script], env=env)
        app_id = await sched.submit(AppDef("quiet", [role]), {"log_dir": str(fs / "logs")})
        filler = fs / "fill"
        filler.mkdir()
        with contextlib.suppress(OSError):
            for n in range(100_000):
                (filler / str(n)).touch()
        filled.touch()
        await wait_for(sched, app_id, lambda d: "log output lost" in d.msg)
        shutil.rmtree(filler)
        go.touch()
        desc = await wait_for(sched, app_id)
        assert desc.state == AppState.SUCCEEDED
        lines = [line async for line in sched.log_iter(app_id, "main", 0)]
        assert lines == [
            "[asynctorchx: 7 bytes of output could not be written here: No space left on device]\n",
            "after\n",
        ], (lines, desc.msg)


STATE_READER = textwrap.dedent(
    """
    import asyncio, json, sys
    from asynctorchx.schedulers.local import LocalScheduler

    async def main(root, app_id):
        async with LocalScheduler("reader", local_root=root) as s:
            desc = await s.describe(app_id)
            listed = {a.app_id: a.state.name for a in await s.list()}
        print(json.dumps({"describe": desc.state.name if desc else None,
                          "msg": desc.msg if desc else None, "list": listed.get(app_id)}))

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


async def read_elsewhere(root: Path, app_id: str) -> dict[str, Any]:
    with anyio.fail_after(60):
        proc = await anyio.run_process(
            [sys.executable, "-c", STATE_READER, str(root), app_id], check=False
        )
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


@pytest.mark.timeout(90)
async def test_a_full_state_root_does_not_make_states_contradict(tmp_path: Path) -> None:
    """When the state root fills up while an app runs, wait(), list() and another process (during
    and after the launcher's life) all report the same final state."""
    go = tmp_path / "go"
    with tiny_tmpfs(tmp_path / "state", "1m") as state:
        root = state / "root"
        s = LocalScheduler("rel", local_root=root)
        try:
            app = AppDef(
                "full",
                [Role("main", image="x", entrypoint="sh", args=["-c", GATE], env={"GO": str(go)})],
            )
            app_id = await s.submit(app, {"log_dir": str(tmp_path / "logs")})
            fill(state)
            go.touch()
            desc = await wait_for(s, app_id)
            listed = {a.app_id: a.state for a in await s.list()}
            assert desc.state == AppState.SUCCEEDED
            assert listed[app_id] == AppState.SUCCEEDED
            seen = await read_elsewhere(root, app_id)
            assert (seen["describe"], seen["list"]) == ("SUCCEEDED", "SUCCEEDED"), seen
        finally:
            await s.close()
        seen = await read_elsewhere(root, app_id)
        assert (seen["describe"], seen["list"]) == ("SUCCEEDED", "SUCCEEDED"), seen


@pytest.mark.timeout(90)
async def test_a_launch_refused_by_a_full_state_root_leaves_no_record_once_space_frees(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launch whose record cannot be created (full disk, logs on it too) is undone, and the log
    loss its replica's output reports while it is undone writes no record: once space frees, no
    record of it appears (before: a RUNNING record of an app nobody had a handle for)."""
    with tiny_tmpfs(tmp_path / "state", "1m") as state:
        root = state / "root"
        s = LocalScheduler("rel", local_root=root)
        try:
            await s.submit(AppDef("warm", [Role("main", image="x", entrypoint="true")]), {})
            spawner = s._launcher._spawner
            held: list[object] = []
            monkeypatch.setattr(spawner, "log_opener", held.append)  # its files: made at close
            start = spawner.start

            async def start_until_output(*args: Any) -> None:
                await start(*args)
                await until(lambda: bool(held), 10, "the replica's first output")

            monkeypatch.setattr(spawner, "start", start_until_output)
            filler = fill(state)
            app = AppDef("lost", [Role("main", image="x", entrypoint="echo", args=["hello"])])
            info = s.submit_dryrun(app, {})
            with pytest.raises(LaunchError, match="record"):
                await s.schedule(info)
            filler.unlink()
            with anyio.fail_after(30):
                assert await s._runtime.writer.flush(retry_for=20)
            assert info.request.app_id not in record_ids(root)
        finally:
            await s.close()


async def test_a_deleted_records_directory_is_created_again(
    root: Path, sched: LocalScheduler
) -> None:
    """After the records directory is deleted, the next submit creates it again and works."""
    first = await sched.submit(AppDef("one", [Role("main", image="x", entrypoint="true")]), {})
    await wait_for(sched, first)
    shutil.rmtree(root / ".apps")
    second = await sched.submit(AppDef("two", [Role("main", image="x", entrypoint="true")]), {})
    assert (await wait_for(sched, second)).state == AppState.SUCCEEDED
    await until(
        lambda: (read_record(root, second) or {}).get("state") == "SUCCEEDED",
        10,
        "the record of the second app",
    )
    assert stat.S_IMODE((root / ".apps").stat().st_mode) == 0o700


# -- 10: many replicas exiting at once ----------------------------------------------------------------


@pytest.mark.timeout(120)
async def test_a_mass_exit_serialises_the_record_a_few_times_not_once_per_exit(
    sched: LocalScheduler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """300 replicas exiting together cost a handful of whole-app record serialisations, not one
    per exit (each is O(replicas), so one per exit is quadratic)."""
    import fcntl

    lock = tmp_path / "gate.lock"
    gate = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(gate, fcntl.LOCK_EX)
    try:
        n = 300
        app = AppDef(
            "mass",
            [
                Role(
                    "main",
                    image="x",
                    entrypoint="flock",
                    args=["-s", str(lock), "true"],
                    num_replicas=n,
                )
            ],
        )
        app_id = await sched.submit(app, {})
        await wait_for(
            sched,
            app_id,
            lambda d: all(r.state == AppState.RUNNING for r in d.roles_statuses[0].replicas),
            timeout=60,
        )
        calls = 0
        to_json = records_module.AppRecord.to_json

        def counting(self: records_module.AppRecord) -> dict[str, Any]:
            nonlocal calls
            calls += 1
            return to_json(self)

        monkeypatch.setattr(records_module.AppRecord, "to_json", counting)
        fcntl.flock(gate, fcntl.LOCK_UN)
        desc = await wait_for(sched, app_id, timeout=60)
    finally:
        os.close(gate)
    assert desc.state == AppState.SUCCEEDED
    assert calls < n // 10, calls


# -- the smaller ones --------------------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_another_process_is_told_at_once_when_an_app_ends(root: Path, tmp_path: Path) -> None:
    """A scheduler watching an app that another process launched is notified when its record turns
    terminal (inotify), without waiting for a poll."""
    go = tmp_path / "go"
    proc = subprocess.Popen(
        launcher_argv(root, {"entrypoint": "sh", "args": ["-c", GATE], "env": {"GO": str(go)}}),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        info = await read_json_line(proc)
        async with LocalScheduler("watcher", local_root=root) as watcher:
            ended = asyncio.Event()

            def on_change(app_id: str) -> None:
                if app_id == info["app_id"]:
                    ended.set()

            unsubscribe = watcher.subscribe(on_change)
            desc = await watcher.describe(info["app_id"])
            assert desc is not None and desc.state == AppState.RUNNING
            go.touch()
            with anyio.fail_after(20):
                while True:
                    ended.clear()
                    desc = await watcher.describe(info["app_id"])
                    if desc is not None and is_terminal(desc.state):
                        break
                    await ended.wait()
            unsubscribe()
        assert desc.state == AppState.SUCCEEDED
    finally:
        sigkill(proc)


@pytest.mark.timeout(60)
async def test_lock_and_cancel_files_are_removed_once_the_app_ends(
    root: Path, sched: LocalScheduler
) -> None:
    """A cancel from another scheduler leaves no lock file and no cancel marker once the app ended."""
    app_id = await sched.submit(
        AppDef("c", [Role("main", image="x", entrypoint="sleep", args=["1000"])]), {}
    )
    async with LocalScheduler("other", local_root=root) as other:
        await other.cancel(app_id)
        assert (await wait_for(sched, app_id)).state == AppState.CANCELLED
    leftovers = {f".{app_id}.lock", f"{app_id}.cancel"}
    await until(lambda: not leftovers & set(os.listdir(root / ".apps")), 10, "the side files to go")


def test_records_finished_by_the_watchdog_are_private(tmp_path: Path) -> None:
    """A record the watchdog rewrites keeps mode 0600 like every other record."""
    from asynctorchx.schedulers._local import watchdog

    store = records_module.RecordStore(tmp_path / "root")
    store.ensure()
    dead = subprocess.Popen(["true"])
    dead.wait()
    doc = {
        "format": 1,
        "app_id": "w-1",
        "name": "w",
        "backend": "local_cwd",
        "session": "s",
        "state": "RUNNING",
        "msg": "",
        "submitted_at": 1.0,
        "app_dir": "/nowhere",
        "owner": {"pid": dead.pid, "start_ticks": 1},
        "replicas": [],
        "app": {},
    }
    assert store.write_many({"w-1": doc}) == {}
    watchdog.finish_record(str(store.records_dir), "w-1", "why", only_if_owner_gone=True)
    path = store.records_dir / "w-1.json"
    assert recordfile.read_document(path)["state"] != "RUNNING"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


async def test_a_directory_as_entrypoint_says_it_is_a_directory(
    sched: LocalScheduler, tmp_path: Path
) -> None:
    """An entrypoint that names a directory fails the submit saying it is a directory."""
    with pytest.raises(LaunchError, match="is a directory"):
        await sched.submit(AppDef("d", [Role("main", image="x", entrypoint=str(tmp_path))]), {})


def test_an_unwritable_log_dir_is_a_usage_error_in_the_cli(tmp_path: Path) -> None:
    """`asynctorchx run` with a log_dir that cannot be created exits 2 (usage error), in one line."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    env = {**os.environ, "ASYNCTORCHX_LOCAL_ROOT": str(tmp_path / "root"), "TORCHXCONFIG": ""}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "asynctorchx",
            "run",
            "-s",
            "local_cwd",
            "-cfg",
            f"log_dir={blocker}/logs",
            "utils.echo",
            "--msg",
            "hi",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "log_dir" in result.stderr and str(blocker) in result.stderr


@pytest.mark.timeout(60)
async def test_a_spawn_refused_by_a_process_limit_says_so(
    sched: LocalScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica whose fork is refused (EAGAIN: RLIMIT_NPROC, a cgroup's pids.max) fails the
    submit naming the limits to look at (it said "Resource temporarily unavailable" alone)."""
    import errno

    from asynctorchx.schedulers._local import spawn as spawn_module

    def refused(*args: object, **kwargs: object) -> object:
        raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))

    monkeypatch.setattr(spawn_module, "spawn", refused)
    with pytest.raises(LaunchError, match=r"RLIMIT_NPROC, or the cgroup's pids\.max"):
        await sched.submit(AppDef("nproc", [Role("main", image=".", entrypoint="true")]), {})
