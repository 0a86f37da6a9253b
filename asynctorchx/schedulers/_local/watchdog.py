"""Stops local apps whose launcher is gone. A standalone, stdlib-only script (started by path with
``python -I -S``, so it starts fast and imports nothing of the package).

Two modes:

``watch RECORDS_DIR OWNER_PID MAX_GRACE``
    One per launching scheduler, in its own session. It reads registrations from stdin (a pipe whose
    only writer is the launcher) until EOF, which happens when the launcher closes it or dies, even by
    SIGKILL. Lines: ``+ APP_ID PGID GRACE`` (a replica's process group started),
    ``- APP_ID PGID`` (that group is gone), ``x APP_ID`` (the app's terminal record is on disk).
    At EOF every group still registered gets SIGTERM, then SIGKILL after its grace period (at most
    MAX_GRACE), and every app not forgotten gets a terminal record that says why.

``escalate RECORDS_DIR APP_ID GRACE PGID:START_TICKS...``
    Started (detached) by a process that cancelled an app it did not launch and already sent
    SIGTERM: after GRACE seconds it SIGKILLs the groups still alive, then writes the CANCELLED record
    if the app's launcher is gone (a live launcher records the outcome itself).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import sys
import time

TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
POLL = 0.02


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


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pgid, sig)


def stop_groups(groups: dict[int, float], max_grace: float) -> None:
    """SIGTERM every group, wait for them to go (each up to its grace), SIGKILL what is left."""
    for pgid in groups:
        signal_group(pgid, signal.SIGTERM)
    start = time.monotonic()
    pending = dict(groups)
    while pending:
        now = time.monotonic() - start
        for pgid, grace in list(pending.items()):
            if not group_alive(pgid):
                del pending[pgid]
            elif now >= min(grace, max_grace):
                signal_group(pgid, signal.SIGKILL)
                del pending[pgid]
        if pending:
            time.sleep(POLL)


def finish_record(records_dir: str, app_id: str, msg: str, only_if_owner_gone: bool) -> None:
    """Marks the app's record CANCELLED (with ``msg``) unless it is already terminal."""
    path = os.path.join(records_dir, f"{app_id}.json")
    lock_path = os.path.join(records_dir, f".{app_id}.lock")
    try:
        lock_fd = os.open(lock_path, os.O_WRONLY | os.O_CREAT, 0o600)
    except OSError:
        return
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError):
            return
        if doc.get("state") in TERMINAL:
            return
        if only_if_owner_gone:
            owner = doc.get("owner") or {}
            pid, ticks = owner.get("pid"), owner.get("start_ticks")
            if isinstance(pid, int) and start_ticks(pid) == ticks:
                return
        now = time.time()
        doc["state"] = "CANCELLED"
        doc["msg"] = msg
        doc["ended_at"] = now
        for rep in doc.get("replicas", []):
            if rep.get("state") not in TERMINAL:
                rep["state"] = "CANCELLED"
                rep["ended_at"] = now
        tmp = os.path.join(records_dir, f".{app_id}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, separators=(",", ":"))
        os.replace(tmp, path)
    finally:
        os.close(lock_fd)


def watch(records_dir: str, owner_pid: int, max_grace: float) -> None:
    apps: dict[str, dict[int, float]] = {}
    buf = b""
    while True:
        try:
            chunk = os.read(0, 65536)
        except InterruptedError:
            continue
        except OSError:
            chunk = b""
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for raw in lines:
            parts = raw.decode("utf-8", "replace").split()
            if not parts:
                continue
            op, app_id = parts[0], parts[1] if len(parts) > 1 else ""
            if op == "+" and len(parts) >= 4:
                apps.setdefault(app_id, {})[int(parts[2])] = float(parts[3])
            elif op == "-" and len(parts) >= 3:
                apps.get(app_id, {}).pop(int(parts[2]), None)
            elif op == "x":
                apps.pop(app_id, None)
    if not apps:
        return
    groups = {pgid: grace for app in apps.values() for pgid, grace in app.items()}
    stop_groups(groups, max_grace)
    msg = (
        f"stopped by the watchdog: the launching process (pid {owner_pid}) exited "
        "without stopping the app"
    )
    for app_id in apps:
        finish_record(records_dir, app_id, msg, only_if_owner_gone=False)


def escalate(records_dir: str, app_id: str, grace: float, specs: list[str]) -> None:
    groups: dict[int, int] = {}
    for spec in specs:
        group, _, since = spec.partition(":")
        groups[int(group)] = int(since)
    deadline = time.monotonic() + grace
    while groups and time.monotonic() < deadline:
        groups = {g: t for g, t in groups.items() if group_alive(g)}
        if groups:
            time.sleep(POLL)
    for pgid, ticks in groups.items():
        # the leader still being the process we were told about means the group id was not reused
        if start_ticks(pgid) in (ticks, None):
            signal_group(pgid, signal.SIGKILL)
    finish_record(records_dir, app_id, "cancelled by another process", only_if_owner_gone=True)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        os.chdir("/")
    mode = argv[1] if len(argv) > 1 else ""
    if mode == "watch" and len(argv) == 5:
        watch(argv[2], int(argv[3]), float(argv[4]))
        return 0
    if mode == "escalate" and len(argv) >= 5:
        if os.fork() > 0:  # detach: the caller reaps this short-lived parent
            os._exit(0)
        escalate(argv[2], argv[3], float(argv[4]), argv[5:])
        return 0
    print(f"usage: {argv[0]} watch|escalate ...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
