"""The Docker Engine API as asynctorchx uses it: one aiodocker client, engine errors made clear.

``DockerEngine`` owns the client (created on first use, closed with the engine unless it was given)
and turns the engine's status codes into ``DockerSchedulerError`` (or
``DockerEngineUnavailableError`` when the engine cannot be reached) with a message that says what
was being done. The image calls the workspaces need live here (inspect, build, tag, push, remove),
shared by the ``local_docker`` and ``kubernetes`` backends, and so do every container, network,
volume, event and log call of ``local_docker``: no other module calls aiodocker. ``requests`` counts
the calls by kind, ``writes`` those that change something (a status read makes none).

Registry credentials for a push come from the Docker client's config file (``$DOCKER_CONFIG`` or
``~/.docker/config.json``), as ``docker push`` finds them: a credential helper (``credHelpers``,
``credsStore``) or the base64 ``auth`` of ``auths``. They go to the engine in the
``X-Registry-Auth`` header only; they are never logged or put in a message.

aiodocker is imported on first use (``pip install 'asynctorchx[docker]'``).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import json
import logging
import os
import re
from collections import Counter
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
)
from contextlib import asynccontextmanager
from types import ModuleType
from typing import Any, TypeVar

import anyio

from asynctorchx.schedulers._docker.frames import FrameDecoder

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: The Docker Hub's key in ``auths`` (what ``docker login`` writes for it).
DOCKER_HUB_AUTH_KEY = "https://index.docker.io/v1/"
#: How long a Docker credential helper may take to answer (one may wait for a keyring prompt).
CREDENTIAL_HELPER_TIMEOUT = 30.0

_TAIL_LINES = 20
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN = (
    r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
    r"(?:\.(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9]))*(?::[0-9]+)?"
)
_REPOSITORY_RE = re.compile(rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*")
_DOMAIN_RE = re.compile(_DOMAIN)
_NETWORK_REMOVE_TRIES = 5

#: Seconds to connect to the engine (any request, streams included).
CONNECT_TIMEOUT = 10.0
#: Seconds a request may wait on the engine for the next piece of its answer: an engine that
#: accepts connections but never answers (a frozen dockerd) gives DockerEngineUnavailableError
#: after that long. Streams that may stay silent (logs followed, events, image pull, build, push)
#: have no read bound; a stop's is its stop timeout plus ``STOP_READ_MARGIN``.
READ_TIMEOUT = 60.0
#: Seconds a stop request may take beyond the stop timeout it gives the container.
STOP_READ_MARGIN = 30.0

#: The kinds of request (keys of ``DockerEngine.requests``) that change something on the engine.
WRITE_REQUESTS = frozenset(
    {
        "container_create",
        "container_start",
        "container_stop",
        "container_remove",
        "network_create",
        "network_remove",
        "volume_create",
        "volume_remove",
        "image_pull",
    }
)


class DockerSchedulerError(RuntimeError):
    """Raised when the Docker engine refuses or fails a request of a backend.

    The message says what was being done (which role, replica, image, volume or network) and why.
    """


class DockerEngineUnavailableError(DockerSchedulerError):
    """Raised when the Docker engine cannot be reached (daemon not running, wrong DOCKER_HOST)."""


class DockerNotFoundError(DockerSchedulerError):
    """Raised when the engine has no such object (any more), where that is not a plain answer."""


def import_aiodocker() -> ModuleType:
    """aiodocker, or an ImportError that says which extra to install."""
    try:
        import aiodocker
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the Docker engine is driven with aiodocker: pip install 'asynctorchx[docker]'"
        ) from e
    return aiodocker


def status_of(err: BaseException) -> int | None:
    """The HTTP status of an aiodocker error (900: the engine could not be reached), else None."""
    status = getattr(err, "status", None)
    return status if isinstance(status, int) else None


def message_of(err: BaseException, address: str | None = None) -> str:
    """The engine's message of an aiodocker error (or the error's text).

    An answer with no message (something that is not a Docker engine, a proxy) gives its HTTP
    status instead, and asks whether ``address`` (the engine's address, when known) is a Docker
    engine.
    """
    message = getattr(err, "message", None)
    text = str(message if message is not None else err).strip()
    if text:
        return text
    status = status_of(err)
    where = address or "the engine's address"
    answer = f"HTTP {status}" if status is not None else f"a {type(err).__name__}"
    return f"{answer} with no message (is {where} a Docker engine?)"


def engine_error(what: str, err: BaseException, address: str | None = None) -> DockerSchedulerError:
    """A clear error for a failed Docker request; ``what`` says what was being done, ``address``
    is the engine's address (named when the engine's answer says nothing)."""
    if status_of(err) == 900 or isinstance(err, OSError):
        return DockerEngineUnavailableError(
            f"{what}: cannot reach the Docker engine ({message_of(err, address)}); is dockerd "
            "running and DOCKER_HOST right?"
        )
    return DockerSchedulerError(f"{what}: {message_of(err, address)}")


def is_docker_error(err: BaseException) -> bool:
    """True for aiodocker's ``DockerError`` family (and fakes shaped like it)."""
    return status_of(err) is not None and hasattr(err, "message")


def check_repository(name: str, field: str = "image_repo") -> str:
    """``name`` if it is a valid image repository (``[registry[:port]/]path``, no tag or digest).

    Raises:
        ValueError: it is not (the message names ``field`` and the value).
    """
    if not isinstance(name, str) or not _REPOSITORY_RE.fullmatch(name) or len(name) > 255:
        tagged = isinstance(name, str) and ("@" in name or ":" in name.rsplit("/", 1)[-1])
        hint = " without a tag or digest" if tagged else ""
        raise ValueError(
            f"{field} must be an image repository{hint} such as registry.example.com:5000/team/app "
            f"(lowercase path components), got {name!r}"
        )
    return name


def registry_of(repository: str) -> str:
    """The registry host of a repository name (``docker.io`` when it names none)."""
    first, sep, _ = repository.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost" or first != first.lower()):
        return first
    return "docker.io"


def _auth_key(key: str) -> str:
    text = key.strip()
    for prefix in ("https://", "http://"):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    return text.split("/", 1)[0]


def docker_config_file() -> str:
    """The Docker client's config file: ``$DOCKER_CONFIG/config.json`` or ``~/.docker/config.json``."""
    directory = os.environ.get("DOCKER_CONFIG") or os.path.join(os.path.expanduser("~"), ".docker")
    return os.path.join(directory, "config.json")


def _read_docker_config(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        # never quote the file: it holds credentials
        raise DockerSchedulerError(
            f"the Docker config file {path!r} cannot be read ({type(e).__name__})"
        ) from None
    return data if isinstance(data, dict) else {}


async def registry_auth(registry: str, config_file: str | None = None) -> dict[str, str] | None:
    """The credentials ``docker push`` would use for ``registry``, or None for an anonymous push.

    Raises:
        DockerSchedulerError: the config file or the credential helper fails (the message holds
            no secret).
    """
    import anyio.to_thread

    path = config_file or docker_config_file()
    config = await anyio.to_thread.run_sync(_read_docker_config, path)
    server = DOCKER_HUB_AUTH_KEY if registry == "docker.io" else registry
    helpers = config.get("credHelpers") or {}
    helper = helpers.get(registry) if isinstance(helpers, dict) else None
    if not helper and registry == "docker.io" and isinstance(helpers, dict):
        helper = helpers.get(DOCKER_HUB_AUTH_KEY)
    helper = helper or config.get("credsStore")
    if isinstance(helper, str) and helper:
        return await _from_helper(helper, server, registry)
    auths = config.get("auths") or {}
    if not isinstance(auths, dict):
        return None
    entry = None
    for key, value in auths.items():
        if (
            key == server
            or _auth_key(key) == registry
            or (registry == "docker.io" and _auth_key(key) in ("index.docker.io", "docker.io"))
        ):
            entry = value
            break
    if not isinstance(entry, dict):
        return None
    if entry.get("identitytoken"):
        return {"identitytoken": str(entry["identitytoken"]), "serveraddress": server}
    username, password = entry.get("username"), entry.get("password")
    if entry.get("auth"):
        try:
            username, _, password = base64.b64decode(str(entry["auth"])).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            raise DockerSchedulerError(
                f"the auth of registry {registry!r} in {path!r} is not base64 'user:password'"
            ) from None
    if not username:
        return None
    return {"username": str(username), "password": str(password or ""), "serveraddress": server}


async def _from_helper(helper: str, server: str, registry: str) -> dict[str, str] | None:
    program = f"docker-credential-{helper}"
    try:
        proc = await asyncio.create_subprocess_exec(
            program,
            "get",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as e:
        raise DockerSchedulerError(
            f"the Docker credential helper {program!r} for registry {registry!r} cannot run: "
            f"{e.strerror or e}"
        ) from None
    try:
        with anyio.fail_after(CREDENTIAL_HELPER_TIMEOUT):
            out, err = await proc.communicate(server.encode())
    except TimeoutError:
        raise DockerSchedulerError(
            f"the Docker credential helper {program!r} for registry {registry!r} did not answer "
            f"within {CREDENTIAL_HELPER_TIMEOUT:g} s (is it waiting for a keyring to be unlocked?)"
        ) from None
    finally:
        if proc.returncode is None:  # timed out or cancelled: it must not outlive the submit
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    if proc.returncode != 0:
        if b"credentials not found" in (out + err).lower():
            return None
        raise DockerSchedulerError(
            f"the Docker credential helper {program!r} failed for registry {registry!r} "
            f"(exit {proc.returncode})"
        )
    try:
        creds = json.loads(out)
        username, secret = str(creds["Username"]), str(creds["Secret"])
    except (ValueError, KeyError, TypeError):
        raise DockerSchedulerError(
            f"the Docker credential helper {program!r} answered something that is not credentials"
        ) from None
    if username == "<token>":
        return {"identitytoken": secret, "serveraddress": server}
    return {"username": username, "password": secret, "serveraddress": server}


def _auth_header(auth: Mapping[str, str] | None) -> str:
    return base64.urlsafe_b64encode(json.dumps(dict(auth or {})).encode()).decode()


async def _json_lines(resp: Any) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a streamed engine response (one per line)."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            obj = _decode(line)
            if obj is not None:
                yield obj
    obj = _decode(buf)
    if obj is not None:
        yield obj


def _decode(line: bytes) -> dict[str, Any] | None:
    line = line.strip()
    if not line:
        return None
    try:
        obj = json.loads(line)
    except ValueError:
        return {"stream": line.decode("utf-8", "replace")}
    return obj if isinstance(obj, dict) else None


def _error_text(obj: Mapping[str, Any]) -> str | None:
    detail = obj.get("errorDetail")
    if isinstance(detail, dict) and detail.get("message"):
        return str(detail["message"]).strip()
    if obj.get("error"):
        return str(obj["error"]).strip()
    return None


class DockerEngine:
    """One Docker engine, reached through one aiodocker client.

    Args:
        client: an ``aiodocker.Docker`` (or a fake with its interface) to use; it is not closed by
            ``close``. By default one is created on first use and closed by ``close``.
        docker_host: the engine's address when no client is given (default: aiodocker's
            resolution: ``DOCKER_HOST``, then the local socket).
    """

    def __init__(self, client: Any = None, *, docker_host: str | None = None) -> None:
        self._client = client
        self._owns_client = client is None
        self._docker_host = docker_host
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        #: builds started by this engine (instrumentation for tests and benchmarks)
        self.builds = 0
        #: pushes started by this engine
        self.pushes = 0
        #: container, network, volume, event and log requests sent, by kind
        self.requests: Counter[str] = Counter()
        self._ncpu: float | None = None
        #: the stop requests under way, by container and timeout: a stop asked again meanwhile
        #: waits for that one (each request sends the container its stop signal again)
        self._stops: dict[tuple[str, int | None], asyncio.Future[BaseException | None]] = {}

    @property
    def docker_host(self) -> str | None:
        """The engine's address this wrapper was given, if any."""
        return self._docker_host

    @property
    def address(self) -> str:
        """The engine's address, for messages: the one given, else the one the client resolved
        (``DOCKER_HOST``, the Docker context, the local socket), else ``DOCKER_HOST``'s value."""
        resolved = getattr(self._client, "_connection_info", None)
        if self._docker_host:
            return self._docker_host
        if isinstance(resolved, str) and resolved:
            return resolved
        return os.environ.get("DOCKER_HOST") or "the Docker engine's address"

    @property
    def started(self) -> bool:
        """True once the client exists (a dry run never starts it)."""
        return self._client is not None and self._loop is not None

    async def client(self) -> Any:
        """The aiodocker client, created on first use.

        Raises:
            RuntimeError: the engine wrapper is closed.
            DockerSchedulerError: aiodocker cannot use the engine's address (an ``ssh://`` one
                without asyncssh, one with no scheme...); the message names it and where it
                came from.
        """
        if self._closed:
            raise RuntimeError("the Docker engine client is closed")
        if self._client is None:
            aiodocker = import_aiodocker()
            try:
                self._client = aiodocker.Docker(url=self._docker_host, timeout=_request_timeout())
            except Exception as e:
                raise DockerSchedulerError(self._address_refused(e)) from None
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._client

    def _address_refused(self, err: BaseException) -> str:
        """Why aiodocker refused the engine's address, naming the address and where it came from."""
        env = os.environ.get("DOCKER_HOST")
        if self._docker_host:
            source = f"docker_host={self._docker_host!r}"
        elif env:
            source = f"DOCKER_HOST={env!r}"
        else:
            source = "the Docker engine's address (from the Docker context)"
        text = str(getattr(err, "message", None) or err).strip() or type(err).__name__
        if "asyncssh" in text:
            text = "an ssh:// address needs asyncssh: pip install 'aiodocker[ssh]'"
        return f"{source} cannot be used to reach the Docker engine: {text}"

    async def close(self) -> None:
        """Closes the client if this wrapper created it. Idempotent."""
        self._closed = True
        if self._owns_client and self._client is not None:
            client, self._client = self._client, None
            await client.close()

    # -- images -----------------------------------------------------------------------------------

    async def inspect_image(self, ref: str) -> dict[str, Any] | None:
        """The engine's ``inspect`` of image ``ref``, or None when it has no such image.

        Raises:
            DockerSchedulerError: the engine failed the request.
        """
        client = await self.client()
        try:
            info = await client.images.inspect(ref)
        except Exception as e:
            if status_of(e) == 404:
                return None
            raise _known_error(f"inspecting image {ref!r}", e, self.address) from None
        return dict(info)

    async def image_id(self, ref: str) -> str | None:
        """The id (``sha256:...``) of image ``ref``, or None when the engine has no such image."""
        info = await self.inspect_image(ref)
        return None if info is None else str(info.get("Id") or "") or None

    def image_id_blocking(self, ref: str) -> str | None:
        """``image_id`` for synchronous code (a dry run).

        From a worker thread of the event loop this engine's client runs on, the question goes to
        that loop; otherwise it is asked from a private event loop in a helper thread, with a
        client of its own (impossible with a client that was given: then DockerSchedulerError).
        """
        loop = self._loop
        if loop is not None and loop.is_running() and not _in_loop_thread(loop):
            return asyncio.run_coroutine_threadsafe(self.image_id(ref), loop).result()
        if not self._owns_client:
            raise DockerSchedulerError(
                f"cannot ask the given Docker client for image {ref!r} from synchronous code: "
                "use the async dry run (submit_dryrun_async, or the runner's run)"
            )
        host = self._docker_host

        async def ask() -> str | None:
            engine = DockerEngine(docker_host=host)
            try:
                return await engine.image_id(ref)
            finally:
                await engine.close()

        return run_blocking(ask)

    async def build(
        self,
        context: AsyncIterable[bytes],
        *,
        tag: str,
        dockerfile: str,
        build_args: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        on_output: Callable[[str], None] | None = None,
    ) -> str:
        """Builds an image from a tar build context streamed from ``context``; returns its id.

        The context is sent as it is produced (never held in memory as a whole); if producing it
        fails, the upload is cut off, so the engine fails the build, and that failure is raised.
        The base image is not pulled when present (``pull=0``); intermediate containers are
        removed even when a step fails, and the engine tags the image only once every step
        succeeded.

        Raises:
            WorkspaceBuildError: a step failed (the message and ``log_tail`` hold the last lines).
            DockerSchedulerError: the engine refused the request.
        """
        from asynctorchx.schedulers.workspace import WorkspaceBuildError

        self.builds += 1
        params = {
            "t": tag,
            "dockerfile": dockerfile,
            "rm": "1",
            "forcerm": "1",
            "pull": "0",
            "buildargs": json.dumps(dict(build_args or {})),
            "labels": json.dumps(dict(labels or {})),
        }
        failed: list[BaseException] = []
        aux, tail = await self._progress_stream(
            f"building image {tag}",
            "build",
            params=params,
            headers={"Content-Type": "application/x-tar"},
            data=_noting_failure(context, failed),
            lines=_build_output_lines,
            on_line=on_output,
            failed=failed,
        )
        found = await self.image_id(tag)
        if found is None:
            raise WorkspaceBuildError(
                f"building image {tag} failed: the engine finished without tagging it", tail
            )
        ids = [str(a["ID"]) for a in aux if a.get("ID")]
        return ids[-1] if ids else found

    async def _progress_stream(
        self,
        what: str,
        path: str,
        *,
        params: Mapping[str, str],
        headers: Mapping[str, str],
        lines: Callable[[Mapping[str, Any]], list[str]],
        on_line: Callable[[str], None] | None,
        data: Any = None,
        failed: list[BaseException] | None = None,
    ) -> tuple[list[dict[str, Any]], list[str]]:
        """POSTs to an endpoint that answers with a stream of JSON progress (build, push).

        Each object's ``lines(obj)`` go to ``on_line``; an error object ends the stream with
        WorkspaceBuildError (``what`` failed: the error, and the last lines). Returns the ``aux``
        objects and the last lines. When the request body failed (``failed``), that is raised.
        """
        from asynctorchx.schedulers.workspace import WorkspaceBuildError

        client = await self.client()
        tail: list[str] = []
        aux: list[dict[str, Any]] = []
        try:
            async with client._query(
                path,
                "POST",
                params=dict(params),
                data=data,
                headers=dict(headers),
                timeout=_stream_timeout(),
            ) as resp:
                try:
                    async for obj in _json_lines(resp):
                        error = _error_text(obj)
                        if error is not None:
                            tail.append(error)
                            raise WorkspaceBuildError(
                                f"{what} failed: {error}", tail[-_TAIL_LINES:]
                            )
                        if isinstance(obj.get("aux"), dict):
                            aux.append(obj["aux"])
                        for line in lines(obj):
                            tail.append(line)
                            del tail[:-_TAIL_LINES]
                            if on_line is not None:
                                on_line(line)
                finally:
                    resp.close()
        except WorkspaceBuildError:
            raise
        except Exception as e:
            if failed:
                raise failed[0] from None
            raise _known_error(what, e, self.address) from None
        return aux, tail

    async def tag(self, image: str, repository: str, tag: str) -> None:
        """Tags ``image`` as ``repository:tag``."""
        client = await self.client()
        try:
            await client.images.tag(image, repository, tag=tag)
        except Exception as e:
            raise _known_error(
                f"tagging image {image} as {repository}:{tag}", e, self.address
            ) from None

    async def push(
        self,
        repository: str,
        tag: str,
        *,
        auth: Mapping[str, str] | None = None,
        on_progress: Callable[[str], None] | None = None,
    ) -> str | None:
        """Pushes ``repository:tag`` to its registry; returns the pushed manifest's digest.

        Raises:
            WorkspaceBuildError: the registry refused the push or could not be reached.
            DockerSchedulerError: the engine refused the request.
        """
        self.pushes += 1

        def lines(obj: Mapping[str, Any]) -> list[str]:
            status = obj.get("status")
            if not isinstance(status, str) or not status:
                return []
            layer, progress = obj.get("id"), obj.get("progress") or ""
            return [f"{layer}: {status} {progress}".strip() if layer else status]

        aux, _ = await self._progress_stream(
            f"pushing image {repository}:{tag}",
            f"images/{repository}/push",
            params={"tag": tag},
            headers={"X-Registry-Auth": _auth_header(auth)},
            lines=lines,
            on_line=on_progress,
        )
        digests = [str(a["Digest"]) for a in aux if a.get("Digest")]
        return digests[-1] if digests else None

    async def remove_image(self, ref: str, *, force: bool = False) -> bool:
        """Removes image ``ref`` (a tag of an image with other tags is only untagged).

        Returns:
            False when the engine had no such image.
        """
        client = await self.client()
        try:
            await client.images.delete(ref, force=force)
        except Exception as e:
            if status_of(e) == 404:
                return False
            raise _known_error(f"removing image {ref}", e, self.address) from None
        return True

    # -- containers, networks, volumes, events and logs (the local_docker backend) ---------------

    def _count(self, op: str) -> None:
        self.requests[op] += 1

    @property
    def writes(self) -> int:
        """How many requests that change something this engine wrapper has sent (see ``requests``)."""
        return sum(n for op, n in self.requests.items() if op in WRITE_REQUESTS)

    async def list_containers(self, label: str) -> list[dict[str, Any]]:
        """Every container (running or not) with ``label`` (``key`` or ``key=value``), as the
        entries of ``GET /containers/json``."""
        client = await self.client()
        self._count("container_list")
        try:
            raw = await client.containers.list(all=True, filters=json.dumps({"label": [label]}))
        except Exception as e:
            raise _known_error("listing containers", e, self.address) from None
        return [_summary(c) for c in raw]

    async def inspect_container(self, cid: str) -> dict[str, Any] | None:
        """The engine's ``inspect`` of a container, or None when it does not exist.

        The engine answers once it has finished recording the container's last change (an exit,
        a restart), so an inspect also waits for that.

        Raises:
            DockerSchedulerError: the engine failed the request.
            DockerEngineUnavailableError: it cannot be reached.
        """
        client = await self.client()
        self._count("container_inspect")
        try:
            return dict(await client.containers.container(cid).show())
        except Exception as e:
            if status_of(e) == 404:
                return None
            raise _request_error(f"inspecting container {cid[:12]}", e, self.address) from None

    async def create_container(
        self, config: Mapping[str, Any], name: str, *, what: str, exist_ok: bool = False
    ) -> str | None:
        """Creates a container and returns its id; with ``exist_ok``, None when the name is taken.

        Raises:
            DockerSchedulerError: the engine refused it (``what`` says which container it is).
        """
        client = await self.client()
        self._count("container_create")
        try:
            container = await client.containers.create(dict(config), name=name)
        except Exception as e:
            if exist_ok and status_of(e) == 409:
                return None
            raise _known_error(what, e, self.address) from None
        return str(container.id)

    async def start_container(self, cid: str, *, what: str) -> None:
        """Starts a created container.

        Raises:
            DockerSchedulerError: it did not start (``what`` says which container it is).
        """
        client = await self.client()
        self._count("container_start")
        try:
            await client.containers.container(cid).start()
        except Exception as e:
            raise _known_error(what, e, self.address) from None

    async def stop_container(self, cid: str, *, timeout: int | None = None) -> None:  # noqa: ASYNC109 - the engine's stop timeout, passed on
        """Stops a container: SIGTERM, then SIGKILL after ``timeout`` seconds (default: its own
        stop timeout). A container already stopped or gone is left alone.

        A stop of the container (with the same ``timeout``) already under way in this process is
        waited for instead of asked again: the engine sends the signal on every request, and a
        second SIGTERM runs the app's handler again (a cancel and the follow-up of the cancelled
        app used to both stop it).
        """
        key = (cid, timeout)
        under_way = self._stops.get(key)
        if under_way is not None:
            theirs = await asyncio.shield(under_way)
            if theirs is None:
                return
            if not isinstance(theirs, asyncio.CancelledError):
                raise theirs
            # that request was abandoned by its caller: ask again
            return await self.stop_container(cid, timeout=timeout)
        mine: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
        self._stops[key] = mine
        outcome: BaseException | None = asyncio.CancelledError()
        try:
            await self._stop(cid, timeout)
            outcome = None
        except Exception as e:
            outcome = e
            raise
        finally:
            if self._stops.get(key) is mine:
                del self._stops[key]
            mine.set_result(outcome)

    async def _stop(self, cid: str, timeout: int | None) -> None:  # noqa: ASYNC109 - as above
        client = await self.client()
        self._count("container_stop")
        # The engine answers once the container stopped: at most ``timeout`` seconds after the
        # signal. With no timeout the container's own applies, unknown here: no bound then.
        bound = None if timeout is None else timeout + STOP_READ_MARGIN
        try:
            container = client.containers.container(cid)
            with anyio.fail_after(bound):
                await (container.stop() if timeout is None else container.stop(t=timeout))
        except Exception as e:
            if status_of(e) in (304, 404):
                return
            raise _request_error(f"stopping container {cid[:12]}", e, self.address) from None

    async def remove_container(self, cid: str) -> None:
        """Removes a container, running or not (a container gone, or going, is left alone)."""
        client = await self.client()
        self._count("container_remove")
        try:
            await client.containers.container(cid).delete(force=True, timeout=_request_timeout())
        except Exception as e:
            if status_of(e) in (404, 409):
                return
            raise _request_error(f"removing container {cid[:12]}", e, self.address) from None

    async def pull_image(self, image: str) -> None:
        """Pulls ``image``.

        Raises:
            DockerSchedulerError: it could not be pulled (the message says so, and why).
            DockerEngineUnavailableError: the engine cannot be reached.
        """
        client = await self.client()
        self._count("image_pull")
        try:
            await client.images.pull(image)
            await client.images.inspect(image)
        except Exception as e:
            if not is_docker_error(e) or status_of(e) == 900:
                raise _known_error(f"pulling image {image!r}", e, self.address) from None
            raise DockerSchedulerError(
                f"image {image!r} is not present locally and could not be pulled "
                f"({message_of(e, self.address)}); build or load it first"
            ) from None

    async def volume_exists(self, name: str) -> bool:
        """True when the engine has the named volume."""
        client = await self.client()
        return await self._exists("volume", client.volumes.get, name)

    async def create_volume(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """Creates a named volume and returns the engine's view of it; when one of that name
        exists already, it is left as it is and returned (its labels, not ``config``'s)."""
        client = await self.client()
        self._count("volume_create")
        try:
            answer = await client._query_json(
                "volumes/create", method="POST", data=json.dumps(dict(config)).encode()
            )
        except Exception as e:
            raise _request_error(
                f"creating volume {config.get('Name')!r}", e, self.address
            ) from None
        return dict(answer or {})

    async def remove_volume(self, name: str) -> bool:
        """Removes a named volume; True when this request removed it, False when it was gone.

        Of several removals of one volume (from any process), exactly one gets True.
        """
        client = await self.client()
        self._count("volume_remove")
        try:
            await import_aiodocker().volumes.DockerVolume(client, name).delete()
        except Exception as e:
            if status_of(e) == 404:
                return False
            raise _request_error(f"removing volume {name!r}", e, self.address) from None
        return True

    async def list_volumes(self, label: str) -> list[dict[str, Any]]:
        """The volumes that carry ``label`` (``key`` or ``key=value``)."""
        client = await self.client()
        self._count("volume_list")
        try:
            answer = await client.volumes.list(filters={"label": [label]})
        except Exception as e:
            raise _request_error("listing volumes", e, self.address) from None
        return [dict(v) for v in (answer or {}).get("Volumes") or []]

    async def network_exists(self, name: str) -> bool:
        """True when the engine has a network of that name or id."""
        client = await self.client()
        return await self._exists("network", client.networks.get, name)

    async def _exists(self, kind: str, get: Callable[[str], Awaitable[Any]], name: str) -> bool:
        self._count(f"{kind}_inspect")
        try:
            await get(name)
        except Exception as e:
            if status_of(e) == 404:
                return False
            raise _request_error(f"checking {kind} {name!r}", e, self.address) from None
        return True

    async def create_network(self, config: Mapping[str, Any]) -> str | None:
        """Creates a network and returns its id; None when one of that name exists already."""
        client = await self.client()
        self._count("network_create")
        try:
            return str((await client.networks.create(dict(config))).id)
        except Exception as e:
            if status_of(e) == 409:
                return None
            raise _request_error(
                f"creating network {config.get('Name')!r}", e, self.address
            ) from None

    async def list_networks(
        self, *, name: str | None = None, label: str | None = None
    ) -> list[dict[str, Any]]:
        """The networks whose name contains ``name`` and that carry ``label`` (``key=value``)."""
        client = await self.client()
        self._count("network_list")
        filters = {"name": [name]} if name else {}
        if label:
            filters["label"] = [label]
        try:
            return [dict(n) for n in await client.networks.list(filters=filters)]
        except Exception as e:
            raise _request_error("listing networks", e, self.address) from None

    async def remove_network(self, nid: str) -> None:
        """Removes a network, waiting (up to ~3 s) while the engine still lets go of containers
        that were attached to it; a network already gone is left alone."""
        client = await self.client()
        for attempt in range(_NETWORK_REMOVE_TRIES):
            self._count("network_remove")
            try:
                await (await client.networks.get(nid)).delete()
                return
            except Exception as e:
                if status_of(e) == 404:
                    return
                if status_of(e) != 403 or attempt == _NETWORK_REMOVE_TRIES - 1:
                    raise _request_error(f"removing network {nid[:12]}", e, self.address) from None
            await asyncio.sleep(0.2 * (attempt + 1))  # 403: endpoints are still attached

    async def cpu_count(self) -> float | None:
        """The engine's CPU count (asked once), or None when it does not say."""
        if self._ncpu is None:
            client = await self.client()
            self._count("system_info")
            try:
                info = await client.system.info()
            except Exception:
                return None
            self._ncpu = float(info.get("NCPU") or 0) or None
        return self._ncpu

    @asynccontextmanager
    async def events(
        self, filters: Mapping[str, Any], since: str | None = None
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """Opens ``GET /events`` (from ``since``, in Docker's ``seconds.nanoseconds`` form, when
        given); entered once the engine answered, it yields the stream of event objects.

        Raises:
            DockerEngineUnavailableError: the engine cannot be reached, or the stream broke.
            DockerSchedulerError: the engine refused the request.
        """
        params: dict[str, Any] = {"filters": json.dumps(dict(filters))}
        if since is not None:
            params["since"] = since
        self._count("events")
        async with self._stream("events", "following the engine's events", params) as resp:
            stream = _guard_stream(_json_lines(resp), "following the engine's events", self.address)
            try:
                yield stream
            finally:
                await stream.aclose()

    @asynccontextmanager
    async def network_joins(self, network: str) -> AsyncIterator[AsyncIterator[str]]:
        """Follows the containers that join ``network`` (a name or an id): entered once the engine
        answered, it yields the id of each container as Docker announces its ``connect`` (sent
        once the container's endpoint has joined the network, early in its start).

        Raises:
            DockerEngineUnavailableError: the engine cannot be reached, or the stream broke.
            DockerSchedulerError: the engine refused the request.
        """
        filters = {"type": ["network"], "event": ["connect"], "network": [network]}
        async with self.events(filters) as stream:
            joined = _joined_containers(stream)
            try:
                yield joined
            finally:
                await joined.aclose()

    async def container_log_frames(
        self, cid: str, params: Mapping[str, Any]
    ) -> AsyncGenerator[tuple[int, bytes], None]:
        """The ``(stream id, payload)`` frames of ``GET /containers/{id}/logs`` with ``params``.

        Raises:
            DockerNotFoundError: the container does not exist (any more).
            DockerEngineUnavailableError: the engine cannot be reached, or the stream broke.
            DockerSchedulerError: the engine refused the request.
        """
        what = f"reading the logs of container {cid[:12]}"
        self._count("container_logs")
        async with self._stream(f"containers/{cid}/logs", what, dict(params)) as resp:
            decoder = FrameDecoder()
            async for chunk in _guard_stream(resp.content.iter_any(), what, self.address):
                for frame in decoder.feed(chunk):
                    yield frame

    @asynccontextmanager
    async def _stream(self, path: str, what: str, params: dict[str, Any]) -> AsyncIterator[Any]:
        """A streamed ``GET`` through aiodocker's raw query (no read bound), closed on exit."""
        client = await self.client()
        async with contextlib.AsyncExitStack() as stack:
            try:
                resp = await stack.enter_async_context(
                    client._query(path, params=params, timeout=_stream_timeout())
                )
            except Exception as e:
                raise _request_error(what, e, self.address) from None
            try:
                yield resp
            finally:
                resp.close()


def run_blocking(fn: Callable[[], Awaitable[T]]) -> T:
    """Runs the coroutine ``fn()`` to completion in a private event loop of a helper thread.

    For synchronous code that must ask an async client something, whether or not the calling
    thread runs an event loop of its own.
    """

    def in_thread() -> T:
        async def main() -> T:
            return await fn()

        return asyncio.run(main())

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="asynctorchx-blocking") as ex:
        return ex.submit(in_thread).result()


def _in_loop_thread(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _import_aiohttp() -> ModuleType:
    import aiohttp

    return aiohttp


def _request_timeout(read: float | None = None) -> Any:
    """The ``aiohttp.ClientTimeout`` of a request: ``CONNECT_TIMEOUT`` to connect, then ``read``
    (default ``READ_TIMEOUT``) seconds for each piece of the answer."""
    return _import_aiohttp().ClientTimeout(
        sock_connect=CONNECT_TIMEOUT, sock_read=READ_TIMEOUT if read is None else read
    )


def _stream_timeout() -> Any:
    """The ``aiohttp.ClientTimeout`` of a stream that may stay silent: a connect bound only."""
    return _import_aiohttp().ClientTimeout(sock_connect=CONNECT_TIMEOUT)


def _known_error(what: str, err: BaseException, address: str | None = None) -> BaseException:
    """``_request_error``, with a 404 kept a plain ``DockerSchedulerError`` (where a missing
    object is an answer of the engine like any other refusal)."""
    if status_of(err) == 404:
        return engine_error(what, err, address)
    return _request_error(what, err, address)


def _request_error(what: str, err: BaseException, address: str | None = None) -> BaseException:
    """The error to raise for a failed request (``engine_error``, and: 404 is DockerNotFoundError,
    a dropped connection or an engine that did not answer in time DockerEngineUnavailableError);
    an error of another kind is kept. ``address``: the engine's, named when its answer says
    nothing."""
    import aiohttp

    if isinstance(err, DockerSchedulerError):
        return err
    if status_of(err) == 404:
        return DockerNotFoundError(f"{what}: {message_of(err, address)}")
    if isinstance(err, asyncio.TimeoutError | TimeoutError):
        detail = f" ({err})" if str(err) else ""
        return DockerEngineUnavailableError(
            f"{what}: the Docker engine did not answer in time{detail}; is dockerd running and "
            "responsive?"
        )
    if is_docker_error(err) or isinstance(err, OSError):
        return engine_error(what, err, address)
    if isinstance(err, aiohttp.ClientError):
        return DockerEngineUnavailableError(
            f"{what}: the connection to the Docker engine failed ({type(err).__name__}: {err})"
        )
    return err


async def _guard_stream(
    items: AsyncIterator[T], what: str, address: str | None = None
) -> AsyncGenerator[T, None]:
    """``items``, with a failure while reading them raised as ``_request_error`` says."""
    try:
        async for item in items:
            yield item
    except Exception as e:
        raise _request_error(what, e, address) from None


async def _joined_containers(
    events: AsyncIterator[dict[str, Any]],
) -> AsyncGenerator[str, None]:
    """The container ids of a stream of network ``connect`` events."""
    async for event in events:
        attributes = (event.get("Actor") or {}).get("Attributes") or {}
        if attributes.get("container"):
            yield str(attributes["container"])


def _summary(container: Any) -> dict[str, Any]:
    """The listing entry of an ``aiodocker`` container (or a plain dict from a fake)."""
    if isinstance(container, Mapping):
        return dict(container)
    out: dict[str, Any] = {}
    for key in ("Id", "Names", "Image", "Labels", "State", "Status", "Created"):
        try:
            out[key] = container[key]
        except (KeyError, TypeError):
            continue
    return out


async def _noting_failure(
    context: AsyncIterable[bytes], failed: list[BaseException]
) -> AsyncIterator[bytes]:
    """``context``'s chunks; what producing them raised is appended to ``failed`` (and re-raised,
    which cuts the upload off so the engine fails the build)."""
    try:
        async for chunk in context:
            yield chunk
    except BaseException as e:
        failed.append(e)
        raise


def _build_output_lines(obj: Mapping[str, Any]) -> list[str]:
    """The non-blank lines of one build progress object's ``stream`` text."""
    text = obj.get("stream")
    if not isinstance(text, str):
        return []
    return [line.rstrip() for line in text.splitlines() if line.strip()]
