"""The kubernetes backend's control flow, end to end against the fake API server (tests/k8s_fake).

Everything goes through the real kubernetes_asyncio client over HTTP on 127.0.0.1: submit, status
from one list/watch per namespace, cancel with its propagation policy, REPLICA retries (done by the
fake Job controller from the Job's per-index backoff), ROLE and APPLICATION retries (done by the
backend), logs with since/until/regex, following logs across pod replacements and dropped streams, a
watch resumed after 410 Gone, and 50 apps waited with one watch.

What the fake cannot prove: that a real scheduler places the pods (resources, node selectors,
tolerations, priority), that images pull, that the headless Service's DNS names resolve (rank 0 is
reachable by the other replicas), admission and RBAC (including the ``services/finalizers``
permission that ``blockOwnerDeletion`` needs), and real timings of the garbage collector and kubelet.
The ``live`` tests (tests/test_kubernetes_live.py) check those on a real cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from datetime import datetime, timedelta, timezone
from typing import Any

import anyio
import pytest
from aiohttp import web
from k8s_fake import ApiError, FakeKubeApiServer, PodContext, PodScript
from k8s_fake.cluster import format_ts
from k8s_fake.testing import fake_k8s, k8s_scheduler, until

from asynctorchx import AsyncRunner
from asynctorchx.logs._cursor import LogCursor
from asynctorchx.runner.hub import PollSettings
from asynctorchx.schedulers._k8s.client import KubeApiError
from asynctorchx.schedulers._k8s.status import parse_time_ns
from asynctorchx.schedulers.api import Stream, UnknownRoleException
from asynctorchx.schedulers.kubernetes import KubernetesScheduler
from asynctorchx.specs import (
    AppDef,
    AppState,
    RetryPolicy,
    Role,
    UnknownAppException,
    parse_app_handle,
)

__all__ = ["fake_k8s", "k8s_scheduler"]

NS = "default"
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
# Pushes only: the hub's safety poll is pushed out of every test's horizon, so a waiter that
# finishes was woken by the backend's watch.
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


@pytest.fixture
async def runner(fake_k8s: FakeKubeApiServer) -> Any:
    async with AsyncRunner(
        name="test", poll_settings=PUSH_ONLY, k8s_configuration=fake_k8s.configuration()
    ) as r:
        yield r


async def submit_and_finish(srv: FakeKubeApiServer, sched: KubernetesScheduler, name: str) -> str:
    """Submits a one-replica app and returns its id once its pod has succeeded."""
    app_id = await sched.submit(AppDef(name, roles=[role()]), {})
    await until(
        srv,
        lambda: any(p["status"].get("phase") == "Succeeded" for p in srv.store.list("pods", NS)),
    )
    return app_id


def app_id_of(handle: str) -> str:
    return parse_app_handle(handle).app_id


def running_pods(srv: FakeKubeApiServer, app: str = "") -> list[dict[str, Any]]:
    return [
        p
        for p in srv.store.list("pods", NS)
        if p["status"].get("phase") == "Running"
        and (not app or p["metadata"]["labels"]["asynctorchx.dev/app-id"] == app)
    ]


async def test_success(fake_k8s: FakeKubeApiServer, runner: AsyncRunner) -> None:
    """A 2-replica app succeeds; each replica reports exit code 0 and its DNS hostname."""
    handle = await runner.run(AppDef("ok", roles=[role(replicas=2)]), scheduler="kubernetes")
    status = await runner.wait(handle, timeout=20)
    assert status is not None and status.state == AppState.SUCCEEDED
    assert status.num_restarts == 0
    name = app_id_of(handle).split(":")[1]
    replicas = status.roles[0].replicas
    assert [(r.id, r.state, r.exit_code) for r in replicas] == [
        (0, AppState.SUCCEEDED, 0),
        (1, AppState.SUCCEEDED, 0),
    ]
    assert replicas[1].hostname == f"{name}-worker-1.{name}"
    described = await runner.describe(handle)
    # the role as submitted: the runner adds the tracking job id (TorchX's runner does the same)
    submitted = role(replicas=2)
    submitted.env["TORCHX_JOB_ID"] = "kubernetes://test/${app_id}"
    assert described is not None and described.name == "ok" and described.roles == [submitted]


async def test_replica_macros_expand_per_pod(
    fake_k8s: FakeKubeApiServer, runner: AsyncRunner
) -> None:
    """$(JOB_COMPLETION_INDEX) expands per replica in args and env; rank 0's DNS name is exported."""
    app = AppDef(
        "macros",
        roles=[
            Role(
                "trainer",
                image="i",
                entrypoint="train",
                args=["--rank", "${replica_id}"],
                env={"RID": "${replica_id}"},
                num_replicas=2,
            ),
            Role("ps", image="i", entrypoint="ps", args=["${replica_id}"]),
        ],
    )
    handle = await runner.run(app, scheduler="kubernetes")
    assert (await runner.wait(handle, timeout=20)).state == AppState.SUCCEEDED  # type: ignore[union-attr]
    name = app_id_of(handle).split(":")[1]
    by_pod = {(c.role, c.index): c for c in fake_k8s.cluster.pod_contexts}
    assert by_pod[("trainer", 1)].argv[-2:] == ["--rank", "1"]
    assert by_pod[("trainer", 1)].env["RID"] == "1"
    assert by_pod[("ps", 0)].argv[-1] == "0"
    assert by_pod[("ps", 0)].env["TORCHX_RANK0_HOST"] == f"{name}-trainer-0.{name}"
    assert by_pod[("trainer", 0)].argv[:2] == ["/bin/sh", "-c"]


@pytest.mark.parametrize(("index", "expected"), [("0", "localhost"), ("1", "app-trainer-0.app")])
async def test_rank0_wrapper_exports_localhost_on_rank0_only(index: str, expected: str) -> None:
    """The /bin/sh wrapper of role 0 sets TORCHX_RANK0_HOST=localhost on replica 0 only."""
    from asynctorchx.schedulers._k8s.manifests import _RANK0_SCRIPT

    proc = await asyncio.create_subprocess_exec(
        "/bin/sh",
        "-c",
        _RANK0_SCRIPT,
        "asynctorchx-rank0",
        "/bin/sh",
        "-c",
        'printf %s "$TORCHX_RANK0_HOST"',
        env={
            "JOB_COMPLETION_INDEX": index,
            "TORCHX_RANK0_HOST": "app-trainer-0.app",
            "PATH": os.environ.get("PATH", ""),
        },
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    assert (proc.returncode, out.decode()) == (0, expected)


async def test_failure_reports_the_exit_code(
    fake_k8s: FakeKubeApiServer, runner: AsyncRunner
) -> None:
    """A replica exiting 3 fails the app; the status names the replica, its exit code and error."""
    error = '{"message": {"message": "CUDA out of memory", "errorCode": 3, "extraInfo": {"timestamp": "1700000000"}}}'
    fake_k8s.cluster.script = lambda ctx: PodScript(
        lines=["boom\n"],
        exit_code=3 if ctx.index == 1 else 0,
        message=error if ctx.index == 1 else "",
    )
    handle = await runner.run(AppDef("bad", roles=[role(replicas=2)]), scheduler="kubernetes")
    status = await runner.wait(handle, timeout=20)
    assert status is not None and status.state == AppState.FAILED
    assert "role 'worker' replica 1 failed with exit code 3" in status.msg
    failed = status.roles[0].replicas[1]
    assert (failed.state, failed.exit_code) == (AppState.FAILED, 3)
    assert "CUDA out of memory" in status.format()


async def test_cancel_deletes_in_the_foreground(
    fake_k8s: FakeKubeApiServer, runner: AsyncRunner
) -> None:
    """cancel deletes the Service with propagationPolicy Foreground; the app ends CANCELLED, pods gone."""
    fake_k8s.cluster.script = lambda ctx: PodScript(hold=asyncio.Event())
    handle = await runner.run(
        AppDef("long", roles=[role(replicas=2), role("ps")]), scheduler="kubernetes"
    )
    name = app_id_of(handle).split(":")[1]
    await until(fake_k8s, lambda: len(running_pods(fake_k8s, name)) == 3)
    await runner.cancel(handle)
    deletes = fake_k8s.requests_for("DELETE", "services")
    assert len(deletes) == 1
    assert deletes[0].path.endswith(f"/services/{name}")
    assert (deletes[0].body or {}).get("propagationPolicy") == "Foreground"
    status = await runner.wait(handle, timeout=20)
    assert status is not None and status.state == AppState.CANCELLED
    await until(fake_k8s, lambda: not fake_k8s.store.objects)
    after = await runner.status(handle)
    assert after is not None and after.state == AppState.CANCELLED
    await runner.cancel(handle)
    assert len(fake_k8s.requests_for("DELETE", "services")) == 1


async def test_cancel_leaves_finished_and_unknown_apps_alone(
    fake_k8s: FakeKubeApiServer, k8s_scheduler: KubernetesScheduler
) -> None:
    """Cancelling a finished app or an unknown one deletes nothing."""
    app_id = await k8s_scheduler.submit(AppDef("done", roles=[role()]), {})
    await until(
        fake_k8s,
        lambda: any(
            p["status"].get("phase") == "Succeeded" for p in fake_k8s.store.list("pods", NS)
        ),
    )
    await until(
        fake_k8s,
        lambda: all(j["status"].get("conditions") for j in fake_k8s.store.list("jobs", NS)),
    )
    await k8s_scheduler.cancel(app_id)
    await k8s_scheduler.cancel("default:never-existed-123")
    assert fake_k8s.requests_for("DELETE", "services") == []
    resp = await k8s_scheduler.describe(app_id)
    assert resp is not None and resp.state == AppState.SUCCEEDED


async def test_the_apps_a_scheduler_remembers_as_cancelled_are_bounded(
    fake_k8s: FakeKubeApiServer, k8s_scheduler: KubernetesScheduler, monkeypatch: Any
) -> None:
    """Once their objects are gone, only the last _REMEMBERED_CANCELS cancelled apps are kept
    as CANCELLED; older ones read as unknown (every cancel was kept forever)."""
    import asynctorchx.schedulers.kubernetes as k8s_module

    monkeypatch.setattr(k8s_module, "_REMEMBERED_CANCELS", 2)
    fake_k8s.cluster.script = lambda ctx: PodScript(hold=asyncio.Event())
    app_ids = [await k8s_scheduler.submit(AppDef(f"c{i}", roles=[role()]), {}) for i in range(4)]
    for app_id in app_ids:
        await k8s_scheduler.cancel(app_id)
    await until(fake_k8s, lambda: not fake_k8s.store.objects)
    states = [
        resp.state if resp is not None else None
        for resp in (await k8s_scheduler.describe_many(app_ids)).values()
    ]
    assert states == [None, None, AppState.CANCELLED, AppState.CANCELLED]
    assert len(k8s_scheduler._cancelled) == 2


async def test_replica_retry(fake_k8s: FakeKubeApiServer, runner: AsyncRunner) -> None:
    """REPLICA: the failed index is replaced by Kubernetes (per-index backoff); the app succeeds."""
    fake_k8s.cluster.script = lambda ctx: PodScript(
        exit_code=1 if (ctx.index, ctx.index_attempt) == (1, 0) else 0
    )
    app = AppDef("rep", roles=[role(replicas=2, max_retries=1, retry_policy=RetryPolicy.REPLICA)])
    handle = await runner.run(app, scheduler="kubernetes")
    status = await runner.wait(handle, timeout=20)
    assert status is not None and status.state == AppState.SUCCEEDED
    assert status.num_restarts == 1
    assert [(c.index, c.index_attempt) for c in fake_k8s.cluster.pod_contexts].count((1, 1)) == 1
    assert fake_k8s.requests_for("DELETE", "jobs") == []


async def test_replica_retries_exhausted_fail_the_app(
    fake_k8s: FakeKubeApiServer, runner: AsyncRunner
) -> None:
    """REPLICA: an index failing more than max_retries times fails the app."""
    fake_k8s.cluster.script = lambda ctx: PodScript(
        exit_code=2 if ctx.index == 0 else 0, line_interval=0
    )
    app = AppDef("rep", roles=[role(replicas=2, max_retries=2, retry_policy=RetryPolicy.REPLICA)])
    handle = await runner.run(app, scheduler="kubernetes")
    status = await runner.wait(handle, timeout=20)
    assert status is not None and status.state == AppState.FAILED
    assert status.num_restarts == 2
    assert "exit code 2" in status.msg and "MaxFailedIndexesExceeded" in status.msg


async def test_application_retry(fake_k8s: FakeKubeApiServer, runner: AsyncRunner) -> None:
    """APPLICATION: a failed role makes the backend recreate every Job with the next attempt."""
    fake_k8s.cluster.script = lambda ctx: PodScript(
        exit_code=1 if (ctx.role, ctx.app_attempt) == ("reader", 0) else 0
    )
    app = AppDef(
        "appretry",
        roles=[
            role("trainer", replicas=2, max_retries=1, retry_policy=RetryPolicy.APPLICATION),
            role("reader", max_retries=1, retry_policy=RetryPolicy.APPLICATION),
        ],
    )
    handle = await runner.run(app, scheduler="kubernetes")
    status = await runner.wait(handle, timeout=20)
    assert status is not None and status.state == AppState.SUCCEEDED, status
    assert status.num_restarts == 1
    attempts = sorted((c.role, c.index, c.app_attempt) for c in fake_k8s.cluster.pod_contexts)
    assert (
        ("trainer", 0, 1) in attempts
        and ("trainer", 1, 1) in attempts
        and ("reader", 0, 1) in attempts
    )
    job_deletes = fake_k8s.requests_for("DELETE", "jobs")
    assert len(job_deletes) == 2 and all(
        d.body["propagationPolicy"] == "Foreground" for d in job_deletes
    )
    labels = [
        j["metadata"]["labels"]["asynctorchx.dev/app-attempt"]
        for j in fake_k8s.store.list("jobs", NS)
    ]
    assert labels == ["1", "1"]


async def test_application_retries_exhausted_fail_the_app(
    fake_k8s: FakeKubeApiServer, runner: AsyncRunner
) -> None:
    """APPLICATION: after max_retries restarts, the next failure fails the app."""
    fake_k8s.cluster.script = lambda ctx: PodScript(exit_code=1)
    handle = await runner.run(
        AppDef("never", roles=[role(max_retries=2, retry_policy=RetryPolicy.APPLICATION)]),
        scheduler="kubernetes",
    )
    status = await runner.wait(handle, timeout=20)
    assert status is not None and status.state == AppState.FAILED
    assert status.num_restarts == 2
    assert sorted(c.app_attempt for c in fake_k8s.cluster.pod_contexts) == [0, 1, 2]


async def test_role_retry_restarts_only_that_role(
    fake_k8s: FakeKubeApiServer, runner: AsyncRunner
) -> None:
    """ROLE: only the failed role's Job is recreated; the other role runs once."""
    fake_k8s.cluster.script = lambda ctx: PodScript(
        exit_code=1 if (ctx.role, ctx.role_attempt) == ("reader", 0) else 0
    )
    app = AppDef(
        "roleretry",
        roles=[role("trainer"), role("reader", max_retries=1, retry_policy=RetryPolicy.ROLE)],
    )
    handle = await runner.run(app, scheduler="kubernetes")
    status = await runner.wait(handle, timeout=20)
    assert status is not None and status.state == AppState.SUCCEEDED
    assert status.num_restarts == 1
    roles = [c.role for c in fake_k8s.cluster.pod_contexts]
    assert roles.count("trainer") == 1 and roles.count("reader") == 2


async def test_a_failed_role_stops_the_others(
    fake_k8s: FakeKubeApiServer, runner: AsyncRunner
) -> None:
    """When a role fails for good, the backend suspends the app's other Jobs: their pods stop."""
    fake_k8s.cluster.script = lambda ctx: (
        PodScript(exit_code=1) if ctx.role == "reader" else PodScript(hold=asyncio.Event())
    )
    handle = await runner.run(
        AppDef("stop", roles=[role("trainer", replicas=2), role("reader")]), scheduler="kubernetes"
    )
    status = await runner.wait(handle, timeout=20)
    assert status is not None and status.state == AppState.FAILED
    name = app_id_of(handle).split(":")[1]
    await until(fake_k8s, lambda: not running_pods(fake_k8s, name))
    trainer = fake_k8s.store.get("jobs", NS, f"{name}-trainer")
    assert trainer["spec"]["suspend"] is True
    final = await runner.status(handle)
    assert final is not None and final.state == AppState.FAILED


async def test_unknown_app_is_none(k8s_scheduler: KubernetesScheduler) -> None:
    """An app id the cluster does not have (or that is not one of ours) describes as None."""
    assert await k8s_scheduler.describe("default:nothing-here-1234") is None
    assert await k8s_scheduler.describe("not an app id") is None
    assert await k8s_scheduler.exists("default:nothing-here-1234") is False
    many = await k8s_scheduler.describe_many(["default:a-12345678", "x"])
    assert many == {"default:a-12345678": None, "x": None}
    with pytest.raises(UnknownAppException):
        async for _ in k8s_scheduler.log_iter("default:nothing-here-1234", "worker"):
            pass


async def test_list(fake_k8s: FakeKubeApiServer, k8s_scheduler: KubernetesScheduler) -> None:
    """list returns the backend's apps in the namespace with state, name and session handle."""
    fake_k8s.cluster.script = lambda ctx: (
        PodScript(hold=asyncio.Event()) if ctx.app.startswith("held") else PodScript()
    )
    done = await k8s_scheduler.submit(AppDef("quick", roles=[role()]), {})
    held = await k8s_scheduler.submit(AppDef("held", roles=[role()]), {})
    other = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "not-ours"},
        "spec": {"clusterIP": "None"},
    }
    fake_k8s.store.create("services", NS, other)
    await until(fake_k8s, lambda: bool(running_pods(fake_k8s, held.split(":")[1])))
    await until(
        fake_k8s, lambda: any(j["status"].get("succeeded") for j in fake_k8s.store.list("jobs", NS))
    )
    apps = {a.app_id: a for a in await k8s_scheduler.list()}
    assert set(apps) == {done, held}
    assert apps[done].state == AppState.SUCCEEDED and apps[done].name == "quick"
    assert apps[held].state == AppState.RUNNING
    assert apps[held].app_handle == f"kubernetes://test/{held}"


async def test_describe_many_costs_constant_round_trips(
    fake_k8s: FakeKubeApiServer, k8s_scheduler: KubernetesScheduler
) -> None:
    """Without a watch, describing 20 apps costs one list per kind, not one call per app."""
    ids = [await k8s_scheduler.submit(AppDef(f"a{i}", roles=[role()]), {}) for i in range(20)]
    before = len(fake_k8s.requests)
    results = await k8s_scheduler.describe_many(ids)
    assert all(r is not None for r in results.values())
    assert len(fake_k8s.requests) - before == 3


async def test_logs_since_until_and_regex(fake_k8s: FakeKubeApiServer, runner: AsyncRunner) -> None:
    """since/until bound lines by their kubelet timestamps; regex filters; newlines are kept."""
    lines = [f"step {i} {'even' if i % 2 == 0 else 'odd'}\n" for i in range(6)]
    fake_k8s.cluster.script = lambda ctx: PodScript(
        lines=[*lines, b"bad \xff byte\n", "no newline"], line_interval=0.02
    )
    handle = await runner.run(AppDef("logs", roles=[role()]), scheduler="kubernetes")
    await runner.wait(handle, timeout=20)
    everything = [line async for line in runner.log_lines(handle, "worker")]
    assert everything == [*lines, "bad \ufffd byte\n", "no newline"]
    ((_, log),) = fake_k8s.cluster.logs.items()
    stamps = [ts for ts, _ in log.lines]
    since = EPOCH + timedelta(microseconds=stamps[1] // 1000)
    until_ = EPOCH + timedelta(microseconds=stamps[4] // 1000 + 1)
    window = [line async for line in runner.log_lines(handle, "worker", since=since, until=until_)]
    assert window == lines[1:5]
    odd = [line async for line in runner.log_lines(handle, "worker", regex=r"odd$", since=since)]
    assert odd == [lines[1], lines[3], lines[5]]
    local = [
        line
        async for line in runner.log_lines(
            handle, "worker", since=since.astimezone().replace(tzinfo=None), until=until_
        )
    ]
    assert local == lines[1:5]


async def run_replaced_pod(
    fake_k8s: FakeKubeApiServer, runner: AsyncRunner, read_first: asyncio.Event
) -> str:
    """Runs a one-replica app (REPLICA retry) whose first pod writes ``first 0``/``first 1`` and
    fails once ``read_first`` is set; its replacement writes ``second 0``/``second 1``."""

    def script(ctx: PodContext) -> PodScript:
        if ctx.index_attempt == 0:
            return PodScript(lines=["first 0\n", "first 1\n"], exit_code=1, hold=read_first)
        return PodScript(lines=["second 0\n", "second 1\n"], line_interval=0.02)

    fake_k8s.cluster.script = script
    app = AppDef("replaced", roles=[role(max_retries=1, retry_policy=RetryPolicy.REPLICA)])
    return await runner.run(app, scheduler="kubernetes")


async def test_follow_across_a_pod_replacement(
    fake_k8s: FakeKubeApiServer, runner: AsyncRunner
) -> None:
    """Following a replica reads its failed pod, then the replacement, each line exactly once."""

    # the first pod fails only once the follower has read it: a follower that started after the
    # replacement would read the newest pod only
    read_first = asyncio.Event()
    handle = await run_replaced_pod(fake_k8s, runner, read_first)
    got = []
    async for line in runner.log_lines(handle, "worker", should_tail=True):
        got.append(line)
        if line == "first 1\n":
            read_first.set()
    assert got == ["first 0\n", "first 1\n", "second 0\n", "second 1\n"]
    status = await runner.status(handle)
    assert status is not None and status.state == AppState.SUCCEEDED


async def test_a_cursor_of_a_replaced_pod_resumes_its_rest_then_the_new_pod(
    fake_k8s: FakeKubeApiServer, runner: AsyncRunner
) -> None:
    """A cursor taken in a pod that has since failed and been replaced (REPLICA retry) resumes
    with the rest of that pod's log, then the replacement's, each line once (read and tailed)."""
    read_first = asyncio.Event()
    handle = await run_replaced_pod(fake_k8s, runner, read_first)
    with anyio.fail_after(30):
        async with contextlib.aclosing(
            runner.log_entries(handle, "worker", should_tail=True)
        ) as entries:
            cursor, line = await anext(entries)
        assert line == "first 0\n"
        read_first.set()  # the first pod fails and is replaced
        status = await runner.wait(handle)
        assert status is not None and status.state == AppState.SUCCEEDED
        for tail in (False, True):
            rest = [
                ln
                async for ln in runner.log_lines(handle, "worker", should_tail=tail, cursor=cursor)
            ]
            assert rest == ["first 1\n", "second 0\n", "second 1\n"], tail


async def _replace_first_pod_after_a_cursor(
    fake_k8s: FakeKubeApiServer, runner: AsyncRunner
) -> tuple[str, str, dict[str, Any]]:
    """The handle of a finished ``run_replaced_pod`` app, a cursor taken at ``first 0`` in its
    first pod, and that (replaced) pod as stored."""
    read_first = asyncio.Event()
    handle = await run_replaced_pod(fake_k8s, runner, read_first)
    async with contextlib.aclosing(runner.log_entries(handle, "worker", should_tail=True)) as it:
        cursor, line = await anext(it)
    assert line == "first 0\n"
    read_first.set()
    status = await runner.wait(handle)
    assert status is not None and status.state == AppState.SUCCEEDED
    uid = LogCursor.decode(cursor).position[0]
    (pod,) = (p for p in fake_k8s.store.list("pods", NS) if p["metadata"]["uid"] == uid)
    return handle, cursor, pod


async def test_a_cursor_of_a_replaced_pod_still_listed_running_reads_its_rest_first(
    fake_k8s: FakeKubeApiServer, runner: AsyncRunner
) -> None:
    """A cursor of a replaced pod the API still lists as running (terminating: not yet terminal)
    resumes with the rest of that pod's log, then the replacement's: the rest is not lost."""
    with anyio.fail_after(30):
        handle, cursor, old = await _replace_first_pod_after_a_cursor(fake_k8s, runner)
        old["status"] = {**old["status"], "phase": "Running"}
        # created a second before its replacement: the newest pod is told by creation time (the
        # resource version this update bumps only breaks ties within one second)
        born = parse_time_ns(old["metadata"]["creationTimestamp"]) or 0
        old["metadata"] = {
            **old["metadata"],
            "creationTimestamp": format_ts(born - 10**9),
            "ownerReferences": [],  # orphaned: the fake's Job controller and GC leave it listed
        }
        fake_k8s.store.replace("pods", old)
        scheduler = runner._scheduler("kubernetes")
        assert isinstance(scheduler, KubernetesScheduler)

        def seen() -> bool:
            inf = scheduler._informers.synced(NS)
            pods = inf.app_objects(app_id_of(handle).split(":")[-1])[2] if inf else []
            return any(p["status"].get("phase") == "Running" for p in pods)

        await until(fake_k8s, seen)
        rest = [ln async for ln in runner.log_lines(handle, "worker", cursor=cursor)]
    assert rest == ["first 1\n", "second 0\n", "second 1\n"]


async def test_a_cursor_of_a_replaced_pod_whose_log_is_refused_reads_the_new_pod(
    fake_k8s: FakeKubeApiServer, runner: AsyncRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-follow read from a cursor of a replaced pod whose log the API refuses (404) goes on
    with the replacement's log rather than returning nothing."""
    with anyio.fail_after(30):
        handle, cursor, old = await _replace_first_pod_after_a_cursor(fake_k8s, runner)
        served = fake_k8s._log

        async def refuse_old(request: Any, ns: str, name: str, query: dict[str, str]) -> Any:
            if name == old["metadata"]["name"]:
                raise ApiError(404, "NotFound", f'pods "{name}" not found')
            return await served(request, ns, name, query)

        monkeypatch.setattr(fake_k8s, "_log", refuse_old)
        rest = [ln async for ln in runner.log_lines(handle, "worker", cursor=cursor)]
    assert rest == ["second 0\n", "second 1\n"]


async def test_follow_across_an_application_restart(
    fake_k8s: FakeKubeApiServer, runner: AsyncRunner
) -> None:
    """Following a replica continues into the recreated Job's pod after an APPLICATION retry."""
    # the first attempt fails only once its line was read: a retry deletes the failed Job and its
    # pods, so a follower that started later could not read that attempt at all
    release = asyncio.Event()
    fake_k8s.cluster.script = lambda ctx: PodScript(
        lines=[f"attempt {ctx.app_attempt}\n"],
        exit_code=1 if ctx.app_attempt == 0 else 0,
        line_interval=0.02,
        hold=release if ctx.app_attempt == 0 else None,
    )
    handle = await runner.run(AppDef("follow", roles=[role(max_retries=1)]), scheduler="kubernetes")
    got = []
    async for line in runner.log_lines(handle, "worker", should_tail=True):
        got.append(line)
        release.set()
    assert got == ["attempt 0\n", "attempt 1\n"]


async def test_follow_resumes_a_dropped_stream_without_duplicates(
    fake_k8s: FakeKubeApiServer, runner: AsyncRunner
) -> None:
    """A log stream cut mid-way is resumed from the last timestamp: no line lost or repeated."""
    lines = [f"line {i}\n" for i in range(12)]
    # lines 3 and 7 are written only once the stream was cut after lines 0-2 and 3-6 were read:
    # the pod is still running, its stream open, when it is cut
    gates = {3: asyncio.Event(), 7: asyncio.Event()}
    fake_k8s.cluster.script = lambda ctx: PodScript(lines=lines, line_interval=0.02, gates=gates)
    handle = await runner.run(AppDef("drop", roles=[role()]), scheduler="kubernetes")
    got: list[str] = []
    drops = 0
    async for line in runner.log_lines(handle, "worker", should_tail=True):
        got.append(line)
        if len(got) in gates:
            drops += fake_k8s.drop_log_streams()
            gates[len(got)].set()
    assert drops == 2
    assert got == lines
    assert len(fake_k8s.requests_for("GET", "pods", watch=False)) >= 0
    log_reads = [r for r in fake_k8s.requests if r.path.endswith("/log")]
    assert len(log_reads) >= 3 and log_reads[-1].query.get("sinceTime")


async def test_a_silent_follow_is_reopened_without_losing_or_repeating_a_line(
    fake_k8s: FakeKubeApiServer,
) -> None:
    """A followed log whose connection goes silent without closing (half-open) is re-opened after
    the log read timeout from its last line; the follow ends with the pod, no line lost or repeated.
    """
    lines = [f"line {i}\n" for i in range(10)]
    # lines 3-9 are written only once the stream went silent after lines 0-2; lines are stamped in
    # pairs, so line 3 shares line 2's timestamp: the re-opened read must skip exactly one line
    gates = {3: asyncio.Event()}
    fake_k8s.cluster.script = lambda ctx: PodScript(
        lines=lines, line_interval=0.01, gates=gates, burst=2
    )
    got: list[str] = []
    silenced = 0
    async with AsyncRunner(
        name="test",
        poll_settings=PUSH_ONLY,
        k8s_configuration=fake_k8s.configuration(),
        log_read_timeout=0.5,
    ) as runner:
        handle = await runner.run(AppDef("silent", roles=[role()]), scheduler="kubernetes")
        with anyio.fail_after(45):
            async for line in runner.log_lines(handle, "worker", should_tail=True):
                got.append(line)
                if len(got) == 3:
                    silenced += fake_k8s.silence_log_streams()
                    gates[3].set()
    assert silenced == 1 and fake_k8s.silenced_log_streams == 1
    assert got == lines
    log_reads = [r for r in fake_k8s.requests if r.path.endswith("/log")]
    assert len(log_reads) >= 2 and log_reads[-1].query.get("sinceTime")


async def test_following_an_ended_pod_whose_log_never_comes_fails_instead_of_hanging(
    fake_k8s: FakeKubeApiServer,
) -> None:
    """Following the log of a pod that has ended, on a server that answers and then sends
    nothing, fails with "Unreachable" after a few read timeouts instead of waiting forever."""
    released = asyncio.Event()

    async def silent_log(request: web.Request) -> web.StreamResponse | None:
        if not request.path.endswith("/log"):
            return None
        resp = web.StreamResponse()
        await resp.prepare(request)
        await released.wait()
        return resp

    sched = KubernetesScheduler(
        "test", k8s_configuration=fake_k8s.configuration(), request_timeout=1
    )
    try:
        app_id = await submit_and_finish(fake_k8s, sched, "ended")
        fake_k8s.intercept = silent_log
        with anyio.fail_after(45), pytest.raises(KubeApiError, match="Unreachable"):
            async for _ in sched.log_iter(app_id, "worker", 0, should_tail=True):
                pass
        log_reads = [r for r in fake_k8s.requests if r.path.endswith("/log")]
        assert all(r.query.get("follow") is None for r in log_reads)
    finally:
        released.set()
        await sched.close()


def test_a_log_read_timeout_that_is_not_a_positive_number_is_refused() -> None:
    """``log_read_timeout`` of 0, a negative number, infinity or a bool (``True`` read as one
    second) is a clear error, not a follow that never times out or times out at once."""
    for bad in (0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match=r"log_read_timeout must be a positive number"):
            KubernetesScheduler("test", log_read_timeout=bad)


@pytest.mark.timeout(60)
async def test_a_log_read_longer_than_the_request_timeout_returns_every_line(
    fake_k8s: FakeKubeApiServer,
) -> None:
    """A log read (no follow) that keeps sending for 5 request timeouts returns all its lines
    (it was cut after each request timeout and failed after 3 resumes: "Unreachable")."""
    sched = KubernetesScheduler(
        "test", k8s_configuration=fake_k8s.configuration(), request_timeout=1
    )
    count, gap = 250, 0.02  # 5 s of sending: more than the 4 timeouts a read could take before
    base_ns = int(datetime(2026, 1, 1, tzinfo=timezone.utc).timestamp()) * 10**9

    async def slow_log(request: web.Request) -> web.StreamResponse | None:
        if not request.path.endswith("/log"):
            return None
        since = request.query.get("sinceTime")
        first = 0 if since is None else ((parse_time_ns(since) or base_ns) - base_ns) // 10**9
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(first, count):  # a line a second of the pod's time: resumes are exact
            await resp.write(f"{format_ts(base_ns + i * 10**9)} line {i}\n".encode())
            await asyncio.sleep(gap)
        await resp.write_eof()
        return resp

    try:
        app_id = await submit_and_finish(fake_k8s, sched, "slowlog")
        fake_k8s.intercept = slow_log
        lines = [line async for line in sched.log_iter(app_id, "worker", 0)]
        assert lines == [f"line {i}\n" for i in range(count)]
    finally:
        await sched.close()


async def test_log_arguments_are_checked(fake_k8s: FakeKubeApiServer, runner: AsyncRunner) -> None:
    """Separate stdout/stderr, unknown roles and replicas out of range are clear errors."""
    handle = await runner.run(AppDef("args", roles=[role(replicas=2)]), scheduler="kubernetes")
    with pytest.raises(ValueError, match=r"unsupported log stream .* scheduler reads combined$"):
        async for _ in runner.log_lines(handle, "worker", streams=Stream.STDERR):
            pass
    with pytest.raises(UnknownRoleException, match="no role 'nope'"):
        async for _ in runner.log_lines(handle, "nope"):
            pass
    with pytest.raises(UnknownRoleException, match="k=2"):
        async for _ in runner.log_lines(handle, "worker", k=2):
            pass
    combined = [
        line
        async for line in runner.log_lines(
            handle, "worker", k=1, streams=Stream.COMBINED, should_tail=True
        )
    ]
    assert len(combined) == 1 and combined[0].endswith(" python -m worker\n")


async def test_watch_resumes_after_410_gone(
    fake_k8s: FakeKubeApiServer, runner: AsyncRunner
) -> None:
    """A dropped watch resumes from the last version it was sent (here a Job's change); that version
    compacted, it relists (410 Gone) and still wakes the waiter."""
    release = asyncio.Event()
    fake_k8s.cluster.script = lambda ctx: PodScript(hold=release)
    handle = await runner.run(AppDef("gone", roles=[role()]), scheduler="kubernetes")
    name = app_id_of(handle).split(":")[1]
    waiter = asyncio.ensure_future(runner.wait(handle, timeout=20))
    await until(fake_k8s, lambda: bool(running_pods(fake_k8s, name)) and fake_k8s.open_watches == 3)
    # a change while the first Jobs watch is open: the backend's version moves past the list's
    (jobs_watch,) = fake_k8s.requests_for("GET", "jobs", watch=True)
    touched = fake_k8s.store.patch(
        "jobs", NS, f"{name}-worker", {"metadata": {"annotations": {"test/touched": "1"}}}
    )
    touched_version = touched["metadata"]["resourceVersion"]
    await until(fake_k8s, lambda: touched_version in fake_k8s.sent_versions(jobs_watch))
    sched = runner._scheduler("kubernetes")
    assert isinstance(sched, KubernetesScheduler)
    lists_before = len(fake_k8s.requests_for("GET", "jobs", watch=False))
    fake_k8s.compact()
    assert fake_k8s.drop_watches() == 3
    await until(
        fake_k8s,
        lambda: (
            sched.watch_stats()["relists"] == 3
            and fake_k8s.open_watches == 3
            and all(
                len(fake_k8s.requests_for("GET", k, watch=True)) == 3
                for k in ("services", "jobs", "pods")
            )
        ),
    )
    assert len(fake_k8s.requests_for("GET", "jobs", watch=False)) > lists_before
    first, expired, relisted = fake_k8s.requests_for("GET", "jobs", watch=True)
    # it resumed from the last version the first watch was sent (an event or a bookmark may have
    # come after the watch opened), which the compaction expired; then it relisted
    last_seen = [first.query["resourceVersion"], *fake_k8s.sent_versions(first)][-1]
    assert int(last_seen) >= int(touched_version) > int(first.query["resourceVersion"])
    assert expired.query["resourceVersion"] == last_seen
    assert int(relisted.query["resourceVersion"]) > int(expired.query["resourceVersion"])
    release.set()
    status = await waiter
    assert status is not None and status.state == AppState.SUCCEEDED


async def test_watch_survives_a_cut_connection(
    fake_k8s: FakeKubeApiServer, runner: AsyncRunner
) -> None:
    """A watch connection cut without 410 resumes from its last resourceVersion (no relist)."""
    release = asyncio.Event()
    fake_k8s.cluster.script = lambda ctx: PodScript(hold=release)
    handle = await runner.run(AppDef("cut", roles=[role()]), scheduler="kubernetes")
    waiter = asyncio.ensure_future(runner.wait(handle, timeout=20))
    await until(fake_k8s, lambda: bool(running_pods(fake_k8s)) and fake_k8s.open_watches == 3)
    fake_k8s.drop_watches(abrupt=True)
    await until(fake_k8s, lambda: len(fake_k8s.requests_for("GET", "pods", watch=True)) >= 2)
    release.set()
    status = await waiter
    assert status is not None and status.state == AppState.SUCCEEDED
    sched = runner._scheduler("kubernetes")
    assert isinstance(sched, KubernetesScheduler) and sched.watch_stats()["relists"] == 0


@pytest.mark.timeout(60)
async def test_fifty_apps_waited_with_one_watch(
    fake_k8s: FakeKubeApiServer, runner: AsyncRunner
) -> None:
    """50 apps waited together cost one watch per kind and no per-app status calls."""
    fake_k8s.cluster.script = lambda ctx: PodScript(lines=["hi\n"], start_delay=0.05)
    handles = await asyncio.gather(
        *(
            runner.run(AppDef(f"many{i}", roles=[role(replicas=2)]), scheduler="kubernetes")
            for i in range(50)
        )
    )
    results = await runner.wait_all(handles)
    assert len(results) == 50
    assert all(st is not None and st.state == AppState.SUCCEEDED for st in results.values())
    for kind in ("services", "jobs", "pods"):
        assert len(fake_k8s.requests_for("GET", kind, watch=True)) == 1, kind
        gets = [
            r
            for r in fake_k8s.requests_for("GET", kind, watch=False)
            if not r.path.endswith(f"/{kind}")
        ]
        assert gets == [], f"per-app GETs of {kind}"
    # one list of Jobs to start the watch, then at most one per status round made before the
    # watch had synced (how many rounds that is depends on how fast the fake answers)
    lists = fake_k8s.requests_for("GET", "jobs", watch=False)
    rounds = runner.hub("kubernetes").rounds
    assert len(lists) <= rounds + 1, f"{len(lists)} job lists in {rounds} rounds for 50 apps"
    sched = runner._scheduler("kubernetes")
    assert isinstance(sched, KubernetesScheduler) and sched.watch_stats()["relists"] == 0


async def test_failed_submit_leaves_nothing(
    fake_k8s: FakeKubeApiServer, k8s_scheduler: KubernetesScheduler
) -> None:
    """A Job the API server rejects fails the submit and deletes the Service already created."""
    info = k8s_scheduler.submit_dryrun(
        AppDef("rej", roles=[role(), role("ps")]),
        {"pod_overlay": '{"spec": {"nodeSelectr": {"a": "b"}}}'},
    )
    with pytest.raises(KubeApiError, match="422"):
        await k8s_scheduler.schedule(info)
    await until(fake_k8s, lambda: not fake_k8s.store.objects)
    assert fake_k8s.requests_for("DELETE", "services")


def answer_services_late(
    fake_k8s: FakeKubeApiServer, created: asyncio.Event, release: asyncio.Event
) -> Any:
    """An intercept under which the fake creates each Service at once but answers only once
    ``release`` is set (a slow API server, or a connection lost after the request arrived)."""

    async def intercept(request: web.Request) -> web.Response | None:
        if request.method != "POST" or not request.path.endswith("/services"):
            return None
        fake_k8s.store.create("services", NS, await request.json())
        created.set()
        await release.wait()
        return web.json_response({}, status=500)

    return intercept


async def test_a_submit_whose_service_create_times_out_leaves_no_service(
    fake_k8s: FakeKubeApiServer,
) -> None:
    """A Service created by the server whose answer comes after the request timeout is deleted
    by the failed submit (it stayed, an app PENDING forever in list)."""
    created, release = asyncio.Event(), asyncio.Event()
    fake_k8s.intercept = answer_services_late(fake_k8s, created, release)
    sched = KubernetesScheduler(
        "test", k8s_configuration=fake_k8s.configuration(), request_timeout=1
    )
    try:
        with pytest.raises(KubeApiError, match="Unreachable"):
            await sched.submit(AppDef("late", roles=[role()]), {})
        assert created.is_set()
        await until(fake_k8s, lambda: not fake_k8s.store.objects)
        assert fake_k8s.requests_for("POST", "jobs") == []
    finally:
        release.set()
        await sched.close()


async def test_a_request_without_an_answer_names_the_timeout(
    fake_k8s: FakeKubeApiServer,
) -> None:
    """A read the API server does not answer within request_timeout says so, with the timeout
    (the message was an empty "TimeoutError: ")."""
    release = asyncio.Event()

    async def never(request: web.Request) -> web.Response | None:
        await release.wait()
        return None

    sched = KubernetesScheduler(
        "test", k8s_configuration=fake_k8s.configuration(), request_timeout=1
    )
    fake_k8s.intercept = never
    try:
        with pytest.raises(
            KubeApiError, match=r"0 Unreachable: TimeoutError: no answer within 1 s$"
        ):
            await sched.describe("default:nobody-12345678")
    finally:
        release.set()
        await sched.close()


async def test_a_submit_cancelled_while_its_service_is_created_leaves_no_service(
    fake_k8s: FakeKubeApiServer, k8s_scheduler: KubernetesScheduler
) -> None:
    """A submit cancelled after the server created its Service but before the answer came
    deletes that Service (it stayed)."""
    created, release = asyncio.Event(), asyncio.Event()
    fake_k8s.intercept = answer_services_late(fake_k8s, created, release)
    try:
        submit = asyncio.ensure_future(k8s_scheduler.submit(AppDef("cut", roles=[role()]), {}))
        with anyio.fail_after(20):
            await created.wait()
        submit.cancel()
        with pytest.raises(asyncio.CancelledError):
            await submit
        await until(fake_k8s, lambda: not fake_k8s.store.objects)
    finally:
        release.set()


async def test_a_service_create_refused_as_a_conflict_deletes_nothing(
    fake_k8s: FakeKubeApiServer, k8s_scheduler: KubernetesScheduler
) -> None:
    """A Service create refused with 409 (the name is another app's) deletes nothing."""

    async def conflict(request: web.Request) -> web.Response | None:
        if request.method == "POST" and request.path.endswith("/services"):
            body = {"kind": "Status", "reason": "AlreadyExists", "code": 409, "message": "taken"}
            return web.json_response(body, status=409)
        return None

    fake_k8s.intercept = conflict
    with pytest.raises(KubeApiError, match="409 AlreadyExists: taken"):
        await k8s_scheduler.submit(AppDef("taken", roles=[role()]), {})
    assert [r.method for r in fake_k8s.requests if r.method != "GET"] == ["POST"]


async def test_a_response_that_is_not_json_is_a_kube_api_error_quoting_it(
    fake_k8s: FakeKubeApiServer, k8s_scheduler: KubernetesScheduler
) -> None:
    """A 2xx answer that is not JSON (an HTML page from a proxy) is a KubeApiError "BadResponse"
    quoting its start, for submits and status reads alike (it was a bare JSONDecodeError)."""
    app_id = await k8s_scheduler.submit(AppDef("html", roles=[role()]), {})

    async def html_page(request: web.Request) -> web.Response:
        return web.Response(status=200, text="<html>Sign in to the proxy</html>")

    fake_k8s.intercept = html_page
    with pytest.raises(KubeApiError, match=r"200 BadResponse: .*<html>Sign in to the proxy"):
        await k8s_scheduler.describe(app_id)
    with pytest.raises(KubeApiError, match=r"200 BadResponse: .*<html>Sign in"):
        await k8s_scheduler.submit(AppDef("html2", roles=[role()]), {})


async def test_close_stops_the_watches(fake_k8s: FakeKubeApiServer) -> None:
    """close() ends the watch task; the scheduler refuses work afterwards."""
    sched = KubernetesScheduler("test", k8s_configuration=fake_k8s.configuration())
    unsubscribe = sched.subscribe(lambda app_id: None)
    app_id = await sched.submit(AppDef("c", roles=[role()]), {})
    await sched.describe(app_id)
    await until(fake_k8s, lambda: fake_k8s.open_watches == 3)
    await sched.close()
    await sched.close()
    unsubscribe()
    await until(fake_k8s, lambda: fake_k8s.open_watches == 0)
    with pytest.raises(RuntimeError, match="closed"):
        await sched.describe(app_id)


async def test_close_during_a_submit_lets_it_create_its_objects(
    fake_k8s: FakeKubeApiServer,
) -> None:
    """close() while a submit creates its Jobs waits for it: the submit returns its app, whole
    (the client was closed under it: "Server disconnected", and a new client was opened and
    leaked to clean up)."""
    sched = KubernetesScheduler("test", k8s_configuration=fake_k8s.configuration())
    sched.subscribe(lambda app_id: None)  # the submit then starts the namespace's watch too
    creating, release = asyncio.Event(), asyncio.Event()

    async def hold_jobs(request: web.Request) -> web.Response | None:
        if request.method == "POST" and request.path.endswith("/jobs"):
            creating.set()
            await release.wait()
        return None

    fake_k8s.intercept = hold_jobs
    submit = asyncio.ensure_future(sched.submit(AppDef("cl", roles=[role(), role("ps")]), {}))
    with anyio.fail_after(20):
        await creating.wait()
    closing = asyncio.ensure_future(sched.close())
    with anyio.fail_after(20):
        while not sched._closed:  # close() has begun
            await asyncio.sleep(0.01)
    assert not closing.done()
    release.set()
    with anyio.fail_after(20):
        app_id = await submit
        await closing
    name = app_id_of(f"kubernetes://test/{app_id}").split(":")[1]
    assert {o["metadata"]["name"] for o in fake_k8s.store.list("jobs", NS)} == {
        f"{name}-worker",
        f"{name}-ps",
    }
    with pytest.raises(RuntimeError, match="closed"):
        await sched.submit(AppDef("after", roles=[role()]), {})


async def test_disruption_is_a_restart_not_a_failure(
    fake_k8s: FakeKubeApiServer, runner: AsyncRunner
) -> None:
    """A preempted pod is replaced even with no retries; the app succeeds with one restart."""
    hold = asyncio.Event()
    fake_k8s.cluster.script = lambda ctx: PodScript(hold=hold if ctx.index_attempt == 0 else None)
    handle = await runner.run(AppDef("preempt", roles=[role()]), scheduler="kubernetes")
    await until(fake_k8s, lambda: bool(running_pods(fake_k8s)))
    fake_k8s.cluster.disrupt(NS, running_pods(fake_k8s)[0]["metadata"]["name"])
    status = await runner.wait(handle, timeout=20)
    assert status is not None and status.state == AppState.SUCCEEDED
    assert status.num_restarts == 1


async def test_kueue_queue_holds_the_app_until_admitted(
    fake_k8s: FakeKubeApiServer, runner: AsyncRunner
) -> None:
    """With queue, the Jobs wait suspended (PENDING, no pod) until Kueue unsuspends them; then run."""
    handle = await runner.run(
        AppDef("queued", roles=[role("trainer", replicas=2), role("reader")]),
        scheduler="kubernetes",
        cfg={"queue": "team-a"},
    )
    name = app_id_of(handle).split(":")[1]
    jobs = [f"{name}-trainer", f"{name}-reader"]

    def suspended(job: str) -> bool:
        found = fake_k8s.store.find("jobs", NS, job)
        conds = (found or {}).get("status", {}).get("conditions") or []
        return any(c["type"] == "Suspended" and c["status"] == "True" for c in conds)

    await until(fake_k8s, lambda: all(suspended(j) for j in jobs))
    status = await runner.status(handle)
    assert status is not None and status.state == AppState.PENDING
    assert status.msg == "waiting for Kueue to admit it (queue team-a)"
    assert fake_k8s.store.list("pods", NS) == []
    for job in jobs:  # Kueue admits the workloads: it unsuspends their Jobs
        labels = fake_k8s.store.get("jobs", NS, job)["metadata"]["labels"]
        assert labels["kueue.x-k8s.io/queue-name"] == "team-a"
        fake_k8s.store.patch("jobs", NS, job, {"spec": {"suspend": False}})
    status = await runner.wait(handle, timeout=20)
    assert status is not None and status.state == AppState.SUCCEEDED
    assert len(fake_k8s.store.list("pods", NS)) == 3
