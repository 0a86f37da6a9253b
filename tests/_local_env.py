"""Helpers for the local backend's tests (real processes, no mocks).

Tests import what they use: ``from _local_env import GATE, wait_for``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
from conftest import engine_missing

from asynctorchx.schedulers.api import DescribeAppResponse
from asynctorchx.schedulers.local import LocalScheduler
from asynctorchx.specs import is_terminal

#: A shell line that blocks until the file named by ``$GO`` exists: the test's go signal.
GATE = 'while [ ! -e "$GO" ]; do sleep 0.01; done'


async def wait_for(
    s: LocalScheduler,
    app_id: str,
    pred: Callable[[DescribeAppResponse], bool] = lambda d: is_terminal(d.state),
    timeout: float = 20.0,
) -> DescribeAppResponse:
    """Waits (on pushed changes, bounded) until ``pred`` holds for the app."""
    changed = asyncio.Event()
    unsubscribe = s.subscribe(lambda a: changed.set() if a == app_id else None)
    try:
        with anyio.fail_after(timeout):
            while True:
                changed.clear()
                desc = await s.describe(app_id)
                if desc is not None and pred(desc):
                    return desc
                await changed.wait()
    finally:
        unsubscribe()


async def poll_until(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Polls ``condition()`` (bounded, every 10 ms) until it is true: for outside facts like pids."""
    try:
        with anyio.fail_after(timeout):
            while not condition():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout} s waiting for {what}") from None


def group_members(pgid: int) -> list[int]:
    """The live (non-zombie) processes of process group ``pgid``."""
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            data = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        fields = data.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(name))
    return members


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped (nothing runs under it now)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@contextlib.contextmanager
def tiny_tmpfs(path: Path, size: str, inodes: int | None = None) -> Iterator[Path]:
    """A tmpfs of ``size`` (and at most ``inodes`` inodes) mounted at ``path`` (root only),
    unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size},mode=0700" + ("" if inodes is None else f",nr_inodes={inodes}")
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        engine_missing(f"mounting a tmpfs ({result.stderr.strip() or 'not root'})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)
