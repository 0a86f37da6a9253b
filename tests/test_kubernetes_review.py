"""The ``kubernetes`` backend's fixes after the review: failed or interrupted role restarts read
FAILED, device mount permissions, requests that leave the node's reserve out, the Istio sidecar
opt-out, ``min_replicas`` documented, and API errors that say what was being done."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
from aiohttp import web
from k8s_fake import FakeKubeApiServer, PodScript
from k8s_fake.testing import fake_k8s, k8s_scheduler, until

import asynctorchx.schedulers.kubernetes as kubernetes_module
from asynctorchx.schedulers._k8s import names as n
from asynctorchx.schedulers._k8s.client import KubeApiError
from asynctorchx.schedulers._k8s.manifests import KubernetesOptions, build_request, lint
from asynctorchx.schedulers._k8s.status import describe_app
from asynctorchx.schedulers.api import DescribeAppResponse
from asynctorchx.schedulers.kubernetes import KubernetesScheduler
from asynctorchx.specs import (
    AppDef,
    AppState,
    DeviceMount,
    InvalidRunConfigException,
    Resource,
    RetryPolicy,
    Role,
)
from asynctorchx.specs import named_resources_aws as nra

__all__ = ["fake_k8s", "k8s_scheduler"]

# what these tests pin is new: its names are imported where used, so that each test fails on its
# own (not the whole module at collection) on a tree without it

NS = "default"
ISTIO = "sidecar.istio.io/inject"
#: the restart record on an app's Service (read by any process, so part of the contract)
RESTART = "asynctorchx.dev/restart"


def dryrun(app: AppDef, cfg: dict[str, Any] | None = None) -> Any:
    return KubernetesScheduler("review").submit_dryrun(app, cfg or {}).request


def template(req: Any, i: int = 0) -> dict[str, Any]:
    return dict(req.jobs[i]["spec"]["template"])


def one_role(**kw: Any) -> AppDef:
    return AppDef("app", roles=[Role("r", image="img", entrypoint="python", **kw)])


async def described(
    sched: KubernetesScheduler, app_id: str, state: AppState, timeout: float = 20.0
) -> DescribeAppResponse:
    """The app's description once it reads ``state`` (fails with the last one otherwise)."""
    deadline = time.monotonic() + timeout
    while True:
        resp = await sched.describe(app_id)
        assert resp is not None
        if resp.state == state or time.monotonic() > deadline:
            assert resp.state == state, f"app reads {resp.state} ({resp.msg!r})"
            return resp
        await asyncio.sleep(0.05)


# -- device mounts -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("permissions", "read_only"),
    [("r", True), ("rw", False), ("rm", False), ("rwm", False)],
)
def test_a_device_mount_is_read_only_without_the_w_or_m_permission(
    permissions: str, read_only: bool
) -> None:
    """A DeviceMount is mounted read-only unless its permissions hold 'w' or 'm' (as TorchX)."""
    app = one_role(mounts=[DeviceMount("/dev/nvme0", "/dev/nvme0", permissions=permissions)])
    mounts = template(dryrun(app))["spec"]["containers"][0]["volumeMounts"]
    dev = next(m for m in mounts if m["mountPath"] == "/dev/nvme0")
    assert dev["readOnly"] is read_only


# -- Istio ---------------------------------------------------------------------------------------


def test_pods_opt_out_of_istio_sidecar_injection_unless_the_overlay_says_otherwise() -> None:
    """Pods are annotated sidecar.istio.io/inject: "false"; a pod overlay can set or remove it."""
    annotations = template(dryrun(one_role()))["metadata"]["annotations"]
    assert annotations == {ISTIO: "false"}
    removed = json.dumps({"metadata": {"annotations": {ISTIO: None}}})
    tpl = template(dryrun(one_role(), {"pod_overlay": removed}))
    assert ISTIO not in (tpl["metadata"].get("annotations") or {})
    forced = json.dumps({"metadata": {"annotations": {ISTIO: "true"}}})
    tpl = template(dryrun(one_role(), {"pod_overlay": forced}))
    assert tpl["metadata"]["annotations"][ISTIO] == "true"


# -- requests and limits -------------------------------------------------------------------------


def test_a_named_instance_resource_requests_less_than_the_instance_it_is_pinned_to() -> None:
    """aws_p3_2xlarge (8 CPUs, 61 GB, pinned to p3.2xlarge nodes) requests 100m and 1024 MiB
    less than its limits, which stay the whole instance; the manifests validate strictly."""
    res = nra.aws_p3_2xlarge()
    req = dryrun(one_role(resource=res))
    tpl = template(req)
    assert tpl["spec"]["nodeSelector"]["node.kubernetes.io/instance-type"] == "p3.2xlarge"
    resources = tpl["spec"]["containers"][0]["resources"]
    assert resources["limits"]["cpu"] == "8"
    assert resources["requests"]["cpu"] == "7900m"
    assert resources["limits"]["memory"] == f"{res.memMB}Mi"
    assert resources["requests"]["memory"] == f"{res.memMB - 1024}Mi"
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
    assert lint(req.manifests()) == []
    for obj in req.manifests():
        kubernetes_validate.validate(obj, "1.29", strict=True)


def test_the_reserves_are_run_options_and_zero_makes_requests_equal_limits() -> None:
    """reserved_millicpu / reserved_memmb change the reserves; 0 requests the limits."""
    app = one_role(resource=Resource(cpu=2, gpu=0, memMB=4096))
    got = template(dryrun(app, {"reserved_millicpu": 500, "reserved_memmb": 2048}))
    assert got["spec"]["containers"][0]["resources"]["requests"] == {
        "cpu": "1500m",
        "memory": "2048Mi",
    }
    got = template(dryrun(app, {"reserved_millicpu": 0, "reserved_memmb": 0}))
    resources = got["spec"]["containers"][0]["resources"]
    assert resources["requests"] == resources["limits"] == {"cpu": "2", "memory": "4096Mi"}
    opts = KubernetesScheduler("review").run_opts()
    assert opts.get("reserved_millicpu") is not None and opts.get("reserved_memmb") is not None


def test_a_limit_not_larger_than_its_reserve_is_requested_in_full() -> None:
    """A container smaller than the reserve requests its whole limit (never 0)."""
    app = one_role(resource=Resource(cpu=0.1, gpu=0, memMB=512))
    resources = template(dryrun(app))["spec"]["containers"][0]["resources"]
    assert resources["requests"] == resources["limits"] == {"cpu": "100m", "memory": "512Mi"}
    app = one_role(resource=Resource(cpu=0.25, gpu=0, memMB=1024.5))
    requests = template(dryrun(app))["spec"]["containers"][0]["resources"]["requests"]
    assert requests == {"cpu": "150m", "memory": "512Ki"}


@pytest.mark.parametrize("key", ["reserved_millicpu", "reserved_memmb"])
def test_a_negative_reserve_is_refused_naming_the_option(key: str) -> None:
    """A negative reserve fails the dry run with an error naming the option and the value."""
    with pytest.raises(InvalidRunConfigException, match=rf"{key}.*-5"):
        dryrun(one_role(resource=Resource(cpu=2, gpu=0, memMB=4096)), {key: -5})


def test_the_lint_refuses_requests_above_limits_and_uneven_device_requests() -> None:
    """The lint reports a CPU request above its limit and a GPU request unlike its limit."""
    from asynctorchx.schedulers._k8s.manifests import quantity_value

    req = dryrun(one_role(resource=Resource(cpu=2, gpu=1, memMB=4096)))
    objs = copy.deepcopy(req.manifests())
    resources = objs[1]["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert lint(objs) == []
    resources["requests"]["cpu"] = "2001m"
    resources["requests"]["nvidia.com/gpu"] = 2
    problems = "\n".join(lint(objs))
    assert "requests more cpu than its limit" in problems
    assert "'nvidia.com/gpu' differ from its limit" in problems
    assert quantity_value("1.5Gi") == 1.5 * 2**30 and quantity_value("16 GB") is None


# -- min_replicas --------------------------------------------------------------------------------


def test_min_replicas_is_accepted_and_documented_as_not_gang_scheduled() -> None:
    """min_replicas (dist.ddp -j MIN:MAX) passes the dry run, starts every replica, and the
    module docstring says so (plain Jobs are not gang-scheduled; torchrun's --nnodes is)."""
    app = one_role(num_replicas=4, min_replicas=1)
    job = dryrun(app).jobs[0]
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 4
    doc = kubernetes_module.__doc__ or ""
    assert "min_replicas" in doc and "gang-scheduled" in doc and "--nnodes MIN:MAX" in doc


# -- API errors ----------------------------------------------------------------------------------


async def test_a_server_error_creating_a_job_names_the_job_and_its_role(
    fake_k8s: FakeKubeApiServer, k8s_scheduler: KubernetesScheduler
) -> None:
    """A 503 (plain text, from a proxy) to a Job create fails the submit with a KubeApiError
    naming the Job and its role, keeping the status; the Service is deleted again."""

    async def gateway(request: web.Request) -> web.Response | None:
        if request.method == "POST" and request.path.endswith("/jobs"):
            return web.Response(status=503, text="upstream connect error")
        return None

    fake_k8s.intercept = gateway
    app = AppDef("broken", roles=[Role("trainer", image="img", entrypoint="python")])
    with pytest.raises(KubeApiError) as info:
        await k8s_scheduler.submit(app, {})
    fake_k8s.intercept = None
    assert fake_k8s.store.list("services", NS) == []
    err = info.value
    assert err.status == 503 and err.message == "upstream connect error"
    assert str(err).startswith(f"creating Job {NS}/broken-"), str(err)
    assert "-trainer (role 'trainer'): Kubernetes API error 503" in str(err)


async def test_a_refused_service_create_names_the_service(
    fake_k8s: FakeKubeApiServer, k8s_scheduler: KubernetesScheduler
) -> None:
    """A Service create the server refuses fails with an error naming the Service."""

    async def forbid(request: web.Request) -> web.Response | None:
        if request.method == "POST" and request.path.endswith("/services"):
            return web.json_response(
                {"kind": "Status", "code": 403, "reason": "Forbidden", "message": "no"},
                status=403,
            )
        return None

    fake_k8s.intercept = forbid
    with pytest.raises(KubeApiError, match=rf"^creating Service {NS}/app-\w+: .*403 Forbidden: no"):
        await k8s_scheduler.submit(one_role(), {})
    fake_k8s.intercept = None


# -- role restarts -------------------------------------------------------------------------------


def _quota_refusal() -> web.Response:
    return web.json_response(
        {
            "kind": "Status",
            "status": "Failure",
            "reason": "Forbidden",
            "code": 403,
            "message": 'jobs "x" is forbidden: exceeded quota',
        },
        status=403,
    )


async def test_a_role_restart_whose_job_recreate_is_refused_reads_failed_naming_role_and_reason(
    fake_k8s: FakeKubeApiServer,
) -> None:
    """ROLE retry whose Job re-create is refused (403 quota): the app reads FAILED, naming the
    role and the refusal, in the submitting process and in any other (not PENDING for ever)."""
    fake_k8s.cluster.script = lambda ctx: PodScript(exit_code=1)
    sched = KubernetesScheduler("test", k8s_configuration=fake_k8s.configuration())
    other = KubernetesScheduler("other", k8s_configuration=fake_k8s.configuration())
    try:
        sched.subscribe(lambda _app_id: None)  # the watch that drives the follow-ups
        refused = asyncio.Event()

        async def quota(request: web.Request) -> web.Response | None:
            if request.method == "POST" and request.path.endswith("/jobs"):
                refused.set()
                return _quota_refusal()
            return None

        app = AppDef(
            "quota",
            roles=[
                Role(
                    "r",
                    image="img",
                    entrypoint="python",
                    max_retries=1,
                    retry_policy=RetryPolicy.ROLE,
                )
            ],
        )
        app_id = await sched.submit(app, {})
        fake_k8s.intercept = quota  # the first create went through; the restart's is refused
        await asyncio.wait_for(refused.wait(), 20)
        for reader in (sched, other):
            resp = await described(reader, app_id, AppState.FAILED)
            assert "role 'r' failed and could not be restarted" in resp.msg, resp.msg
            assert "exceeded quota" in resp.msg and "(restarting role 'r')" in resp.msg
        assert fake_k8s.store.list("jobs", NS) == []
    finally:
        fake_k8s.intercept = None
        await other.close()
        await sched.close()


async def test_a_restart_interrupted_between_delete_and_create_reads_failed_once_stale(
    fake_k8s: FakeKubeApiServer, k8s_scheduler: KubernetesScheduler
) -> None:
    """A restart recorded on the Service whose process stopped after deleting the Job: RUNNING
    (restarting) while the record is fresh, FAILED ("interrupted", naming the role) once it is
    older than the bound; an app without a record and without its Job still reads PENDING."""
    from asynctorchx.schedulers._k8s.status import RESTART_STALE_NS, RestartRecord

    hold = asyncio.Event()
    fake_k8s.cluster.script = lambda ctx: PodScript(hold=hold)
    app_id = await k8s_scheduler.submit(one_role(), {})
    name = app_id.split(":")[1]
    await until(fake_k8s, lambda: bool(fake_k8s.store.list("pods", NS)))
    fake_k8s.store.delete("jobs", NS, f"{name}-r", "Background")
    await until(fake_k8s, lambda: fake_k8s.store.list("jobs", NS) == [])
    assert (await k8s_scheduler.describe(app_id)).state == AppState.PENDING  # type: ignore[union-attr]

    def record(age_s: float) -> None:
        at_ns = time.time_ns() - int(age_s * 1e9)
        value = RestartRecord((0,), 0, (1,), at_ns).to_json()
        fake_k8s.store.patch("services", NS, name, {"metadata": {"annotations": {RESTART: value}}})

    record(1)
    assert (await k8s_scheduler.describe(app_id)).state == AppState.RUNNING  # type: ignore[union-attr]
    record(RESTART_STALE_NS / 1e9 + 60)
    resp = await k8s_scheduler.describe(app_id)
    assert resp is not None and resp.state == AppState.FAILED
    assert "the restart of role 'r' was interrupted" in resp.msg, resp.msg
    hold.set()


async def test_a_normal_role_restart_still_works_and_leaves_no_record(
    fake_k8s: FakeKubeApiServer,
) -> None:
    """ROLE retry: the failed Job is recreated, the app succeeds with one restart, and the restart
    record written on the Service meanwhile is gone."""
    fake_k8s.cluster.script = lambda ctx: PodScript(exit_code=1 if ctx.role_attempt == 0 else 0)
    seen: list[str] = []
    unsubscribe = fake_k8s.store.subscribe(
        lambda ev: seen.extend(
            str(ann)
            for ann in [((ev.obj.get("metadata") or {}).get("annotations") or {}).get(RESTART)]
            if ann
        )
    )
    sched = KubernetesScheduler("test", k8s_configuration=fake_k8s.configuration())
    try:
        sched.subscribe(lambda _app_id: None)
        app = one_role(max_retries=1, retry_policy=RetryPolicy.ROLE)
        app_id = await sched.submit(app, {})
        resp = await described(sched, app_id, AppState.SUCCEEDED)
        assert resp.num_restarts == 1
        name = app_id.split(":")[1]
        await until(
            fake_k8s,
            lambda: (
                RESTART
                not in (
                    fake_k8s.store.get("services", NS, name)["metadata"].get("annotations") or {}
                )
            ),
        )
        assert seen and json.loads(seen[0])["roles"] == [0]
    finally:
        unsubscribe()
        await sched.close()


def test_a_recorded_restart_is_judged_from_the_jobs_and_its_age() -> None:
    """describe_app: a record whose Jobs are recreated is ignored; a pending one reads RUNNING
    while fresh, FAILED when stale or when it holds an error; no record: PENDING."""
    from asynctorchx.schedulers._k8s.status import RESTART_STALE_NS, RestartRecord

    req = build_request(one_role(), KubernetesOptions(), "sess", app_name="demo-abcdefgh")
    now = time.time_ns()
    service = copy.deepcopy(req.service)
    assert describe_app(service, [], [], now_ns=now).state == AppState.PENDING

    def with_record(rec: RestartRecord) -> dict[str, Any]:
        svc = copy.deepcopy(req.service)
        svc["metadata"]["annotations"][RESTART] = rec.to_json()
        return svc

    fresh = RestartRecord((0,), 0, (1,), now)
    assert describe_app(with_record(fresh), [], [], now_ns=now).state == AppState.RUNNING
    stale = describe_app(with_record(fresh), [], [], now_ns=now + RESTART_STALE_NS + 10**9)
    assert stale.state == AppState.FAILED and "'r' was interrupted" in stale.msg
    failed = RestartRecord((0,), 0, (1,), now, "quota exceeded")
    resp = describe_app(with_record(failed), [], [], now_ns=now)
    assert resp.state == AppState.FAILED
    assert resp.msg == "role 'r' failed and could not be restarted: quota exceeded"
    recreated = copy.deepcopy(req.jobs[0])
    recreated["metadata"]["labels"][n.LABEL_ROLE_ATTEMPT] = "1"
    old = describe_app(with_record(failed), [recreated], [], now_ns=now + 10 * RESTART_STALE_NS)
    assert old.state == AppState.PENDING
    assert RestartRecord.of({"metadata": {"annotations": {RESTART: "{bad"}}}) is None
