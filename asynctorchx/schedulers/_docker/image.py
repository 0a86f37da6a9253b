"""Workspace images: the first role's image plus the workspace, built by the Docker engine.

Used by ``local_docker`` (which runs the image) and ``kubernetes`` (which pushes it to the
``image_repo`` run option first). The recipe is the workspace's ``Dockerfile.torchx``, else
``FROM $IMAGE`` + ``COPY . .`` (TorchX's); it receives the build arguments ``IMAGE`` (the base
image) and ``WORKSPACE`` (the workspace), as in TorchX. The build context is the workspace minus
what its ``.dockerignore`` excludes (``Dockerfile.torchx`` is always sent).

Images are content addressed: ``asynctorchx/workspace:{hash}``, where the hash covers the base
image's id, the recipe, the build arguments and every file sent (path, mode, bytes). A tag that
exists is never rebuilt, so an unchanged workspace costs only its hashing; concurrent submits of
one hash share one build (``SingleFlight``); the base image is never pulled when present (a
missing one is pulled by the build's ``FROM``, and the hash then covers its name instead of its
id). The engine tags an image only after every step succeeded: a failed build leaves no tag. A
build every submit of which was cancelled is stopped (``SingleFlight``): its request is closed,
the engine kills the step it runs, and nothing is tagged either.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread

from asynctorchx._tasks import await_shielded
from asynctorchx.schedulers._docker.engine import DockerEngine, registry_auth, registry_of
from asynctorchx.schedulers.workspace import (
    DEFAULT_DOCKERFILE,
    DOCKERIGNORE,
    TORCHX_DOCKERFILE,
    SingleFlight,
    WorkspaceEvent,
    WorkspacePlan,
    WorkspaceProgress,
    WorkspaceScan,
    format_bytes,
    image_key,
    read_shipped,
    report,
    scan_workspace,
    write_tar,
)
from asynctorchx.specs.api import AppDef
from asynctorchx.specs.workspace import InvalidWorkspaceException, Workspace

LOCAL_REPOSITORY = "asynctorchx/workspace"
LABEL_WORKSPACE_HASH = "asynctorchx.io/workspace-hash"

_CHUNK = 256 * 1024
_REMEMBERED_PUSHES = 10_000


def local_tag(content_hash: str) -> str:
    """The local tag of the workspace image with ``content_hash``."""
    return f"{LOCAL_REPOSITORY}:{content_hash}"


def _recipe(scan: WorkspaceScan) -> tuple[bytes, str]:
    entry = scan.get(TORCHX_DOCKERFILE)
    if entry is None:
        return DEFAULT_DOCKERFILE, "default: FROM $IMAGE, COPY . ."
    if entry.kind != "file":
        raise InvalidWorkspaceException(
            f"{entry.source!r} must be a regular file (the recipe of the workspace image)"
        )
    data = read_shipped(entry)  # a FIFO put in its place since the scan must not block the open
    return data, f"{TORCHX_DOCKERFILE} of the workspace"


def plan_image(
    backend: str,
    app: AppDef,
    workspace: Workspace,
    base_id: str | None,
    *,
    push_repository: str | None = None,
) -> WorkspacePlan:
    """The plan of the workspace image of ``app``'s first role (reads and hashes the workspace).

    Args:
        backend: the scheduler.
        app: the app; its first role's image is the base.
        workspace: the workspace.
        base_id: the base image's id, or None when the engine does not have it.
        push_repository: the repository the image is pushed to (kubernetes), if any.

    Raises:
        InvalidWorkspaceException: the workspace cannot be read (see ``scan_workspace``).
    """
    role = app.roles[0]
    base = role.image
    scan = scan_workspace(workspace, DOCKERIGNORE, keep=(TORCHX_DOCKERFILE,))
    recipe, source = _recipe(scan)
    build_args = {"IMAGE": base, "WORKSPACE": str(workspace)}
    content_hash = image_key(
        scan, base=base_id or f"ref:{base}", recipe=recipe, build_args=build_args
    )
    local = local_tag(content_hash)
    target = f"{push_repository}:{content_hash}" if push_repository else local
    return WorkspacePlan(
        backend=backend,
        workspace=workspace,
        action="build and push image" if push_repository else "build image",
        roles=(role.name,),
        target=target,
        content_hash=content_hash,
        scan=scan,
        base_image=base,
        base_image_id=base_id,
        recipe=recipe.decode("utf-8", "replace"),
        recipe_source=source,
        push_to=target if push_repository else None,
        details=(("built as", local),) if push_repository else (),
    )


def _build_args(plan: WorkspacePlan) -> dict[str, str]:
    return {"IMAGE": plan.base_image or "", "WORKSPACE": str(plan.workspace)}


async def ensure_image(
    engine: DockerEngine,
    plan: WorkspacePlan,
    flights: SingleFlight,
    progress: WorkspaceProgress | None,
) -> None:
    """Builds the plan's image unless its tag exists; concurrent callers share one build, which
    is stopped (tagging nothing) when every one of them has been cancelled.

    Raises:
        WorkspaceBuildError: the build failed (nothing is tagged).
        WorkspaceChangedError: a workspace file changed since the dry run read it.
    """
    assert plan.content_hash is not None
    tag = local_tag(plan.content_hash)
    if await engine.image_id(tag) is not None:
        report(
            progress, WorkspaceEvent("build", tag, f"{tag} exists: nothing to build", True, True)
        )
        return

    async def job(rep: WorkspaceProgress) -> None:
        await _build(engine, plan, tag, rep)

    await flights.run(("build", tag), job, progress)


async def _build(
    engine: DockerEngine, plan: WorkspacePlan, tag: str, rep: WorkspaceProgress
) -> None:
    if await engine.image_id(tag) is not None:  # a build that ended while this one was asked for
        rep(WorkspaceEvent("build", tag, f"{tag} exists: nothing to build", True, True))
        return
    scan = plan.scan
    assert scan is not None
    rep(
        WorkspaceEvent(
            "build",
            tag,
            f"building {tag} from {plan.base_image} ({scan.files} files, "
            f"{format_bytes(scan.total_bytes)})",
        )
    )
    started = time.monotonic()
    extra = (
        {} if scan.get(TORCHX_DOCKERFILE) is not None else {TORCHX_DOCKERFILE: DEFAULT_DOCKERFILE}
    )
    send, recv = anyio.create_memory_object_stream[bytes](4)
    producer = _TarProducer(scan, extra)

    async def build() -> str:
        try:
            return await engine.build(
                producer.chunks(recv),
                tag=tag,
                dockerfile=TORCHX_DOCKERFILE,
                build_args=_build_args(plan),
                # one label: the classic builder adds a step (a container) per label
                labels={LABEL_WORKSPACE_HASH: plan.content_hash or ""},
                on_output=lambda line: rep(WorkspaceEvent("build", tag, line)),
            )
        finally:
            recv.close()  # a build that stopped reading lets the producer go

    _, built = await asyncio.gather(producer.run(send), build(), return_exceptions=True)
    if producer.error is not None:
        raise producer.error
    if isinstance(built, BaseException):
        raise built
    rep(WorkspaceEvent("build", tag, f"built {tag} in {time.monotonic() - started:.1f}s", True))


class _TarProducer:
    """Writes the build context tar in a worker thread and hands it to the event loop in chunks.

    A failure (a file that changed since the scan) ends the chunk stream with an error, so the
    engine sees a broken upload and fails the build, instead of building a truncated context.
    """

    def __init__(self, scan: WorkspaceScan, extra: dict[str, bytes]) -> None:
        self._scan = scan
        self._extra = extra
        self.error: BaseException | None = None

    async def run(self, send: Any) -> None:
        try:
            await anyio.to_thread.run_sync(self._write, send)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the build stopped reading: its own error says why
        except Exception as e:
            self.error = e
        finally:
            send.close()

    def _write(self, send: Any) -> None:
        sink = _Sink(send)
        write_tar(self._scan, sink, self._extra)
        sink.flush()

    async def chunks(self, recv: Any) -> AsyncIterator[bytes]:
        async for chunk in recv:
            yield chunk
        if self.error is not None:
            raise self.error


class _Sink:
    """A file-like ``write`` for a worker thread: hands the bytes to the event loop in chunks."""

    def __init__(self, send: Any) -> None:
        self._send = send
        self._buf = bytearray()

    def write(self, data: bytes) -> int:
        self._buf += data
        if len(self._buf) >= _CHUNK:
            self.flush()
        return len(data)

    def flush(self) -> None:
        if self._buf:
            chunk, self._buf = bytes(self._buf), bytearray()
            anyio.from_thread.run(self._send.send, chunk)


async def ensure_pushed(
    engine: DockerEngine,
    plan: WorkspacePlan,
    flights: SingleFlight,
    progress: WorkspaceProgress | None,
    pushed: set[str],
) -> None:
    """Tags the plan's local image as its ``push_to`` name and pushes it (once per process and
    name); concurrent callers share one push. A failed push removes that tag again.

    Raises:
        WorkspaceBuildError: the registry refused the push or cannot be reached.
    """
    target = plan.push_to
    assert target is not None and plan.content_hash is not None
    if target in pushed:
        report(progress, WorkspaceEvent("push", target, f"{target} was pushed already", True, True))
        return

    async def job(rep: WorkspaceProgress) -> None:
        await _push(engine, plan, target, rep)

    await flights.run(("push", target), job, progress)
    pushed.add(target)
    if len(pushed) > _REMEMBERED_PUSHES:
        pushed.clear()


async def _push(
    engine: DockerEngine, plan: WorkspacePlan, target: str, rep: WorkspaceProgress
) -> None:
    repository, _, tag = target.rpartition(":")
    assert plan.content_hash is not None
    rep(WorkspaceEvent("push", target, f"pushing {target}"))
    started = time.monotonic()
    await engine.tag(local_tag(plan.content_hash), repository, tag)
    try:
        auth = await registry_auth(registry_of(repository))
        await engine.push(
            repository,
            tag,
            auth=auth,
            on_progress=lambda line: rep(WorkspaceEvent("push", target, line)),
        )
    except BaseException:
        # awaited here whatever cancellation comes (anyio's shield alone lets Task.cancel() in)
        with contextlib.suppress(Exception):
            await await_shielded(asyncio.ensure_future(engine.remove_image(target)))
        raise
    rep(
        WorkspaceEvent(
            "push", target, f"pushed {target} in {time.monotonic() - started:.1f}s", True
        )
    )
