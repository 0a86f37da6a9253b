"""The async Scheduler interface every backend implements, and the types it returns.

A backend turns an ``AppDef`` into a request (``submit_dryrun``, pure and synchronous), submits it
(``schedule``), and answers ``describe``/``list``/``cancel``/``log_iter`` for the apps it knows. All I/O is
``async``; nothing here blocks the event loop.

A backend that ships workspaces sets ``supports_workspace = True``, implements ``plan_workspace``
(what it will build, push or copy: pure apart from reading the workspace's files, and for images
the base image's id) and carries the plan out at the start of ``schedule`` (``dryrun_info.workspace``),
sending progress to ``asynctorchx.schedulers.workspace.current_progress()``. The others raise
``WorkspaceNotSupportedException`` when given a workspace, instead of dropping it.

A backend that learns of changes without polling (child-process exits, Docker events, a Kubernetes
watch) sets ``pushes_changes = True`` and calls ``self._notify(app_id)`` whenever an app may have
changed; the runner's StatusHub subscribes with ``subscribe`` and re-describes just those apps.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import anyio
import anyio.to_thread

from asynctorchx.logs._cursor import CursorEncoder, CursorKind, Position, lines_of
from asynctorchx.logs._cursor import LogEntry as LogEntry
from asynctorchx.logs._query import ALL_STREAMS, LogQuery
from asynctorchx.logs._query import Stream as Stream

# the log-query helpers live in ``logs`` (below the backends); these names are kept here for
# backends and for TorchX's ``schedulers.api`` names (``Stream``, ``filter_regex``, ``split_lines``)
from asynctorchx.logs._query import check_time_window as check_time_window
from asynctorchx.logs._query import compile_log_regex as compile_log_regex
from asynctorchx.logs._query import filter_regex as filter_regex
from asynctorchx.logs._query import split_lines as split_lines
from asynctorchx.logs._query import to_timestamp as to_timestamp
from asynctorchx.specs.api import (
    NONE,
    AppDef,
    AppDryRunInfo,
    AppState,
    AppStatus,
    CfgVal,
    Role,
    RoleStatus,
    copy_app,
    runopts,
    validate_app,
)
from asynctorchx.specs.workspace import Workspace

if TYPE_CHECKING:
    from asynctorchx.schedulers.workspace import WorkspacePlan

logger = logging.getLogger(__name__)

T = TypeVar("T")

ChangeCallback = Callable[[str], None]


@dataclass
class DescribeAppResponse:
    """What a scheduler knows about one app.

    Args:
        app_id: the app's id on its scheduler.
        state: the app's state.
        num_restarts: how many restarts happened (-1 when the backend cannot tell).
        msg: a human-readable message.
        structured_error_msg: a JSON error (torchelastic format) or NONE.
        ui_url: where to look at the app in a UI.
        roles_statuses: per-role replica statuses.
        roles: the app's roles as submitted (when the backend can recover them).
        name: the app's name as submitted, when known.
        metadata: the app's ``AppDef.metadata`` as submitted (when the backend can recover it).
    """

    app_id: str = "<NOT_SET>"
    state: AppState = AppState.UNSUBMITTED
    num_restarts: int = -1
    msg: str = NONE
    structured_error_msg: str = NONE
    ui_url: str | None = None
    roles_statuses: list[RoleStatus] = field(default_factory=list)
    roles: list[Role] = field(default_factory=list)
    name: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_status(self) -> AppStatus:
        """The ``AppStatus`` view of this response."""
        return AppStatus(
            state=self.state,
            num_restarts=self.num_restarts,
            msg="" if self.msg == NONE else self.msg,
            structured_error_msg=self.structured_error_msg,
            ui_url=self.ui_url,
            roles=self.roles_statuses,
        )


@dataclass(frozen=True)
class ListAppResponse:
    """One app in a scheduler's listing.

    Args:
        app_id: the app's id on its scheduler.
        state: its state.
        app_handle: its handle ``{scheduler}://{session}/{app_id}``.
        name: the app's name, when known.
    """

    app_id: str
    state: AppState
    app_handle: str = "<NOT_SET>"
    name: str = ""


class UnknownRoleException(ValueError):
    """Raised when an app has no role of the given name, or the replica index is out of range."""


class WorkspaceNotSupportedException(ValueError):
    """Raised when a workspace is given to a scheduler that cannot ship one (the message names it)."""


class Scheduler(abc.ABC, Generic[T]):
    """An async scheduler backend. ``T`` is the type of its dry-run request.

    Args:
        backend: the name the scheduler is registered under (e.g. ``local_cwd``).
        session_name: the session (runner name) that owns the apps submitted through this object.
    """

    #: True when the backend calls ``_notify`` on changes, so the runner need not poll it often.
    pushes_changes: ClassVar[bool] = False
    #: True when the backend can ship a workspace (see ``plan_workspace``).
    supports_workspace: ClassVar[bool] = False

    def __init__(self, backend: str, session_name: str) -> None:
        self.backend = backend
        self.session_name = session_name
        self._listeners: list[ChangeCallback] = []
        self._closed = False

    # -- options and dry runs (pure) ------------------------------------------------------------

    def run_opts(self) -> runopts:
        """The run options (cfg keys) this scheduler accepts."""
        return self._run_opts()

    def _run_opts(self) -> runopts:
        return runopts()

    def submit_dryrun(
        self,
        app: AppDef,
        cfg: Mapping[str, CfgVal],
        workspace: Workspace | str | None = None,
    ) -> AppDryRunInfo[T]:
        """Builds the request that ``schedule`` would submit. Pure: nothing is created or started.

        ``app`` is validated, ``cfg`` resolved against ``run_opts()``; neither is modified. With a
        ``workspace`` the dry run also holds the workspace plan (``info.workspace``): the
        workspace's files are read and hashed here (this blocks; async code uses
        ``submit_dryrun_async``), but nothing is built, pushed or copied.

        Raises:
            InvalidAppDefException: a field of the app is bad (names the role, field and value).
            InvalidRunConfigException: the cfg does not satisfy the run options.
            InvalidWorkspaceException: the workspace cannot be used (names it and why).
            WorkspaceNotSupportedException: this backend ships no workspace.
        """
        validate_app(app)
        resolved = self.run_opts().resolve(cfg)
        ws = Workspace.of(workspace)
        plan = None if ws is None else self.plan_workspace(app, resolved, ws)
        return self._finish_dryrun(app, resolved, plan)

    async def submit_dryrun_async(
        self,
        app: AppDef,
        cfg: Mapping[str, CfgVal],
        workspace: Workspace | str | None = None,
    ) -> AppDryRunInfo[T]:
        """``submit_dryrun`` that reads the workspace (if any) off the event loop."""
        validate_app(app)
        resolved = self.run_opts().resolve(cfg)
        ws = Workspace.of(workspace)
        plan = None if ws is None else await self.plan_workspace_async(app, resolved, ws)
        return self._finish_dryrun(app, resolved, plan)

    def _finish_dryrun(
        self, app: AppDef, resolved: Mapping[str, CfgVal], plan: WorkspacePlan | None
    ) -> AppDryRunInfo[T]:
        own = copy_app(app)
        if plan is None:
            info = self._submit_dryrun(own, resolved)
        else:
            info = self._submit_dryrun_workspace(own, resolved, plan)
        for role in own.roles:
            info = role.pre_proc(self.backend, info)
        if plan is None:
            info._app = app
        else:
            shown = copy_app(app)
            self._apply_workspace(shown, plan)
            info._app = shown
        info._cfg = resolved
        info._scheduler = self.backend
        info._session = self.session_name
        info._workspace = plan
        return info

    def plan_workspace(
        self, app: AppDef, cfg: Mapping[str, CfgVal], workspace: Workspace
    ) -> WorkspacePlan:
        """What this backend will do with ``workspace`` for ``app`` (called by ``submit_dryrun``).

        Reads the workspace (it blocks) but creates nothing. Backends that ship workspaces
        override it (and set ``supports_workspace``).

        Raises:
            WorkspaceNotSupportedException: this backend ships no workspace.
        """
        raise WorkspaceNotSupportedException(
            f"the {self.backend} scheduler does not support workspaces (got workspace "
            f"{str(workspace)!r}); run without one, or use a scheduler that ships them"
        )

    async def plan_workspace_async(
        self, app: AppDef, cfg: Mapping[str, CfgVal], workspace: Workspace
    ) -> WorkspacePlan:
        """``plan_workspace`` run in a worker thread, so the event loop never waits on the disk."""
        if not self.supports_workspace:
            return self.plan_workspace(app, cfg, workspace)
        from asynctorchx.schedulers.workspace import run_in_thread

        return await run_in_thread(self.plan_workspace, app, cfg, workspace)

    def _apply_workspace(self, app: AppDef, plan: WorkspacePlan) -> None:
        """Points the roles that get the workspace at its target (their image)."""
        for role in app.roles:
            if role.name in plan.roles:
                role.image = plan.target

    def _submit_dryrun_workspace(
        self, app: AppDef, cfg: Mapping[str, CfgVal], plan: WorkspacePlan
    ) -> AppDryRunInfo[T]:
        """The request for an app whose roles run from a workspace (default: the roles' images
        become the plan's target, then ``_submit_dryrun``)."""
        self._apply_workspace(app, plan)
        return self._submit_dryrun(app, cfg)

    @abc.abstractmethod
    def _submit_dryrun(self, app: AppDef, cfg: Mapping[str, CfgVal]) -> AppDryRunInfo[T]:
        """Builds the request for a validated copy of the app and a resolved cfg."""

    # -- the app lifecycle (async) --------------------------------------------------------------

    @abc.abstractmethod
    async def schedule(self, dryrun_info: AppDryRunInfo[T]) -> str:
        """Submits a dry run's request and returns the new app's id.

        A failed submit raises and leaves nothing running.
        """

    async def submit(
        self, app: AppDef, cfg: Mapping[str, CfgVal], workspace: Workspace | str | None = None
    ) -> str:
        """``schedule(submit_dryrun(app, cfg, workspace))``."""
        if workspace is None:
            return await self.schedule(self.submit_dryrun(app, cfg))
        return await self.schedule(await self.submit_dryrun_async(app, cfg, workspace))

    @abc.abstractmethod
    async def describe(self, app_id: str) -> DescribeAppResponse | None:
        """What the scheduler knows of the app, or None when it does not know the app."""

    async def describe_many(self, app_ids: Sequence[str]) -> dict[str, DescribeAppResponse | None]:
        """``describe`` for many apps at once.

        This default runs at most 16 ``describe`` calls concurrently; backends that can answer for
        many apps in one round trip (one ``squeue``, one container listing) override it.
        """
        results: dict[str, DescribeAppResponse | None] = {}
        limiter = anyio.CapacityLimiter(16)

        async def one(app_id: str) -> None:
            async with limiter:
                results[app_id] = await self.describe(app_id)

        async with anyio.create_task_group() as tg:
            for app_id in dict.fromkeys(app_ids):
                tg.start_soon(one, app_id)
        return results

    async def exists(self, app_id: str) -> bool:
        """True when the scheduler knows the app (in any state)."""
        return await self.describe(app_id) is not None

    async def cancel(self, app_id: str) -> None:
        """Asks the scheduler to stop the app; returns without waiting for it to end.

        Idempotent: cancelling an app that is unknown or already finished does nothing. The first
        cancel of a running app is a stop the user asked for: the app ends CANCELLED.

        Every backend goes through this template (as TorchX's do): ``exists``, then
        ``_cancel_existing``. A backend makes ``exists`` cheap rather than overriding ``cancel``.
        """
        if await self.exists(app_id):
            await self._cancel_existing(app_id)

    @abc.abstractmethod
    async def _cancel_existing(self, app_id: str) -> None:
        """Stops an app ``exists`` just found (it may have ended since: then nothing happens)."""

    @abc.abstractmethod
    async def list(self) -> list[ListAppResponse]:
        """The apps this scheduler knows (as far as it keeps them)."""

    #: The streams ``log_iter`` can read; COMBINED (the default) is everything the replica wrote,
    #: both streams in the order they arrived.
    log_streams: ClassVar[frozenset[Stream]] = ALL_STREAMS

    #: What a log cursor of this backend holds (see ``logs/_cursor.py``); None: the backend
    #: cannot resume a log, and ``log_entries`` or a ``cursor`` raise NotImplementedError.
    log_cursor_kind: ClassVar[CursorKind | None] = None

    def log_iter(
        self,
        app_id: str,
        role_name: str,
        k: int = 0,
        regex: str | re.Pattern[str] | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        should_tail: bool = False,
        streams: Stream | None = None,
        *,
        cursor: str | None = None,
    ) -> AsyncIterator[str]:
        """The log lines of replica ``k`` of ``role_name``, each ending with its ``\\n``.

        The arguments are checked here, the same way for every backend (``LogQuery.build``), and
        the backend reads (``_log_iter``). An argument error raises at this call; that the app,
        role and replica exist is found out by reading, so those errors raise at the first
        iteration.

        Args:
            regex: only lines matching it (``re.search``): a pattern string, or a compiled
                ``re.Pattern[str]`` (its flags kept, as TorchX's ``re.compile(regex)`` keeps them).
            since: only lines written at or after this time (naive = local time).
            until: only lines written at or before this time.
            should_tail: follow the log until the app is terminal, then drain what is left and stop;
                otherwise return what exists now.
            streams: which output to read; by default (None, or COMBINED) everything the replica
                wrote, in the order it arrived.
            cursor: resume exactly after the line this cursor was taken at (``log_entries``
                gives each line's cursor); it must come from the same app, role, replica and
                ``streams``. The other arguments apply to what follows it.

        Raises:
            ValueError: a stream this backend cannot read (``log_streams``), an invalid regex,
                ``since`` after ``until``, a negative ``k``, or a malformed cursor or one taken
                on another app, role, replica or stream selection.
            TypeError: an argument of the wrong type.
            NotImplementedError: a cursor for a backend that cannot resume logs.
            UnknownAppException: (when iterated) no such app.
            UnknownRoleException: (when iterated) no such role, or no replica ``k``.
        """
        query = self._log_query(
            app_id, role_name, k, regex, since, until, should_tail, streams, cursor
        )
        if query.after is not None:
            return lines_of(self._log_entries(query))
        return self._log_iter(query)

    def log_entries(
        self,
        app_id: str,
        role_name: str,
        k: int = 0,
        regex: str | re.Pattern[str] | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        should_tail: bool = False,
        streams: Stream | None = None,
        *,
        cursor: str | None = None,
    ) -> AsyncIterator[LogEntry]:
        """Like ``log_iter``, with each line's cursor: ``LogEntry(cursor, line)`` pairs.

        Passing an entry's ``cursor`` to ``log_iter``/``log_entries`` (same app, role, replica
        and ``streams``) resumes exactly after its line: no line repeated, none skipped, also
        while the app still writes. Cursors are opaque strings (safe in URLs and HTTP headers).

        Raises:
            NotImplementedError: the backend cannot resume logs (``log_cursor_kind`` is None).
            ValueError, TypeError: as ``log_iter``.
        """
        if self.log_cursor_kind is None:
            raise NotImplementedError(f"the {self.backend} scheduler does not support log cursors")
        query = self._log_query(
            app_id, role_name, k, regex, since, until, should_tail, streams, cursor
        )
        return self._entries(query, self.log_cursor_kind)

    def _log_query(
        self,
        app_id: str,
        role_name: str,
        k: int,
        regex: str | re.Pattern[str] | None,
        since: datetime | None,
        until: datetime | None,
        should_tail: bool,
        streams: Stream | None,
        cursor: str | None,
    ) -> LogQuery:
        return LogQuery.build(
            self.backend,
            self.log_streams,
            app_id,
            role_name,
            k,
            regex,
            since,
            until,
            should_tail,
            streams,
            cursor,
            self.log_cursor_kind,
        )

    async def _entries(self, query: LogQuery, kind: CursorKind) -> AsyncIterator[LogEntry]:
        encode = CursorEncoder(query.app_id, query.role, query.k, query.stream.value, kind)
        entries = self._log_entries(query)
        async with contextlib.aclosing(entries):
            async for position, line in entries:
                yield LogEntry(encode(position), line)

    def _log_iter(self, query: LogQuery) -> AsyncIterator[str]:
        """The backend's part of ``log_iter``: an async generator of the lines ``query`` asks for.

        It raises UnknownAppException/UnknownRoleException from its first iteration.
        ``query.after`` is always None here: a resumed read goes to ``_log_entries``.
        """
        raise NotImplementedError(f"the {self.backend} scheduler does not read logs")

    def _log_entries(self, query: LogQuery) -> AsyncGenerator[tuple[Position, str], None]:
        """The backend's part of ``log_entries``: ``(position, line)`` pairs, starting after
        ``query.after`` when set (its position has this backend's ``log_cursor_kind`` shape).

        Implemented by every backend whose ``log_cursor_kind`` is set.
        """
        raise NotImplementedError(f"the {self.backend} scheduler does not support log cursors")

    async def close(self) -> None:
        """Releases what the scheduler holds (clients, background tasks). Idempotent."""
        self._closed = True

    async def __aenter__(self) -> Scheduler[T]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- pushed changes --------------------------------------------------------------------------

    def subscribe(self, callback: ChangeCallback) -> Callable[[], None]:
        """Registers ``callback(app_id)`` to be called when an app may have changed.

        Called from the event loop; the callback must not block. Returns a function that unsubscribes.
        """
        self._listeners.append(callback)

        def unsubscribe() -> None:
            if callback in self._listeners:
                self._listeners.remove(callback)

        return unsubscribe

    def _notify(self, app_id: str) -> None:
        for callback in list(self._listeners):
            try:
                callback(app_id)
            except Exception:
                logger.exception("change listener failed for app %s", app_id)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} backend={self.backend!r} session={self.session_name!r}>"


# -- helpers shared by backends ------------------------------------------------------------------


def check_replica(
    app_id: str, replicas_per_role: Mapping[str, int], role_name: str, k: int
) -> None:
    """Raises UnknownRoleException unless ``role_name`` exists and ``0 <= k < its replicas``."""
    if role_name not in replicas_per_role:
        known = ", ".join(sorted(replicas_per_role)) or "none"
        raise UnknownRoleException(f"app {app_id!r} has no role {role_name!r} (roles: {known})")
    n = replicas_per_role[role_name]
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < n:
        raise UnknownRoleException(
            f"replica k={k!r} is out of range for role {role_name!r} of app {app_id!r} ({n} replicas)"
        )


def role_replica_counts(roles: Iterable[Role]) -> dict[str, int]:
    """``{role name: num_replicas}`` for ``roles``."""
    return {r.name: r.num_replicas for r in roles}
