"""A file-system tracker in TorchX's ``FsspecTracker`` layout: runs written by either are read by both.

Layout under ``root_path`` (run ids are Base32-encoded, so ``local_cwd://s/app`` is a valid name)::

    {root}/{b32(run_id)}/metadata/{time_ns}      {"metadata": {...}}   one file per add_metadata
    {root}/{b32(run_id)}/artifacts/{time_ns}     {"name": ..., "path": ..., "metadata": ...}
    {root}/{b32(run_id)}/sources/{b32(source)}   the artifact name and a newline ("\\n" for none)
    {root}/{b32(source)}/descendants/{b32(run)}  only when that directory already exists (as TorchX)

Readers merge the metadata files in the order of their names (the write time), later values winning.

On a local path (``protocol=file``) nothing beyond the standard library is needed, and every file
appears whole: it is written beside the category directory and hard-linked into place under a
name no other writer holds (``O_EXCL`` semantics: two replicas writing in the same nanosecond both
keep their entry); where hard links are refused, it is renamed into place without replacing.
Readers open files without blocking and read regular files only (a FIFO among the entries is
skipped with a warning), and leave out an entry still incomplete after ``INCOMPLETE_WAIT``.
Other protocols (``s3``, ``memory``, ...) go through fsspec
(``pip install 'asynctorchx[tracker]'``); there an entry's name is its write time with random
sub-millisecond digits, created with mode ``"xb"`` where the file system has it (see
``_FsspecStorage.create_entry``). A file of ``metadata``/``artifacts`` whose name is not an entry
name (ASCII digits) is skipped with a warning naming its path.

``create(config)`` reads TorchX's config file: ``key=value`` lines, ``#`` comments, ``protocol`` and
``root_path`` required, every other key (``a.b=v`` nests) passed to ``fsspec.filesystem``.
"""

from __future__ import annotations

import binascii
import contextlib
import ctypes
import enum
import errno
import json
import logging
import os
import secrets
import stat
import threading
import time
from base64 import b32decode, b32encode
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from asynctorchx.tracker.api import (
    MAX_JSON_DEPTH,
    Lineage,
    TrackerArtifact,
    TrackerBase,
    TrackerConfigError,
    TrackerError,
    TrackerSource,
    UnknownRunError,
    check_artifact_metadata,
    check_json,
)

METADATA = "metadata"
ARTIFACTS = "artifacts"
SOURCES = "sources"
DESCENDANTS = "descendants"

LOCAL_PROTOCOLS = ("file", "local")
INSTALL_HINT = "pip install 'asynctorchx[tracker]'"

#: A config file holds a few ``key=value`` lines; anything larger is not one.
MAX_CONFIG_BYTES = 1 << 20

#: Seconds ``metadata()``/``artifacts()`` wait for an entry a writer has not finished before they
#: leave it out (a writer without atomic publication, or one killed half-way through).
INCOMPLETE_WAIT = 0.5

logger = logging.getLogger(__name__)


#: File names are at most 255 bytes; Base32 makes 8 characters of every 5 bytes.
MAX_RUN_ID_BYTES = 255 // 8 * 5


def _run_id_bytes(run_id: str) -> bytes:
    """The UTF-8 bytes of ``run_id``.

    Raises:
        TrackerError: the id is empty or not UTF-8 text.
    """
    if not isinstance(run_id, str) or not run_id:
        raise TrackerError(f"a run id must be a non-empty string, got {run_id!r}")
    try:
        return run_id.encode("utf-8")
    except UnicodeEncodeError:  # bytes that were not UTF-8, decoded with surrogateescape
        raise TrackerError(
            f"run id {run_id!r} is not valid text (it holds bytes that are not UTF-8)"
        ) from None


def encode_run_id(run_id: str, *, check_length: bool = True) -> str:
    """The directory name of ``run_id`` (Base32 of its UTF-8 bytes, as TorchX for ASCII ids).

    With ``check_length=False`` a name too long to be a file name is returned too (what TorchX
    would look for: no such file can exist).

    Raises:
        TrackerError: the id is empty (it would name the root itself), too long to be a file name,
            or not UTF-8 text.
    """
    raw = _run_id_bytes(run_id)
    if check_length and len(raw) > MAX_RUN_ID_BYTES:
        raise TrackerError(
            f"run id {run_id[:40]!r}... is too long for the file tracker "
            f"({len(raw)} bytes; at most {MAX_RUN_ID_BYTES})"
        )
    return b32encode(raw).decode("ascii")


def is_storable_run_id(run_id: str) -> bool:
    """False when ``run_id`` is too long to be stored: no run of the tracker has it, and reads
    find nothing (as TorchX's, which look for the file that cannot exist).

    Raises:
        TrackerError: the id is empty or not UTF-8 text (as ``encode_run_id``).
    """
    return len(_run_id_bytes(run_id)) <= MAX_RUN_ID_BYTES


def decode_run_id(name: str) -> str | None:
    """The run id of a directory name, or None when the name is not one ``encode_run_id`` makes."""
    try:
        return b32decode(name.encode("ascii")).decode("utf-8") or None
    except (binascii.Error, ValueError, UnicodeError):
        return None


class Skipped(enum.Enum):
    """What ``FsspecTracker.read_entry`` returns for an entry readers leave out."""

    #: removed since it was listed (its run deleted by a cleanup...)
    GONE = "gone"
    #: not a regular file (a FIFO would block its reader, a directory cannot be read)
    NOT_A_FILE = "not a regular file"


class NotRegularFileError(OSError):
    """Raised when a file the tracker reads is a FIFO, a directory, a device or a socket."""


def _file_kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return kind
    return "special file"


def _read_regular(path: str, limit: int | None = None) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit + 1`` of them).

    The file is opened without blocking and checked before it is read: opening a FIFO for reading
    would wait for a writer, forever and deaf to Ctrl+C.

    Raises:
        NotRegularFileError: ``path`` is not a regular file (names the path and what it is).
        OSError: it cannot be opened or read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(
                errno.EINVAL, f"a {_file_kind(mode)}, not a regular file", path
            )
        return f.read() if limit is None else f.read(limit + 1)


def _libc_function(name: str) -> Any:
    """libc's function ``name``, or None.

    Looked up in the symbols the process already has (libc among them), then in ``libc.so.6``:
    ``ctypes.util.find_library`` would run ``ldconfig -p`` (or gcc) in a subprocess.
    """
    for library in (None, "libc.so.6"):
        try:
            return getattr(ctypes.CDLL(library, use_errno=True), name)
        except (OSError, AttributeError, TypeError):
            continue
    return None


def _rename_noreplace_fn() -> Any:
    """libc's ``renameat2`` (Linux, glibc 2.28+), or None."""
    fn = _libc_function("renameat2")
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_renameat2: Any = None
_renameat2_looked_up = False


def _rename_noreplace(src: str, dst: str) -> bool:
    """Renames ``src`` to ``dst`` unless ``dst`` exists; False when the system cannot do that.

    Raises:
        FileExistsError: ``dst`` exists.
        OSError: the rename failed otherwise.
    """
    global _renameat2, _renameat2_looked_up
    if not _renameat2_looked_up:
        _renameat2, _renameat2_looked_up = _rename_noreplace_fn(), True
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False  # an old kernel, or a file system without RENAME_NOREPLACE
    raise OSError(err, os.strerror(err), src, None, dst)


def is_entry_name(name: str) -> bool:
    """True when ``name`` is an entry's name: its write time in ns, ASCII digits.

    (``str.isdigit`` also accepts superscripts and other scripts' digits, which ``int`` rejects.)
    """
    return name.isascii() and name.isdigit()


def entry_sort_key(name: str) -> tuple[int, str]:
    """Orders entry files by their write time (their name), foreign names last."""
    return (int(name), name) if is_entry_name(name) else (1 << 64, name)


def entry_timestamp(name: str) -> float | None:
    """When entry ``name`` was written (seconds since the epoch), or None for a foreign name."""
    return int(name) / 1e9 if is_entry_name(name) else None


#: A remote entry's name keeps the write time to the millisecond; the digits below are random.
_REMOTE_RANDOM_NS = 1_000_000
_entry_names_lock = threading.Lock()
#: The greatest entry name this process picked, by scope: ``""`` for remote stores (any
#: directory), a directory's path for local ones (the last ``_REMEMBERED_DIRECTORIES`` written).
_last_entry_names: OrderedDict[str, int] = OrderedDict()
_REMEMBERED_DIRECTORIES = 4096


def _later_entry_name(ns: int, scope: str = "") -> int:
    """``ns``, or one more than the greatest entry name this process picked before in ``scope``
    when ``ns`` is not greater: the entries of one writer stay in write order (a later
    ``add_metadata`` wins) even when the wall clock steps back (NTP, a VM resumed). Local and
    remote entries alike; a local writer finding the name taken tries the next ones, and notes
    the one it got (``_took_entry_name``)."""
    with _entry_names_lock:
        ns = max(ns, _last_entry_names.get(scope, 0) + 1)
        _remember_entry_name(ns, scope)
    return ns


def _took_entry_name(ns: int, scope: str = "") -> None:
    """Notes that this process holds entry name ``ns`` in ``scope`` (one found free above the
    name it picked)."""
    with _entry_names_lock:
        _remember_entry_name(max(ns, _last_entry_names.get(scope, 0)), scope)


def _remember_entry_name(ns: int, scope: str) -> None:
    _last_entry_names[scope] = ns
    _last_entry_names.move_to_end(scope)
    if len(_last_entry_names) > _REMEMBERED_DIRECTORIES:
        _last_entry_names.popitem(last=False)


def _remote_entry_name() -> str:
    """A name for a new entry on a remote store: the write time in ns, its sub-millisecond digits
    random, so that two writers in one clock tick pick different names (an object store may have
    no exclusive create), and greater than any name this process picked before
    (``_later_entry_name``). Still digits: sortable, and read by TorchX as any file."""
    ns = time.time_ns()
    ns += secrets.randbelow(_REMOTE_RANDOM_NS) - ns % _REMOTE_RANDOM_NS
    return str(_later_entry_name(ns))


#: Attempts at a fresh entry name before giving up (each collision is a one-in-a-million event).
_MAX_NAME_ATTEMPTS = 100

#: What identifies a version of a file: ``(inode, mtime_ns, size)``.
FileSignature = tuple[int, int, int]


class _Storage:
    """The file operations the tracker needs, on a local directory tree."""

    local = True

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def listdir(self, path: str) -> list[tuple[str, bool]]:
        """``(name, is_directory)`` of each entry; empty when ``path`` does not exist."""
        try:
            with os.scandir(path) as it:
                return [(e.name, e.is_dir()) for e in it]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def read(self, path: str) -> bytes:
        """The bytes of the regular file ``path``.

        Raises:
            NotRegularFileError: ``path`` is a FIFO, a directory... (it is not opened blocking).
        """
        return _read_regular(path)

    def signature(self, path: str) -> FileSignature | None:
        """``(inode, mtime_ns, size)`` of ``path``: it changes when the file is rewritten or
        replaced; None when ``path`` is gone."""
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _temp(self, tmp_dir: str, data: bytes) -> str:
        """A new dot-file in ``tmp_dir`` holding ``data``; nothing is left behind when that fails.

        Raises:
            OSError: naming the temporary file (a full disk fails the write, not the open).
        """
        # the thread too: two threads of one process can read the same time on a coarse clock
        tmp = os.path.join(tmp_dir, f".tmp-{os.getpid()}-{threading.get_ident()}-{time.time_ns()}")
        try:
            with open(tmp, "xb") as f:
                f.write(data)
        except BaseException as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(e, OSError) and e.filename is None:
                raise OSError(e.errno, e.strerror, tmp) from e
            raise
        return tmp

    def create_entry(self, directory: str, data: bytes, tmp_dir: str) -> str:
        """Writes ``data`` as a new file named by the current time (ns) in ``directory``, a name
        greater than any this process picked before there (``_later_entry_name``).

        The file appears whole under its name: it is written beside ``directory`` first, then
        hard-linked there; where hard links are refused (vfat, exfat, some FUSE and CIFS mounts),
        renamed there without replacing a file of that name.
        """
        tmp = self._temp(tmp_dir, data)
        try:
            ns = _later_entry_name(time.time_ns(), directory)
            while True:
                path = os.path.join(directory, str(ns))
                try:
                    os.link(tmp, path)
                    _took_entry_name(ns, directory)
                    return path
                except FileExistsError:
                    ns += 1
                except OSError as e:
                    if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                        raise
                    break  # a file system without hard links
            while True:
                path = os.path.join(directory, str(ns))
                try:
                    if _rename_noreplace(tmp, path):
                        _took_entry_name(ns, directory)
                        return path
                    # No RENAME_NOREPLACE either: hold the name with an empty file (which readers
                    # take for an entry being written), then replace it by the whole one.
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                except FileExistsError:
                    ns += 1
                    continue
                os.close(fd)
                try:
                    os.rename(tmp, path)
                except BaseException:
                    os.unlink(path)
                    raise
                _took_entry_name(ns, directory)
                return path
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def replace(self, path: str, data: bytes, tmp_dir: str) -> None:
        """Writes ``data`` to ``path`` at once (readers see the old or the new file, never half)."""
        tmp = self._temp(tmp_dir, data)
        try:
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise

    def append(self, path: str, data: bytes) -> None:
        """Appends ``data`` to the regular file ``path`` (made if missing).

        Raises:
            NotRegularFileError: ``path`` is a FIFO, a directory... (a FIFO opened for writing
                would wait for a reader for ever).
        """
        fd = os.open(
            path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o644
        )
        with os.fdopen(fd, "ab") as f:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise NotRegularFileError(
                    errno.EINVAL, f"a {_file_kind(mode)}, not a regular file", path
                )
            f.write(data)


class _FsspecStorage(_Storage):
    """The same operations through an fsspec file system."""

    local = False

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def join(self, *parts: str) -> str:
        return "/".join(p.rstrip("/") for p in parts[:-1]) + "/" + parts[-1]

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def isdir(self, path: str) -> bool:
        return bool(self.fs.isdir(path))

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def listdir(self, path: str) -> list[tuple[str, bool]]:
        try:
            listing = self.fs.ls(path, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        for item in listing:
            name = str(item["name"]).rstrip("/").rsplit("/", 1)[-1]
            out.append((name, item.get("type") == "directory"))
        return out

    def read(self, path: str) -> bytes:
        with self.fs.open(path, "rb") as f:
            return bytes(f.read())

    def signature(self, path: str) -> FileSignature | None:
        """None: an object store has no inode, and asking costs a request per entry (a reader
        reads an entry it skipped again at every scan instead)."""
        return None

    def create_entry(self, directory: str, data: bytes, tmp_dir: str) -> str:
        """Writes ``data`` as a new file named by the current time (``_remote_entry_name``).

        The file is created with mode ``"xb"`` where the file system has it (an existing name
        fails instead of being replaced); elsewhere a name found taken is tried again, and the
        random digits of the name keep two writers of one clock tick apart.

        Raises:
            FileExistsError: no free name after ``_MAX_NAME_ATTEMPTS`` attempts.
        """
        for _ in range(_MAX_NAME_ATTEMPTS):
            path = self.join(directory, _remote_entry_name())
            try:
                self._write_new(path, data)
            except FileExistsError:
                continue
            return path
        raise FileExistsError(
            errno.EEXIST, f"no free entry name after {_MAX_NAME_ATTEMPTS} attempts", directory
        )

    def _write_new(self, path: str, data: bytes) -> None:
        """Writes ``data`` to the new file ``path``.

        Raises:
            FileExistsError: ``path`` exists.
        """
        try:
            f = self.fs.open(path, "xb")
        except (ValueError, NotImplementedError, TypeError):  # no mode "x" on this file system
            if self.fs.exists(path):
                raise FileExistsError(errno.EEXIST, "entry name taken", path) from None
            f = self.fs.open(path, "wb")
        with f:
            f.write(data)

    def replace(self, path: str, data: bytes, tmp_dir: str) -> None:
        with self.fs.open(path, "wb") as f:
            f.write(data)

    def append(self, path: str, data: bytes) -> None:
        with self.fs.open(path, "ab") as f:
            f.write(data)


def _is_local_fs(fs: Any) -> bool:
    protocol = getattr(fs, "protocol", None)
    protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol or ())
    return any(p in LOCAL_PROTOCOLS for p in protocols) and type(fs).__name__ == "LocalFileSystem"


def _local_root(root: str) -> str:
    """The absolute path of a local ``root_path`` as fsspec's local file system takes it (TorchX
    passes it there): a ``file://``, ``file:``, ``local://`` or ``local:`` prefix stripped, then a
    leading ``~`` expanded."""
    for prefix in ("file://", "file:", "local://", "local:"):
        if root.startswith(prefix):
            root = root[len(prefix) :]
            break
    if root.startswith("~"):
        root = os.path.expanduser(root)
    return os.path.abspath(root)


class FsspecTracker(TrackerBase):
    """A tracker storing each run in a directory tree (TorchX's ``FsspecTracker`` layout).

    Args:
        fs: an fsspec file system, or None for a local path (no fsspec needed).
        root_dir: the directory holding the runs; it must exist.

    Raises:
        TrackerConfigError: ``root_dir`` does not exist.
    """

    def __init__(self, fs: Any, root_dir: str | os.PathLike[str]) -> None:
        root = os.fspath(root_dir)
        if fs is None or _is_local_fs(fs):
            self._fs: _Storage = _Storage()
            root = _local_root(root)
        else:
            self._fs = _FsspecStorage(fs)
        if not self._fs.isdir(root):
            raise TrackerConfigError(
                f"the tracker's root_path {root!r} does not exist or is not a directory"
            )
        self.fs = fs
        self.root = root
        #: paths of the entries found incomplete after a wait: not waited for again
        self._incomplete: set[str] = set()
        self._incomplete_lock = threading.Lock()

    @property
    def is_local(self) -> bool:
        """True when the runs are in a local directory (file-system notification can watch it)."""
        return self._fs.local

    # -- paths ----------------------------------------------------------------------------------

    def run_dir(self, run_id: str) -> str:
        """The directory of ``run_id``."""
        return self._fs.join(self.root, encode_run_id(run_id))

    def category_dir(self, run_id: str, category: str) -> str:
        """The ``metadata``/``artifacts``/``sources`` directory of ``run_id``."""
        return self._fs.join(self.run_dir(run_id), category)

    # -- writing --------------------------------------------------------------------------------

    def _persist(self, run_id: str, category: str, content: Mapping[str, object]) -> None:
        data = json.dumps(content).encode("utf-8")
        directory = self.category_dir(run_id, category)
        self._fs.makedirs(directory)
        self._fs.create_entry(directory, data, self.run_dir(run_id))

    def add_metadata(self, run_id: str, **metadata: object) -> None:
        """Writes one metadata file holding ``metadata``."""
        check_json("metadata", metadata)
        self._persist(run_id, METADATA, {"metadata": metadata})

    def add_artifact(
        self, run_id: str, name: str, path: str, metadata: Mapping[str, object] | None = None
    ) -> None:
        """Writes one artifact file.

        Raises:
            TypeError: ``metadata`` is not a mapping (names the artifact).
            InvalidMetadataError: ``metadata`` is not JSON-serialisable.
        """
        if metadata is not None:
            check_artifact_metadata(name, metadata)
        entry = {
            "name": name,
            "path": path,
            "metadata": None if metadata is None else dict(metadata),
        }
        self._persist(run_id, ARTIFACTS, entry)

    def add_source(self, run_id: str, source_id: str, artifact_name: str | None = None) -> None:
        """Writes the source file of ``source_id`` (replacing an earlier one, as TorchX).

        Raises:
            TrackerError: ``artifact_name`` holds a line break (the file holds one name a line).
        """
        if artifact_name and ("\n" in artifact_name or "\r" in artifact_name):
            raise TrackerError(
                f"artifact name {artifact_name!r} of source {source_id!r} holds a line break, "
                "which the file tracker cannot record (one artifact name a line)"
            )
        source_name = encode_run_id(source_id)
        sources = self.category_dir(run_id, SOURCES)
        self._fs.makedirs(sources)
        line = f"{artifact_name or ''}\n".encode()
        self._fs.replace(self._fs.join(sources, source_name), line, self.run_dir(run_id))
        descendants = self.category_dir(source_id, DESCENDANTS)
        if self._fs.isdir(descendants):
            self._fs.append(self._fs.join(descendants, encode_run_id(run_id)), line)

    # -- reading --------------------------------------------------------------------------------

    def exists(self, run_id: str) -> bool:
        """True when the tracker has a directory for ``run_id`` (False for an id too long to be
        stored)."""
        return is_storable_run_id(run_id) and self._fs.isdir(self.run_dir(run_id))

    def check_run(self, run_id: str) -> None:
        """Raises ``UnknownRunError`` when the tracker has no run ``run_id``."""
        if not self.exists(run_id):
            raise UnknownRunError(run_id, repr(self))

    def entry_names(self, run_id: str, category: str) -> list[str]:
        """The entry files of a category of the run, in write order (directories left out)."""
        names = [
            n for n, is_dir in self._fs.listdir(self.category_dir(run_id, category)) if not is_dir
        ]
        return sorted((n for n in names if not n.startswith(".")), key=entry_sort_key)

    def entry_signature(self, run_id: str, category: str, name: str) -> FileSignature | None:
        """``(inode, mtime_ns, size)`` of an entry file on a local path (it changes when the file
        is rewritten or replaced); None when it is gone, or on a remote store."""
        return self._fs.signature(self._fs.join(self.category_dir(run_id, category), name))

    def read_entry(
        self, run_id: str, category: str, name: str
    ) -> Mapping[str, Any] | Skipped | None:
        """One entry file; None while it is still being written (empty or cut-off JSON); a
        ``Skipped`` when it is gone or is not a regular file (logged as a warning).

        Raises:
            TrackerError: the file holds something that is not an entry, or JSON nested too deeply
                to be read (names the file).
        """
        path = self._fs.join(self.category_dir(run_id, category), name)
        try:
            data = self._fs.read(path)
        except FileNotFoundError:
            return Skipped.GONE
        except (NotRegularFileError, IsADirectoryError) as e:
            logger.warning("%r: skipping %s: %s", self, path, e.strerror)
            return Skipped.NOT_A_FILE
        try:
            entry = json.loads(data)
        except (UnicodeDecodeError, ValueError) as e:
            if not data.strip() or _cut_off(data):
                return None  # a writer without atomic publication (TorchX's) is still at it
            raise TrackerError(f"{self!r}: {path} is not valid JSON: {e}") from None
        except RecursionError:
            raise TrackerError(
                f"{self!r}: {path} holds JSON nested too deeply to be read "
                f"({len(data)} bytes; asynctorchx writes at most {MAX_JSON_DEPTH} levels)"
            ) from None
        if not isinstance(entry, dict) or (
            category == METADATA and not isinstance(entry.get("metadata"), dict)
        ):
            raise TrackerError(f"{self!r}: {path} is not a {category} entry: {data[:80]!r}")
        return entry

    def _read_or_wait(
        self, run_id: str, category: str, name: str
    ) -> Mapping[str, Any] | Skipped | None:
        """``read_entry``, waiting up to ``INCOMPLETE_WAIT`` for an entry still being written.

        An entry is waited for once: found incomplete after that, it is left out at once by
        later reads (a killed writer's half file would otherwise cost every read, and the worker
        thread it runs in, half a second).
        """
        path = self._fs.join(self.category_dir(run_id, category), name)
        entry = self.read_entry(run_id, category, name)
        with self._incomplete_lock:
            waited = path in self._incomplete
            if entry is not None:
                self._incomplete.discard(path)
        if entry is not None or waited:
            return entry
        deadline = time.monotonic() + INCOMPLETE_WAIT
        while entry is None and time.monotonic() < deadline:
            time.sleep(0.01)  # a file still being written by a non-atomic writer
            entry = self.read_entry(run_id, category, name)
        if entry is None:
            with self._incomplete_lock:
                self._incomplete.add(path)
        return entry

    def _load(self, run_id: str, category: str) -> list[Mapping[str, Any]]:
        if not is_storable_run_id(run_id):
            return []  # no such run can exist: empty, as for any unknown run
        entries = []
        gone = False
        for name in self.entry_names(run_id, category):
            if not is_entry_name(name):
                logger.warning(
                    "%r: skipping %s: not an entry (entries are named by their write time, "
                    "in digits)",
                    self,
                    self._fs.join(self.category_dir(run_id, category), name),
                )
                continue
            entry = self._read_or_wait(run_id, category, name)
            if entry is None:
                # Its writer is slow or was killed half-way: the read is as if made before it.
                logger.warning(
                    "%r: skipping %s: still empty or incomplete after %.1f s",
                    self,
                    self._fs.join(self.category_dir(run_id, category), name),
                    INCOMPLETE_WAIT,
                )
            elif entry is Skipped.GONE:
                gone = True
            elif not isinstance(entry, Skipped):
                entries.append(entry)
        if gone:
            self.check_run(run_id)  # deleted while it was read
        return entries

    def metadata(self, run_id: str) -> dict[str, object]:
        """The run's metadata, merged in write order (empty for an unknown run, as TorchX)."""
        merged: dict[str, object] = {}
        for entry in self._load(run_id, METADATA):
            merged.update(entry["metadata"])
        return merged

    def artifacts(self, run_id: str) -> dict[str, TrackerArtifact]:
        """The run's artifacts by name, a later one of a name replacing an earlier one."""
        out: dict[str, TrackerArtifact] = {}
        for entry in self._load(run_id, ARTIFACTS):
            name = str(entry.get("name"))
            out[name] = TrackerArtifact(name, str(entry.get("path")), entry.get("metadata"))
        return out

    def sources(self, run_id: str, artifact_name: str | None = None) -> list[TrackerSource]:
        """The run's sources, optionally only those recorded for ``artifact_name``."""
        out: list[TrackerSource] = []
        if not is_storable_run_id(run_id):
            return out
        sources = self.category_dir(run_id, SOURCES)
        for name, is_dir in sorted(self._fs.listdir(sources)):
            source_id = decode_run_id(name)
            if is_dir or source_id is None:
                continue
            path = self._fs.join(sources, name)
            try:
                data = self._fs.read(path)
            except FileNotFoundError:
                continue  # removed since it was listed
            except (NotRegularFileError, IsADirectoryError) as e:
                logger.warning("%r: skipping %s: %s", self, path, e.strerror)
                continue
            lines = [ln.strip().decode("utf-8", "replace") for ln in data.splitlines()]
            kinds = [ln for ln in lines if ln]
            if kinds:
                out.extend(
                    TrackerSource(source_id, k)
                    for k in kinds
                    if not artifact_name or k == artifact_name
                )
            elif not artifact_name:
                out.append(TrackerSource(source_id, None))
        return out

    def run_ids(self, parent_run_id: str | None = None, **filters: str) -> list[str]:
        """Every run id under the root; ``parent_run_id=`` keeps the runs with that source.

        Raises:
            TypeError: an unknown filter.
            ValueError: ``parent_run_id`` is empty (it is no run's id, and no filter either).
        """
        if parent_run_id is not None and (not isinstance(parent_run_id, str) or not parent_run_id):
            raise ValueError(f"parent_run_id must be a non-empty string, got {parent_run_id!r}")
        if filters:
            raise TypeError(
                f"unknown run_ids filter(s) {', '.join(map(repr, filters))}; "
                "the fsspec tracker filters by parent_run_id only"
            )
        ids = []
        if parent_run_id is not None and not is_storable_run_id(parent_run_id):
            return []  # a run with that source would have recorded it in a file too long
        parent_name = None if parent_run_id is None else encode_run_id(parent_run_id)
        for name, is_dir in self._fs.listdir(self.root):
            run_id = decode_run_id(name) if is_dir else None
            if run_id is None:
                continue
            if parent_name is not None and not self._fs.exists(
                self._fs.join(self.root, name, SOURCES, parent_name)
            ):
                continue
            ids.append(run_id)
        return sorted(ids)

    def lineage(self, run_id: str) -> Lineage:
        """Not implemented (nor is it in TorchX)."""
        raise NotImplementedError("lineage is not implemented by the fsspec tracker")

    def __repr__(self) -> str:
        return f"<FsspecTracker: root_path={self.root}>"


_JSON_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")


def _cut_off(data: bytes) -> bool:
    """True when ``data`` looks like the start of a JSON document whose end is missing."""
    try:
        json.loads(data)
    except json.JSONDecodeError as e:
        if e.msg.startswith("Unterminated string"):
            return True  # the data ends inside a string (e.pos is where the string starts)
        if e.msg.startswith("Invalid \\uXXXX escape"):
            return len(e.doc) - e.pos < 6  # the data ends inside a \uXXXX escape
        tail = e.doc[e.pos :]
        if tail and (
            all(c in "+-.eE0123456789" for c in tail)  # inside a number
            or any(lit.startswith(tail) for lit in _JSON_LITERALS)
        ):
            return True
        return e.pos >= len(e.doc.rstrip())
    except UnicodeDecodeError as e:
        # the data ends inside a character of several bytes
        return (
            e.reason == "unexpected end of data"
            and e.end == len(data)
            and _cut_off(data[: e.start])
        )
    except (ValueError, RecursionError):
        return False
    return False


def _put_config(key: str, value: str, config: dict[str, Any], source: str) -> None:
    head, dot, rest = key.partition(".")
    if not dot:
        config[key] = value
        return
    if not rest or not head:
        raise TrackerConfigError(f"{source}: config key {key!r} is not valid (empty part)")
    nested = config.setdefault(head, {})
    if not isinstance(nested, dict):
        raise TrackerConfigError(f"{source}: config key {head!r} is both a value and a section")
    _put_config(rest, value, nested, source)


def _read_text(config_file: str) -> str:
    path = config_file[len("file://") :] if config_file.startswith("file://") else config_file
    if "://" not in path:
        try:
            data = _read_regular(path, MAX_CONFIG_BYTES)
            if len(data) > MAX_CONFIG_BYTES:
                raise TrackerConfigError(
                    f"config file {config_file!r} is larger than {MAX_CONFIG_BYTES} bytes "
                    "(it should hold a few key=value lines)"
                )
            return data.decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise TrackerConfigError(f"cannot read config file {config_file!r}: {reason}") from None
    fsspec = _import_fsspec(f"reading config file {config_file!r}")
    try:
        with fsspec.open(config_file, "rt", encoding="utf-8") as f:
            return str(f.read())
    except Exception as e:
        raise TrackerConfigError(f"cannot read config file {config_file!r}: {e}") from None


def _import_fsspec(why: str) -> Any:
    try:
        import fsspec
    except ImportError:
        raise TrackerConfigError(f"{why} needs fsspec: {INSTALL_HINT}") from None
    return fsspec


def read_config(config_file: str) -> dict[str, Any]:
    """The ``key=value`` lines of a tracker config file, ``a.b=v`` nested (TorchX's format).

    Raises:
        TrackerConfigError: the file cannot be read, or a key is not valid.
    """
    data: dict[str, Any] = {}
    for line in _read_text(config_file).splitlines():
        if line.lstrip().startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if key.strip() and sep and value.strip():
            _put_config(key.strip(), value.strip(), data, config_file)
    return data


def create(config: str | None) -> FsspecTracker:
    """The tracker described by the config file ``config`` (TorchX's entry point of the same name).

    The file needs ``protocol`` (``file`` for a local path, or any fsspec protocol) and ``root_path``
    (an existing directory); other keys are passed to ``fsspec.filesystem(protocol, **kwargs)``.

    Raises:
        TrackerConfigError: no config given, the file is unreadable, a key is missing, the root does
            not exist, or the protocol needs fsspec and it is not installed.
    """
    if not config:
        raise TrackerConfigError(
            "the fsspec tracker needs a config file: set 'config = PATH' in its [tracker:NAME] "
            "section of .torchxconfig (a file with 'protocol=file' and 'root_path=DIR' lines)"
        )
    values = read_config(config)
    missing = [k for k in ("protocol", "root_path") if k not in values]
    if missing:
        raise TrackerConfigError(
            f"config file {config!r} has no {' and no '.join(missing)} (both are required)"
        )
    protocol = values.pop("protocol")
    root = values.pop("root_path")
    if not isinstance(protocol, str) or not isinstance(root, str):
        raise TrackerConfigError(f"config file {config!r}: protocol and root_path must be values")
    if protocol in LOCAL_PROTOCOLS and not values:
        return FsspecTracker(None, root)
    fsspec = _import_fsspec(f"protocol {protocol!r} of config file {config!r}")
    try:
        fs = fsspec.filesystem(protocol, **values)
    except Exception as e:
        raise TrackerConfigError(
            f"config file {config!r}: fsspec cannot open protocol {protocol!r} with "
            f"{sorted(values)}: {type(e).__name__}: {e}"
        ) from None
    return FsspecTracker(fs, root)
