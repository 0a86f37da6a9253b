"""Naming the process that made a Docker object, so that others on the same host can tell it exited.

A cancel marker names its canceller, a launch claim and each replica container its launcher
(``LABEL_CANCELLER``, ``LABEL_LAUNCHER``): ``boot id/pid namespace/pid/start time``. A process that
reads such a name on the same host and in the same pid namespace can tell whether that process
has exited (the start time tells a reused pid apart); from anywhere else it cannot, and the
process counts as alive.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterable, Mapping
from typing import Any

from asynctorchx.schedulers._docker.request import (
    KIND_LAUNCH_CANCELLED,
    KIND_LAUNCH_CLAIM,
    LABEL_APP_ID,
    LABEL_KIND,
    LABEL_LAUNCHER,
)
from asynctorchx.schedulers._docker.state import ContainerInfo
from asynctorchx.schedulers._local.recordfile import pid_alive, proc_start_ticks


@functools.cache
def _host_and_namespace() -> tuple[str, str]:
    """This machine's boot id and this process's pid namespace ("" where unreadable)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return boot, namespace


_identities: dict[int, str] = {}


def process_identity() -> str:
    """Names this process (for a cancel marker, a launch claim, a replica container):
    ``boot/pid-namespace/pid/start-ticks``."""
    pid = os.getpid()  # a forked child is another process
    if pid not in _identities:
        boot, namespace = _host_and_namespace()
        _identities[pid] = f"{boot}/{namespace}/{pid}/{proc_start_ticks(pid) or ''}"
    return _identities[pid]


def process_gone(identity: str) -> bool:
    """True only when the process ``identity`` names has certainly exited.

    A process of another machine or pid namespace (or an unreadable identity) cannot be judged
    from here: it counts as alive.
    """
    boot, namespace, pid, ticks = ([*identity.split("/", 3), "", "", "", ""])[:4]
    if not boot or not namespace or (boot, namespace) != _host_and_namespace():
        return False
    try:
        return not pid_alive(int(pid), int(ticks) if ticks else None)
    except ValueError:
        return False


def with_launchers_judged(infos: list[ContainerInfo]) -> list[ContainerInfo]:
    """``infos`` with each never-started replica whose launcher has exited marked
    ``launcher_gone`` (nobody will start it: see ``state.replica_state``)."""
    gone: dict[str, bool] = {}
    out = []
    for c in infos:
        launcher = c.labels.get(LABEL_LAUNCHER, "")
        if c.state == "created" and launcher and not c.is_marker:
            if launcher not in gone:
                gone[launcher] = process_gone(launcher)
            if gone[launcher]:
                c = dataclasses.replace(c, launcher_gone=True)
        out.append(c)
    return out


def dead_launches(volumes: Iterable[Mapping[str, Any]]) -> dict[str, list[str]]:
    """The launch claims and cancel records among ``volumes`` (entries of a volume listing)
    whose launcher has exited, by app id: what a launch killed before its containers existed
    left (see ``Launcher.clear_dead``)."""
    out: dict[str, list[str]] = {}
    for v in volumes:
        labels = v.get("Labels") or {}
        if (
            labels.get(LABEL_KIND) in (KIND_LAUNCH_CLAIM, KIND_LAUNCH_CANCELLED)
            and labels.get(LABEL_APP_ID)
            and process_gone(str(labels.get(LABEL_LAUNCHER, "")))
        ):
            out.setdefault(str(labels[LABEL_APP_ID]), []).append(str(v.get("Name", "")))
    return out
