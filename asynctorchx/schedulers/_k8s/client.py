"""A thin async wrapper over ``kubernetes_asyncio`` that speaks plain JSON.

The backend uses a handful of calls on three kinds (Services, Jobs, Pods): create, get, list, watch,
merge-patch, delete with a propagation policy, and pod logs. They go through ``kubernetes_asyncio``'s
generated API classes (its configuration, authentication and HTTP session) with
``_preload_content=False``, so that bodies stay plain dicts and streams are read line by line here:
watch events and log lines of any length, never split. Pod logs use the generic ``call_api``
because the generated method lacks ``sinceTime``.

``kubernetes_asyncio`` is imported on first use; without it, ``KubeApi.connect`` raises an
ImportError naming ``pip install 'asynctorchx[kubernetes]'``.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

INSTALL_HINT = "pip install 'asynctorchx[kubernetes]'"

KINDS = ("services", "jobs", "pods")

_CORE = "CoreV1Api"
_BATCH = "BatchV1Api"
_METHODS = {
    "services": (_CORE, "service"),
    "jobs": (_BATCH, "job"),
    "pods": (_CORE, "pod"),
}


def import_kubernetes_asyncio() -> Any:
    """Imports ``kubernetes_asyncio``, or raises ImportError saying how to install it."""
    try:
        import kubernetes_asyncio
        import kubernetes_asyncio.client
        import kubernetes_asyncio.config
    except ImportError as e:
        raise ImportError(
            f"the kubernetes scheduler needs the kubernetes_asyncio package: {INSTALL_HINT} ({e})"
        ) from e
    return kubernetes_asyncio


class KubeApiError(Exception):
    """Raised when the API server answers with an error status (or cannot be reached: status 0).

    Its text says what was being done first (``creating Job ml/app-trainer (role 'trainer'):
    Kubernetes API error 503 : ...``).

    Attributes:
        status: the HTTP status (0 when the server could not be reached).
        reason: the Status reason (``NotFound``, ``AlreadyExists``, ``Expired``...).
        message: the server's message.
        context: what the call was doing (empty when unknown).
    """

    def __init__(self, status: int, reason: str, message: str, context: str = "") -> None:
        text = f"Kubernetes API error {status} {reason}: {message}"
        super().__init__(f"{context}: {text}" if context else text)
        self.status = status
        self.reason = reason
        self.message = message
        self.context = context

    def add_context(self, context: str) -> KubeApiError:
        """Makes the error say what was being done (a context it has already is kept)."""
        if context and not self.context:
            self.context = context
            self.args = (f"{context}: {self.args[0]}" if self.args else context,)
        return self


_KIND_NAMES = {"services": "Service", "jobs": "Job", "pods": "pod"}


def _object(kind: str, namespace: str, name: str) -> str:
    """``Job ml/app-trainer``: an object as error messages name it."""
    return f"{_KIND_NAMES.get(kind, kind)} {namespace}/{name}"


def net_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean the server could not be reached or the connection dropped."""
    import aiohttp

    return (OSError, asyncio.TimeoutError, aiohttp.ClientError)


def _unreachable(e: BaseException, timeout: float | None = None) -> KubeApiError:
    detail = str(e)
    if not detail and isinstance(e, asyncio.TimeoutError):
        detail = "no answer in time" if timeout is None else f"no answer within {timeout:g} s"
    return KubeApiError(0, "Unreachable", f"{type(e).__name__}: {detail}")


def _error_from_body(status: int, body: bytes) -> KubeApiError:
    reason, message = "", body.decode("utf-8", "replace").strip()[:2000]
    try:
        data = json.loads(body)
        if isinstance(data, dict):
            reason = str(data.get("reason", ""))
            message = str(data.get("message", message))
    except ValueError:
        pass
    return KubeApiError(status, reason, message)


async def _iter_lines(content: Any) -> AsyncIterator[bytes]:
    """Lines (with their ``\\n``; a final partial one without) of an aiohttp stream, any length."""
    buf = bytearray()
    async for chunk in content.iter_any():
        buf += chunk
        start = 0
        while True:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            yield bytes(buf[start : nl + 1])
            start = nl + 1
        del buf[:start]
    if buf:
        yield bytes(buf)


class KubeApi:
    """JSON calls to one API server through a ``kubernetes_asyncio.client.ApiClient``.

    Args:
        api_client: the client to use.
        owns_client: close ``api_client`` on ``close()``.
        request_timeout: the total timeout (seconds) of a non-streaming call.
        log_read_timeout: how long (seconds) a followed log may send nothing before its read
            fails (status 0), so that a half-open connection cannot hang the follow.
    """

    def __init__(
        self,
        api_client: Any,
        *,
        owns_client: bool,
        request_timeout: float = 30.0,
        log_read_timeout: float = 60.0,
    ) -> None:
        k8s = import_kubernetes_asyncio()
        self._k8s = k8s
        self._client = api_client
        self._owns = owns_client
        self._timeout = request_timeout
        self._log_read_timeout = log_read_timeout
        self._net = net_errors()
        self._apis = {
            _CORE: k8s.client.CoreV1Api(api_client),
            _BATCH: k8s.client.BatchV1Api(api_client),
        }

    @classmethod
    async def connect(
        cls,
        *,
        configuration: Any = None,
        kubeconfig: str | None = None,
        context: str | None = None,
        request_timeout: float = 30.0,
        log_read_timeout: float = 60.0,
    ) -> KubeApi:
        """A client for the configured cluster.

        Uses ``configuration`` (a ``kubernetes_asyncio.client.Configuration``) when given; else the
        kubeconfig file (``kubeconfig``, ``$KUBECONFIG`` or ``~/.kube/config``) with ``context``; else,
        inside a pod, the in-cluster service account.
        """
        k8s = import_kubernetes_asyncio()
        if configuration is None:
            configuration = k8s.client.Configuration()
            if (
                kubeconfig is None
                and context is None
                and os.environ.get("KUBERNETES_SERVICE_HOST")
                and not (os.environ.get("KUBECONFIG"))
            ):
                k8s.config.load_incluster_config(client_configuration=configuration)
            else:
                await k8s.config.load_kube_config(
                    config_file=kubeconfig,
                    context=context,
                    client_configuration=configuration,
                    persist_config=False,
                )
        return cls(
            k8s.client.ApiClient(configuration),
            owns_client=True,
            request_timeout=request_timeout,
            log_read_timeout=log_read_timeout,
        )

    async def close(self) -> None:
        """Closes the HTTP session when this object created it."""
        if self._owns:
            await self._client.close()

    def _method(self, kind: str, verb: str) -> Any:
        api_name, noun = _METHODS[kind]
        return getattr(self._apis[api_name], f"{verb}_namespaced_{noun}")

    async def _json(self, context: str, call: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            return await self._json_call(call, *args, **kwargs)
        except KubeApiError as e:
            e.add_context(context)
            raise

    async def _json_call(self, call: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            resp = await call(
                *args, _preload_content=False, _request_timeout=self._timeout, **kwargs
            )
        except self._net as e:
            raise _unreachable(e, self._timeout) from e
        except self._k8s.client.ApiException as e:
            raise KubeApiError(e.status or 0, str(e.reason or ""), str(e.body or e)) from e
        try:
            body = await resp.read()
        except self._net as e:
            raise _unreachable(e, self._timeout) from e
        finally:
            resp.release()
        if not 200 <= resp.status < 300:
            raise _error_from_body(resp.status, body)
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise KubeApiError(
                resp.status, "BadResponse", f"expected a JSON object, got {body[:200]!r}"
            )
        return data

    async def create(
        self, kind: str, namespace: str, body: dict[str, Any], *, what: str = ""
    ) -> dict[str, Any]:
        """Creates an object and returns it as stored.

        Args:
            kind: ``services``, ``jobs`` or ``pods``.
            namespace: its namespace.
            body: the object.
            what: what the object is for, added to an error's text (e.g. ``role 'trainer'``).
        """
        name = (body.get("metadata") or {}).get("name", "")
        context = f"creating {_object(kind, namespace, name)}" + (f" ({what})" if what else "")
        return await self._json(context, self._method(kind, "create"), namespace, body)

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return await self._json(
                f"reading {_object(kind, namespace, name)}",
                self._method(kind, "read"),
                name,
                namespace,
            )
        except KubeApiError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, kind: str, namespace: str, label_selector: str) -> dict[str, Any]:
        """The list object (``items`` and ``metadata.resourceVersion``) of matching objects."""
        return await self._json(
            f"listing {kind} in namespace {namespace}",
            self._method(kind, "list"),
            namespace,
            label_selector=label_selector,
        )

    async def patch(
        self, kind: str, namespace: str, name: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        """Merge-patches an object (strategic merge for built-in kinds) and returns it."""
        return await self._json(
            f"patching {_object(kind, namespace, name)}",
            self._method(kind, "patch"),
            name,
            namespace,
            body,
        )

    async def delete(
        self, kind: str, namespace: str, name: str, propagation_policy: str
    ) -> dict[str, Any] | None:
        """Deletes an object with an explicit propagation policy; None when it did not exist."""
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "propagationPolicy": propagation_policy,
        }
        try:
            return await self._json(
                f"deleting {_object(kind, namespace, name)}",
                self._method(kind, "delete"),
                name,
                namespace,
                body=body,
            )
        except KubeApiError as e:
            if e.status == 404:
                return None
            raise

    async def watch(
        self,
        kind: str,
        namespace: str,
        label_selector: str,
        resource_version: str,
        timeout_seconds: int,
    ) -> AsyncGenerator[dict[str, Any], None]:
        """The watch events (``{"type", "object"}``) after ``resource_version``, until the server ends
        the stream (after ``timeout_seconds``) or the connection drops.

        An ``ERROR`` event is yielded as is (e.g. 410 Expired: the version is too old; relist).

        Raises:
            KubeApiError: the watch could not be opened, or the connection failed mid-stream.
        """
        call = self._method(kind, "list")
        context = f"watching {kind} in namespace {namespace}"
        try:
            resp = await call(
                namespace,
                label_selector=label_selector,
                watch=True,
                resource_version=resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=timeout_seconds,
                _preload_content=False,
                _request_timeout=(10, timeout_seconds + 30),
            )
        except self._net as e:
            raise _unreachable(e).add_context(context) from e
        try:
            if not 200 <= resp.status < 300:
                raise _error_from_body(resp.status, await resp.read()).add_context(context)
            async for line in _iter_lines(resp.content):
                if not line.strip():
                    continue
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict):
                    yield event
        except self._net as e:
            raise _unreachable(e).add_context(context) from e
        finally:
            resp.close()

    @asynccontextmanager
    async def pod_log(
        self,
        namespace: str,
        pod: str,
        *,
        container: str | None = None,
        follow: bool = False,
        since_time: str | None = None,
    ) -> AsyncIterator[AsyncIterator[bytes]]:
        """Opens a pod's log with timestamps; yields an iterator of its raw lines.

        Raises:
            KubeApiError: the log cannot be read (404 no such pod, 400 the container has not started),
                or nothing came for the read timeout (status 0; ``log_read_timeout`` when following).
        """
        query: list[tuple[str, str]] = [("timestamps", "true")]
        if follow:
            query.append(("follow", "true"))
        if container:
            query.append(("container", container))
        if since_time:
            query.append(("sinceTime", since_time))
        context = f"reading the log of pod {namespace}/{pod}"
        try:
            resp = await self._client.call_api(
                "/api/v1/namespaces/{namespace}/pods/{name}/log",
                "GET",
                path_params={"namespace": namespace, "name": pod},
                query_params=query,
                header_params={"Accept": "*/*"},
                auth_settings=["BearerToken"],
                _preload_content=False,
                # a stream has no total timeout (a long log takes as long as it takes to send),
                # only a read timeout: nothing came for that long (a quiet container, or a
                # connection gone half-open); the caller resumes from its last line
                _request_timeout=(10, self._log_read_timeout)
                if follow
                else (self._timeout, self._timeout),
            )
        except self._net as e:
            raise _unreachable(e).add_context(context) from e
        lines = _guard(_iter_lines(resp.content), self._net, context)
        try:
            if not 200 <= resp.status < 300:
                raise _error_from_body(resp.status, await resp.read()).add_context(context)
            yield lines
        finally:
            await lines.aclose()
            resp.close()


async def _guard(
    lines: AsyncIterator[bytes], errors: tuple[type[BaseException], ...], context: str
) -> AsyncGenerator[bytes, None]:
    try:
        async for line in lines:
            yield line
    except errors as e:
        raise _unreachable(e).add_context(context) from e


class KubeConnection:
    """The scheduler's ``KubeApi``, connected on first use (kubeconfig read, client created).

    Args:
        client: a ``kubernetes_asyncio.client.ApiClient`` to use (never closed here).
        configuration: a ``kubernetes_asyncio.client.Configuration`` to connect with.
        kubeconfig: a kubeconfig file (default: ``$KUBECONFIG``, ``~/.kube/config``, in-cluster).
        context: the kubeconfig context to use.
        request_timeout: total timeout of each non-streaming call, in seconds.
        log_read_timeout: how long a followed log may send nothing before it is re-opened, in
            seconds.
    """

    def __init__(
        self,
        *,
        client: Any = None,
        configuration: Any = None,
        kubeconfig: str | None = None,
        context: str | None = None,
        request_timeout: float = 30.0,
        log_read_timeout: float = 60.0,
    ) -> None:
        self._given = client
        self._configuration = configuration
        self._kubeconfig = kubeconfig
        self._context = context
        self.request_timeout = request_timeout
        self.log_read_timeout = log_read_timeout
        self._api: KubeApi | None = None
        self._lock: asyncio.Lock | None = None

    async def api(self) -> KubeApi:
        """The client (connecting once, however many callers ask at the same time)."""
        if self._api is None:
            if self._lock is None:
                self._lock = asyncio.Lock()
            async with self._lock:
                if self._api is None:
                    self._api = await self._connect()
        return self._api

    async def _connect(self) -> KubeApi:
        if self._given is not None:
            return KubeApi(
                self._given,
                owns_client=False,
                request_timeout=self.request_timeout,
                log_read_timeout=self.log_read_timeout,
            )
        return await KubeApi.connect(
            configuration=self._configuration,
            kubeconfig=self._kubeconfig,
            context=self._context,
            request_timeout=self.request_timeout,
            log_read_timeout=self.log_read_timeout,
        )

    async def close(self) -> None:
        """Closes the client if it was created here. Idempotent."""
        api, self._api = self._api, None
        if api is not None:
            await api.close()
