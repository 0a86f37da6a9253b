"""AsyncRunner: submit, watch, tail and cancel apps on any backend from one event loop.

The runner turns components and AppDefs into app handles (``{scheduler}://{session}/{app_id}``), creates
schedulers lazily (one per backend, closed with the runner), and serves every ``wait``/``wait_all``/
``as_completed``/``watch`` through one StatusHub per scheduler, so that a thousand waiters cost one
status round per tick, not a thousand polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from asynctorchx._tasks import TaskSupervisor, await_shielded
from asynctorchx.runner import _launch
from asynctorchx.runner._pacing import LaunchPacer
from asynctorchx.runner._readings import LogReadings
from asynctorchx.runner.hub import AppEntry, PollSettings, StatusHub
from asynctorchx.runner.limits import (
    BackendLimiter,
    Clock,
    LaunchEvent,
    LaunchEvents,
    LaunchEventStream,
    LaunchPhase,
    Limits,
    SystemClock,
    make_limiters,
)
from asynctorchx.schedulers import (
    SchedulerFactory,
    builtin_scheduler_factory,
    get_scheduler_factories,
)
from asynctorchx.schedulers.api import ListAppResponse, LogEntry, Scheduler, Stream
from asynctorchx.specs.api import (
    AppDef,
    AppDryRunInfo,
    AppHandle,
    AppState,
    AppStatus,
    CfgVal,
    UnknownAppException,
    UnknownSchedulerException,
    is_session_name,
    make_app_handle,
    parse_app_handle,
    runopts,
)
from asynctorchx.specs.workspace import Workspace
from asynctorchx.tracker.api import TrackerSetting

if TYPE_CHECKING:
    from asynctorchx.schedulers.workspace import WorkspaceProgress

#: What ``workspace=`` takes: a path, a ``file://`` URL, ``"dir:subdir,..."``, a mapping, a Workspace.
WorkspaceArg = Workspace | str | Mapping[str, str] | None

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Put by ``close()`` into the queues of active ``as_completed``/``watch`` iterations.
_CLOSED: Any = object()

DEFAULT_SESSION_NAME = "asynctorchx"

#: How long ``close()`` waits for a scheduler's ``close()`` by default (``close_timeout``): above
#: the builtins' own bounds (the local backend's 30 s stopping grace plus its clean-up,
#: Docker's and Kubernetes' 30 s for the launches in flight plus 30 s for the follow-ups).
DEFAULT_CLOSE_TIMEOUT = 120.0

#: How long a scheduler close cancelled at ``close_timeout`` may take to end, before it is left
#: to the runner's closing supervisor (a close that ignores its cancellation).
_CANCELLED_CLOSE_GRACE = 5.0


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
        final: the runner follows the app no further (it ended, or its scheduler no longer
            knows it: state UNKNOWN): this is its last event.
    """

    handle: AppHandle
    state: AppState
    status: AppStatus | None
    previous_state: AppState | None
    num_restarts: int
    timestamp: float
    final: bool = False

    @property
    def is_terminal(self) -> bool:
        """True when this is the app's last event."""
        return self.final or self.status is None or self.status.is_terminal()


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
            a seam for tests and for embedding custom backends (``asynctorchx.testing``). A factory
            registered as ``name`` must make a scheduler whose ``backend`` is ``name``.
        limits: per-backend launch limits, ``{backend: Limits(...)}`` or ``{backend: {key: value}}``
            (see ``asynctorchx.runner.limits``).
        clock: the time source of the rate limits (``asynctorchx.testing.VirtualClock`` in tests);
            waiting, timeouts and status polling always use real time.
        close_timeout: how long ``close()`` waits for each scheduler's ``close()`` (they close
            concurrently), and for each of its other steps (the log iterations it ends, the
            status hubs, the launch blocks' submits in flight, its background tasks); a
            scheduler still closing then is cancelled,
            with a warning naming its backend (``math.inf``: no bound). The default
            leaves the builtins their own bounded clean-up (up to a minute, e.g. the local
            backend's stopping grace).
        **scheduler_params: passed to every scheduler factory (each takes what it knows).

    Raises:
        ValueError: a bad name, a bad limit (naming the backend and the value) or a
            ``close_timeout`` that is no number > 0.
        UnknownSchedulerException: ``limits`` names a backend that does not exist.
    """

    def __init__(
        self,
        name: str = DEFAULT_SESSION_NAME,
        component_defaults: Mapping[str, Mapping[str, str]] | None = None,
        *,
        poll_settings: PollSettings | None = None,
        scheduler_factories: Mapping[str, SchedulerFactory] | None = None,
        limits: Mapping[str, Limits | Mapping[str, object]] | None = None,
        clock: Clock | None = None,
        close_timeout: float = DEFAULT_CLOSE_TIMEOUT,
        **scheduler_params: Any,
    ) -> None:
        # the name is a directory of the local backends' state root: '..' would escape it
        if not is_session_name(name):
            raise ValueError(
                "runner name must be a string without '/', ':', spaces or NUL, and not '.' or "
                f"'..', got {name!r}"
            )
        if (
            isinstance(close_timeout, bool)
            or not isinstance(close_timeout, (int, float))
            or not _float(close_timeout) > 0  # also rejects NaN
        ):
            raise ValueError(
                f"close_timeout must be a number of seconds > 0 (math.inf: no bound), "
                f"got {close_timeout!r}"
            )
        self._close_timeout = _float(close_timeout)
        self._name = name
        self._component_defaults = {k: dict(v) for k, v in (component_defaults or {}).items()}
        self._scheduler_params = scheduler_params
        self._poll_settings = poll_settings or PollSettings()
        self._factories = dict(scheduler_factories) if scheduler_factories is not None else None
        self._schedulers: dict[str, Scheduler[Any]] = {}
        self._hubs: dict[str, StatusHub] = {}
        self._split_cache: dict[str, tuple[str, str]] = {}
        self._supervisor = TaskSupervisor(f"runner:{name}")
        # the submits of launch blocks (shielded from their caller's cancellation): close() lets
        # those in flight finish, as a run()'s, so that their blocks learn what they launched
        self._submits = TaskSupervisor(f"runner:{name}")
        self._state = _Lifecycle.UNOPENED
        # the queues that as_completed and watch are reading: close() puts _CLOSED in each
        self._readers: set[asyncio.Queue[Any]] = set()
        self._readings = LogReadings()  # the log iterations handed out: close() ends them
        self._trackers: list[TrackerSetting] | None = None  # .torchxconfig's, read at first dry run
        self._trackers_read: (
            asyncio.Task[tuple[list[TrackerSetting] | None, Exception | None]] | None
        ) = None
        self._limiters: dict[str, BackendLimiter] = make_limiters(limits, clock or SystemClock())
        self._pacer = LaunchPacer(self._exits_awaited)
        for backend in self._limiters:
            if self._factory(backend) is None:
                raise UnknownSchedulerException(backend, self._available())
        self._launch_events = LaunchEvents()
        self._closing: asyncio.Task[None] | None = None  # close()'s clean-up, awaited by every call
        self._closer: TaskSupervisor | None = None  # owns the clean-up and the schedulers' closes
        # the loop open() ran in: the hubs, schedulers and their tasks belong to it
        self._loop: asyncio.AbstractEventLoop | None = None

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
        self._loop = asyncio.get_running_loop()
        self._state = _Lifecycle.OPENED

    async def close(self) -> None:
        """Stops the status hubs and closes every scheduler (local apps this runner owns are stopped).

        The iterations it handed out end with RuntimeError ("the runner was closed while ..."):
        ``as_completed``, ``watch``, and ``log_lines``/``log_entries`` (whose scheduler iterators
        are closed: a tail of an app the close does not stop reads nothing more); a
        ``launch_events`` stream ends. Submits in flight complete (bounded), so that their
        ``run()`` or launch block gets the handle. The schedulers close concurrently, each for
        at most ``close_timeout`` seconds (see ``AsyncRunner``).

        Idempotent. The clean-up runs to its end even if the caller is cancelled meanwhile (then the
        cancellation is raised afterwards), so nothing is left half-closed.
        """
        self._check_loop()
        if self._closing is None:
            self._state = _Lifecycle.CLOSED
            for queue in self._readers:
                queue.put_nowait(_CLOSED)
            self._launch_events.close()
            # the waits end now, not after the steps of the clean-up (a log iteration slow to
            # close held them up to close_timeout)
            for hub in self._hubs.values():
                hub.shut()
            for limiter in self._limiters.values():
                limiter.close()
            # its own supervisor: the runner's is closed by the clean-up itself
            self._closer = TaskSupervisor(f"runner:{self._name}")
            self._closing = self._closer.spawn(self._close(), name="close")
        await await_shielded(self._closing)

    async def _close(self) -> None:
        # each step runs whatever the one before did: a failed step (logged by the closing
        # supervisor) must not leave the schedulers open
        await self._close_step(
            self._readings.aclose(self._close_timeout), "the log iterations", bounded=False
        )
        await self._close_step(self._close_hubs(), "the status hubs")
        await self._close_step(self._submits.join(), "the submits in flight")
        await self._close_step(self._close_tasks(), "the runner's background tasks")
        await self._close_schedulers()

    async def _close_tasks(self) -> None:
        await asyncio.gather(self._submits.aclose(), self._supervisor.aclose())

    async def _close_hubs(self) -> None:
        # every hub's waiters are woken before any loop is awaited: one backend's round that
        # ignores its cancellation must not hold the waits on the others
        for hub in self._hubs.values():
            hub.shut()
        await asyncio.gather(*(hub.aclose() for hub in self._hubs.values()))

    async def _close_step(
        self, step: Coroutine[Any, Any, None], what: str, *, bounded: bool = True
    ) -> None:
        """Runs a step of the close for at most ``close_timeout`` seconds (``bounded=False``: a
        step that bounds itself); one still running then (a backend call that ignores its
        cancellation: nothing can end it) is left to the closing supervisor, with a warning.
        A step that fails is logged by that supervisor; the close goes on."""
        assert self._closer is not None
        task = self._closer.spawn(step, name=what)
        timeout = None if self._close_timeout == math.inf or not bounded else self._close_timeout
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if not done:
            logger.warning(
                "%s did not stop within %.3g s of the runner's close (AsyncRunner "
                "close_timeout): left running",
                what,
                self._close_timeout,
            )

    async def _close_schedulers(self) -> None:
        """Closes every scheduler at once, each for at most ``close_timeout`` seconds: one that
        hangs is cancelled (and awaited, bounded), with a warning; the others close all the same."""
        if not self._schedulers:
            return
        assert self._closer is not None
        closes = {
            self._closer.spawn(self._close_scheduler(s), name=f"close:{backend}"): backend
            for backend, s in self._schedulers.items()
        }
        timeout = None if self._close_timeout == math.inf else self._close_timeout
        _, late = await asyncio.wait(closes, timeout=timeout)
        for task in late:
            logger.warning(
                "scheduler %s did not close within %.3g s (AsyncRunner close_timeout): cancelled",
                closes[task],
                self._close_timeout,
            )
            task.cancel()
        if late:
            _, stuck = await asyncio.wait(late, timeout=_CANCELLED_CLOSE_GRACE)
            for task in stuck:  # it ignores its cancellation: the closing supervisor keeps it
                logger.error(
                    "scheduler %s's close ignores its cancellation: left running", closes[task]
                )

    @staticmethod
    async def _close_scheduler(scheduler: Scheduler[Any]) -> None:
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
        self._check_loop()

    def _check_loop(self) -> None:
        """Raises RuntimeError when called in an event loop other than the one ``open()`` ran in:
        the runner's hubs and schedulers wait on that loop's futures, so a call from another loop
        (a second ``asyncio.run``) would wait forever."""
        if self._loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:  # a synchronous call (launched(), hub()) outside any loop
            return
        if running is not self._loop:
            raise RuntimeError(
                "this runner was opened in another event loop: a runner belongs to the loop it "
                "was opened in (make one per asyncio.run)"
            )

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
            if scheduler.backend != backend:
                raise ValueError(
                    f"the scheduler factory registered as {backend!r} made a scheduler of backend "
                    f"{scheduler.backend!r}: register it under {scheduler.backend!r}"
                )
            self._schedulers[backend] = scheduler
        return scheduler

    def _exits_awaited(self) -> bool:
        """True while someone waits for an app of this runner to change (launches then take turns
        with the exits: see ``_pacing``)."""
        return any(hub.awaited() for hub in self._hubs.values())

    def _hub(self, backend: str) -> StatusHub:
        self._check_open()
        hub = self._hubs.get(backend)
        if hub is None:
            limiter = self._limiters.get(backend)
            hub = StatusHub(
                self._scheduler(backend),
                self._supervisor,
                self._poll_settings,
                before_round=None if limiter is None else limiter.call,
                round_would_wait=None if limiter is None else limiter.call_would_wait,
            )
            self._hubs[backend] = hub
        return hub

    def scheduler_run_opts(self, scheduler: str) -> runopts:
        """The run options of ``scheduler``.

        Raises:
            UnknownSchedulerException: no such scheduler.
        """
        return self._scheduler(scheduler).run_opts()

    def cfg_from_str(self, scheduler: str, *cfg_literal: str) -> dict[str, CfgVal]:
        """Parses ``"k=v,k2=v2"`` strings into one typed cfg for ``scheduler``, as TorchX does.

        Each string is parsed by ``runopts.cfg_from_str``; a key given in several strings takes the
        value of the last one: ``cfg_from_str("slurm", "partition=a,time=10", "partition=b")``.

        Raises:
            InvalidRunConfigException: a string is not ``key=value`` pairs or a value has the
                wrong type (names the string).
        """
        opts = self.scheduler_run_opts(scheduler)
        cfg: dict[str, CfgVal] = {}
        for literal in cfg_literal:
            cfg.update(opts.cfg_from_str(literal))
        return cfg

    # -- submitting -----------------------------------------------------------------------------

    def dryrun(
        self,
        app: AppDef,
        scheduler: str,
        cfg: Mapping[str, CfgVal] | None = None,
        workspace: WorkspaceArg = None,
        parent_run_id: str | None = None,
    ) -> AppDryRunInfo[Any]:
        """What ``run`` would submit, without submitting it (pure; ``app`` is not modified).

        Every role's env gets the tracking variables (``TORCHX_JOB_ID``, ``TORCHX_PARENT_RUN_ID``
        from ``parent_run_id`` or the launcher's environment, ``TORCHX_TRACKERS`` and the trackers'
        configs from ``.torchxconfig``, read once per runner): see ``asynctorchx.tracker``.

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
        _check_cfg(cfg)
        ws = Workspace.of(workspace)
        sched = self._scheduler(scheduler)
        tracked = self._with_tracking(app, scheduler, parent_run_id)
        if ws is None:
            return sched.submit_dryrun(tracked, cfg or {})
        return sched.submit_dryrun(tracked, cfg or {}, ws)

    async def _dryrun_async(
        self,
        app: AppDef,
        scheduler: str,
        cfg: Mapping[str, CfgVal] | None,
        workspace: WorkspaceArg,
        parent_run_id: str | None,
    ) -> AppDryRunInfo[Any]:
        if self._trackers is None:
            await self._load_trackers()
        ws = Workspace.of(workspace)
        if ws is None:
            return self.dryrun(app, scheduler, cfg, None, parent_run_id)
        _check_cfg(cfg)
        tracked = self._with_tracking(app, scheduler, parent_run_id)
        return await self._scheduler(scheduler).submit_dryrun_async(tracked, cfg or {}, ws)

    async def _load_trackers(self) -> None:
        """Reads ``.torchxconfig``'s trackers in a worker thread, once for all concurrent submits
        (they all resume together when it is read). A bad config raises here, and again at the
        next submit."""
        from asynctorchx.runner.config import configured_trackers

        async def read() -> tuple[list[TrackerSetting] | None, Exception | None]:
            try:
                return await anyio.to_thread.run_sync(configured_trackers), None
            except Exception as e:  # handed to every waiter, not logged as a failed task
                return None, e

        if self._trackers_read is None:
            self._trackers_read = self._supervisor.spawn(read(), "read-trackers")
        reading = self._trackers_read
        await asyncio.wait({reading})  # (a cancellation of the caller does not cancel the read)
        if reading.cancelled():  # close() stopped it: not a cancellation of the caller
            raise RuntimeError("the runner is closed")
        trackers, error = reading.result()
        if error is not None:
            self._trackers_read = None
            raise error
        if self._trackers is None:
            self._trackers = trackers

    def _with_tracking(self, app: AppDef, scheduler: str, parent_run_id: str | None) -> AppDef:
        from asynctorchx.tracker._launch import tracking_env, with_env

        if self._trackers is None:
            from asynctorchx.runner.config import configured_trackers

            self._trackers = configured_trackers()
        env = tracking_env(scheduler, self._name, self._trackers, parent_run_id)
        return with_env(app, env)

    def dryrun_component(
        self,
        component: str,
        component_args: Sequence[str] | Mapping[str, Any],
        scheduler: str,
        cfg: Mapping[str, CfgVal] | None = None,
        workspace: WorkspaceArg = None,
        parent_run_id: str | None = None,
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
        return self.dryrun(app, scheduler, cfg, workspace, parent_run_id)

    def _materialize(
        self, component: str, component_args: Sequence[str] | Mapping[str, Any]
    ) -> AppDef:
        from asynctorchx.components import get_component
        from asynctorchx.specs.builders import materialize_appdef, materialize_appdef_from_kwargs

        if isinstance(component_args, str):  # its characters would be taken as the arguments
            raise TypeError(
                f"component_args must be a list of arguments or a mapping, not a string: got "
                f"{component_args!r} for component {component!r} (pass {component_args.split()!r})"
            )
        found = get_component(component)
        defaults = self._component_defaults.get(component) or self._component_defaults.get(
            found.name
        )
        if isinstance(component_args, Mapping):
            # (the defaults are strings, from .torchxconfig: decoded by each parameter's type)
            return materialize_appdef_from_kwargs(
                found.fn, component_args, defaults, name=found.name
            )
        return materialize_appdef(found.fn, list(component_args), defaults, name=found.name)

    async def run(
        self,
        app: AppDef,
        scheduler: str,
        cfg: Mapping[str, CfgVal] | None = None,
        workspace: WorkspaceArg = None,
        parent_run_id: str | None = None,
        *,
        progress: WorkspaceProgress | None = None,
    ) -> AppHandle:
        """Submits ``app`` to ``scheduler`` and returns its handle (it does not wait for the app).

        A submit that completes while the runner closes still returns the handle: the app was
        launched (the close stops it on the local backends, where it ends CANCELLED). A launch
        that reaches the backend only after the runner closed raises RuntimeError and submits
        nothing.

        Args:
            workspace: local code to ship with the app (see ``dryrun``); it goes into the first
                role's image (a Docker image on local_docker and kubernetes, a snapshot directory
                on local_dir, the job's directory on slurm) or, on local_cwd, is the directory the
                replicas run in. It is read and hashed off the event loop.
            parent_run_id: groups runs for tracking (``TORCHX_PARENT_RUN_ID`` in every role).
            progress: called on the event loop with each ``WorkspaceEvent`` (build output, push
                progress, copies) while the workspace is shipped; it must not block.
        """
        self._check_open()
        await self._pacer.turn()
        info = await self._dryrun_async(app, scheduler, cfg, workspace, parent_run_id)
        return await self._schedule(info, progress)

    async def run_component(
        self,
        component: str,
        component_args: Sequence[str] | Mapping[str, Any],
        scheduler: str,
        cfg: Mapping[str, CfgVal] | None = None,
        workspace: WorkspaceArg = None,
        parent_run_id: str | None = None,
        *,
        progress: WorkspaceProgress | None = None,
    ) -> AppHandle:
        """Builds the app of a component and submits it; returns its handle (see ``run``)."""
        self._check_open()
        if ".py:" in component or component.endswith(".py"):
            # a component file is read, linted and run: not on the event loop
            app = await anyio.to_thread.run_sync(self._materialize, component, component_args)
            await self._pacer.turn()
        else:
            await self._pacer.turn()
            app = self._materialize(component, component_args)
        info = await self._dryrun_async(app, scheduler, cfg, workspace, parent_run_id)
        return await self._schedule(info, progress)

    async def schedule(
        self, dryrun_info: AppDryRunInfo[Any], *, progress: WorkspaceProgress | None = None
    ) -> AppHandle:
        """Submits a dry run made by this runner (or a scheduler of the same backend and session:
        one of another session is refused with a ValueError, its app being that session's).

        A dry run made with a workspace is shipped first (built, pushed or copied, unless the
        content-addressed result exists already); ``progress`` receives its events (see ``run``).
        """
        self._check_open()
        await self._pacer.turn()
        return await self._schedule(dryrun_info, progress)

    async def _schedule(
        self, dryrun_info: AppDryRunInfo[Any], progress: WorkspaceProgress | None
    ) -> AppHandle:
        from asynctorchx.schedulers.workspace import reporting

        self._check_open()
        backend = dryrun_info.scheduler
        if backend is None:
            raise ValueError("the dry run has no scheduler: make it with runner.dryrun(...)")
        if dryrun_info.session not in (None, self._name):
            # (its app would belong to that session: a handle of this runner's would not name it)
            raise ValueError(
                f"the dry run was made for session {dryrun_info.session!r}, not this runner's "
                f"{self._name!r}: make it with this runner's dryrun(...)"
            )
        scheduler = self._scheduler(backend)
        with reporting(progress):
            app_id = await self._submit(backend, scheduler, dryrun_info)
        handle = make_app_handle(backend, self._name, app_id)
        if self._state is _Lifecycle.CLOSED:
            # the runner closed while the backend was asked: the app was launched all the same
            # (and stopped by the close, on a local backend), so its handle is the answer
            return handle
        self._hub(backend).track(app_id, submitted=True)
        return handle

    async def _submit(
        self, backend: str, scheduler: Scheduler[Any], dryrun_info: AppDryRunInfo[Any]
    ) -> str:
        """The backend's ``schedule``, through the backend's limits, reported to launch_events."""
        limiter = self._limiters.get(backend)
        guard = _launch.submit_guard()
        events = self._launch_events
        if limiter is None and guard is None and not events.listened:
            return await scheduler.schedule(dryrun_info)  # the plain path: no cost per launch
        launch_id = events.new_id()
        app_name = dryrun_info.app.name if dryrun_info.app is not None else ""

        def emit(phase: LaunchPhase, **fields: Any) -> None:
            if events.listened:
                events.emit(
                    LaunchEvent(
                        launch_id, backend, app_name, phase, timestamp=time.time(), **fields
                    )
                )

        handles: list[AppHandle] = []
        # a guarded submit the backend refused while its caller was cancelled: the refusal, not
        # the cancellation, is what happened to the launch
        refused: list[Exception] = []

        def submitted(app_id: str) -> None:
            handles.append(make_app_handle(backend, self._name, app_id))
            if guard is not None:
                guard.on_submitted(handles[0])
            emit(LaunchPhase.SUBMITTED, handle=handles[0])

        try:
            async with (
                limiter.submit(lambda n: emit(LaunchPhase.QUEUED, waiting=n))
                if limiter is not None
                else contextlib.nullcontext()
            ):
                self._check_not_closed()  # closed while this launch waited for its slot
                if guard is not None and guard.closing():
                    # its block failed while it waited for its slot or its turn: the app would
                    # only be cancelled again, at the cost of two calls to the backend
                    raise RuntimeError(
                        "the launch group's block ended while this launch waited for its turn: "
                        "nothing was submitted"
                    )
                emit(LaunchPhase.SENT)
                if guard is None:
                    app_id = await scheduler.schedule(dryrun_info)
                    submitted(app_id)
                    return app_id
                # a launch block must learn the id of what it submitted, even if cancelled meanwhile
                return await _launch.shielded(
                    self._submits,
                    scheduler.schedule(dryrun_info),
                    name=f"submit:{backend}",
                    on_result=submitted,
                    on_error=refused.append,
                )
        except asyncio.CancelledError:
            if refused:
                emit(LaunchPhase.FAILED, error=f"{type(refused[0]).__name__}: {refused[0]}")
            elif not handles:  # a guarded submit reports SUBMITTED, then the cancellation
                emit(LaunchPhase.CANCELLED)
            raise
        except Exception as e:
            emit(LaunchPhase.FAILED, error=f"{type(e).__name__}: {e}")
            raise

    async def _call(self, backend: str) -> None:
        """Waits for the backend's call-rate limit, if it has one."""
        limiter = self._limiters.get(backend)
        if limiter is not None:
            await limiter.call()

    # -- embedding ------------------------------------------------------------------------------

    def launched(
        self,
        app: AppDef | str,
        scheduler: str,
        cfg: Mapping[str, CfgVal] | None = None,
        *,
        component_args: Sequence[str] | Mapping[str, Any] | None = None,
        cancel_on_exit: bool = True,
        cancel_on_normal_exit: bool = False,
        cleanup_timeout: float = _launch.DEFAULT_CLEANUP_TIMEOUT,
        **run_kwargs: Any,
    ) -> contextlib.AbstractAsyncContextManager[AppHandle]:
        """Launches an app for the duration of an ``async with`` block, which gets its handle.

        ``async with runner.launched(app, "slurm") as handle:`` — when the block is left by an
        exception or because the enclosing task was cancelled, the app is cancelled and waited for
        until it is terminal (shielded from further cancellation; the cancel always reaches the
        backend, and the wait for the app to end lasts at most ``cleanup_timeout`` seconds after
        it); when the block ends normally the app keeps running, unless
        ``cancel_on_normal_exit``. An app the runner already saw end is not cancelled. A
        cancellation that arrives while the backend is being asked waits for its answer, so that
        the app it made is cancelled too.

        Args:
            app: an ``AppDef``, or a component name (as ``run_component`` takes).
            scheduler: the backend.
            cfg: its run options.
            component_args: the component's arguments (only with a component name).
            cancel_on_exit: cancel the app when the block raises or is cancelled.
            cancel_on_normal_exit: cancel it also when the block ends normally.
            cleanup_timeout: how long leaving the block may wait for the app to end once it was
                cancelled (the cancel call itself is bounded only by the runner's
                ``close_timeout``).
            **run_kwargs: passed to ``run``/``run_component`` as they are.

        Raises:
            TimeoutError: on a normal exit with ``cancel_on_normal_exit``, the app was not terminal
                after ``cleanup_timeout`` (on other exits this is logged: their exception wins).
            RuntimeError: the runner is closed, or was closed inside the block before it could
                cancel the app, or the backend refused the cancel (the message says why; logged
                likewise on other exits).
            ValueError: ``cleanup_timeout`` is not a finite number > 0.
        """
        self._check_open()
        return _launch.launched(
            self._launcher(),
            app,
            scheduler,
            cfg,
            component_args=component_args,
            cancel_on_exit=cancel_on_exit,
            cancel_on_normal_exit=cancel_on_normal_exit,
            cleanup_timeout=cleanup_timeout,
            **run_kwargs,
        )

    def launch_group(
        self,
        *,
        gang: bool = False,
        cancel_on_exit: bool = True,
        cancel_on_normal_exit: bool = False,
        cleanup_timeout: float = _launch.DEFAULT_CLEANUP_TIMEOUT,
    ) -> contextlib.AbstractAsyncContextManager[_launch.LaunchGroup]:
        """A block that owns the apps launched through it: ``async with runner.launch_group() as g``.

        ``await g.launch(app_or_component, scheduler, cfg, component_args=...)`` submits an app
        (from any task inside the block); ``await g.wait()`` waits for all of them. Leaving the
        block by an exception or a cancellation cancels every app of the group, as ``launched``
        does for one. With ``gang=True``, an app that ends without succeeding (FAILED, CANCELLED by
        someone else, or lost) cancels the block and every other app, and the block raises
        ``GangFailedError``; the gang is watched while the block runs.

        Raises:
            GangFailedError: in a gang, an app did not succeed (the others still running were
                cancelled; the message says how many).
            TimeoutError, RuntimeError: as for ``launched``.
        """
        self._check_open()
        return _launch.launch_group(
            self._launcher(),
            gang=gang,
            cancel_on_exit=cancel_on_exit,
            cancel_on_normal_exit=cancel_on_normal_exit,
            cleanup_timeout=cleanup_timeout,
        )

    def launch_events(self) -> LaunchEventStream:
        """The ``LaunchEvent`` of every launch from now on (QUEUED, SENT, SUBMITTED, FAILED, CANCELLED).

        A launch waiting for a submit slot has no app handle yet, so ``watch`` cannot report it;
        this stream does. Use it as ``async with runner.launch_events() as events:``; it ends when
        the runner closes.
        """
        self._check_open()
        return self._launch_events.stream()

    def limits(self, scheduler: str) -> Limits | None:
        """The limits this runner applies to ``scheduler`` (None: none)."""
        limiter = self._limiters.get(scheduler)
        return None if limiter is None else limiter.limits

    def _launcher(self) -> _launch.Launcher:
        return _launch.Launcher(
            run=self.run,
            run_component=self.run_component,
            cancel=self.cancel,
            wait=self.wait,
            wait_all=self.wait_all,
            supervisor=self._supervisor,
            watch_final=self._watch_final,
            closed=lambda: self._state is _Lifecycle.CLOSED,
            known_final=self._known_final,
            close_timeout=self._close_timeout,
        )

    def _known_final(self, handle: AppHandle) -> bool:
        """True when the runner already saw the app end (its hub's entry is final): a launch
        block's clean-up sends it no cancel."""
        try:
            backend, app_id = self._split(handle)
        except Exception:  # not expected of a handle the runner made; cancelling it is harmless
            return False
        hub = self._hubs.get(backend)
        entry = None if hub is None else hub.entry(app_id)
        return entry is not None and entry.final

    def _watch_final(
        self, handle: AppHandle, on_final: Callable[[AppStatus | None], None]
    ) -> Callable[[], None]:
        """Calls ``on_final(status)`` once the app (just submitted) is final; returns the function
        that stops watching it."""
        backend, app_id = self._split(handle)
        hub = self._hub(backend)
        entry = hub.track(app_id, submitted=True)
        if entry.final:
            on_final(entry.status)
            return lambda: None
        return hub.listen(entry, lambda e: on_final(e.status) if e.final else None)

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
        await self._call(backend)
        asked_at = time.monotonic()  # the hub drops this answer if it knows a newer one
        response = await self._scheduler(backend).describe(app_id)
        if self._state is not _Lifecycle.CLOSED:  # (closed meanwhile: the answer stands)
            self._hub(backend).record(app_id, response, asked_at=asked_at)
        return None if response is None else response.to_status()

    async def wait(
        self,
        app_handle: AppHandle,
        timeout: float | None = None,  # noqa: ASYNC109
        wait_interval: float | None = None,
    ) -> AppStatus | None:
        """Waits until the app is terminal and returns its final status (None when unknown).

        Event-driven through the scheduler's StatusHub. Cancelling the awaiting task, or the timeout,
        leaves the app running. When the deadline passes, the scheduler is asked once more before
        ``TimeoutError`` is raised: an app that is already terminal is returned even with
        ``timeout=0``. With a positive timeout, that last question is not asked when the
        backend's ``max_calls_per_second`` would hold it back past the deadline: the timeout is
        kept. ``timeout=0`` is a question, not a deadline: it waits for the rate's next slot to
        ask it (never exceeding the rate), at most ``PollSettings.final_look_timeout``.

        Args:
            app_handle: the app.
            timeout: give up after this many seconds (None: wait as long as it takes).
            wait_interval: TorchX's polling interval, as a hint for backends that are polled
                (Slurm): while this wait lasts, their status is asked for at least every
                ``wait_interval`` seconds, and, if every waiter of the backend gives one, no more
                often than the shortest hint once nothing changes. Backends that push changes
                (local, Docker, Kubernetes) need no polling and ignore it. Note that TorchX's
                second positional parameter is ``wait_interval``; here it is ``timeout``.

        Raises:
            TimeoutError: the app was still running after ``timeout`` seconds.
            ValueError: ``timeout`` is negative or not a number, or ``wait_interval`` is not a
                positive number.
        """
        self._check_open()
        timeout = _check_timeout(timeout)
        if wait_interval is not None and (
            isinstance(wait_interval, bool)
            or not isinstance(wait_interval, (int, float))
            or not 0 < _float(wait_interval) < math.inf
        ):
            raise ValueError(
                f"wait_interval must be a positive number of seconds, got {wait_interval!r}"
            )
        backend, app_id = self._split(app_handle)
        hub = self._hub(backend)
        entry = await hub.wait_final(
            app_id, timeout, None if wait_interval is None else float(wait_interval)
        )
        return entry.status

    async def wait_all(
        self,
        app_handles: Iterable[AppHandle],
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> dict[AppHandle, AppStatus | None]:
        """Waits for every app; returns ``{handle: final status or None}``.

        Raises:
            TimeoutError: some app was still running after ``timeout`` seconds.
            ValueError: ``timeout`` is negative or not a number.
            TypeError: ``app_handles`` is one handle (a string) rather than an iterable of them.
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

        When the deadline passes, the schedulers are asked once more before ``TimeoutError`` is
        raised: apps that are already terminal are yielded even with ``timeout=0`` (which waits
        for a backend's ``max_calls_per_second`` to allow that question; a positive timeout does
        not: it is kept).

        Raises:
            TimeoutError: apps were still running after ``timeout`` seconds (those done were yielded).
            ValueError: ``timeout`` is negative or not a number.
            TypeError: ``app_handles`` is one handle (a string) rather than an iterable of them.
        """
        self._check_open()
        timeout = _check_timeout(timeout)
        handles = list(dict.fromkeys(_handles(app_handles)))
        if not handles:
            return
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        done: asyncio.Queue[tuple[AppHandle, AppEntry]] = asyncio.Queue()
        entries: list[tuple[AppHandle, StatusHub, AppEntry]] = []
        for handle in handles:
            backend, app_id = self._split(handle)
            hub = self._hub(backend)
            entries.append((handle, hub, hub.track(app_id)))

        pending = len(entries)
        stop_listening: list[Callable[[], None]] = []
        for handle, hub, entry in entries:
            if entry.final:
                done.put_nowait((handle, entry))
                continue

            def on_change(e: AppEntry, handle: AppHandle = handle) -> None:
                if e.final or e.error is not None:  # (error: the backend cannot be asked)
                    done.put_nowait((handle, e))

            stop_listening.append(hub.listen(entry, on_change))
        seen: set[AppHandle] = set()
        asked = False
        self._readers.add(done)
        try:
            while pending:
                remaining = deadline - time.monotonic()
                item: tuple[AppHandle, AppEntry] | None = None
                if remaining > 0:
                    with anyio.move_on_after(remaining):
                        item = await self._next_item(done, "waiting for apps")
                elif not done.empty():
                    item = await self._next_item(done, "waiting for apps")
                if item is None:
                    if asked:
                        raise TimeoutError(f"{pending} of {len(entries)} apps are not terminal")
                    # the deadline passed: ask the schedulers once more before giving up, so that
                    # an app that ended is reported ended whatever the timeout
                    asked = True
                    checks = [
                        (hub, *hub.consult(entry.app_id))
                        for handle, hub, entry in entries
                        if handle not in seen and not entry.final
                    ]
                    # the bounds run from one start: the looks of several hubs wait together
                    started = time.monotonic()
                    for hub, entry, token in checks:
                        bound = started + hub.final_look_bound(timeout or 0.0)
                        if not await hub.final_look(
                            entry,
                            token,
                            wait_for_rate=timeout == 0,
                            bound=max(0.0, bound - time.monotonic()),
                        ):
                            break  # rate-limited or not answered in time: the deadline is kept
                    continue
                handle, entry = item
                if handle in seen:
                    continue
                if not entry.final and entry.error is not None:
                    raise entry.error  # no retry mends it (a Slurm command missing)
                seen.add(handle)
                pending -= 1
                yield handle, entry.status
        finally:
            self._readers.discard(done)
            for stop in stop_listening:
                stop()

    async def _next_item(self, queue: asyncio.Queue[T], what: str) -> T:
        """The next item of a queue that ``close()`` ends with ``_CLOSED``."""
        item = await queue.get()
        if item is _CLOSED:
            raise RuntimeError(f"the runner was closed while {what}")
        return item

    async def watch(self, app_handles: Iterable[AppHandle]) -> AsyncGenerator[AppEvent, None]:
        """Yields an ``AppEvent`` for every state change (and restart) of the apps until all are final.

        The first event of each app is its state when the runner first sees it.

        Raises:
            TypeError: ``app_handles`` is one handle (a string) rather than an iterable of them.
        """
        self._check_open()
        queue: asyncio.Queue[AppEvent | BaseException] = asyncio.Queue()
        live: dict[AppHandle, AppEntry] = {}
        stop_listening: list[Callable[[], None]] = []
        last: dict[AppHandle, tuple[AppState, int] | None] = {}
        ended: set[AppHandle] = set()

        def emit(handle: AppHandle, entry: AppEntry) -> None:
            if handle in ended:
                return
            if not entry.final and entry.error is not None:  # the backend cannot be asked
                queue.put_nowait(entry.error)
                return
            resp = entry.response
            key = None if resp is None else (resp.state, resp.num_restarts)
            if handle in last and last[handle] == key and not entry.final:
                return
            if entry.final:  # (its last event, even when its state did not change)
                ended.add(handle)
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
                    final=entry.final,
                )
            )

        self._readers.add(queue)
        try:
            # inside the try: a bad handle after good ones must not leave their listeners behind
            for handle in dict.fromkeys(_handles(app_handles)):
                backend, app_id = self._split(handle)
                hub = self._hub(backend)
                entry = hub.track(app_id)
                live[handle] = entry

                def on_change(e: AppEntry, handle: AppHandle = handle) -> None:
                    emit(handle, e)

                stop_listening.append(hub.listen(entry, on_change))
                if entry.known:
                    emit(handle, entry)
            remaining = set(live)
            while remaining:
                event = await self._next_item(queue, "watching apps")
                if isinstance(event, BaseException):
                    raise event  # no retry mends it (a Slurm command missing)
                if event.is_terminal:
                    remaining.discard(event.handle)
                yield event
        finally:
            self._readers.discard(queue)
            for stop in stop_listening:
                stop()

    # -- control and inspection -----------------------------------------------------------------

    async def cancel(self, app_handle: AppHandle) -> None:
        """Asks the scheduler to stop the app; returns without waiting for it to end. Idempotent.

        A cancel the backend carries out while the runner closes returns normally (as ``status``
        returns what the backend answered then): only calls made after the close began raise.
        """
        self._check_open()
        backend, app_id = self._split(app_handle)
        await self._call(backend)
        await self._scheduler(backend).cancel(app_id)
        if self._state is not _Lifecycle.CLOSED:  # (closed meanwhile: the app was cancelled)
            self._hub(backend).refresh(app_id)

    async def stop(self, app_handle: AppHandle) -> None:
        """TorchX's older name for ``cancel`` (same behaviour)."""
        await self.cancel(app_handle)

    async def describe(self, app_handle: AppHandle) -> AppDef | None:
        """The app as its scheduler knows it (roles may be partial on some backends), or None."""
        self._check_open()
        backend, app_id = self._split(app_handle)
        await self._call(backend)
        response = await self._scheduler(backend).describe(app_id)
        if response is None:
            return None
        return AppDef(
            name=response.name or app_id, roles=list(response.roles), metadata=response.metadata
        )

    def log_lines(
        self,
        app_handle: AppHandle,
        role_name: str,
        k: int = 0,
        regex: str | re.Pattern[str] | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        should_tail: bool = False,
        streams: Stream | None = None,
        *,
        cursor: str | None = None,
    ) -> AsyncGenerator[str, None]:
        """The log lines of replica ``k`` of ``role_name`` (see ``Scheduler.log_iter``).

        The arguments are checked at this call (as ``Scheduler.log_iter`` checks them); the
        handle, and whether the app exists, when the first line is asked for, when the log is
        opened. ``aclose()`` stops a tail at once. With ``cursor`` (from ``log_entries``) the log
        resumes exactly after that line.
        Closing the runner ends the iteration (a tail of an app the close does not stop too): its
        next line, or the one it waits for, raises RuntimeError.

        Raises:
            UnknownAppException: the scheduler does not know the app.
            UnknownRoleException: no such role or replica.
            ValueError: a malformed cursor, or one taken on another app, role, replica or
                ``streams`` (and the other argument errors of ``Scheduler.log_iter``).
            RuntimeError: the runner is closed, or was closed while the lines were read.
        """

        def open_log(scheduler: Scheduler[Any], app_id: str) -> AsyncIterator[str]:
            return scheduler.log_iter(
                app_id, role_name, k, regex, since, until, should_tail, streams, cursor=cursor
            )

        return self._readings.read(self._log_opener(app_handle, open_log), "reading logs")

    def log_entries(
        self,
        app_handle: AppHandle,
        role_name: str,
        k: int = 0,
        regex: str | re.Pattern[str] | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        should_tail: bool = False,
        streams: Stream | None = None,
        *,
        cursor: str | None = None,
    ) -> AsyncGenerator[LogEntry, None]:
        """``log_lines`` with each line's cursor: ``LogEntry(cursor, line)`` pairs.

        A cursor is an opaque string (safe in URLs and HTTP headers, e.g. an SSE event id).
        Passing it back as ``cursor=`` (same app, role, replica and ``streams``) resumes exactly
        after its line: nothing repeated, nothing skipped, also while the app still writes and
        when lines share a timestamp. Every built-in backend supports cursors. Closing the runner
        ends the iteration as it ends ``log_lines``.

        Raises:
            NotImplementedError: the backend cannot resume logs.
            ValueError, UnknownAppException, UnknownRoleException, RuntimeError: as ``log_lines``.
        """

        def open_log(scheduler: Scheduler[Any], app_id: str) -> AsyncIterator[LogEntry]:
            return scheduler.log_entries(
                app_id, role_name, k, regex, since, until, should_tail, streams, cursor=cursor
            )

        return self._readings.read(self._log_opener(app_handle, open_log), "reading logs")

    def _log_opener(
        self, app_handle: AppHandle, open_log: Callable[[Scheduler[Any], str], AsyncIterator[T]]
    ) -> Callable[[], Awaitable[AsyncIterator[T]]]:
        """What opens the log of ``app_handle`` at the first line (one call to the backend),
        ``open_log(scheduler, app_id)`` called now when the handle can be read: a scheduler's log
        iterator checks its arguments when it is made (an invalid regex, a malformed cursor...
        raise at the caller's call, as ``Scheduler.log_iter``'s do) and reads nothing until it is
        iterated. An unusable handle, or a closed runner, raises at the first line instead."""
        made: AsyncIterator[T] | None = None
        try:
            self._check_open()
            backend, app_id = self._split(app_handle)
            scheduler = self._scheduler(backend)
        except (RuntimeError, ValueError, UnknownAppException, UnknownSchedulerException):
            pass  # (raised again when the log is opened)
        else:
            made = open_log(scheduler, app_id)

        async def open_source() -> AsyncIterator[T]:
            self._check_open()
            backend, app_id = self._split(app_handle)
            scheduler = self._scheduler(backend)
            await self._call(backend)
            return made if made is not None else open_log(scheduler, app_id)

        return open_source

    async def list(self, scheduler: str) -> list[ListAppResponse]:
        """The apps ``scheduler`` knows, with their handles filled in."""
        self._check_open()
        backend = self._scheduler(scheduler)
        await self._call(scheduler)
        apps = await backend.list()
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


def _check_cfg(cfg: object) -> None:
    """Raises TypeError unless ``cfg`` is a mapping or None (a ``"k=v"`` string is a likely slip)."""
    if cfg is not None and not isinstance(cfg, Mapping):
        hint = (
            " (parse a 'key=value,...' string with runner.cfg_from_str)"
            if isinstance(cfg, str)
            else ""
        )
        raise TypeError(f"cfg must be a mapping of run options or None, got {cfg!r}{hint}")


def _handles(app_handles: Iterable[AppHandle]) -> Iterable[AppHandle]:
    """``app_handles``, unless it is one handle (a string, whose characters would be taken as handles).

    Raises:
        TypeError: ``app_handles`` is a string.
    """
    if isinstance(app_handles, str):
        raise TypeError(
            f"app_handles must be an iterable of app handles, not one handle: got {app_handles!r} "
            "(pass [handle])"
        )
    return app_handles


def _check_timeout(timeout: float | None) -> float | None:
    """``timeout`` as a float (an int too large for one is inf: no limit).

    Raises:
        ValueError: ``timeout`` is not None or a number of seconds >= 0.
    """
    if timeout is None:
        return None
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not timeout >= 0  # also rejects NaN
    ):
        raise ValueError(f"timeout must be a number of seconds >= 0 or None, got {timeout!r}")
    return _float(timeout)


def _float(seconds: float) -> float:
    """``float(seconds)``, inf for an int too large for a float (10**400 s: no limit)."""
    try:
        return float(seconds)
    except OverflowError:
        return math.inf


def get_runner(
    name: str | None = None,
    component_defaults: Mapping[str, Mapping[str, str]] | None = None,
    *,
    limits: Mapping[str, Limits | Mapping[str, object]] | None = None,
    **scheduler_params: Any,
) -> AsyncRunner:
    """An unopened AsyncRunner; use it as ``async with get_runner() as runner:``.

    ``[component:NAME]`` sections of ``.torchxconfig`` supply component defaults unless given;
    ``[limits:SCHEDULER]`` sections supply the limits of the schedulers ``limits`` does not name.

    Raises:
        ValueError: a bad ``[limits:SCHEDULER]`` section (names it, the key and the value).
        UnknownSchedulerException: limits for a scheduler that does not exist.
    """
    if component_defaults is None:
        try:
            from asynctorchx.runner.config import load_sections

            component_defaults = load_sections(prefix="component")
        except ImportError:
            component_defaults = None
    from asynctorchx.runner.limits import limits_from_config

    merged: dict[str, Limits | Mapping[str, object]] = dict(limits_from_config())
    merged.update(limits or {})
    return AsyncRunner(
        name or DEFAULT_SESSION_NAME, component_defaults, limits=merged, **scheduler_params
    )
