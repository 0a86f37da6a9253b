"""AsyncRunner: submit, watch, tail and cancel apps on any backend from one event loop.

The runner turns components and AppDefs into app handles (``{scheduler}://{session}/{app_id}``), creates
schedulers lazily (one per backend, closed with the runner), and serves every ``wait``/``wait_all``/
``as_completed``/``watch`` through one StatusHub per scheduler, so that a thousand waiters cost one
status round per tick, not a thousand polls.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from asynctorchx._tasks import TaskSupervisor
from asynctorchx.runner.hub import PollSettings, StatusHub, _Entry
from asynctorchx.schedulers import (
    SchedulerFactory,
    builtin_scheduler_factory,
    get_scheduler_factories,
)
from asynctorchx.schedulers.api import ListAppResponse, Scheduler, Stream
from asynctorchx.specs.api import (
    AppDef,
    AppDryRunInfo,
    AppHandle,
    AppState,
    AppStatus,
    CfgVal,
    UnknownAppException,
    UnknownSchedulerException,
    make_app_handle,
    parse_app_handle,
    runopts,
)
from asynctorchx.specs.errors import InvalidComponentArgsException
from asynctorchx.specs.workspace import Workspace

if TYPE_CHECKING:
    from asynctorchx.schedulers.workspace import WorkspaceProgress

#: What ``workspace=`` takes: a path, a ``file://`` URL, ``"dir:subdir,..."``, a mapping, a Workspace.
WorkspaceArg = Workspace | str | Mapping[str, str] | None

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Put by ``close()`` into the queues of active ``as_completed``/``watch`` iterations.
_CLOSED: Any = object()

DEFAULT_SESSION_NAME = "asynctorchx"


@dataclass(frozen=True, slots=True)
class AppEvent:
    """A change of an app's state (or restart count) seen by ``AsyncRunner.watch``.

    Args:
        handle: the app's handle.
        state: the new state (UNKNOWN when the scheduler does not know the app).
        status: the full status, or None when the scheduler does not know the app.
        previous_state: the state before this change (None for the first event of an app).
        num_restarts: the restart count at this change.
        timestamp: when the runner saw the change (``time.time()``).
    """

    handle: AppHandle
    state: AppState
    status: AppStatus | None
    previous_state: AppState | None
    num_restarts: int
    timestamp: float

    @property
    def is_terminal(self) -> bool:
        """True when this is the app's last event."""
        return self.status is None or self.status.is_terminal()


class _Lifecycle(Enum):
    UNOPENED = "unopened"
    OPENED = "opened"
    CLOSED = "closed"


class AsyncRunner:
    """Launches and follows apps; use it as ``async with AsyncRunner(name="session") as runner:``.

    Args:
        name: the session name; it is part of every handle this runner makes and accepts.
        component_defaults: per-component default arguments, ``{component: {arg: value}}``.
        poll_settings: how the status hubs pace their rounds.
        scheduler_factories: the backends to use instead of the registry's (builtins and plugins);
            a seam for tests and for embedding custom backends.
        **scheduler_params: passed to every scheduler factory (each takes what it knows).
    """

    def __init__(
        self,
        name: str = DEFAULT_SESSION_NAME,
        component_defaults: Mapping[str, Mapping[str, str]] | None = None,
        *,
        poll_settings: PollSettings | None = None,
        scheduler_factories: Mapping[str, SchedulerFactory] | None = None,
        **scheduler_params: Any,
    ) -> None:
        if (
            not isinstance(name, str)
            or "/" in name
            or ":" in name
            or any(c.isspace() for c in name)
        ):
            raise ValueError(
                f"runner name must be a string without '/', ':' or spaces, got {name!r}"
            )
        self._name = name
        self._component_defaults = {k: dict(v) for k, v in (component_defaults or {}).items()}
        self._scheduler_params = scheduler_params
        self._poll_settings = poll_settings or PollSettings()
        self._factories = dict(scheduler_factories) if scheduler_factories is not None else None
        self._schedulers: dict[str, Scheduler[Any]] = {}
        self._hubs: dict[str, StatusHub] = {}
        self._split_cache: dict[str, tuple[str, str]] = {}
        self._supervisor = TaskSupervisor(f"runner:{name}")
        self._state = _Lifecycle.UNOPENED
        # the queues that as_completed and watch are reading: close() puts _CLOSED in each
        self._readers: set[asyncio.Queue[Any]] = set()

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The session name."""
        return self._name

    async def __aenter__(self) -> AsyncRunner:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def open(self) -> None:
        """Opens the runner (``async with`` does it for you).

        Raises:
            RuntimeError: the runner was already opened or closed.
        """
        if self._state is not _Lifecycle.UNOPENED:
            raise RuntimeError(f"cannot open a runner that is {self._state.value}")
        self._state = _Lifecycle.OPENED

    async def close(self) -> None:
        """Stops the status hubs and closes every scheduler (local apps this runner owns are stopped).

        Idempotent. Cleanup runs shielded from cancellation so nothing is left half-closed.
        """
        if self._state is _Lifecycle.CLOSED:
            return
        self._state = _Lifecycle.CLOSED
        for queue in self._readers:
            queue.put_nowait(_CLOSED)
        with anyio.CancelScope(shield=True):
            for hub in self._hubs.values():
                await hub.aclose()
            await self._supervisor.aclose()
            for scheduler in self._schedulers.values():
                try:
                    await scheduler.close()
                except Exception:
                    logger.exception("closing scheduler %s failed", scheduler.backend)

    def _check_open(self) -> None:
        if self._state is _Lifecycle.UNOPENED:
            raise RuntimeError(
                "the runner is not open: use 'async with AsyncRunner(...) as runner:' or await runner.open()"
            )
        if self._state is _Lifecycle.CLOSED:
            raise RuntimeError("the runner is closed")

    def _check_not_closed(self) -> None:
        if self._state is _Lifecycle.CLOSED:
            raise RuntimeError("the runner is closed")

    # -- schedulers -----------------------------------------------------------------------------

    def _available(self) -> Mapping[str, SchedulerFactory]:
        if self._factories is None:
            # resolved once per runner: every handle is checked against it, thousands of times a
            # second in a busy as_completed loop
            self._factories = get_scheduler_factories()
        return self._factories

    def scheduler_backends(self) -> list[str]:
        """The names of every scheduler backend available."""
        return list(self._available())

    def _factory(self, backend: str) -> SchedulerFactory | None:
        """The factory of ``backend`` (None when unknown); a builtin needs no entry-point scan."""
        if self._factories is None:
            builtin = builtin_scheduler_factory(backend)
            if builtin is not None:
                return builtin
        return self._available().get(backend)

    def _scheduler(self, backend: str) -> Scheduler[Any]:
        self._check_not_closed()
        scheduler = self._schedulers.get(backend)
        if scheduler is None:
            factory = self._factory(backend)
            if factory is None:
                raise UnknownSchedulerException(backend, self._available())
            scheduler = factory(self._name, **self._scheduler_params)
            self._schedulers[backend] = scheduler
        return scheduler

    def _hub(self, backend: str) -> StatusHub:
        self._check_open()
        hub = self._hubs.get(backend)
        if hub is None:
            hub = StatusHub(self._scheduler(backend), self._supervisor, self._poll_settings)
            self._hubs[backend] = hub
        return hub

    def scheduler_run_opts(self, scheduler: str) -> runopts:
        """The run options of ``scheduler``.

        Raises:
            UnknownSchedulerException: no such scheduler.
        """
        return self._scheduler(scheduler).run_opts()

    def cfg_from_str(self, scheduler: str, cfg_str: str) -> dict[str, CfgVal]:
        """Parses ``"k=v,k2=v2"`` into a typed cfg for ``scheduler`` (see ``runopts.cfg_from_str``)."""
        return self.scheduler_run_opts(scheduler).cfg_from_str(cfg_str)

    # -- submitting -----------------------------------------------------------------------------

    def dryrun(
        self,
        app: AppDef,
        scheduler: str,
        cfg: Mapping[str, CfgVal] | None = None,
        workspace: WorkspaceArg = None,
    ) -> AppDryRunInfo[Any]:
        """What ``run`` would submit, without submitting it (pure; ``app`` is not modified).

        With a ``workspace`` (a directory, a ``file://`` URL, ``"dir_a:sub_a,dir_b:sub_b"``, or a
        ``Workspace``; ``None`` or ``""`` for none) the dry run holds the workspace plan, shown
        first when printed: what would be built, pushed or copied (the base image, the recipe,
        the number and size of the files, the content hash, the target image or directory).
        Nothing is built, pushed or copied; the workspace's files are read and hashed, which
        blocks: ``run`` does that in a worker thread.

        Raises:
            UnknownSchedulerException: no such scheduler (the message lists the available ones).
            InvalidAppDefException: a bad field in the app.
            InvalidRunConfigException: a bad cfg value (names the run option and its type).
            InvalidWorkspaceException: the workspace cannot be used (names it and why).
            WorkspaceNotSupportedException: the scheduler ships no workspace.
        """
        ws = Workspace.of(workspace)
        sched = self._scheduler(scheduler)
        if ws is None:
            return sched.submit_dryrun(app, cfg or {})
        return sched.submit_dryrun(app, cfg or {}, ws)

    async def _dryrun_async(
        self, app: AppDef, scheduler: str, cfg: Mapping[str, CfgVal] | None, workspace: WorkspaceArg
    ) -> AppDryRunInfo[Any]:
        ws = Workspace.of(workspace)
        if ws is None:
            return self.dryrun(app, scheduler, cfg)
        return await self._scheduler(scheduler).submit_dryrun_async(app, cfg or {}, ws)

    def dryrun_component(
        self,
        component: str,
        component_args: Sequence[str] | Mapping[str, Any],
        scheduler: str,
        cfg: Mapping[str, CfgVal] | None = None,
        workspace: WorkspaceArg = None,
    ) -> AppDryRunInfo[Any]:
        """``dryrun`` of the app a component builds from its arguments.

        Args:
            component: ``module.fn`` of a builtin or plugin component, or ``path/to/file.py:fn``.
            component_args: command-line style arguments (``["--msg", "hi"]``) or keyword arguments.

        Raises:
            ComponentNotFoundException: unknown component (close names are suggested).
            ComponentValidationException: the component file does not pass the linter.
            SystemExit-free argparse errors are raised as ValueError naming the argument.
        """
        app = self._materialize(component, component_args)
        return self.dryrun(app, scheduler, cfg, workspace)

    def _materialize(
        self, component: str, component_args: Sequence[str] | Mapping[str, Any]
    ) -> AppDef:
        from asynctorchx.components import get_component
        from asynctorchx.specs.builders import materialize_appdef

        found = get_component(component)
        defaults = self._component_defaults.get(component) or self._component_defaults.get(
            found.name
        )
        if isinstance(component_args, Mapping):
            merged: dict[str, Any] = {**(defaults or {}), **component_args}
            try:
                inspect.signature(found.fn).bind(**merged)
            except TypeError as e:  # a missing or unknown argument
                raise InvalidComponentArgsException(component, str(e)) from None
            return found.fn(**merged)
        return materialize_appdef(found.fn, list(component_args), defaults)

    async def run(
        self,
        app: AppDef,
        scheduler: str,
        cfg: Mapping[str, CfgVal] | None = None,
        workspace: WorkspaceArg = None,
        *,
        progress: WorkspaceProgress | None = None,
    ) -> AppHandle:
        """Submits ``app`` to ``scheduler`` and returns its handle (it does not wait for the app).

        Args:
            workspace: local code to ship with the app (see ``dryrun``); it goes into the first
                role's image (a Docker image on local_docker and kubernetes, a snapshot directory
                on local_dir, the job's directory on slurm) or, on local_cwd, is the directory the
                replicas run in. It is read and hashed off the event loop.
            progress: called on the event loop with each ``WorkspaceEvent`` (build output, push
                progress, copies) while the workspace is shipped; it must not block.
        """
        self._check_open()
        info = await self._dryrun_async(app, scheduler, cfg, workspace)
        return await self.schedule(info, progress=progress)

    async def run_component(
        self,
        component: str,
        component_args: Sequence[str] | Mapping[str, Any],
        scheduler: str,
        cfg: Mapping[str, CfgVal] | None = None,
        workspace: WorkspaceArg = None,
        *,
        progress: WorkspaceProgress | None = None,
    ) -> AppHandle:
        """Builds the app of a component and submits it; returns its handle (see ``run``)."""
        self._check_open()
        app = self._materialize(component, component_args)
        info = await self._dryrun_async(app, scheduler, cfg, workspace)
        return await self.schedule(info, progress=progress)

    async def schedule(
        self, dryrun_info: AppDryRunInfo[Any], *, progress: WorkspaceProgress | None = None
    ) -> AppHandle:
        """Submits a dry run made by this runner (or a scheduler of the same backend).

        A dry run made with a workspace is shipped first (built, pushed or copied, unless the
        content-addressed result exists already); ``progress`` receives its events (see ``run``).
        """
        from asynctorchx.schedulers.workspace import reporting

        self._check_open()
        backend = dryrun_info.scheduler
        if backend is None:
            raise ValueError("the dry run has no scheduler: make it with runner.dryrun(...)")
        with reporting(progress):
            app_id = await self._scheduler(backend).schedule(dryrun_info)
        self._hub(backend).track(app_id, submitted=True)
        return make_app_handle(backend, self._name, app_id)

    # -- status ---------------------------------------------------------------------------------

    def _split(self, app_handle: AppHandle) -> tuple[str, str]:
        # cached: a sweep driver hands the same handles to as_completed over and over
        split = self._split_cache.get(app_handle)
        if split is not None:
            return split
        backend, session, app_id = parse_app_handle(app_handle)
        if backend not in self._schedulers and self._factory(backend) is None:
            raise UnknownSchedulerException(backend, self._available())
        if session != self._name:
            raise UnknownAppException(
                app_handle, f"it belongs to session {session!r}, not this runner's {self._name!r}"
            )
        if len(self._split_cache) >= 100_000:
            self._split_cache.clear()
        self._split_cache[app_handle] = (backend, app_id)
        return backend, app_id

    async def status(self, app_handle: AppHandle) -> AppStatus | None:
        """The app's current status, or None when its scheduler does not know it."""
        self._check_open()
        backend, app_id = self._split(app_handle)
        response = await self._scheduler(backend).describe(app_id)
        self._hub(backend).record(app_id, response)
        return None if response is None else response.to_status()

    async def wait(self, app_handle: AppHandle, timeout: float | None = None) -> AppStatus | None:  # noqa: ASYNC109
        """Waits until the app is terminal and returns its final status (None when unknown).

        Event-driven through the scheduler's StatusHub. Cancelling the awaiting task, or the timeout,
        leaves the app running.

        Raises:
            TimeoutError: the app was still running after ``timeout`` seconds.
        """
        self._check_open()
        backend, app_id = self._split(app_handle)
        hub = self._hub(backend)
        with anyio.fail_after(math.inf if timeout is None else timeout):
            entry = await hub.wait_final(app_id)
        return entry.status

    async def wait_all(
        self,
        app_handles: Iterable[AppHandle],
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> dict[AppHandle, AppStatus | None]:
        """Waits for every app; returns ``{handle: final status or None}``.

        Raises:
            TimeoutError: some app was still running after ``timeout`` seconds.
        """
        results: dict[AppHandle, AppStatus | None] = {}
        async for handle, status in self.as_completed(app_handles, timeout=timeout):
            results[handle] = status
        return results

    async def as_completed(
        self,
        app_handles: Iterable[AppHandle],
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> AsyncGenerator[tuple[AppHandle, AppStatus | None], None]:
        """Yields ``(handle, final status or None)`` for each app as it finishes, in completion order.

        Raises:
            TimeoutError: apps were still running after ``timeout`` seconds (those done were yielded).
        """
        self._check_open()
        handles = list(dict.fromkeys(app_handles))
        if not handles:
            return
        done: asyncio.Queue[tuple[AppHandle, _Entry]] = asyncio.Queue()
        entries: list[tuple[AppHandle, StatusHub, _Entry]] = []
        for handle in handles:
            backend, app_id = self._split(handle)
            hub = self._hub(backend)
            entries.append((handle, hub, hub.track(app_id)))

        pending = len(entries)
        listeners: list[tuple[_Entry, Any]] = []
        for handle, _hub, entry in entries:
            if entry.final:
                done.put_nowait((handle, entry))
                continue

            def on_change(e: _Entry, handle: AppHandle = handle) -> None:
                if e.final:
                    done.put_nowait((handle, e))

            entry.listeners.append(on_change)
            listeners.append((entry, on_change))
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        seen: set[AppHandle] = set()
        self._readers.add(done)
        try:
            while pending:
                remaining = deadline - time.monotonic()
                with anyio.fail_after(max(remaining, 0) if remaining != math.inf else math.inf):
                    handle, entry = await self._next_item(done, "waiting for apps")
                if handle in seen:
                    continue
                seen.add(handle)
                pending -= 1
                yield handle, entry.status
        finally:
            self._readers.discard(done)
            for entry, listener in listeners:
                if listener in entry.listeners:
                    entry.listeners.remove(listener)

    async def _next_item(self, queue: asyncio.Queue[T], what: str) -> T:
        """The next item of a queue that ``close()`` ends with ``_CLOSED``."""
        item = await queue.get()
        if item is _CLOSED:
            raise RuntimeError(f"the runner was closed while {what}")
        return item

    async def watch(self, app_handles: Iterable[AppHandle]) -> AsyncGenerator[AppEvent, None]:
        """Yields an ``AppEvent`` for every state change (and restart) of the apps until all are final.

        The first event of each app is its state when the runner first sees it.
        """
        self._check_open()
        queue: asyncio.Queue[AppEvent] = asyncio.Queue()
        live: dict[AppHandle, _Entry] = {}
        registered: list[tuple[_Entry, Any]] = []
        last: dict[AppHandle, tuple[AppState, int] | None] = {}

        def emit(handle: AppHandle, entry: _Entry) -> None:
            resp = entry.response
            key = None if resp is None else (resp.state, resp.num_restarts)
            if handle in last and last[handle] == key and not (entry.final and resp is None):
                return
            previous = last.get(handle)
            last[handle] = key
            status = None if resp is None else resp.to_status()
            queue.put_nowait(
                AppEvent(
                    handle=handle,
                    state=AppState.UNKNOWN if resp is None else resp.state,
                    status=status,
                    previous_state=None if previous is None else previous[0],
                    num_restarts=0 if resp is None else max(resp.num_restarts, 0),
                    timestamp=time.time(),
                )
            )

        for handle in dict.fromkeys(app_handles):
            backend, app_id = self._split(handle)
            entry = self._hub(backend).track(app_id)
            live[handle] = entry

            def on_change(e: _Entry, handle: AppHandle = handle) -> None:
                emit(handle, e)

            entry.listeners.append(on_change)
            registered.append((entry, on_change))
            if entry.known:
                emit(handle, entry)
        self._readers.add(queue)
        try:
            remaining = set(live)
            while remaining:
                event = await self._next_item(queue, "watching apps")
                if event.is_terminal:
                    remaining.discard(event.handle)
                yield event
        finally:
            self._readers.discard(queue)
            for entry, listener in registered:
                if listener in entry.listeners:
                    entry.listeners.remove(listener)

    # -- control and inspection -----------------------------------------------------------------

    async def cancel(self, app_handle: AppHandle) -> None:
        """Asks the scheduler to stop the app; returns without waiting for it to end. Idempotent."""
        self._check_open()
        backend, app_id = self._split(app_handle)
        await self._scheduler(backend).cancel(app_id)
        self._hub(backend).refresh(app_id)

    async def describe(self, app_handle: AppHandle) -> AppDef | None:
        """The app as its scheduler knows it (roles may be partial on some backends), or None."""
        self._check_open()
        backend, app_id = self._split(app_handle)
        response = await self._scheduler(backend).describe(app_id)
        if response is None:
            return None
        return AppDef(name=response.name or app_id, roles=list(response.roles))

    async def log_lines(
        self,
        app_handle: AppHandle,
        role_name: str,
        k: int = 0,
        regex: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        should_tail: bool = False,
        streams: Stream | None = None,
    ) -> AsyncGenerator[str, None]:
        """The log lines of replica ``k`` of ``role_name`` (see ``Scheduler.log_iter``).

        Nothing is checked or read until the first line is asked for; ``aclose()`` stops a tail at
        once.

        Raises:
            UnknownAppException: the scheduler does not know the app.
            UnknownRoleException: no such role or replica.
        """
        self._check_open()
        backend, app_id = self._split(app_handle)
        scheduler = self._scheduler(backend)
        if not await scheduler.exists(app_id):
            raise UnknownAppException(app_handle)
        lines = scheduler.log_iter(app_id, role_name, k, regex, since, until, should_tail, streams)
        # one plain async-generator layer: cheaper per line than any hand-written __anext__
        try:
            async for line in lines:
                yield line
        finally:
            aclose = getattr(lines, "aclose", None)
            if aclose is not None:
                await aclose()

    async def list(self, scheduler: str) -> list[ListAppResponse]:
        """The apps ``scheduler`` knows, with their handles filled in."""
        self._check_open()
        apps = await self._scheduler(scheduler).list()
        return [
            ListAppResponse(
                app_id=a.app_id,
                state=a.state,
                app_handle=make_app_handle(scheduler, self._name, a.app_id)
                if a.app_handle in ("", "<NOT_SET>")
                else a.app_handle,
                name=a.name,
            )
            for a in apps
        ]

    def hub(self, scheduler: str) -> StatusHub:
        """The StatusHub of ``scheduler`` (for instrumentation: ``hub.rounds`` counts status rounds)."""
        return self._hub(scheduler)

    def __repr__(self) -> str:
        return f"<AsyncRunner name={self._name!r} {self._state.value}>"


def get_runner(
    name: str | None = None,
    component_defaults: Mapping[str, Mapping[str, str]] | None = None,
    **scheduler_params: Any,
) -> AsyncRunner:
    """An unopened AsyncRunner; use it as ``async with get_runner() as runner:``.

    ``[component:NAME]`` sections of ``.torchxconfig`` supply component defaults unless given.
    """
    if component_defaults is None:
        try:
            from asynctorchx.runner.config import load_sections

            component_defaults = load_sections(prefix="component")
        except ImportError:
            component_defaults = None
    return AsyncRunner(name or DEFAULT_SESSION_NAME, component_defaults, **scheduler_params)
