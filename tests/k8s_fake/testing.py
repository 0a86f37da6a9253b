"""pytest fixtures for tests that run against the fake API server (import them into a test module)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from asynctorchx.schedulers._k8s.client import KubeApi
from asynctorchx.schedulers.kubernetes import KubernetesScheduler
from k8s_fake.server import FakeKubeApiServer


@pytest.fixture
async def fake_k8s() -> AsyncIterator[FakeKubeApiServer]:
    """A started fake API server; set ``fake_k8s.cluster.script`` to script the pods."""
    async with FakeKubeApiServer() as srv:
        yield srv
        assert srv.cluster.errors == [], f"the fake control plane failed: {srv.cluster.errors!r}"


@pytest.fixture
async def kube_api(fake_k8s: FakeKubeApiServer) -> AsyncIterator[KubeApi]:
    """The backend's thin client (real kubernetes_asyncio underneath) connected to the fake."""
    api = await KubeApi.connect(configuration=fake_k8s.configuration())
    try:
        yield api
    finally:
        await api.close()


@pytest.fixture
async def k8s_scheduler(fake_k8s: FakeKubeApiServer) -> AsyncIterator[KubernetesScheduler]:
    """The kubernetes scheduler connected to the fake (closed after the test)."""
    sched = KubernetesScheduler("test", k8s_configuration=fake_k8s.configuration())
    try:
        yield sched
    finally:
        await sched.close()


async def until(
    srv: FakeKubeApiServer, predicate: Callable[[], bool], timeout: float = 30.0
) -> None:
    """Returns once ``predicate()`` holds, re-checking it after every change in the fake's store and
    every request, watch or log stream the fake server sees.

    ``timeout`` only guards against a hang (the condition never coming): nothing a test checks
    depends on how fast it comes, so it is far beyond what a loaded machine needs.

    Raises:
        TimeoutError: it did not hold within ``timeout`` seconds.
    """
    changed = asyncio.Event()
    unsubscribe = srv.store.subscribe(lambda _ev: changed.set())
    unsubscribe_activity = srv.subscribe_activity(changed.set)
    try:
        deadline = asyncio.get_running_loop().time() + timeout
        while not predicate():
            changed.clear()
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                raise TimeoutError(f"condition not reached within {timeout}s")
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except asyncio.TimeoutError:
                raise TimeoutError(f"condition not reached within {timeout}s") from None
    finally:
        unsubscribe()
        unsubscribe_activity()
