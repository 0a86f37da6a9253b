"""A fake Kubernetes API server speaking real HTTP on 127.0.0.1 (aiohttp), for the kubernetes backend.

Endpoints (the ones the backend uses), with the real API's paths, parameters and body shapes:

- ``/api/v1/namespaces/{ns}/services[/{name}]``, ``/apis/batch/v1/namespaces/{ns}/jobs[/{name}]``,
  ``/api/v1/namespaces/{ns}/pods[/{name}]``: create (POST), get, list (``labelSelector``), watch
  (``watch=true``, ``resourceVersion``, ``timeoutSeconds``, ``allowWatchBookmarks``), merge/strategic
  patch, delete (``propagationPolicy`` in a ``DeleteOptions`` body or the query);
- ``/api/v1/namespaces/{ns}/pods/{name}/log``: ``follow``, ``timestamps``, ``sinceTime``,
  ``sinceSeconds``, ``container``; ``400 BadRequest`` while the container is waiting to start.

Errors are ``Status`` objects (404 NotFound, 409 AlreadyExists, 422 Invalid, 400 BadRequest); a watch
from a compacted version gets the ``ERROR`` event with code 410 (reason ``Expired``) inside a 200
stream, as the real server sends it. Created objects are validated against the official Kubernetes
1.29 OpenAPI schemas in strict mode (``kubernetes-validate``), so a manifest the real server would
reject for an unknown or mistyped field is rejected here too.

Test hooks: ``drop_watches`` (end or cut every open watch), ``compact`` (forget the history: the next
resume gets 410), ``drop_log_streams``, ``silence_log_streams`` (a connection gone half-open),
``requests`` (every request received), ``sent_versions``
(the resourceVersions a watch request was sent, events and bookmarks, in order).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

from aiohttp import web

from k8s_fake.cluster import FakeCluster, PodContext, PodScript, format_ts
from k8s_fake.store import (
    RESOURCES,
    ApiError,
    Event,
    Request,
    Store,
    matches,
    not_found,
    parse_selector,
)

_PATH = re.compile(
    r"/(?:api/v1|apis/(?P<group>batch)/v1)/namespaces/(?P<ns>[^/]+)/(?P<resource>[^/]+)"
    r"(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?)?/?"
)
_GROUPS = {"services": None, "pods": None, "jobs": "batch"}
_LIST_KINDS = {"services": "ServiceList", "jobs": "JobList", "pods": "PodList"}


class _SchemaValidator:
    """Strict OpenAPI validation with the schemas shipped in ``kubernetes-validate``.

    The validator of each kind is built once (``kubernetes_validate.validate`` reloads the schema
    files on every call, which would dominate the fake's time).
    """

    def __init__(self, version: str) -> None:
        self.version = version
        self._validators: dict[tuple[str, str], Any] = {}

    def _validator(self, kind: str, api_version: str) -> Any:
        key = (kind, api_version)
        if key not in self._validators:
            import jsonschema
            from kubernetes_validate import utils
            from referencing import Registry, Resource

            schema_dir = f"kubernetes-json-schema/v{self.version}.0-local-strict"
            group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
            schema = utils.schema_contents(
                f"{schema_dir}/{kind.lower()}-{group}.json", self.version
            )
            defs = utils.schema_contents(f"{schema_dir}/_definitions.json", self.version)
            registry = Resource.from_contents(defs) @ (Resource.from_contents(schema) @ Registry())
            self._validators[key] = jsonschema.Draft202012Validator(schema, registry=registry)
        return self._validators[key]

    def validate(self, obj: dict[str, Any]) -> None:
        validator = self._validator(str(obj.get("kind")), str(obj.get("apiVersion")))
        error = next(iter(validator.iter_errors(obj)), None)
        if error is not None:
            path = ".".join(str(p) for p in error.path)
            name = (obj.get("metadata") or {}).get("name", "")
            raise ApiError(
                422, "Invalid", f'{obj.get("kind")} "{name}" is invalid: {path}: {error.message}'
            )


class FakeKubeApiServer:
    """The fake API server with its control plane (``cluster``).

    Args:
        script: what each pod does (see ``PodScript``); by default it echoes its argv and exits 0.
        schema_version: validate created objects against this Kubernetes version's schemas (None: off).
        bookmark_interval: seconds between BOOKMARK events on watches that allow them.
    """

    def __init__(
        self,
        script: Callable[[PodContext], PodScript] | None = None,
        *,
        schema_version: str | None = "1.29",
        bookmark_interval: float = 0.5,
    ) -> None:
        self.store = Store()
        self.cluster = FakeCluster(self.store, script)
        self.bookmark_interval = bookmark_interval
        self._validator = _SchemaValidator(schema_version) if schema_version else None
        self._runner: web.AppRunner | None = None
        self.port = 0
        self._watch_queues: set[asyncio.Queue[Event | str]] = set()
        self._log_drops: set[asyncio.Event] = set()
        self._log_silences: set[asyncio.Event] = set()
        #: how many log streams went silent (``silence_log_streams``)
        self.silenced_log_streams = 0
        self._activity: list[Callable[[], None]] = []
        # id(watch request) -> the resourceVersions of what was written on it (see sent_versions)
        self._sent: dict[int, list[str]] = {}
        #: a test's fault injection: called with each request (after it is recorded); a response it
        #: returns is sent instead of the fake's own (None: the fake answers as usual)
        self.intercept: Callable[[web.Request], Awaitable[web.StreamResponse | None]] | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> FakeKubeApiServer:
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.cluster.start()
        return self

    async def aclose(self) -> None:
        self.drop_watches()
        self.drop_log_streams()
        await self.cluster.aclose()
        if self._runner is not None:
            await self._runner.cleanup()

    async def __aenter__(self) -> FakeKubeApiServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def configuration(self) -> Any:
        """A ``kubernetes_asyncio.client.Configuration`` pointing at this server."""
        from kubernetes_asyncio.client import Configuration

        cfg = Configuration(host=self.url)
        cfg.api_key = {"authorization": "Bearer fake-token"}
        return cfg

    # -- test hooks ------------------------------------------------------------------------------

    @property
    def requests(self) -> list[Request]:
        return self.store.requests

    def requests_for(
        self, method: str, resource: str, *, watch: bool | None = None
    ) -> list[Request]:
        """The requests with ``method`` on ``resource`` (``watch`` filters GETs)."""
        out = []
        for r in self.store.requests:
            m = _PATH.fullmatch(r.path)
            if r.method != method or not m or m.group("resource") != resource or m.group("sub"):
                continue
            is_watch = _parse_bool(r.query.get("watch"))
            if watch is not None and is_watch != watch:
                continue
            out.append(r)
        return out

    def sent_versions(self, request: Request) -> list[str]:
        """The ``metadata.resourceVersion`` of every event and bookmark written on the watch that
        ``request`` (one of ``requests``) opened, in order: a client that read the stream to its
        end resumes from the last one (or from the request's own version when there is none)."""
        return list(self._sent.get(id(request), []))

    def drop_watches(self, abrupt: bool = False) -> int:
        """Ends every open watch (cleanly, or by cutting the connection); returns how many."""
        for q in list(self._watch_queues):
            q.put_nowait("CUT" if abrupt else "END")
        return len(self._watch_queues)

    def compact(self) -> None:
        """Forgets the change history, like etcd compaction: resuming an old watch gets 410."""
        self.store.compact()

    def drop_log_streams(self) -> int:
        """Cuts every open log stream; returns how many."""
        for ev in list(self._log_drops):
            ev.set()
        return len(self._log_drops)

    def silence_log_streams(self) -> int:
        """Makes every open log stream send nothing more and never end, as a connection gone
        half-open does (the client only learns it by a read timeout); streams opened later are
        served as usual. Returns how many went silent."""
        for ev in list(self._log_silences):
            ev.set()
        return len(self._log_silences)

    @property
    def open_watches(self) -> int:
        return len(self._watch_queues)

    def subscribe_activity(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Calls ``callback()`` after each request, each watch or log stream opening or closing, and
        each event or bookmark written on a watch."""
        self._activity.append(callback)
        return lambda: self._activity.remove(callback) if callback in self._activity else None

    def _active(self) -> None:
        for callback in list(self._activity):
            callback()

    # -- dispatch --------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        body: Any = None
        if request.can_read_body:
            raw = await request.read()
            if raw:
                try:
                    body = json.loads(raw)
                except ValueError:
                    return _status(ApiError(400, "BadRequest", "the request body is not JSON"))
        received = Request(request.method, request.path, query, body)
        self.store.requests.append(received)
        self._active()
        if self.intercept is not None:
            injected = await self.intercept(request)
            if injected is not None:
                return injected
        m = _PATH.fullmatch(request.path)
        if (
            not m
            or m.group("resource") not in RESOURCES
            or _GROUPS[m.group("resource")] != m.group("group")
        ):
            return _status(
                ApiError(404, "NotFound", "the server could not find the requested resource")
            )
        resource, ns, name, sub = (
            m.group("resource"),
            m.group("ns"),
            m.group("name"),
            m.group("sub"),
        )
        try:
            if sub is not None:
                if resource == "pods" and sub == "log" and request.method == "GET":
                    return await self._log(request, ns, name, query)
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            if name is None:
                if request.method == "GET":
                    if _parse_bool(query.get("watch")):
                        sent = self._sent.setdefault(id(received), [])
                        return await self._watch(request, resource, ns, query, sent)
                    return self._list(resource, ns, query)
                if request.method == "POST":
                    if not isinstance(body, dict):
                        raise ApiError(400, "BadRequest", "expected an object")
                    if self._validator is not None:
                        self._validator.validate(body)
                    return _json(self.store.create(resource, ns, body), 201)
                raise ApiError(405, "MethodNotAllowed", f"{request.method} is not allowed here")
            if request.method == "GET":
                return _json(self.store.get(resource, ns, name))
            if request.method == "DELETE":
                policy = query.get("propagationPolicy") or (body or {}).get("propagationPolicy")
                return _json(self.store.delete(resource, ns, name, policy))
            if request.method == "PATCH":
                ctype = request.headers.get("Content-Type", "")
                if "json-patch" in ctype or not isinstance(body, dict):
                    raise ApiError(415, "UnsupportedMediaType", f"unsupported patch type {ctype!r}")
                return _json(self.store.patch(resource, ns, name, body))
            raise ApiError(405, "MethodNotAllowed", f"{request.method} is not allowed here")
        except ApiError as e:
            return _status(e)

    def _list(self, resource: str, ns: str, query: dict[str, str]) -> web.Response:
        items = self.store.list(resource, ns, query.get("labelSelector", ""), deep=False)
        for item in items:
            item.pop("apiVersion", None)
            item.pop("kind", None)
        api_version = RESOURCES[resource][0]
        return _json(
            {
                "kind": _LIST_KINDS[resource],
                "apiVersion": api_version,
                "metadata": {"resourceVersion": str(self.store.rv)},
                "items": items,
            }
        )

    async def _watch(
        self,
        request: web.Request,
        resource: str,
        ns: str,
        query: dict[str, str],
        sent: list[str],
    ) -> web.StreamResponse:
        reqs = parse_selector(query.get("labelSelector", ""))
        timeout = float(query.get("timeoutSeconds", "1800"))
        bookmarks = _parse_bool(query.get("allowWatchBookmarks"))
        rv_param = query.get("resourceVersion", "")
        if rv_param not in ("", "0") and not rv_param.isdigit():
            raise ApiError(400, "BadRequest", f"invalid resourceVersion {rv_param!r}")
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        queue: asyncio.Queue[Event | str] = asyncio.Queue()

        def listener(ev: Event) -> None:
            if ev.resource == resource and ev.namespace == ns:
                queue.put_nowait(ev)

        unsubscribe = self.store.subscribe(listener)
        self._watch_queues.add(queue)
        self._active()
        kind = RESOURCES[resource][1]
        try:
            if rv_param in ("", "0"):
                for obj in self.store.list(
                    resource, ns, query.get("labelSelector", ""), deep=False
                ):
                    await resp.write(_line({"type": "ADDED", "object": obj}))
                    sent.append(obj["metadata"]["resourceVersion"])
            else:
                try:
                    backlog = self.store.events_since(int(rv_param))
                except ApiError as e:
                    await resp.write(_line({"type": "ERROR", "object": e.status()}))
                    return await _finish(resp)
                for ev in backlog:
                    if ev.resource == resource and ev.namespace == ns:
                        await _send(resp, ev, reqs, sent)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                wait = min(remaining, self.bookmark_interval) if bookmarks else remaining
                try:
                    item = await asyncio.wait_for(queue.get(), wait)
                except asyncio.TimeoutError:
                    # no bookmark once drop_watches queued the end: a bookmark written after the
                    # test's compact() would carry a version newer than the compaction
                    if bookmarks and loop.time() < deadline and queue.empty():
                        version = str(self.store.rv)
                        await resp.write(
                            _line(
                                {
                                    "type": "BOOKMARK",
                                    "object": {
                                        "kind": kind,
                                        "apiVersion": RESOURCES[resource][0],
                                        "metadata": {"resourceVersion": version},
                                    },
                                }
                            )
                        )
                        sent.append(version)
                        self._active()
                    continue
                if item == "END":
                    break
                if item == "CUT":
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
                assert isinstance(item, Event)
                await _send(resp, item, reqs, sent)
                self._active()
        except (ConnectionResetError, asyncio.CancelledError):
            return resp
        finally:
            unsubscribe()
            self._watch_queues.discard(queue)
            self._active()
        return await _finish(resp)

    async def _log(
        self, request: web.Request, ns: str, name: str, query: dict[str, str]
    ) -> web.StreamResponse:
        pod = self.store.find("pods", ns, name)
        if pod is None:
            raise not_found("pods", name)
        containers = [c["name"] for c in pod["spec"].get("containers") or []]
        container = query.get("container") or (containers[0] if len(containers) == 1 else None)
        if container not in containers:
            raise ApiError(400, "BadRequest", f"container {container} is not valid for pod {name}")
        statuses = {
            c.get("name"): c for c in (pod.get("status") or {}).get("containerStatuses") or []
        }
        state = (statuses.get(container) or {}).get("state") or {}
        if "running" not in state and "terminated" not in state:
            reason = (state.get("waiting") or {}).get("reason", "ContainerCreating")
            raise ApiError(
                400,
                "BadRequest",
                f'container "{container}" in pod "{name}" is waiting to start: {reason}',
            )
        since_ns = None
        if query.get("sinceTime"):
            since_ns = _parse_time_ns(query["sinceTime"])
            if since_ns is None:
                raise ApiError(400, "BadRequest", f"invalid sinceTime {query['sinceTime']!r}")
        elif query.get("sinceSeconds"):
            import time

            since_ns = time.time_ns() - int(query["sinceSeconds"]) * 1_000_000_000
        follow = _parse_bool(query.get("follow"))
        stamps = _parse_bool(query.get("timestamps"))
        log = self.cluster.logs.get((ns, name))
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/plain"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        drop = asyncio.Event()
        silence = asyncio.Event()
        self._log_drops.add(drop)
        self._log_silences.add(silence)
        self._active()
        i = 0
        try:
            while log is not None:
                while i < len(log.lines) and not silence.is_set():
                    ts, text = log.lines[i]
                    i += 1
                    if since_ns is not None and ts < since_ns:
                        continue
                    await resp.write(((format_ts(ts) + " ") if stamps else "").encode() + text)
                if silence.is_set():
                    self._log_silences.discard(silence)
                    self.silenced_log_streams += 1
                    self._active()
                    await drop.wait()  # held open, saying nothing, until the server closes
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
                if not follow or log.closed:
                    break
                changed = asyncio.ensure_future(log.changed.wait())
                dropped = asyncio.ensure_future(drop.wait())
                silenced = asyncio.ensure_future(silence.wait())
                await asyncio.wait(
                    {changed, dropped, silenced}, return_when=asyncio.FIRST_COMPLETED
                )
                changed.cancel()
                dropped.cancel()
                silenced.cancel()
                if drop.is_set():
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
        except (ConnectionResetError, asyncio.CancelledError):
            return resp
        finally:
            self._log_drops.discard(drop)
            self._log_silences.discard(silence)
            self._active()
        return await _finish(resp)


async def _finish(resp: web.StreamResponse) -> web.StreamResponse:
    try:
        await resp.write_eof()
    except ConnectionResetError:
        pass
    return resp


def _parse_bool(value: str | None) -> bool:
    """A boolean query parameter as Go's strconv.ParseBool reads it (``true``, ``True``, ``1``...)."""
    return value in ("1", "t", "T", "TRUE", "true", "True")


def _parse_time_ns(value: str) -> int | None:
    try:
        dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return int(dt.timestamp()) * 1_000_000_000 + dt.microsecond * 1000


async def _send(resp: web.StreamResponse, ev: Event, reqs: list[Any], sent: list[str]) -> None:
    new_match = matches(ev.obj, reqs)
    if ev.type == "MODIFIED" and ev.old is not None:
        old_match = matches(ev.old, reqs)
        if new_match and old_match:
            type_ = "MODIFIED"
        elif new_match:
            type_ = "ADDED"
        elif old_match:
            type_ = "DELETED"
        else:
            return
    elif new_match:
        type_ = ev.type
    else:
        return
    await resp.write(_line({"type": type_, "object": ev.obj}))
    sent.append(str(ev.obj["metadata"]["resourceVersion"]))


def _line(obj: Any) -> bytes:
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(
        status=status, body=json.dumps(obj).encode(), content_type="application/json"
    )


def _status(e: ApiError) -> web.Response:
    return _json(e.status(), e.code)
