"""The ``local_docker`` backend: every replica a Docker container, driven through aiodocker.

How an app maps onto Docker:

- Each replica is a container named (and hostnamed) ``{app_id}-{role}-{replica}``. An app with more
  than one container gets a network of its own, ``asynctorchx-{app_id}``, on which every replica
  reaches the others by hostname; ``TORCHX_RANK0_HOST`` holds the hostname of rank 0. A
  single-container app runs on Docker's default bridge (the ``network`` run option picks an
  existing network instead).
- Labels on the containers carry the app's id, session, shape and retry settings, so that any
  process (not only the launcher) can describe, list, cancel and read the logs of any app: apps
  outlive the process that launched them. An app id Docker has no container for is unknown
  (``describe`` returns None) unless it is being submitted (PENDING); it is never reported as
  SUCCEEDED. Each container also names the process that created it to start it: a replica never
  started by a launcher that has exited (killed mid-submit) fails the app, which would otherwise
  stay PENDING for good (judged on the launcher's host only, see ``_docker/processes.py``).
- Status is one container listing by label for any number of apps (none while Docker's event
  stream vouches for the last one); changes are pushed by one subscription to ``/events``.
- Retries: a REPLICA retry policy is Docker's own ``on-failure`` restart policy; ROLE and
  APPLICATION retries are done by the backend, which recreates the role's (or app's) containers as
  a new attempt, under the same hostnames. A replica failing with no retry left fails the app, and
  the backend stops the app's other replicas; the app's message names the replica that failed
  first (by the engine's exit times), never one the backend stopped after it. These follow-ups
  (and removing a finished app's network, or its containers with ``remove_finished``) are driven
  by Docker's events, in one task per app; a status read (``describe``, ``list``) never changes anything.
- Cancel stops every container (SIGTERM, then SIGKILL after the app's ``stop_timeout``) and leaves
  a never-started marker container, so that every process sees the app as CANCELLED. It returns
  once the marker exists and the engine has the stops under way (``_docker/stops.py``): the
  escalation is the engine's, and a task of the scheduler waits for it (``close`` lets it finish).
  Until a submit has created the app's containers, a launch claim (a volume named after the app)
  names it for every process (PENDING, "being submitted"); a cancel then removes the claim, and the
  launch, which removes it itself once its containers exist, starts nothing if it finds it gone
  (the cancel leaves a record in the claim's place, so that the app reads CANCELLED meanwhile).
  What a launcher killed before its containers existed left (its claim, its network) is removed
  by the process that finds it gone: a describe of the app, or any scheduler's first connection.
  After that the submit looks for the marker before the starts, after rank 0 and after the last
  start, and stops there. Each container is stopped once (a second SIGTERM would run its handler
  again): by the process that made the marker if it started before the marker, else by the launch
  (or retry) that started it; other cancellers and the follow-ups stop nothing, unless the
  marker's maker has exited without doing so (``_docker/cancel.py``: then one process takes over).
- Clean-up an engine outage cut off is owed, not dropped: the purge of a failed submit (the
  app then reads unknown here, as a failed submit does) and the stops of a cancel are done again
  by the app's follow-up once the engine answers (the event stream reconnects, or a status read
  succeeds while it is not followed); a second ``cancel`` of the app finishes its stops, and a
  new submit of the same dry run finishes its purge first. A ROLE/APPLICATION retry the engine
  refuses fails the app for every process (``_docker/actions.py``).
- Logs come from the Docker API: stdout and stderr kept apart (COMBINED: in arrival order), long
  lines joined back, ``since``/``until`` per line, a dropped follow stream resumed by timestamp.

The parts: ``_docker/request.py`` builds the requests (pure), ``_docker/state.py`` assesses an app
from its containers (pure: the status and the follow-ups owed), ``_docker/engine.py`` is the only
caller of aiodocker, ``_docker/events.py`` follows the events, ``_docker/actions.py`` does the
follow-ups, ``_docker/launch.py`` submits, and ``_docker/logs.py`` reads logs.

Requires the ``docker`` extra: ``pip install 'asynctorchx[docker]'``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from asynctorchx._tasks import TaskSupervisor, await_shielded
from asynctorchx.logs._cursor import Position, lines_of
from asynctorchx.logs._query import LogQuery
from asynctorchx.logs._timestamps import parse_rfc3339_ns
from asynctorchx.schedulers._docker.actions import FollowUps, started_after
from asynctorchx.schedulers._docker.cancel import (
    abandoned_cancel,
    own_stops_owed,
    take_over_if_abandoned,
    turn,
)
from asynctorchx.schedulers._docker.engine import (
    DockerEngine,
    DockerEngineUnavailableError,
    DockerSchedulerError,
)
from asynctorchx.schedulers._docker.events import EventFeed
from asynctorchx.schedulers._docker.image import ensure_image, plan_image
from asynctorchx.schedulers._docker.launch import CancelWatch, ClaimTakenError, Launcher
from asynctorchx.schedulers._docker.logs import DockerLogSource
from asynctorchx.schedulers._docker.processes import (
    dead_launches,
    process_gone,
    process_identity,
)
from asynctorchx.schedulers._docker.request import (
    KIND_LAUNCH_CANCELLED,
    KIND_LAUNCH_CLAIM,
    LABEL_APP_ID,
    LABEL_CANCELLER,
    LABEL_KIND,
    LABEL_LAUNCHER,
    DockerJob,
    build_job,
    cancel_marker,
    cancel_record,
    cancel_record_name,
    claim_name,
    is_app_id,
    run_options,
)
from asynctorchx.schedulers._docker.state import (
    Assessment,
    ContainerInfo,
    assess,
    dead_launch,
    group_by_app,
    restarted_by_docker,
)
from asynctorchx.schedulers._docker.stops import stop_all
from asynctorchx.schedulers._reconcile import CallsUnderWay, Reconciler, finish_shielded
from asynctorchx.schedulers.api import DescribeAppResponse, ListAppResponse, Scheduler
from asynctorchx.schedulers.workspace import (
    SingleFlight,
    WorkspacePlan,
    current_progress,
    run_in_thread,
)
from asynctorchx.specs.api import (
    LINUX_PID_MAX_LIMIT,
    AppDef,
    AppDryRunInfo,
    AppState,
    CfgVal,
    check_replica_count,
    is_terminal,
    make_app_handle,
    make_unique,
    runopts,
)
from asynctorchx.specs.workspace import Workspace

if TYPE_CHECKING:
    import aiodocker

__all__ = [
    "DockerEngineUnavailableError",
    "DockerJob",
    "DockerScheduler",
    "DockerSchedulerError",
    "create_scheduler",
]

logger = logging.getLogger(__name__)

#: how long ``close`` waits for the submits, the cancels and the follow-ups under way (a stop
#: waits up to ``stop_timeout``)
_CLOSE_GRACE = 30.0
#: The exit code of a container killed by SIGKILL: by ``docker kill``, a stop's timeout, or the
#: kernel's OOM killer (which only an inspect tells apart).
OOM_EXIT = 137
#: How many exited containers' inspections (OOM verdict, exit time) are remembered.
_REMEMBERED_EXITS = 4096


class DockerScheduler(Scheduler[DockerJob]):
    """Runs apps as Docker containers on one Docker engine.

    Args:
        session_name: the session (runner name) the apps are launched for.
        client: an ``aiodocker.Docker`` (or a fake with the same interface) to use; the scheduler
            then does not close it. By default one is created on first use and closed by ``close``.
        docker_host: the engine's address (e.g. ``unix:///var/run/docker.sock``) when no client is
            given; defaults to aiodocker's resolution (``DOCKER_HOST``, then the local socket).
        watch_events: follow Docker's event stream to push changes and drive the follow-ups (turn
            off only for tests).
    """

    pushes_changes = True
    log_cursor_kind = "docker"
    supports_workspace = True

    def __init__(
        self,
        session_name: str,
        client: aiodocker.Docker | Any | None = None,
        *,
        docker_host: str | None = None,
        watch_events: bool = True,
    ) -> None:
        super().__init__("local_docker", session_name)
        self._engine = DockerEngine(client, docker_host=docker_host)
        self._tasks = TaskSupervisor(f"local_docker:{session_name}")
        self._flights = SingleFlight(self._tasks)
        self._reconciler = Reconciler(self._tasks, self._follow_up, self.backend)
        self._events = EventFeed(
            self._engine,
            self._tasks,
            on_change=self._notify,
            on_follow_up=self._reconciler.request,
            on_connect=self._retry_owed,
            enabled=watch_events,
        )
        self._follow_ups = FollowUps(
            self._engine, self._events.app_containers, inspect=self._with_inspections
        )
        self._launcher = Launcher(self._engine, self._tasks, self._events)
        self._submits = CallsUnderWay()  # close() lets them finish
        self._launches: dict[str, CancelWatch] = {}  # the submits under way, by app id
        # the cancels under way, by app id: resolved once their stops are under way (or with the
        # error that kept them from it), and the task that goes on until the containers stopped
        self._cancels: dict[str, tuple[asyncio.Future[None], asyncio.Task[None]]] = {}
        # Clean-up an outage (or a refusal) cut off, done again by the app's follow-up once the
        # engine answers (see ``_settle_owed``): failed submits to purge (the job, and whether
        # it had begun creating things: else only its claim is to go), by app id; cancels of
        # this process whose stops failed, with when they failed; follow-ups cut off.
        self._owed_purges: dict[str, tuple[DockerJob, bool]] = {}
        self._owed_stops: dict[str, float] = {}
        self._owed_looks: set[str] = set()
        self._owed_locks: dict[str, tuple[asyncio.Lock, int]] = {}  # one settler per app
        # what an inspect of an exited container said (OOM killed?, when it exited), by id
        self._exits: dict[str, tuple[bool, int | None]] = {}
        self._logs = DockerLogSource(
            self._engine, self._events.containers, self._events.wait_app, self._handle
        )

    @property
    def engine(self) -> DockerEngine:
        """The Docker engine this scheduler drives."""
        return self._engine

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the local_docker scheduler is closed")

    def _handle(self, app_id: str) -> str:
        return make_app_handle(self.backend, self.session_name, app_id)

    # -- options, dry runs and workspaces (pure, or reads only) ---------------------------------

    def _run_opts(self) -> runopts:
        return run_options()

    def _submit_dryrun(self, app: AppDef, cfg: Mapping[str, CfgVal]) -> AppDryRunInfo[DockerJob]:
        check_replica_count(
            app,
            self.backend,
            LINUX_PID_MAX_LIMIT,
            "each replica is a container, at least one process of the Docker host, and a Linux "
            f"host runs at most {LINUX_PID_MAX_LIMIT} (the kernel's PID_MAX_LIMIT)",
        )
        job = build_job(
            app,
            cfg,
            app_id=make_unique(app.name),
            session_name=self.session_name,
            environ=os.environ,
        )
        return AppDryRunInfo(job, str)

    def plan_workspace(
        self, app: AppDef, cfg: Mapping[str, CfgVal], workspace: Workspace
    ) -> WorkspacePlan:
        """The workspace image of the first role (see ``asynctorchx.schedulers._docker.image``).

        Reads and hashes the workspace and asks the engine for the base image's id; builds
        nothing.
        """
        base_id = self._engine.image_id_blocking(app.roles[0].image)
        return plan_image(self.backend, app, workspace, base_id)

    async def plan_workspace_async(
        self, app: AppDef, cfg: Mapping[str, CfgVal], workspace: Workspace
    ) -> WorkspacePlan:
        """``plan_workspace`` with the engine asked from the event loop, the files read in a
        worker thread."""
        base_id = await self._engine.image_id(app.roles[0].image)
        return await run_in_thread(plan_image, self.backend, app, workspace, base_id)

    # -- submitting -----------------------------------------------------------------------------

    async def schedule(self, dryrun_info: AppDryRunInfo[DockerJob]) -> str:
        """Creates the app's network and containers, then starts them; returns the app id.

        A dry run made with a workspace first gets its image built (unless its tag exists).
        An app cancelled meanwhile (from any process) is left CANCELLED: nothing more of it is
        created or started, what was started is stopped, and its id is returned.

        Raises:
            WorkspaceBuildError: the workspace image did not build (nothing was created).
            DockerSchedulerError: an image cannot be had, a volume or network does not exist, or
                Docker refused a container. Whatever was created for the app is removed first.
            DockerEngineUnavailableError: the engine cannot be reached.
        """
        self._check_open()
        job = dryrun_info.request
        if job.app_id in self._launches:
            raise DockerSchedulerError(
                f"app {job.app_id!r} is being submitted already; a dry run can be scheduled only once"
            )
        if job.app_id in self._owed_purges:  # this dry run failed before: clean up first
            await finish_shielded(self._tasks, self._settle_owed(job.app_id), f"purge:{job.app_id}")
        watch = self._launches[job.app_id] = CancelWatch(self._engine, job.app_id)
        try:
            with self._submits.one():
                launched = await self._schedule(dryrun_info, watch)
        finally:
            del self._launches[job.app_id]
            watch.done.set()
            watch.released.set()
        if not launched:
            self._notify(job.app_id)
            self._reconciler.request(job.app_id)  # its network, once the app is CANCELLED
            return job.app_id
        logger.info("launched %s: %d container(s)", job.app_id, len(job.containers))
        return job.app_id

    async def _schedule(self, dryrun_info: AppDryRunInfo[DockerJob], watch: CancelWatch) -> bool:
        """``schedule``'s checks and launch; False when the app was cancelled meanwhile.

        The launch claim that names the app for other processes is made while the checks run
        (they create nothing), so it costs the submit no round trip of its own.
        """
        job = dryrun_info.request
        try:
            claimed, checked = await asyncio.gather(
                self._launcher.claim(job, uuid.uuid4().hex),
                self._checks(dryrun_info),
                return_exceptions=True,
            )
            for outcome in (claimed, checked):
                if isinstance(outcome, BaseException):
                    raise outcome
            self._check_open()  # closed during the checks: nothing was created
            await self._events.connected()  # its follow-ups are driven by the events from now on
        except ClaimTakenError:
            raise  # the claim is another launch's
        except BaseException:
            await self._clean_up_failed(job, created=False)
            raise
        try:
            return await self._launcher.launch(job, watch)
        except BaseException:
            await self._clean_up_failed(job, created=True)
            raise

    async def _clean_up_failed(self, job: DockerJob, *, created: bool) -> None:
        """Removes what a failed submit made: everything of the app once it had begun creating
        things (``created``), else its launch claim; runs to its end even if the caller is
        cancelled. When that fails (the engine cannot be reached), the clean-up is owed: done
        again once the engine answers (``_settle_owed``), and the app reads unknown meanwhile.
        """

        async def clean_up() -> None:
            try:
                await self._purge(job, created=created)
            except Exception as e:
                self._owed_purges[job.app_id] = (job, created)
                logger.warning(
                    "cleaning up after the failed submit of %s failed (%s); done once the "
                    "engine answers again",
                    job.app_id,
                    e,
                )

        await finish_shielded(self._tasks, clean_up(), f"purge:{job.app_id}")

    async def _purge(self, job: DockerJob, *, created: bool) -> None:
        if created:
            await self._launcher.purge(job.app_id, job.network_request)
        else:
            await self._launcher.unclaim(job)

    async def _checks(self, dryrun_info: AppDryRunInfo[DockerJob]) -> None:
        """The workspace image (built unless its tag exists), then ``Launcher.preflight``."""
        if dryrun_info.workspace is not None:
            await ensure_image(
                self._engine, dryrun_info.workspace, self._flights, current_progress()
            )
        await self._launcher.preflight(dryrun_info.request)

    # -- status (reads only) --------------------------------------------------------------------

    async def describe(self, app_id: str) -> DescribeAppResponse | None:
        """The app's status from its containers; None when Docker has no container of it (and
        it is not being submitted: then PENDING)."""
        return (await self.describe_many([app_id]))[app_id]

    async def describe_many(self, app_ids: Sequence[str]) -> dict[str, DescribeAppResponse | None]:
        """Describes many apps with one container listing (none when events vouch for them all)."""
        self._check_open()
        asked = list(dict.fromkeys(app_ids))
        ids = [app_id for app_id in asked if is_app_id(app_id)]  # others cannot name a container
        failed = [app_id for app_id in ids if self._failed_submit(app_id)]
        for app_id in failed:  # unknown, as once purged; its purge is tried again
            self._reconciler.request(app_id)
        ids = [app_id for app_id in ids if app_id not in failed]
        if not ids:
            return dict.fromkeys(asked)
        groups = self._events.snapshot(ids)
        if groups is None:
            listed = await self._events.containers(ids[0] if len(ids) == 1 else None, for_apps=ids)
            groups = group_by_app(listed)
            self._engine_answered()
        out: dict[str, DescribeAppResponse | None] = {}
        found: list[Assessment] = []
        for app_id in ids:
            assessment = assess(app_id, groups.get(app_id, []))
            if assessment is None:
                out[app_id] = self._follow_ups.removed(app_id)
            else:
                found.append(assessment)
        for assessment in await asyncio.gather(*(self._with_inspections(a) for a in found)):
            out[assessment.response.app_id] = assessment.response
            if abandoned_cancel(assessment) or dead_launch(assessment):
                # No event says that a process died: its follow-up finishes what it left.
                self._reconciler.request(assessment.response.app_id)
        unknown = [app_id for app_id, r in out.items() if r is None]
        if unknown:
            launching = await self._being_launched(unknown)
            missed = [app_id for app_id in unknown if app_id not in launching]
            if missed:
                # A launch may have made its containers, then removed its claim, between the
                # two listings: looked for again, they are there (it has no claim any more).
                one = missed[0] if len(missed) == 1 else None
                again = group_by_app(await self._events.containers(one, for_apps=missed))
                for app_id in missed:
                    late = assess(app_id, again.get(app_id, []))
                    if late is not None:
                        out[app_id] = late.response
            for app_id, kind in launching.items():
                out[app_id] = (
                    DescribeAppResponse(
                        app_id=app_id,
                        state=AppState.CANCELLED,
                        msg="cancelled before its containers were made",
                    )
                    if kind == KIND_LAUNCH_CANCELLED
                    else DescribeAppResponse(
                        app_id=app_id, state=AppState.PENDING, msg="being submitted"
                    )
                )
        return {app_id: out.get(app_id) for app_id in asked}

    def _failed_submit(self, app_id: str) -> bool:
        """True for an app whose submit failed here once it had made things, which are still to
        be removed (its purge is owed): it is unknown, as it will be once they are."""
        owed = self._owed_purges.get(app_id)
        return owed is not None and owed[1]

    async def _being_launched(self, app_ids: list[str]) -> dict[str, str]:
        """Those of ``app_ids`` (apps Docker has no container of) being submitted, by this
        process or by another (see ``_launch_claims``), with the kind of their volume."""
        here = {a: KIND_LAUNCH_CLAIM for a in app_ids if a in self._launches}
        elsewhere = [a for a in app_ids if a not in self._launches]
        if elsewhere:
            here.update(await self._launch_claims(elsewhere))
        return here

    async def _with_inspections(self, a: Assessment) -> Assessment:
        """Adds what only an inspect says: Docker's restart counts of replicas that Docker
        restarts itself (REPLICA policy), whether a replica that exited with 137 was killed for
        running out of memory, and, when more than one replica failed, when each exited (the
        first failure is the app's, not the survivors the backend stopped after it); and which
        replicas this process stopped as survivors of a failure. What an inspect of an exited
        container says is kept: it does not change."""
        failed = [c for c in a.current.values() if c.state == "exited" and c.exit_code]
        timed = {c.id for c in failed} if len(failed) > 1 else set()
        wanted = [
            c
            for c in a.current.values()
            if restarted_by_docker(c.labels)
            or (c.exit_code == OOM_EXIT and c.state == "exited")
            or c.id in timed
        ]
        survivors = [c for c in a.current.values() if self._follow_ups.stopped_survivor(c.id)]
        if not wanted and not survivors:
            return a

        wanted_ids = {c.id for c in wanted}

        async def inspect(c: ContainerInfo) -> ContainerInfo:
            c = dataclasses.replace(c, stopped_by_backend=self._follow_ups.stopped_survivor(c.id))
            if c.id not in wanted_ids:
                return c
            known = self._exits.get(c.id)
            if known is not None and not restarted_by_docker(c.labels):
                return dataclasses.replace(c, oom_killed=known[0], finished_at=known[1])
            try:
                info = await self._engine.inspect_container(c.id)
            except DockerSchedulerError:
                return c
            if info is None:
                return c
            state = info.get("State") or {}
            oom = c.exit_code == OOM_EXIT and bool(state.get("OOMKilled"))
            finished = _finished_at(state) if c.state == "exited" else None
            if c.state == "exited":
                self._exits[c.id] = (oom, finished)
                while len(self._exits) > _REMEMBERED_EXITS:
                    del self._exits[next(iter(self._exits))]
            restarts = int(info.get("RestartCount") or 0) if restarted_by_docker(c.labels) else -1
            return dataclasses.replace(
                c, restart_count=restarts, oom_killed=oom, finished_at=finished
            )

        todo = list({c.id: c for c in [*wanted, *survivors]}.values())
        updated = {c.id: c for c in await asyncio.gather(*(inspect(c) for c in todo))}
        containers = [updated.get(c.id, c) for c in a.containers]
        return assess(a.response.app_id, containers) or a

    async def exists(self, app_id: str) -> bool:
        """True when Docker has a container of the app (or this process removed them), or the
        app is being submitted (by this process, or by another: its launch claim is there)."""
        self._check_open()
        return (
            is_app_id(app_id)
            and not self._failed_submit(app_id)
            and (
                app_id in self._launches
                or bool(await self._events.containers(app_id))
                or self._follow_ups.removed(app_id) is not None
                or bool(await self._launch_claims([app_id]))
                # its launch may have made them, then removed its claim, between the two listings
                or bool(await self._events.containers(app_id))
            )
        )

    async def _launch_claims(self, app_ids: Sequence[str]) -> dict[str, str]:
        """Those of ``app_ids`` whose launch claim (``KIND_LAUNCH_CLAIM``), or the record a cancel
        left in its place (``KIND_LAUNCH_CANCELLED``, once the claim is gone), is there and whose
        launcher is not known to be gone (asked only for apps Docker has no container of: a
        launch that has not created them yet, see ``CancelWatch``). The claim of a submit that
        failed here, whose removal is owed, names no launch."""
        wanted = set(app_ids).difference(self._owed_purges)
        if not wanted:
            return {}
        label = f"{LABEL_APP_ID}={app_ids[0]}" if len(app_ids) == 1 else LABEL_APP_ID
        out: dict[str, str] = {}
        volumes = await self._engine.list_volumes(label)
        for app_id in wanted.intersection(dead_launches(volumes)):
            self._reconciler.request(app_id)  # its follow-up removes what that launch left
        for v in volumes:
            labels = dict(v.get("Labels") or {})
            kind, app_id = labels.get(LABEL_KIND), labels.get(LABEL_APP_ID, "")
            if (
                kind in (KIND_LAUNCH_CLAIM, KIND_LAUNCH_CANCELLED)
                and app_id in wanted
                and not process_gone(labels.get(LABEL_LAUNCHER, ""))
                and out.get(app_id) != KIND_LAUNCH_CLAIM  # the claim, until a cancel removes it
            ):
                out[app_id] = kind
        return out

    async def list(self) -> list[ListAppResponse]:
        """Every app with containers on this engine (any session), from one listing."""
        self._check_open()
        out = []
        listed = await self._events.containers()
        self._engine_answered()
        for app_id, containers in group_by_app(listed).items():
            a = assess(app_id, containers)
            if a is None or self._failed_submit(app_id):
                continue
            session = a.session or self.session_name
            handle = make_app_handle(self.backend, session, app_id)
            out.append(
                ListAppResponse(
                    app_id=app_id, state=a.response.state, app_handle=handle, name=a.name
                )
            )
        return out

    # -- follow-ups (driven by the event feed) --------------------------------------------------

    def subscribe(self, callback: Callable[[str], None]) -> Callable[[], None]:
        """Registers ``callback(app_id)``; starts following Docker's event stream if needed."""
        unsubscribe = super().subscribe(callback)
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop()
            self._events.ensure_running()
        return unsubscribe

    async def _follow_up(self, app_id: str) -> None:
        """The app's follow-up (the ``Reconciler``'s work): what an outage left owed first, then
        what its containers say it is owed (even if the first failed); cut off by an outage, it
        is owed itself."""
        errors: list[Exception] = []
        for step in (self._settle_owed, self._look_at):
            try:
                await step(app_id)
            except Exception as e:
                errors.append(e)
        if any(isinstance(e, DockerEngineUnavailableError) for e in errors):
            self._owed_looks.add(app_id)
        else:
            self._owed_looks.discard(app_id)
        if errors:
            raise errors[0]

    async def _look_at(self, app_id: str) -> None:
        a = await self._follow_ups.run(app_id)
        if a is not None and await take_over_if_abandoned(self._engine, a):
            logger.info("finished the cancel of %s: its canceller had exited", app_id)
        if (a is None and self._follow_ups.removed(app_id) is None) or (
            a is not None and any(c.launcher_gone for c in a.containers)
        ):
            await self._launcher.clear_dead(app_id, has_containers=a is not None)

    # -- clean-up owed after an outage -----------------------------------------------------------

    def _retry_owed(self) -> None:
        """Asks for the follow-up of every app owed a clean-up (the engine answers again)."""
        for app_id in dict.fromkeys([*self._owed_purges, *self._owed_stops, *self._owed_looks]):
            self._reconciler.request(app_id)

    def _engine_answered(self) -> None:
        """A listing succeeded: without the event stream to say that the engine is back, the
        owed clean-ups are tried again now."""
        if not self._events.live:
            self._retry_owed()

    @contextlib.asynccontextmanager
    async def _owed_turn(self, app_id: str) -> AsyncIterator[None]:
        """Held while settling what ``app_id`` is owed: one settler at a time per app."""
        lock, users = self._owed_locks.get(app_id, (asyncio.Lock(), 0))
        self._owed_locks[app_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._owed_locks[app_id]
            if users > 1:
                self._owed_locks[app_id] = (lock, users - 1)
            else:
                del self._owed_locks[app_id]

    async def _settle_owed(self, app_id: str, under_way: Callable[[], None] = lambda: None) -> None:
        """Does the clean-up an outage cut off for ``app_id``, if one is owed: the purge of its
        failed submit, the stops of this process's cancel (``under_way`` is called once they are
        under way, see ``_stop_containers``). Idempotent.

        Raises:
            DockerSchedulerError: it failed again (it stays owed).
        """
        if app_id not in self._owed_purges and app_id not in self._owed_stops:
            return
        async with self._owed_turn(app_id):
            owed = self._owed_purges.get(app_id)
            if owed is not None:
                job, created = owed
                await self._purge(job, created=created)
                del self._owed_purges[app_id]
                logger.info("removed what the failed submit of %s had left", app_id)
                self._notify(app_id)
            failed_at = self._owed_stops.get(app_id)
            if failed_at is not None:
                try:
                    await self._finish_stops(app_id, failed_at, under_way)
                except DockerSchedulerError:
                    self._owed_stops[app_id] = time.monotonic()  # its stops may have gone out
                    raise
                del self._owed_stops[app_id]
                logger.info("finished the cancel of %s", app_id)

    async def _finish_stops(
        self, app_id: str, failed_at: float, under_way: Callable[[], None]
    ) -> None:
        """Finishes this process's cancel of ``app_id`` whose stops failed at ``failed_at``:
        stops what its marker's maker owes (``own_stops_owed``), or, when the marker was never
        made, cancels from the start; an app that has ended, or whose marker another process
        made, is left alone."""
        a = assess(app_id, await self._events.containers(app_id))
        if a is None or is_terminal(a.response.state):
            return
        markers = [c for c in a.containers if c.is_marker]
        if not markers:
            await self._mark_and_stop(app_id, a, under_way)
            return
        first = min(markers, key=turn)
        if first.labels.get(LABEL_CANCELLER) != process_identity():
            return  # another process's cancel: the stops are its own
        owed = await own_stops_owed(self._engine, a, first, failed_at, on_wait=under_way)
        await self._stop_containers(app_id, owed, under_way)

    # -- cancel ---------------------------------------------------------------------------------

    async def _cancel_existing(self, app_id: str) -> None:
        """Marks the app cancelled and has the engine stop every container (SIGTERM, SIGKILL
        after its stop timeout); returns once the stops are under way, not once they have ended.

        The marker makes the app read CANCELLED from any process once nothing of it runs; a
        finished app keeps its state, and only the live containers it still owes a stop (the
        survivors of a failure nothing followed) are stopped. The cancel goes on as a task of the scheduler (``close`` lets
        it finish), waiting for the containers to stop; it runs even if the caller is cancelled
        meanwhile. A cancel of the app already under way here is joined, not repeated. Raises
        what kept the stops from being under way: the engine refused the marker, the listing or
        a stop (``stop_all``).

        An app this process is submitting is told so: still in its checks (pulling an image, say),
        it will create nothing but the cancel marker, and this returns at once; already creating
        its containers, this waits until the launch has stopped (it starts nothing more, and its
        stops are under way) or ended. An app another process is submitting is marked, so that its
        launch stops likewise.

        Stops cut off by an outage (DockerEngineUnavailableError) are owed: finished by the app's
        follow-up once the engine answers, or by cancelling again (``_settle_owed``).
        """
        self._check_open()
        self._events.ensure_running()  # its kill events tell when the stops are under way
        watch = self._launches.get(app_id)
        if watch is not None:
            watch.requested = True
            if not watch.launching:
                return
            await watch.released.wait()
            if not watch.done.is_set():
                return  # the launch marked the app, and the stops of what it started are under way
        joined = self._cancels.get(app_id)
        if joined is None:
            under_way = asyncio.get_running_loop().create_future()
            task = self._tasks.spawn(self._cancel(app_id, under_way), name=f"cancel:{app_id}")
            joined = self._cancels[app_id] = (under_way, task)
        await await_shielded(joined[0])

    async def _cancel(self, app_id: str, under_way: asyncio.Future[None]) -> None:
        """The cancel of ``app_id`` (a task): resolves ``under_way`` once its stops are under way,
        or with the error that kept them from it; a stop that fails after that is owed and
        logged (``_settle_owed`` finishes it once the engine answers)."""

        def started() -> None:
            if not under_way.done():
                under_way.set_result(None)

        try:
            await self._stop_app(app_id, started)
            started()  # nothing was left to stop, or the stops have ended
        except Exception as e:
            if not under_way.done():
                under_way.set_exception(e)
            else:
                logger.warning(
                    "the cancel of %s: stopping its containers failed (%s); done again once "
                    "the engine answers",
                    app_id,
                    e,
                )
        finally:
            if not under_way.done():  # cancelled: the scheduler closed meanwhile
                under_way.set_exception(
                    RuntimeError(f"the local_docker scheduler closed during the cancel of {app_id}")
                )
            if self._cancels.get(app_id, (None,))[0] is under_way:
                del self._cancels[app_id]

    async def _stop_app(self, app_id: str, under_way: Callable[[], None]) -> None:
        a = assess(app_id, await self._events.containers(app_id))
        if a is None:  # being launched by another process, which has made no container yet
            if await self._cancel_launch(app_id):
                self._notify(app_id)  # that launch now creates nothing but the marker
                return
            a = assess(app_id, await self._events.containers(app_id))  # made them meanwhile
            if a is None:
                return
        if is_terminal(a.response.state):
            # Ended, with live containers it still owes a stop when nothing followed its events
            # as it failed (its launcher killed, say): their follow-up, done now.
            owed = self._follow_ups.stops_owed(a)
            if owed:
                await self._stop_containers(app_id, owed, under_way)
            return
        if any(c.is_marker for c in a.containers):
            # Its canceller stops them (a second SIGTERM would run their handler again), unless
            # it died before it could, or it is this process and an outage cut its stops off.
            if app_id in self._owed_stops:
                await self._settle_owed(app_id, under_way)
            else:
                await take_over_if_abandoned(self._engine, a, on_wait=under_way)
            self._notify(app_id)
            return
        await self._mark_and_stop(app_id, a, under_way)

    async def _mark_and_stop(
        self, app_id: str, a: Assessment, under_way: Callable[[], None]
    ) -> None:
        """Makes the app's cancel marker, then stops the containers it owes (those started
        before it). A failure from the marker on leaves the stops owed (``_settle_owed``)."""
        marker = cancel_marker(
            app_id, a.name, a.session, a.containers[0].image, canceller=process_identity()
        )
        try:
            made = await self._engine.create_container(
                marker.config, marker.name, what=f"marking {app_id} as cancelled", exist_ok=True
            )
            if made is None:  # another canceller made it first: the stops are its to do
                self._notify(app_id)
                return
            # Listed again after the marker: a launch under way looks for the marker after its
            # starts, so a container it started before the marker is in this listing (those
            # started after it are the launch's to stop: see ``started_after``).
            listed = assess(app_id, await self._events.containers(app_id))
            alive = [
                c.id for c in (listed.containers if listed else []) if c.alive and not c.is_record
            ]
            if alive:
                after = await started_after(self._engine, made, alive)
                alive = [c for c, later in zip(alive, after, strict=True) if later is not True]
            await self._stop_containers(app_id, alive, under_way)
        except DockerSchedulerError:
            self._owed_stops[app_id] = time.monotonic()
            raise

    async def _stop_containers(
        self, app_id: str, alive: Sequence[str], under_way: Callable[[], None] = lambda: None
    ) -> None:
        """Stops ``alive`` (containers of a cancelled app this process owes a stop), and waits
        until the engine has recorded their exits; ``under_way`` is called as soon as every stop
        is under way in the engine with none refused (``stop_all``).

        Raises:
            DockerSchedulerError: a stop failed (the first failure, naming the app).
        """
        results = await stop_all(self._engine, self._events, self._tasks, alive, under_way)
        # Inspecting waits until the engine has recorded each exit, so the listing shows it.
        await asyncio.gather(
            *(self._engine.inspect_container(c) for c in alive), return_exceptions=True
        )
        self._notify(app_id)
        self._reconciler.request(app_id)  # the network of the app, once it is CANCELLED
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            raise type(errors[0])(f"stopping the containers of {app_id}: {errors[0]}")

    async def _cancel_launch(self, app_id: str) -> bool:
        """Cancels the launch of an app another process is submitting and has made no container
        of yet, by removing its launch claim; False when there was none (any more).

        A record of the cancel is made first (the claim's labels, another kind), so that from the
        claim's removal on every process reads the app CANCELLED, not unknown, until the launch
        makes the cancel marker and removes the record. When the claim was removed by someone
        else, the record is removed again if the launch had committed (its containers exist),
        and left for the launch to remove if another cancel came first.
        """
        volumes = await self._engine.list_volumes(f"{LABEL_APP_ID}={app_id}")
        claim = next((v for v in volumes if v.get("Name") == claim_name(app_id)), None)
        if claim is None:
            return False
        labels = {str(k): str(v) for k, v in (claim.get("Labels") or {}).items()}
        if labels.get(LABEL_KIND) != KIND_LAUNCH_CLAIM or labels.get(LABEL_APP_ID) != app_id:
            return False
        await self._engine.create_volume(cancel_record(labels))
        if await self._engine.remove_volume(claim_name(app_id)):
            return True
        if await self._events.containers(app_id):
            await self._engine.remove_volume(cancel_record_name(app_id))
        return False

    # -- logs and lifecycle ---------------------------------------------------------------------

    def _log_iter(self, query: LogQuery) -> AsyncIterator[str]:
        """Lines of every attempt of the replica, oldest first (see ``_docker/logs.py``)."""
        return lines_of(self._logs.entries(query))

    def _log_entries(self, query: LogQuery) -> AsyncGenerator[tuple[Position, str], None]:
        """The lines with their containers' cursors (see ``DockerLogSource.entries``)."""
        return self._logs.entries(query)

    async def close(self) -> None:
        """Finishes the launches, cancels and follow-ups under way (bounded), stops the event
        stream, closes an owned client. Apps keep running: containers outlive the scheduler; those
        of an app cancelled here have stopped (the engine killed them after their stop timeout)
        unless that takes longer than the bound, and then the engine still goes on with the stop.

        A submit still checking its images, volumes and network then raises "closed" without
        creating anything; one already creating its containers completes.
        """
        if self._closed:
            return
        self._closed = True
        await self._submits.finished(_CLOSE_GRACE)
        # the cancels under way: the containers the user cancelled are stopped before the end
        cancels = [task for _, task in self._cancels.values()]
        if cancels:
            await asyncio.wait(cancels, timeout=_CLOSE_GRACE)
        self._retry_owed()  # a last try at what an outage left owed
        await self._reconciler.drain(_CLOSE_GRACE)
        left = sorted({*self._owed_purges, *self._owed_stops})
        if left:
            logger.warning(
                "closing with clean-ups an engine outage left undone (apps %s): a failed "
                "submit's containers, network or claim, or a cancel's stops",
                ", ".join(left),
            )
        await self._tasks.aclose()
        await self._engine.close()


def _finished_at(state: Mapping[str, Any]) -> int | None:
    """When an exited container exited (its inspect's ``State.FinishedAt``), in nanoseconds since
    the epoch; None when that cannot be read."""
    value = state.get("FinishedAt")
    try:
        return parse_rfc3339_ns(str(value)) if value else None
    except ValueError:
        return None


def create_scheduler(
    session_name: str,
    client: aiodocker.Docker | Any | None = None,
    docker_host: str | None = None,
    **kwargs: Any,
) -> DockerScheduler:
    """Creates the ``local_docker`` scheduler (unknown keyword arguments are ignored).

    Args:
        session_name: the session the apps are launched for.
        client: an ``aiodocker.Docker`` to use instead of creating one.
        docker_host: the engine's address when no client is given.
    """
    watch_events = kwargs.get("watch_events", True)
    return DockerScheduler(
        session_name, client, docker_host=docker_host, watch_events=bool(watch_events)
    )
