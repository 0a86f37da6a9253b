"""Probes of the ``kubernetes`` backend's log follow and dry-run limits, against the fake API server.

Each test pins a defect found by probing: it failed before its fix.
"""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
from k8s_fake import FakeKubeApiServer, PodContext, PodScript
from k8s_fake.testing import fake_k8s, until

from asynctorchx import AsyncRunner
from asynctorchx.runner.hub import PollSettings
from asynctorchx.specs import AppDef, RetryPolicy, Role

__all__ = ["fake_k8s"]

NS = "default"
# Pushes only: a waiter that finishes was woken by the backend's watch.
PUSH_ONLY = PollSettings(push_safety_interval=600.0, max_interval=600.0)


def role(name: str = "worker", replicas: int = 1, **kw: Any) -> Role:
    return Role(
        name,
        image="registry.example/img:1",
        entrypoint="python",
        args=["-m", name],
        num_replicas=replicas,
        **kw,
    )


async def test_a_pod_replaced_while_its_follow_was_silent_is_read_to_its_end_first(
    fake_k8s: FakeKubeApiServer,
) -> None:
    """A pod that writes its last lines and fails (REPLICA retry) while its followed stream is silent
    (half-open) has those lines read when the follow is re-opened, before its replacement's (the
    re-opened follow went to the newest pod: the failed pod's last lines, its traceback, were lost)."""
    gate = asyncio.Event()

    def script(ctx: PodContext) -> PodScript:
        if ctx.index_attempt == 0:
            return PodScript(lines=["first 0\n", "first 1\n"], exit_code=1, gates={1: gate})
        return PodScript(lines=["second 0\n", "second 1\n"])

    fake_k8s.cluster.script = script
    app = AppDef("replaced", roles=[role(max_retries=1, retry_policy=RetryPolicy.REPLICA)])
    got: list[str] = []
    async with AsyncRunner(
        name="test",
        poll_settings=PUSH_ONLY,
        k8s_configuration=fake_k8s.configuration(),
        log_read_timeout=1.0,
    ) as runner:
        handle = await runner.run(app, scheduler="kubernetes")
        with anyio.fail_after(45):
            async for line in runner.log_lines(handle, "worker", should_tail=True):
                got.append(line)
                if line == "first 0\n":
                    assert fake_k8s.silence_log_streams() == 1
                    gate.set()  # the first pod writes "first 1" (unsent) and fails
                    await until(fake_k8s, lambda: len(fake_k8s.store.list("pods", NS)) == 2)
    assert got == ["first 0\n", "first 1\n", "second 0\n", "second 1\n"]
