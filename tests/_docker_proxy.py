"""A unix-socket forwarder to the Docker engine that a test can take down, stall or bring back.

``EngineForwarder`` listens on a socket of its own (``url``: give it to the scheduler as
``docker_host``) and passes each connection through to the real engine. It runs its own event
loop in a thread, so it keeps serving while the test's loop waits. A test switches its ``mode``:

- ``FORWARD``: requests go to the engine and back (the default).
- ``DROP``: the engine is unreachable: every open connection is cut, and each request is noted
  and cut off unanswered (with ``only``: only the requests whose line contains it; the others
  are forwarded).
- ``STALL``: a frozen engine: connections (open or new) stay open, their requests are noted and
  never answered.

Every request line seen (in any mode) is counted by ``arrived``: a test waits for "the n-th
request whose line contains X" instead of sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import shutil
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import anyio
import pytest
from _docker_env import purge_session

from asynctorchx.schedulers.docker import DockerScheduler

T = TypeVar("T")

_UPSTREAM = "/var/run/docker.sock"
_METHODS = (b"GET ", b"POST ", b"PUT ", b"DELETE ", b"HEAD ")


class Mode(enum.Enum):
    FORWARD = "forward"
    DROP = "drop"
    STALL = "stall"


class EngineForwarder:
    """Forwards a unix socket of its own to the Docker engine's (see the module's docstring).

    Use it as a context manager (``with EngineForwarder() as fw``): it serves from the start and
    stops, cutting every connection, on exit.
    """

    def __init__(self, upstream: str | None = None) -> None:
        host = os.environ.get("DOCKER_HOST", "")
        self.upstream = upstream or (host[len("unix://") :] if host.startswith("unix://") else "")
        self.upstream = self.upstream or _UPSTREAM
        self._dir = tempfile.mkdtemp(prefix="atx-fw-", dir="/tmp")  # short: sun_path limit
        self.path = os.path.join(self._dir, "docker.sock")
        self._mode = Mode.FORWARD
        self._only = ""
        self._closing: asyncio.Event | None = None
        self._lock = threading.Lock()
        self._lines: list[str] = []
        self._waits: list[tuple[tuple[str, ...], int, Callable[[], None]]] = []
        self._conns: set[asyncio.StreamWriter] = set()
        self._server: asyncio.AbstractServer | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        """The forwarder's address, as ``DOCKER_HOST`` spells it."""
        return f"unix://{self.path}"

    @property
    def mode(self) -> Mode:
        return self._mode

    def set_mode(self, mode: Mode, *, only: str = "") -> None:
        """Switches mode (see the module's docstring); ``DROP`` cuts every connection open."""
        self._call(self._set_mode(mode, only))

    def lines(self, *parts: str) -> list[str]:
        """The request lines seen so far that contain every one of ``parts``."""
        with self._lock:
            return [line for line in self._lines if all(p in line for p in parts)]

    async def arrived(self, *parts: str, count: int = 1) -> None:
        """Returns once ``count`` request lines containing every one of ``parts`` have been seen
        (counted from the forwarder's start)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the waiter's loop is closed
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

        wait = (parts, count, wake)
        with self._lock:
            if self._count(parts) >= count:
                return
            self._waits.append(wait)
        try:
            await done
        finally:
            with self._lock, contextlib.suppress(ValueError):
                self._waits.remove(wait)

    def __enter__(self) -> EngineForwarder:
        self._thread.start()
        self._call(self._start())
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Stops serving and cuts every connection. Idempotent."""
        if self._thread.is_alive():
            self._call(self._stop())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- in the forwarder's loop ------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _start(self) -> None:
        self._closing = asyncio.Event()
        self._server = await asyncio.start_unix_server(self._serve, self.path)

    async def _stop(self) -> None:
        assert self._closing is not None
        self._closing.set()
        if self._server is not None:
            self._server.close()
            self._server = None
        self._cut_all()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if others:  # each ends once its connection is cut (a held one: once closing is set)
            await asyncio.wait(others, timeout=5)

    async def _set_mode(self, mode: Mode, only: str) -> None:
        self._mode, self._only = mode, only
        if mode is Mode.DROP:
            self._cut_all()

    def _cut_all(self) -> None:
        for w in list(self._conns):
            w.transport.abort()
        self._conns.clear()

    def _note(self, data: bytes) -> str | None:
        """Notes the request line ``data`` starts with, if any; returns it."""
        if not data.startswith(_METHODS):
            return None
        line = data.split(b"\r\n", 1)[0].decode("latin-1")
        with self._lock:
            self._lines.append(line)
            for wait in list(self._waits):
                parts, count, wake = wait
                if self._count(parts) >= count:
                    self._waits.remove(wait)
                    wake()
        return line

    def _count(self, parts: tuple[str, ...]) -> int:
        return sum(all(p in line for p in parts) for line in self._lines)

    async def _hold(self, data: bytes) -> bool:
        """What the mode does to a request that starts with ``data``: False to forward it; True
        once it was refused (DROP: at once; STALL: when the forwarder closes)."""
        line = self._note(data)
        if self._mode is Mode.STALL:
            assert self._closing is not None
            await self._closing.wait()
            return True
        return self._mode is Mode.DROP and line is not None and self._only in line

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self._conns.add(cw)
        uw: asyncio.StreamWriter | None = None
        try:
            first = await cr.read(65536)
            if not first or await self._hold(first):
                return
            ur, uw = await asyncio.open_unix_connection(self.upstream)
            self._conns.add(uw)
            uw.write(first)
            await asyncio.gather(
                self._requests(cr, uw), self._answers(ur, cw), return_exceptions=True
            )
        except OSError:
            pass
        finally:
            for w in (cw, uw):
                if w is not None:
                    self._conns.discard(w)
                    w.transport.abort()

    async def _requests(self, cr: asyncio.StreamReader, uw: asyncio.StreamWriter) -> None:
        """Client to engine: each further request of the connection is noted and held as the
        mode says (a refused one cuts the connection)."""
        try:
            while data := await cr.read(65536):
                if await self._hold(data):
                    return
                uw.write(data)
                await uw.drain()
        finally:
            uw.transport.abort()

    async def _answers(self, ur: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        """Engine to client, as it comes."""
        try:
            while data := await ur.read(65536):
                cw.write(data)
                await cw.drain()
        finally:
            cw.transport.abort()


@pytest.fixture
async def outage_scheduler(
    forwarder: EngineForwarder, docker_session: str
) -> AsyncIterator[DockerScheduler]:
    """A DockerScheduler reaching the engine through the test module's ``forwarder`` fixture; its
    session is purged after (the forwarder forwarding again first)."""
    scheduler = DockerScheduler(docker_session, docker_host=forwarder.url)
    try:
        yield scheduler
    finally:
        forwarder.set_mode(Mode.FORWARD)
        with anyio.fail_after(30):
            await scheduler.close()
        await purge_session(docker_session)
