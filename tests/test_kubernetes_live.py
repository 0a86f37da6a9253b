"""The kubernetes backend on a real cluster: what the fake API server cannot prove.

Off by default (no cluster can run on the machines that run the suite): set
``ASYNCTORCHX_LIVE_K8S=1`` to run them against the cluster of ``$KUBECONFIG`` (or
``~/.kube/config``, or the in-cluster service account). ``ASYNCTORCHX_LIVE_K8S_NAMESPACE`` (default
``default``) and ``ASYNCTORCHX_LIVE_K8S_IMAGE`` (default ``busybox:1.36``, it needs ``sh`` and
``nslookup``) choose where and what runs. They check that pods get scheduled and pull their image,
that rank 0's name resolves through the headless Service, that per-index retries happen, that
cancel really removes the pods, and that logs come back.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator

import pytest

from asynctorchx import AsyncRunner
from asynctorchx.specs import AppDef, AppState, RetryPolicy, Role, parse_app_handle

LIVE = os.environ.get("ASYNCTORCHX_LIVE_K8S", "") not in ("", "0", "false")
NAMESPACE = os.environ.get("ASYNCTORCHX_LIVE_K8S_NAMESPACE", "default")
IMAGE = os.environ.get("ASYNCTORCHX_LIVE_K8S_IMAGE", "busybox:1.36")

pytestmark = [
    pytest.mark.live,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        not LIVE, reason="needs a real cluster: set ASYNCTORCHX_LIVE_K8S=1 (and KUBECONFIG)"
    ),
]

CFG = {"namespace": NAMESPACE, "image_pull_policy": "IfNotPresent"}


@pytest.fixture
async def runner() -> AsyncIterator[AsyncRunner]:
    async with AsyncRunner(name="live", namespace=NAMESPACE) as r:
        yield r


def sh(name: str, script: str, replicas: int = 1, **kw: object) -> Role:
    return Role(
        name, image=IMAGE, entrypoint="sh", args=["-c", script], num_replicas=replicas, **kw
    )  # type: ignore[arg-type]


async def test_live_success_and_logs(runner: AsyncRunner) -> None:
    """Two replicas run, succeed, and replica 1's log reads back with its index expanded."""
    handle = await runner.run(
        AppDef("live-echo", roles=[sh("echo", "echo replica $JOB_COMPLETION_INDEX", replicas=2)]),
        "kubernetes",
        CFG,
    )
    status = await runner.wait(handle, timeout=300)
    assert status is not None and status.state == AppState.SUCCEEDED, status
    lines = [line async for line in runner.log_lines(handle, "echo", k=1)]
    assert lines == ["replica 1\n"]


async def test_live_rank0_resolves_through_the_headless_service(runner: AsyncRunner) -> None:
    """Rank 0 sees localhost; the other replica resolves rank 0's DNS name before it is ready."""
    script = (
        'if [ "$JOB_COMPLETION_INDEX" = 0 ]; then echo "rank0 sees $TORCHX_RANK0_HOST"; sleep 30; '
        'else for i in $(seq 60); do nslookup "$TORCHX_RANK0_HOST" >/dev/null 2>&1 && echo resolved && exit 0; '
        "sleep 1; done; exit 1; fi"
    )
    handle = await runner.run(
        AppDef("live-dns", roles=[sh("trainer", script, replicas=2)]), "kubernetes", CFG
    )
    status = await runner.wait(handle, timeout=300)
    assert status is not None and status.state == AppState.SUCCEEDED, status
    assert [line async for line in runner.log_lines(handle, "trainer", k=0)] == [
        "rank0 sees localhost\n"
    ]
    assert [line async for line in runner.log_lines(handle, "trainer", k=1)] == ["resolved\n"]


async def test_live_replica_retry(runner: AsyncRunner) -> None:
    """REPLICA: the first attempt of index 1 fails, Kubernetes replaces it, the app succeeds."""
    overlay = {
        "spec": {
            "containers": [
                {
                    "name": "retry",
                    "env": [
                        {
                            "name": "FAILURES",
                            "valueFrom": {
                                "fieldRef": {
                                    "fieldPath": "metadata.annotations['batch.kubernetes.io/job-index-failure-count']"
                                }
                            },
                        }
                    ],
                }
            ]
        }
    }
    role = sh(
        "retry",
        'if [ "$JOB_COMPLETION_INDEX" = 1 ] && [ "$FAILURES" = 0 ]; then exit 3; fi; echo ok',
        replicas=2,
    )
    role.max_retries = 1
    role.retry_policy = RetryPolicy.REPLICA
    handle = await runner.run(
        AppDef("live-retry", roles=[role]),
        "kubernetes",
        {**CFG, "pod_overlay": json.dumps(overlay)},
    )
    status = await runner.wait(handle, timeout=300)
    assert status is not None and status.state == AppState.SUCCEEDED, status
    assert status.num_restarts == 1


async def test_live_cancel_removes_every_object(runner: AsyncRunner) -> None:
    """cancel stops a running app: it reads CANCELLED and its Service, Jobs and pods disappear."""
    handle = await runner.run(
        AppDef("live-cancel", roles=[sh("sleeper", "sleep 600", replicas=2)]), "kubernetes", CFG
    )
    async for event in runner.watch([handle]):
        if event.state == AppState.RUNNING:
            break
    await runner.cancel(handle)
    status = await runner.wait(handle, timeout=300)
    assert status is not None and status.state == AppState.CANCELLED
    from asynctorchx.schedulers._k8s.client import KubeApi

    api = await KubeApi.connect()
    try:
        name = parse_app_handle(handle).app_id.split(":")[1]
        selector = f"asynctorchx.dev/app-id={name}"
        import asyncio

        for _ in range(120):
            left = [
                len((await api.list(kind, NAMESPACE, selector))["items"])
                for kind in ("services", "jobs", "pods")
            ]
            if left == [0, 0, 0]:
                break
            await asyncio.sleep(1)
        assert left == [0, 0, 0], f"left behind (services, jobs, pods): {left}"
    finally:
        await api.close()
