"""Directory watches through Linux inotify (ctypes on libc), delivered on the asyncio event loop.

One inotify instance per event loop carries every watch of that loop (inotify instances are a scarce
per-user resource; watches are not). Callbacks receive the changed file's name and the event mask.
Where inotify is unavailable (not Linux, a libc without it, the instance limit reached, or
``ASYNCTORCHX_DISABLE_INOTIFY=1``) ``watch`` returns None and callers fall back to polling.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import struct
import weakref
from collections.abc import Callable

logger = logging.getLogger(__name__)

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000

IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

DIRECTORY_EVENTS = (
    IN_MODIFY
    | IN_CLOSE_WRITE
    | IN_CREATE
    | IN_MOVED_TO
    | IN_DELETE_SELF
    | IN_MOVE_SELF
    | IN_ONLYDIR
)

_EVENT_HEADER = struct.Struct("iIII")

WatchCallback = Callable[[str, int], None]

#: Set to "1" to make ``watch`` report inotify as unavailable (readers then poll): for tests and for
#: file systems where inotify misses writes (network file systems written by other hosts).
DISABLE_ENV = "ASYNCTORCHX_DISABLE_INOTIFY"


def _load_inotify_libc() -> ctypes.CDLL:
    """The C library holding inotify: the symbols the process already has (libc among them),
    else ``libc.so.6``.

    Never ``ctypes.util.find_library``: it runs ``ldconfig -p`` (or gcc) in a subprocess, and the
    first watch of a process looks libc up on the event loop.

    Raises:
        OSError: neither has ``inotify_init1``.
    """
    for name in (None, "libc.so.6"):
        try:
            lib = ctypes.CDLL(name, use_errno=True)
        except OSError:
            continue
        if hasattr(lib, "inotify_init1"):
            return lib
    raise OSError(errno.ENOSYS, "no C library with inotify_init1")


class _Libc:
    def __init__(self) -> None:
        lib = _load_inotify_libc()
        self.init1 = lib.inotify_init1
        self.init1.argtypes = [ctypes.c_int]
        self.init1.restype = ctypes.c_int
        self.add_watch = lib.inotify_add_watch
        self.add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self.add_watch.restype = ctypes.c_int
        self.rm_watch = lib.inotify_rm_watch
        self.rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        self.rm_watch.restype = ctypes.c_int


_libc: _Libc | None = None
_libc_failed = False


def _get_libc() -> _Libc | None:
    global _libc, _libc_failed
    if os.environ.get(DISABLE_ENV) == "1":
        return None
    if _libc is None and not _libc_failed:
        try:
            _libc = _Libc()
        except (OSError, AttributeError, TypeError):
            _libc_failed = True
    return _libc


class Watch:
    """One registration made by ``watch``; ``cancel`` removes it (idempotent)."""

    __slots__ = ("_hub", "callback", "path", "wd")

    def __init__(self, hub: _Hub, wd: int, path: str, callback: WatchCallback) -> None:
        self._hub = hub
        self.wd = wd
        self.path = path
        self.callback = callback

    @property
    def active(self) -> bool:
        """False once cancelled or once the watched directory went away."""
        return self.wd >= 0

    def cancel(self) -> None:
        """Stops delivering events to this watch."""
        if self.wd >= 0:
            self._hub.remove(self)
            self.wd = -1


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class _Hub:
    def __init__(self, loop: asyncio.AbstractEventLoop, libc: _Libc, fd: int) -> None:
        self._loop_ref = weakref.ref(loop)
        self._libc = libc
        self._fd = fd
        self._by_wd: dict[int, set[Watch]] = {}
        loop.add_reader(fd, self._on_readable)
        # A loop closed while followers were left open must not leak the inotify descriptor.
        self._finalizer = weakref.finalize(loop, _close_fd, fd)

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def add(self, path: str, mask: int, callback: WatchCallback) -> Watch:
        wd = self._libc.add_watch(self._fd, os.fsencode(path), mask)
        if wd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
        w = Watch(self, wd, path, callback)
        self._by_wd.setdefault(wd, set()).add(w)
        return w

    def remove(self, w: Watch) -> None:
        found = self._by_wd.get(w.wd)
        if found is None:
            return
        found.discard(w)
        if not found:
            del self._by_wd[w.wd]
            self._libc.rm_watch(self._fd, w.wd)
        if not self._by_wd:
            self.close()

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            self._finalizer.detach()
            loop = self._loop_ref()
            if loop is not None:
                if not loop.is_closed():
                    loop.remove_reader(fd)
                if _hub_of(loop) is self:
                    del _hubs[loop]
            _close_fd(fd)

    def _on_readable(self) -> None:
        chunks = []
        while True:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                break
            except OSError as e:
                logger.warning("inotify read failed: %s", e)
                break
            if not data:
                break
            chunks.append(data)
        if not chunks:
            return
        data = b"".join(chunks)
        pos, n = 0, len(data)
        calls: list[tuple[Watch, str, int]] = []
        overflow = False
        gone: list[int] = []
        while pos + _EVENT_HEADER.size <= n:
            wd, mask, _cookie, length = _EVENT_HEADER.unpack_from(data, pos)
            pos += _EVENT_HEADER.size
            name = data[pos : pos + length].rstrip(b"\0").decode("utf-8", "surrogateescape")
            pos += length
            if mask & IN_Q_OVERFLOW:
                overflow = True
                continue
            for w in self._by_wd.get(wd, ()):
                calls.append((w, name, mask))
            if mask & IN_IGNORED:
                gone.append(wd)
        if overflow:
            calls = [(w, "", IN_Q_OVERFLOW) for ws in self._by_wd.values() for w in ws]
        for wd in gone:
            for w in self._by_wd.pop(wd, set()):
                w.wd = -1
        seen: set[tuple[int, str, int]] = set()
        for w, name, mask in calls:
            key = (id(w), name, mask)
            if key in seen:
                continue
            seen.add(key)
            try:
                w.callback(name, mask)
            except Exception:
                logger.exception("inotify callback failed for %s", w.path)
        if not self._by_wd:
            self.close()


#: Each loop's hub, held weakly on both sides: the loop keeps its open hub alive (its reader), and
#: a hub held strongly here would keep its loop alive through the watches' callbacks (a scheduler
#: never closed, whose objects refer to the loop): the loop, and everything on it, would never be
#: collected, nor their descriptors closed.
_hubs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, weakref.ref[_Hub]] = (
    weakref.WeakKeyDictionary()
)


def _hub_of(loop: asyncio.AbstractEventLoop) -> _Hub | None:
    ref = _hubs.get(loop)
    return None if ref is None else ref()


def available() -> bool:
    """True when libc exposes inotify."""
    return _get_libc() is not None


def watch(path: str, callback: WatchCallback, mask: int = DIRECTORY_EVENTS) -> Watch | None:
    """Calls ``callback(name, mask)`` on the running loop for each inotify event on ``path``.

    Returns None when inotify cannot be used here.

    Raises:
        FileNotFoundError: ``path`` does not exist (or is not a directory, with ``IN_ONLYDIR``).
    """
    libc = _get_libc()
    if libc is None:
        return None
    loop = asyncio.get_running_loop()
    hub = _hub_of(loop)
    if hub is None or hub.closed:
        fd = libc.init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            logger.debug("inotify_init1 failed: %s", os.strerror(err))
            return None
        hub = _Hub(loop, libc, fd)
        _hubs[loop] = weakref.ref(hub)
    try:
        return hub.add(path, mask, callback)
    except OSError as e:
        if not hub._by_wd:
            hub.close()
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            raise FileNotFoundError(e.errno, e.strerror, path) from None
        logger.debug("inotify_add_watch(%s) failed: %s", path, e)
        return None
