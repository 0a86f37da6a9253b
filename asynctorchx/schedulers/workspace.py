"""Shipping a workspace: the file-system half of workspaces, shared by every backend.

``asynctorchx.specs.workspace.Workspace`` says which directories make a workspace; this module reads
them. No backend walks, hashes, tars or copies a workspace by itself:

- ``scan_workspace`` walks each project, applies its ignore file (``.dockerignore`` for images,
  ``.torchxignore`` for directory copies) and hashes every included file. The ``WorkspaceScan`` it
  returns is what a dry run shows (files, bytes, content hash) and what content-addressed names
  (image tags, snapshot directories) are made from.
- ``write_tar`` streams the scanned files as a tar (a Docker build context); ``copy_scan`` copies
  them into a directory (reflinks where the file system offers them). Both check that every file
  still has the bytes it was hashed with, so a name never stands for content it does not hold.
- ``WorkspacePlan`` is what a backend will do with a workspace (the dry run prints it);
  ``WorkspaceEvent`` a step of doing it, for the progress callback (``reporting``).
- ``SingleFlight`` runs one build per key however many submits ask for it at once.

Ignore files use the ``.dockerignore`` syntax, matched as the Docker CLI does: one pattern per line,
``#`` at the start of a line for a comment, ``!`` to re-include, ``*``/``?``/``[...]`` within a path
component, ``**`` across components. Patterns are anchored at the project's root (``*.pyc`` matches
only top-level files; ``**/*.pyc`` matches at any depth) and a pattern that matches a directory
excludes everything below it. Matching is done by ``pathspec``'s gitignore patterns, anchored and
with trailing slashes dropped, which gives Docker's rules; the differences are in edge cases only:
``**`` inside a component (``a**b``) does not cross ``/`` here (Docker's does), and an unclosed
``[`` is a literal here (Docker rejects the file). As in the Docker CLI, an excluded directory is
not entered unless a ``!`` pattern starts with its path, so ``!**/keep`` does not re-include a file
inside an excluded directory, but ``!build/keep`` does.

TorchX reads the same files differently: each pattern is an ``fnmatch`` of the whole path, whose
``*`` crosses ``/`` (``*.pt`` leaves out ``ckpt/a/b.pt`` too), and ``#`` starts a comment anywhere
on a line. A scan warns, naming the pattern and a few of the files, when it ships what TorchX's
reading would have left out, so that a TorchX user's ignore file never ships checkpoints silently
(``**/*.pt`` means the same in both readings).

The functions here block (they read and hash files): async code calls them through
``run_in_thread``, which stops them between files and 1 MB pieces when the caller is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import errno
import fcntl
import fnmatch
import hashlib
import logging
import os
import posixpath
import re
import stat
import tarfile
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Generic, TypeVar

import anyio.from_thread
import anyio.to_thread

from asynctorchx._tasks import TaskSupervisor, wait_held
from asynctorchx.specs.workspace import InvalidWorkspaceException, Workspace

__all__ = [
    "DEFAULT_DOCKERFILE",
    "DOCKERIGNORE",
    "TORCHXIGNORE",
    "TORCHX_DOCKERFILE",
    "IgnoreRules",
    "SingleFlight",
    "WorkspaceBuildError",
    "WorkspaceChangedError",
    "WorkspaceCopyError",
    "WorkspaceEntry",
    "WorkspaceEvent",
    "WorkspacePlan",
    "WorkspaceScan",
    "copy_scan",
    "read_shipped",
    "remove_tree",
    "report",
    "reporting",
    "scan_workspace",
    "write_tar",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

DOCKERIGNORE = ".dockerignore"
TORCHXIGNORE = ".torchxignore"
TORCHX_DOCKERFILE = "Dockerfile.torchx"

#: The recipe of a workspace image when the workspace has no ``Dockerfile.torchx`` (TorchX's).
DEFAULT_DOCKERFILE = b"ARG IMAGE\nFROM $IMAGE\n\nCOPY . .\n"

_HASH_VERSION = b"asynctorchx-workspace-v1"
_CHUNK = 1 << 20
# A file changed less than this long before it was hashed may change again without its timestamps
# moving (they tick coarsely): its stat is not trusted to stand for its bytes (git's "racy" rule).
_RACY_SECONDS = 2.0
_HASH_CACHE_SIZE = 200_000
# Smaller files are copied even where reflinks work: measured on XFS, a clone of a 50 kB file
# costs more than copying it (a transaction per clone), while a 200 MB file clones in no time.
_CLONE_MIN_BYTES = 256 * 1024


class WorkspaceBuildError(RuntimeError):
    """Raised when a workspace image cannot be built or pushed (a failing ``Dockerfile.torchx``, a
    registry that refuses the push). Nothing was launched.

    Attributes:
        log_tail: the last lines of the build's (or push's) output, for a CLI to show.
    """

    def __init__(self, message: str, log_tail: Sequence[str] = ()) -> None:
        self.log_tail = list(log_tail)
        super().__init__(message)


class WorkspaceChangedError(InvalidWorkspaceException):
    """Raised when a workspace file changed between being hashed and being shipped (submit again)."""


@contextlib.contextmanager
def _leave_out_hint(ignore_file: str) -> Iterator[None]:
    """Adds to a WorkspaceChangedError raised inside how to ship a workspace with a file that is
    always being written (a job's log in the project directory fails every submit: "submit again"
    alone never helps)."""
    try:
        yield
    except WorkspaceChangedError as e:
        raise WorkspaceChangedError(
            f"{e} (a file that is always being written, a log say, can be left out with "
            f"{ignore_file})"
        ) from None


class WorkspaceCopyError(OSError):
    """Raised when a copy of a workspace cannot be written where it goes (a full disk, a read-only
    file system): the message names the destination and the file being written, which a bare
    ``OSError`` from deep inside the copy did not. Nothing of the copy is left behind.

    ``errno`` is the error of the write (``ENOSPC`` for a full disk).
    """

    def __str__(self) -> str:
        return str(self.strerror)


def copy_error(e: OSError, what: str, where: str, path: str = "") -> WorkspaceCopyError:
    """The WorkspaceCopyError of ``e``, raised while ``what`` (e.g. ``copy workspace /src``) was
    written into ``where``; ``path`` is the file or directory being written, if known."""
    at = f" (writing {path!r})" if path else ""
    return WorkspaceCopyError(e.errno, f"cannot {what} into {where!r}: {e.strerror or e}{at}")


# -- ignore rules -----------------------------------------------------------------------------------


#: A ``#`` after a space inside a pattern: a comment in TorchX's reading, a character in Docker's.
_TRAILING_COMMENT = re.compile(r"\s#")
#: A pattern with one of these reads differently in TorchX (``fnmatch``: ``*`` crosses ``/``).
_GLOB = re.compile(r"[*?\[]")


class IgnoreRules:
    """The patterns of one ignore file (dockerignore syntax; see the module docstring).

    Args:
        lines: the file's lines.
        source: where they come from (for error messages).
    """

    def __init__(self, lines: Sequence[str] = (), source: str = "") -> None:
        from pathspec.patterns.gitignore.basic import GitIgnoreBasicPattern

        self.source = source
        self._patterns: list[tuple[str, bool, Any]] = []
        #: every pattern as TorchX reads it (``fnmatch`` of the whole path), when one is a glob
        self._torchx: list[tuple[str, bool, re.Pattern[str]]] = []
        for number, raw in enumerate(lines, 1):
            line = raw.lstrip("\ufeff") if number == 1 else raw
            if line.startswith("#"):
                continue
            text = line.strip()
            if not text:
                continue
            if _TRAILING_COMMENT.search(text):
                logger.warning(
                    "%s line %d: %r is one pattern: '#' starts a comment only at the start of a "
                    "line, as in .dockerignore (TorchX read the rest of the line as a comment); "
                    "put the comment on a line of its own",
                    source or "ignore file",
                    number,
                    text,
                )
            include = text.startswith("!")
            if include:
                text = text[1:].strip()
            text = posixpath.normpath(text) if text else text
            if len(text) > 1 and text.startswith("/"):
                text = text.lstrip("/")
            if text in ("", ".", "/"):
                continue
            try:
                pattern = GitIgnoreBasicPattern("/" + text)
            except ValueError as e:  # pathspec's GitIgnorePatternError
                raise InvalidWorkspaceException(
                    f"{source or 'ignore file'} line {number}: bad pattern {raw.strip()!r} ({e})"
                ) from None
            if pattern.regex is None:
                continue
            self._patterns.append((text, include, pattern.regex))
            self._torchx.append((text, include, re.compile(fnmatch.translate(text))))
        if not any(_GLOB.search(text) for text, _, _ in self._torchx):
            self._torchx = []  # without a glob both readings agree
        self._torchx_dirs: dict[str, str | None] = {}

    @classmethod
    def load(cls, directory: str, name: str) -> IgnoreRules:
        """The rules of ``directory/name`` (no rules when the file does not exist).

        Raises:
            InvalidWorkspaceException: the file cannot be read, is not a regular file (a FIFO
                would block the read forever), or holds a bad pattern.
        """
        path = os.path.join(directory, name)
        try:
            # O_NONBLOCK: a FIFO must not block the open forever (nor a device be read endlessly)
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return cls((), path)
        except OSError as e:
            raise InvalidWorkspaceException(
                f"ignore file {path!r} cannot be read: {e.strerror or e}"
            ) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise InvalidWorkspaceException(
                    f"ignore file {path!r} is not a regular file (a FIFO, a device or a directory)"
                )
            with os.fdopen(fd, encoding="utf-8", errors="surrogateescape", closefd=False) as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise InvalidWorkspaceException(
                f"ignore file {path!r} cannot be read: {e.strerror or e}"
            ) from None
        finally:
            os.close(fd)
        return cls(lines, path)

    def __bool__(self) -> bool:
        return bool(self._patterns)

    def excluded(self, rel: str) -> bool:
        """True when ``rel`` (a path relative to the project, ``/``-separated) is excluded.

        The last pattern that matches the path or one of its parent directories decides.
        """
        for _, include, regex in reversed(self._patterns):
            if regex.match(rel):
                return not include
        return False

    def torchx_excludes(self, rel: str) -> str | None:
        """The pattern under which TorchX would leave out ``rel`` (a path these rules include), or
        None when TorchX would ship it too.

        TorchX matches each pattern against the whole path with ``fnmatch`` (its ``*`` crosses
        ``/``), the last matching pattern deciding, and does not enter a directory it leaves out.
        Only a path below a directory can be read differently.
        """
        if not self._torchx or "/" not in rel:
            return None
        parent = rel.rpartition("/")[0]
        if parent in self._torchx_dirs:
            up = self._torchx_dirs[parent]
        else:
            up = self.torchx_excludes(parent) if "/" in parent else self._torchx_decides(parent)
            self._torchx_dirs[parent] = up
        return up if up is not None else self._torchx_decides(rel)

    def _torchx_decides(self, rel: str) -> str | None:
        for text, include, regex in reversed(self._torchx):
            if regex.match(rel):
                return None if include else text
        return None

    def may_include_below(self, rel_dir: str) -> bool:
        """True when a ``!`` pattern starts with ``rel_dir/`` (the Docker CLI then enters the
        excluded directory to look for files it re-includes)."""
        prefix = rel_dir + "/"
        return any(
            include and (text + "/").startswith(prefix) for text, include, _ in self._patterns
        )


# -- scanning ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkspaceEntry:
    """One thing a workspace ships.

    Args:
        path: where it goes, relative to the target root (``/``-separated).
        source: the absolute path it is read from.
        kind: ``"file"``, ``"dir"`` or ``"symlink"``.
        mode: its permission bits.
        size: its size in bytes (files; 0 otherwise).
        digest: the sha256 of a file's bytes, or a symlink's target; ``""`` for directories.
        link: a symlink's target.
        mtime: its modification time (seconds), kept in tar members.
        stat_key: (device, inode, size, mtime_ns, ctime_ns) when it was hashed.
        racy: it changed too recently before it was hashed for its stat to vouch for its bytes.
        mtime_ns: its modification time in nanoseconds, kept exactly in copies: a snapshot's file
            whose time is no longer its workspace file's, to the nanosecond, has been written
            since it was copied (``_intact``). 0 when unknown (``mtime`` is used then).
    """

    path: str
    source: str
    kind: str
    mode: int
    size: int = 0
    digest: str = ""
    link: str = ""
    mtime: float = 0.0
    stat_key: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)
    racy: bool = False
    mtime_ns: int = 0

    @property
    def copy_mtime_ns(self) -> int:
        """The modification time its copies get (nanoseconds)."""
        return self.mtime_ns or round(self.mtime * 1e9)


@dataclass(frozen=True)
class WorkspaceScan:
    """The included contents of a workspace, hashed.

    Args:
        workspace: the workspace.
        ignore_file: the ignore file honoured (``.dockerignore`` or ``.torchxignore``).
        entries: what is shipped, sorted by path.
        digest: the sha256 of every entry's path, kind, mode and bytes (hex).
    """

    workspace: Workspace
    ignore_file: str
    entries: tuple[WorkspaceEntry, ...]
    digest: str

    @property
    def files(self) -> int:
        """How many regular files are shipped."""
        return sum(1 for e in self.entries if e.kind == "file")

    @property
    def total_bytes(self) -> int:
        """The size of every shipped file, in bytes."""
        return sum(e.size for e in self.entries)

    def get(self, path: str) -> WorkspaceEntry | None:
        """The entry shipped at ``path``, if any."""
        for e in self.entries:
            if e.path == path:
                return e
        return None


class _HashCache:
    """sha256 of files by path, trusted while the file's (device, inode, size, mtime, ctime) stay."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict[str, tuple[tuple[int, int, int, int, int], str]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, path: str, key: tuple[int, int, int, int, int]) -> str | None:
        with self._lock:
            hit = self._items.get(path)
            if hit is None or hit[0] != key:
                return None
            self._items.move_to_end(path)
            return hit[1]

    def put(self, path: str, key: tuple[int, int, int, int, int], digest: str) -> None:
        with self._lock:
            self._items[path] = (key, digest)
            self._items.move_to_end(path)
            while len(self._items) > self._size:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


_hash_cache = _HashCache(_HASH_CACHE_SIZE)
_scan_locks: dict[tuple[Any, ...], threading.Lock] = {}
_scan_locks_guard = threading.Lock()


def clear_hash_cache() -> None:
    """Forgets every remembered file hash (the next scan reads every file again)."""
    _hash_cache.clear()


def _stat_key(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _unreadable(path: str, e: OSError, what: str = "file") -> InvalidWorkspaceException:
    return InvalidWorkspaceException(f"workspace {what} {path!r} cannot be read: {e.strerror or e}")


class _Cancelled(Exception):
    """Raised in a worker thread of ``run_in_thread`` whose caller was cancelled."""


_stop: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "asynctorchx_workspace_stop", default=None
)


def _check_cancelled() -> None:
    """Raises when the task waiting on this worker thread was cancelled.

    Reading a large workspace takes a while (a 20 GB file hashes in ~50 s): checked between
    files and between 1 MB pieces, Ctrl+C (or any cancelled submit) ends the read at once
    instead of when the whole workspace has been read, and a copy being made is removed.
    Outside a worker thread it does nothing.
    """
    stop = _stop.get()
    if stop is not None and stop.is_set():
        raise _Cancelled("the submit was cancelled")
    try:
        anyio.from_thread.check_cancelled()
    except RuntimeError:  # not an anyio worker thread: a synchronous caller
        pass


async def run_in_thread(func: Callable[..., T], *args: Any, wait_on_cancel: bool = False) -> T:
    """``func(*args)`` in a worker thread that stops reading or copying a workspace when the
    caller is cancelled, by anyio or by ``Task.cancel()`` (which ``anyio.to_thread`` alone does
    not pass on: its thread would go on, reading a whole workspace after Ctrl+C, or finishing a
    copy nobody removes).

    With ``wait_on_cancel``, a caller that is cancelled (or fails) returns only once the thread
    has stopped (at its next check, with both kinds of cancellation held off meanwhile), so that
    what the caller removes next is not made again behind its back: a cancelled ``local_dir``
    submit removes the app's directory that its thread was linking. Only for functions that
    check for cancellation often (``_check_cancelled``): the caller waits as long as the thread
    runs.
    """
    stop = threading.Event()
    loop = asyncio.get_running_loop()
    started = threading.Event()
    ended: asyncio.Future[None] = loop.create_future()

    def call() -> T:
        started.set()
        try:
            if stop.is_set():  # cancelled before the thread got to it: nothing is done
                raise _Cancelled("the submit was cancelled")
            return func(*args)
        finally:
            with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody waits
                loop.call_soon_threadsafe(_resolve, ended)

    token = _stop.set(stop)  # the worker runs in a copy of this context
    try:
        return await anyio.to_thread.run_sync(call)
    except BaseException:
        stop.set()
        # (started is set before the thread looks at stop: a thread not started by now never
        # runs func, and one that has ends soon and resolves ended)
        if wait_on_cancel and started.is_set():
            late = await wait_held(ended)
            if late is not None:  # cancelled while it waited: the cancellation wins
                raise late from None
        raise
    finally:
        _stop.reset(token)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


# O_NONBLOCK: a file replaced by a FIFO after it was listed must not block its open forever (on a
# regular file the flag does nothing). O_NOFOLLOW: nor may it have become a symlink.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def _open_shipped(entry: WorkspaceEntry) -> BinaryIO:
    """``entry``'s file, opened for reading, which must still be a regular file.

    Raises:
        WorkspaceChangedError: it is gone, or is no longer a regular file.
    """
    try:
        fd = os.open(entry.source, _READ_FLAGS)
    except OSError as e:
        raise WorkspaceChangedError(
            f"workspace file {entry.source!r} cannot be read any more ({e.strerror or e}); "
            "submit again"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise WorkspaceChangedError(
            f"workspace file {entry.source!r} is no longer a regular file; submit again"
        )
    return os.fdopen(fd, "rb")


def read_shipped(entry: WorkspaceEntry) -> bytes:
    """The bytes of ``entry``'s file (a small one: a recipe), which must be those it was hashed
    with. A file replaced by a FIFO since is an error, never an open that waits for a writer.

    Raises:
        WorkspaceChangedError: it is gone, no longer a regular file, or holds other bytes.
        InvalidWorkspaceException: it cannot be read.
    """
    with _open_shipped(entry) as f:
        try:
            data = f.read()
        except OSError as e:
            raise _unreadable(entry.source, e) from None
    if hashlib.sha256(data).hexdigest() != entry.digest:
        raise WorkspaceChangedError(
            f"workspace file {entry.source!r} changed after it was hashed; submit again"
        )
    return data


def _hash_file(path: str, expected: os.stat_result) -> tuple[str, os.stat_result]:
    """The sha256 of a file's bytes, and its stat (taken from the open file).

    Raises:
        FileNotFoundError: the file was removed.
        InvalidWorkspaceException: it cannot be read.
        WorkspaceChangedError: it is no longer the file that was listed.
    """
    h = hashlib.sha256()
    try:
        fd = os.open(path, _READ_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise _unreadable(path, e) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_ino != expected.st_ino:
            raise WorkspaceChangedError(f"workspace file {path!r} changed while it was read")
        with os.fdopen(fd, "rb", closefd=False) as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                _check_cancelled()
    except OSError as e:
        raise _unreadable(path, e) from None
    finally:
        os.close(fd)
    return h.hexdigest(), st


def check_directory(path: str) -> None:
    """Raises InvalidWorkspaceException unless ``path`` is an existing, readable directory."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise InvalidWorkspaceException(f"workspace directory {path!r} does not exist") from None
    except OSError as e:
        raise _unreadable(path, e, "directory") from None
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidWorkspaceException(
            f"workspace {path!r} is not a directory (a workspace is a directory of files)"
        )


def check_literal_names(workspace: Workspace) -> None:
    """Refuses a workspace whose string names an existing directory that the multi-project syntax
    read otherwise (``Workspace.literal_names``): ``exp,v2`` read as two directories, or
    ``runs/exp-10:30`` as ``runs/exp-10`` going to ``30/``. Shipping another directory than the
    one named, silently, is worse than an error naming the ``file://`` URL that names it.

    Raises:
        InvalidWorkspaceException: such a directory exists.
    """
    for given, path in workspace.literal_names:
        if os.path.isdir(path):
            from urllib.parse import quote

            reading = (
                "several directories separated by ','"
                if "," in given
                else "DIR:SUBDIR (a directory going to a sub-directory)"
            )
            raise InvalidWorkspaceException(
                f"workspace {given!r} is a directory, but is read as {reading}: to ship the "
                f"directory itself, give it as file://{quote(path)} (to map a directory to a "
                "sub-directory, write DIR/:SUBDIR)"
            )


def _walk(
    root: str,
    rules: IgnoreRules,
    keep: frozenset[str],
    skip: frozenset[tuple[int, int]],
    skip_marker: str | None,
) -> Iterator[tuple[str, str, os.stat_result]]:
    """``(relative path, absolute path, lstat)`` of everything included under ``root``, except
    the directories whose (device, inode) is in ``skip`` or that hold a ``skip_marker`` file.

    What is removed while it is walked (an editor's swap or test file) is left out, as a walk made
    a moment later would.
    """
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        abs_dir = os.path.join(root, rel_dir) if rel_dir else root
        items = []
        try:
            with os.scandir(abs_dir) as it:
                for e in it:
                    with contextlib.suppress(FileNotFoundError):
                        items.append((e.name, e.path, e.stat(follow_symlinks=False)))
        except (FileNotFoundError, NotADirectoryError) as e:
            if not rel_dir:
                raise _unreadable(abs_dir, e, "directory") from None
            continue  # removed (or replaced by a file) since its parent was listed
        except OSError as e:
            raise _unreadable(abs_dir, e, "directory") from None
        items.sort()
        below: list[str] = []
        for name, path, st in items:
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if stat.S_ISDIR(st.st_mode):
                if (st.st_dev, st.st_ino) in skip or (
                    skip_marker and os.path.lexists(os.path.join(path, skip_marker))
                ):
                    continue
                if rules.excluded(rel):
                    if rules.may_include_below(rel):
                        below.append(rel)
                    continue
                yield rel, path, st
                below.append(rel)
            elif stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                if rel in keep or not rules.excluded(rel):
                    yield rel, path, st
            else:
                logger.debug("workspace: skipping %s (not a file, directory or symlink)", path)
        stack.extend(reversed(below))


def scan_workspace(
    workspace: Workspace,
    ignore_file: str,
    *,
    keep: Sequence[str] = (),
    skip_dirs: Sequence[str] = (),
    skip_marker: str | None = None,
) -> WorkspaceScan:
    """Walks and hashes the included contents of every project of ``workspace``.

    Args:
        workspace: the workspace.
        ignore_file: the name of the ignore file each project may have at its root.
        keep: paths (relative to a project) included even when the ignore file excludes them
            (``Dockerfile.torchx``, which the Docker CLI always sends, as TorchX does).
        skip_dirs: directories never shipped when a project contains them: the backend's own
            state (a state root holding logs that grow and the snapshots made before, which each
            snapshot would otherwise copy again). Told apart by device and inode, so any path to
            them counts.
        skip_marker: directories holding a file of this name are never shipped either (the job
            directories a backend made earlier inside the workspace, which it marks so).

    Raises:
        InvalidWorkspaceException: a directory is missing, is a file, or cannot be read; a file
            cannot be read; an ignore file holds a bad pattern; two projects put different files
            at the same path.
    """
    skip = frozenset(_dir_ids(skip_dirs))
    lock_key = (workspace.key(), ignore_file, tuple(keep), skip, skip_marker)
    with _scan_locks_guard:
        lock = _scan_locks.setdefault(lock_key, threading.Lock())
        if len(_scan_locks) > 1024:
            for k in [k for k, v in _scan_locks.items() if not v.locked() and k != lock_key]:
                del _scan_locks[k]
    # Scans of one workspace take turns: the second of two concurrent submits then finds every
    # hash remembered instead of reading the whole workspace a second time.
    with lock, _leave_out_hint(ignore_file):
        return _scan(workspace, ignore_file, frozenset(keep), skip, skip_marker)


def _dir_ids(paths: Sequence[str]) -> Iterator[tuple[int, int]]:
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue  # not made yet: nothing of it to skip
        yield st.st_dev, st.st_ino


def _scan(
    workspace: Workspace,
    ignore_file: str,
    keep: frozenset[str],
    skip: frozenset[tuple[int, int]],
    skip_marker: str | None,
) -> WorkspaceScan:
    entries: dict[str, WorkspaceEntry] = {}
    now = time.time()
    check_literal_names(workspace)
    for project, dest in workspace.projects.items():
        check_directory(project)
        _check_shippable(project, skip)
        rules = IgnoreRules.load(project, ignore_file)
        if dest:
            parts = dest.split("/")
            for i in range(1, len(parts) + 1):
                d = "/".join(parts[:i])
                entries.setdefault(
                    d, WorkspaceEntry(path=d, source=project, kind="dir", mode=0o755)
                )
        differ: dict[str, list[str]] = {}  # shipped here, left out by TorchX: pattern -> paths
        for rel, path, st in _walk(project, rules, keep, skip, skip_marker):
            _check_cancelled()
            if not stat.S_ISDIR(st.st_mode) and rel not in keep:
                pattern = rules.torchx_excludes(rel)
                if pattern is not None:
                    differ.setdefault(pattern, []).append(rel)
            target = f"{dest}/{rel}" if dest else rel
            try:
                entry = _entry(target, path, st, now)
            except FileNotFoundError:
                continue  # removed since it was listed
            prior = entries.get(target)
            if prior is not None and (prior.kind != "dir" or entry.kind != "dir"):
                raise InvalidWorkspaceException(
                    f"workspace projects collide: {prior.source!r} and {path!r} both go to "
                    f"{target!r}"
                )
            entries.setdefault(target, entry)
        if differ:
            _warn_torchx_reading(rules.source, differ)
    _check_parents(entries)
    ordered = tuple(entries[k] for k in sorted(entries))
    h = hashlib.sha256(_HASH_VERSION + b"\0")
    for e in ordered:
        h.update(
            f"{e.kind}\0{e.path}\0{e.mode:o}\0{e.size}\0{e.digest}\n".encode(
                "utf-8", "surrogateescape"
            )
        )
    return WorkspaceScan(workspace, ignore_file, ordered, h.hexdigest())


def _warn_torchx_reading(source: str, differ: dict[str, list[str]]) -> None:
    """Warns that files ``source``'s patterns leave out in TorchX's reading are shipped."""
    paths = sorted(p for found in differ.values() for p in found)
    examples = ", ".join(repr(p) for p in paths[:3]) + (", ..." if len(paths) > 3 else "")
    fixes = ", ".join(
        repr(p if p.startswith("**/") else f"**/{p.lstrip('/')}") for p in sorted(differ)
    )
    logger.warning(
        "%s: %d file%s that TorchX would leave out %s shipped (%s): %s match%s only at the top "
        "level here, as in .dockerignore, where TorchX's '*' crosses '/'; write %s to leave them "
        "out at any depth",
        source,
        len(paths),
        "" if len(paths) == 1 else "s",
        "is" if len(paths) == 1 else "are",
        examples,
        ", ".join(repr(p) for p in sorted(differ)),
        "es" if len(differ) == 1 else "",
        fixes,
    )


def _check_shippable(project: str, skip: frozenset[tuple[int, int]]) -> None:
    """Raises InvalidWorkspaceException when ``project`` is ``/`` or one of the ``skip``
    directories, by any path to it.

    ``/`` would be read whole, ``/proc`` and every mounted disk included (25 s here before it
    failed on a file of ``/proc``); a backend's state directory would be shipped with the logs
    of running apps and every snapshot made before (its files changed while read, so the submit
    failed saying "submit again", every time).
    """
    st = os.stat(project)
    if os.path.samestat(st, os.stat("/")):
        raise InvalidWorkspaceException(
            f"workspace directory {project!r} is the root of the file system: give the "
            "directory of your project"
        )
    if (st.st_dev, st.st_ino) in skip:
        raise InvalidWorkspaceException(
            f"workspace directory {project!r} is where the backend keeps its own state (its "
            "state root or log_dir), which is never shipped: give the directory of your project"
        )


def _check_parents(entries: dict[str, WorkspaceEntry]) -> None:
    """Raises InvalidWorkspaceException when an entry lies below one that is not a directory.

    Only projects can make that (one ships a symlink ``lib``, another goes to ``lib/``); a copy
    or an extracted tar would then write through the symlink, outside the target.
    """
    for path, entry in entries.items():
        parent = posixpath.dirname(path)
        while parent:
            prior = entries.get(parent)
            if prior is not None and prior.kind != "dir":
                raise InvalidWorkspaceException(
                    f"workspace projects collide: {entry.source!r} goes to {path!r}, below "
                    f"{prior.source!r}, which is a {prior.kind}, not a directory"
                )
            parent = posixpath.dirname(parent)


def _entry(target: str, path: str, st: os.stat_result, now: float) -> WorkspaceEntry:
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISDIR(st.st_mode):
        return WorkspaceEntry(target, path, "dir", mode, mtime=st.st_mtime, mtime_ns=st.st_mtime_ns)
    if stat.S_ISLNK(st.st_mode):
        try:
            link = os.readlink(path)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise _unreadable(path, e, "symlink") from None
        digest = hashlib.sha256(link.encode("utf-8", "surrogateescape")).hexdigest()
        return WorkspaceEntry(
            target, path, "symlink", mode, 0, digest, link, st.st_mtime, mtime_ns=st.st_mtime_ns
        )
    key = _stat_key(st)
    racy = now - max(st.st_mtime, st.st_ctime) < _RACY_SECONDS
    cached = None if racy else _hash_cache.get(path, key)
    if cached is not None:
        digest = cached
    else:
        digest, st2 = _hash_file(path, st)
        if _stat_key(st2) != key:
            raise WorkspaceChangedError(f"workspace file {path!r} changed while it was read")
        if not racy:
            _hash_cache.put(path, key, digest)
    return WorkspaceEntry(
        target, path, "file", mode, st.st_size, digest, "", st.st_mtime, key, racy, st.st_mtime_ns
    )


def image_key(scan: WorkspaceScan, *, base: str, recipe: bytes, build_args: dict[str, str]) -> str:
    """The content hash of a workspace image: the base image's identity, the recipe, the build
    arguments and every shipped file (sha256, hex)."""
    h = hashlib.sha256(_HASH_VERSION + b"\0image\0")
    h.update(base.encode() + b"\0")
    h.update(hashlib.sha256(recipe).hexdigest().encode() + b"\0")
    for k in sorted(build_args):
        h.update(f"{k}={build_args[k]}\0".encode("utf-8", "surrogateescape"))
    h.update(scan.digest.encode())
    return h.hexdigest()


# -- shipping: checked reads, tar streams, directory copies -----------------------------------------


def _check_unchanged(entry: WorkspaceEntry) -> None:
    """Raises WorkspaceChangedError unless ``entry``'s file still has the stat it was hashed with."""
    try:
        st = os.lstat(entry.source)
    except OSError as e:
        raise WorkspaceChangedError(
            f"workspace file {entry.source!r} changed after it was hashed ({e.strerror or e}); "
            "submit again"
        ) from None
    if _stat_key(st) != entry.stat_key:
        raise WorkspaceChangedError(
            f"workspace file {entry.source!r} changed after it was hashed; submit again"
        )


class _CheckedReader:
    """Reads a workspace file, raising WorkspaceChangedError unless it still has the bytes scanned.

    A file whose timestamps vouch for it (not changed just before the scan) must keep the stat it
    had then, from open to the last byte: any write since would have moved its mtime or ctime. A
    file changed just before the scan is hashed again instead.
    """

    def __init__(self, entry: WorkspaceEntry) -> None:
        self._entry = entry
        self._f = _open_shipped(entry)
        self._hash = hashlib.sha256() if entry.racy else None
        self._left = entry.size
        if not entry.racy and not self._same_stat():
            self._f.close()
            raise WorkspaceChangedError(
                f"workspace file {entry.source!r} changed after it was hashed; submit again"
            )

    def _same_stat(self) -> bool:
        return _stat_key(os.fstat(self._f.fileno())) == self._entry.stat_key

    @property
    def remaining(self) -> int:
        """Bytes left to read."""
        return self._left

    def read(self, n: int) -> bytes:
        """The next ``min(n, remaining)`` bytes; after the last, the whole file is checked."""
        n = min(n, self._left)
        data = self._f.read(n)
        if self._hash is not None:
            self._hash.update(data)
        self._left -= len(data)
        if len(data) < n or (self._left == 0 and not self._final_check()):
            raise WorkspaceChangedError(
                f"workspace file {self._entry.source!r} changed after it was hashed; submit again"
            )
        return data

    def _final_check(self) -> bool:
        if self._f.read(1):
            return False
        if self._hash is None:
            return self._same_stat()
        return self._hash.hexdigest() == self._entry.digest

    def close(self) -> None:
        self._f.close()


def _tar_member(entry: WorkspaceEntry) -> tarfile.TarInfo:
    info = tarfile.TarInfo(entry.path)
    info.mode = entry.mode
    info.mtime = int(entry.mtime)
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if entry.kind == "dir":
        info.type = tarfile.DIRTYPE
    elif entry.kind == "symlink":
        info.type = tarfile.SYMTYPE
        info.linkname = entry.link
    else:
        info.size = entry.size
    return info


def _header(info: tarfile.TarInfo) -> bytes:
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def write_tar(scan: WorkspaceScan, out: Any, extra: dict[str, bytes] | None = None) -> None:
    """Writes the scanned contents (and ``extra`` files, ``{path: bytes}``) as a tar to ``out``.

    Every file is read again and must hash as it did when scanned. Headers come from
    ``tarfile`` (PAX, for long names); file bytes go to ``out.write`` in 1 MB pieces as read,
    so that a worker thread writing a large workspace spends its time in reads and hashing, which
    release the GIL, not in Python code an event loop would wait on.

    Raises:
        WorkspaceChangedError: a file changed since the scan.
    """
    with _leave_out_hint(scan.ignore_file):
        _write_entries(scan, out)
    for path, data in (extra or {}).items():
        info = tarfile.TarInfo(path)
        info.size = len(data)
        info.mode = 0o644
        info.mtime = int(time.time())
        out.write(_header(info) + data)
        if len(data) % tarfile.BLOCKSIZE:
            out.write(tarfile.NUL * (tarfile.BLOCKSIZE - len(data) % tarfile.BLOCKSIZE))
    out.write(tarfile.NUL * (2 * tarfile.BLOCKSIZE))


def _write_entries(scan: WorkspaceScan, out: Any) -> None:
    for entry in scan.entries:
        out.write(_header(_tar_member(entry)))
        if entry.kind != "file":
            continue
        reader = _CheckedReader(entry)
        try:
            if entry.size == 0:
                reader.read(0)
            while reader.remaining:
                out.write(reader.read(_CHUNK))
        finally:
            reader.close()
        if entry.size % tarfile.BLOCKSIZE:
            out.write(tarfile.NUL * (tarfile.BLOCKSIZE - entry.size % tarfile.BLOCKSIZE))


def _clone_or_copy(entry: WorkspaceEntry, dst: str, use_clone: list[bool]) -> bool:
    """Copies ``entry``'s file to a new file ``dst``: a reflink (FICLONE) when ``use_clone`` and
    the file system takes them (else ``use_clone`` turns False). Returns True for a reflink."""
    with _open_shipped(entry) as fsrc, open(dst, "xb") as fdst:
        if use_clone[0]:
            try:
                fcntl.ioctl(fdst.fileno(), _FICLONE, fsrc.fileno())
                return True
            except OSError as e:
                if e.errno not in (
                    errno.EOPNOTSUPP,
                    errno.ENOTTY,
                    errno.EXDEV,
                    errno.EINVAL,
                    errno.ENOSYS,
                ):
                    raise
                use_clone[0] = False
        _copy_data(fsrc.fileno(), fdst.fileno(), entry.source)
    return False


def _copy_data(src: int, dst: int, source: str) -> None:
    """Copies the file ``src`` (the workspace file ``source``) to the empty file ``dst``, leaving
    its holes holes.

    A sparse file (``truncate -s 50G``, a preallocated dataset) is read and written only where it
    holds data, so its copy takes the disk space of the original, not its length in zeros. A
    file that changes meanwhile is caught by the stat or hash check that follows every copy.

    Raises:
        InvalidWorkspaceException: ``source`` cannot be read.
        OSError: ``dst`` cannot be written.
    """
    size = os.fstat(src).st_size
    pos = 0
    while pos < size:
        try:
            start = os.lseek(src, pos, os.SEEK_DATA)
            end = min(os.lseek(src, start, os.SEEK_HOLE), size)
        except OSError as e:
            if e.errno == errno.ENXIO:
                break  # only a hole is left
            if e.errno != errno.EINVAL:
                raise _unreadable(source, e) from None
            start, end = pos, size  # a file system that cannot tell holes: copy everything
        while start < end:
            try:
                chunk = os.pread(src, min(_CHUNK, end - start), start)
            except OSError as e:
                raise _unreadable(source, e) from None
            if not chunk:
                break  # cut short since its stat was taken
            view, offset = memoryview(chunk), start
            while view:
                written = os.pwrite(dst, view, offset)
                view, offset = view[written:], offset + written
            start += len(chunk)
            _check_cancelled()
        if start < end:
            break
        pos = end
    os.ftruncate(dst, size)


_FICLONE = 0x40049409


def copy_scan(
    scan: WorkspaceScan, dest: str, *, clone: bool = True, shown_as: str | None = None
) -> dict[str, int]:
    """Copies the scanned contents into the existing directory ``dest``.

    Each file of at least 256 kB is cloned (FICLONE, sharing blocks until either side is
    written) when ``clone`` and the file system allows, else copied; a clone or copy does not
    change when the source is edited in place later (hard links would). A file's stat must not
    have moved since the scan, and a file changed just before the scan (its timestamps cannot
    vouch for it) is hashed again. A file that is no longer a regular file is never opened as one
    (a FIFO would block the copy forever). The holes of a sparse file stay holes in its copy.

    Args:
        scan: what to copy.
        dest: the directory it goes into.
        clone: clone large files where the file system allows.
        shown_as: the destination error messages name (a temporary ``dest`` is renamed later).

    Returns:
        ``{"cloned": n, "copied": n}``.

    Raises:
        WorkspaceChangedError: a file changed since the scan.
        WorkspaceCopyError: ``dest`` cannot be written (a full disk), naming it and the file.
    """
    use_clone = [clone]
    counts = {"cloned": 0, "copied": 0}
    dirs: list[WorkspaceEntry] = []
    what = f"copy workspace {scan.workspace}"
    for entry in scan.entries:
        _check_cancelled()
        target = os.path.join(dest, *entry.path.split("/"))
        try:
            with _leave_out_hint(scan.ignore_file):
                _copy_entry(entry, target, use_clone, counts, dirs)
        except OSError as e:
            raise copy_error(e, what, shown_as or dest, entry.path) from None
    for entry in reversed(dirs):
        target = os.path.join(dest, *entry.path.split("/"))
        try:
            os.chmod(target, entry.mode | stat.S_IWUSR | stat.S_IXUSR)
        except OSError as e:
            raise copy_error(e, what, shown_as or dest, entry.path) from None
    return counts


def _copy_entry(
    entry: WorkspaceEntry,
    target: str,
    use_clone: list[bool],
    counts: dict[str, int],
    dirs: list[WorkspaceEntry],
) -> None:
    if entry.kind == "dir":
        os.makedirs(target, exist_ok=True)
        dirs.append(entry)
    elif entry.kind == "symlink":
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.symlink(entry.link, target)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        small = entry.size < _CLONE_MIN_BYTES
        cloned = _clone_or_copy(entry, target, [False] if small else use_clone)
        counts["cloned" if cloned else "copied"] += 1
        _check_unchanged(entry)
        if entry.racy:
            digest, _ = _hash_file(target, os.stat(target))
            if digest != entry.digest:
                raise WorkspaceChangedError(
                    f"workspace file {entry.source!r} changed after it was hashed; submit again"
                )
        os.chmod(target, entry.mode)
        # in nanoseconds: a float (seconds) loses the last digits, and a snapshot's file is told
        # unchanged by its time being exactly the workspace file's (``_intact``)
        os.utime(target, ns=(entry.copy_mtime_ns, entry.copy_mtime_ns))


def snapshot(
    scan: WorkspaceScan, store: str, name: str, *, read_only: bool = False
) -> tuple[str, bool]:
    """The directory ``store/name`` holding a copy of the scanned contents, made if missing.

    Made in a temporary directory and renamed into place, so a concurrent maker (another process)
    never sees a partial snapshot and exactly one copy wins. What makers killed midway left
    (``_sweep_scratch``) is removed first. With ``read_only`` its files lose
    their write permission bits (so that a user's program cannot rewrite a shared snapshot).

    An existing snapshot is used only while it is intact (see ``_intact``): one whose files were
    rewritten in place since (by a replica running as root, which the missing write bits do not
    stop) is set aside and made again, so that its name never stands for other bytes.

    Returns:
        ``(path, made)``: made is False when the snapshot already existed.

    Raises:
        WorkspaceChangedError: a file changed since the scan.
        WorkspaceCopyError: ``store`` cannot be written (a full disk), naming the snapshot.
    """
    final = os.path.join(store, name)
    if os.path.isdir(final):
        if _intact(scan, final, read_only):
            return final, False
        logger.warning(
            "workspace snapshot %s was changed since it was made (a replica rewrote a file of it "
            "in place?): making it again",
            final,
        )
        aside = os.path.join(store, _scratch_name("stale", name))
        try:
            os.rename(final, aside)
        except FileNotFoundError:
            pass  # another submit set it aside first
        else:
            remove_tree(aside)  # the apps using it keep their hard links
    what = f"copy workspace {scan.workspace}"
    _sweep_scratch(store)
    try:
        os.makedirs(store, exist_ok=True)
        tmp = os.path.join(store, _scratch_name("tmp", name))
        os.mkdir(tmp)
    except OSError as e:
        raise copy_error(e, what, final) from None
    try:
        copy_scan(scan, tmp, shown_as=final)
        try:
            if read_only:
                for entry in scan.entries:
                    if entry.kind == "file":
                        target = os.path.join(tmp, *entry.path.split("/"))
                        os.chmod(target, entry.mode & ~0o222)
            os.rename(tmp, final)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise copy_error(e, what, final) from None
            remove_tree(tmp)
            return final, False
    except BaseException:
        remove_tree(tmp)
        raise
    return final, True


_SCRATCH = re.compile(r"\.(?:tmp|stale)-[0-9a-f]{1,16}-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{8}")


def _scratch_name(kind: str, name: str) -> str:
    """A temporary name in a snapshot store, ``.{kind}-{hash}-{host}-{pid}-{random}``: what a
    killed maker left is told from what a live one is making by its host and process."""
    return f".{kind}-{name[:16]}-{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _sweep_scratch(store: str) -> None:
    """Removes the temporary directories of ``store`` whose maker, a process of this host, is
    gone: a submit killed midway (SIGKILL, the OOM killer) left a partial copy of its workspace
    there, which nothing else would ever remove."""
    try:
        names = os.listdir(store)
    except OSError:
        return
    host = os.uname().nodename
    for n in names:
        m = _SCRATCH.fullmatch(n)
        if m is None or m["host"] != host:
            continue
        try:
            os.kill(int(m["pid"]), 0)
        except ProcessLookupError:
            remove_tree(os.path.join(store, n))
        except (PermissionError, OverflowError):
            pass  # alive (another user's), or no pid at all


def _intact(scan: WorkspaceScan, final: str, read_only: bool) -> bool:
    """True while the snapshot ``final`` holds every entry of ``scan`` with the kind, and for files
    the size, mode and bytes, they were copied with.

    An in-place write moves a file's modification time to the time of the write, so a file whose
    modification time is exactly the workspace file's (to the nanosecond: the copy keeps it so)
    is taken as intact: one stat per entry (0.3 s for 50 000 files) costs far less than reading
    the files again. Exactly, not within a second: a replica's rewrite made less than a second
    after the workspace file was saved passed as intact, and the next app got the replica's bytes.

    A file whose time differs is read and hashed: the workspace file may have been touched,
    checked out again or edited and reverted since the snapshot was made, its bytes unchanged (the
    snapshot, named by content, kept the time of the first copy), and remaking the snapshot then
    would also remove it from under the submits linking to it. A snapshot made by an earlier
    version (times copied as floats, off by some nanoseconds) is so checked once, not remade. A
    file found intact takes the time of the workspace file, so that the next submit of that
    workspace needs its stat alone.

    The change time cannot tell instead: every app's hard link to a file moves it. A replica that
    rewrites a file and then sets its time back to the workspace file's goes unnoticed.
    """
    for entry in scan.entries:
        path = os.path.join(final, *entry.path.split("/"))
        try:
            st = os.lstat(path)
        except OSError:
            return False
        if entry.kind == "dir":
            ok = stat.S_ISDIR(st.st_mode)
        elif entry.kind == "symlink":
            ok = stat.S_ISLNK(st.st_mode)
        else:
            mode = entry.mode & ~0o222 if read_only else entry.mode
            ok = (
                stat.S_ISREG(st.st_mode)
                and stat.S_IMODE(st.st_mode) == mode
                and st.st_size == entry.size
            )
            mtime_ns = entry.copy_mtime_ns
            if ok and st.st_mtime_ns != mtime_ns:
                ok = _holds(path, st, entry.digest)
                if ok:  # vouched for: the next submit of this workspace needs its stat alone
                    with contextlib.suppress(OSError):
                        os.utime(path, ns=(mtime_ns, mtime_ns))
        if not ok:
            return False
    return True


def _holds(path: str, st: os.stat_result, digest: str) -> bool:
    """True when the file ``path`` (of stat ``st``) hashes to ``digest``."""
    try:
        found, _ = _hash_file(path, st)
    except (OSError, InvalidWorkspaceException):
        return False
    return found == digest


def link_tree(src: str, dest: str) -> int:
    """Recreates the directories of ``src`` under the new directory ``dest`` and hard-links its
    files there (symlinks are copied as symlinks). Returns the number of files linked.

    Walked with a stack of its own, so a tree of any depth is linked (``os.walk`` recurses once
    per level before Python 3.12: a workspace deeper than the recursion limit failed with
    RecursionError). A directory that cannot be listed fails the link (it is not left out: a
    partial tree, silently), and what was linked is removed.

    Each directory gets the mode of its source (``os.mkdir``'s default made a 0700 workspace
    directory 0755 to the app), set once the whole tree is linked, so that a mode without the
    owner's write bit does not stop its own linking. In a worker thread of ``run_in_thread``,
    a cancelled caller stops the linking at the next entry (a tree of 50 000 files takes
    seconds) and what was linked is removed: nothing is made after the caller is gone.
    """
    count = 0
    os.mkdir(dest)
    dirs: list[tuple[str, int]] = []  # (directory made, its source's mode), parents first
    try:
        dirs.append((dest, stat.S_IMODE(os.stat(src).st_mode)))
        stack = [""]
        while stack:
            rel = stack.pop()
            with os.scandir(os.path.join(src, rel) if rel else src) as it:
                items = list(it)
            here = os.path.join(dest, rel) if rel else dest
            for item in items:
                _check_cancelled()
                target = os.path.join(here, item.name)
                if item.is_symlink():
                    os.symlink(os.readlink(item.path), target)
                elif item.is_dir(follow_symlinks=False):
                    os.mkdir(target)
                    dirs.append((target, stat.S_IMODE(item.stat(follow_symlinks=False).st_mode)))
                    stack.append(os.path.join(rel, item.name) if rel else item.name)
                else:
                    os.link(item.path, target)
                    count += 1
        _check_cancelled()
        # children first: a parent's mode may deny the search of its children's paths
        for target, mode in reversed(dirs):
            os.chmod(target, mode)
    except BaseException:
        for target, _ in dirs:  # (whatever modes were set: the removal must be able to enter)
            with contextlib.suppress(OSError):
                os.chmod(target, stat.S_IRWXU)
        remove_tree(dest)
        raise
    return count


def remove_tree(path: str) -> None:
    """Removes ``path`` and everything below it, as far as it can (errors are ignored).

    Without recursion: ``shutil.rmtree`` recurses once per level before Python 3.12 and fails
    with RecursionError on a tree deeper than the recursion limit, leaving it all behind whatever
    ``ignore_errors`` says. And, as ``shutil.rmtree``, through descriptors: each directory is
    opened (``O_NOFOLLOW``) relative to its parent's descriptor and its entries removed relative
    to its own, so a directory swapped for a symlink while the tree is removed (by a replica
    still writing into it) never makes it remove anything outside the tree. One descriptor is
    open per level being removed.
    """
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)
            return
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    # (descriptor, parent's descriptor or -1 for the top, name in the parent, entries done)
    stack: list[tuple[int, int, str, bool]] = [(top, -1, path, False)]
    while stack:
        fd, parent, name, emptied = stack.pop()
        if emptied:
            os.close(fd)
            with contextlib.suppress(OSError):
                if parent < 0:
                    os.rmdir(name)
                else:
                    os.rmdir(name, dir_fd=parent)
            continue
        stack.append((fd, parent, name, True))
        try:
            with os.scandir(fd) as it:
                items = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        except OSError:
            continue
        for entry, is_dir in items:
            try:
                if not is_dir:
                    os.unlink(entry, dir_fd=fd)
                    continue
                child = os.open(
                    entry,
                    os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                    dir_fd=fd,
                )
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):  # no longer a directory: a symlink
                    with contextlib.suppress(OSError):
                        os.unlink(entry, dir_fd=fd)
                continue
            stack.append((child, fd, entry, False))


# -- plans and progress -----------------------------------------------------------------------------


def format_bytes(n: int) -> str:
    """``n`` bytes, readable (``12.3 MB``)."""
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"  # pragma: no cover


@dataclass(frozen=True)
class WorkspacePlan:
    """What a backend will do with a workspace; a dry run shows it and ``schedule`` carries it out.

    Args:
        backend: the scheduler.
        workspace: the workspace.
        action: what is done, e.g. ``"build image"``, ``"build and push image"``, ``"snapshot"``,
            ``"copy"``, ``"run in place"``.
        roles: the roles that get the workspace.
        target: the image name or directory the roles run from.
        content_hash: the content hash that names the target (None when nothing is hashed).
        scan: the scanned contents (None when the workspace is used in place).
        base_image: the image the workspace goes on top of.
        base_image_id: its id, or None when it is not present locally (the build pulls it).
        recipe: the Dockerfile the image is built with.
        recipe_source: where the recipe comes from.
        push_to: the registry reference the image is pushed to.
        details: more ``(name, value)`` lines for the dry run.
    """

    backend: str
    workspace: Workspace
    action: str
    roles: tuple[str, ...]
    target: str
    content_hash: str | None = None
    scan: WorkspaceScan | None = field(default=None, repr=False, compare=False)
    base_image: str | None = None
    base_image_id: str | None = None
    recipe: str | None = None
    recipe_source: str | None = None
    push_to: str | None = None
    details: tuple[tuple[str, str], ...] = ()

    @property
    def files(self) -> int | None:
        """How many files are shipped (None when the workspace is used in place)."""
        return None if self.scan is None else self.scan.files

    @property
    def total_bytes(self) -> int | None:
        """Their total size in bytes (None when the workspace is used in place)."""
        return None if self.scan is None else self.scan.total_bytes

    def __str__(self) -> str:
        lines = [
            f"workspace: {self.workspace}",
            f"  {self.action} for role(s) {', '.join(self.roles)}",
        ]
        if self.scan is not None:
            lines.append(
                f"  files: {self.scan.files} ({format_bytes(self.scan.total_bytes)}), "
                f"ignore file: {self.scan.ignore_file}"
            )
        if self.content_hash:
            lines.append(f"  content hash: {self.content_hash}")
        if self.base_image is not None:
            base_id = self.base_image_id or "not present locally: the build pulls it"
            lines.append(f"  base image: {self.base_image} ({base_id})")
        if self.recipe is not None:
            lines.append(f"  recipe ({self.recipe_source}):")
            lines.extend(f"    {line}" for line in self.recipe.rstrip("\n").splitlines())
        lines.append(f"  target: {self.target}")
        if self.push_to:
            lines.append(f"  pushed to: {self.push_to}")
        lines.extend(f"  {k}: {v}" for k, v in self.details)
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class WorkspaceEvent:
    """One step of shipping a workspace, as the progress callback receives it.

    Args:
        stage: ``"build"``, ``"push"``, ``"snapshot"`` or ``"copy"``.
        target: the image or directory being made.
        message: one line of output (a build step, a layer's push progress), without a newline.
        final: True on the stage's last event.
        cached: True when the stage had nothing to do (the image or snapshot existed).
    """

    stage: str
    target: str
    message: str
    final: bool = False
    cached: bool = False


WorkspaceProgress = Callable[[WorkspaceEvent], None]

_progress: contextvars.ContextVar[WorkspaceProgress | None] = contextvars.ContextVar(
    "asynctorchx_workspace_progress", default=None
)


@contextlib.contextmanager
def reporting(callback: WorkspaceProgress | None) -> Iterator[None]:
    """Sends the workspace events of submits made inside the block (in this task) to ``callback``.

    ``AsyncRunner.run(..., progress=)`` uses it; a direct user of ``Scheduler.schedule`` can too.
    """
    token = _progress.set(callback)
    try:
        yield
    finally:
        _progress.reset(token)


def current_progress() -> WorkspaceProgress | None:
    """The callback ``reporting`` installed for the current task, if any."""
    return _progress.get()


def report(callback: WorkspaceProgress | None, event: WorkspaceEvent) -> None:
    """Calls ``callback(event)``; a failing callback is logged, never fails the submit."""
    if callback is None:
        return
    try:
        callback(event)
    except Exception:
        logger.exception("workspace progress callback failed")


class _Flight(Generic[T]):
    def __init__(self) -> None:
        self.future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self.listeners: list[WorkspaceProgress] = []
        self.waiters = 0
        self.task: asyncio.Task[None] | None = None

    def broadcast(self, event: WorkspaceEvent) -> None:
        for listener in list(self.listeners):
            report(listener, event)


class SingleFlight:
    """Runs one job per key at a time: callers asking for a key already in flight wait for the
    same result, and every caller's progress callback receives the job's events.

    The job runs as a task of ``supervisor``: a caller that gives up (is cancelled) does not stop
    it while another caller still waits for it; the last one to give up does, so that a build
    nobody wants any more stops streaming its context and tags nothing. A later call for that
    key starts a job of its own, never inheriting the stopped one's cancellation; it begins once
    the stopped job has unwound (a push's clean-up removes the tag a new push of that name would
    use). Closing the supervisor stops every job.
    """

    def __init__(self, supervisor: TaskSupervisor) -> None:
        self._supervisor = supervisor
        self._flights: dict[Hashable, _Flight[Any]] = {}
        # jobs cancelled because their callers all left, until they have unwound
        self._stopping: dict[Hashable, asyncio.Task[None]] = {}
        self.started = 0

    def in_flight(self, key: Hashable) -> bool:
        """True while a job for ``key`` runs."""
        return key in self._flights

    async def run(
        self,
        key: Hashable,
        job: Callable[[WorkspaceProgress], Awaitable[T]],
        progress: WorkspaceProgress | None = None,
    ) -> T:
        """The result of ``job(report)`` for ``key``, started unless one is in flight.

        Cancelling the last caller waiting for a job cancels the job too.
        """
        flight: _Flight[T] | None = self._flights.get(key)
        if flight is None:
            flight = _Flight()
            self._flights[key] = flight
            self.started += 1
            flight.task = self._supervisor.spawn(
                self._fly(key, flight, job, self._stopping.get(key)), name=f"single-flight:{key}"
            )
        flight.waiters += 1
        if progress is not None:
            flight.listeners.append(progress)
        try:
            # shielded: one caller's cancellation must not cancel the job the others wait for
            return await asyncio.shield(flight.future)
        finally:
            flight.waiters -= 1
            if progress is not None and progress in flight.listeners:
                flight.listeners.remove(progress)
            if flight.waiters == 0 and not flight.future.done():
                # the last caller gave up before the job ended: nobody wants its result
                self._abandon(key, flight)

    def _abandon(self, key: Hashable, flight: _Flight[Any]) -> None:
        # out of the table at once, not when the task has unwound: a submit of the same key
        # arriving meanwhile starts a job of its own instead of joining (and failing with) this one
        if self._flights.get(key) is flight:
            del self._flights[key]
        flight.future.cancel()
        task = flight.task
        if task is not None and not task.done():
            task.cancel()
            self._stopping[key] = task
            task.add_done_callback(lambda _: self._stopped(key, task))

    def _stopped(self, key: Hashable, task: asyncio.Task[None]) -> None:
        if self._stopping.get(key) is task:
            del self._stopping[key]

    async def _fly(
        self,
        key: Hashable,
        flight: _Flight[T],
        job: Callable[[WorkspaceProgress], Awaitable[T]],
        previous: asyncio.Task[None] | None,
    ) -> None:
        try:
            if previous is not None:
                # one job per key at a time: the one its callers abandoned unwinds first
                await asyncio.wait({previous})
            result = await job(flight.broadcast)
        except BaseException as e:
            if not flight.future.done():
                if isinstance(e, asyncio.CancelledError):
                    flight.future.set_exception(
                        RuntimeError("the build was cancelled (the scheduler closed)")
                    )
                else:
                    flight.future.set_exception(e)
                flight.future.exception()  # marked retrieved: every waiter may have gone
            if not isinstance(e, Exception):
                raise
        else:
            if not flight.future.done():
                flight.future.set_result(result)
        finally:
            # only this job's entry: an abandoned job's key may belong to a newer job by now
            if self._flights.get(key) is flight:
                del self._flights[key]
