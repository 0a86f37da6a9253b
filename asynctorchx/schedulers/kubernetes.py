"""The ``kubernetes`` backend: plain Kubernetes (1.29+), nothing to install in the cluster.

Each app is a headless Service ``{app}`` that owns one Indexed Job ``{app}-{role}`` per role (see
``asynctorchx.schedulers._k8s.manifests`` for the exact objects). App ids are ``{namespace}:{app}``;
handles are ``kubernetes://{session}/{namespace}:{app}``.

Status comes from one list/watch of the backend's Services, Jobs and Pods per namespace, started
lazily (once something subscribes to pushed changes, follows logs, or an app needs live restarts) as
a single task owned by the scheduler and stopped by ``close()``. Every change calls ``_notify(app_id)``
so the runner's StatusHub re-describes just that app, from the cache: waiting on many apps costs no
round trips per app. Without the watch, ``describe_many`` answers with one list per kind and namespace.

Retries:

- ``RetryPolicy.REPLICA`` is done by Kubernetes itself (per-index backoff), with or without a runner;
- ``ROLE`` and ``APPLICATION`` are done by this scheduler: when a role's Job fails and retries are
  left, it deletes the Job (or all the app's Jobs) with foreground propagation, waits until they are
  gone, and recreates them with a higher attempt label (counted in ``num_restarts``). This needs the
  process that submitted the app to keep its scheduler open (a runner that waits, watches or tails);
  if it exits, the failed Job stays failed and the app reads as FAILED;
- likewise, when a role fails for good, the scheduler that submitted the app suspends the app's other
  Jobs, so their pods stop (TorchX's "a failed replica stops the app").

Workspaces: the first role's image plus the workspace is built by the local Docker engine (as on
``local_docker``, see ``asynctorchx.schedulers._docker.image``), pushed to the ``image_repo`` run
option as ``{image_repo}:{content hash}`` with the Docker client's registry credentials, and the
manifests name that image; all of it before anything is created on the API server.

``cancel`` deletes the Service with ``propagationPolicy: Foreground`` (the API's default for Jobs would
orphan their pods): the app reads CANCELLED while its pods terminate, and this scheduler keeps
reporting CANCELLED after the objects are gone. ``log_iter`` reads the newest pod of a replica with
timestamps; following it survives dropped streams (resuming from the last timestamp without
duplicates) and pod replacements (retries).

RBAC needed in the namespace: ``services``, ``jobs`` (batch): create, get, list, watch, patch, delete;
``pods``: get, list, watch; ``pods/log``: get; and ``services/finalizers``: update, where the
``OwnerReferencesPermissionEnforcement`` admission plugin is on (the Jobs block their Service's
foreground deletion).
"""

from __future__ import annotations

import asyncio
import builtins
import copy
import functools
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar

import anyio
import anyio.to_thread

from asynctorchx._tasks import TaskSupervisor
from asynctorchx.schedulers._k8s import names as n
from asynctorchx.schedulers._k8s.client import (
    KINDS,
    KubeApi,
    KubeApiError,
    import_kubernetes_asyncio,
)
from asynctorchx.schedulers._k8s.informer import MANAGED_SELECTOR, Informer
from asynctorchx.schedulers._k8s.logs import (
    LogCursor,
    datetime_to_ns,
    split_timestamp,
    to_rfc3339_seconds,
)
from asynctorchx.schedulers._k8s.manifests import (
    KubernetesOptions,
    KubernetesRequest,
    build_request,
    owned_by,
    with_attempts,
)
from asynctorchx.schedulers._k8s.status import (
    describe_app,
    job_finished,
    job_role_index,
    job_state,
    labels_of,
    meta,
    pod_index,
    pod_sort_key,
    pod_started,
    pod_state,
    pods_of_job,
)
from asynctorchx.schedulers.api import (
    DescribeAppResponse,
    ListAppResponse,
    Scheduler,
    Stream,
    check_replica,
    check_time_window,
    compile_log_regex,
)
from asynctorchx.schedulers.workspace import SingleFlight, WorkspacePlan, current_progress
from asynctorchx.specs.api import (
    AppDef,
    AppDryRunInfo,
    AppState,
    CfgVal,
    InvalidRunConfigException,
    MalformedAppHandleException,
    RetryPolicy,
    UnknownAppException,
    is_terminal,
    make_app_handle,
    runopts,
)
from asynctorchx.specs.workspace import Workspace

if TYPE_CHECKING:
    from asynctorchx.schedulers._docker.engine import DockerEngine

logger = logging.getLogger(__name__)

__all__ = ["KubeApiError", "KubernetesRequest", "KubernetesScheduler", "create_scheduler"]

_LIST_CHUNK = 100
_CONFIRMED_APPS = 10_000


def _finished_jobs_key(jobs: Sequence[Mapping[str, Any]]) -> tuple[tuple[str, str], ...]:
    """Which of the app's Jobs have finished, by uid and resourceVersion (empty: none has)."""
    return tuple(
        sorted(
            (str(meta(j).get("uid", "")), str(meta(j).get("resourceVersion", "")))
            for j in jobs
            if job_finished(j)
        )
    )


# A log read (without following) cut this many times in a row raises instead of returning a part.
_MAX_LOG_RESUMES = 3


@dataclass
class _Managed:
    """An app this scheduler submitted and looks after (restarts, stopping roles after a failure)."""

    request: KubernetesRequest
    service: dict[str, Any]
    app_attempt: int = 0
    role_attempts: builtins.list[int] = field(default_factory=list)
    busy: bool = False


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
        restart_timeout: how long a restart waits for the failed Jobs to be deleted, in seconds.
        docker_host: the Docker engine that builds workspace images (default: aiodocker's
            resolution, ``DOCKER_HOST`` then the local socket).
    """

    pushes_changes: ClassVar[bool] = True
    supports_workspace: ClassVar[bool] = True

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
        restart_timeout: float = 300.0,
        docker_host: str | None = None,
    ) -> None:
        super().__init__("kubernetes", session_name)
        self._namespace = namespace or "default"
        self._k8s_client = k8s_client
        self._k8s_configuration = k8s_configuration
        self._kubeconfig = kubeconfig
        self._kube_context = kube_context
        self._watch_timeout = watch_timeout
        self._request_timeout = request_timeout
        self._restart_timeout = restart_timeout
        self._api: KubeApi | None = None
        self._api_lock: asyncio.Lock | None = None
        self._supervisor = TaskSupervisor(f"kubernetes:{session_name}")
        self._informers: dict[str, Informer] = {}
        self._informer_tasks: dict[str, asyncio.Task[None]] = {}
        self._managed: dict[str, _Managed] = {}
        self._cancelled: dict[str, DescribeAppResponse] = {}
        # app id -> the finished Jobs whose pods were listed afresh (see _list_pods)
        self._pods_confirmed: dict[str, tuple[tuple[str, str], ...]] = {}
        self._namespaces_used: set[str] = {self._namespace}
        self._docker_host = docker_host
        self._engine: DockerEngine | None = None
        self._flights = SingleFlight(self._supervisor)
        self._pushed: set[str] = set()

    # -- options and dry runs -------------------------------------------------------------------

    def _run_opts(self) -> runopts:
        opts = runopts()
        opts.add("namespace", str, "namespace of the app's objects", default=self._namespace)
        opts.add(
            "queue",
            str,
            "Kueue LocalQueue to submit to: the Jobs are labelled kueue.x-k8s.io/queue-name and "
            "created suspended until Kueue admits them (TorchX's queue is Volcano's)",
        )
        opts.add("service_account", str, "service account the pods run as")
        opts.add(
            "priority_class",
            str,
            "PriorityClass of the pods (with queue: also the workload's priority in Kueue)",
        )
        opts.add("node_selector", dict[str, str], "node labels the pods must match (key:value,...)")
        opts.add(
            "tolerations",
            list[str],
            "taints the pods tolerate: key[=value][:NoSchedule|PreferNoSchedule|NoExecute],...",
        )
        opts.add("image_pull_secrets", list[str], "names of the Secrets used to pull the images")
        opts.add("image_pull_policy", str, "Always, IfNotPresent or Never (default: the cluster's)")
        opts.add(
            "labels",
            dict[str, str],
            "extra labels on every object, e.g. team:vision",
        )
        opts.add(
            "pod_overlay",
            str,
            'a JSON object merged into every pod template, e.g. {"spec": {"hostNetwork": true}}',
        )
        opts.add(
            "image_repo",
            str,
            "the repository workspace images are pushed to, as {image_repo}:{content hash} (e.g. "
            "registry.example.com/team/app); the cluster must be able to pull from it",
        )
        opts.add(
            "rank0_localhost",
            bool,
            "replica 0 of the first role sees TORCHX_RANK0_HOST=localhost (its command runs under "
            "/bin/sh when the role has several replicas); off: every replica gets rank 0's DNS name",
            default=True,
        )
        return opts

    def _submit_dryrun(
        self, app: AppDef, cfg: Mapping[str, CfgVal]
    ) -> AppDryRunInfo[KubernetesRequest]:
        _image_repo(cfg)
        request = build_request(app, KubernetesOptions.from_cfg(cfg), self.session_name)
        return AppDryRunInfo(request, str)

    # -- workspaces -------------------------------------------------------------------------------

    def _docker_engine(self) -> DockerEngine:
        from asynctorchx.schedulers._docker.engine import DockerEngine

        if self._engine is None:
            self._engine = DockerEngine(docker_host=self._docker_host)
        return self._engine

    def _workspace_repo(self, cfg: Mapping[str, CfgVal], workspace: Workspace) -> str:
        repo = _image_repo(cfg)
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
        return await anyio.to_thread.run_sync(
            functools.partial(
                plan_image, self.backend, app, workspace, base_id, push_repository=repo
            )
        )

    async def _ship_workspace(self, plan: WorkspacePlan) -> None:
        from asynctorchx.schedulers._docker.image import ensure_image, ensure_pushed

        engine = self._docker_engine()
        progress = current_progress()
        await ensure_image(engine, plan, self._flights, progress)
        await ensure_pushed(engine, plan, self._flights, progress, self._pushed)

    # -- the client and the watches -------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the kubernetes scheduler is closed")

    async def _client(self) -> KubeApi:
        self._check_open()
        if self._api is None:
            if self._api_lock is None:
                self._api_lock = asyncio.Lock()
            async with self._api_lock:
                if self._api is None:
                    if self._k8s_client is not None:
                        self._api = KubeApi(
                            self._k8s_client,
                            owns_client=False,
                            request_timeout=self._request_timeout,
                        )
                    else:
                        self._api = await KubeApi.connect(
                            configuration=self._k8s_configuration,
                            kubeconfig=self._kubeconfig,
                            context=self._kube_context,
                            request_timeout=self._request_timeout,
                        )
        return self._api

    def _wants_watch(self) -> bool:
        return bool(self._listeners) or bool(self._managed)

    async def _informer(self, namespace: str) -> Informer:
        """The namespace's informer, started (as a task owned by this scheduler) if needed."""
        api = await self._client()
        inf = self._informers.get(namespace)
        if inf is None:
            inf = Informer(
                api, namespace, self._change_callback(namespace), watch_timeout=self._watch_timeout
            )
            self._informers[namespace] = inf
        task = self._informer_tasks.get(namespace)
        if task is None or task.done():
            self._informer_tasks[namespace] = self._supervisor.spawn(
                inf.run(), name=f"watch:{namespace}"
            )
        return inf

    def _change_callback(self, namespace: str) -> Callable[[str], None]:
        def on_change(app: str) -> None:
            self._on_change(namespace, app)

        return on_change

    def _synced_informer(self, namespace: str) -> Informer | None:
        inf = self._informers.get(namespace)
        return inf if inf is not None and inf.synced else None

    def _on_change(self, namespace: str, app: str) -> None:
        app_id = n.make_app_id(namespace, app)
        self._notify(app_id)
        managed = self._managed.get(app_id)
        if managed is not None and not managed.busy and not self._supervisor.closed:
            self._supervisor.spawn(self._look_after(app_id), name=f"look-after:{app_id}")

    # -- submit -----------------------------------------------------------------------------------

    async def schedule(self, dryrun_info: AppDryRunInfo[KubernetesRequest]) -> str:
        """Creates the Service, then the Jobs it owns. On any failure, deletes what was created.

        A dry run made with a workspace first gets its image built and pushed (nothing is created
        on the API server when either fails).

        Raises:
            WorkspaceBuildError: the workspace image did not build or push.
            KubeApiError: the API server refused an object (e.g. 409 AlreadyExists, 403 Forbidden).
        """
        request = dryrun_info.request
        if dryrun_info.workspace is not None:
            await self._ship_workspace(dryrun_info.workspace)
        api = await self._client()
        ns = request.namespace
        service = await api.create("services", ns, request.service)
        try:
            for job in request.jobs:
                await api.create("jobs", ns, owned_by(job, service))
        except BaseException:
            with anyio.CancelScope(shield=True), anyio.move_on_after(self._request_timeout):
                await self._delete_app(ns, request.name, request.jobs)
            raise
        self._namespaces_used.add(ns)
        if len(request.roles) > 1 or request.needs_live_retries:
            self._managed[request.app_id] = _Managed(
                request=request, service=service, role_attempts=[0] * len(request.roles)
            )
        if self._wants_watch():
            await self._informer(ns)
        return request.app_id

    async def _delete_app(
        self, namespace: str, name: str, jobs: Sequence[Mapping[str, Any]]
    ) -> None:
        api = await self._client()
        try:
            await api.delete("services", namespace, name, "Foreground")
            for job in jobs:
                await api.delete("jobs", namespace, job["metadata"]["name"], "Background")
        except KubeApiError:
            logger.exception("cleaning up the partly submitted app %s/%s failed", namespace, name)

    # -- describe ---------------------------------------------------------------------------------

    def _restarting(
        self, app_id: str, jobs: Sequence[Mapping[str, Any]], pods: Sequence[Mapping[str, Any]]
    ) -> bool:
        managed = self._managed.get(app_id)
        if managed is None:
            return False
        if managed.busy:
            return True
        return self._restart_plan(managed, jobs, pods) is not None

    def _restart_plan(
        self,
        managed: _Managed,
        jobs: Sequence[Mapping[str, Any]],
        pods: Sequence[Mapping[str, Any]],
    ) -> builtins.list[int] | None:
        """The role indexes to restart for the app's failed Jobs, or None when none can restart."""
        failed = [
            job_role_index(j) for j in jobs if job_state(j, pods_of_job(j, pods)) == AppState.FAILED
        ]
        roles = managed.request.roles
        for i in failed:
            if not 0 <= i < len(roles):
                return None
            role = roles[i]
            policy = RetryPolicy(role.retry_policy)
            if policy == RetryPolicy.APPLICATION and managed.app_attempt < role.max_retries:
                return list(range(len(roles)))
            if policy == RetryPolicy.ROLE and managed.role_attempts[i] < role.max_retries:
                continue
            return None
        return failed or None

    def _response(
        self,
        app_id: str,
        service: Mapping[str, Any] | None,
        jobs: Sequence[Mapping[str, Any]],
        pods: Sequence[Mapping[str, Any]],
    ) -> DescribeAppResponse | None:
        if service is None:
            return copy.deepcopy(self._cancelled.get(app_id))
        return describe_app(service, jobs, pods, restarting=self._restarting(app_id, jobs, pods))

    async def describe(self, app_id: str) -> DescribeAppResponse | None:
        """The app's status and roles; None for an app id this cluster does not have."""
        return (await self.describe_many([app_id]))[app_id]

    async def describe_many(self, app_ids: Sequence[str]) -> dict[str, DescribeAppResponse | None]:
        """Describes many apps: from the watched cache, else with one list per kind and namespace."""
        self._check_open()
        results: dict[str, DescribeAppResponse | None] = {}
        by_ns: dict[str, list[tuple[str, str]]] = {}
        for app_id in dict.fromkeys(app_ids):
            parts = n.split_app_id(app_id)
            if parts is None:
                results[app_id] = None
                continue
            by_ns.setdefault(parts[0], []).append((app_id, parts[1]))
        for ns, apps in by_ns.items():
            if self._wants_watch():
                await self._informer(ns)
            inf = self._synced_informer(ns)
            missing: list[tuple[str, str]] = []
            confirm: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {}
            for app_id, name in apps:
                if inf is not None:
                    svc, jobs, pods = inf.app_objects(name)
                    if svc is not None:
                        key = _finished_jobs_key(jobs)
                        if key and self._pods_confirmed.get(app_id) != key:
                            confirm[name] = (app_id, key)
                            continue
                        results[app_id] = self._response(app_id, svc, jobs, pods)
                        continue
                missing.append((app_id, name))
            if confirm:
                assert inf is not None
                await self._confirm_pods(ns, inf, confirm, results)
            for i in range(0, len(missing), _LIST_CHUNK):
                chunk = missing[i : i + _LIST_CHUNK]
                found = await self._fetch_apps(ns, [name for _, name in chunk])
                for app_id, name in chunk:
                    svc, jobs, pods = found.get(name, (None, [], []))
                    results[app_id] = self._response(app_id, svc, jobs, pods)
        return results

    async def _confirm_pods(
        self,
        namespace: str,
        inf: Informer,
        confirm: Mapping[str, tuple[str, tuple[tuple[str, str], ...]]],
        results: dict[str, DescribeAppResponse | None],
    ) -> None:
        """Describes apps whose Jobs just finished with their pods listed afresh (``_list_pods``).

        The app is read from the cache again once the pods are listed: if its Jobs changed
        meanwhile (a restart began), the cache answers and the confirmation waits for next time.
        """
        names = list(confirm)
        for i in range(0, len(names), _LIST_CHUNK):
            part = names[i : i + _LIST_CHUNK]
            fresh = await self._list_pods(namespace, part)
            for name in part:
                app_id, key = confirm[name]
                svc, jobs, pods = inf.app_objects(name)
                if svc is not None and _finished_jobs_key(jobs) == key:
                    pods = fresh.get(name, [])
                    self._pods_confirmed[app_id] = key
                    while len(self._pods_confirmed) > _CONFIRMED_APPS:
                        del self._pods_confirmed[next(iter(self._pods_confirmed))]
                results[app_id] = self._response(app_id, svc, jobs, pods)

    async def _list_pods(self, namespace: str, names: list[str]) -> dict[str, list[dict[str, Any]]]:
        """The pods of the named apps, in one list call.

        The Jobs and the pods come from two watches whose events may arrive in either order: when
        a Job has just finished, the cached pods can lag it (the replacement pod that succeeded not
        seen yet, so no restart counted). Pods listed after the Job was seen finished include every
        pod that finished before it.
        """
        api = await self._client()
        selector = f"{MANAGED_SELECTOR},{n.LABEL_APP_ID} in ({','.join(names)})"
        listing = await api.list("pods", namespace, selector)
        out: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for pod in listing.get("items") or []:
            app = labels_of(pod).get(n.LABEL_APP_ID)
            if app in out:
                out[app].append(pod)
        return out

    async def _fetch_apps(
        self, namespace: str, names: list[str]
    ) -> dict[str, tuple[dict[str, Any] | None, list[dict[str, Any]], list[dict[str, Any]]]]:
        api = await self._client()
        if len(names) == 1:
            selector = f"{MANAGED_SELECTOR},{n.LABEL_APP_ID}={names[0]}"
        else:
            selector = f"{MANAGED_SELECTOR},{n.LABEL_APP_ID} in ({','.join(names)})"
        listings = await asyncio.gather(*(api.list(kind, namespace, selector) for kind in KINDS))
        out: dict[str, tuple[dict[str, Any] | None, list[dict[str, Any]], list[dict[str, Any]]]] = {
            name: (None, [], []) for name in names
        }
        for kind, listing in zip(KINDS, listings, strict=True):
            for obj in listing.get("items") or []:
                app = labels_of(obj).get(n.LABEL_APP_ID)
                if app not in out:
                    continue
                _, jobs, pods = out[app]
                if kind == "services":
                    out[app] = (obj, jobs, pods)
                elif kind == "jobs":
                    jobs.append(obj)
                else:
                    pods.append(obj)
        return out

    # -- cancel and list --------------------------------------------------------------------------

    async def cancel(self, app_id: str) -> None:
        """Deletes the app's Service with foreground propagation (its Jobs and pods go with it).

        Idempotent; an unknown or finished app is left alone. Returns without waiting for the pods.
        """
        resp = await self.describe(app_id)
        if resp is None or is_terminal(resp.state):
            return
        await self._delete_for_cancel(app_id, resp)

    async def _cancel_existing(self, app_id: str) -> None:
        resp = await self.describe(app_id)
        if resp is not None:
            await self._delete_for_cancel(app_id, resp)

    async def _delete_for_cancel(self, app_id: str, before: DescribeAppResponse) -> None:
        parts = n.split_app_id(app_id)
        if parts is None:
            return
        ns, name = parts
        self._managed.pop(app_id, None)
        api = await self._client()
        await api.delete("services", ns, name, "Foreground")
        before.state = AppState.CANCELLED
        before.msg = "cancelled"
        self._cancelled[app_id] = before
        self._notify(app_id)

    async def list(self) -> list[ListAppResponse]:
        """The backend's apps in the scheduler's namespace (and those it submitted elsewhere)."""
        out: builtins.list[ListAppResponse] = []
        for ns in sorted(self._namespaces_used):
            inf = self._synced_informer(ns)
            if inf is not None:
                apps = {name: inf.app_objects(name) for name in inf.apps()}
            else:
                api = await self._client()
                listings = await asyncio.gather(*(api.list(k, ns, MANAGED_SELECTOR) for k in KINDS))
                grouped: dict[str, tuple[Any, builtins.list[Any], builtins.list[Any]]] = {}
                for svc in listings[0].get("items") or []:
                    grouped[meta(svc).get("name", "")] = (svc, [], [])
                for kind_i in (1, 2):
                    for obj in listings[kind_i].get("items") or []:
                        app = labels_of(obj).get(n.LABEL_APP_ID)
                        if app in grouped:
                            grouped[app][kind_i].append(obj)
                apps = grouped
            for name, (svc, jobs, pods) in sorted(apps.items()):
                if svc is None:
                    continue
                app_id = n.make_app_id(ns, name)
                resp = self._response(app_id, svc, jobs, pods)
                if resp is None:
                    continue
                session = str((meta(svc).get("annotations") or {}).get(n.ANN_SESSION, ""))
                try:
                    handle = make_app_handle(self.backend, session, app_id)
                except MalformedAppHandleException:
                    handle = "<NOT_SET>"
                out.append(
                    ListAppResponse(
                        app_id=app_id, state=resp.state, app_handle=handle, name=resp.name
                    )
                )
        return out

    # -- looking after submitted apps (restarts, stopping the other roles) ------------------------

    async def _look_after(self, app_id: str) -> None:
        managed = self._managed.get(app_id)
        parts = n.split_app_id(app_id)
        if managed is None or managed.busy or parts is None:
            return
        ns, name = parts
        inf = self._synced_informer(ns)
        if inf is None:
            return
        svc, jobs, pods = inf.app_objects(name)
        if svc is None or meta(svc).get("deletionTimestamp"):
            self._managed.pop(app_id, None)
            return
        states = [job_state(j, pods_of_job(j, pods)) for j in jobs]
        if len(jobs) == len(managed.request.roles) and all(s == AppState.SUCCEEDED for s in states):
            self._managed.pop(app_id, None)
            return
        if AppState.FAILED not in states:
            return
        plan = self._restart_plan(managed, jobs, pods)
        managed.busy = True
        try:
            if plan is None:
                self._managed.pop(app_id, None)
                await self._stop_others(ns, jobs, pods)
            else:
                await self._restart(app_id, managed, inf, plan)
        except (KubeApiError, TimeoutError):
            logger.exception("looking after app %s failed; it is left as it is", app_id)
            self._managed.pop(app_id, None)
        finally:
            managed.busy = False
            self._notify(app_id)

    async def _stop_others(
        self, namespace: str, jobs: Sequence[Mapping[str, Any]], pods: Sequence[Mapping[str, Any]]
    ) -> None:
        api = await self._client()
        for job in jobs:
            if not is_terminal(job_state(job, pods_of_job(job, pods))) and not (
                job.get("spec") or {}
            ).get("suspend"):
                await api.patch("jobs", namespace, meta(job)["name"], {"spec": {"suspend": True}})

    async def _restart(
        self, app_id: str, managed: _Managed, inf: Informer, plan: builtins.list[int]
    ) -> None:
        api = await self._client()
        ns, name = managed.request.namespace, managed.request.name
        whole_app = len(plan) == len(managed.request.roles) and any(
            RetryPolicy(managed.request.roles[i].retry_policy) == RetryPolicy.APPLICATION
            for i in plan
        )
        if whole_app:
            managed.app_attempt += 1
        else:
            for i in plan:
                managed.role_attempts[i] += 1
        targets = {managed.request.jobs[i]["metadata"]["name"] for i in plan}
        logger.info("restarting %s of app %s", ", ".join(sorted(targets)), app_id)
        for job_name in sorted(targets):
            await api.delete("jobs", ns, job_name, "Foreground")
        with anyio.fail_after(self._restart_timeout):
            while True:
                svc, jobs, _ = inf.app_objects(name)
                if svc is None or meta(svc).get("deletionTimestamp") or app_id not in self._managed:
                    return
                if not targets & {meta(j).get("name") for j in jobs}:
                    break
                event = inf.change_event(name)
                with anyio.move_on_after(1.0):
                    await event.wait()
        for i in plan:
            job = with_attempts(
                managed.request.jobs[i], managed.app_attempt, managed.role_attempts[i]
            )
            await api.create("jobs", ns, owned_by(job, managed.service))

    # -- logs -------------------------------------------------------------------------------------

    async def _pods_for(
        self, namespace: str, app: str, role_dns: str, k: int
    ) -> builtins.list[dict[str, Any]]:
        inf = self._synced_informer(namespace)
        if inf is not None:
            pods = inf.app_objects(app)[2]
        else:
            api = await self._client()
            selector = f"{MANAGED_SELECTOR},{n.LABEL_APP_ID}={app},{n.LABEL_ROLE}={role_dns}"
            pods = (await api.list("pods", namespace, selector)).get("items") or []
        return [p for p in pods if labels_of(p).get(n.LABEL_ROLE) == role_dns and pod_index(p) == k]

    async def _newest_pod(
        self, namespace: str, app: str, role_dns: str, k: int
    ) -> dict[str, Any] | None:
        pods = await self._pods_for(namespace, app, role_dns, k)
        return max(pods, key=pod_sort_key) if pods else None

    async def _wait_for_change(self, namespace: str, app: str, delay: float) -> None:
        inf = await self._informer(namespace)
        event = inf.change_event(app)
        with anyio.move_on_after(delay):
            await event.wait()

    def log_iter(
        self,
        app_id: str,
        role_name: str,
        k: int = 0,
        regex: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        should_tail: bool = False,
        streams: Stream | None = None,
    ) -> AsyncIterator[str]:
        """The lines of replica ``k`` of ``role_name``: its newest pod's log (stdout and stderr
        combined, as Kubernetes keeps them).

        With ``should_tail``, follows the replica until the app is terminal, across dropped streams
        (resumed from the last timestamp without duplicates) and pod replacements (retries).

        Raises:
            ValueError: ``streams`` is STDOUT or STDERR (Kubernetes does not separate them), a bad
                regex, or ``since`` after ``until``.
            UnknownAppException: no such app.
            UnknownRoleException: no such role or replica.
        """
        if streams not in (None, Stream.COMBINED):
            raise ValueError(
                f"the kubernetes scheduler cannot read {Stream(streams).value} alone: Kubernetes keeps "
                "a pod's stdout and stderr as one log; use streams=Stream.COMBINED (or None)"
            )
        pattern = compile_log_regex(regex)
        check_time_window(since, until)
        return self._log_lines(app_id, role_name, k, pattern, since, until, should_tail)

    async def _log_lines(
        self,
        app_id: str,
        role_name: str,
        k: int,
        pattern: Any,
        since: datetime | None,
        until: datetime | None,
        should_tail: bool,
    ) -> AsyncIterator[str]:
        resp = await self.describe(app_id)
        parts = n.split_app_id(app_id)
        if resp is None or parts is None:
            raise UnknownAppException(app_id)
        counts = {r.name: r.num_replicas for r in resp.roles} or {
            rs.role: len(rs.replicas) for rs in resp.roles_statuses
        }
        check_replica(app_id, counts, role_name, k)
        ns, app = parts
        role_dns = n.role_dns_name(role_name)
        since_ns = datetime_to_ns(since) if since is not None else None
        until_ns = datetime_to_ns(until) if until is not None else None
        api = await self._client()
        if should_tail:
            await self._informer(ns)
        cursors: dict[str, LogCursor] = {}
        finished: set[str] = set()
        pause = 0.05
        drops = 0
        while True:
            pod = await self._newest_pod(ns, app, role_dns, k)
            uid = str(meta(pod).get("uid", "")) if pod is not None else ""
            readable = pod is not None and uid not in finished and pod_started(pod)
            if pod is not None and readable:
                cursor = cursors.setdefault(uid, LogCursor())
                since_time = cursor.since_time() or (
                    to_rfc3339_seconds(since_ns) if since_ns is not None else None
                )
                was_terminal = is_terminal(pod_state(pod))
                ended_cleanly = False
                try:
                    async with api.pod_log(
                        ns, meta(pod)["name"], follow=should_tail, since_time=since_time
                    ) as lines:
                        read = cursor.begin_pass()
                        async for raw in lines:
                            ts, text = split_timestamp(raw.decode("utf-8", "replace"))
                            if not read.accept(ts):
                                continue
                            if ts is not None and since_ns is not None and ts < since_ns:
                                continue
                            if ts is not None and until_ns is not None and ts > until_ns:
                                return
                            if pattern is None or pattern.search(text):
                                yield text
                    ended_cleanly = True
                except KubeApiError as e:
                    if e.status not in (0, 400, 404):
                        raise
                    logger.debug("log stream of %s ended: %s", meta(pod).get("name"), e)
                    if e.status == 0 and not should_tail:
                        drops += 1
                        if drops > _MAX_LOG_RESUMES:
                            raise
                        continue
                if not should_tail:
                    return
                if ended_cleanly and was_terminal:
                    finished.add(uid)
                    continue
                if ended_cleanly:
                    fresh = await self._newest_pod(ns, app, role_dns, k)
                    if (
                        fresh is not None
                        and meta(fresh).get("uid") == uid
                        and is_terminal(pod_state(fresh))
                    ):
                        continue
                else:
                    pause = 0.05
            elif not should_tail:
                return
            if not readable:
                current = await self.describe(app_id)
                if current is None or is_terminal(current.state):
                    newest = await self._newest_pod(ns, app, role_dns, k)
                    if newest is None or not pod_started(newest):
                        return
                    if meta(newest).get("uid") in finished:
                        return
                    continue
            await self._wait_for_change(ns, app, pause)
            pause = min(pause * 2, 1.0)

    # -- lifecycle --------------------------------------------------------------------------------

    async def close(self) -> None:
        """Stops the watches and restart tasks, and closes the client it created. Idempotent."""
        if self._closed:
            return
        await self._supervisor.aclose()
        self._informer_tasks.clear()
        self._informers.clear()
        self._managed.clear()
        if self._api is not None:
            await self._api.close()
            self._api = None
        if self._engine is not None:
            await self._engine.close()
        await super().close()

    # -- instrumentation ----------------------------------------------------------------------------

    def watch_stats(self) -> dict[str, int]:
        """Counts of lists, relists and watches opened, over every namespace (for tests, benchmarks)."""
        out = {"lists": 0, "relists": 0, "watches": 0}
        for inf in self._informers.values():
            out["lists"] += inf.lists
            out["relists"] += inf.relists
            out["watches"] += inf.watches
        return out


def _image_repo(cfg: Mapping[str, CfgVal]) -> str | None:
    from asynctorchx.schedulers._docker.engine import check_repository

    value = cfg.get("image_repo")
    if value is None or value == "":
        return None
    try:
        return check_repository(str(value))
    except ValueError as e:
        raise InvalidRunConfigException(str(e), "image_repo", cfg) from None


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
        "restart_timeout",
        "docker_host",
    }
    return KubernetesScheduler(session_name, **{k: v for k, v in kwargs.items() if k in known})
