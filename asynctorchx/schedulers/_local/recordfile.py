"""Reading app records without the scheduler: where they are, how one is read and parsed, and when
the app it describes is lost. Stdlib-only and standalone.

``records.py`` builds its typed records (``AppRecord``, ``ReplicaRecord``) on the parsing here, and
the CLI's read-only commands (``status``, ``describe``, ``list`` of local apps) use it directly: they
load this file by path, without importing the ``asynctorchx.schedulers`` package (and with it
asyncio and anyio), so that answering from one small file costs no event loop. Both therefore accept
the same documents, log the same warnings and find the same apps lost.

Parsed records are plain dicts of ``AppRecord``'s fields (``parse_app``), states given by name.

**The file format.** A record file holds the versions of the record, one JSON document per line
(``protocol.write_record_file`` appends each new version as a whole line, and now and then rewrites
the file with only the latest). The record is the last complete line: one ending in ``"\\n"`` that
is a JSON document. A last line without its ``"\\n"`` (a write caught halfway, or cut short by a
crash or a full disk) and a complete line that is not JSON (a torn line the next writer ended) are
skipped, and the version before them wins; blank lines are skipped. A file written before this
format (one JSON document and no newline) is read whole. A file with no complete version (empty:
created a moment ago and not yet written) is no record yet.

**Apps being submitted.** A launcher claims an app's id before it ships or starts anything of it,
and writes its record only once it starts it (``protocol.py``): an app whose claim's lock is held
but which has no record is being submitted (``claim_holder``, ``held_claims``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import time
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from stat import S_ISREG

# (no typing or dataclasses at run time: the watchdog imports this module; see protocol.py)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from pathlib import Path
    from typing import Any, TypeVar

    T = TypeVar("T")

ROOT_ENV = "ASYNCTORCHX_LOCAL_ROOT"
#: The states after which nothing changes (``AppState`` names).
TERMINAL_NAMES = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})
#: What a record holds where there is no structured error (``asynctorchx.specs.NONE``).
NONE = "<NONE>"
_APP_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")
#: The longest local app id (``submit_dryrun`` makes ids of at most 40): every file named after an
#: app must fit in a file name (255 bytes), the longest being the temporary file of a record's
#: compaction, ``.{app_id}.{pid}.{thread id}.tmp`` (34 bytes more).
MAX_APP_ID = 200
#: What parsing a corrupt record's fields (or the AppDef it holds) may raise.
PARSE_ERRORS = (KeyError, TypeError, ValueError, AttributeError, OverflowError, RecursionError)
#: A record file's complete lines that are not JSON read back from its end before it is called
#: corrupt (a record holds a few versions: compaction keeps it within about four of them).
MAX_CORRUPT_LINES = 16


def root_dir() -> str:
    """``$ASYNCTORCHX_LOCAL_ROOT`` (absolute), else ``{temp dir}/asynctorchx-{uid}``."""
    env = os.environ.get(ROOT_ENV)
    if env:
        return os.path.abspath(os.path.expanduser(env))
    import tempfile  # (and with it shutil, random: a few ms of the CLI's start-up)

    return os.path.join(tempfile.gettempdir(), f"asynctorchx-{os.getuid()}")


def default_root() -> Path:
    """``root_dir()`` as a path."""
    from pathlib import Path

    return Path(root_dir())


def records_dir(root: str | os.PathLike[str]) -> str:
    """The directory of the app records under the state root ``root``."""
    return os.path.join(root, ".apps")


def is_app_id(app_id: object) -> bool:
    """True when ``app_id`` can be the id of a local app (and so names files in the records dir:
    ``[A-Za-z0-9][A-Za-z0-9_.-]*``, at most ``MAX_APP_ID`` characters)."""
    return (
        isinstance(app_id, str)
        and len(app_id) <= MAX_APP_ID
        and _APP_ID_RE.fullmatch(app_id) is not None
    )


class StateRootError(OSError):
    """Raised when the records under the local state root cannot be read at all (no permission;
    a records directory, or a root, that is not a directory): the apps there are not known not to
    exist, so they must not be reported unknown. Its message names the state root, the path and
    ``ASYNCTORCHX_LOCAL_ROOT``, as a launch's error for an unusable root does. (A record that is
    not a regular file, a FIFO or a symbolic link, is no record: it is warned about and skipped.)"""


#: errno values that say the state root cannot be read as it is (rather than that a record is
#: missing, corrupt or not a regular file): a reader cannot tell what it holds.
ROOT_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.ENOTDIR})


def state_root_error(
    path: str | os.PathLike[str], e: OSError, doing: str = "read"
) -> StateRootError:
    """The ``StateRootError`` of ``e``, met when ``doing`` (``read``, ``write``) ``path``: the
    records directory or a file in it (the state root is the directory above it)."""
    path = os.fspath(path)
    records = path if os.path.basename(path) == ".apps" else os.path.dirname(path)
    root = os.path.dirname(records)
    why = e.strerror or str(e)
    return StateRootError(
        f"cannot use the local state root {root!r}: cannot {doing} {path!r}: {why} (set "
        f"{ROOT_ENV} or local_root= to a directory this user can {doing})"
    )


def list_ids(directory: str | os.PathLike[str]) -> list[str]:
    """The ids of every app recorded in the records directory ``directory`` (unchecked).

    Raises:
        StateRootError: the directory cannot be listed (no permission; not a directory).
        OSError: it cannot be listed for another reason (no file descriptor left...).
    """
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    except OSError as e:
        if e.errno in ROOT_ERRNOS:
            raise state_root_error(directory, e) from None
        raise
    return [n[:-5] for n in names if n.endswith(".json") and not n.startswith(".")]


#: The directory of the claims in the records directory (``protocol.CLAIMS_DIR``).
CLAIMS_DIR = ".claims"


def claim_holder(records_dir: str, app_id: str) -> dict[str, Any] | None:
    """What the launcher holding the claim of ``app_id`` says of itself (the JSON of its holder
    file, ``{"backend": ..., "session": ...}``; ``{}`` when it says nothing), or None when there
    is no claim or nobody holds its lock any more (its launcher and watchdog are gone: the claim is
    stale, and taken over by the next launch of the dry run) or it cannot be told (a claim of a
    file system without hard links or locks, or of an older version).

    The lock is probed with an exclusive ``flock`` that fails at once while a launcher or a
    watchdog holds its shared one; one that succeeds is let go at once (``take_stale_claim`` tries
    again when it meets it).
    """
    import fcntl
    import stat

    if not is_app_id(app_id):  # (it would name another file)
        return None
    path = os.path.join(records_dir, CLAIMS_DIR, app_id)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # held: by a launcher that may still start the app, or by its watchdog
        except OSError:
            return None
        else:
            return None
        data = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        said = json.loads(data) if data.strip() else {}
    except ValueError:
        said = {}
    return said if isinstance(said, dict) else {}


def held_claims(records_dir: str, recorded: Container[str]) -> dict[str, dict[str, Any]]:
    """``claim_holder`` of every app claimed in ``records_dir`` but not in ``recorded`` (the apps
    being submitted, without a record yet), by app id; one listing of the claims directory."""
    try:
        names = os.listdir(os.path.join(records_dir, CLAIMS_DIR))
    except OSError:
        return {}
    out = {}
    for name in names:
        if name in recorded:  # (the holder files, whose names start with a dot, are no app's)
            continue
        said = claim_holder(records_dir, name)
        if said is not None:
            out[name] = said
    return out


def log_warning(message: str, *args: object) -> None:
    """Logs a warning on this module's logger (``logging`` is imported at the first one)."""
    import logging

    logging.getLogger(__name__).warning(message, *args)


#: How much of the end of a record file a reader takes first (widened until it holds a document).
TAIL = 16384


class NoDocument(ValueError):
    """A record file holds no complete version: its first one is being written, or its writer died
    writing it."""


class EmptyRecord(NoDocument):
    """A record file is empty: created, its first version not written yet (or never)."""


def read_document(path: str | os.PathLike[str]) -> Any:
    """The latest JSON document of the record file ``path`` (see the module docstring), reading
    only as much of its end as that document takes.

    Raises:
        FileNotFoundError: there is no such file.
        NoDocument: the file holds no complete version (its first one is being written, or its
            writer died writing it); ``EmptyRecord`` when it is empty.
        ValueError: the file holds complete lines but none is a JSON document.
        OSError: it cannot be read, or is not a regular file (a FIFO there would block the
            open, or the read, for ever; a symbolic link is not followed).
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
        size = st.st_size
        if size == 0:
            raise EmptyRecord("the record file is empty")
        return _last_document(fd, size)
    finally:
        os.close(fd)


def _last_document(fd: int, size: int) -> Any:
    corrupt = 0
    lines = _LinesBackwards(fd, size)
    for line in lines:
        if line.strip():
            try:
                return json.loads(line)
            except (ValueError, RecursionError):  # (JSON nested too deep: RecursionError)
                corrupt += 1
                if corrupt >= MAX_CORRUPT_LINES:
                    break
    if corrupt:
        some = "no complete line" if corrupt < MAX_CORRUPT_LINES else f"none of the last {corrupt}"
        raise ValueError(f"{some} of the record file is a JSON document")
    if lines.unended is not None:  # a file written before the format: one document, whole
        with contextlib.suppress(ValueError, RecursionError):
            return json.loads(lines.unended)
    raise NoDocument("the first version of the record is not written (yet)")


class _LinesBackwards:
    """The complete lines of a file (without their newline), last first, read from its end in
    chunks that double in size, the first an eighth of the file (compaction keeps a file within
    about four versions, so the last one takes one or two reads); each line is copied once
    (``unended``: the whole content of a file without a newline, once the lines are exhausted)."""

    def __init__(self, fd: int, size: int) -> None:
        self._fd = fd
        self._size = size
        self.unended: bytes | None = None

    def __iter__(self) -> Iterator[bytes]:
        fd, pos, window = self._fd, self._size, max(TAIL, self._size // 8)
        pending: list[memoryview] = []  # the pieces of the line being gathered, its end first
        ended = False  # a newline was seen: what follows the last one is no line
        while pos > 0:
            first = max(0, pos - window)
            chunk = os.pread(fd, pos - first, first)
            if len(chunk) != pos - first:
                raise ValueError("the record file shrank while it was read")
            pos, window = first, window * 2
            view = memoryview(chunk)
            hi = len(chunk)
            while (nl := chunk.rfind(b"\n", 0, hi)) >= 0:
                if ended:
                    pending.append(view[nl + 1 : hi])
                    yield b"".join(reversed(pending))
                ended = True
                pending = []
                hi = nl
            pending.append(view[:hi])
        whole = b"".join(reversed(pending))
        if ended:
            yield whole
        else:
            self.unended = whole


def read_record(
    path: str | os.PathLike[str],
    parse: Callable[[Any], T],
    warn: Callable[..., None] = log_warning,
) -> T | None:
    """``parse`` of the latest document in the record file ``path`` (``read_document``), or None
    when there is none, it is not a regular file (a FIFO, a directory, a symbolic link), it cannot
    be read for want of a resource (``EIO``, ``EMFILE``...), or its first version is still being
    written.

    A file that holds no document ``parse`` accepts is read again twice, 2 ms apart: its first
    version may be being written, or it may have been caught halfway through an in-place rewrite
    (full disk). Unreadable and corrupt records are reported with ``warn(message, *args)``
    (``logging``'s arguments); an empty file is not reported, and is no record (a launcher killed
    between creating its record and writing it leaves one; its watchdog then writes the record).

    Raises:
        StateRootError: the record cannot be read for want of permission, or the records
            directory is not a directory (``ROOT_ERRNOS``): the app may well exist, so it is not
            called unknown.
    """
    for attempt in range(3):
        try:
            return parse(read_document(path))
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno in ROOT_ERRNOS:
                raise state_root_error(path, e) from None
            warn("cannot read app record %s: %s", path, e)
            return None
        except EmptyRecord:
            if attempt == 2:
                return None
        except ValueError as e:
            if attempt == 2:
                warn("ignoring corrupt app record %s: %s", path, e)
                return None
        time.sleep(0.002)
    return None


# -- parsing ---------------------------------------------------------------------------------------


class Owner:
    """The process that launched an app (and its watchdog), identified by pid and start time."""

    __slots__ = ("pid", "start_ticks", "watchdog_pid", "watchdog_start_ticks")

    def __init__(
        self,
        pid: int,
        start_ticks: int | None,
        watchdog_pid: int | None = None,
        watchdog_start_ticks: int | None = None,
    ) -> None:
        self.pid = pid
        self.start_ticks = start_ticks
        self.watchdog_pid = watchdog_pid
        self.watchdog_start_ticks = watchdog_start_ticks

    def _fields(self) -> tuple[int | None, ...]:
        return (self.pid, self.start_ticks, self.watchdog_pid, self.watchdog_start_ticks)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Owner):
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        return "Owner(pid={!r}, start_ticks={!r}, watchdog_pid={!r}, watchdog_start_ticks={!r})".format(
            *self._fields()
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "pid": self.pid,
            "start_ticks": self.start_ticks,
            "watchdog_pid": self.watchdog_pid,
            "watchdog_start_ticks": self.watchdog_start_ticks,
        }

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> Owner:
        """The owner ``to_json`` wrote."""
        return Owner(
            pid=int(d.get("pid", 0)),
            start_ticks=d.get("start_ticks"),
            watchdog_pid=d.get("watchdog_pid"),
            watchdog_start_ticks=d.get("watchdog_start_ticks"),
        )


def _state(name: Any, states: Container[str]) -> str:
    if name not in states:
        raise KeyError(name)
    return str(name)


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _checked(value: Any, kind: type, what: str) -> Any:
    """``value`` if it is a ``kind``; TypeError naming ``what`` otherwise (a corrupt record)."""
    if not isinstance(value, kind):
        raise TypeError(f"{what} is a {type(value).__name__}, not a {kind.__name__}")
    return value


def parse_replica(d: Mapping[str, Any], states: Container[str]) -> dict[str, Any]:
    """The fields of ``ReplicaRecord`` from its JSON; the state is a name, one of ``states``.

    Raises:
        KeyError, TypeError, ValueError, AttributeError: not a replica record.
    """
    return {
        "role": _checked(d["role"], str, "a replica's role"),
        "id": int(d["id"]),
        "state": _state(d.get("state", "UNKNOWN"), states),
        "pid": d.get("pid"),
        "start_ticks": d.get("start_ticks"),
        "exit_code": d.get("exit_code"),
        "attempts": int(d.get("attempts", 0)),
        "started_at": d.get("started_at"),
        "ended_at": d.get("ended_at"),
        "log_dir": d.get("log_dir", ""),
        "error_file": d.get("error_file", ""),
        "structured_error_msg": d.get("structured_error_msg", NONE),
    }


def parse_app(d: Any, states: Container[str]) -> dict[str, Any]:
    """The fields of ``AppRecord`` from its JSON: the state a name (one of ``states``), ``owner`` an
    ``Owner`` and ``replicas`` a list of ``parse_replica`` dicts.

    Raises:
        ValueError: the document is not an app record this version understands.
    """
    try:
        return {
            "app_id": _checked(d["app_id"], str, "the app id"),
            "name": _checked(d.get("name", ""), str, "the name"),
            "backend": _checked(d.get("backend", "local_cwd"), str, "the backend"),
            "session": _checked(d.get("session", ""), str, "the session"),
            "state": _state(d["state"], states),
            "msg": _checked(d.get("msg", ""), str, "the message"),
            "structured_error_msg": _checked(
                d.get("structured_error_msg", NONE), str, "the structured error"
            ),
            "num_restarts": int(d.get("num_restarts", 0)),
            "submitted_at": float(d.get("submitted_at", 0.0)),
            "ended_at": d.get("ended_at"),
            "app_dir": d.get("app_dir", ""),
            "grace_period": float(d.get("grace_period", 5.0)),
            "owner": Owner.from_json(d.get("owner") or {}),
            "replicas": [parse_replica(r, states) for r in d.get("replicas", [])],
            "app": _checked(d.get("app") or {}, dict, "the app"),
            "cgroup": _str_or_none(d.get("cgroup")),
        }
    except PARSE_ERRORS as e:
        raise ValueError(f"not an app record: {e!r}") from None


# -- processes and lost apps -----------------------------------------------------------------------


def proc_start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot), or None when it does not exist or is a zombie.

    Two processes with the same pid and start time are the same process, so this guards signals sent
    from another process against pid reuse.
    """
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    if not data:
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def pid_alive(pid: int, start_ticks: int | None = None) -> bool:
    """True when ``pid`` runs (not a zombie) and, if given, started at ``start_ticks``."""
    ticks = proc_start_ticks(pid)
    return ticks is not None and (start_ticks is None or ticks == start_ticks)


def lost_message(
    state: str, owner: Owner, replicas: Iterable[tuple[int | None, int | None]]
) -> str | None:
    """Why an app recorded in ``state`` is lost, or None when it is not.

    An app is lost when its record is not terminal but its launcher, its watchdog and all its
    replicas (``(pid, start_ticks)`` pairs) are gone: nobody is left to record how it ended.
    """
    if state in TERMINAL_NAMES:
        return None
    if pid_alive(owner.pid, owner.start_ticks):
        return None
    if owner.watchdog_pid and pid_alive(owner.watchdog_pid, owner.watchdog_start_ticks):
        return None
    if any(pid and pid_alive(pid, ticks) for pid, ticks in replicas):
        return None
    return (
        f"lost: its launching process (pid {owner.pid}) and watchdog exited without recording "
        "how it ended"
    )
