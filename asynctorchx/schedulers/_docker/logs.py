"""The ``local_docker`` log source: a replica's lines, read from the Docker API.

A replica's log is the logs of its containers, one per attempt (a ROLE/APPLICATION retry makes a new
container; a REPLICA retry restarts the same one), read oldest first. Lines are read with
``timestamps=1`` and stdout/stderr as the query asks (both: in the order Docker received them);
``since``/``until`` go to the engine and are checked again on each line's time; a followed stream
that drops is resumed from its ``ResumeCursor``s (the shared one of ``asynctorchx.logs``), so no
line is lost or repeated. Each stream read has its own cursor (its own unfinished last line): the
engine stamps stdout and stderr apart, each line when it reads it from its pipe, so the lines of a
combined read are in the order Docker stored them but their timestamps can go back between the
streams; no line is dropped for its timestamp, only those a resumed stream gives again. Following
ends once the app is terminal and every container has been drained.

An engine that cannot be reached (restarted, briefly overloaded) is asked again with a capped
backoff, and the read resumes where it was once it answers: a followed read waits out up to
``_FOLLOW_OUTAGE_LIMIT`` seconds of engine failures in a row, one that does not follow
``_READ_OUTAGE_LIMIT``; then DockerEngineUnavailableError is raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from asynctorchx.logs._cursor import Position
from asynctorchx.logs._match import LineFilter
from asynctorchx.logs._query import LogQuery, Stream
from asynctorchx.logs._timestamps import CursorPass, ResumeCursor, seconds_to_ns
from asynctorchx.schedulers._docker.engine import (
    DockerEngine,
    DockerEngineUnavailableError,
    DockerNotFoundError,
)
from asynctorchx.schedulers._docker.frames import (
    STDERR,
    STDOUT,
    LineAssembler,
    LogLine,
    format_api_time,
)
from asynctorchx.schedulers._docker.state import ContainerInfo, assess
from asynctorchx.schedulers.api import check_replica, role_replica_counts
from asynctorchx.specs.api import UnknownAppException, is_terminal

logger = logging.getLogger(__name__)

#: seconds of engine failures in a row (dropped streams, an unreachable engine) after which a
#: followed read gives up (raises DockerEngineUnavailableError)
_FOLLOW_OUTAGE_LIMIT = 300.0
#: the same for a read that does not follow
_READ_OUTAGE_LIMIT = 5.0
#: the longest wait between two attempts to reach the engine again
_MAX_BACKOFF = 2.0


#: a container's cursors, one per stream read (STDOUT, STDERR)
_Cursors = dict[int, ResumeCursor]


@dataclass(frozen=True)
class _Window:
    """What to read of each container: which streams, and the time window in nanoseconds."""

    stdout: bool
    stderr: bool
    since_ns: int | None
    until_ns: int | None

    def admits(self, ts: int | None) -> bool:
        return ts is None or (
            (self.since_ns is None or ts >= self.since_ns)
            and (self.until_ns is None or ts <= self.until_ns)
        )

    @property
    def streams(self) -> tuple[int, ...]:
        """The ids of the streams read, in the order of a cursor's position."""
        return (STDOUT,) * self.stdout + (STDERR,) * self.stderr

    def past(self) -> bool:
        """True once ``until`` has gone by (nothing more can be written within the window)."""
        return self.until_ns is not None and time.time_ns() > self.until_ns


class DockerLogSource:
    """Reads replicas' logs through the engine wrapper.

    Args:
        engine: the engine to read from.
        list_app: lists one app's containers (the event feed's listing).
        wait_app: waits for the app's next event, at most the seconds given.
        handle_of: the handle of an app id (for UnknownAppException).
    """

    def __init__(
        self,
        engine: DockerEngine,
        list_app: Callable[[str], Awaitable[list[ContainerInfo]]],
        wait_app: Callable[[str, float], Awaitable[None]],
        handle_of: Callable[[str], str],
    ) -> None:
        self._engine = engine
        self._list_app = list_app
        self._wait_app = wait_app
        self._handle_of = handle_of

    async def entries(self, query: LogQuery) -> AsyncGenerator[tuple[Position, str], None]:
        """``(position, line)`` pairs of what ``query`` asks for, after ``query.after`` when set.

        A position is ``(attempt, container id)`` then ``(since, count, partial)`` of each
        stream read: the container's cursors (``ResumeCursor``) once the line was returned.
        Resuming skips the attempts before the cursor's, and reads the cursor's container from the
        earliest ``since``, each stream skipping its lines stamped before its ``since`` and its
        first ``count`` at or after it.

        Raises:
            UnknownAppException: Docker has no container of the app.
            UnknownRoleException: no such role or replica.
        """
        flt = LineFilter(query.regex) if query.regex is not None else None
        containers = await self._list_app(query.app_id)
        a = assess(query.app_id, containers)
        if a is None:
            raise UnknownAppException(self._handle_of(query.app_id))
        check_replica(query.app_id, role_replica_counts(a.response.roles), query.role, query.k)
        window = _Window(
            stdout=query.stream in (Stream.STDOUT, Stream.COMBINED),
            stderr=query.stream in (Stream.STDERR, Stream.COMBINED),
            since_ns=None if query.since is None else seconds_to_ns(query.since),
            until_ns=None if query.until is None else seconds_to_ns(query.until),
        )
        cursors: dict[str, _Cursors] = {}
        first_attempt = 0
        if query.after is not None:
            attempt, cid, *counts = query.after.position
            key = (query.role, query.k, attempt)
            if not any(
                c.id == cid and (c.role, c.replica_id, c.attempt) == key for c in containers
            ):
                raise ValueError(
                    f"the log cursor's container {str(cid)[:12]!r} (attempt {attempt}) is not a "
                    f"container of {query.app_id}/{query.role}/{query.k} (removed, or another log)"
                )
            first_attempt = int(attempt)
            if len(counts) == 2:  # an older single-stream cursor
                counts.append(0)
            cursors[str(cid)] = {
                s: ResumeCursor(int(counts[i]) or None, int(counts[i + 1]), int(counts[i + 2]))
                for s, i in zip(window.streams, range(0, len(counts), 3), strict=True)
            }
        finished: set[str] = set()  # containers read to the end that will not write again
        outage = _Outage(_FOLLOW_OUTAGE_LIMIT if query.follow else _READ_OUTAGE_LIMIT)
        while True:
            final = not query.follow or a is None or is_terminal(a.response.state) or window.past()
            attempts = sorted(
                (
                    c
                    for c in containers
                    if not c.is_marker
                    and (c.role, c.replica_id) == (query.role, query.k)
                    and c.attempt >= first_attempt
                ),
                key=lambda c: c.attempt,
            )
            for c in attempts:
                if c.id in finished:
                    continue
                latest = c is attempts[-1]
                mine = cursors.setdefault(c.id, {s: ResumeCursor() for s in window.streams})
                read = self._container_lines(
                    query.app_id, c.id, window, mine, latest and not final, outage
                )
                async with contextlib.aclosing(read):
                    async for line in read:
                        if flt is None or await flt.matches(line.text):
                            yield _position(c.attempt, c.id, mine), line.text
                if final or not latest:
                    finished.add(c.id)
            if final:
                return
            # The replica's latest container stopped while the app goes on: it may be restarted or
            # retried as a new attempt; look again on the app's next event (or in a second).
            await self._wait_app(query.app_id, 1.0)
            containers = await self._relist(query.app_id, outage)
            a = assess(query.app_id, containers)

    async def _relist(self, app_id: str, outage: _Outage) -> list[ContainerInfo]:
        """The app's containers, asked again while the engine cannot be reached (see ``_Outage``)."""
        while True:
            try:
                containers = await self._list_app(app_id)
            except DockerEngineUnavailableError as e:
                await outage.failed(e, f"listing the containers of {app_id}")
                continue
            outage.ended()
            return containers

    async def _container_lines(
        self,
        app_id: str,
        cid: str,
        window: _Window,
        cursors: _Cursors,
        follow: bool,
        outage: _Outage,
    ) -> AsyncGenerator[LogLine, None]:
        """One container's lines after ``cursors``; with ``follow``, until the container stops.

        A stream that drops is resumed from the cursors, so no line is lost or repeated; an engine
        that cannot be reached is asked again as ``outage`` allows.
        """
        while True:
            opened = _opening(window, cursors)
            read = _Read({s: c.begin_pass(opened) for s, c in cursors.items()}, window)
            frames = self._engine.container_log_frames(cid, _params(window, opened, follow))
            try:
                async with contextlib.aclosing(frames):
                    async for frame in frames:
                        outage.ended()  # the engine answers: only failures in a row count
                        line = read.feed(*frame)
                        if line is read.END:
                            return
                        if line is not None:
                            yield line
                if not follow:
                    for tail in read.flush():
                        yield tail
                    return
                follow = await self._keep_following(app_id, cid, window)
                outage.ended()
            except DockerNotFoundError:
                return  # the container was removed
            except DockerEngineUnavailableError as e:
                await outage.failed(e, f"log stream of container {cid[:12]}")

    async def _keep_following(self, app_id: str, cid: str, window: _Window) -> bool:
        """After a followed stream ended: whether to follow again (the container still runs, or
        may run again) or read once more to drain it (it stopped, or ``until`` has gone by).

        Raises:
            DockerNotFoundError: the container was removed.
        """
        info = await self._engine.inspect_container(cid)
        if info is None:
            raise DockerNotFoundError(f"container {cid[:12]} is gone")
        state = info.get("State") or {}
        if window.past():
            return False
        if state.get("Restarting") or state.get("Paused"):
            await self._wait_app(app_id, 0.5)  # not writing now: follow again once it changes
        return bool(state.get("Running") or state.get("Restarting") or state.get("Paused"))


class _Outage:
    """The engine failures in a row of one log read: each waits a capped backoff before the next
    attempt, until they have lasted ``limit`` seconds."""

    def __init__(self, limit: float) -> None:
        self._limit = limit
        self._since: float | None = None
        self._failures = 0

    def ended(self) -> None:
        """The engine answered."""
        self._since = None
        self._failures = 0

    async def failed(self, error: DockerEngineUnavailableError, what: str) -> None:
        """Waits before the next attempt after ``error``.

        Raises:
            DockerEngineUnavailableError: ``error``, once the failures have lasted ``limit``.
        """
        now = time.monotonic()
        if self._since is None:
            self._since = now
            logger.info("%s failed (%s); trying again", what, error)
        if now - self._since >= self._limit:
            raise error
        self._failures += 1
        await asyncio.sleep(min(0.1 * 2**self._failures, _MAX_BACKOFF))


class _Read:
    """One pass over a container's log stream: frames into lines, filtered by window and cursor."""

    END = LogLine(None, 0, "")

    def __init__(self, cursors: dict[int, CursorPass], window: _Window) -> None:
        self._cursors = cursors
        self._window = window
        self._assembler = LineAssembler()

    def feed(self, stream: int, payload: bytes) -> LogLine | None:
        """The line a frame completes, if it is to be returned; ``END`` past ``until``.

        The cursor sees every line before the window is applied: a cursor is a place in the log,
        whatever window it was taken with.
        """
        line = self._assembler.feed(stream, payload)
        if line is None:
            return None
        until = self._window.until_ns
        if until is not None and line.ts_ns is not None and line.ts_ns > until:
            return self.END
        cursor = self._cursors.get(line.stream)
        if cursor is not None and not cursor.admit(line.ts_ns):
            return None
        return line if self._window.admits(line.ts_ns) else None

    def flush(self) -> Iterator[LogLine]:
        """The unterminated last lines, once the stream has ended: each is admitted to its
        stream's cursor as it is given (so the first one's position does not count the next),
        and as partial (given again whole once it has grown: see ``ResumeCursor``)."""
        for line in self._assembler.flush():
            if not self._window.admits(line.ts_ns):
                continue
            cursor = self._cursors.get(line.stream)
            if cursor is None or cursor.admit_partial(line.ts_ns, line.size):
                yield line


def _position(attempt: int, cid: str, cursors: _Cursors) -> Position:
    """A line's position: the container and each stream's cursor (see ``entries``)."""
    out: list[int | str] = [attempt, cid]
    for c in cursors.values():
        out += (c.since_ns or 0, c.count, c.partial)
    return tuple(out)


def _opening(window: _Window, cursors: _Cursors) -> int | None:
    """Where to (re)open a container's log: the earliest of the streams' cursors' ``since`` (the
    query's ``since`` for a stream that has none yet; None: the log's start). Each stream skips
    what it returned."""
    starts = [window.since_ns if c.since_ns is None else c.since_ns for c in cursors.values()]
    return None if None in starts else min(s for s in starts if s is not None)


def _params(window: _Window, start: int | None, follow: bool) -> dict[str, Any]:
    """The query of ``GET /containers/{id}/logs``, from ``start`` (None: the log's start)."""
    params: dict[str, Any] = {
        "stdout": window.stdout,
        "stderr": window.stderr,
        "timestamps": True,
        "follow": follow,
    }
    if start is not None:
        params["since"] = format_api_time(start)
    if window.until_ns is not None:
        params["until"] = format_api_time(window.until_ns)
    return params
