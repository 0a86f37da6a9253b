"""The ``kubernetes`` backend: plain Kubernetes (1.29+), nothing to install in the cluster.

Each app is a headless Service ``{app}`` that owns one Indexed Job ``{app}-{role}`` per role (see
``asynctorchx.schedulers._k8s.manifests`` for the exact objects). App ids are ``{namespace}:{app}``;
handles are ``kubernetes://{session}/{namespace}:{app}``.

Status comes from one list/watch of the backend's Services, Jobs and Pods per namespace, started
lazily (once something subscribes to pushed changes, follows logs, or an app needs live restarts) as
a single task owned by the scheduler and stopped by ``close()``. Every change calls ``_notify(app_id)``
so the runner's StatusHub re-describes just that app, from the cache: waiting on many apps costs no
round trips per app. Without the watch, ``describe_many`` answers with one list per kind and namespace.
A status read never changes anything in the cluster.

Retries:

- ``RetryPolicy.REPLICA`` is done by Kubernetes itself (per-index backoff), with or without a runner;
- ``ROLE`` and ``APPLICATION`` are done by this scheduler: when a role's Job fails and retries are
  left, it deletes the Job (or all the app's Jobs) with foreground propagation, waits until they are
  gone, and recreates them with a higher attempt label (counted in ``num_restarts``). This needs the
  process that submitted the app to keep its scheduler open (a runner that waits, watches or tails);
  if it exits, the failed Job stays failed and the app reads as FAILED;
- likewise, when a role fails for good, the scheduler that submitted the app suspends the app's other
  Jobs, so their pods stop (TorchX's "a failed replica stops the app");
- a restart is recorded on the app's Service while under way: when its Jobs cannot be recreated
  (a quota, a webhook...) the app reads FAILED, naming the roles and the reason, in any process;
  and if the process doing it stops between deleting and recreating them, FAILED ("interrupted")
  two minutes later, not PENDING for ever.

These follow-ups are driven by the watch: every change of an app asks the scheduler's
``Reconciler`` for a look at it (``_k8s/followups.py``, from ``_k8s/status.follow_up``).

Workspaces: the first role's image plus the workspace is built by the local Docker engine (as on
``local_docker``, see ``asynctorchx.schedulers._docker.image``), pushed to the ``image_repo`` run
option as ``{image_repo}:{content hash}`` with the Docker client's registry credentials, and the
manifests name that image; all of it before anything is created on the API server.

``cancel`` deletes the Service with ``propagationPolicy: Foreground`` (the API's default for Jobs would
orphan their pods): the app reads CANCELLED while its pods terminate, and this scheduler keeps
reporting CANCELLED after the objects are gone. ``log_iter`` reads the newest pod of a replica with
timestamps (stdout and stderr as one log, which is all Kubernetes keeps); following it survives
dropped or silent streams (a follow that sends nothing for ``log_read_timeout`` is re-opened, resuming
from the last timestamp without duplicates) and pod replacements (retries).

Differences from TorchX's ``kubernetes`` scheduler, which runs a Volcano Job:

- nothing to install in the cluster; the ``queue`` run option is an optional Kueue LocalQueue (each
  role's Job is a Kueue workload of its own), where TorchX's is a required Volcano queue;
- ``Role.min_replicas`` (``dist.ddp -j MIN:MAX`` sets it) is accepted and changes nothing in the
  objects: plain Jobs are not gang-scheduled, so every replica's pod starts as soon as it is
  scheduled, all ``num_replicas`` of them, where TorchX gives Volcano's tasks ``minAvailable``
  (the first ``min_replicas`` required, the others optional). The elastic minimum is torchrun's
  ``--nnodes MIN:MAX``: training starts once MIN nodes have joined the rendezvous and the others
  join as their pods start;
- as in TorchX, CPU and memory requests are the limits less a reserve (the ``reserved_millicpu``
  and ``reserved_memmb`` run options, 100 millicores and 1024 MiB by default; 0 makes requests
  equal limits), and pods carry ``sidecar.istio.io/inject: "false"``.

The parts: ``_k8s/manifests.py`` builds the objects (pure), ``_k8s/status.py`` assesses an app from
them (pure: the status and the follow-up owed), ``_k8s/client.py`` talks to the API server
(``informer.py`` watches, ``reads.py`` reads, ``followups.py`` acts), and ``_k8s/logs.py`` reads logs.

RBAC needed in the namespace: ``services``, ``jobs`` (batch): create, get, list, watch, patch, delete;
``pods``: get, list, watch; ``pods/log``: get; and ``services/finalizers``: update, where the
``OwnerReferencesPermissionEnforcement`` admission plugin is on (the Jobs block their Service's
foreground deletion).
"""

from __future__ import annotations

import builtins
import copy
import functools
import logging
import math
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import anyio
import anyio.to_thread

from asynctorchx._tasks import TaskSupervisor
from asynctorchx.logs._cursor import CursorKind, Position, lines_of
from asynctorchx.logs._query import LogQuery, Stream
from asynctorchx.schedulers._k8s import names as n
from asynctorchx.schedulers._k8s.client import (
    KubeApiError,
    KubeConnection,
    import_kubernetes_asyncio,
)
from asynctorchx.schedulers._k8s.followups import KubeFollowUps
from asynctorchx.schedulers._k8s.informer import Informer, Informers
from asynctorchx.schedulers._k8s.logs import KubeLogSource
from asynctorchx.schedulers._k8s.manifests import (
    KubernetesOptions,
    KubernetesRequest,
    build_request,
    image_repo,
    owned_by,
    run_options,
)
from asynctorchx.schedulers._k8s.reads import AppReader
from asynctorchx.schedulers._k8s.status import describe_app, labels_of, meta
from asynctorchx.schedulers._reconcile import CallsUnderWay, Reconciler, finish_shielded
from asynctorchx.schedulers.api import DescribeAppResponse, ListAppResponse, Scheduler
from asynctorchx.schedulers.workspace import (
    SingleFlight,
    WorkspacePlan,
    current_progress,
    run_in_thread,
)
from asynctorchx.specs.api import (
    AppDef,
    AppDryRunInfo,
    AppState,
    CfgVal,
    InvalidRunConfigException,
    MalformedAppHandleException,
    is_terminal,
    make_app_handle,
    runopts,
)
from asynctorchx.specs.workspace import Workspace

if TYPE_CHECKING:
    from asynctorchx.schedulers._docker.engine import DockerEngine

logger = logging.getLogger(__name__)

__all__ = ["KubeApiError", "KubernetesRequest", "KubernetesScheduler", "create_scheduler"]

# How many apps cancelled by this scheduler it still reports as CANCELLED once their objects are
# gone (the oldest are forgotten: then they read as unknown, like apps cancelled by another process)
_REMEMBERED_CANCELS = 10_000
#: how long ``close`` waits for the submits under way to finish creating their objects
_CLOSE_GRACE = 30.0


class KubernetesScheduler(Scheduler[KubernetesRequest]):
    """Runs apps on a Kubernetes cluster as Indexed Jobs under a headless Service.

    Args:
        session_name: the session submitting apps.
        namespace: the default namespace (the ``namespace`` run option) and the one ``list`` reads.
        k8s_client: a ``kubernetes_asyncio.client.ApiClient`` to use (not closed by ``close()``).
        k8s_configuration: a ``kubernetes_asyncio.client.Configuration`` to connect with.
        kubeconfig: a kubeconfig file (default: ``$KUBECONFIG``, ``~/.kube/config``, or in-cluster).
        kube_context: the kubeconfig context to use.
        watch_timeout: seconds after which the API server ends (and the scheduler resumes) a watch.
        request_timeout: total timeout of each non-streaming API call, in seconds.
        log_read_timeout: how long a followed log may send nothing before it is re-opened from
            its last line, in seconds (a connection gone half-open would otherwise hang the
            follow; a quiet container only costs a re-open per period).
        restart_timeout: how long a restart waits for the failed Jobs to be deleted, in seconds.
        docker_host: the Docker engine that builds workspace images (default: aiodocker's
            resolution, ``DOCKER_HOST`` then the local socket).
    """

    pushes_changes: ClassVar[bool] = True
    supports_workspace: ClassVar[bool] = True
    #: Kubernetes keeps a container's stdout and stderr as one log.
    log_streams: ClassVar[frozenset[Stream]] = frozenset({Stream.COMBINED})
    log_cursor_kind: ClassVar[CursorKind | None] = "kubernetes"

    def __init__(
        self,
        session_name: str,
        *,
        namespace: str | None = None,
        k8s_client: Any = None,
        k8s_configuration: Any = None,
        kubeconfig: str | None = None,
        kube_context: str | None = None,
        watch_timeout: int = 300,
        request_timeout: float = 30.0,
        log_read_timeout: float = 60.0,
        restart_timeout: float = 300.0,
        docker_host: str | None = None,
    ) -> None:
        super().__init__("kubernetes", session_name)
        if not (
            isinstance(log_read_timeout, int | float)
            and not isinstance(log_read_timeout, bool)
            and 0 < log_read_timeout < math.inf
        ):
            raise ValueError(
                f"log_read_timeout must be a positive number of seconds, got {log_read_timeout!r}"
            )
        self._namespace = namespace or "default"
        self._connection = KubeConnection(
            client=k8s_client,
            configuration=k8s_configuration,
            kubeconfig=kubeconfig,
            context=kube_context,
            request_timeout=request_timeout,
            log_read_timeout=log_read_timeout,
        )
        self._tasks = TaskSupervisor(f"kubernetes:{session_name}")
        self._informers = Informers(self._tasks, self._on_change, watch_timeout=watch_timeout)
        self._reader = AppReader(self._connection, self._informers)
        self._follow_ups = KubeFollowUps(
            self._connection, self._informers, self._notify, restart_timeout
        )
        self._reconciler = Reconciler(self._tasks, self._follow_ups.run, self.backend)
        self._logs = KubeLogSource(
            self._connection, self._reader, self._watch, self.describe, self._handle
        )
        self._cancelled: dict[str, DescribeAppResponse] = {}
        self._namespaces_used: set[str] = {self._namespace}
        self._docker_host = docker_host
        self._engine: DockerEngine | None = None
        self._flights = SingleFlight(self._tasks)
        self._pushed: set[str] = set()
        self._submits = CallsUnderWay()  # close() lets them finish

    # -- options, dry runs and workspaces -------------------------------------------------------

    def _run_opts(self) -> runopts:
        return run_options(self._namespace)

    def _submit_dryrun(
        self, app: AppDef, cfg: Mapping[str, CfgVal]
    ) -> AppDryRunInfo[KubernetesRequest]:
        image_repo(cfg)
        if not cfg.get("namespace"):
            # an empty option (``-cfg namespace=``) reads as unset: the scheduler's namespace,
            # which the request (and so the app id every later call reads) then carries
            cfg = {**cfg, "namespace": self._namespace}
        request = build_request(app, KubernetesOptions.from_cfg(cfg), self.session_name)
        return AppDryRunInfo(request, str)

    def _docker_engine(self) -> DockerEngine:
        from asynctorchx.schedulers._docker.engine import DockerEngine

        if self._engine is None:
            self._engine = DockerEngine(docker_host=self._docker_host)
        return self._engine

    def _workspace_repo(self, cfg: Mapping[str, CfgVal], workspace: Workspace) -> str:
        repo = image_repo(cfg)
        if repo is None:
            raise InvalidRunConfigException(
                f"a workspace ({workspace}) is built into a local image that the cluster cannot "
                "pull: set the image_repo run option to a repository it pulls from (e.g. -cfg "
                "image_repo=registry.example.com/team/app); the image is pushed there first",
                "image_repo",
                cfg,
            )
        return repo

    def plan_workspace(
        self, app: AppDef, cfg: Mapping[str, CfgVal], workspace: Workspace
    ) -> WorkspacePlan:
        """The workspace image of the first role, to be pushed to ``{image_repo}:{hash}``.

        Reads and hashes the workspace and asks the Docker engine for the base image's id;
        builds and pushes nothing.

        Raises:
            InvalidRunConfigException: ``image_repo`` is not set, or not a repository name.
        """
        from asynctorchx.schedulers._docker.image import plan_image

        repo = self._workspace_repo(cfg, workspace)
        base_id = self._docker_engine().image_id_blocking(app.roles[0].image)
        return plan_image(self.backend, app, workspace, base_id, push_repository=repo)

    async def plan_workspace_async(
        self, app: AppDef, cfg: Mapping[str, CfgVal], workspace: Workspace
    ) -> WorkspacePlan:
        """``plan_workspace`` with the engine asked from the event loop, the files read in a
        worker thread."""
        from asynctorchx.schedulers._docker.image import plan_image

        repo = self._workspace_repo(cfg, workspace)
        base_id = await self._docker_engine().image_id(app.roles[0].image)
        plan = functools.partial(
            plan_image, self.backend, app, workspace, base_id, push_repository=repo
        )
        return await run_in_thread(plan)

    async def _ship_workspace(self, plan: WorkspacePlan) -> None:
        from asynctorchx.schedulers._docker.image import ensure_image, ensure_pushed

        engine = self._docker_engine()
        progress = current_progress()
        await ensure_image(engine, plan, self._flights, progress)
        await ensure_pushed(engine, plan, self._flights, progress, self._pushed)

    # -- the watches and the follow-ups they drive ----------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the kubernetes scheduler is closed")

    def _handle(self, app_id: str) -> str:
        return make_app_handle(self.backend, self.session_name, app_id)

    def _wants_watch(self) -> bool:
        return bool(self._listeners) or self._follow_ups.manages()

    async def _watch(self, namespace: str) -> Informer:
        """The namespace's watch, started (as a task owned by this scheduler) if needed."""
        self._check_open()
        return self._informers.start(await self._connection.api(), namespace)

    def _on_change(self, namespace: str, app: str) -> None:
        app_id = n.make_app_id(namespace, app)
        self._notify(app_id)
        if self._follow_ups.manages(app_id):
            self._reconciler.request(app_id)

    # -- submit -----------------------------------------------------------------------------------

    async def schedule(self, dryrun_info: AppDryRunInfo[KubernetesRequest]) -> str:
        """Creates the Service, then the Jobs it owns. On any failure, deletes what was (or may
        have been: a create whose answer never came) created.

        A dry run made with a workspace first gets its image built and pushed (nothing is created
        on the API server when either fails).

        Raises:
            WorkspaceBuildError: the workspace image did not build or push.
            KubeApiError: the API server refused an object (e.g. 409 AlreadyExists, 403 Forbidden);
                its text names the object and, for a Job, its role.
        """
        self._check_open()
        with self._submits.one():
            return await self._schedule(dryrun_info.request, dryrun_info.workspace)

    async def _schedule(self, request: KubernetesRequest, workspace: WorkspacePlan | None) -> str:
        if workspace is not None:
            await self._ship_workspace(workspace)
            self._check_open()  # closed while the image was built or pushed: nothing was created
        api = await self._connection.api()
        ns = request.namespace
        service: dict[str, Any] | None = None
        try:
            service = await api.create("services", ns, request.service)
            for job, role in zip(request.jobs, request.roles, strict=True):
                await api.create("jobs", ns, owned_by(job, service), what=f"role {role.name!r}")
        except BaseException as e:
            # a Service create that timed out, was cut off or was cancelled may still have been
            # carried out; only a refusal (4xx, e.g. 409 for a name another app holds) certainly
            # created nothing
            refused = isinstance(e, KubeApiError) and 400 <= e.status < 500
            if service is not None or not refused:
                jobs = request.jobs if service is not None else []
                cleanup = self._delete_app(ns, request.name, jobs)
                await finish_shielded(self._tasks, cleanup, f"cleanup:{request.app_id}")
            raise
        self._namespaces_used.add(ns)
        self._follow_ups.manage(request, service)
        if self._wants_watch() and not self._closed:
            await self._watch(ns)
        return request.app_id

    async def _delete_app(
        self, namespace: str, name: str, jobs: Sequence[Mapping[str, Any]]
    ) -> None:
        """Deletes a partly submitted app (bounded by the request timeout; errors are logged)."""
        api = await self._connection.api()
        try:
            with anyio.fail_after(self._connection.request_timeout):
                await api.delete("services", namespace, name, "Foreground")
                for job in jobs:
                    await api.delete("jobs", namespace, job["metadata"]["name"], "Background")
        except (KubeApiError, TimeoutError):
            logger.exception("cleaning up the partly submitted app %s/%s failed", namespace, name)

    # -- status (reads only) ----------------------------------------------------------------------

    def _response(
        self,
        app_id: str,
        service: Mapping[str, Any] | None,
        jobs: builtins.list[Any],
        pods: builtins.list[Any],
    ) -> DescribeAppResponse | None:
        if service is None:
            return copy.deepcopy(self._cancelled.get(app_id))
        restarting = self._follow_ups.restarting(app_id, jobs, pods)
        return describe_app(service, jobs, pods, restarting=restarting)

    async def describe(self, app_id: str) -> DescribeAppResponse | None:
        """The app's status and roles; None for an app id this cluster does not have."""
        return (await self.describe_many([app_id]))[app_id]

    async def describe_many(self, app_ids: Sequence[str]) -> dict[str, DescribeAppResponse | None]:
        """Describes many apps: from the watched cache, else with one list per kind and namespace."""
        self._check_open()
        results: dict[str, DescribeAppResponse | None] = {}
        by_ns: dict[str, builtins.list[tuple[str, str]]] = {}
        for app_id in dict.fromkeys(app_ids):
            parts = n.split_app_id(app_id)
            if parts is None:
                results[app_id] = None
            else:
                by_ns.setdefault(parts[0], []).append((app_id, parts[1]))
        for ns, apps in by_ns.items():
            if self._wants_watch():
                await self._watch(ns)
            found = await self._reader.apps(ns, [name for _, name in apps])
            for app_id, name in apps:
                results[app_id] = self._response(app_id, *found.get(name, (None, [], [])))
        return results

    async def list(self) -> builtins.list[ListAppResponse]:
        """The backend's apps in the scheduler's namespace (and those it submitted elsewhere)."""
        self._check_open()
        out: builtins.list[ListAppResponse] = []
        for ns in sorted(self._namespaces_used):
            for name, (svc, jobs, pods) in sorted((await self._reader.all_apps(ns)).items()):
                app_id = n.make_app_id(ns, name)
                resp = self._response(app_id, svc, jobs, pods)
                if svc is None or resp is None:
                    continue
                session = str((meta(svc).get("annotations") or {}).get(n.ANN_SESSION, ""))
                try:
                    handle = make_app_handle(self.backend, session, app_id)
                except MalformedAppHandleException:
                    handle = "<NOT_SET>"
                out.append(ListAppResponse(app_id, resp.state, handle, resp.name))
        return out

    # -- cancel -----------------------------------------------------------------------------------

    async def exists(self, app_id: str) -> bool:
        """True when the cluster has the app's Service (or this scheduler cancelled the app): one
        read of the Service, or none while the namespace's watch has it."""
        self._check_open()
        parts = n.split_app_id(app_id)
        if app_id in self._cancelled or parts is None:
            return parts is not None
        inf = self._informers.synced(parts[0])
        if inf is not None and inf.app_objects(parts[1])[0] is not None:
            return True
        svc = await (await self._connection.api()).get("services", parts[0], parts[1])
        return svc is not None and labels_of(svc).get(n.LABEL_MANAGED_BY) == n.MANAGED_BY

    async def _cancel_existing(self, app_id: str) -> None:
        """Deletes the app's Service with foreground propagation (its Jobs and pods go with it).

        A finished app is left alone. Returns without waiting for the pods.
        """
        resp = await self.describe(app_id)
        parts = n.split_app_id(app_id)
        if resp is None or parts is None or is_terminal(resp.state):
            return
        self._follow_ups.forget(app_id)
        api = await self._connection.api()
        await api.delete("services", parts[0], parts[1], "Foreground")
        resp.state = AppState.CANCELLED
        resp.msg = "cancelled"
        self._cancelled[app_id] = resp
        while len(self._cancelled) > _REMEMBERED_CANCELS:
            del self._cancelled[next(iter(self._cancelled))]
        self._notify(app_id)

    # -- logs and lifecycle -----------------------------------------------------------------------

    def _log_iter(self, query: LogQuery) -> AsyncIterator[str]:
        """The newest pod's log of the replica, across pod replacements (see ``_k8s/logs.py``)."""
        return lines_of(self._logs.entries(query))

    def _log_entries(self, query: LogQuery) -> AsyncGenerator[tuple[Position, str], None]:
        """The lines with their pods' cursors (see ``KubeLogSource.entries``)."""
        return self._logs.entries(query)

    async def close(self) -> None:
        """Stops the watches and restart tasks, and closes the client it created. Idempotent.

        Submits creating their objects are waited for (up to 30 s) and complete; one still
        building or pushing its workspace image then raises "closed" having created nothing.
        """
        if self._closed:
            return
        self._closed = True
        await self._submits.finished(_CLOSE_GRACE)
        await self._tasks.aclose()
        self._informers.clear()
        self._follow_ups.forget()
        await self._connection.close()
        if self._engine is not None:
            await self._engine.close()

    def watch_stats(self) -> dict[str, int]:
        """Counts of lists, relists and watches opened, over every namespace (for tests, benchmarks)."""
        return self._informers.stats()


def create_scheduler(session_name: str, **kwargs: Any) -> KubernetesScheduler:
    """Creates the ``kubernetes`` scheduler (parameters it does not know are ignored).

    Raises:
        ImportError: kubernetes_asyncio is not installed (the message says ``pip install
            'asynctorchx[kubernetes]'``).
    """
    import_kubernetes_asyncio()
    known = {
        "namespace",
        "k8s_client",
        "k8s_configuration",
        "kubeconfig",
        "kube_context",
        "watch_timeout",
        "request_timeout",
        "log_read_timeout",
        "restart_timeout",
        "docker_host",
    }
    return KubernetesScheduler(session_name, **{k: v for k, v in kwargs.items() if k in known})
