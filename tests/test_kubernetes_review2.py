"""The ``kubernetes`` backend's fixes after the second review.

What was found:

- a ``pod_overlay`` (the run option, or a role's ``metadata['kubernetes']['pod_overlay']``) could
  set the pod labels the backend finds its pods by (``app.kubernetes.io/managed-by``,
  ``asynctorchx.dev/*``, the Job's completion-index label), which the ``labels`` option refuses:
  the app's pods then went unseen (exit codes lost, logs unreadable);
- a ``pod_overlay`` env entry named ``JOB_COMPLETION_INDEX`` was merged by name into the backend's
  ``valueFrom`` entry, making an entry with both ``value`` and ``valueFrom`` that the API server
  refuses at submit (a role's env with that name was already refused at the dry run);
- ``log_iter`` read no line of a pod to which an overlay added a sidecar: the log read named no
  container, the API server refused it (400, "a container name must be specified") and the refusal
  was only logged at debug level;
- an empty ``namespace`` option (``-cfg namespace=``) put the app in ``default``, not in the
  scheduler's own namespace.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import anyio
import pytest
from aiohttp import web
from k8s_fake import ApiError, FakeKubeApiServer, PodScript
from k8s_fake.testing import fake_k8s, k8s_scheduler, until
from test_kubernetes_backend import role

from asynctorchx.schedulers._k8s.manifests import KubernetesOptions, build_request, lint
from asynctorchx.schedulers.kubernetes import KubernetesScheduler
from asynctorchx.specs import (
    AppDef,
    AppState,
    InvalidAppDefException,
    InvalidRunConfigException,
)

__all__ = ["fake_k8s", "k8s_scheduler"]

pytestmark = pytest.mark.timeout(60)

NS = "default"
MANAGED_BY = "app.kubernetes.io/managed-by"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
INDEX_ENV = "JOB_COMPLETION_INDEX"
#: how a role's env naming INDEX_ENV is refused (the overlay's refusal says the same)
INDEX_ENV_REFUSED = "is set by Kubernetes for Indexed Jobs and cannot be overridden"


def app(name: str = "app", **kw: Any) -> AppDef:
    return AppDef(name, roles=[role(replicas=2, **kw)])


def overlay_cfg(overlay: dict[str, Any]) -> dict[str, Any]:
    return {"pod_overlay": json.dumps(overlay)}


def env_overlay(container: str, env: list[dict[str, Any]]) -> dict[str, Any]:
    return {"spec": {"containers": [{"name": container, "env": env}]}}


# -- reserved pod labels in a pod overlay ---------------------------------------------------------


@pytest.mark.parametrize(
    "label",
    [
        MANAGED_BY,
        "asynctorchx.dev/app-id",
        "asynctorchx.dev/role-name",
        "asynctorchx.dev/role-attempt",
        "asynctorchx.dev/app-attempt",
        "asynctorchx.dev/anything",
        COMPLETION_INDEX_LABEL,
    ],
)
def test_a_pod_overlay_setting_a_reserved_label_is_refused_naming_the_option_and_label(
    label: str,
) -> None:
    """A pod_overlay setting a pod label the backend sets itself (and finds its pods by: the
    watch's selector, the log reader, the attempts, the replica index) is refused at the dry run
    as the ``labels`` option refuses it, naming the option and the label."""
    with pytest.raises(InvalidRunConfigException, match=r"'pod_overlay'") as info:
        KubernetesScheduler("review").submit_dryrun(
            app(), overlay_cfg({"metadata": {"labels": {label: "other"}}})
        )
    assert repr(label) in str(info.value)


def test_a_role_pod_overlay_setting_a_reserved_label_is_refused_naming_the_role() -> None:
    """The same label in a role's metadata['kubernetes']['pod_overlay'] is refused naming the
    role, the field and the label."""
    overlay = {"metadata": {"labels": {MANAGED_BY: "helm"}}}
    bad = AppDef("app", roles=[role(metadata={"kubernetes": {"pod_overlay": overlay}})])
    with pytest.raises(
        InvalidAppDefException,
        match=r"role 'worker': metadata\['kubernetes'\]\['pod_overlay'\] must be .*"
        r"'app\.kubernetes\.io/managed-by'",
    ):
        KubernetesScheduler("review").submit_dryrun(bad, {})


@pytest.mark.parametrize(
    "overlay",
    [
        {"metadata": None},
        {"metadata": {"labels": None}},
        {"metadata": {"labels": {MANAGED_BY: None}}},
        {"metadata": {"labels": {"asynctorchx.dev/role-attempt": None}}},
    ],
)
def test_a_pod_overlay_removing_reserved_labels_is_refused(overlay: dict[str, Any]) -> None:
    """A null removes what it names from the template: removing the reserved labels (or every
    label, or the metadata holding them) is refused as setting them is."""
    with pytest.raises(InvalidRunConfigException, match=r"'pod_overlay'.*asynctorchx\.dev/\*"):
        KubernetesScheduler("review").submit_dryrun(app(), overlay_cfg(overlay))


def test_other_labels_pass_and_the_labels_option_refuses_the_same_keys() -> None:
    """Labels of the user's own pass in an overlay; the ``labels`` option and the overlay refuse
    one set of keys (the completion-index label, which the Job controller sets, included)."""
    sched = KubernetesScheduler("review")
    overlay = {"metadata": {"labels": {"team": "vision", "example.com/tier": "gold"}}}
    req = sched.submit_dryrun(app(), overlay_cfg(overlay)).request
    labels = req.jobs[0]["spec"]["template"]["metadata"]["labels"]
    assert labels["team"] == "vision" and labels[MANAGED_BY] == "asynctorchx"
    with pytest.raises(InvalidRunConfigException, match=r"'labels'.*which the backend sets"):
        sched.submit_dryrun(app(), {"labels": {COMPLETION_INDEX_LABEL: "3"}})


async def test_an_overlay_hiding_the_pods_is_refused_before_anything_is_created(
    fake_k8s: FakeKubeApiServer, k8s_scheduler: KubernetesScheduler
) -> None:
    """The reviewer's consequence (an overlay managed-by label hid the app's pods: no replica
    exit code, no log) cannot happen: the submit is refused before any request is sent."""
    overlay = {"metadata": {"labels": {MANAGED_BY: "helm"}}}
    with pytest.raises(InvalidRunConfigException, match=r"'pod_overlay'.*managed-by"):
        await k8s_scheduler.submit(AppDef("hidden", roles=[role()]), overlay_cfg(overlay))
    assert fake_k8s.requests_for("POST", "services") == []
    assert fake_k8s.requests_for("POST", "jobs") == []


# -- JOB_COMPLETION_INDEX in a pod overlay ----------------------------------------------------------


@pytest.mark.parametrize(
    "overlay",
    [
        env_overlay("worker", [{"name": INDEX_ENV, "value": "5"}]),
        env_overlay("worker", [{"name": INDEX_ENV, "valueFrom": {"fieldRef": {"fieldPath": "x"}}}]),
        env_overlay("sidecar", [{"name": "A", "value": "1"}, {"name": INDEX_ENV, "value": "5"}]),
    ],
)
def test_a_pod_overlay_setting_job_completion_index_is_refused_like_a_role_env(
    overlay: dict[str, Any],
) -> None:
    """An overlay env entry named JOB_COMPLETION_INDEX (merged by name into the backend's
    ``valueFrom`` entry, or in a sidecar, to which the Job controller gives it too) is refused at
    the dry run naming the option, the variable and why, in the words a role's env gets."""
    with pytest.raises(InvalidRunConfigException, match=r"'pod_overlay'") as info:
        KubernetesScheduler("review").submit_dryrun(app(), overlay_cfg(overlay))
    assert repr(INDEX_ENV) in str(info.value) and INDEX_ENV_REFUSED in str(info.value)
    with pytest.raises(InvalidAppDefException, match=rf"env\['{INDEX_ENV}'\] {INDEX_ENV_REFUSED}"):
        KubernetesScheduler("review").submit_dryrun(app(env={INDEX_ENV: "5"}), {})


def test_a_role_pod_overlay_setting_job_completion_index_is_refused_naming_the_role() -> None:
    """The same env entry in a role's pod overlay is refused naming the role and the field."""
    overlay = env_overlay("worker", [{"name": INDEX_ENV, "value": "5"}])
    bad = AppDef("app", roles=[role(metadata={"kubernetes": {"pod_overlay": overlay}})])
    with pytest.raises(
        InvalidAppDefException,
        match=rf"role 'worker': metadata\['kubernetes'\]\['pod_overlay'\] must be .*"
        rf"'{INDEX_ENV}'.*{INDEX_ENV_REFUSED}",
    ):
        KubernetesScheduler("review").submit_dryrun(bad, {})


def test_the_lint_flags_an_env_var_with_both_value_and_value_from() -> None:
    """The final lint of the manifests refuses an EnvVar holding both ``value`` and
    ``valueFrom`` (the API server's validation does), whatever put it there."""
    req = build_request(app(), KubernetesOptions(), "review")
    assert lint(req.manifests()) == []
    env = req.jobs[0]["spec"]["template"]["spec"]["containers"][0]["env"]
    index = next(e for e in env if e["name"] == INDEX_ENV)
    index["value"] = "5"
    problems = lint(req.manifests())
    assert any(INDEX_ENV in p and "value" in p and "valueFrom" in p for p in problems), problems


# -- log reads of a pod with a sidecar -------------------------------------------------------------


async def test_logs_of_a_pod_with_an_overlay_sidecar_are_the_role_containers(
    fake_k8s: FakeKubeApiServer, k8s_scheduler: KubernetesScheduler
) -> None:
    """pod_overlay merges containers by name and appends new ones (a sidecar). The log read names
    the role's container (the API server refuses a read without one on a pod with two), and
    returns its lines."""
    fake_k8s.cluster.script = lambda ctx: PodScript(lines=["hello\n"], exit_code=0)
    overlay = {"spec": {"containers": [{"name": "sidecar", "image": "busybox"}]}}
    app_id = await k8s_scheduler.submit(AppDef("side", roles=[role()]), overlay_cfg(overlay))
    await until(
        fake_k8s,
        lambda: any(
            p["status"].get("phase") == "Succeeded" for p in fake_k8s.store.list("pods", NS)
        ),
    )
    (pod,) = fake_k8s.store.list("pods", NS)
    assert [c["name"] for c in pod["spec"]["containers"]] == ["worker", "sidecar"]
    lines = [line async for line in k8s_scheduler.log_iter(app_id, "worker", 0)]
    assert lines == ["hello\n"]
    reads = [r for r in fake_k8s.requests if r.path.endswith("/log")]
    assert reads and all(r.query.get("container") == "worker" for r in reads)


def refusing_logs(message: str) -> Any:
    """An intercept answering every log read with a 400 saying ``message``."""

    async def intercept(request: web.Request) -> web.Response | None:
        if not request.path.endswith("/log"):
            return None
        status = ApiError(400, "BadRequest", message).status()
        return web.Response(
            status=400, body=json.dumps(status).encode(), content_type="application/json"
        )

    return intercept


@pytest.mark.parametrize(
    ("message", "warned"),
    [
        ("container worker is not valid for pod p", True),
        ('container "worker" in pod "p" is waiting to start: ContainerCreating', False),
    ],
)
async def test_a_refused_log_read_is_a_warning_unless_the_container_is_yet_to_start(
    fake_k8s: FakeKubeApiServer,
    k8s_scheduler: KubernetesScheduler,
    caplog: pytest.LogCaptureFixture,
    message: str,
    warned: bool,
) -> None:
    """A log read the API server refuses (400) for another reason than a container not started
    yet is logged as a warning quoting it (it was a debug line: no line and no word why); the
    expected 400 of a container yet to start stays quiet."""
    fake_k8s.cluster.script = lambda ctx: PodScript(lines=["hello\n"], exit_code=0)
    app_id = await k8s_scheduler.submit(AppDef("refused", roles=[role()]), {})
    await until(
        fake_k8s,
        lambda: any(
            p["status"].get("phase") == "Succeeded" for p in fake_k8s.store.list("pods", NS)
        ),
    )
    fake_k8s.intercept = refusing_logs(message)
    with caplog.at_level(logging.DEBUG, logger="asynctorchx.schedulers._k8s.logs"):
        lines = [line async for line in k8s_scheduler.log_iter(app_id, "worker", 0)]
    assert lines == []
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    if warned:
        assert len(warnings) == 1 and message in warnings[0].getMessage(), warnings
    else:
        assert warnings == []


async def test_a_followed_log_that_stays_refused_warns_once_per_pod(
    fake_k8s: FakeKubeApiServer,
    k8s_scheduler: KubernetesScheduler,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A follow tries a refused read again and again: the warning comes once for the pod, not at
    every try."""
    hold = asyncio.Event()
    fake_k8s.cluster.script = lambda ctx: PodScript(lines=["hello\n"], hold=hold)
    app_id = await k8s_scheduler.submit(AppDef("refusedf", roles=[role()]), {})
    await until(
        fake_k8s,
        lambda: any(p["status"].get("phase") == "Running" for p in fake_k8s.store.list("pods", NS)),
    )
    fake_k8s.intercept = refusing_logs("container worker is not valid for pod p")
    with caplog.at_level(logging.WARNING, logger="asynctorchx.schedulers._k8s.logs"):
        with anyio.move_on_after(1.5):
            async for _ in k8s_scheduler.log_iter(app_id, "worker", 0, should_tail=True):
                pass
    hold.set()
    reads = [r for r in fake_k8s.requests if r.path.endswith("/log")]
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(reads) > 1 and len(warnings) == 1, (len(reads), warnings)


# -- an empty namespace option ---------------------------------------------------------------------


def test_an_empty_namespace_option_means_the_schedulers_namespace() -> None:
    """``namespace=''`` (``-cfg namespace=``) reads as unset: the scheduler's namespace applies to
    every object and to the app id, not ``default``."""
    info = KubernetesScheduler("review", namespace="team").submit_dryrun(app(), {"namespace": ""})
    req = info.request
    assert req.namespace == "team" and req.app_id.startswith("team:")
    assert {o["metadata"]["namespace"] for o in req.manifests()} == {"team"}
    plain = KubernetesScheduler("review").submit_dryrun(app(), {"namespace": ""}).request
    assert plain.namespace == "default"


async def test_an_app_submitted_with_an_empty_namespace_lives_in_the_schedulers_namespace(
    fake_k8s: FakeKubeApiServer,
) -> None:
    """Submitted with ``namespace=''``, the app's objects are in the scheduler's namespace, and
    describe, log_iter, list and cancel (which read the namespace from the app id) find it."""
    hold = asyncio.Event()
    fake_k8s.cluster.script = lambda ctx: PodScript(lines=["hi\n"], hold=hold)
    sched = KubernetesScheduler(
        "test", namespace="team", k8s_configuration=fake_k8s.configuration()
    )
    try:
        app_id = await sched.submit(AppDef("emptyns", roles=[role()]), {"namespace": ""})
        assert app_id.startswith("team:")
        name = app_id.split(":")[1]
        assert fake_k8s.store.find("services", "team", name) is not None
        assert fake_k8s.store.list("services", NS) == []
        await until(
            fake_k8s,
            lambda: any(
                p["status"].get("phase") == "Running" for p in fake_k8s.store.list("pods", "team")
            ),
        )
        resp = await sched.describe(app_id)
        assert resp is not None and resp.state == AppState.RUNNING
        assert [a.app_id for a in await sched.list()] == [app_id]
        with anyio.fail_after(30):
            async for line in sched.log_iter(app_id, "worker", 0, should_tail=True):
                assert line == "hi\n"
                break
        await sched.cancel(app_id)
        deletes = fake_k8s.requests_for("DELETE", "services")
        assert [r.path.split("/")[4] for r in deletes] == ["team"]
        await until(fake_k8s, lambda: fake_k8s.store.find("services", "team", name) is None)
        resp = await sched.describe(app_id)
        assert resp is not None and resp.state == AppState.CANCELLED
    finally:
        hold.set()
        await sched.close()
