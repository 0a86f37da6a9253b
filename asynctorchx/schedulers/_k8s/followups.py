"""Looking after the apps this scheduler submitted: restarts, and stopping the other roles.

``KubeFollowUps.run`` is the ``kubernetes`` backend's ``Reconciler`` work, asked for by the
namespace's watch at every change of an app's objects. It reads the app from the watched cache,
asks ``status.follow_up`` what is owed, and does it: a ``Restart`` deletes the failed Jobs (or all
the app's) with foreground propagation, waits until they are gone and recreates them with the next
attempt label; ``StopRoles`` suspends the app's other Jobs. This needs the submitting process to
keep its scheduler open (a runner that waits, watches or tails): no other process knows the attempts.

A restart is recorded on the app's Service (``status.RestartRecord``) before the Jobs are deleted,
refreshed while it waits for them to go, and removed once they are recreated; when they cannot be
(a quota, a webhook, the API server gone), the record gets the reason and the app's other Jobs are
suspended. So every process reads such an app as FAILED, saying why, not as PENDING for ever (a
Service with fewer Jobs than roles); and a restart whose process stopped between deleting and
recreating reads as FAILED once its record has gone unrefreshed for two minutes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import anyio

from asynctorchx.schedulers._k8s import names as n
from asynctorchx.schedulers._k8s.client import KubeApiError, KubeConnection
from asynctorchx.schedulers._k8s.informer import Informer, Informers
from asynctorchx.schedulers._k8s.manifests import KubernetesRequest, owned_by, with_attempts
from asynctorchx.schedulers._k8s.status import (
    RESTART_HEARTBEAT,
    Forget,
    ManagedApp,
    Obj,
    Restart,
    RestartRecord,
    StopRoles,
    follow_up,
    job_state,
    meta,
    pods_of_job,
    restart_plan,
)
from asynctorchx.specs.api import is_terminal

logger = logging.getLogger(__name__)


class KubeFollowUps:
    """The apps this scheduler looks after, and what it does for them.

    Args:
        connection: the API client.
        informers: the scheduler's watches (the apps are read from their caches).
        notify: tells the scheduler's listeners that an app changed.
        restart_timeout: how long a restart waits for the failed Jobs to be deleted, in seconds.
    """

    def __init__(
        self,
        connection: KubeConnection,
        informers: Informers,
        notify: Callable[[str], None],
        restart_timeout: float,
    ) -> None:
        self._connection = connection
        self._informers = informers
        self._notify = notify
        self._restart_timeout = restart_timeout
        self._managed: dict[str, ManagedApp] = {}

    def manage(self, request: KubernetesRequest, service: Obj) -> None:
        """Starts looking after a submitted app (needed for several roles or live retries)."""
        if len(request.roles) > 1 or request.needs_live_retries:
            self._managed[request.app_id] = ManagedApp(
                request=request, service=dict(service), role_attempts=[0] * len(request.roles)
            )

    def manages(self, app_id: str | None = None) -> bool:
        """True when it looks after ``app_id`` (any app, for None)."""
        return bool(self._managed) if app_id is None else app_id in self._managed

    def forget(self, app_id: str | None = None) -> None:
        """Stops looking after ``app_id`` (every app, for None)."""
        if app_id is None:
            self._managed.clear()
        else:
            self._managed.pop(app_id, None)

    def restarting(self, app_id: str, jobs: list[Obj], pods: list[Obj]) -> bool:
        """True when the app's failure is being (or is to be) restarted: it then reads RUNNING."""
        managed = self._managed.get(app_id)
        if managed is None:
            return False
        return managed.restarting or restart_plan(managed, jobs, pods) is not None

    async def run(self, app_id: str) -> None:
        """Does what app ``app_id`` is owed now (the ``Reconciler``'s work for it)."""
        managed = self._managed.get(app_id)
        parts = n.split_app_id(app_id)
        inf = self._informers.synced(parts[0]) if parts is not None else None
        if managed is None or inf is None or parts is None:
            return
        action = follow_up(managed, *inf.app_objects(parts[1]))
        if action is None:
            return
        if isinstance(action, Forget):
            self.forget(app_id)
            return
        try:
            if isinstance(action, StopRoles):
                self.forget(app_id)
                await self._stop_roles(managed, action)
            elif isinstance(action, Restart):
                managed.restarting = True
                await self._restart(app_id, managed, inf, action)
        except (KubeApiError, TimeoutError):
            logger.exception("looking after app %s failed; it is left as it is", app_id)
            self.forget(app_id)
        finally:
            managed.restarting = False
            self._notify(app_id)

    async def _stop_roles(self, managed: ManagedApp, action: StopRoles) -> None:
        api = await self._connection.api()
        for job in action.jobs:
            await api.patch("jobs", managed.request.namespace, job, {"spec": {"suspend": True}})

    async def _restart(
        self, app_id: str, managed: ManagedApp, inf: Informer, restart: Restart
    ) -> None:
        """Records the restart on the Service, deletes the failed Jobs, waits until they are gone,
        recreates them as the next attempt and removes the record. When they cannot be recreated,
        records why and suspends the app's other Jobs, then raises."""
        request = managed.request
        if restart.whole_app:
            managed.app_attempt += 1
        else:
            for i in restart.roles:
                managed.role_attempts[i] += 1
        record = RestartRecord(
            roles=restart.roles,
            app_attempt=managed.app_attempt,
            role_attempts=tuple(managed.role_attempts[i] for i in restart.roles),
            at_ns=time.time_ns(),
        )
        await self._record(request, record.to_json())
        try:
            recreated = await self._recreate(app_id, managed, inf, restart, record)
        except (KubeApiError, TimeoutError) as e:
            await self._failed(managed, inf, restart, record, e)
            raise
        if recreated:
            try:
                await self._record(request, None)
            except KubeApiError:  # harmless: the Jobs carry the attempts the record names
                logger.warning(
                    "removing the restart record of app %s failed", app_id, exc_info=True
                )

    async def _recreate(
        self,
        app_id: str,
        managed: ManagedApp,
        inf: Informer,
        restart: Restart,
        record: RestartRecord,
    ) -> bool:
        """Deletes and recreates the restarted roles' Jobs; False when the app went meanwhile."""
        api = await self._connection.api()
        request = managed.request
        targets = {request.jobs[i]["metadata"]["name"] for i in restart.roles}
        logger.info("restarting %s of app %s", ", ".join(sorted(targets)), app_id)
        for job_name in sorted(targets):
            await api.delete("jobs", request.namespace, job_name, "Foreground")
        beat = anyio.current_time()
        with anyio.fail_after(self._restart_timeout):
            while True:
                svc, jobs, _ = inf.app_objects(request.name)
                if svc is None or meta(svc).get("deletionTimestamp") or not self.manages(app_id):
                    return False
                if not targets & {meta(j).get("name") for j in jobs}:
                    break
                if anyio.current_time() - beat >= RESTART_HEARTBEAT:
                    beat = anyio.current_time()
                    await self._heartbeat(request, record)
                event = inf.change_event(request.name)
                with anyio.move_on_after(1.0):
                    await event.wait()
        for i in restart.roles:
            job = with_attempts(request.jobs[i], managed.app_attempt, managed.role_attempts[i])
            role = request.roles[i].name
            await api.create(
                "jobs",
                request.namespace,
                owned_by(job, managed.service),
                what=f"restarting role {role!r}",
            )
        return True

    async def _record(self, request: KubernetesRequest, value: str | None) -> None:
        """Sets the Service's restart record (None: removes it)."""
        api = await self._connection.api()
        body = {"metadata": {"annotations": {n.ANN_RESTART: value}}}
        await api.patch("services", request.namespace, request.name, body)

    async def _heartbeat(self, request: KubernetesRequest, record: RestartRecord) -> None:
        """Refreshes the record's time (a failure is logged: the restart goes on)."""
        try:
            await self._record(request, replace(record, at_ns=time.time_ns()).to_json())
        except KubeApiError:
            logger.warning(
                "refreshing the restart record of %s failed", request.name, exc_info=True
            )

    async def _failed(
        self,
        managed: ManagedApp,
        inf: Informer,
        restart: Restart,
        record: RestartRecord,
        error: KubeApiError | TimeoutError,
    ) -> None:
        """Records why the restart failed and suspends the app's other Jobs (failures logged)."""
        request = managed.request
        if isinstance(error, TimeoutError):
            reason = f"the failed Jobs were not deleted within {self._restart_timeout:g} s"
        else:
            reason = str(error)
        failed = replace(record, at_ns=time.time_ns(), error=reason)
        restarted = {request.jobs[i]["metadata"]["name"] for i in restart.roles}
        _, jobs, pods = inf.app_objects(request.name)
        others = tuple(
            str(meta(j).get("name", ""))
            for j in jobs
            if meta(j).get("name") not in restarted
            and not (j.get("spec") or {}).get("suspend")
            and not is_terminal(job_state(j, pods_of_job(j, pods)))
        )
        try:
            await self._record(request, failed.to_json())
            await self._stop_roles(managed, StopRoles(others))
        except KubeApiError:
            logger.warning(
                "recording the failed restart of app %s failed", request.app_id, exc_info=True
            )
