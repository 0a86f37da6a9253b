"""Probes of the ``kubernetes`` backend's log follow and dry-run limits, against the fake API server.

Each test pins a defect found by probing: it failed before its fix.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

import anyio
import pytest
from aiohttp import web
from k8s_fake import FakeKubeApiServer, PodContext, PodScript
from k8s_fake.cluster import format_ts
from k8s_fake.testing import fake_k8s, until
from test_kubernetes_backend import NS, PUSH_ONLY, role

from asynctorchx import AsyncRunner
from asynctorchx.schedulers._k8s.status import parse_time_ns
from asynctorchx.schedulers.kubernetes import KubernetesScheduler
from asynctorchx.specs import AppDef, InvalidAppDefException, Resource, RetryPolicy

__all__ = ["fake_k8s"]


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


@pytest.mark.parametrize("tail", [False, True])
async def test_a_log_read_cut_repeatedly_whose_lines_the_regex_drops_still_reaches_its_end(
    fake_k8s: FakeKubeApiServer, tail: bool
) -> None:
    """An ended pod's log whose every read is cut after 50 lines (5 cuts in all), read with a regex
    only its last line matches, returns that line: each cut read got further, but only lines the
    regex kept counted as progress, so it failed after 3 resumes ("Unreachable")."""
    sched = KubernetesScheduler("test", k8s_configuration=fake_k8s.configuration())
    count, per_read = 250, 50
    base_ns = int(datetime(2026, 1, 1, tzinfo=timezone.utc).timestamp()) * 10**9

    async def cut_log(request: web.Request) -> web.StreamResponse | None:
        if not request.path.endswith("/log"):
            return None
        since = request.query.get("sinceTime")
        first = 0 if since is None else ((parse_time_ns(since) or base_ns) - base_ns) // 10**9
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(first, min(first + per_read, count)):  # a line a second: exact resumes
            await resp.write(f"{format_ts(base_ns + i * 10**9)} line {i}\n".encode())
        if first + per_read < count and request.transport is not None:
            request.transport.abort()  # cut, as a proxy that drops long streams
        else:
            await resp.write_eof()
        return resp

    try:
        app_id = await sched.submit(AppDef("cutlog", roles=[role()]), {})
        await until(
            fake_k8s,
            lambda: any(
                p["status"].get("phase") == "Succeeded" for p in fake_k8s.store.list("pods", NS)
            ),
        )
        fake_k8s.intercept = cut_log
        with anyio.fail_after(45):
            every = [line async for line in sched.log_iter(app_id, "worker", 0, should_tail=tail)]
            assert every == [f"line {i}\n" for i in range(count)]
            last = [
                line
                async for line in sched.log_iter(
                    app_id, "worker", 0, regex=f"line {count - 1}$", should_tail=tail
                )
            ]
        assert last == [f"line {count - 1}\n"]
    finally:
        await sched.close()


@pytest.mark.parametrize(
    ("devices", "words"),
    [
        ({"example.com/" + "x" * 64: 1}, "a name of at most 63 characters"),
        ({"a" * 245 + ".com/x": 1}, "leave room for one"),
        ({"requests.example.com/x": 1}, "must not start with 'requests.'"),
        ({"hugepages-big": 1}, "'hugepages-' and a page size"),
        ({"hugepages-2Mi": 3}, r"whole number of pages \(bytes, a multiple of 2097152\)"),
    ],
)
def test_device_names_and_counts_the_api_server_refuses_fail_the_dry_run(
    devices: dict[str, int], words: str
) -> None:
    """A resource.devices name the API server takes from no container (a name past 63 characters,
    an extended prefix with no room for 'requests.', 'requests.' itself, a huge page name without a
    size) or a huge page count that is no whole number of pages fails the dry run naming it: the
    dry run let them through and the API server refused the Job at submit."""
    res = Resource(cpu=1, gpu=0, memMB=64, devices=devices)
    app = AppDef("dev", roles=[role(resource=res)])
    sched = KubernetesScheduler("test")
    with pytest.raises(InvalidAppDefException, match=words) as info:
        sched.submit_dryrun(app, {})
    assert info.value.role == "worker" and info.value.field_name == "resource.devices"


def test_huge_pages_without_cpu_or_memory_fail_the_dry_run() -> None:
    """Huge pages asked for without resource.cpu or resource.memMB (which the API server refuses:
    "HugePages require cpu or memory") fail the dry run; with memory they pass."""
    sched = KubernetesScheduler("test")
    pages = {"hugepages-2Mi": 2 * 2**21}
    bare = Resource(cpu=0, gpu=0, memMB=0, devices=pages)
    with pytest.raises(InvalidAppDefException, match=r"needs resource\.cpu or resource\.memMB"):
        sched.submit_dryrun(AppDef("hp", roles=[role(resource=bare)]), {})
    ok = Resource(cpu=0, gpu=0, memMB=64, devices=pages)
    info = sched.submit_dryrun(AppDef("hp", roles=[role(resource=ok)]), {})
    limits = info.request.jobs[0]["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert limits["limits"]["hugepages-2Mi"] == 2 * 2**21


async def test_a_line_stamped_before_the_line_written_ahead_of_it_is_returned(
    fake_k8s: FakeKubeApiServer,
) -> None:
    """A log whose second line carries an earlier timestamp than its first (stdout and stderr
    written at once: containerd stamps each before the shared lock) returns both lines."""
    sched = KubernetesScheduler("test", k8s_configuration=fake_k8s.configuration())
    base_ns = int(datetime(2026, 1, 1, tzinfo=timezone.utc).timestamp()) * 10**9

    async def log(request: web.Request) -> web.StreamResponse | None:
        if not request.path.endswith("/log"):
            return None
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(f"{format_ts(base_ns + 2000)} err\n".encode())
        await resp.write(f"{format_ts(base_ns + 1000)} out\n".encode())
        await resp.write_eof()
        return resp

    try:
        app_id = await sched.submit(AppDef("stamps", roles=[role()]), {})
        await until(
            fake_k8s,
            lambda: any(
                p["status"].get("phase") == "Succeeded" for p in fake_k8s.store.list("pods", NS)
            ),
        )
        fake_k8s.intercept = log
        with anyio.fail_after(30):
            lines = [line async for line in sched.log_iter(app_id, "worker", 0)]
        assert lines == ["err\n", "out\n"]
    finally:
        await sched.close()
