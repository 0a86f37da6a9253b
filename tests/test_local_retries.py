"""Retries and gang failure of the local backends, with real processes.

Each replica prints ``start`` when it starts (restarts append to the same log), then waits for a file
the test creates. Replica 1 of role ``a`` fails its first attempt.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
from _local_env import GATE, group_members, wait_for

from asynctorchx.schedulers.api import DescribeAppResponse
from asynctorchx.schedulers.local import LocalScheduler
from asynctorchx.specs import AppDef, AppState, RetryPolicy, Role, macros


@pytest.fixture
async def sched(tmp_path: Path) -> AsyncIterator[LocalScheduler]:
    s = LocalScheduler("retries", local_root=tmp_path / "root")
    yield s
    await s.close()


def role(name: str, n: int, tmp: Path, fail_replica: str | None = None, **kw: object) -> Role:
    ready = tmp / "ready"
    ready.mkdir(exist_ok=True)
    fail = ""
    if fail_replica is not None:
        # fail only once every replica of the app has started, so that each restart is visible
        fail = (
            f'if [ "{macros.replica_id}" = "{fail_replica}" ] && [ ! -e "$MARK" ]; then '
            'while [ "$(ls "$READY" | wc -l)" -lt "$TOTAL" ]; do sleep 0.01; done; '
            'touch "$MARK"; exit 1; fi; '
        )
    return Role(
        name,
        image="x",
        entrypoint="sh",
        args=["-c", f'echo start; touch "$READY/{name}-{macros.replica_id}"; {fail}{GATE}'],
        env={
            "GO": str(tmp / "go"),
            "MARK": str(tmp / f"mark-{name}"),
            "READY": str(ready),
            "TOTAL": "3",
        },
        num_replicas=n,
        **kw,  # type: ignore[arg-type]
    )


async def starts(s: LocalScheduler, app_id: str, role_name: str, k: int) -> int:
    return [line async for line in s.log_iter(app_id, role_name, k)].count("start\n")


def all_running(d: DescribeAppResponse) -> bool:
    return all(r.state == AppState.RUNNING for rs in d.roles_statuses for r in rs.replicas)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (RetryPolicy.REPLICA, {("a", 0): 1, ("a", 1): 2, ("b", 0): 1}),
        (RetryPolicy.ROLE, {("a", 0): 2, ("a", 1): 2, ("b", 0): 1}),
        (RetryPolicy.APPLICATION, {("a", 0): 2, ("a", 1): 2, ("b", 0): 2}),
    ],
)
async def test_retry_policy_restarts_the_right_replicas(
    sched: LocalScheduler, tmp_path: Path, policy: RetryPolicy, expected: dict[tuple[str, int], int]
) -> None:
    """REPLICA restarts the failed replica, ROLE its role, APPLICATION every replica; the app then succeeds."""
    app = AppDef(
        "retry",
        [
            role("a", 2, tmp_path, fail_replica="1", max_retries=1, retry_policy=policy),
            role("b", 1, tmp_path),
        ],
    )
    app_id = await sched.submit(app, {})
    desc = await wait_for(sched, app_id, lambda d: d.num_restarts == 1 and all_running(d))
    assert desc.state == AppState.RUNNING
    (tmp_path / "go").touch()
    desc = await wait_for(sched, app_id)
    assert desc.state == AppState.SUCCEEDED
    assert desc.num_restarts == 1
    got = {(r, k): await starts(sched, app_id, r, k) for (r, k) in expected}
    assert got == expected


async def test_retries_exhausted_fails_the_app(sched: LocalScheduler) -> None:
    """A replica that keeps failing is restarted max_retries times, then the app fails."""
    app = AppDef(
        "fails",
        [Role("a", image="x", entrypoint="sh", args=["-c", "echo start; exit 4"], max_retries=2)],
    )
    app_id = await sched.submit(app, {})
    desc = await wait_for(sched, app_id)
    assert desc.state == AppState.FAILED
    assert desc.num_restarts == 2
    assert desc.roles_statuses[0].replicas[0].exit_code == 4
    assert await starts(sched, app_id, "a", 0) == 3


async def test_retry_budget_is_per_role(sched: LocalScheduler, tmp_path: Path) -> None:
    """A failure in a role without retries fails the app even if another role has retries left."""
    app = AppDef(
        "budget",
        [
            role("a", 1, tmp_path, max_retries=3),
            Role("b", image="x", entrypoint="sh", args=["-c", "exit 5"]),
        ],
    )
    app_id = await sched.submit(app, {"cancel_grace_period": 1.0})
    desc = await wait_for(sched, app_id)
    assert desc.state == AppState.FAILED
    assert desc.num_restarts == 0
    assert "b[0]" in desc.msg and "5" in desc.msg


async def test_failed_replica_stops_its_siblings(sched: LocalScheduler, tmp_path: Path) -> None:
    """A replica failing with no retries left fails the app and stops the others, even TERM-ignoring ones."""
    app = AppDef(
        "gang",
        [
            Role(
                "w",
                image="x",
                entrypoint="sh",
                args=[
                    "-c",
                    f'if [ "{macros.replica_id}" = 1 ]; then '
                    'while [ ! -e "$READY" ]; do sleep 0.01; done; exit 2; fi; '
                    'trap "" TERM; touch "$READY"; sleep 30',
                ],
                env={"READY": str(tmp_path / "ready")},
                num_replicas=2,
            )
        ],
    )
    app_id = await sched.submit(app, {"cancel_grace_period": 0.3})
    running = await sched.describe(app_id)
    assert running is not None
    pgid = running.roles_statuses[0].replicas[0].pid
    assert pgid is not None
    desc = await wait_for(sched, app_id)
    assert desc.state == AppState.FAILED
    first, second = desc.roles_statuses[0].replicas
    assert (second.state, second.exit_code) == (AppState.FAILED, 2)
    assert first.state == AppState.CANCELLED and first.exit_code == -9
    assert "w[1]" in desc.msg
    with anyio.fail_after(2):  # SIGKILLed members may take a moment to finish exiting
        while group_members(pgid):
            await asyncio.sleep(0.02)


async def test_a_replica_whose_restart_cannot_start_ends_failed(
    sched: LocalScheduler, tmp_path: Path
) -> None:
    """A replica exits 1 and its restart cannot start (its program removed itself): the app fails
    naming the restart, and the replica ends FAILED with its exit code, not CANCELLED (nothing
    cancelled it: its own failure is its end)."""
    program = tmp_path / "once.sh"
    program.write_text('#!/bin/sh\nrm -f "$0"\nexit 1\n')
    program.chmod(0o755)
    app = AppDef("once", [Role("a", image="x", entrypoint=str(program), max_retries=1)])
    app_id = await sched.submit(app, {})
    desc = await wait_for(sched, app_id)
    assert desc.state == AppState.FAILED
    assert desc.msg.startswith("restart failed"), desc.msg
    replica = desc.roles_statuses[0].replicas[0]
    assert (replica.state, replica.exit_code) == (AppState.FAILED, 1)


@pytest.mark.timeout(60)
async def test_another_process_sees_a_restart_while_its_scope_stops(
    sched: LocalScheduler, tmp_path: Path
) -> None:
    """Replica 0 fails and the application restarts, its other replicas ignoring SIGTERM for the
    whole grace period: another process reading the record meanwhile sees the restart (replica 0
    FAILED with its exit code, one restart), not replica 0 still RUNNING once its pid is gone."""
    script = (
        f'if [ "{macros.replica_id}" = 0 ] && [ ! -e "$MARK" ]; then touch "$MARK"; exit 3; fi; '
        "trap '' TERM; while :; do sleep 0.05; done"
    )
    role = Role(
        "main",
        image="x",
        entrypoint="sh",
        args=["-c", script],
        env={"MARK": str(tmp_path / "mark")},
        num_replicas=3,
        max_retries=1,
        retry_policy=RetryPolicy.APPLICATION,
    )
    app_id = await sched.submit(AppDef("restarts", [role]), {"cancel_grace_period": 6.0})
    other = LocalScheduler("other", local_root=tmp_path / "root")
    try:
        seen = None
        with anyio.move_on_after(4):  # well within the 6 s the others take to stop
            while True:
                seen = await other.describe(app_id)
                if seen is not None and seen.num_restarts == 1:
                    break
                await anyio.sleep(0.02)
        assert seen is not None and seen.num_restarts == 1, seen
        replica = seen.roles_statuses[0].replicas[0]
        assert (replica.state, replica.exit_code) == (AppState.FAILED, 3)
    finally:
        await other.close()
        await sched.cancel(app_id)


async def _starts(s: LocalScheduler, app_id: str, role: str, k: int) -> int:
    return [line async for line in s.log_iter(app_id, role, k)].count("start\n")


@pytest.mark.timeout(60)
async def test_under_replica_each_replica_has_its_own_retries(
    sched: LocalScheduler, tmp_path: Path
) -> None:
    """REPLICA, max_retries=1, two replicas each failing its first attempt once: each replica has
    its own retry (as a container's restart policy on local_docker and an index's backoff limit
    on Kubernetes), so the app succeeds. The role's one retry was spent by the first failure, and
    the second failed the app (the fourteenth session's review)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    script = (
        f'echo start; M="$MARKS/{macros.replica_id}"; '
        f'if [ ! -e "$M" ]; then touch "$M"; sleep 0.{macros.replica_id}; exit 1; fi; exit 0'
    )
    role = Role(
        "w",
        image=str(tmp_path),
        entrypoint="sh",
        args=["-c", script],
        env={"MARKS": str(marks)},
        num_replicas=2,
        max_retries=1,
        retry_policy=RetryPolicy.REPLICA,
    )
    app_id = await sched.submit(AppDef("perreplica", [role]), {})
    desc = await wait_for(sched, app_id)
    assert desc.state == AppState.SUCCEEDED, (desc.state, desc.msg)
    assert desc.num_restarts == 2
    assert [await _starts(sched, app_id, "w", k) for k in (0, 1)] == [2, 2]


@pytest.mark.timeout(60)
async def test_a_replica_failing_for_good_while_a_restart_stops_its_scope_is_not_restarted_over(
    sched: LocalScheduler, tmp_path: Path
) -> None:
    """Role a (ROLE, one retry) restarts after a[0] fails; a[1] ignores SIGTERM, so the stop takes
    the grace period. Meanwhile b[0] (no retries) fails: the app has failed. It ends FAILED, naming
    b[0], once the stop is over, and role a is not started again (it was, then stopped again after
    a second grace period)."""
    a_script = (
        f'echo start; if [ "{macros.replica_id}" = 0 ] && [ ! -e "$MARK" ]; then '
        'while [ ! -e "$READY" ]; do sleep 0.01; done; touch "$MARK"; exit 3; fi; '
        'touch "$READY"; trap "" TERM; while :; do sleep 0.05; done'
    )
    b_script = 'echo start; while [ ! -e "$MARK" ]; do sleep 0.01; done; sleep 0.3; exit 7'
    env = {"MARK": str(tmp_path / "mark"), "READY": str(tmp_path / "ready")}
    a = Role(
        "a",
        image=str(tmp_path),
        entrypoint="sh",
        args=["-c", a_script],
        env=env,
        num_replicas=2,
        max_retries=1,
        retry_policy=RetryPolicy.ROLE,
    )
    b = Role("b", image=str(tmp_path), entrypoint="sh", args=["-c", b_script], env=env)
    grace = 2.0
    app_id = await sched.submit(AppDef("oos", [a, b]), {"cancel_grace_period": grace})
    await wait_for(sched, app_id, lambda d: d.num_restarts == 1)
    restarted = asyncio.get_running_loop().time()
    desc = await wait_for(sched, app_id, timeout=30)
    took = asyncio.get_running_loop().time() - restarted
    assert desc.state == AppState.FAILED
    assert "b[0] exited with code 7" in desc.msg, desc.msg
    assert [await _starts(sched, app_id, "a", k) for k in (0, 1)] == [1, 1]
    assert took < 2 * grace, f"{took:.1f} s: a second grace period (the scope started again)"
    states = [r.state for r in desc.roles_statuses[0].replicas]
    assert states == [AppState.FAILED, AppState.CANCELLED]
