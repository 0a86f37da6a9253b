"""Stops local apps whose launcher is gone. A standalone, stdlib-only script (started by path with
``python -I -S``, so it starts fast and imports nothing of the package but its sibling modules
``protocol.py``, ``recordfile.py`` and ``contain.py``).

Two modes:

``watch RECORDS_DIR OWNER_PID MAX_GRACE BASE_CGROUP|-``
    One per launching scheduler, in its own session. It reads the launcher's registrations
    (``protocol.py``) from stdin, a pipe whose only writer is the launcher, until EOF, which happens
    when the launcher closes it or dies, even by SIGKILL. At EOF, for every app still registered:
    SIGTERM to each of its process groups (the registered ones and those of the processes carrying
    its marker, which covers a replica spawned but not yet registered); once nothing of the app
    is left, or after its grace period (at most MAX_GRACE), SIGKILL of everything it contains (its
    cgroup, its groups, its marker holders); and as soon as its processes are gone, its terminal
    record: FAILED, saying that the launcher died (a stop nobody asked for is not a cancel). An app
    whose launcher died before writing its first record gets the minimal record its registration
    carried. The scheduler's cgroup directory is removed at the end.

``escalate RECORDS_DIR APP_ID GRACE CGROUP|- PGID:START_TICKS...``
    Started (detached) by a process that cancelled an app it did not launch and already sent
    SIGTERM: after GRACE seconds, or as soon as nothing of the app is left, it SIGKILLs what is
    left (the groups whose leader is still the process it was told about, the app's cgroup and
    marker holders), then writes the CANCELLED record if the app's launcher is gone (a live
    launcher records the outcome itself).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time

# (no typing or dataclasses: this process's start-up competes for a core with its launcher's first
# launches; see protocol.py)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

if __package__:
    from . import contain, protocol, recordfile
else:  # run as a script: the sibling modules are imported by path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import contain  # type: ignore[import-not-found, no-redef]
    import protocol  # type: ignore[import-not-found, no-redef]
    import recordfile  # type: ignore[import-not-found, no-redef]

TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
POLL = 0.02
#: How long the watchdog pauses after reading its launcher's lines before it reads again: a burst of
#: launches then wakes it a few times instead of twice per app (each wake-up is a context switch on
#: the launcher's write and a slice of a core its replicas need). Its launcher's death is noticed
#: this much later at most; the lines wait in the pipe (1 MiB), which the launcher never waits for.
NAP = 0.02
#: How long the watchdog waits for SIGKILLed processes to be gone before it records the app anyway.
KILL_WAIT = 5.0
#: How long after its launcher's death an app must show nothing alive before it is recorded gone:
#: a replica the launcher was spawning when it died (forked, not yet exec'd) still has the
#: launcher's environment, so no marker, and shows up only once it has exec'd (microseconds
#: later, unless the machine is very busy)
SETTLE = 2.0


def start_ticks(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot, or None if it does not exist (or is a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def finish_record(
    records_dir: str,
    app_id: str,
    msg: str,
    only_if_owner_gone: bool,
    state: str = "CANCELLED",
    fallback: dict[str, Any] | None = None,
) -> None:
    """Marks the app's record ``state`` (with ``msg``) unless it is already terminal; writes
    ``fallback`` so marked when there is no record (the launcher died before writing one).

    Runs under the record's lock; once the record is terminal, the lock file and the cancel marker
    are removed.
    """
    try:
        with protocol.locked_record(records_dir, app_id):
            _finish_locked(records_dir, app_id, msg, only_if_owner_gone, state, fallback)
    except OSError:
        pass


def _finish_locked(
    records_dir: str,
    app_id: str,
    msg: str,
    only_if_owner_gone: bool,
    state: str,
    fallback: dict[str, Any] | None,
) -> None:
    try:
        doc = recordfile.read_document(protocol.record_path(records_dir, app_id))
    except (FileNotFoundError, recordfile.NoDocument):
        # (no complete version: the launcher died writing its first one)
        if fallback is None:
            protocol.drop_lock_files(records_dir, app_id)
            return
        doc = dict(fallback)
    except (OSError, ValueError):
        return
    if not isinstance(doc, dict):
        return
    if doc.get("state") in TERMINAL:
        protocol.drop_lock_files(records_dir, app_id)
        return
    if only_if_owner_gone:
        owner = doc.get("owner") or {}
        pid, ticks = owner.get("pid"), owner.get("start_ticks")
        if isinstance(pid, int) and start_ticks(pid) == ticks:
            return
    if state == "FAILED" and os.path.lexists(protocol.cancel_path(records_dir, app_id)):
        # a cancel was accepted before this end (its marker is only left for a record that is
        # not terminal, under this lock): the app ends as cancelled, not as failed
        state, msg = "CANCELLED", f"cancelled; {msg}"
    now = time.time()
    doc["state"] = state
    doc["msg"] = msg
    doc["ended_at"] = now
    for rep in doc.get("replicas", []):
        if rep.get("state") not in TERMINAL:
            rep["state"] = state
            rep["ended_at"] = now
    data = json.dumps(doc, separators=(",", ":")).encode()
    protocol.write_record_file(records_dir, app_id, data)
    protocol.drop_lock_files(records_dir, app_id)


class _App:
    __slots__ = ("cgroup", "grace", "killed_at", "pgids", "prefix", "record")

    def __init__(
        self, grace: float, cgroup: str | None, record: dict[str, Any] | None = None
    ) -> None:
        self.grace = grace
        self.cgroup = cgroup
        self.record = record
        self.pgids: set[int] = set()
        self.prefix = ""
        self.killed_at: float | None = None


def _belongs(app: _App, pgid: int, marker: str | None) -> bool:
    return pgid in app.pgids or (marker is not None and marker.startswith(app.prefix))


def _kill_everything(app: _App, procs: list[tuple[int, int, str | None]]) -> None:
    if app.cgroup:
        contain.kill(app.cgroup)
    contain.kill_groups(app.pgids, signal.SIGKILL)
    contain.kill_pids(pid for pid, pgid, marker in procs if _belongs(app, pgid, marker))


def stop_apps(apps: dict[str, _App], records_dir: str, owner_pid: int, max_grace: float) -> None:
    """Stops every app (SIGTERM, grace, SIGKILL) and records each one as soon as it is gone."""
    for app_id, app in apps.items():
        app.prefix = protocol.app_marker_prefix(app_id)
    prefixes = [app.prefix for app in apps.values()]
    procs = contain.live_processes(protocol.MARKER_ENV_BYTES, prefixes)
    for app in apps.values():
        app.pgids |= {pgid for _, pgid, marker in procs if _belongs(app, pgid, marker)}
        contain.kill_groups(app.pgids, signal.SIGTERM)
    known = [p for app in apps.values() for p in app.pgids] + [p for p, _, _ in procs]
    min_pid = min(known, default=0)
    msg = f"the launcher (pid {owner_pid}) died; its watchdog stopped the app"
    start = time.monotonic()
    pending = dict(apps)
    while pending:
        all_groups = {g for app in pending.values() for g in app.pgids}
        procs = contain.live_processes(
            protocol.MARKER_ENV_BYTES,
            [app.prefix for app in pending.values()],
            pgids=all_groups,
            min_pid=min_pid,
        )
        now = time.monotonic() - start
        for app_id, app in list(pending.items()):
            mine = [p for p in procs if _belongs(app, p[1], p[2])]
            found = {pgid for _, pgid, _ in mine} - app.pgids
            if found:  # a replica that exec'd since (it was being spawned): stopped like the rest
                app.pgids |= found
                if app.killed_at is None:
                    contain.kill_groups(found, signal.SIGTERM)
            alive = bool(mine) or (app.cgroup is not None and contain.populated(app.cgroup))
            if alive and now >= min(app.grace, max_grace) and (app.killed_at is None or found):
                _kill_everything(app, mine)
                if app.killed_at is None:
                    app.killed_at = now
            elif (not alive and now >= SETTLE) or (
                alive and app.killed_at is not None and now - app.killed_at >= KILL_WAIT
            ):
                why = msg
                if alive:
                    why += f" ({len(mine)} of its processes did not die after SIGKILL)"
                if app.cgroup:
                    contain.remove_tree(app.cgroup)
                finish_record(
                    records_dir,
                    app_id,
                    why,
                    only_if_owner_gone=False,
                    state="FAILED",
                    fallback=app.record,
                )
                del pending[app_id]
        if pending:
            time.sleep(POLL)


def watch(records_dir: str, owner_pid: int, max_grace: float, base: str | None) -> None:
    apps: dict[str, _App] = {}
    buf = b""
    while True:
        try:
            chunk = os.read(0, 1 << 16)
        except InterruptedError:
            continue
        except OSError:
            chunk = b""
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for raw in lines:
            msg = protocol.parse_line(raw)
            if msg is None:
                continue
            if msg.op == "A":
                apps[msg.app_id] = _App(msg.grace, msg.cgroup, msg.record)
            elif msg.op == "+":
                apps.setdefault(msg.app_id, _App(max_grace, None)).pgids.add(msg.pid)
            elif msg.op == "-":
                app = apps.get(msg.app_id)
                if app is not None:
                    app.pgids.discard(msg.pid)
            elif msg.op == "x":
                apps.pop(msg.app_id, None)
        time.sleep(NAP)
    if apps:
        stop_apps(apps, records_dir, owner_pid, max_grace)
    if base:
        contain.remove_tree(base)


def escalate(
    records_dir: str, app_id: str, grace: float, cgroup: str | None, specs: list[str]
) -> None:
    groups: dict[int, int] = {}
    for spec in specs:
        parsed = protocol.parse_group_spec(spec)
        if parsed is not None:
            groups[parsed[0]] = parsed[1]
    prefix = protocol.app_marker_prefix(app_id)
    deadline = time.monotonic() + grace
    procs = contain.live_processes(protocol.MARKER_ENV_BYTES, [prefix], pgids=set(groups))
    while time.monotonic() < deadline:
        procs = contain.live_processes(protocol.MARKER_ENV_BYTES, [prefix], pgids=set(groups))
        if not procs and not (cgroup and contain.populated(cgroup)):
            break
        time.sleep(POLL)
    else:
        for pgid, ticks in groups.items():
            # the leader still being the process we were told about means the group id was not
            # reused (a leader that exited leaves its group id to its remaining members)
            if start_ticks(pgid) in (ticks, None):
                contain.kill_groups([pgid], signal.SIGKILL)
        if cgroup:
            contain.kill(cgroup)
        contain.kill_pids(p for p, _, marker in procs if marker and marker.startswith(prefix))
    finish_record(records_dir, app_id, "cancelled by another process", only_if_owner_gone=True)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        os.chdir("/")
    mode = argv[1] if len(argv) > 1 else ""
    if mode == "watch" and len(argv) == 6:
        watch(argv[2], int(argv[3]), float(argv[4]), None if argv[5] == "-" else argv[5])
        return 0
    if mode == "escalate" and len(argv) >= 6:
        if os.fork() > 0:  # detach: the caller reaps this short-lived parent
            os._exit(0)
        cgroup = None if argv[5] == "-" else argv[5]
        escalate(argv[2], argv[3], float(argv[4]), cgroup, argv[6:])
        return 0
    print(f"usage: {argv[0]} watch|escalate ...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
