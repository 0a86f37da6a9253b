"""Keeping every process a replica starts within reach: a cgroup v2 per replica, or a marker.

Standalone and stdlib-only: the watchdog (``watchdog.py``, started as ``python -I -S`` by path)
imports it as a sibling module, and the launcher imports it from the package.

**cgroup mode.** Where this process may create cgroups in its own cgroup v2 directory (found in
``/proc/self/mountinfo`` and ``/proc/self/cgroup``), a scheduler creates ``asynctorchx-{pid}-{n}``
there, one directory per app under it and one per replica attempt under that
(``{base}/{app_id}/{index}.{attempt}``). Each replica is moved into its directory right after it
is spawned, so everything it starts later, ``setsid`` and double-forked daemons included, is born
inside (what it started before the move is found and moved too: ``adopt``); ``cgroup.kill`` stops
all of it at once and ``cgroup.events`` says when the last process
has exited (zombies waiting for a slow reaper do not count).

**marker mode (fallback).** Without a usable cgroup (e.g. inside a container whose
``/sys/fs/cgroup`` is read-only, or with ``ASYNCTORCHX_LOCAL_CGROUPS=0``), descendants are found by
the marker every replica carries in its environment (``ASYNCTORCHX_REPLICA={app_id}/{role}/{k}``,
see ``protocol.py``): a scan of ``/proc/*/environ``. A process that rewrites its own environment
escapes this mode (not the cgroup mode).

Moving a process into a cgroup takes a kernel lock whose writer side waits for an RCU grace period
when no migration happened in the last few milliseconds (measured here: 5-20 ms, against 40-150 us
right after another migration). The launcher (``guard.Containment``) moves a replica on its event
loop only while the lock is warm; otherwise a worker thread moves it, and the launch does not wait.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import signal
import threading
import time
from collections.abc import Collection, Iterable


def _log(level: str, message: str, *args: object) -> None:
    """Logs on this module's logger, importing ``logging`` at the first message (the watchdog
    imports this module; ``logging`` would add ~8 ms of processor time to its start-up)."""
    import logging

    getattr(logging.getLogger(__name__), level)(message, *args)


#: Set to "0" to use marker mode even where cgroups are usable.
CGROUPS_ENV = "ASYNCTORCHX_LOCAL_CGROUPS"
BASE_PREFIX = "asynctorchx-"

_counter = itertools.count()


# -- finding and creating our cgroup directory -------------------------------------------------------


def _unescape_mount(path: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal
    out, i = [], 0
    while i < len(path):
        if path[i] == "\\" and i + 3 < len(path) and path[i + 1 : i + 4].isdigit():
            out.append(chr(int(path[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(path[i])
            i += 1
    return "".join(out)


def own_cgroup_path() -> str | None:
    """This process's cgroup v2 path (``/proc/self/cgroup``, relative to its cgroup namespace)."""
    try:
        with open("/proc/self/cgroup", encoding="utf-8", errors="replace") as f:
            rel = next((line[3:].rstrip("\n") for line in f if line.startswith("0::")), None)
    except OSError:
        return None
    if rel is None or rel.endswith(" (deleted)"):
        return None
    return rel


def own_cgroup_dir() -> str | None:
    """This process's cgroup v2 directory, or None when there is no cgroup v2 hierarchy to use."""
    rel = own_cgroup_path()
    if rel is None:
        return None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            mounts = f.read().splitlines()
    except OSError:
        return None
    for line in mounts:
        left, sep, right = line.partition(" - ")
        if not sep or not right.startswith("cgroup2 "):
            continue
        fields = left.split()
        if len(fields) < 5:
            continue
        root, mount = _unescape_mount(fields[3]), _unescape_mount(fields[4])
        if root == "/":
            sub = rel
        elif rel == root or rel.startswith(root.rstrip("/") + "/"):
            sub = rel[len(root.rstrip("/")) :]
        else:
            continue
        path = os.path.normpath(mount + "/" + sub.lstrip("/"))
        if os.path.isdir(path):
            return path
    return None


def make_base() -> str | None:
    """Creates this scheduler's cgroup directory; None (marker mode) when that is not possible.

    Also removes the empty directories that launchers which died (their pid is gone) left behind.
    """
    if os.environ.get(CGROUPS_ENV) == "0":
        return None
    parent = own_cgroup_dir()
    if parent is None:
        return None
    clean_stale(parent)
    base = os.path.join(parent, f"{BASE_PREFIX}{os.getpid()}-{next(_counter)}")
    try:
        os.mkdir(base)
    except OSError as e:
        _log("debug", "no cgroup containment (cannot create %s: %s); using the marker", base, e)
        return None
    usable = (
        os.access(os.path.join(base, "cgroup.procs"), os.W_OK)
        and os.access(os.path.join(base, "cgroup.kill"), os.W_OK)
        and os.access(os.path.join(base, "cgroup.events"), os.R_OK)
        and os.access(os.path.join(parent, "cgroup.procs"), os.W_OK)
    )
    if not usable:
        _log("debug", "no cgroup containment (%s lacks cgroup.kill or is not writable)", base)
        remove_tree(base)
        return None
    return base


def clean_stale(parent: str) -> None:
    """Removes the (empty) scheduler directories under ``parent`` of processes that are gone."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        if not name.startswith(BASE_PREFIX):
            continue
        pid_text = name[len(BASE_PREFIX) :].partition("-")[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid():
            continue
        if not os.path.exists(f"/proc/{pid_text}"):
            remove_tree(os.path.join(parent, name))


# -- operations on one cgroup -------------------------------------------------------------------------


class _Reserve:
    """One descriptor this process keeps open so that a cgroup can still be looked into and killed
    when the process has run out of them (EMFILE): it is closed for that open and made again."""

    def __init__(self) -> None:
        self._fd = -1
        self._lock = threading.Lock()

    def keep(self) -> None:
        """Opens the reserve (if it is not open)."""
        with self._lock:
            self._keep()

    def _keep(self) -> None:
        if self._fd < 0:
            with contextlib.suppress(OSError):
                self._fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def open(self, path: str, flags: int) -> int:
        """``os.open(path, flags)``, on the reserve's descriptor if there is none left."""
        try:
            return os.open(path, flags)
        except OSError as e:
            if e.errno not in (errno.EMFILE, errno.ENFILE):
                raise
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            try:
                return os.open(path, flags)
            finally:
                self._keep()


_reserve = _Reserve()
keep_reserve = _reserve.keep


def open_reserved(path: str, flags: int) -> int:
    """``os.open(path, flags | O_CLOEXEC)``, on the reserved descriptor if none is left."""
    return _reserve.open(path, flags | os.O_CLOEXEC)


def read_file(path: str, size: int | None = 4096) -> bytes | None:
    """The contents of a ``/proc`` or cgroup file (its first ``size`` bytes, all of it when None),
    or None when it cannot be read."""
    try:
        fd = _reserve.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if size is not None:
            return os.read(fd, size)
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def write_file(path: str, data: bytes) -> None:
    """Writes ``data`` to a cgroup interface file in one call (raises OSError)."""
    fd = _reserve.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def move(cgroup: str, pid: int) -> None:
    """Moves process ``pid`` (all its threads) into ``cgroup`` (raises OSError)."""
    write_file(os.path.join(cgroup, "cgroup.procs"), b"%d" % pid)


def _children_of_task(pid: int, tid: int | str) -> list[int]:
    data = read_file(f"/proc/{pid}/task/{tid}/children", 1 << 16)
    try:
        return [int(x) for x in data.split()] if data else []
    except ValueError:
        return []


def children(pid: int) -> list[int]:
    """The children of ``pid`` (every thread's), from ``/proc``."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    return [child for tid in tids for child in _children_of_task(pid, tid)]


class Adoption:
    """One just-spawned process for ``adopt_all`` to move into ``cgroup``; ``error`` is set when
    the process itself could not be moved."""

    __slots__ = ("cgroup", "error", "exited", "marker", "pid")

    def __init__(self, cgroup: str, pid: int, marker: bytes = b"", exited: bool = False) -> None:
        self.cgroup = cgroup
        self.pid = pid
        self.marker = marker  # NAME=value, the marker in the process's environment
        self.exited = exited  # its main process has exited: only what it left is looked for
        self.error: OSError | None = None


def adopt(
    cgroup: str,
    pid: int,
    born_in: str | None = None,
    marker: bytes = b"",
    siblings: Collection[int] = (),
) -> None:
    """Moves a just-spawned ``pid`` into ``cgroup``, then every descendant it already started
    (``adopt_all`` of one). Raises OSError when ``pid`` itself cannot be moved."""
    one = Adoption(cgroup, pid, marker)
    adopt_all([one], born_in, siblings)
    if one.error is not None:
        raise one.error


def adopt_all(
    adoptions: list[Adoption], born_in: str | None = None, siblings: Collection[int] = ()
) -> None:
    """Moves each just-spawned process into its cgroup, then every descendant it already started.

    Once a process is inside, its new children are born inside; the ones it had already are moved
    one by one (each move makes their own new children be born inside), so the walk ends. A
    descendant whose parent has already exited (a double-forked daemon started before the move, on
    a busy machine) is nobody's child any more: when ``born_in`` (the cgroup the processes were born
    in) and their markers are given, the processes still in ``born_in`` that are newer than one of
    them and carry its marker are moved too, until a pass finds none. One sweep serves them all
    (each candidate's environment is read once, however many processes are adopted). ``siblings``
    are processes known to be none's strays (the replicas spawned by the caller and not reaped
    yet): the sweep skips them, and it leaves out a process when every pid handed out since its own
    is a sibling's (nothing else was born since, so nothing escaped). A process that has
    ``exited`` (a zombie: the kernel would not move it, and its children were given away) is not
    moved; only its strays are looked for. A process that cannot be moved gets its ``error``; a
    descendant that exits meanwhile is skipped.
    """
    seen = {*siblings}
    seen.update(a.pid for a in adoptions)
    for a in adoptions:
        if not a.exited:
            try:
                move(a.cgroup, a.pid)
            except OSError as e:
                a.error = e
                continue
            # a process that has just exec'd has one thread (its task id is its pid)
            _move_tree(a.cgroup, _children_of_task(a.pid, a.pid), seen)
    if born_in is None:
        return
    # (read after the moves: what the moved ones start from now on is born inside)
    newest = last_pid()
    sweep = [
        a
        for a in adoptions
        if a.error is None and a.marker and not _only_siblings_since(a.pid, siblings, newest)
    ]
    if sweep:
        _move_strays(sweep, born_in, seen)


def _only_siblings_since(pid: int, siblings: Collection[int], newest: int | None) -> bool:
    """True when every pid the kernel handed out after ``pid`` up to ``newest`` (the last one
    handed out in this pid namespace) is one of ``siblings`` (none at all, without siblings)."""
    if newest is None or newest < pid or newest - pid > len(siblings):
        return False
    return all(p in siblings for p in range(pid + 1, newest + 1))


def _move_tree(cgroup: str, todo: list[int], seen: set[int]) -> None:
    while todo:
        child = todo.pop()
        if child in seen:
            continue
        seen.add(child)
        try:
            move(cgroup, child)
        except OSError:
            continue
        todo.extend(children(child))


#: Passes of the stray sweep at most (each pass moves what the last one found; strays that keep
#: forking faster than that are left to the marker scans of cancel and of the watchdog).
_STRAY_PASSES = 64


def _move_strays(adoptions: list[Adoption], born_in: str, seen: set[int]) -> None:
    """Moves into each adoption's cgroup the processes in ``born_in`` that carry its marker and are
    newer than its process (any pid once the pid counter has wrapped), and their descendants."""
    me = os.getpid()
    newest = last_pid()
    wrapped = newest is not None and any(newest < a.pid for a in adoptions)
    by_name: dict[bytes, dict[str, Adoption]] = {}
    for a in adoptions:
        name, _, raw = a.marker.partition(b"=")
        by_name.setdefault(name, {})[raw.decode("utf-8", "replace")] = a
    floor = 0 if wrapped else min(a.pid for a in adoptions)
    for _ in range(_STRAY_PASSES):
        data = read_file(os.path.join(born_in, "cgroup.procs"), None)
        found: dict[Adoption, list[int]] = {}
        for word in (data or b"").split():
            other = int(word)
            if other <= floor or other == me or other in seen:
                continue
            seen.add(other)  # (found or not: a process carries one environment)
            for name, by_value in by_name.items():
                found_value = marker_of(other, name)
                owner = None if found_value is None else by_value.get(found_value)
                if owner is not None and (wrapped or other > owner.pid):
                    found.setdefault(owner, []).append(other)
                    break
        if not found:
            return
        for owner, pids in found.items():
            seen.difference_update(pids)  # (for _move_tree, which marks what it moves)
            _move_tree(owner.cgroup, pids, seen)
    _log(
        "warning",
        "processes of pids %s keep appearing outside their cgroups; left to the marker scan",
        ", ".join(str(a.pid) for a in adoptions),
    )


def populated(cgroup: str) -> bool:
    """True while a process (not a zombie) is in ``cgroup`` or below; False when it is gone. True
    when that cannot be read but the cgroup is there (no descriptor left: its caller kills it
    rather than leave a process behind)."""
    path = os.path.join(cgroup, "cgroup.events")
    try:
        fd = _reserve.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True
    try:
        return b"populated 1" in os.read(fd, 256)
    except OSError:
        return True
    finally:
        os.close(fd)


def kill(cgroup: str) -> None:
    """SIGKILLs every process in ``cgroup`` and below (no-op when it is gone)."""
    try:
        write_file(os.path.join(cgroup, "cgroup.kill"), b"1")
    except FileNotFoundError:
        pass
    except OSError as e:
        _log("warning", "cgroup.kill of %s failed: %s", cgroup, e)


def remove_tree(cgroup: str) -> bool:
    """Removes ``cgroup`` and the (empty) cgroups below it; True when it is gone."""
    try:
        entries = list(os.scandir(cgroup))
    except FileNotFoundError:
        return True
    except OSError:
        return False
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            remove_tree(entry.path)
    try:
        os.rmdir(cgroup)
    except FileNotFoundError:
        return True
    except OSError as e:
        if e.errno not in (errno.EBUSY, errno.ENOTEMPTY):
            _log("debug", "cannot remove cgroup %s: %s", cgroup, e)
        return False
    return True


# -- processes ------------------------------------------------------------------------------------


def stat_of(pid: int | str) -> tuple[bytes, int] | None:
    """``(state letter, process group id)`` of ``pid``, or None when it does not exist."""
    data = read_file(f"/proc/{pid}/stat", 1024)
    if not data:
        return None
    try:
        fields = data[data.rindex(b")") + 2 :].split()
        return fields[0], int(fields[2])
    except (ValueError, IndexError):
        return None


#: How long an empty environment is read again while its process looks in the middle of an execve.
EXEC_WAIT = 0.1
_PF_KTHREAD = 0x00200000


def _between_images(pid: int | str) -> bool:
    """True when ``pid`` (whose environment and command line just read empty) is a live process
    that is not a kernel thread: one in the middle of an ``execve`` (or one exec'd with neither
    arguments nor environment)."""
    data = read_file(f"/proc/{pid}/stat", 1024)
    if not data:
        return False
    try:
        fields = data[data.rindex(b")") + 2 :].split()
        return fields[0] not in (b"Z", b"X") and not int(fields[6]) & _PF_KTHREAD
    except (ValueError, IndexError):
        return False


def environ_of(pid: int | str) -> bytes | None:
    """``pid``'s initial environment (None when it cannot be read: gone, or not ours to read).

    A process in the middle of an ``execve`` reads as an empty environment and an empty command
    line: the new image's strings are in place, their addresses not yet (measured here: 10-90 us,
    up to 8 ms on a busy machine). Such a read is repeated for up to ``EXEC_WAIT`` seconds, so a
    process caught between two images is not taken for one without a marker (a scan that did so
    would leave it running, or outside its cgroup).
    """
    path = f"/proc/{pid}/environ"
    deadline = None
    while True:
        env = read_file(path, None)
        if env or env is None:
            return env
        if read_file(f"/proc/{pid}/cmdline", 1):
            # arguments in place: the environment too (both are set at once), or it has none
            return read_file(path, None)
        if not _between_images(pid):  # a kernel thread, or a process exiting
            return env
        if deadline is None:
            deadline = time.monotonic() + EXEC_WAIT
        elif time.monotonic() > deadline:
            return env
        time.sleep(0.0002)


def marker_of(pid: int | str, name: bytes) -> str | None:
    """The value of environment variable ``name`` in ``pid``'s initial environment, if set."""
    env = environ_of(pid)
    if not env:
        return None
    key = name + b"="
    if env.startswith(key):
        start = len(key)
    else:
        at = env.find(b"\0" + key)
        if at < 0:
            return None
        start = at + 1 + len(key)
    end = env.find(b"\0", start)
    return env[start : end if end >= 0 else len(env)].decode("utf-8", "replace")


def last_pid() -> int | None:
    """The last pid the kernel handed out in this pid namespace (None if unknown)."""
    data = read_file("/proc/sys/kernel/ns_last_pid", 32)
    try:
        return int(data) if data else None
    except ValueError:
        return None


def live_processes(
    marker_name: bytes,
    prefixes: Collection[str] = (),
    pgids: Collection[int] = (),
    min_pid: int = 0,
    exact: Collection[str] = (),
) -> list[tuple[int, int, str | None]]:
    """The processes that are not zombies and either are in one of ``pgids`` or carry a marker
    equal to one of ``exact`` or starting with one of ``prefixes``: ``(pid, pgid, marker)`` each.

    ``min_pid`` skips older pids (a replica's descendants have larger pids than the replica unless
    the pid counter wrapped around, which is checked). This process is never listed.
    """
    me = os.getpid()
    newest = last_pid()
    if min_pid and newest is not None and newest < min_pid:
        min_pid = 0  # the counter wrapped: anyone may be a descendant
    prefix_tuple = tuple(prefixes)
    found: list[tuple[int, int, str | None]] = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        pid = int(name)
        if pid == me or pid < min_pid:
            continue
        st = stat_of(name)
        if st is None or st[0] in (b"Z", b"X"):
            continue
        marker = marker_of(name, marker_name) if prefix_tuple or exact else None
        if st[1] in pgids or (
            marker is not None and (marker in exact or marker.startswith(prefix_tuple))
        ):
            found.append((pid, st[1], marker))
    return found


def kill_pids(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    """Sends ``sig`` to each pid, ignoring the ones that are gone."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


def kill_groups(pgids: Iterable[int], sig: int) -> None:
    """Sends ``sig`` to each process group, ignoring the ones that are gone."""
    for pgid in pgids:
        with contextlib.suppress(OSError):
            os.killpg(pgid, sig)


def open_fds() -> int:
    """How many file descriptors this process has open (``/proc/self/fd``)."""
    try:
        size = os.stat("/proc/self/fd").st_size  # the count itself since Linux 6.2
        if size > 0:
            return size
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0
