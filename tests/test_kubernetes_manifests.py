"""Dry runs of the kubernetes backend: the manifests it would submit, without any cluster.

The manifests are validated offline against the official Kubernetes OpenAPI schemas in strict mode
(``kubernetes-validate``) at the oldest supported version (1.29) and the newest the package ships,
plus the backend's own lint for what the schemas do not check (name lengths, enums, quantities,
``clusterIP: "None"`` as a string). Set ``ASYNCTORCHX_UPDATE_GOLDEN=1`` to rewrite the golden file.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from asynctorchx.schedulers._k8s import names
from asynctorchx.schedulers._k8s.manifests import (
    KubernetesRequest,
    lint,
    merge_overlay,
    parse_toleration,
)
from asynctorchx.schedulers.kubernetes import KubernetesScheduler
from asynctorchx.specs import (
    AppDef,
    BindMount,
    DeviceMount,
    InvalidAppDefException,
    InvalidRunConfigException,
    Resource,
    RetryPolicy,
    Role,
    VolumeMount,
    macros,
)
from asynctorchx.version import __version__

GOLDEN = Path(__file__).parent / "golden" / "kubernetes" / "two_roles_two_replicas.yaml"
OLDEST = "1.29"
NEWEST = kubernetes_validate.latest_version()


def scheduler() -> KubernetesScheduler:
    return KubernetesScheduler("sess")


def device_role(devices: dict[str, int]) -> Role:
    return Role(
        "w", image="i", entrypoint="e", resource=Resource(cpu=1, gpu=0, memMB=1, devices=devices)
    )


def two_role_app() -> AppDef:
    return AppDef(
        "trainer",
        roles=[
            Role(
                "trainer",
                image="ghcr.io/example/train:1.0",
                entrypoint="bash",
                args=[
                    "-c",
                    f"torchrun --nnodes=2 --node_rank={macros.replica_id}"
                    f" --rdzv_endpoint=$${{{macros.rank0_env}:=localhost}}:29500"
                    f" train.py --out /ckpt/{macros.app_id}",
                ],
                env={"LOG_LEVEL": "info", "REPLICA": macros.replica_id},
                num_replicas=2,
                max_retries=2,
                retry_policy=RetryPolicy.REPLICA,
                resource=Resource(cpu=4, gpu=1, memMB=16384),
                port_map={"c10d": 29500},
                mounts=[VolumeMount(src="checkpoints", dst_path="/ckpt")],
            ),
            Role(
                "reader",
                image="ghcr.io/example/reader:1.0",
                entrypoint="python",
                args=["-m", "reader", "--shard", macros.replica_id],
                num_replicas=2,
                max_retries=1,
                retry_policy=RetryPolicy.APPLICATION,
                resource=Resource(cpu=0.5, gpu=0, memMB=1536),
                mounts=[BindMount(src_path="/data", dst_path="/data", read_only=True)],
            ),
        ],
    )


def normalized_yaml(req: KubernetesRequest) -> str:
    text = str(req)
    return text.replace(req.name, "trainer-00000000").replace(
        f"asynctorchx.dev/version: {__version__}", "asynctorchx.dev/version: VERSION"
    )


def validate_all(objs: list[dict[str, Any]], version: str) -> None:
    for obj in objs:
        kubernetes_validate.validate(obj, version, strict=True)


def test_golden_two_roles_two_replicas() -> None:
    """The dry run of a 2-role x 2-replica app matches the golden manifests."""
    info = scheduler().submit_dryrun(
        two_role_app(), {"namespace": "ml", "service_account": "trainer"}
    )
    got = normalized_yaml(info.request)
    if os.environ.get("ASYNCTORCHX_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(got)
    assert got == GOLDEN.read_text()


@pytest.mark.parametrize("version", [OLDEST, NEWEST])
def test_golden_manifests_validate_strictly(version: str) -> None:
    """The golden manifests pass strict OpenAPI validation at the oldest and newest versions."""
    objs = list(yaml.safe_load_all(GOLDEN.read_text()))
    assert [o["kind"] for o in objs] == ["Service", "Job", "Job"]
    validate_all(objs, version)
    assert lint(objs) == []


@pytest.mark.parametrize("version", [OLDEST, NEWEST])
def test_every_option_validates_strictly(version: str) -> None:
    """A dry run using every run option and mount kind passes strict validation."""
    app = two_role_app()
    app.roles[1].mounts.append(DeviceMount(src_path="/dev/fuse", dst_path="/dev/fuse"))
    app.roles[0].resource.devices["vpc.amazonaws.com/efa"] = 2
    app.roles[0].metadata["kubernetes"] = {"pod_overlay": {"spec": {"hostIPC": True}}}
    cfg = {
        "namespace": "team-a",
        "service_account": "runner",
        "priority_class": "high",
        "node_selector": {"cloud.google.com/gke-accelerator": "nvidia-l4"},
        "tolerations": ["nvidia.com/gpu=present:NoSchedule", "dedicated:NoExecute", "spot"],
        "image_pull_secrets": ["regcred"],
        "image_pull_policy": "IfNotPresent",
        "labels": {"team": "vision"},
        "queue": "team-a",
        "pod_overlay": json.dumps({"spec": {"schedulerName": "custom"}}),
        "rank0_localhost": False,
    }
    req = scheduler().submit_dryrun(app, cfg).request
    validate_all(req.manifests(), version)
    assert lint(req.manifests()) == []
    pod = req.jobs[0]["spec"]["template"]["spec"]
    assert pod["schedulerName"] == "custom" and pod["hostIPC"] is True
    assert pod["tolerations"][2] == {"key": "spot", "operator": "Exists"}
    assert req.jobs[1]["spec"]["template"]["spec"]["containers"][0]["securityContext"] == {
        "privileged": True
    }
    assert req.service["metadata"]["labels"]["team"] == "vision"
    assert all(j["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a" for j in req.jobs)


@pytest.mark.parametrize("version", [OLDEST, NEWEST])
@pytest.mark.parametrize(
    "cfg",
    [
        {"queue": "team-a", "priority_class": "high-priority"},
        {"labels": {"kueue.x-k8s.io/queue-name": "team-a"}, "priority_class": "high-priority"},
    ],
    ids=["queue", "queue-label"],
)
def test_kueue_queue_labels_and_suspends_the_jobs(cfg: dict[str, Any], version: str) -> None:
    """queue (or its label): each Job is labelled for Kueue and created suspended; schema-valid."""
    req = scheduler().submit_dryrun(two_role_app(), cfg).request
    validate_all(req.manifests(), version)
    assert lint(req.manifests()) == []
    for job in req.jobs:
        assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert job["spec"]["suspend"] is True
        assert job["spec"]["template"]["spec"]["priorityClassName"] == "high-priority"
    if "queue" in cfg:  # only the Jobs are Kueue's: neither the pods nor the Service are labelled
        assert "kueue.x-k8s.io/queue-name" not in req.service["metadata"]["labels"]
        for job in req.jobs:
            assert "kueue.x-k8s.io/queue-name" not in job["spec"]["template"]["metadata"]["labels"]
    plain = scheduler().submit_dryrun(two_role_app(), {}).request
    assert all("suspend" not in j["spec"] for j in plain.jobs)


def test_kueue_queue_is_a_run_option_like_torchxs() -> None:
    """The kubernetes backend has TorchX's queue run option (optional here: Kueue, not Volcano)."""
    opt = scheduler().run_opts().get("queue")
    assert opt is not None and opt.opt_type is str and not opt.is_required
    assert "Kueue" in opt.help


def test_dryrun_layout() -> None:
    """The Service owns nothing yet, selects every pod, and each Job is Indexed with its retries."""
    req = scheduler().submit_dryrun(two_role_app(), {}).request
    name = req.name
    assert req.app_id == f"default:{name}"
    assert req.service["spec"]["clusterIP"] == "None"
    assert req.service["spec"]["publishNotReadyAddresses"] is True
    trainer, reader = req.jobs
    assert trainer["metadata"]["name"] == f"{name}-trainer"
    assert trainer["spec"]["completions"] == trainer["spec"]["parallelism"] == 2
    assert trainer["spec"]["backoffLimitPerIndex"] == 2 and trainer["spec"]["maxFailedIndexes"] == 0
    assert reader["spec"]["backoffLimit"] == 0 and "backoffLimitPerIndex" not in reader["spec"]
    for job in req.jobs:
        assert job["spec"]["podReplacementPolicy"] == "Failed"
        assert job["spec"]["podFailurePolicy"]["rules"][0]["action"] == "Ignore"
        assert job["spec"]["template"]["spec"]["subdomain"] == name
        assert "ownerReferences" not in job["metadata"]
    assert req.needs_live_retries


def test_macros_become_kubernetes_references() -> None:
    """replica_id becomes $(JOB_COMPLETION_INDEX), declared first; app_id and rank0_env are filled."""
    req = scheduler().submit_dryrun(two_role_app(), {}).request
    c = req.jobs[0]["spec"]["template"]["spec"]["containers"][0]
    assert c["args"] == [
        "-c",
        "torchrun --nnodes=2 --node_rank=$(JOB_COMPLETION_INDEX)"
        " --rdzv_endpoint=${TORCHX_RANK0_HOST:=localhost}:29500"
        f" train.py --out /ckpt/{req.name}",
    ]
    env = {e["name"]: e for e in c["env"]}
    assert c["env"][0]["name"] == "JOB_COMPLETION_INDEX"
    assert "fieldRef" in c["env"][0]["valueFrom"]
    assert env["REPLICA"]["value"] == "$(JOB_COMPLETION_INDEX)"
    assert env["TORCHX_RANK0_HOST"]["value"] == f"{req.name}-trainer-0.{req.name}"
    assert c["command"][:2] == ["/bin/sh", "-c"] and c["command"][-1] == "bash"


def test_resources_requests_are_the_limits_less_the_reserves() -> None:
    """CPU and memory are limited to the role's amounts and requested less 100m and 1024 MiB
    (GPUs in full); with both reserves 0, requests equal limits."""
    req = scheduler().submit_dryrun(two_role_app(), {}).request
    trainer = req.jobs[0]["spec"]["template"]["spec"]["containers"][0]["resources"]
    reader = req.jobs[1]["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert trainer["limits"] == {"cpu": "4", "memory": "16384Mi", "nvidia.com/gpu": 1}
    assert trainer["requests"] == {"cpu": "3900m", "memory": "15360Mi", "nvidia.com/gpu": 1}
    assert reader["limits"] == {"cpu": "500m", "memory": "1536Mi"}
    cfg = {"reserved_millicpu": 0, "reserved_memmb": 0}
    req = scheduler().submit_dryrun(two_role_app(), cfg).request
    trainer = req.jobs[0]["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert (
        trainer["limits"]
        == trainer["requests"]
        == {"cpu": "4", "memory": "16384Mi", "nvidia.com/gpu": 1}
    )


def test_dryrun_does_no_io_and_does_not_change_the_app() -> None:
    """A dry run needs no cluster and leaves the AppDef as it was."""
    app = two_role_app()
    before = repr(app)
    info = KubernetesScheduler("s", kubeconfig="/nonexistent/kubeconfig").submit_dryrun(app, {})
    assert repr(app) == before
    assert "kind: Job" in repr(info)


def test_long_app_name_is_truncated_to_fit() -> None:
    """An app name longer than the budget is shortened so every derived name fits 63 characters."""
    app = two_role_app()
    app.name = "a-really-long-application-name-that-goes-on-and-on-forever"
    req = scheduler().submit_dryrun(app, {}).request
    assert len(req.name) <= names.APP_ID_MAX_LENGTH
    assert lint(req.manifests()) == []
    for job in req.jobs:
        assert len(f"{job['metadata']['name']}-{job['spec']['completions'] - 1}") <= 63


def test_role_name_too_long_fails_with_a_clear_error() -> None:
    """A role name that leaves no room for the app id in a 63-character hostname is rejected."""
    app = AppDef("x", roles=[Role("r" * 60, image="i", entrypoint="e", num_replicas=10)])
    with pytest.raises(InvalidAppDefException, match=r"role 'r{60}'.*63 characters.*at most \d+"):
        scheduler().submit_dryrun(app, {})


def test_bad_memory_fails_with_a_clear_error() -> None:
    """Memory that Kubernetes cannot represent (infinite, negative) names the field and value."""
    inf = AppDef(
        "x",
        roles=[
            Role(
                "w", image="i", entrypoint="e", resource=Resource(cpu=1, gpu=0, memMB=float("inf"))
            )
        ],
    )
    with pytest.raises(InvalidAppDefException, match=r"role 'w'.*resource\.memMB.*inf"):
        scheduler().submit_dryrun(inf, {})
    negative = AppDef(
        "x", roles=[Role("w", image="i", entrypoint="e", resource=Resource(cpu=1, gpu=0, memMB=-5))]
    )
    with pytest.raises(InvalidAppDefException, match=r"resource\.memMB.*-5"):
        scheduler().submit_dryrun(negative, {})


def test_counts_kubernetes_cannot_hold_fail_at_the_dry_run() -> None:
    """More replicas than an Indexed Job may run (100 000) and per-replica retries past a 32-bit
    backoffLimitPerIndex are refused at the dry run, naming the role and the field (the API server
    refused them only at submit); the largest allowed values pass and validate."""
    big = Role("w", image="i", entrypoint="e", num_replicas=100_001)
    with pytest.raises(InvalidAppDefException, match=r"role 'w'.*num_replicas.*100000.*100001"):
        scheduler().submit_dryrun(AppDef("x", roles=[big]), {})
    huge = Role("w", image="i", entrypoint="e", num_replicas=2**31)
    with pytest.raises(InvalidAppDefException, match=r"num_replicas.*2147483648"):
        scheduler().submit_dryrun(AppDef("x", roles=[huge]), {})
    retries = Role(
        "w", image="i", entrypoint="e", max_retries=2**31, retry_policy=RetryPolicy.REPLICA
    )
    with pytest.raises(InvalidAppDefException, match=r"role 'w'.*max_retries.*2147483648"):
        scheduler().submit_dryrun(AppDef("x", roles=[retries]), {})
    most = Role(
        "w",
        image="i",
        entrypoint="e",
        num_replicas=100_000,
        max_retries=2**31 - 1,
        retry_policy=RetryPolicy.REPLICA,
    )
    info = scheduler().submit_dryrun(AppDef("x", roles=[most]), {})
    (job,) = info.request.jobs
    assert job["spec"]["parallelism"] == 100_000
    assert job["spec"]["backoffLimitPerIndex"] == 2**31 - 1
    app_retries = Role("w", image="i", entrypoint="e", max_retries=2**40)  # (restarted by us)
    scheduler().submit_dryrun(AppDef("x", roles=[app_retries]), {})


@pytest.mark.parametrize(
    ("resource", "pattern"),
    [
        (Resource(cpu=1e30, gpu=0, memMB=1), r"resource\.cpu must be at most 9223372036854775 "),
        (Resource(cpu=1, gpu=0, memMB=2**53), r"resource\.memMB must be at most 8796093022207 "),
        (Resource(cpu=1, gpu=2**63, memMB=1), r"resource\.gpu must be at most 9223372036854775807"),
        (
            Resource(cpu=1, gpu=0, memMB=1, devices={"example.com/efa": 2**63}),
            r"resource\.devices\['example\.com/efa'\].*got 9223372036854775808",
        ),
        (
            Resource(cpu=1, gpu=0, memMB=1, devices={"example.com/efa": True}),
            r"resource\.devices\['example\.com/efa'\].*got True",
        ),
    ],
)
def test_resource_amounts_kubernetes_cannot_hold_fail_at_the_dry_run(
    resource: Resource, pattern: str
) -> None:
    """Resource amounts past a 64-bit quantity (millicores, bytes, devices) or a device count
    that is not a number fail at the dry run naming the role, field and value (the API server
    capped them, and the pod could never be placed, or refused them at submit)."""
    role = Role("w", image="i", entrypoint="e", resource=resource)
    with pytest.raises(InvalidAppDefException, match=r"role 'w': " + pattern):
        scheduler().submit_dryrun(AppDef("x", roles=[role]), {})


def test_the_largest_resource_amounts_pass_the_dry_run() -> None:
    """The largest CPU, memory, GPU and device amounts a quantity holds pass and validate."""
    res = Resource(
        cpu=(2**63 - 1) // 1000,
        gpu=2**63 - 1,
        memMB=(2**63 - 1) // 2**20,
        devices={"example.com/efa": 2**63 - 1},
    )
    info = scheduler().submit_dryrun(
        AppDef("x", roles=[Role("w", image="i", entrypoint="e", resource=res)]), {}
    )
    (job,) = info.request.jobs
    limits = job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {
        "cpu": "9223372036854775",
        "memory": "8796093022207Mi",
        "nvidia.com/gpu": 2**63 - 1,
        "example.com/efa": 2**63 - 1,
    }
    for version in (OLDEST, NEWEST):
        for obj in info.request.manifests():
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("image", ["", " img:1", "img:1\n"])
def test_an_empty_or_padded_image_fails_at_the_dry_run(image: str) -> None:
    """An empty image (the Job refused at submit) or one with surrounding whitespace (the Job
    created, each of its pods refused) fails at the dry run naming the role and the value."""
    role = Role("w", image=image, entrypoint="e")
    with pytest.raises(
        InvalidAppDefException, match=r"role 'w': image must be .*" + re.escape(repr(image))
    ):
        scheduler().submit_dryrun(AppDef("x", roles=[role]), {})


@pytest.mark.parametrize(
    ("role", "field"),
    [
        (Role("w", image="i", entrypoint="e", args=["x" * 300_000]), "args"),
        (Role("w", image="i", entrypoint="e", env={"BIG": "x" * 300_000}), "env"),
    ],
)
def test_a_role_past_the_annotation_limit_fails_at_the_dry_run(role: Role, field: str) -> None:
    """A role whose definition (kept as its Job's annotation) passes the API's 256 KiB of
    annotations fails at the dry run naming the role and the field (the server refused the Job
    at submit)."""
    with pytest.raises(
        InvalidAppDefException, match=rf"role 'w': {field} is too large for Kubernetes.*262144"
    ):
        scheduler().submit_dryrun(AppDef("x", roles=[role]), {})
    fits = Role("w", image="i", entrypoint="e", args=["x" * 200_000])
    scheduler().submit_dryrun(AppDef("x", roles=[fits]), {})


def test_an_app_name_past_the_annotation_limit_fails_at_the_dry_run() -> None:
    """An app name too large for the Service's annotations fails at the dry run naming it."""
    app = AppDef("a" * 300_000, roles=[Role("w", image="i", entrypoint="e")])
    with pytest.raises(InvalidAppDefException, match=r"app name \(300000 characters\).*262144"):
        scheduler().submit_dryrun(app, {})


def test_a_pod_overlay_with_integers_in_range_passes() -> None:
    """An overlay's integer fields within their ranges (an unset hostPort 0 included) pass."""
    overlay = {
        "spec": {
            "terminationGracePeriodSeconds": 2**63 - 1,
            "priority": -(2**31),
            "containers": [{"name": "w", "ports": [{"containerPort": 65535, "hostPort": 0}]}],
        }
    }
    info = scheduler().submit_dryrun(two_role_app(), {"pod_overlay": json.dumps(overlay)})
    assert info.request.jobs[0]["spec"]["template"]["spec"]["priority"] == -(2**31)


def test_unknown_retry_policy_fails_with_a_clear_error() -> None:
    """A retry policy that is not REPLICA, ROLE or APPLICATION is rejected, naming it."""
    role = Role("w", image="i", entrypoint="e", max_retries=1)
    role.retry_policy = "SOMETIMES"  # type: ignore[assignment]
    with pytest.raises(InvalidAppDefException, match=r"retry_policy.*SOMETIMES"):
        scheduler().submit_dryrun(AppDef("x", roles=[role]), {})


@pytest.mark.parametrize(
    ("cfg", "pattern"),
    [
        ({"namespace": "Not_A_Namespace"}, r"namespace.*Not_A_Namespace"),
        ({"tolerations": ["gpu:Sometimes"]}, r"tolerations.*gpu:Sometimes"),
        ({"image_pull_policy": "Maybe"}, r"image_pull_policy.*Maybe"),
        ({"node_selector": {"zone": "bad value!"}}, r"node_selector.*bad value!"),
        ({"pod_overlay": "{not json"}, r"pod_overlay"),
        ({"pod_overlay": '{"containers": []}'}, r"pod_overlay.*metadata.*spec"),
        ({"queue": "Team_A"}, r"'queue'.*Kueue LocalQueue.*Team_A"),
        (
            {"labels": {"app.kubernetes.io/managed-by": "me"}},
            r"'labels'.*which the backend sets itself, got 'app\.kubernetes\.io/managed-by:me'",
        ),
        (
            {"labels": {"asynctorchx.dev/app-id": "other"}},
            r"'labels'.*which the backend sets itself, got 'asynctorchx\.dev/app-id:other'",
        ),
        ({"queue": "a" * 64}, r"'queue'.*Kueue LocalQueue"),
        (
            {"labels": {"kueue.x-k8s.io/queue-name": "Team_A"}},
            r"'labels'.*Kueue LocalQueue.*'kueue\.x-k8s\.io/queue-name:Team_A'",
        ),
        (
            {"queue": "team-a", "labels": {"kueue.x-k8s.io/queue-name": "team-b"}},
            r"'queue'.*same queue as labels' kueue\.x-k8s\.io/queue-name:team-b",
        ),
    ],
)
def test_bad_run_options_fail_with_clear_errors(cfg: dict[str, Any], pattern: str) -> None:
    """Each bad run option is rejected in the dry run with its name and value."""
    with pytest.raises(InvalidRunConfigException, match=pattern):
        scheduler().submit_dryrun(two_role_app(), cfg)


@pytest.mark.parametrize(
    ("role", "pattern"),
    [
        (
            Role("a_b", image="i", entrypoint="e", port_map={"my_port": 80}),
            r"port_map key 'my_port'",
        ),
        (
            Role("w", image="i", entrypoint="e", env={"JOB_COMPLETION_INDEX": "1"}),
            r"JOB_COMPLETION_INDEX",
        ),
        (Role("w", image="i", entrypoint="e", env={"1BAD": "x"}), r"env key '1BAD'"),
        (
            Role("w", image="i", entrypoint="e", resource=Resource(cpu=1, gpu=0.5, memMB=10)),
            r"resource\.gpu.*0\.5",
        ),
        (
            Role("w", image="i", entrypoint="e", mounts=[VolumeMount("Bad_Claim", "/x")]),
            r"Bad_Claim",
        ),
        (
            Role("w", image="i", entrypoint="e", mounts=[BindMount("/data/../etc", "/x")]),
            r"role 'w': mounts\[0\]\.src_path must not contain '\.\.'.*'/data/\.\./etc'",
        ),
        (
            Role("w", image="i", entrypoint="e", mounts=[DeviceMount("../dev/fuse", "/dev/fuse")]),
            r"role 'w': mounts\[0\]\.src_path must not contain '\.\.'",
        ),
        (device_role({"efa": 1}), r"role 'w': resource\.devices key 'efa'.*domain prefix"),
        (device_role({"cpu": 4}), r"role 'w': resource\.devices key 'cpu'.*resource\.cpu"),
    ],
)
def test_roles_kubernetes_cannot_run_fail_with_clear_errors(role: Role, pattern: str) -> None:
    """Role fields Kubernetes would reject fail in the dry run, naming the role and the value."""
    with pytest.raises(InvalidAppDefException, match=pattern):
        scheduler().submit_dryrun(AppDef("x", roles=[role]), {})


_MISSHAPEN_OVERLAYS = [
    ({"spec": "x"}, r"an object \(or null\) at spec\b"),
    ({"metadata": {"labels": "x"}}, r"at metadata\.labels"),
    ({"spec": {"containers": ["x"]}}, r"a list of objects \(or null\) at spec\.containers"),
    ({"spec": {"volumes": [1]}}, r"at spec\.volumes"),
    ({"spec": {"tolerations": "x"}}, r"at spec\.tolerations"),
    ({"spec": {"containers": [{"name": "w", "env": ["x"]}]}}, r"spec\.containers\[0\]\.env"),
    (
        {"spec": {"containers": [{"name": "w", "resources": {"limits": "x"}}]}},
        r"spec\.containers\[0\]\.resources\.limits",
    ),
    ({"spec": {"containers": [{"name": 5}]}}, r"a string as spec\.containers\[0\]\.name"),
    ({"spec": {"activeDeadlineSeconds": float("nan")}}, r"JSON.*[Nn]a[Nn]"),
    ({"spec": {"priority": 2**31}}, r"a 32-bit integer at spec\.priority \(not 2147483648\)"),
    (
        {"spec": {"terminationGracePeriodSeconds": 2**63}},
        r"a 64-bit integer at spec\.terminationGracePeriodSeconds \(not 9223372036854775808\)",
    ),
    ({"spec": {"activeDeadlineSeconds": 1.5}}, r"a 64-bit integer at spec\.activeDeadlineSeconds"),
    (
        {"spec": {"containers": [{"name": "w", "ports": [{"containerPort": 70000}]}]}},
        r"a port in \[1, 65535\] at spec\.containers\[0\]\.ports\[0\]\.containerPort \(not 70000\)",
    ),
    (
        {"spec": {"securityContext": {"supplementalGroups": [1, 2**64]}}},
        r"a 64-bit integer at spec\.securityContext\.supplementalGroups\[1\]",
    ),
]


@pytest.mark.parametrize(("overlay", "pattern"), _MISSHAPEN_OVERLAYS)
def test_a_misshapen_pod_overlay_option_is_refused_naming_the_option_and_the_place(
    overlay: dict[str, Any], pattern: str
) -> None:
    """A pod_overlay run option with the wrong type where the template has an object or a list
    (or NaN) is refused naming the option and the place (it was an AttributeError from the lint)."""
    raw = json.dumps(overlay)
    with pytest.raises(InvalidRunConfigException, match=r"'pod_overlay'.*" + pattern):
        scheduler().submit_dryrun(two_role_app(), {"pod_overlay": raw})


@pytest.mark.parametrize(
    ("overlay", "pattern"), [*_MISSHAPEN_OVERLAYS, ("spec: {}", r"a JSON object"), ([1], r"object")]
)
def test_a_misshapen_role_pod_overlay_is_refused_naming_the_role_and_the_field(
    overlay: Any, pattern: str
) -> None:
    """A role's metadata['kubernetes']['pod_overlay'] that is not an object of the template's
    shape is refused naming the role and the field (it was an AttributeError from the lint)."""
    role = Role("w", image="i", entrypoint="e", metadata={"kubernetes": {"pod_overlay": overlay}})
    with pytest.raises(
        InvalidAppDefException,
        match=r"role 'w': metadata\['kubernetes'\]\['pod_overlay'\] must be .*" + pattern,
    ):
        scheduler().submit_dryrun(AppDef("x", roles=[role]), {})


@pytest.mark.parametrize("version", ["1.29.0", "1.32.0"])
def test_a_role_mount_at_dev_shm_replaces_the_default_one(version: str) -> None:
    """A role mounting a volume at /dev/shm gets it instead of the default memory volume (both
    were mounted there: the API server refuses a path mounted twice)."""
    role = Role("w", image="i", entrypoint="e", mounts=[BindMount("/host/shm", "/dev/shm")])
    req = scheduler().submit_dryrun(AppDef("x", roles=[role]), {}).request
    pod = req.jobs[0]["spec"]["template"]["spec"]
    assert pod["containers"][0]["volumeMounts"] == [
        {"name": "mount-0", "mountPath": "/dev/shm", "readOnly": False}
    ]
    assert pod["volumes"] == [{"name": "mount-0", "hostPath": {"path": "/host/shm"}}]
    validate_all(req.manifests(), version)


def test_two_mounts_at_one_path_are_refused_naming_them() -> None:
    """Two mounts of a role at the same path are refused at the dry run, naming both (the API
    server refused the Job: "mountPath: must be unique")."""
    role = Role(
        "w",
        image="i",
        entrypoint="e",
        mounts=[BindMount("/a", "/data"), VolumeMount("claim", "/data/")],
    )
    with pytest.raises(
        InvalidAppDefException,
        match=r"role 'w': mounts\[1\]\.dst_path '/data/' is also mounts\[0\]'s",
    ):
        scheduler().submit_dryrun(AppDef("x", roles=[role]), {})


def test_lint_catches_a_path_mounted_twice() -> None:
    """The lint reports a mountPath that two volumeMounts use (an overlay can add one)."""
    overlay = {
        "spec": {
            "containers": [
                {
                    "name": "w",
                    "volumeMounts": [
                        {"name": "dshm", "mountPath": "/dev/shm"},
                        {"name": "dshm2", "mountPath": "/dev/shm"},
                    ],
                }
            ],
            "volumes": [{"name": "dshm2", "emptyDir": {}}],
        }
    }
    with pytest.raises(InvalidAppDefException, match=r"mountPath '/dev/shm' is mounted twice"):
        scheduler().submit_dryrun(
            AppDef("x", roles=[Role("w", image="i", entrypoint="e")]),
            {"pod_overlay": json.dumps(overlay)},
        )


def test_role_names_that_collide_in_kubernetes_are_rejected() -> None:
    """Two roles whose DNS forms are equal (Trainer, trainer) are rejected, naming both."""
    app = AppDef(
        "x",
        roles=[
            Role("trainer", image="i", entrypoint="e"),
            Role("Trainer", image="i", entrypoint="e"),
        ],
    )
    with pytest.raises(InvalidAppDefException, match=r"'Trainer'.*'trainer'"):
        scheduler().submit_dryrun(app, {})


def test_lint_catches_what_schemas_miss() -> None:
    """The lint reports a numeric clusterIP, long names, bad quantities and bad enum values."""
    req = scheduler().submit_dryrun(two_role_app(), {}).request
    objs = json.loads(json.dumps(req.manifests()))
    objs[0]["spec"]["clusterIP"] = None
    objs[1]["metadata"]["name"] = "x" * 64
    c = objs[1]["spec"]["template"]["spec"]["containers"][0]
    c["resources"]["limits"]["memory"] = "16 GB"
    c["imagePullPolicy"] = "Sometimes"
    objs[2]["spec"]["podReplacementPolicy"] = "TerminatingOrFailed"
    problems = "\n".join(lint(objs))
    for needle in ("clusterIP", "x" * 64, "'16 GB'", "Sometimes", "podReplacementPolicy"):
        assert needle in problems


def test_strict_schema_rejects_a_misspelt_overlay() -> None:
    """A pod overlay with a misspelt field passes the lint but fails strict schema validation."""
    req = (
        scheduler()
        .submit_dryrun(two_role_app(), {"pod_overlay": '{"spec": {"nodeSelectr": {"a": "b"}}}'})
        .request
    )
    assert lint(req.manifests()) == []
    with pytest.raises(kubernetes_validate.ValidationError, match="nodeSelectr"):
        validate_all(req.manifests(), OLDEST)


def test_toleration_parsing() -> None:
    """key=value:Effect is Equal with an effect; key alone tolerates every effect of the key."""
    assert parse_toleration("a=b:NoSchedule") == {
        "key": "a",
        "operator": "Equal",
        "value": "b",
        "effect": "NoSchedule",
    }
    assert parse_toleration("a:NoExecute") == {
        "key": "a",
        "operator": "Exists",
        "effect": "NoExecute",
    }
    assert parse_toleration("a=b") == {"key": "a", "operator": "Equal", "value": "b"}


def test_overlay_merges_named_lists_by_name() -> None:
    """An overlay merges containers and env entries by name, replaces other lists, None removes."""
    base = {
        "spec": {
            "containers": [{"name": "w", "env": [{"name": "A", "value": "1"}]}],
            "volumes": [1],
            "x": 1,
        }
    }
    overlay = {
        "spec": {
            "containers": [{"name": "w", "env": [{"name": "B", "value": "2"}]}],
            "volumes": [2],
            "x": None,
        }
    }
    merged = merge_overlay(base, overlay)
    assert merged["spec"]["containers"][0]["env"] == [
        {"name": "A", "value": "1"},
        {"name": "B", "value": "2"},
    ]
    assert merged["spec"]["volumes"] == [2] and "x" not in merged["spec"]
    assert base["spec"]["x"] == 1


def test_role_round_trips_through_the_job_annotation() -> None:
    """The role stored on its Job reads back equal to the submitted one."""
    from asynctorchx.schedulers._k8s.manifests import role_from_json, role_to_json

    app = two_role_app()
    for role in app.roles:
        assert role_from_json(role_to_json(role)) == role


def test_importing_the_backend_does_not_import_the_client() -> None:
    """Importing the backend (and dry runs) leave kubernetes_asyncio unimported."""
    code = (
        "import sys, asynctorchx.schedulers.kubernetes as k\n"
        "from asynctorchx.specs import AppDef, Role\n"
        "k.KubernetesScheduler('s').submit_dryrun(AppDef('a', roles=[Role('w', image='i', entrypoint='e')]), {})\n"
        "assert 'kubernetes_asyncio' not in sys.modules, 'imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_missing_extra_names_the_pip_command() -> None:
    """Without kubernetes_asyncio, creating the scheduler says to pip install the extra."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'kubernetes_asyncio':\n"
        "            raise ImportError('blocked for the test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from asynctorchx.schedulers import create_scheduler\n"
        "try:\n"
        "    create_scheduler('kubernetes', 's')\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60
    )
    assert "pip install 'asynctorchx[kubernetes]'" in out.stdout
