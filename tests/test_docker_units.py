"""Unit tests of the local_docker backend without an engine: log decoding, state rules, and the
submit error paths against a fake aiodocker client (a refused create, a failed pull, a racing
network create) that a real engine cannot be made to produce on demand."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import anyio
import pytest
from _docker_env import FakeDocker

from asynctorchx.logs._timestamps import parse_rfc3339_ns
from asynctorchx.schedulers._docker.engine import DockerEngine
from asynctorchx.schedulers._docker.frames import (
    STDERR,
    STDOUT,
    FrameDecoder,
    LineAssembler,
    format_api_time,
)
from asynctorchx.schedulers._docker.request import (
    KIND_CANCEL_MARKER,
    LABEL_APP_ID,
    LABEL_ATTEMPT,
    LABEL_KIND,
    LABEL_MAX_RETRIES,
    LABEL_NETWORK,
    LABEL_REMOVE_FINISHED,
    LABEL_REPLICA_ID,
    LABEL_RETRY_POLICY,
    LABEL_ROLE_NAME,
    LABEL_ROLES,
    cancel_marker,
    claim_name,
)
from asynctorchx.schedulers._docker.state import (
    ContainerInfo,
    RemoveApp,
    RemoveNetwork,
    RetryReplicas,
    StopContainer,
    assess,
)
from asynctorchx.schedulers.api import UnknownRoleException
from asynctorchx.schedulers.docker import (
    DockerEngineUnavailableError,
    DockerScheduler,
    DockerSchedulerError,
)
from asynctorchx.specs import AppDef, AppState, Resource, RetryPolicy, Role, VolumeMount

IMAGE = "asynctorchx-test/busybox:latest"
TS = b"2024-05-01T12:00:00.123456789Z"
TS_NS = parse_rfc3339_ns(TS)


def _frame(stream: int, payload: bytes) -> bytes:
    return struct.pack(">BxxxL", stream, len(payload)) + payload


# -- log decoding ------------------------------------------------------------------------------


def test_frame_decoder_handles_any_chunking() -> None:
    """Frames split across reads at every possible byte boundary come out whole and in order."""
    data = _frame(STDOUT, b"a\n") + _frame(STDERR, b"bb\n") + _frame(STDOUT, b"")
    for cut in range(len(data) + 1):
        decoder = FrameDecoder()
        frames = decoder.feed(data[:cut]) + decoder.feed(data[cut:])
        assert frames == [(STDOUT, b"a\n"), (STDERR, b"bb\n"), (STDOUT, b"")]
        assert decoder.pending == 0


def test_parse_timestamp_reads_docker_nanosecond_times() -> None:
    """Docker's RFC 3339 times (up to nine fraction digits, offsets) become epoch nanoseconds with
    the parser shared with Kubernetes; resuming asks Docker for ``seconds.nanoseconds``."""
    assert TS_NS == 1714564800_123456789
    assert parse_rfc3339_ns(b"2024-05-01T14:00:00.5+02:00") == 1714564800_500000000
    assert parse_rfc3339_ns(b"2024-05-01T12:00:00Z") == 1714564800_000000000
    with pytest.raises(ValueError, match="not an RFC 3339 time"):
        parse_rfc3339_ns(b"not a time")
    assert format_api_time(1714564800_000000042) == "1714564800.000000042"


def test_line_assembler_joins_split_long_lines_per_stream() -> None:
    """Docker's 16 KiB parts of one long line are joined back (never truncated), per stream."""
    asm = LineAssembler()
    part = b"x" * 16384
    assert asm.feed(STDOUT, TS + b" " + part) is None
    err = asm.feed(STDERR, TS + b" interleaved\n")
    assert err is not None and err.text == "interleaved\n" and err.stream == STDERR
    assert asm.feed(STDOUT, b"2024-05-01T12:00:01.000000000Z " + part) is None
    line = asm.feed(STDOUT, b"2024-05-01T12:00:02.000000000Z end\n")
    assert line is not None
    assert line.text == "x" * 32768 + "end\n"
    assert line.ts_ns == TS_NS  # the time of the line's first part


def test_line_assembler_replaces_invalid_utf8_and_keeps_unterminated_tail() -> None:
    """Invalid UTF-8 becomes U+FFFD; an unterminated last line is returned by flush without a newline."""
    asm = LineAssembler()
    line = asm.feed(STDOUT, TS + b" caf\xc3\xa9 \xff\xfe ok\n")
    assert line is not None and line.text == "café \ufffd\ufffd ok\n"
    assert asm.feed(STDOUT, TS + b" no newline") is None
    assert [x.text for x in asm.flush()] == ["no newline"]
    assert asm.flush() == []


# -- state rules -------------------------------------------------------------------------------


def _c(
    role: str,
    k: int,
    state: str,
    code: int | None = None,
    *,
    attempt: int = 0,
    roles: str = '[["r",2]]',
    retries: int = 0,
    policy: str = "APPLICATION",
    kind: str = "replica",
    network: str = "",
    remove_finished: bool = False,
) -> ContainerInfo:
    labels = {
        LABEL_APP_ID: "app",
        LABEL_ROLE_NAME: role,
        LABEL_REPLICA_ID: str(k),
        LABEL_ATTEMPT: str(attempt),
        LABEL_ROLES: roles,
        LABEL_MAX_RETRIES: str(retries),
        LABEL_RETRY_POLICY: policy,
        LABEL_KIND: kind,
        LABEL_NETWORK: network,
        LABEL_REMOVE_FINISHED: "true" if remove_finished else "false",
    }
    return ContainerInfo(
        id=f"{role}-{k}-{attempt}-{kind}",
        name=f"app-{role}-{k}",
        image=IMAGE,
        labels=labels,
        state=state,
        exit_code=code,
        created=0,
    )


def test_no_containers_means_unknown_app_never_succeeded() -> None:
    """An app id with no container is unknown (None), not SUCCEEDED."""
    assert assess("app", []) is None


def test_all_replicas_exit_zero_is_succeeded_and_one_failure_fails_and_stops_the_rest() -> None:
    """All zero exits: SUCCEEDED. A failure with no retry left: FAILED with its exit code, and the
    replicas still running are to be stopped."""
    ok = assess("app", [_c("r", 0, "exited", 0), _c("r", 1, "exited", 0)])
    assert ok is not None and ok.response.state == AppState.SUCCEEDED
    bad = assess("app", [_c("r", 0, "exited", 3), _c("r", 1, "running")])
    assert bad is not None and bad.response.state == AppState.FAILED
    assert "r/0" in bad.response.msg and "exit code 3" in bad.response.msg
    assert [c.replica_id for c in bad.to_stop] == [1]
    assert bad.response.roles_statuses[0].replicas[0].exit_code == 3


def test_created_is_pending_running_is_running_and_missing_replicas_are_reported() -> None:
    """Created containers: PENDING (one missing too: its create may be under way); any running:
    RUNNING; replicas missing while remove_finished removes the app's containers: UNKNOWN."""
    pending = assess("app", [_c("r", 0, "created"), _c("r", 1, "created")])
    assert pending is not None and pending.response.state == AppState.PENDING
    creating = assess("app", [_c("r", 0, "created")])
    assert creating is not None and creating.response.state == AppState.PENDING
    running = assess("app", [_c("r", 0, "running"), _c("r", 1, "exited", 0)])
    assert running is not None and running.response.state == AppState.RUNNING
    lost = assess("app", [_c("r", 0, "exited", 0, remove_finished=True)])
    assert lost is not None and lost.response.state == AppState.UNKNOWN
    assert "r/1" in lost.response.msg


def test_a_replica_whose_container_was_removed_under_us_fails_the_app() -> None:
    """Once every replica has started, a replica with no container (docker rm -f) fails the app,
    naming it, and the survivors are to be stopped: it never stays RUNNING/UNKNOWN forever."""
    for survivor in (_c("r", 0, "running"), _c("r", 0, "exited", 0)):
        a = assess("app", [survivor])
        assert a is not None and a.response.state == AppState.FAILED
        assert "r/1" in a.response.msg and "removed" in a.response.msg
        assert a.to_stop == ([survivor] if survivor.alive else [])
    stopped = assess("app", [_c("r", 0, "exited", 137)])  # the survivor, once stopped
    assert stopped is not None and stopped.response.state == AppState.FAILED
    assert "r/1" in stopped.response.msg and "removed" in stopped.response.msg


def test_cancel_marker_means_cancelled_once_nothing_is_alive() -> None:
    """With a cancel marker the app is RUNNING while a container is alive, then CANCELLED."""
    marker = _c("", -1, "created", kind=KIND_CANCEL_MARKER)
    stopping = assess("app", [_c("r", 0, "running"), _c("r", 1, "exited", 137), marker])
    assert stopping is not None and stopping.response.state == AppState.RUNNING
    done = assess("app", [_c("r", 0, "exited", 143), _c("r", 1, "exited", 137), marker])
    assert done is not None and done.response.state == AppState.CANCELLED
    states = {r.state for r in done.response.roles_statuses[0].replicas}
    assert states == {AppState.CANCELLED}


def test_application_retry_recreates_every_replica_until_retries_run_out() -> None:
    """An APPLICATION-policy failure with retries left asks for every replica as the next attempt;
    the last attempt's failure fails the app."""
    first = assess(
        "app",
        [_c("r", 0, "exited", 1, retries=1), _c("r", 1, "running", retries=1)],
    )
    assert first is not None and first.response.state == AppState.RUNNING
    assert first.retry is not None and first.retry.attempt == 1
    assert set(first.retry.replicas) == {("r", 0), ("r", 1)}
    last = assess(
        "app",
        [
            _c("r", 0, "exited", 1, retries=1),
            _c("r", 1, "exited", 137, retries=1),
            _c("r", 0, "exited", 1, attempt=1, retries=1),
            _c("r", 1, "running", attempt=1, retries=1),
        ],
    )
    assert last is not None and last.response.state == AppState.FAILED
    assert last.retry is None and last.response.num_restarts == 1


def test_role_retry_only_touches_the_failed_role() -> None:
    """A ROLE-policy failure asks only for the replicas of that role."""
    roles = '[["a",1],["b",1]]'
    a = assess(
        "app",
        [
            _c("a", 0, "exited", 2, roles=roles, retries=2, policy="ROLE"),
            _c("b", 0, "running", roles=roles, retries=2, policy="ROLE"),
        ],
    )
    assert a is not None and a.retry is not None and a.retry.replicas == (("a", 0),)


def test_replica_policy_failure_is_final_once_docker_stops_restarting() -> None:
    """With the REPLICA policy Docker restarts the container; an exited one has no retry left."""
    a = assess("app", [_c("r", 0, "exited", 1, retries=3, policy="REPLICA"), _c("r", 1, "running")])
    assert a is not None and a.response.state == AppState.FAILED and a.retry is None
    restarting = assess(
        "app", [_c("r", 0, "restarting", retries=3, policy="REPLICA"), _c("r", 1, "running")]
    )
    assert restarting is not None and restarting.response.state == AppState.RUNNING


# -- follow-up actions of the assessor -----------------------------------------------------------


def test_failed_app_owes_stopping_its_survivors_and_nothing_else_yet() -> None:
    """FAILED with a replica still running: the only action is stopping that replica; its network
    stays until nothing of the app is alive."""
    survivor = _c("r", 1, "running", network="net")
    a = assess("app", [_c("r", 0, "exited", 3, network="net"), survivor])
    assert a is not None and a.response.state == AppState.FAILED
    assert a.actions == (StopContainer(survivor.id),)


def test_a_running_or_pending_app_owes_nothing() -> None:
    """An app whose replicas run (or wait to start) asks for no action."""
    running = assess("app", [_c("r", 0, "running"), _c("r", 1, "exited", 0)])
    pending = assess("app", [_c("r", 0, "created"), _c("r", 1, "created")])
    assert running is not None and running.actions == ()
    assert pending is not None and pending.actions == ()


def test_application_retry_stops_the_live_replicas_then_recreates_every_one() -> None:
    """An APPLICATION retry: stop the replica still running, then recreate both replicas (from
    their current containers) as attempt 1."""
    failed, live = _c("r", 0, "exited", 1, retries=1), _c("r", 1, "running", retries=1)
    a = assess("app", [failed, live])
    assert a is not None and a.response.state == AppState.RUNNING
    assert a.actions == (StopContainer(live.id), RetryReplicas(1, (failed, live)))


def test_role_retry_recreates_only_the_failed_role() -> None:
    """A ROLE retry recreates the failed role's replica and leaves the other role running."""
    roles = '[["a",1],["b",1]]'
    failed = _c("a", 0, "exited", 2, roles=roles, retries=2, policy="ROLE")
    other = _c("b", 0, "running", roles=roles, retries=2, policy="ROLE")
    a = assess("app", [failed, other])
    assert a is not None and a.actions == (RetryReplicas(1, (failed,)),)


def test_superseded_attempt_still_alive_is_stopped() -> None:
    """A container of an older attempt that is still alive is stopped (the newer one runs on)."""
    old = _c("r", 0, "running", retries=1)
    a = assess(
        "app",
        [old, _c("r", 0, "running", attempt=1, retries=1), _c("r", 1, "running", attempt=1)],
    )
    assert a is not None and a.response.state == AppState.RUNNING
    assert a.actions == (StopContainer(old.id),)


def test_finished_app_owes_its_network_or_its_containers() -> None:
    """Once finished with nothing alive: its own network is removed, or with remove_finished its
    containers (and the network) are; without a network of its own, nothing is owed."""
    done = [_c("r", 0, "exited", 0, network="net"), _c("r", 1, "exited", 0, network="net")]
    a = assess("app", done)
    assert a is not None and a.response.state == AppState.SUCCEEDED
    assert a.actions == (RemoveNetwork(tuple(c.id for c in done)),)
    rm = [_c("r", k, "exited", 0, network="net", remove_finished=True) for k in (0, 1)]
    b = assess("app", rm)
    assert b is not None and b.actions == (RemoveApp(tuple(c.id for c in rm), network=True),)
    plain = assess("app", [_c("r", 0, "exited", 0), _c("r", 1, "exited", 0)])
    assert plain is not None and plain.actions == ()


def test_nothing_is_removed_while_a_replica_may_still_start() -> None:
    """A failed app with a replica created but not started (a launch under way) keeps its network:
    removing it would make that start fail; the start's event brings the stop."""
    a = assess(
        "app", [_c("r", 0, "exited", 3, network="net"), _c("r", 1, "created", network="net")]
    )
    assert a is not None and a.response.state == AppState.FAILED and a.actions == ()


def test_cancelled_app_owes_its_network_once_nothing_is_alive() -> None:
    """A cancelled app (marker) owes the stop of a live replica (one that started after the cancel
    too), and its network's removal once its replicas have stopped."""
    marker = _c("", -1, "created", kind=KIND_CANCEL_MARKER, network="net")
    running = _c("r", 0, "running", network="net")
    stopping = assess("app", [running, marker])
    assert stopping is not None and stopping.actions == (StopContainer(running.id),)
    replicas = [_c("r", 0, "exited", 143, network="net"), _c("r", 1, "exited", 137, network="net")]
    done = assess("app", [*replicas, marker])
    assert done is not None and done.response.state == AppState.CANCELLED
    assert done.actions == (RemoveNetwork(tuple(c.id for c in [*replicas, marker])),)


@pytest.mark.parametrize(
    "roles",
    [
        '[["r", 30000000]]',
        '[["r", 4194304], ["s", 1]]',
        '[["r", -5]]',
        '[["r", 1e999]]',
        "[" * 100000,
    ],
)
def test_a_roles_label_no_dry_run_makes_is_read_as_missing(roles: str) -> None:
    """A replica count no dry run accepts in the roles label (past PID_MAX_LIMIT, negative, an
    overflowing float, nesting past the recursion limit: a container anyone with the engine
    can make) is ignored, the roles read from the containers: describe (and the event feed's
    catch-up of every app) ran into a MemoryError, or raised the parse error."""
    a = assess("app", [_c("r", 0, "running", roles=roles)])
    assert a is not None and a.response.state == AppState.RUNNING
    assert [(s.role, len(s.replicas)) for s in a.response.roles_statuses] == [("r", 1)]


# -- submit error paths with a fake client ------------------------------------------------------


def _app(*roles: Role) -> AppDef:
    return AppDef("fake", list(roles))


def _role(name: str = "r", n: int = 1, **kwargs: Any) -> Role:
    return Role(
        name=name, image=IMAGE, entrypoint="sh", args=["-c", "true"], num_replicas=n, **kwargs
    )


async def _submit(docker: FakeDocker, app: AppDef, cfg: dict[str, Any] | None = None) -> str:
    scheduler = DockerScheduler("s", docker, watch_events=False)
    try:
        return await scheduler.submit(app, cfg or {})
    finally:
        await scheduler.close()


async def test_missing_image_that_cannot_be_pulled_fails_before_creating_anything() -> None:
    """A missing image is pulled; when the pull fails the error names role and image and nothing
    was created."""
    docker = FakeDocker()
    with pytest.raises(
        DockerSchedulerError, match=r"role 'r': image .*busybox.* could not be pulled"
    ):
        await _submit(docker, _app(_role()))
    assert ("pull", IMAGE) in docker.calls
    assert not any(op == "create" for op, _ in docker.calls)
    assert not docker.containers_by_id and not docker.networks_by_id


async def test_missing_image_that_can_be_pulled_is_pulled_then_used() -> None:
    """An image absent locally but pullable is pulled, then the app is created."""
    docker = FakeDocker()
    docker.pullable.add(IMAGE)
    app_id = await _submit(docker, _app(_role()))
    assert ("pull", IMAGE) in docker.calls and docker.by_name(f"{app_id}-r-0") is not None


async def test_present_image_is_not_pulled() -> None:
    """An image already present is never pulled."""
    docker = FakeDocker({IMAGE})
    await _submit(docker, _app(_role()))
    assert not any(op == "pull" for op, _ in docker.calls)


async def test_refused_container_removes_everything_already_created() -> None:
    """When Docker refuses one replica's container, the others and the app's network are removed
    and the error names the role, the replica and Docker's reason."""
    docker = FakeDocker({IMAGE})
    app = _app(_role("a", 2), _role("b", 1))
    scheduler = DockerScheduler("s", docker, watch_events=False)
    info = scheduler.submit_dryrun(app, {})
    docker.fail_create[f"{info.request.app_id}-b-0"] = "invalid mount config for type bind"
    with pytest.raises(DockerSchedulerError, match=r"role 'b' replica 0: .*invalid mount config"):
        await scheduler.schedule(info)
    await scheduler.close()
    assert not docker.containers_by_id
    assert not docker.networks_by_id


async def test_failed_start_removes_every_container() -> None:
    """A container that does not start fails the submit; nothing of the app is left."""
    docker = FakeDocker({IMAGE})
    scheduler = DockerScheduler("s", docker, watch_events=False)
    info = scheduler.submit_dryrun(_app(_role("a", 2)), {})
    docker.fail_start.add(f"{info.request.app_id}-a-1")
    with pytest.raises(DockerSchedulerError, match="did not start"):
        await scheduler.schedule(info)
    await scheduler.close()
    assert not docker.containers_by_id and not docker.networks_by_id


async def test_other_ranks_start_once_rank0_has_joined_its_network() -> None:
    """Ranks 1.. are started as soon as rank 0 has joined the app's network (Docker's connect
    event), while rank 0's own start is still under way; the submit returns once all started."""
    docker = FakeDocker({IMAGE})
    scheduler = DockerScheduler("s", docker, watch_events=False)
    info = scheduler.submit_dryrun(_app(_role("a", 3)), {})
    app_id = info.request.app_id
    docker.hold_start[f"{app_id}-a-0"] = release = asyncio.Event()
    submit = asyncio.ensure_future(scheduler.schedule(info))
    try:
        with anyio.fail_after(10):
            await docker.start_asked(f"{app_id}-a-1").wait()
            await docker.start_asked(f"{app_id}-a-2").wait()
        assert not submit.done()
        release.set()
        with anyio.fail_after(10):
            assert await submit == app_id
    finally:
        release.set()
        await asyncio.gather(submit, return_exceptions=True)
        await scheduler.close()
    assert all(c.state == "running" for c in docker.containers_by_id.values())


@pytest.mark.parametrize(("replicas", "failing"), [(3, 0), (2, 1)])
async def test_a_start_failing_while_rank0_starts_leaves_nothing(
    replicas: int, failing: int
) -> None:
    """A start failing while the starts overlap (rank 0's after it joined, the others already
    asked for; or rank 1's while rank 0's is under way) fails the submit, once every start has
    ended, with the engine's message for that replica, and no container or network is left."""
    docker = FakeDocker({IMAGE})
    scheduler = DockerScheduler("s", docker, watch_events=False)
    info = scheduler.submit_dryrun(_app(_role("a", replicas)), {})
    app_id = info.request.app_id
    docker.hold_start[f"{app_id}-a-0"] = release = asyncio.Event()
    docker.fail_start.add(f"{app_id}-a-{failing}")
    submit = asyncio.ensure_future(scheduler.schedule(info))
    try:
        with anyio.fail_after(10):
            await docker.start_asked(f"{app_id}-a-{replicas - 1}").wait()
        release.set()
        with pytest.raises(
            DockerSchedulerError, match=rf"role 'a' replica {failing}: .*exec: not found"
        ):
            with anyio.fail_after(10):
                await submit
    finally:
        release.set()
        await asyncio.gather(submit, return_exceptions=True)
        await scheduler.close()
    assert not docker.containers_by_id and not docker.networks_by_id


async def test_without_events_rank0_starts_alone_first() -> None:
    """When the engine's events cannot be followed, the others wait for rank 0's start: a rank 0
    that fails to start fails the submit, nothing else was started, and nothing is left."""
    docker = FakeDocker({IMAGE})
    docker.events_refused = True
    scheduler = DockerScheduler("s", docker, watch_events=False)
    info = scheduler.submit_dryrun(_app(_role("a", 2)), {})
    docker.fail_start.add(f"{info.request.app_id}-a-0")
    with pytest.raises(DockerSchedulerError, match=r"role 'a' replica 0: the container did not"):
        await scheduler.schedule(info)
    await scheduler.close()
    assert ("start", f"{info.request.app_id}-a-1") not in docker.calls
    assert not docker.containers_by_id and not docker.networks_by_id


async def test_missing_volume_and_network_fail_before_creating_anything() -> None:
    """A named volume or a network (run option) that does not exist is a clear error up front."""
    docker = FakeDocker({IMAGE})
    role = _role(mounts=[VolumeMount(src="nope", dst_path="/v")])
    with pytest.raises(DockerSchedulerError, match=r"volume 'nope' does not exist"):
        await _submit(docker, _app(role))
    with pytest.raises(DockerSchedulerError, match=r"network 'no-such-net' .*does not exist"):
        await _submit(docker, _app(_role()), {"network": "no-such-net"})
    assert not any(op in ("create", "network-create") for op, _ in docker.calls)


async def test_preflight_asks_its_questions_at_once() -> None:
    """The preflight's reads (app listing, images, volume, CPU count) are in flight together, so a
    submit waits for the slowest one rather than their sum."""
    docker = FakeDocker({IMAGE, "other:1"})
    docker.volumes_present.add("data")
    role = _role(mounts=[VolumeMount(src="data", dst_path="/v")], resource=Resource(1, 0, 64))
    other = Role(name="o", image="other:1", entrypoint="true")
    await _submit(docker, _app(role, other))
    assert docker.most_reads_at_once >= 5


async def test_bad_volume_fails_before_any_pull() -> None:
    """A missing volume is reported before a missing image is pulled: bad input never costs a
    pull, and nothing is created."""
    docker = FakeDocker()
    docker.pullable.add(IMAGE)
    role = _role(mounts=[VolumeMount(src="nope", dst_path="/v")])
    with pytest.raises(DockerSchedulerError, match=r"volume 'nope' does not exist"):
        await _submit(docker, _app(role))
    assert not any(op in ("pull", "create", "network-create") for op, _ in docker.calls)


async def test_every_missing_image_is_pulled_and_a_failed_pull_names_its_role() -> None:
    """Two missing images are both pulled; the one that cannot be pulled fails the submit naming
    its role, and nothing is created."""
    docker = FakeDocker()
    docker.pullable.add(IMAGE)
    other = Role(name="o", image="other:1", entrypoint="true")
    with pytest.raises(DockerSchedulerError, match=r"role 'o': image 'other:1' .*could not be"):
        await _submit(docker, _app(_role(), other))
    assert {("pull", IMAGE), ("pull", "other:1")} <= set(docker.calls)
    assert not any(op in ("create", "network-create") for op, _ in docker.calls)


async def test_more_cpus_than_the_host_has_is_a_clear_error() -> None:
    """resource.cpu above the engine's CPU count fails the submit naming the field and value."""
    docker = FakeDocker({IMAGE})
    role = _role(resource=Resource(cpu=8, gpu=0, memMB=64))
    with pytest.raises(DockerSchedulerError, match=r"resource.cpu=8 is more than the 2 CPUs"):
        await _submit(docker, _app(role))
    assert not docker.containers_by_id


async def test_unreachable_engine_is_reported_as_such() -> None:
    """A connection failure (aiodocker's status 900) becomes DockerEngineUnavailableError."""
    from aiodocker.exceptions import DockerError

    docker = FakeDocker({IMAGE})

    async def refuse(name: str) -> None:
        raise DockerError(900, "Cannot connect to Docker Engine via unix:///nope.sock")

    docker.images.inspect = refuse  # type: ignore[method-assign]
    with pytest.raises(DockerEngineUnavailableError, match="is dockerd running"):
        await _submit(docker, _app(_role()))


async def test_racing_network_creates_end_with_one_network() -> None:
    """Concurrent creates of one app network (Docker 20.10 lets duplicates through) all return the
    same network id, and the duplicates are removed again."""
    docker = FakeDocker({IMAGE})
    docker.racy_networks = True
    scheduler = DockerScheduler("s", docker, watch_events=False)
    request = scheduler.submit_dryrun(_app(_role("a", 2)), {}).request.network_request
    assert request is not None
    others = [DockerScheduler("s", docker, watch_events=False) for _ in range(4)]
    ids = await asyncio.gather(*(s._launcher.create_network(request) for s in [scheduler, *others]))
    assert len(set(ids)) == 1
    assert list(docker.networks_by_id) == [ids[0]]
    for s in [scheduler, *others]:
        await s.close()


async def test_network_create_is_idempotent() -> None:
    """Creating the app's network a second time reuses it."""
    docker = FakeDocker({IMAGE})
    scheduler = DockerScheduler("s", docker, watch_events=False)
    request = scheduler.submit_dryrun(_app(_role("a", 2)), {}).request.network_request
    assert request is not None
    first = await scheduler._launcher.create_network(request)
    assert await scheduler._launcher.create_network(request) == first
    assert len(docker.networks_by_id) == 1
    await scheduler.close()


async def test_describe_and_cancel_of_an_unknown_app() -> None:
    """An unknown app describes as None, does not exist, and cancelling it does nothing."""
    docker = FakeDocker({IMAGE})
    scheduler = DockerScheduler("s", docker, watch_events=False)
    assert await scheduler.describe("nope-12345678") is None
    assert await scheduler.describe_many(["nope-1", "nope-2"]) == {"nope-1": None, "nope-2": None}
    assert not await scheduler.exists("nope-12345678")
    await scheduler.cancel("nope-12345678")
    assert not any(op in ("stop", "create") for op, _ in docker.calls)
    await scheduler.close()


async def test_describe_many_is_one_listing_for_many_apps() -> None:
    """Describing many apps costs one container listing, whatever their number (and, for those
    it has no container of, one volume listing for their launch claims, then one container
    listing again: a launch may have made them, then removed its claim, meanwhile)."""
    docker = FakeDocker({IMAGE})
    scheduler = DockerScheduler("s", docker, watch_events=False)
    ids = [await scheduler.submit(_app(_role()), {}) for _ in range(5)]
    docker.calls.clear()
    result = await scheduler.describe_many([*ids, "unknown-1", "unknown-2"])
    assert [op for op, _ in docker.calls] == ["list", "volume_list", "list"]
    assert all(result[i] is not None and result[i].state == AppState.RUNNING for i in ids)  # type: ignore[union-attr]
    assert result["unknown-1"] is None and result["unknown-2"] is None
    await scheduler.close()


async def test_log_iter_rejects_bad_arguments_at_call_time() -> None:
    """An unsupported stream, a bad regex or since after until raise ValueError at once."""
    from datetime import datetime, timedelta

    scheduler = DockerScheduler("s", FakeDocker(), watch_events=False)
    with pytest.raises(
        ValueError, match=r"^unsupported log stream 'both'; the local_docker scheduler reads stdout"
    ):
        scheduler.log_iter("a", "r", streams="both")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="regex"):
        scheduler.log_iter("a", "r", regex="(")
    now = datetime.now()
    with pytest.raises(ValueError, match="after"):
        scheduler.log_iter("a", "r", since=now, until=now - timedelta(seconds=1))
    await scheduler.close()


async def test_closing_does_not_close_an_injected_client() -> None:
    """The scheduler closes only a client it created itself."""
    docker = FakeDocker()
    scheduler = DockerScheduler("s", docker, watch_events=False)
    await scheduler.close()
    await scheduler.close()
    assert not docker.closed


async def test_scheduling_a_dryrun_twice_fails_and_keeps_the_first_app() -> None:
    """A dry run scheduled a second time is refused, and the app it made the first time stays."""
    docker = FakeDocker({IMAGE})
    scheduler = DockerScheduler("s", docker, watch_events=False)
    info = scheduler.submit_dryrun(_app(_role("a", 2)), {})
    app_id = await scheduler.schedule(info)
    with pytest.raises(DockerSchedulerError, match="already exists"):
        await scheduler.schedule(info)
    assert {c.name for c in docker.containers_by_id.values()} == {f"{app_id}-a-0", f"{app_id}-a-1"}
    assert len(docker.networks_by_id) == 1
    await scheduler.close()


def _die_event(container: Any, code: int) -> dict[str, Any]:
    labels = container.config["Labels"]
    return {
        "Type": "container",
        "Action": "die",
        "id": container.id,
        "Actor": {"ID": container.id, "Attributes": {**labels, "exitCode": str(code)}},
        "timeNano": 1_700_000_000_000_000_000,
    }


async def test_die_event_counts_before_the_engine_listing_catches_up() -> None:
    """Docker lists a container as running for ~0.1 s after its die event: the event's exit code
    is used at once (and listeners are told), unless a REPLICA restart may follow."""
    docker = FakeDocker({IMAGE})
    scheduler = DockerScheduler("s", docker, watch_events=False)
    told: list[str] = []
    scheduler.subscribe(told.append)
    app_id = await scheduler.submit(_app(_role()), {})
    container = docker.by_name(f"{app_id}-r-0")
    assert container is not None and container.state == "running"
    scheduler._events.handle(_die_event(container, 3))
    assert told == [app_id]
    resp = await scheduler.describe(app_id)
    assert resp is not None and resp.state == AppState.FAILED
    assert resp.roles_statuses[0].replicas[0].exit_code == 3

    restartable = _role(max_retries=2, retry_policy=RetryPolicy.REPLICA)
    other = await scheduler.submit(_app(restartable), {})
    container = docker.by_name(f"{other}-r-0")
    assert container is not None
    scheduler._events.handle(_die_event(container, 1))
    resp = await scheduler.describe(other)
    assert resp is not None and resp.state == AppState.RUNNING  # Docker may restart it
    await scheduler.close()


async def test_with_live_events_an_exit_is_described_without_asking_the_engine() -> None:
    """While the event stream is live, a die event updates the app's snapshot: describing it costs
    no listing; any other event (a start, a create) makes the next describe list again."""
    docker = FakeDocker({IMAGE})
    scheduler = DockerScheduler("s", docker, watch_events=False)
    scheduler._events._set_live(True)  # as if the event stream were connected
    app_id = await scheduler.submit(_app(_role()), {})
    assert (await scheduler.describe(app_id)).state == AppState.RUNNING  # type: ignore[union-attr]
    container = docker.by_name(f"{app_id}-r-0")
    assert container is not None
    docker.calls.clear()
    scheduler._events.handle(_die_event(container, 0))
    resp = await scheduler.describe(app_id)
    assert resp is not None and resp.state == AppState.SUCCEEDED
    assert not any(op == "list" for op, _ in docker.calls)
    start = _die_event(container, 0)
    start["Action"] = "start"
    scheduler._events.handle(start)
    await scheduler.describe(app_id)
    assert [op for op, _ in docker.calls if op == "list"] == ["list"]
    await scheduler.close()


async def _failed_app_with_a_survivor(scheduler: DockerScheduler, docker: FakeDocker) -> str:
    """An app whose replica 0 exited 3 while replica 1 runs: it owes stopping replica 1."""
    app_id = await scheduler.submit(_app(_role("r", 2)), {})
    failed = docker.by_name(f"{app_id}-r-0")
    assert failed is not None
    failed.state, failed.exit_code = "exited", 3
    return app_id


async def test_status_reads_issue_no_write_to_the_engine() -> None:
    """describe, describe_many, exists, list and reading logs of an app that owes a follow-up (a
    survivor to stop) send the engine no request that changes anything."""
    docker = FakeDocker({IMAGE})
    scheduler = DockerScheduler("s", docker, watch_events=False)
    app_id = await _failed_app_with_a_survivor(scheduler, docker)
    writes, calls = scheduler.engine.writes, len(docker.calls)
    assert (await scheduler.describe(app_id)).state == AppState.FAILED  # type: ignore[union-attr]
    await scheduler.describe_many([app_id, "other-1"])
    assert await scheduler.exists(app_id)
    assert [a.state for a in await scheduler.list()] == [AppState.FAILED]
    with pytest.raises(UnknownRoleException):
        async for _ in scheduler.log_iter(app_id, "nope"):
            pass
    await scheduler._reconciler.wait_idle()
    assert scheduler.engine.writes == writes
    assert scheduler.engine.requests["container_list"] >= 4
    # describe_many lists the containers of "other-1" again after its (absent) launch claim
    assert [op for op, _ in docker.calls[calls:]] == ["list"] * 2 + ["volume_list"] + ["list"] * 4
    assert docker.by_name(f"{app_id}-r-1").state == "running"  # type: ignore[union-attr]
    await scheduler.close()


async def test_an_exit_event_drives_the_follow_up() -> None:
    """The die event of the failed replica (not a status read) makes the backend stop the survivor."""
    docker = FakeDocker({IMAGE})
    scheduler = DockerScheduler("s", docker, watch_events=False)
    app_id = await _failed_app_with_a_survivor(scheduler, docker)
    writes = scheduler.engine.writes
    scheduler._events.handle(_die_event(docker.by_name(f"{app_id}-r-0"), 3))
    await scheduler._reconciler.wait_idle()
    assert scheduler.engine.writes == writes + 1
    assert ("stop", f"{app_id}-r-1") in docker.calls
    survivor = docker.by_name(f"{app_id}-r-1")
    assert survivor is not None and survivor.state == "exited"
    await scheduler.close()


def _event(container: Any, action: str) -> dict[str, Any]:
    event = _die_event(container, 0)
    event["Action"] = action
    return event


async def test_a_replica_starting_after_its_app_failed_is_stopped() -> None:
    """Rank 0 fails while replica 1 is still only created (its launch under way): nothing can be
    stopped yet and the network stays; replica 1's start event then brings its stop."""
    docker = FakeDocker({IMAGE})
    scheduler = DockerScheduler("s", docker, watch_events=False)
    app_id = await scheduler.submit(_app(_role("r", 2)), {})
    rank0, late = docker.by_name(f"{app_id}-r-0"), docker.by_name(f"{app_id}-r-1")
    assert rank0 is not None and late is not None
    rank0.state, rank0.exit_code = "exited", 3
    late.state = "created"
    scheduler._events.handle(_die_event(rank0, 3))
    await scheduler._reconciler.wait_idle()
    assert not any(op in ("stop", "network-delete") for op, _ in docker.calls)
    late.state = "running"
    scheduler._events.handle(_event(late, "start"))
    await scheduler._reconciler.wait_idle()
    assert ("stop", f"{app_id}-r-1") in docker.calls and late.state == "exited"
    await scheduler.close()


async def test_the_follow_up_of_a_cancelled_app_stops_none_of_its_containers() -> None:
    """A cancel while the replicas are only created (their launch under way) stops nothing; their
    start events after the cancel marker's create bring no stop from the follow-up either (the
    launch that started them stops them: one stop, one SIGTERM, per container)."""
    docker = FakeDocker({IMAGE})
    scheduler = DockerScheduler("s", docker, watch_events=False)
    app_id = await scheduler.submit(_app(_role("r", 2)), {})
    late = [docker.by_name(f"{app_id}-r-{k}") for k in (0, 1)]
    for c in late:
        assert c is not None
        c.state = "created"
    await scheduler.cancel(app_id)
    marker = docker.by_name(f"{app_id}-cancelled")
    assert marker is not None and not any(op == "stop" for op, _ in docker.calls)
    scheduler._events.handle(_event(marker, "create"))
    for c in late:
        assert c is not None
        c.state = "running"
        scheduler._events.handle(_event(c, "start"))
    await scheduler._reconciler.wait_idle()
    assert not any(op == "stop" for op, _ in docker.calls)
    resp = await scheduler.describe(app_id)
    assert resp is not None and resp.state == AppState.RUNNING and resp.msg == "cancelling"
    await scheduler.close()


async def test_cancel_finishes_its_stops_when_the_caller_is_cancelled() -> None:
    """A task awaiting cancel() that is itself cancelled (Task.cancel) while the containers stop:
    the stop still completes, then the caller sees its CancelledError; the app reads CANCELLED."""
    docker = FakeDocker({IMAGE})
    scheduler = DockerScheduler("s", docker, watch_events=False)
    app_id = await scheduler.submit(_app(_role("r", 1)), {})
    container = docker.by_name(f"{app_id}-r-0")
    assert container is not None
    entered, release = asyncio.Event(), asyncio.Event()
    real_stop = container.stop

    async def slow_stop(**kwargs: Any) -> None:
        entered.set()
        await release.wait()
        await real_stop(**kwargs)

    container.stop = slow_stop  # type: ignore[method-assign]
    caller = asyncio.ensure_future(scheduler.cancel(app_id))
    await asyncio.wait_for(entered.wait(), 10)
    caller.cancel()  # delivered to the caller before the stop can go on
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(caller, 10)
    assert container.state == "exited"
    resp = await scheduler.describe(app_id)
    assert resp is not None and resp.state == AppState.CANCELLED
    await scheduler.close()


class _SlowStops:
    """A client whose container stops wait for ``release`` (counts the requests)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, int | None]] = []
        self.release = asyncio.Event()
        self.asked = asyncio.Event()
        self.containers = self

    def container(self, cid: str) -> Any:
        client = self

        class _Container:
            async def stop(self, t: int | None = None) -> None:
                client.requests.append((cid, t))
                client.asked.set()
                await client.release.wait()

        return _Container()


async def test_a_stop_asked_again_while_under_way_sends_one_request() -> None:
    """Concurrent stops of one container with the same timeout send one stop request (each would
    signal the container again); another timeout, and a stop whose caller was cancelled, do not
    hold back a new request."""
    client = _SlowStops()
    engine = DockerEngine(client)
    with anyio.fail_after(10):
        first = asyncio.ensure_future(engine.stop_container("c1"))
        await client.asked.wait()
        again = asyncio.ensure_future(engine.stop_container("c1"))
        killed = asyncio.ensure_future(engine.stop_container("c1", timeout=0))
        await asyncio.sleep(0)  # one turn of the loop: both run up to their first wait
        client.release.set()
        await asyncio.gather(first, again, killed)
        assert client.requests == [("c1", None), ("c1", 0)]

        client.requests.clear()
        client.release.clear()
        client.asked.clear()
        abandoned = asyncio.ensure_future(engine.stop_container("c2"))
        await client.asked.wait()
        waiting = asyncio.ensure_future(engine.stop_container("c2"))
        await asyncio.sleep(0)  # one turn of the loop: it waits for the first request
        abandoned.cancel()
        client.release.set()
        await waiting
        assert client.requests == [("c2", None), ("c2", None)]


async def test_a_dry_run_scheduled_twice_at_once_launches_once_and_keeps_the_claim() -> None:
    """One dry run scheduled by two schedulers at once: one launches it, the other is refused
    ("being submitted already") without removing the first one's launch claim, which the
    launch removes itself once its container exists."""
    docker = FakeDocker({IMAGE})
    first = DockerScheduler("s", docker, watch_events=False)
    second = DockerScheduler("s", docker, watch_events=False)
    info = first.submit_dryrun(_app(_role()), {})
    app_id = info.request.app_id
    results = await asyncio.gather(
        first.schedule(info), second.schedule(info), return_exceptions=True
    )
    assert results[0] == app_id
    assert isinstance(results[1], DockerSchedulerError)
    assert "being submitted already" in str(results[1])
    assert [op for op, name in docker.calls if name == claim_name(app_id)] == [
        "volume_create",
        "volume_create",
        "volume_remove",
    ]
    assert docker.labelled_volumes == {}
    await first.close()
    await second.close()


@pytest.mark.parametrize("how", ["a failed check", "a cancelled submit"])
async def test_a_submit_that_ends_in_its_checks_removes_its_launch_claim(how: str) -> None:
    """A submit whose checks fail (an image that cannot be pulled) or that is cancelled during
    them leaves no launch claim: the app is unknown, not PENDING."""
    docker = FakeDocker(set() if how == "a failed check" else {IMAGE})
    scheduler = DockerScheduler("s", docker, watch_events=False)
    info = scheduler.submit_dryrun(_app(_role()), {})
    if how == "a cancelled submit":
        checking = asyncio.Event()
        real = docker.images.inspect

        async def inspect_forever(name: str) -> Any:
            checking.set()
            await asyncio.Event().wait()
            return await real(name)

        docker.images.inspect = inspect_forever  # type: ignore[method-assign]
        submit = asyncio.ensure_future(scheduler.schedule(info))
        with anyio.fail_after(10):
            await checking.wait()
        submit.cancel()
        with pytest.raises(asyncio.CancelledError):
            await submit
    else:
        with pytest.raises(DockerSchedulerError, match="could not be pulled"):
            await scheduler.schedule(info)
    assert docker.labelled_volumes == {}
    assert await scheduler.describe(info.request.app_id) is None
    await scheduler.close()


async def test_two_processes_finishing_a_dead_cancellers_cancel_stop_each_container_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An app marked cancelled by a process that has exited, its replica still running: two
    schedulers (as two processes) cancelling it at once take the cancel over once between them
    (one marker of the next turn, one stop)."""
    import subprocess
    import sys

    from asynctorchx.schedulers._docker import cancel
    from asynctorchx.schedulers._docker.processes import _host_and_namespace

    monkeypatch.setattr(cancel, "STOP_SLACK", 0.0)  # a fake engine kills at once
    docker = FakeDocker({IMAGE})
    schedulers = [DockerScheduler("s", docker, watch_events=False) for _ in range(2)]
    app_id = await schedulers[0].submit(_app(_role()), {"stop_timeout": 0})
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    boot, namespace = _host_and_namespace()
    marker = cancel_marker(
        app_id, "fake", "s", IMAGE, canceller=f"{boot}/{namespace}/{dead.stdout.strip()}/"
    )
    await docker.containers.create(marker.config, name=marker.name)
    real_create, arrived, both = docker.containers.create, [], asyncio.Event()

    async def create_when_both_take_over(config: dict[str, Any], *, name: str) -> Any:
        if name == f"{marker.name}-2":  # both have found the canceller gone
            arrived.append(name)
            if len(arrived) == 2:
                both.set()
            await both.wait()
        return await real_create(config, name=name)

    docker.containers.create = create_when_both_take_over  # type: ignore[method-assign]
    with anyio.fail_after(10):
        # each returns before its wait for the dead canceller's stop; the take-over goes on
        await asyncio.gather(*(s.cancel(app_id) for s in schedulers))
        await both.wait()
        for s in schedulers:
            await s.close()  # lets the take-overs finish
    assert len(arrived) == 2
    assert [name for op, name in docker.calls if op == "stop"] == [f"{app_id}-r-0"]
    assert docker.by_name(f"{marker.name}-2") is not None
