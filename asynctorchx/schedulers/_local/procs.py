"""Starting replicas in their own sessions, reading how they ended, and signalling their groups.

Replicas start with ``os.posix_spawn`` (vfork + exec, no Python in the child) when they run in the
launcher's current directory, and with ``subprocess.Popen`` otherwise (``posix_spawn`` cannot change
directory here). Either way the child is a session and process-group leader (``setsid``), its stdin
is ``/dev/null`` and its stdout/stderr are pipes. Exits are learnt from a pidfd (``os.pidfd_open``)
the event loop watches, so there is no watcher thread and no polling; the scheduler reaps the child
itself.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from asynctorchx.schedulers._local import contain
from asynctorchx.schedulers._local.recordfile import pid_alive as pid_alive
from asynctorchx.schedulers._local.recordfile import proc_start_ticks as proc_start_ticks

_RESET_SIGNALS = tuple(
    s for s in (getattr(signal, "SIGPIPE", None), getattr(signal, "SIGXFSZ", None)) if s is not None
)


class LaunchError(RuntimeError):
    """Raised when a local replica cannot be started (missing entrypoint, bad working directory,
    unwritable log directory, no file descriptors left); the submit that raised it leaves nothing
    running and nothing on disk."""


class LaunchSpecError(LaunchError):
    """Raised when the app or its run options cannot be launched as given (an entrypoint that is
    missing, a directory or not executable, a missing working directory, a ``log_dir`` that cannot
    be written): a usage error rather than a failure of the machine."""


#: errno values that say the launch was asked for something impossible (not that a resource ran out)
SPEC_ERRNOS = frozenset(
    {
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
        errno.ENOTDIR,
        errno.ENOENT,
        errno.EEXIST,
        errno.ENOEXEC,
        errno.ELOOP,  # (a symbolic link loop in the path)
        errno.ENAMETOOLONG,
        errno.E2BIG,  # (the arguments and environment exceed what exec takes)
    }
)
#: errno values that say this process (or the system) ran out of file descriptors
FD_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE})


def fd_exhaustion_message() -> str:
    """What to say when the launcher ran out of file descriptors."""
    soft = "?"
    try:
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        soft = "unlimited" if limit == resource.RLIM_INFINITY else str(limit)
    except (ValueError, OSError):
        pass
    return (
        f"this process ran out of file descriptors (limit {soft}, RLIMIT_NOFILE); "
        "raise it with `ulimit -n` or run fewer replicas at once"
    )


def launch_error(app_id: str, e: OSError, what: str, records_dir: object) -> LaunchError:
    """The LaunchError that says why ``what`` of app ``app_id`` could not be created or started
    (``records_dir`` is named when ``what`` is the app's record or claim, which are made there:
    a full file system is then said to be that one, not left to guess)."""
    why = e.strerror or str(e)
    if e.errno in FD_ERRNOS:
        return LaunchError(f"cannot start app {app_id!r}: {fd_exhaustion_message()}")
    full = " (its file system is full)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    if what == "the app's record":
        return LaunchError(
            f"cannot write the record of app {app_id!r} under {records_dir}: {why}{full}"
        )
    if full:
        where = f" in {records_dir}" if what == "the app's claim" and records_dir else ""
        return LaunchError(f"cannot create {what} of app {app_id!r}{where}: {why}{full}")
    if what.startswith("the log") and e.errno in SPEC_ERRNOS:
        return LaunchSpecError(
            f"cannot create {what} of app {app_id!r}: {why} "
            "(set the log_dir run option to a writable directory)"
        )
    return LaunchError(f"cannot create {what} of app {app_id!r}: {why}")


#: File descriptors a running replica holds in the launching process: two pipes, a pidfd, three
#: log files and the timing index (the last four opened before the others).
FDS_PER_REPLICA = 7
#: Of those, the ones opened with its log files (before it starts).
FDS_PER_REPLICA_FILES = 4
#: Descriptors an app's launch needs for a moment besides (a spawn's pipe write ends, records).
FDS_PER_LAUNCH = 4
#: Descriptors kept free for everything else in the process (the event loop, worker threads).
FD_SPARE = 32
_fd_reserved = 0  # descriptors promised to launches in progress (every scheduler of the process)


def raise_fd_limit() -> None:
    """Raises the soft limit of open files to the hard limit (up to 65536): each running replica
    holds ``FDS_PER_REPLICA`` descriptors (pipes, pidfd, log files)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        pass


def reserve_fds(app_id: str, replicas: int) -> int:
    """Promises the descriptors an app of ``replicas`` replicas needs, or raises LaunchError when
    they do not fit under RLIMIT_NOFILE with what is open and promised already."""
    global _fd_reserved
    need = FDS_PER_REPLICA * replicas + FDS_PER_LAUNCH
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ValueError, OSError):
        return 0
    if soft == resource.RLIM_INFINITY:
        return 0
    free = soft - FD_SPARE - contain.open_fds() - _fd_reserved
    if need > free:
        raise LaunchError(
            f"not enough file descriptors to start app {app_id!r}: its {replicas} replicas need "
            f"{need} in this process ({FDS_PER_REPLICA} each for their output pipes, pidfd and "
            f"log files), and only {max(free, 0)} of its limit of {soft} are free "
            "(RLIMIT_NOFILE: raise it with `ulimit -n`, or run fewer replicas at once)"
        )
    _fd_reserved += need
    return need


def release_fds(reserved: int) -> None:
    """Gives back descriptors ``reserve_fds`` promised (now open, or no longer needed)."""
    global _fd_reserved
    _fd_reserved -= reserved


@dataclass(frozen=True)
class Spawned:
    """A started replica: its pid (= its process group id), the read ends of its output pipes, and
    its start time in clock ticks since boot when the spawn pinned it down (None: read ``/proc``)."""

    pid: int
    stdout_fd: int
    stderr_fd: int
    start_ticks: int | None = None


def _tick_ns() -> int:
    try:
        hz = os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError):
        return 0
    return 10**9 // hz if hz > 0 and 10**9 % hz == 0 else 0


#: nanoseconds per clock tick of ``/proc/<pid>/stat``'s start time (0: not derivable here)
_TICK_NS = _tick_ns()
#: whether a derived start time matched ``/proc`` on this machine (None: not compared yet)
_derived_ticks_ok: bool | None = None


def spawned_ticks(pid: int, before_ns: int, after_ns: int) -> int | None:
    """The start time ``/proc/<pid>/stat`` gives a child forked between two ``CLOCK_BOOTTIME``
    readings, when both fall in the same clock tick; None when they do not (one spawn in ~80 here)
    or the derivation is not trusted on this machine.

    The kernel stamps a child with the boot-time clock while forking it and shows that stamp in
    whole ticks (rounded down), so a fork bracketed inside one tick started in that tick: the
    launch needs no ``/proc`` read (60-90 us on a busy loop) for the pid-reuse guard other processes
    check. (The stamp has been the boot-time clock, suspended time included, since Linux 3.17; the
    local backends need pidfds, 5.3+.) The first derivation in a process is compared with
    ``/proc``; a mismatch (an exotic kernel) turns the derivation off for good.
    """
    global _derived_ticks_ok
    if not _TICK_NS or _derived_ticks_ok is False:
        return None
    ticks = before_ns // _TICK_NS
    if after_ns // _TICK_NS != ticks:
        return None
    if _derived_ticks_ok is None:
        real = proc_start_ticks(pid)
        if real is None:  # gone already: nothing to compare with, try the next one
            return None
        _derived_ticks_ok = real == ticks
        return real
    return ticks


def check_cwd(cwd: str, role: str) -> None:
    """Raises LaunchSpecError unless ``cwd`` is a directory the replicas can enter."""
    if not os.path.isdir(cwd):
        raise LaunchSpecError(f"role {role!r}: working directory {cwd!r} does not exist")
    if not os.access(cwd, os.X_OK):
        raise LaunchSpecError(
            f"role {role!r}: working directory {cwd!r} cannot be entered (permission denied)"
        )


def resolve_executable(entrypoint: str, path: str, cwd: str, role: str) -> str:
    """The absolute path of the program ``entrypoint`` names, looked up like a shell would.

    A name with a ``/`` is taken relative to ``cwd``; a bare name is searched on ``path`` (the
    replica's PATH, relative entries taken relative to ``cwd``).

    Raises:
        LaunchSpecError: no executable file matches (names the role, entrypoint and where it looked).
    """
    if "/" in entrypoint:
        full = os.path.normpath(os.path.join(cwd, entrypoint))
        if os.path.isdir(full):
            raise LaunchSpecError(
                f"role {role!r}: entrypoint {entrypoint!r} is a directory ({full}), not a program"
            )
        if not os.path.isfile(full):
            raise LaunchSpecError(
                f"role {role!r}: entrypoint {entrypoint!r} does not exist (looked for {full})"
            )
        if not os.access(full, os.X_OK):
            raise LaunchSpecError(f"role {role!r}: entrypoint {full!r} is not executable")
        return full
    dirs = [d if os.path.isabs(d) else os.path.join(cwd, d) for d in path.split(os.pathsep) if d]
    found = shutil.which(entrypoint, path=os.pathsep.join(dirs))
    if found is None:
        raise LaunchSpecError(
            f"role {role!r}: entrypoint {entrypoint!r} was not found on the replica's PATH "
            f"({path}) or is not executable"
        )
    return os.path.abspath(found)


def spawn(
    executable: str,
    argv: Sequence[str],
    env: Mapping[bytes, bytes],
    cwd: str,
    stdin_fd: int,
) -> Spawned:
    """Starts one replica as a session leader with its stdout and stderr on new pipes.

    Raises:
        OSError: the program could not be executed (reported synchronously by exec).
    """
    out_r, out_w = os.pipe()
    try:
        err_r, err_w = os.pipe()
    except BaseException:
        os.close(out_r)
        os.close(out_w)
        raise
    before = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
    try:
        if cwd == os.getcwd() and min(out_w, err_w, stdin_fd) > 2:
            pid = os.posix_spawn(
                executable,
                list(argv),
                env,
                file_actions=[
                    (os.POSIX_SPAWN_DUP2, stdin_fd, 0),
                    (os.POSIX_SPAWN_DUP2, out_w, 1),
                    (os.POSIX_SPAWN_DUP2, err_w, 2),
                ],
                setsid=True,
                setsigdef=_RESET_SIGNALS,
                setsigmask=(),
            )
        else:
            proc = subprocess.Popen(
                list(argv),
                executable=executable,
                stdin=stdin_fd,
                stdout=out_w,
                stderr=err_w,
                cwd=cwd,
                env=dict(env),
                start_new_session=True,
            )
            pid = proc.pid
            # the scheduler reaps the child through its pidfd; stop Popen from reaping or warning
            proc.returncode = 0
        after = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
    except BaseException:
        for fd in (out_r, err_r):
            os.close(fd)
        raise
    finally:
        os.close(out_w)
        os.close(err_w)
    return Spawned(pid, out_r, err_r, spawned_ticks(pid, before, after))


def exit_code_of(result: os.waitid_result) -> int:
    """The exit code of a ``waitid`` result, negative for a signal (``subprocess`` convention)."""
    if result.si_code == os.CLD_EXITED:
        return result.si_status
    return -result.si_status


def reap(pid: int, pidfd: int) -> int | None:
    """Reaps an exited child after SIGKILLing what is left of its process group.

    The group is killed while the leader is still a zombie, so its id cannot have been reused.

    Returns:
        The exit code (negative: killed by that signal); None when the child has not exited (a
        spurious wake-up); -255 when something else already reaped it (the code is lost).
    """
    flags = os.WEXITED | os.WNOHANG
    try:
        peek = os.waitid(os.P_PIDFD, pidfd, flags | os.WNOWAIT)
    except ChildProcessError:
        return -255
    if peek is None:
        return None
    kill_group(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitid(os.P_PIDFD, pidfd, flags)
    return exit_code_of(peek)


def kill_group(pgid: int, sig: int) -> bool:
    """Sends ``sig`` to process group ``pgid``; False when the group does not exist (any more)."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def kill_and_reap_now(pid: int) -> None:
    """SIGKILLs a just-started replica's group and waits for it (failed-submit clean-up)."""
    kill_group(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
