"""What the launcher, its watchdog and other processes tell each other. Stdlib-only: the watchdog
(``python -I -S watchdog.py``) imports it as a sibling module.

**The replica marker.** Every replica starts with ``ASYNCTORCHX_REPLICA={app_id}/{role}/{k}`` in
its environment (set last: a role's ``env`` cannot override it), and its descendants inherit it.
It finds the processes of an app that are in no known process group or cgroup (see
``contain.py``).

**The watchdog's input**, one line per message on a pipe whose only writer is the launcher:

- ``A {json}``: an app is about to start; ``{"app": id, "grace": seconds, "cgroup": dir or
  null, "record": a minimal record, written if the launcher dies before writing the real one}``.
  Written to the pipe before its first replica is spawned.
- ``+ APP_ID PID``: a replica started; PID is also its process group id. Written right after the
  spawn, before anything else happens on the event loop.
- ``- APP_ID PID``: that replica's main process exited and was reaped.
- ``x APP_ID``: the app's terminal record is on disk (or the failed submit was undone): forget it.

**Process groups** are named ``PGID:START_TICKS`` (``group_spec``) in a cancel marker and on the
escalator's command line.

**Claims.** A launcher claims an app's id (``claim_app``: a hard link named after it) before it
registers the app or starts anything of it, so two launchers of one dry run cannot both start it;
the claim goes once the app's record is terminal. Each claim is a link of its launcher's holder
file, which the launcher and its watchdogs keep a shared ``flock`` on while they live: a claim
without a record whose lock nobody holds any more was left by a launcher killed before its
watchdog knew of the app, and is taken over by the next launcher of that dry run
(``take_stale_claim``). Until the app's record is written (when it starts), its claim alone
says that it is being submitted, to any process that finds the claim's lock held
(``recordfile.claim_holder``); the holder file holds what the launcher says of itself (its
backend and session, as JSON), for listings.

**Record files** (``write_record_file``) hold one JSON document per line, the last complete one
being the record (``recordfile.py`` reads them).

**Record locks.** A process other than a live launcher changes a record only under
``.{app_id}.lock`` (``locked_record``); whoever holds it and finds the record terminal removes the
lock file and the ``{app_id}.cancel`` marker, so neither outlives the app.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator

# (no typing or dataclasses at run time: the watchdog imports this module, and those two cost its
# start-up ~18 ms of processor time, a share of a core the first launches of its scheduler need)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Protocol
else:
    Protocol = object

MARKER_ENV = "ASYNCTORCHX_REPLICA"
MARKER_ENV_BYTES = MARKER_ENV.encode()


def replica_marker(app_id: str, role: str, replica_id: int) -> str:
    """The marker value of replica ``replica_id`` of ``role``."""
    return f"{app_id}/{role}/{replica_id}"


def app_marker_prefix(app_id: str) -> str:
    """What the marker of every replica of ``app_id`` starts with."""
    return f"{app_id}/"


def group_spec(pgid: int, start_ticks: int | None) -> str:
    """``PGID:START_TICKS``: a process group and when its leader started (0: unknown), as a cancel
    marker lists the groups it signalled and the escalator is told them."""
    return f"{pgid}:{start_ticks or 0}"


def parse_group_spec(spec: str | bytes) -> tuple[int, int] | None:
    """``(pgid, start_ticks)`` of a ``group_spec``, or None when it is not one (a bare pgid has
    ticks 0)."""
    text = spec.decode("ascii", "replace") if isinstance(spec, bytes) else spec
    group, _, ticks = text.strip().partition(":")
    if not group.isdigit() or (ticks and not ticks.isdigit()):
        return None
    return int(group), int(ticks or 0)


# -- watchdog lines --------------------------------------------------------------------------------


def app_line(
    app_id: str, grace: float, cgroup: str | None, record: dict[str, Any] | None = None
) -> bytes:
    """``A``: the app is about to start."""
    doc = json.dumps(
        {"app": app_id, "grace": grace, "cgroup": cgroup, "record": record},
        separators=(",", ":"),
        default=str,
    )
    return b"A " + doc.encode() + b"\n"


def start_line(app_id: str, pid: int) -> bytes:
    """``+``: a replica (and its process group) started."""
    return b"+ %s %d\n" % (app_id.encode(), pid)


def exit_line(app_id: str, pid: int) -> bytes:
    """``-``: a replica's main process was reaped."""
    return b"- %s %d\n" % (app_id.encode(), pid)


def forget_line(app_id: str) -> bytes:
    """``x``: the app is recorded as terminal (or undone); forget it."""
    return b"x %s\n" % app_id.encode()


class Message:
    """One parsed line: ``op`` is ``A``, ``+``, ``-`` or ``x``."""

    __slots__ = ("app_id", "cgroup", "grace", "op", "pid", "record")

    def __init__(
        self,
        op: str,
        app_id: str,
        pid: int = 0,
        grace: float = 0.0,
        cgroup: str | None = None,
        record: dict[str, Any] | None = None,
    ) -> None:
        self.op = op
        self.app_id = app_id
        self.pid = pid
        self.grace = grace
        self.cgroup = cgroup
        self.record = record

    def _fields(self) -> tuple[object, ...]:
        return (self.op, self.app_id, self.pid, self.grace, self.cgroup, self.record)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Message):
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]  # (holds a dict)

    def __repr__(self) -> str:
        return (
            "Message(op={!r}, app_id={!r}, pid={!r}, grace={!r}, cgroup={!r}, record={!r})".format(
                *self._fields()
            )
        )


def parse_line(raw: bytes) -> Message | None:
    """The message of one line (without its newline), or None when it is not one."""
    op, _, rest = raw.partition(b" ")
    try:
        if op == b"A":
            doc = json.loads(rest)
            cgroup, record = doc.get("cgroup"), doc.get("record")
            return Message(
                "A",
                str(doc["app"]),
                grace=float(doc["grace"]),
                cgroup=cgroup if isinstance(cgroup, str) else None,
                record=record if isinstance(record, dict) else None,
            )
        if op in (b"+", b"-"):
            app_id, pid = rest.split()
            return Message(op.decode(), app_id.decode("utf-8", "replace"), pid=int(pid))
        if op == b"x":
            return Message("x", rest.strip().decode("utf-8", "replace"))
    except (ValueError, KeyError, TypeError):
        return None
    return None


# -- record files ----------------------------------------------------------------------------------


def record_path(records_dir: str, app_id: str) -> str:
    """The record file of ``app_id``."""
    return os.path.join(records_dir, f"{app_id}.json")


def lock_path(records_dir: str, app_id: str) -> str:
    """The lock file that serialises changes to ``app_id``'s record by other processes."""
    return os.path.join(records_dir, f".{app_id}.lock")


def cancel_path(records_dir: str, app_id: str) -> str:
    """The marker whose presence means another process asked to cancel ``app_id``."""
    return os.path.join(records_dir, f"{app_id}.cancel")


#: The directory of the claims, in the records directory (apart: its changes wake no watcher of
#: the records, and a listing of the records does not read them).
CLAIMS_DIR = ".claims"
#: The file every claim was a hard link of before claims named their holder (older versions): a
#: claim of it cannot be told stale (no app id starts with a dot).
CLAIM_FILE = ".shared"
#: What the name of a launcher's holder file starts with, in ``CLAIMS_DIR``
#: (``.holder.{pid}.{start_ticks}.{token}``, for people: the lock says whether it lives).
HOLDER_PREFIX = ".holder."


#: The temporary names, in ``CLAIMS_DIR``, of a holder file being made and of a claim being taken
#: over.
_MAKING = ".new."
_TAKING = ".take."
_TEMPORARY = (_MAKING, _TAKING)


def claim_path(records_dir: str, app_id: str) -> str:
    """The claim of ``app_id``: a hard link of its launcher's holder file (``claim_app``)."""
    return os.path.join(records_dir, CLAIMS_DIR, app_id)


def make_holder(records_dir: str, name: str, says: bytes = b"") -> tuple[str, int] | None:
    """Creates a holder file ``HOLDER_PREFIX + name`` in ``CLAIMS_DIR`` holding ``says`` (what
    the launcher says of itself to other processes, which read it through any of its claims:
    ``recordfile.claim_holder``) and takes a shared ``flock`` on it; returns its path and the
    descriptor that holds the lock (close-on-exec: pass it to the watchdog, whose copy keeps the
    lock after the launcher died), or None when the file system has no ``flock`` (the claims are
    then files of their own, ``claim_app``). Raises OSError when the file cannot be made.
    """
    claims = os.path.join(records_dir, CLAIMS_DIR)
    with contextlib.suppress(FileExistsError):
        os.mkdir(claims, 0o700)
    path = os.path.join(claims, HOLDER_PREFIX + name)
    # locked before it has its name: ``drop_dead_holders`` never sees it unlocked
    tmp = os.path.join(claims, _MAKING + name)
    flags = os.O_RDONLY | os.O_CLOEXEC
    if says:
        # (written through a descriptor of its own: one kept open for writing would keep the file
        # system from being remounted read-only)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o400)
        try:
            with contextlib.suppress(OSError):  # (a full disk: the launcher says nothing)
                _write_all(fd, says)
        finally:
            os.close(fd)
    else:
        flags |= os.O_CREAT | os.O_EXCL
    try:
        fd = os.open(tmp, flags, 0o400)
    except BaseException:
        if says:
            _drop(tmp)
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.rename(tmp, path)
    except OSError as e:
        os.close(fd)
        _drop(tmp)
        if isinstance(e, BlockingIOError) or e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP):
            raise
        return None
    return path, fd


def claim_app(records_dir: str, app_id: str, holder: str | None) -> bool:
    """Claims ``app_id`` for the launcher of the holder file ``holder``; False when it is claimed
    already. Raises OSError (FileNotFoundError: ``holder`` or the directory is gone).

    A claim is a hard link of the launcher's holder file (``make_holder``) named after the app
    (``claim_path``): a link never replaces a file, so of two launchers scheduling one dry run at
    once one makes it and the other is told it exists; and it costs a directory entry (~12 us), no
    inode, so a burst of launches claims its ids on the event loop whatever the spare files left.
    Where there are no hard links (or no lock, ``holder`` None, or as many links as the file
    system allows) the claim is a file of its own, as exclusive but never taken over. The claim
    lasts until the app's record is terminal or its submit is undone (``drop_claim``); the
    launcher checks after claiming that the app has no record (a dry run scheduled before).
    """
    path = claim_path(records_dir, app_id)
    if holder is not None:
        try:
            os.link(holder, path)
            return True
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in _NO_LINK:
                raise
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    except FileExistsError:
        return False
    return True


#: What ``link`` fails with on a file system without hard links, or once the holder file has as
#: many links as the file system allows.
_NO_LINK = (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK)

#: ``take_stale_claim``: the claim is now the caller's.
TAKEN = "taken"
#: ``take_stale_claim``: a launcher or its watchdog that may still start or record the app holds it.
HELD = "held"
#: ``take_stale_claim``: who made the claim cannot be checked (a file of its own, or of an older
#: version).
UNKNOWN = "unknown"
#: ``take_stale_claim``: the claim went, or changed, meanwhile (claim again).
GONE = "gone"


def take_stale_claim(
    records_dir: str, app_id: str, holder: str, may_take: Callable[[], bool] = lambda: True
) -> str:
    """Makes the claim of ``app_id`` a link of ``holder`` when nobody holds the lock of the file it
    links any more and ``may_take()`` (called then) is true; returns ``TAKEN``, ``HELD`` (also when
    ``may_take()`` is false), ``UNKNOWN`` or ``GONE``. Raises OSError.

    The lock of a holder file is held by its launcher and by each of its watchdogs (which inherit
    it), so a lock nobody holds means that no process is left that could start the app or record
    it: the launcher died before its watchdog knew of the app. The exclusive lock taken to find
    that out is kept until the claim is replaced, and the claim is checked to still be the file
    locked: of two launchers taking one stale claim over at once, one does, the other is told
    ``GONE`` (and then finds the winner's claim ``HELD``). The caller checks that the app has no
    record (after), and no process left (``may_take``: a claim left so stays stale).
    """
    path = claim_path(records_dir, app_id)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return GONE
    except OSError as e:
        if e.errno in _NOT_A_SPARE:  # a symlink, a FIFO or a directory: not a claim we made
            return UNKNOWN
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink < 2 or _is_legacy(path, st):
            return UNKNOWN
        try:
            _lock_unless_held(fd)
        except BlockingIOError:
            return HELD
        except OSError:  # (no flock here)
            return UNKNOWN
        try:
            if os.lstat(path).st_ino != st.st_ino:
                return GONE
        except FileNotFoundError:
            return GONE
        if not may_take():
            return HELD
        taking = f"{_TAKING}{os.getpid()}.{threading.get_ident()}"
        tmp = os.path.join(os.path.dirname(path), taking)
        os.link(holder, tmp)
        # a cancel asked of the dead launcher's attempt is not this one's (one asked from now on,
        # of the app being submitted, is: the marker is dropped before the claim changes hands)
        _drop(cancel_path(records_dir, app_id))
        try:
            os.replace(tmp, path)
        except BaseException:
            _drop(tmp)
            raise
        return TAKEN
    finally:
        os.close(fd)


def _lock_unless_held(fd: int) -> None:
    """Takes the exclusive lock of the claim open as ``fd`` unless a launcher or watchdog holds its
    shared one (BlockingIOError then). A process asking whether the app is being submitted
    (``recordfile.claim_holder``) holds the exclusive lock of a stale claim for microseconds: the
    lock is tried again a few times, a millisecond apart, before the claim is said held."""
    for attempt in range(4):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if attempt == 3:
                raise
            time.sleep(0.001)


def _is_legacy(path: str, st: os.stat_result) -> bool:
    """True when the claim ``st`` (at ``path``) is a link of the older versions' ``CLAIM_FILE``."""
    try:
        legacy = os.stat(os.path.join(os.path.dirname(path), CLAIM_FILE))
    except OSError:
        return False
    return (legacy.st_dev, legacy.st_ino) == (st.st_dev, st.st_ino)


def drop_dead_holders(records_dir: str, keep: str | None) -> int:
    """Removes the holder files (but ``keep``) of launchers that are gone and left no claim, and
    the temporary names of a holder being made or a claim being taken over that their process
    left over a minute ago (it was killed in those microseconds); returns how many holders. A
    holder whose claims are left stays: it tells them stale."""
    claims = os.path.join(records_dir, CLAIMS_DIR)
    try:
        names = os.listdir(claims)
    except FileNotFoundError:
        return 0
    dropped = 0
    for name in names:
        path = os.path.join(claims, name)
        if name.startswith(_TEMPORARY):
            with contextlib.suppress(OSError):
                if time.time() - os.lstat(path).st_ctime > 60:
                    os.unlink(path)
            continue
        if not name.startswith(HOLDER_PREFIX) or path == keep:
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_nlink != 1:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # (a dead holder gets no new link: only its own launcher links it)
            os.unlink(path)
            dropped += 1
        except OSError:
            continue
        finally:
            os.close(fd)
    return dropped


def _is_compaction_tmp(name: str) -> bool:
    """True for the name of a compaction's temporary file, ``.{app_id}.{pid}.{thread}.tmp``, or
    of a cancel marker's, ``.{app_id}.cancel.{pid}.tmp`` (``records.RecordStore.mark_cancel``)."""
    if not (name.startswith(".") and name.endswith(".tmp")):
        return False
    parts = name[1:-4].rsplit(".", 2)
    if len(parts) != 3 or not parts[0] or not (parts[2].isascii() and parts[2].isdigit()):
        return False
    return parts[1] == "cancel" or (parts[1].isascii() and parts[1].isdigit())


def drop_compaction_leftovers(records_dir: str, older_than: float = 60.0) -> int:
    """Removes the temporary files of record compactions (and of cancel markers) whose writer was
    killed before it renamed or removed them (a compaction takes milliseconds: one older than ``older_than``
    seconds is a leftover); returns how many."""
    dropped = 0
    now = time.time()
    try:
        entries = list(os.scandir(records_dir))
    except FileNotFoundError:
        return 0
    for entry in entries:
        if not _is_compaction_tmp(entry.name):
            continue
        with contextlib.suppress(OSError):
            if entry.is_file(follow_symlinks=False) and now - entry.stat().st_mtime > older_than:
                os.unlink(entry.path)
                dropped += 1
    return dropped


def drop_claim(records_dir: str, app_id: str) -> None:
    """Removes the claim of ``app_id`` (its record is terminal, or its submit was undone). One that
    cannot be removed is left: it only refuses its dry run, which its record refuses anyway."""
    with contextlib.suppress(OSError):
        os.unlink(claim_path(records_dir, app_id))


@contextlib.contextmanager
def locked_record(records_dir: str, app_id: str) -> Iterator[None]:
    """Holds the lock of ``app_id``'s record (blocking; raises OSError if it cannot be created).

    A lock file can be removed while another process waits on it; the holder checks after locking
    that the file it locked is still the one at the path, and locks again otherwise.
    """
    path = lock_path(records_dir, app_id)
    while True:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            break
        os.close(fd)
    try:
        yield
    finally:
        os.close(fd)


def drop_lock_files(records_dir: str, app_id: str) -> None:
    """Removes the lock file, the cancel marker and the claim of a terminal app (call it holding
    the lock)."""
    paths = (lock_path(records_dir, app_id), cancel_path(records_dir, app_id))
    for path in (*paths, claim_path(records_dir, app_id)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


#: A record file is compacted (rewritten with only its latest version) when an append would make
#: it larger than this many bytes, or ``COMPACT_FACTOR`` times the new version if that is more.
COMPACT_SIZE = 65536
COMPACT_FACTOR = 4


def write_record_file(
    records_dir: str,
    app_id: str,
    data: bytes,
    spares: Spares | None = None,
) -> None:
    """Makes ``data`` (one JSON document, no newline in it) the record of ``app_id``. Raises OSError.

    Every writer of records calls this. The first version creates the file (mode 0600): given
    ``spares`` (``spares.SparePool``: empty files of this user's made ahead in ``records_dir``), it
    is written into a spare, which is then linked into
    place, so the record appears whole and no inode is allocated. Every
    version is appended as one line with a single ``write()`` on an ``O_APPEND`` descriptor, so a
    version after the first costs no new inode. In a file that is not empty the line starts with a
    newline, which ends a line torn by a writer that died or ran out of space (and the document of
    an old single-document file) so that readers skip it (``recordfile.read_document``). When the
    file would grow past ``COMPACT_SIZE`` (or ``COMPACT_FACTOR`` times ``data``), it is replaced by
    a file holding ``data`` alone instead.

    A file that holds one version (the first, or a compaction's) holds it padded with spaces to
    twice its size (``_with_room``), so that a later version finds room in place when the file
    system is full (below).

    Appenders hold a shared ``flock`` on the record file and the compaction an exclusive one, so no
    append lands in a file between the moment it is replaced and the moment its replacement is
    in place; an appender that finds its file replaced (no links left) appends to the new one, and
    one that finds it removed (the submit was undone) stops. A write that finds the file system
    full rewrites the record in place when ``data`` fits in the space the file already holds
    (padded with spaces, which JSON ignores); one that does not fit even so (long error texts) is
    written with those texts cut (``_with_texts_cut``): the app's state is never the part lost.
    """
    if b"\n" in data:
        raise ValueError(f"a record must be one line; the record of {app_id} has a newline")
    final = record_path(records_dir, app_id)
    line = b"\n" + data + b"\n"
    limit = max(COMPACT_SIZE, COMPACT_FACTOR * len(line))
    reopened = False
    compact = True
    while True:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC
        try:
            # (``spares is not None``: an empty pool is falsy, and a record made while it is empty
            # must still ask it for a spare, which counts towards the pool's growth)
            creating = not reopened and spares is None
            fd = os.open(final, flags | os.O_CREAT if creating else flags, 0o600)
        except FileNotFoundError:
            if reopened:
                return  # removed while this version was being written: the removal wins
            if spares is None:
                raise
            if _link_spare(spares, final, _with_room(data)):
                return
            spares = None  # none to be had: created the usual way
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            st = os.fstat(fd)
            if st.st_nlink == 0:
                reopened = True
                continue
            if compact and st.st_size + len(line) > limit:
                fcntl.flock(fd, fcntl.LOCK_UN)  # (the compaction's lock would wait for this one)
                if _compact(records_dir, app_id, final, data):
                    return
                # appended instead; the file was there, so if it is gone now it was removed (the
                # submit was undone): the removal wins, as for any reopening
                compact = False
                reopened = True
                continue
            try:
                _write_all(fd, line if st.st_size else _with_room(data))
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                if not _rewrite_in_place(final, fd, data):
                    cut = _with_texts_cut(data)
                    if cut is None or not _rewrite_in_place(final, fd, cut):
                        raise
            return
        finally:
            os.close(fd)


class Spares(Protocol):
    """Empty files made ahead (``spares.SparePool``)."""

    def take(self) -> str | None:
        """The path of a spare, now the caller's; None when there is none."""

    def lost(self) -> None:
        """The spares were found removed: forget them."""


def _link_spare(spares: Spares, final: str, content: bytes) -> bool:
    """Writes ``content`` into a spare file and links it to ``final``; False when there was no
    spare, or it could not be written or linked (``final`` exists now, the disk is full, or the
    directory is gone: the caller then goes the usual way, which says so).

    A spare that is not an empty-able regular file of its own is dropped and the next one taken:
    one a launcher linked to its record before it was killed (it is that record: emptying it would
    destroy another app's record), a symlink (writing through it would change the file it names),
    a FIFO (opening it would block) or a directory.
    """
    while (path := spares.take()) is not None:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | _SPARE_OPEN)
        except FileNotFoundError:
            spares.lost()
            return False
        except OSError as e:
            if e.errno not in _NOT_A_SPARE:
                return False
            _drop(path)
            continue
        try:
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                    _drop(path)
                    continue
                if st.st_size:  # written by a launcher that died before linking it
                    os.ftruncate(fd, 0)
                _write_all(fd, content)
            finally:
                os.close(fd)
            os.link(path, final)
        except OSError:
            _drop(path)
            return False
        _drop(path)
        return True
    return False


#: ``O_NOFOLLOW``: a spare that is a symlink is not written through; ``O_NONBLOCK``: one that is a
#: FIFO does not block the writer (no effect on a regular file).
_SPARE_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK
#: What opening a spare that is a symlink, a FIFO or a directory fails with.
_NOT_A_SPARE = (errno.ELOOP, errno.ENXIO, errno.EISDIR)


def _drop(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _compact(records_dir: str, app_id: str, final: str, data: bytes) -> bool:
    """Replaces the record file by one holding ``data`` alone, holding the file's exclusive lock
    (no append lands in the file being replaced); False when that could not be done (the caller
    then appends)."""
    tmp = os.path.join(records_dir, f".{app_id}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, _with_room(data))
        finally:
            os.close(fd)
        lock = os.open(final, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if os.fstat(lock).st_nlink == 0:  # replaced meanwhile: append to the new one
                os.unlink(tmp)
                return False
            os.replace(tmp, final)
        finally:
            os.close(lock)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return False
    return True


#: The least size of a record file holding one version (``_with_room``): a page's worth.
MIN_ROOM = 4000
#: How much of each message and structured error a version cut to fit a full disk keeps.
CUT_TEXT = 512


def _with_room(data: bytes) -> bytes:
    """``data`` as the only line of a record file: padded with spaces (which JSON ignores) to
    twice its size, at least ``MIN_ROOM``, so that the versions after it (an app's terminal one
    holds a little more: exit codes, times, its message) can be rewritten in place on a full disk
    (``_rewrite_in_place``)."""
    size = max(2 * (len(data) + 1), MIN_ROOM)
    return data + b" " * (size - len(data) - 1) + b"\n"


def _with_texts_cut(data: bytes) -> bytes | None:
    """The record ``data`` with its messages and structured errors (the app's and its replicas')
    cut to ``CUT_TEXT`` characters, saying so; None when nothing was cut (or it is not a record)."""
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    cut = False
    for holder in [doc, *(r for r in doc.get("replicas") or () if isinstance(r, dict))]:
        for key in ("msg", "structured_error_msg"):
            text = holder.get(key)
            if isinstance(text, str) and len(text) > CUT_TEXT:
                holder[key] = text[:CUT_TEXT] + " [... cut: the state root's file system was full]"
                cut = True
    return json.dumps(doc, separators=(",", ":")).encode() if cut else None


def _rewrite_in_place(path: str, locked: int, data: bytes) -> bool:
    """Overwrites the record file ``path`` (open as ``locked``) with ``data`` as its only line,
    padded with spaces to the file's size; False when that does not fit in the space the file holds
    or cannot be done."""
    try:
        fcntl.flock(locked, fcntl.LOCK_EX)
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)  # (pwrite on an O_APPEND file appends)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if st.st_ino != os.fstat(locked).st_ino:
            return False
        room = max(st.st_size, st.st_blocks * 512)
        if len(data) + 1 > room:
            return False
        padded = data + b" " * max(0, st.st_size - len(data) - 1) + b"\n"
        view = memoryview(padded)
        offset = 0
        while offset < len(padded):
            offset += os.pwrite(fd, view[offset:], offset)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
