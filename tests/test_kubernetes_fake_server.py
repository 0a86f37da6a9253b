"""The fake API server (tests/k8s_fake) answers like a real one where the backend depends on it.

Driven by the real kubernetes_asyncio client (through the backend's thin wrapper), these tests pin
the behaviours the backend's own tests rely on: label selectors, resourceVersion-ordered watches and
their 410 after compaction, propagation policies, Job controller status shapes (compared with objects
recorded from real clusters, tests/fixtures/kubernetes), per-index backoff, disruptions, pod logs.

What a fake cannot prove: scheduling, resource fit, image pulls, DNS, admission, RBAC, quota, and the
real garbage collector's and kubelet's timings; the ``live`` tests cover those on a real cluster.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_fake import FakeKubeApiServer, PodContext, PodScript
from k8s_fake.testing import fake_k8s, kube_api, until

from asynctorchx.schedulers._k8s.client import KubeApi, KubeApiError
from asynctorchx.schedulers._k8s.manifests import KubernetesOptions, build_request, owned_by
from asynctorchx.specs import AppDef, RetryPolicy, Role

__all__ = ["fake_k8s", "kube_api"]

FIXTURES = Path(__file__).parent / "fixtures" / "kubernetes"
NS = "default"


def recorded(name: str) -> Any:
    text = (FIXTURES / name).read_text()
    return json.loads(text) if name.endswith(".json") else yaml.safe_load(text)


async def submit(api: KubeApi, app: AppDef) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    req = build_request(app, KubernetesOptions(), "test")
    svc = await api.create("services", NS, req.service)
    jobs = [await api.create("jobs", NS, owned_by(j, svc)) for j in req.jobs]
    return svc, jobs


def job_of(srv: FakeKubeApiServer, name: str) -> dict[str, Any] | None:
    return srv.store.find("jobs", NS, name)


def finished(srv: FakeKubeApiServer, name: str) -> bool:
    job = job_of(srv, name)
    conds = {
        c["type"]
        for c in (job or {}).get("status", {}).get("conditions", [])
        if c["status"] == "True"
    }
    return bool(conds & {"Complete", "Failed"})


async def test_label_selectors(fake_k8s: FakeKubeApiServer, kube_api: KubeApi) -> None:
    """Equality, inequality, set-based and existence selectors select like the API server's."""
    for name, labels in (("a", {"k": "x"}), ("b", {"k": "y"}), ("c", {"other": "1"})):
        await kube_api.create(
            "services",
            NS,
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": name, "labels": labels},
                "spec": {"clusterIP": "None"},
            },
        )

    async def names(selector: str) -> list[str]:
        return [
            o["metadata"]["name"] for o in (await kube_api.list("services", NS, selector))["items"]
        ]

    assert await names("k=x") == ["a"]
    assert await names("k!=x") == ["b", "c"]
    assert await names("k in (x,y)") == ["a", "b"]
    assert await names("k notin (x)") == ["b", "c"]
    assert await names("k") == ["a", "b"]
    assert await names("!k") == ["c"]


async def test_watch_resumes_after_a_resource_version(
    fake_k8s: FakeKubeApiServer, kube_api: KubeApi
) -> None:
    """A watch from a list's resourceVersion sends only later changes, in order."""
    listing = await kube_api.list("services", NS, "")
    rv = listing["metadata"]["resourceVersion"]
    body = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "late"},
        "spec": {"clusterIP": "None"},
    }
    await kube_api.create("services", NS, body)
    await kube_api.delete("services", NS, "late", "Background")
    events = []
    async for e in kube_api.watch("services", NS, "", rv, 30):
        if e["type"] != "BOOKMARK":
            events.append(e)
        if e["type"] == "DELETED":
            break
    assert [e["type"] for e in events] == ["ADDED", "DELETED"]
    rvs = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
    assert rvs == sorted(rvs) and rvs[0] > int(rv)


async def test_compacted_watch_gets_the_recorded_410_event(
    fake_k8s: FakeKubeApiServer, kube_api: KubeApi
) -> None:
    """Resuming from a compacted version yields the ERROR 410 event shaped like the recorded one."""
    rv = (await kube_api.list("pods", NS, ""))["metadata"]["resourceVersion"]
    await kube_api.create(
        "services",
        NS,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "s"},
            "spec": {"clusterIP": "None"},
        },
    )
    fake_k8s.compact()
    events = [e async for e in kube_api.watch("pods", NS, "", rv, 5)]
    want = recorded("watch_410_expired.json")
    assert len(events) == 1 and events[0]["type"] == "ERROR"
    assert events[0]["object"].keys() == want["object"].keys()
    assert (events[0]["object"]["code"], events[0]["object"]["reason"]) == (410, "Expired")
    assert events[0]["object"]["message"].startswith("too old resource version")


async def test_not_found_has_the_recorded_status_shape(
    fake_k8s: FakeKubeApiServer, kube_api: KubeApi
) -> None:
    """A 404 on a Job has the same Status fields and message form as the recorded one."""
    with pytest.raises(KubeApiError) as info:
        await kube_api.patch("jobs", NS, "nonexistent-job", {"spec": {"suspend": True}})
    assert (info.value.status, info.value.reason) == (404, "NotFound")
    assert info.value.message == recorded("status_404_job.json")["message"]
    assert await kube_api.get("jobs", NS, "nonexistent-job") is None


async def test_invalid_objects_are_rejected(fake_k8s: FakeKubeApiServer, kube_api: KubeApi) -> None:
    """Unknown fields (strict OpenAPI schema), bad names and duplicates are rejected like the real server."""
    with pytest.raises(KubeApiError, match="422"):
        await kube_api.create(
            "services",
            NS,
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "s"},
                "spec": {"clusterIp": "None"},
            },
        )
    with pytest.raises(KubeApiError, match="422"):
        await kube_api.create(
            "services",
            NS,
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "1-starts-with-digit"},
                "spec": {},
            },
        )
    ok = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "s"},
        "spec": {"clusterIP": "None"},
    }
    await kube_api.create("services", NS, ok)
    with pytest.raises(KubeApiError, match="409 AlreadyExists"):
        await kube_api.create("services", NS, ok)


async def test_job_status_shapes_match_recorded_jobs(
    fake_k8s: FakeKubeApiServer, kube_api: KubeApi
) -> None:
    """Completed and failed Jobs carry the status fields and conditions real clusters write."""

    def script(ctx: PodContext) -> PodScript:
        return PodScript(exit_code=0 if ctx.role == "good" else 1)

    fake_k8s.cluster.script = script
    app = AppDef(
        "shapes",
        roles=[
            Role("good", image="i", entrypoint="e", num_replicas=2),
            Role("bad", image="i", entrypoint="e"),
        ],
    )
    _, (good, bad) = await submit(kube_api, app)
    await until(
        fake_k8s,
        lambda: (
            finished(fake_k8s, good["metadata"]["name"])
            and finished(fake_k8s, bad["metadata"]["name"])
        ),
    )
    done = job_of(fake_k8s, good["metadata"]["name"])
    failed = job_of(fake_k8s, bad["metadata"]["name"])
    assert done is not None and failed is not None
    want_done, want_failed = (
        recorded("job_complete.yaml")["status"],
        recorded("job_failed.yaml")["status"],
    )
    assert set(want_done) <= set(done["status"])
    assert set(want_failed) <= set(failed["status"])
    assert [(c["type"], c["reason"]) for c in done["status"]["conditions"]] == [
        (c["type"], c["reason"]) for c in want_done["conditions"]
    ]
    assert [(c["type"], c["reason"]) for c in failed["status"]["conditions"]] == [
        (c["type"], c["reason"]) for c in want_failed["conditions"]
    ]
    for cond in done["status"]["conditions"] + failed["status"]["conditions"]:
        assert cond.keys() == want_done["conditions"][0].keys()
    assert done["status"]["completedIndexes"] == "0,1"
    assert set(recorded("job_active.yaml")["metadata"]["labels"]) <= set(done["metadata"]["labels"])


async def test_pods_of_an_indexed_job_look_like_recorded_ones(
    fake_k8s: FakeKubeApiServer, kube_api: KubeApi
) -> None:
    """Pods carry the completion index label/annotation, hostname, finalizer and owner like real ones."""
    fake_k8s.cluster.script = lambda ctx: PodScript(hold=asyncio.Event())
    _, (job,) = await submit(
        kube_api, AppDef("pods", roles=[Role("w", image="i", entrypoint="e", num_replicas=2)])
    )
    await until(fake_k8s, lambda: len(fake_k8s.store.list("pods", NS)) == 2)
    want = recorded("pod_indexed_metadata.yaml")["metadata"]
    for pod in fake_k8s.store.list("pods", NS):
        meta = pod["metadata"]
        assert set(want) - {"annotations"} <= set(meta) | {"annotations"}
        assert {
            "batch.kubernetes.io/job-completion-index",
            "batch.kubernetes.io/job-name",
            "controller-uid",
        } <= set(meta["labels"])
        assert meta["ownerReferences"][0].keys() == want["ownerReferences"][0].keys()
        assert meta["finalizers"] == want["finalizers"]
        idx = meta["labels"]["batch.kubernetes.io/job-completion-index"]
        assert pod["spec"]["hostname"] == f"{job['metadata']['name']}-{idx}"


async def test_foreground_deletion_keeps_the_owner_until_dependents_are_gone(
    fake_k8s: FakeKubeApiServer, kube_api: KubeApi
) -> None:
    """Deleting the Service in the foreground marks it, deletes Jobs and pods, then removes it."""
    fake_k8s.cluster.script = lambda ctx: PodScript(hold=asyncio.Event())
    svc, _ = await submit(
        kube_api, AppDef("fg", roles=[Role("w", image="i", entrypoint="e", num_replicas=2)])
    )
    await until(fake_k8s, lambda: len(fake_k8s.store.list("pods", NS)) == 2)
    deleted = await kube_api.delete("services", NS, svc["metadata"]["name"], "Foreground")
    assert deleted is not None and deleted["metadata"]["deletionTimestamp"]
    assert "foregroundDeletion" in deleted["metadata"]["finalizers"]
    await until(fake_k8s, lambda: not fake_k8s.store.objects)
    assert await kube_api.delete("services", NS, svc["metadata"]["name"], "Foreground") is None


async def test_orphan_is_the_default_for_jobs(
    fake_k8s: FakeKubeApiServer, kube_api: KubeApi
) -> None:
    """Deleting a Job without a propagation policy orphans its pods, as batch/v1 does."""
    fake_k8s.cluster.script = lambda ctx: PodScript(hold=asyncio.Event())
    _, (job,) = await submit(
        kube_api, AppDef("orphan", roles=[Role("w", image="i", entrypoint="e")])
    )
    await until(fake_k8s, lambda: len(fake_k8s.store.list("pods", NS)) == 1)
    fake_k8s.store.delete("jobs", NS, job["metadata"]["name"], None)

    def pods_of(job_name: str) -> list[dict[str, Any]]:
        return [
            p
            for p in fake_k8s.store.list("pods", NS)
            if p["metadata"]["labels"].get("batch.kubernetes.io/job-name") == job_name
        ]

    # The fake's control loop handles the store's changes in order and collects garbage on every
    # pass: once it has made the pod of a Job created after the deletion, its garbage collector has
    # had its chance at the orphan.
    _, (later,) = await submit(
        kube_api, AppDef("later", roles=[Role("w", image="i", entrypoint="e")])
    )
    await until(fake_k8s, lambda: bool(pods_of(later["metadata"]["name"])))
    pods = pods_of(job["metadata"]["name"])
    assert len(pods) == 1 and not pods[0]["metadata"].get("ownerReferences")
    assert not pods[0]["metadata"].get("deletionTimestamp")


async def test_per_index_backoff_replaces_the_failed_index(
    fake_k8s: FakeKubeApiServer, kube_api: KubeApi
) -> None:
    """With backoffLimitPerIndex, a failed index gets a replacement recording its failure count."""
    fake_k8s.cluster.script = lambda ctx: PodScript(
        exit_code=1 if ctx.index == 1 and ctx.index_attempt == 0 else 0
    )
    role = Role(
        "w",
        image="i",
        entrypoint="e",
        num_replicas=2,
        max_retries=1,
        retry_policy=RetryPolicy.REPLICA,
    )
    _, (job,) = await submit(kube_api, AppDef("pidx", roles=[role]))
    await until(fake_k8s, lambda: finished(fake_k8s, job["metadata"]["name"]))
    final = job_of(fake_k8s, job["metadata"]["name"])
    assert final is not None
    assert [c["type"] for c in final["status"]["conditions"]] == ["SuccessCriteriaMet", "Complete"]
    assert (
        final["status"]["failed"],
        final["status"]["succeeded"],
        final["status"]["failedIndexes"],
    ) == (1, 2, "")
    replacement = [
        p
        for p in fake_k8s.store.list("pods", NS)
        if p["metadata"]["annotations"].get("batch.kubernetes.io/job-index-failure-count") == "1"
    ]
    assert len(replacement) == 1


async def test_disruptions_are_ignored_by_the_pod_failure_policy(
    fake_k8s: FakeKubeApiServer, kube_api: KubeApi
) -> None:
    """A preempted pod (DisruptionTarget) is replaced without counting as a failure."""
    hold = asyncio.Event()
    fake_k8s.cluster.script = lambda ctx: PodScript(hold=hold if ctx.index_attempt == 0 else None)
    _, (job,) = await submit(
        kube_api, AppDef("disrupt", roles=[Role("w", image="i", entrypoint="e")])
    )
    await until(
        fake_k8s,
        lambda: any(p["status"].get("phase") == "Running" for p in fake_k8s.store.list("pods", NS)),
    )
    fake_k8s.cluster.disrupt(NS, fake_k8s.store.list("pods", NS)[0]["metadata"]["name"])
    await until(fake_k8s, lambda: finished(fake_k8s, job["metadata"]["name"]))
    final = job_of(fake_k8s, job["metadata"]["name"])
    assert (
        final is not None
        and final["status"].get("failed", 0) == 0
        and final["status"]["succeeded"] == 1
    )
    pods = fake_k8s.store.list("pods", NS)
    assert any(
        c["type"] == "DisruptionTarget" for p in pods for c in p["status"].get("conditions", [])
    )
    assert any(
        p["metadata"]["annotations"].get("batch.kubernetes.io/job-index-ignored-failure-count")
        == "1"
        for p in pods
    )


async def test_pod_logs_follow_timestamps_and_since_time(
    fake_k8s: FakeKubeApiServer, kube_api: KubeApi
) -> None:
    """Logs are refused while the container waits, then stream with nanosecond timestamps and sinceTime."""
    release = asyncio.Event()
    start = asyncio.Event()  # the container waits to start until the refused request was made
    fake_k8s.cluster.script = lambda ctx: PodScript(
        lines=["one\n", "two\n"], start=start, hold=release
    )
    await submit(kube_api, AppDef("logs", roles=[Role("w", image="i", entrypoint="e")]))
    await until(
        fake_k8s,
        lambda: any(p["status"].get("containerStatuses") for p in fake_k8s.store.list("pods", NS)),
    )
    name = fake_k8s.store.list("pods", NS)[0]["metadata"]["name"]
    with pytest.raises(KubeApiError) as info:
        async with kube_api.pod_log(NS, name) as lines:
            pass
    assert (
        info.value.status == 400 and "is waiting to start: ContainerCreating" in info.value.message
    )
    start.set()
    await until(
        fake_k8s, lambda: fake_k8s.store.list("pods", NS)[0]["status"]["phase"] == "Running"
    )
    got: list[bytes] = []
    async with kube_api.pod_log(NS, name, follow=True) as lines:
        async for line in lines:
            got.append(line)
            if len(got) == 2:
                release.set()
    assert [line.split(b" ", 1)[1] for line in got] == [b"one\n", b"two\n"]
    stamp = got[0].split(b" ", 1)[0].decode()
    assert len(stamp) == len("2026-01-01T00:00:00.000000000Z") and stamp.endswith("Z")
    async with kube_api.pod_log(NS, name, since_time="2999-01-01T00:00:00Z") as lines:
        assert [line async for line in lines] == []
