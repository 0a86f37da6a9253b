"""A replica the launcher was spawning when it died is stopped by the watchdog too.

Found by a kill-at-random-points sweep of local_dir launches (2 survivors in ~200 SIGKILLs): a
replica forked but not yet exec'd when its launcher was SIGKILLed still has the launcher's
environment (no replica marker) and is not registered with the watchdog; the watchdog found
nothing of the app alive, recorded it FAILED and exited, and the replica then exec'd and ran on
for good, nobody's. Here the window is made wide and certain: the second replica's spawn gets a
``preexec_fn`` that closes its descriptors (as ``close_fds`` does just before the exec) and waits,
and the launcher SIGKILLs itself as soon as that spawn returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from _local_env import poll_until, wait_for

from asynctorchx.schedulers.local import LocalScheduler
from asynctorchx.specs import AppDef, AppState, Role

LAUNCHER = textwrap.dedent(
    """
    import asyncio, os, pickle, signal, subprocess, sys, time
    from asynctorchx.schedulers.local import LocalScheduler

    real = subprocess.Popen
    calls = []

    def slow_exec():  # the child, between closing its descriptors and its exec
        os.closerange(3, 65536)
        time.sleep(0.5)

    def popen(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            kwargs["preexec_fn"] = slow_exec
            real(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    subprocess.Popen = popen

    async def main():
        info = pickle.loads(bytes.fromhex(sys.argv[2]))
        scheduler = LocalScheduler("wd", "local_dir", local_root=sys.argv[1])
        print("go", flush=True)
        await scheduler.schedule(info)
        await asyncio.Event().wait()

    asyncio.run(main())
    """
)


def processes_with(token: str) -> list[int]:
    """The live processes whose environment holds ``ATX_TOKEN=token``."""
    needle = f"ATX_TOKEN={token}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env and state not in (b"Z", b"X"):
            found.append(int(name))
    return found


@pytest.mark.timeout(60)
async def test_a_replica_being_spawned_when_the_launcher_dies_is_stopped(tmp_path: Path) -> None:
    """Three replicas of ``sleep 1000``; the launcher dies while the second is between fork and
    exec: once it has exec'd, the watchdog finds it by its marker and stops it, and records the
    app FAILED only then (it recorded it gone at once, and the replica survived)."""
    root, image = tmp_path / "root", tmp_path / "image"
    image.mkdir()
    token = uuid.uuid4().hex
    role = Role(
        "main", str(image), "sleep", args=["1000"], num_replicas=3, env={"ATX_TOKEN": token}
    )
    planner = LocalScheduler("wd", "local_dir", local_root=root)
    info = planner.submit_dryrun(AppDef("victim", [role]), {"cancel_grace_period": 0.5})
    await planner.close()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), *sys.path])))
    launcher = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        LAUNCHER,
        str(root),
        pickle.dumps(info).hex(),
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert launcher.stdout is not None
        assert await asyncio.wait_for(launcher.stdout.readline(), 30) == b"go\n"
        assert await asyncio.wait_for(launcher.wait(), 30) == -signal.SIGKILL
        # the watchdog records the app once nothing of it is alive; the second replica execs
        # 0.5 s after its fork, and the watchdog must still be looking then
        reader = LocalScheduler("wd", "local_dir", local_root=root)
        try:
            described = await wait_for(reader, info.request.app_id, timeout=30)
        finally:
            await reader.close()
        assert described.state == AppState.FAILED, described
        assert "watchdog" in described.msg
        await poll_until(lambda: not processes_with(token), "the app's processes gone", 10)
        await asyncio.sleep(1.0)  # (time passing: a survivor would have exec'd long since)
        assert processes_with(token) == []
    finally:
        if launcher.returncode is None:
            launcher.kill()
            await launcher.wait()
        for pid in processes_with(token):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
