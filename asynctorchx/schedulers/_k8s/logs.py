"""The ``kubernetes`` log source: a replica's lines, read from its pods' logs.

A replica is the newest pod of its completion index; following it goes on across pod replacements
(REPLICA retries, disruptions, restarts of the Job) until the app is terminal. Logs are read with
``timestamps=true``: the kubelet prefixes each line with its RFC 3339 nanosecond time and a space,
which gives ``since``/``until`` per line. A dropped stream, or a followed one silent for the
connection's ``log_read_timeout`` (a quiet container, or a connection gone half-open), is resumed
from ``sinceTime`` (rounded down to the second by the API) with the shared ``ResumeCursor`` skipping
the lines already returned, from the same pod even if it was replaced meanwhile (its last lines
first, then its replacement's); a pod that has ended is read to its end without follow. Kubernetes
keeps a container's stdout and stderr as one log: only COMBINED is readable. The container runtime
stamps each line when it reads it from its stream, before the log's shared writer takes it, so the
stamps can go back a little between stdout and stderr lines: no line is dropped for its timestamp,
only those a resumed stream gives again.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from asynctorchx.logs._cursor import Position
from asynctorchx.logs._match import LineFilter
from asynctorchx.logs._query import LogQuery
from asynctorchx.logs._timestamps import (
    ResumeCursor,
    format_rfc3339_seconds,
    seconds_to_ns,
    split_timestamp,
)
from asynctorchx.schedulers._k8s import names as n
from asynctorchx.schedulers._k8s.client import KubeApiError, KubeConnection
from asynctorchx.schedulers._k8s.informer import Informer
from asynctorchx.schedulers._k8s.reads import AppReader
from asynctorchx.schedulers._k8s.status import meta, pod_sort_key, pod_started, pod_state
from asynctorchx.schedulers.api import DescribeAppResponse, check_replica
from asynctorchx.specs.api import UnknownAppException, is_terminal

logger = logging.getLogger(__name__)

Obj = dict[str, Any]

#: a log read (without following: an ended pod's, or any without follow) cut this many times in a
#: row without reading further raises instead of returning a part or retrying forever
_MAX_LOG_RESUMES = 3
#: what the 400 answering a log read of a container not started yet says (``container "c" in pod
#: "p" is waiting to start: ContainerCreating``): expected, the read is tried again
_WAITING = "is waiting to start"


def _refused(error: KubeApiError | None) -> bool:
    """True for a log read the API server refused (400) other than for a container not started
    yet (tried again without a word)."""
    return error is not None and error.status == 400 and _WAITING not in error.message


def to_rfc3339_seconds(ns: int) -> str:
    """Nanoseconds since the epoch as the API's ``sinceTime``: RFC 3339 in UTC, to the second."""
    return format_rfc3339_seconds(ns)


@dataclass
class _Follow:
    """Where a read of one replica is: a cursor per pod, the pods read to their end, the pause."""

    cursors: dict[str, ResumeCursor] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    pause: float = 0.05
    drops: int = 0
    warned: set[str] = field(default_factory=set)  # the pods whose refused read was logged


@dataclass
class _PodRead:
    """How one read of a pod's log ended."""

    clean: bool = False  # the stream ended by itself
    past_until: bool = False  # a line after ``until`` came: nothing more is wanted
    error: KubeApiError | None = None  # the stream could not be read, or dropped (status 0)


class KubeLogSource:
    """Reads replicas' logs.

    Args:
        connection: the API client.
        reader: reads the replica's pods (from the watched cache when synced).
        watch: starts (or returns) the watch of a namespace, to wait for changes.
        describe: the scheduler's ``describe`` (a read).
        handle_of: the handle of an app id (for UnknownAppException).
    """

    def __init__(
        self,
        connection: KubeConnection,
        reader: AppReader,
        watch: Callable[[str], Awaitable[Informer]],
        describe: Callable[[str], Awaitable[DescribeAppResponse | None]],
        handle_of: Callable[[str], str],
    ) -> None:
        self._connection = connection
        self._reader = reader
        self._watch = watch
        self._describe = describe
        self._handle_of = handle_of

    async def entries(self, query: LogQuery) -> AsyncGenerator[tuple[Position, str], None]:
        """``(position, line)`` pairs of what ``query`` asks for, after ``query.after`` when set.

        A position is ``(pod uid, since, count)``: that pod's ``ResumeCursor`` once the line was
        returned. Resuming reads that pod's log from ``since`` (a whole second, as the API's
        ``sinceTime`` is) and skips its first ``count`` lines stamped at or after it; when
        that pod has been replaced since (and is still listed, terminated or still terminating),
        the rest of its log comes first (followed to its end when following), then the newest
        pod's from its start. A replaced pod whose log the API refuses (400, 404) is skipped with
        a warning: its lines cannot be read any more.

        Raises:
            UnknownAppException: no such app.
            UnknownRoleException: no such role or replica.
        """
        ns, app = await self._check(query)
        role_dns = n.role_dns_name(query.role)
        if query.follow:
            await self._watch(ns)
        state = _Follow()
        catch_up = None  # the cursor's pod, if since replaced: the rest of its log comes first
        if query.after is not None:
            uid_at, ts, at_ts = query.after.position
            catch_up = str(uid_at)
            state.cursors[catch_up] = ResumeCursor(int(ts) or None, int(at_ts))
        while True:
            pods = await self._reader.replica_pods(ns, app, role_dns, query.k)
            pod = max(pods, key=pod_sort_key) if pods else None
            older = False
            if catch_up is not None:
                old = next((p for p in pods if meta(p).get("uid") == catch_up), None)
                if old is not None and old is not pod:  # replaced, maybe still terminating
                    pod, older = old, True
                else:
                    catch_up = None
            uid = str(meta(pod).get("uid", "")) if pod is not None else ""
            if pod is not None and uid not in state.finished and pod_started(pod):
                was_terminal = is_terminal(pod_state(pod))
                # an ended pod's log is read to its end without follow: that read has a timeout
                # and a bounded number of resumes, where a silent follow would be re-opened forever
                following = query.follow and not was_terminal
                read = _PodRead()
                cursor = state.cursors.setdefault(uid, ResumeCursor())
                reached = (cursor.since_ns, cursor.count)
                pod_lines = self._read_pod(ns, pod, role_dns, query, cursor, read, following)
                async with contextlib.aclosing(pod_lines):
                    async for line in pod_lines:
                        state.drops = 0  # counted only in a row: this read got somewhere
                        yield (uid, cursor.since_ns or 0, cursor.count), line
                if (cursor.since_ns, cursor.count) != reached:
                    state.drops = 0  # it got further, even if no line it read was wanted
                if read.past_until:
                    return
                if older:
                    if read.error is not None and read.error.status == 0 and not following:
                        state.drops += 1
                        if state.drops > _MAX_LOG_RESUMES:
                            raise read.error
                        continue
                    if (read.clean and (was_terminal or not query.follow)) or (
                        read.error is not None and read.error.status != 0
                    ):
                        if read.error is not None:
                            logger.warning(
                                "the log of replaced pod %s cannot be read (%s); reading its "
                                "replacement",
                                meta(pod).get("name"),
                                read.error,
                            )
                        state.finished.add(uid)
                        catch_up = None
                        continue
                    # followed while terminating: read it again (to its end) once it has ended
                    await self._wait(ns, app, state.pause)
                    continue
                if _refused(read.error) and uid not in state.warned:
                    # not the expected 400 of a container yet to start: say so (once per pod)
                    state.warned.add(uid)
                    logger.warning(
                        "the log of pod %s cannot be read: %s", meta(pod).get("name"), read.error
                    )
                if read.error is not None and read.error.status == 0 and not following:
                    state.drops += 1
                    if state.drops > _MAX_LOG_RESUMES:
                        raise read.error
                    continue
                if not query.follow:
                    return
                if read.error is not None and read.error.status == 0:
                    # cut or silent: what the pod wrote since comes first, even once it is replaced
                    catch_up = uid
                if read.clean and was_terminal:
                    state.finished.add(uid)
                    continue
                if read.clean and await self._ended(ns, app, role_dns, query.k, uid):
                    continue  # it terminated meanwhile: read it once more, to its end
                if not read.clean:
                    state.pause = 0.05
            elif not query.follow:
                return
            else:
                done = await self._app_done(query, ns, app, role_dns, state)
                if done is not None:
                    if done:
                        return
                    continue
            await self._wait(ns, app, state.pause)
            state.pause = min(state.pause * 2, 1.0)

    async def _check(self, query: LogQuery) -> tuple[str, str]:
        """The app's namespace and name, once the app, role and replica are known to exist."""
        resp = await self._describe(query.app_id)
        parts = n.split_app_id(query.app_id)
        if resp is None or parts is None:
            raise UnknownAppException(self._handle_of(query.app_id))
        counts = {r.name: r.num_replicas for r in resp.roles} or {
            rs.role: len(rs.replicas) for rs in resp.roles_statuses
        }
        check_replica(query.app_id, counts, query.role, query.k)
        return parts

    async def _read_pod(
        self,
        ns: str,
        pod: Obj,
        container: str,
        query: LogQuery,
        cursor: ResumeCursor,
        read: _PodRead,
        follow: bool,
    ) -> AsyncGenerator[str, None]:
        """The new lines of one pod's log (following it with ``follow``); how the read ended goes
        to ``read`` (a follow silent for the log read timeout ends as a drop, status 0).

        ``container`` is the role's container (named as the role's DNS name): the API server
        refuses a log read without one on a pod with several (a pod overlay's sidecar).

        The cursor sees every line before ``since`` is applied: a cursor is a place in the log,
        whatever window it was taken with.
        """
        since_ns = None if query.since is None else seconds_to_ns(query.since)
        until_ns = None if query.until is None else seconds_to_ns(query.until)
        flt = LineFilter(query.regex) if query.regex is not None else None
        start = cursor.since_ns if cursor.since_ns is not None else since_ns
        since_time = to_rfc3339_seconds(start) if start is not None else None
        api = await self._connection.api()
        try:
            async with api.pod_log(
                ns, meta(pod)["name"], container=container, follow=follow, since_time=since_time
            ) as raw_lines:
                new = cursor.begin_pass(start)
                async for raw in raw_lines:
                    ts, body = split_timestamp(raw)
                    if ts is not None and until_ns is not None and ts > until_ns:
                        read.past_until = True
                        return
                    if not new.admit(ts) or (
                        ts is not None and since_ns is not None and ts < since_ns
                    ):
                        continue
                    text = body.decode("utf-8", "replace")
                    if flt is None or await flt.matches(text):
                        yield text
            read.clean = True
        except KubeApiError as e:
            if e.status not in (0, 400, 404):
                raise
            logger.debug("log stream of %s ended: %s", meta(pod).get("name"), e)
            read.error = e

    async def _ended(self, ns: str, app: str, role_dns: str, k: int, uid: str) -> bool:
        """After a clean end of a followed stream: True when that pod is still the newest and has
        terminated (read its log once more, to its end)."""
        pods = await self._reader.replica_pods(ns, app, role_dns, k)
        fresh = max(pods, key=pod_sort_key) if pods else None
        return fresh is not None and meta(fresh).get("uid") == uid and is_terminal(pod_state(fresh))

    async def _app_done(
        self, query: LogQuery, ns: str, app: str, role_dns: str, state: _Follow
    ) -> bool | None:
        """When no pod of the replica is readable: True when following is over (the app is
        terminal and its newest pod read), False to look again at once, None to wait."""
        current = await self._describe(query.app_id)
        if current is not None and not is_terminal(current.state):
            return None
        pods = await self._reader.replica_pods(ns, app, role_dns, query.k)
        newest = max(pods, key=pod_sort_key) if pods else None
        if newest is None or not pod_started(newest):
            return True
        return meta(newest).get("uid") in state.finished

    async def _wait(self, ns: str, app: str, delay: float) -> None:
        """Returns at the app's next change, or after ``delay`` seconds."""
        inf = await self._watch(ns)
        event = inf.change_event(app)
        with anyio.move_on_after(delay):
            await event.wait()
