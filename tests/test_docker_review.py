# ruff: noqa: F811 - the fixtures imported from _docker_env are redefined as test parameters
"""Defects a review of the local_docker backend found, each fixed and kept fixed here.

- A failed app's message named the survivor the backend stopped (exit 137 after its stop timeout)
  instead of the replica that failed first.
- ``port_map`` ports were published on every host interface (0.0.0.0 and ::, random host ports).
- Env values and args that are not UTF-8 (surrogate escapes, from ``copy_env`` say) reached the
  containers with U+FFFD in their place (the Docker API is JSON).
- An engine answer without a body gave "listing containers: " with nothing after; an ``ssh://``
  docker_host gave aiodocker's own error.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import aiodocker
import pytest
from _docker_env import (  # noqa: F401 - pytest fixtures
    busybox_image,
    docker_engine,
    docker_scheduler,
    docker_session,
    sh,
    wait_for,
)

from asynctorchx.schedulers._docker.engine import DockerSchedulerError
from asynctorchx.schedulers._docker.request import (
    LABEL_APP_ID,
    LABEL_ATTEMPT,
    LABEL_KIND,
    LABEL_MAX_RETRIES,
    LABEL_REPLICA_ID,
    LABEL_RETRY_POLICY,
    LABEL_ROLE_NAME,
    LABEL_ROLES,
)
from asynctorchx.schedulers._docker.state import ContainerInfo, assess
from asynctorchx.schedulers.docker import DockerScheduler
from asynctorchx.specs import AppDef, AppState, InvalidAppDefException, Role

# -- the first failure is the app's, not the survivors the backend stopped ---------------------


def _replica(k: int, code: int, **kwargs: Any) -> ContainerInfo:
    labels = {
        LABEL_APP_ID: "app",
        LABEL_ROLE_NAME: "main",
        LABEL_REPLICA_ID: str(k),
        LABEL_ATTEMPT: "0",
        LABEL_ROLES: '[["main",2]]',
        LABEL_MAX_RETRIES: "0",
        LABEL_RETRY_POLICY: "APPLICATION",
        LABEL_KIND: "replica",
    }
    return ContainerInfo(
        id=f"c{k}",
        name=f"app-main-{k}",
        image="img",
        labels=labels,
        state="exited",
        exit_code=code,
        created=0,
        **kwargs,
    )


def test_the_replica_that_exited_first_is_named_not_the_survivor_stopped_after_it() -> None:
    """main/1 exited 5 first; main/0 was stopped after it (137): main/1 is the app's failure,
    and main/0's status says it was stopped (times read from any process's inspect)."""
    a = assess("app", [_replica(0, 137, finished_at=2_000), _replica(1, 5, finished_at=1_000)])
    assert a is not None and a.response.state == AppState.FAILED
    assert a.response.msg == "replica main/1 failed with exit code 5"
    survivor, cause = a.response.roles_statuses[0].replicas
    assert survivor.structured_error_msg == "stopped after replica main/1 failed"
    assert cause.structured_error_msg == "<NONE>"


def test_a_replica_the_backend_stopped_is_never_the_cause_and_role_order_breaks_ties() -> None:
    # marked by the process that stopped it: never the cause, even with no times to compare
    a = assess("app", [_replica(0, 1, stopped_by_backend=True), _replica(1, 3)])
    assert a is not None and a.response.msg == "replica main/1 failed with exit code 3"
    assert a.response.roles_statuses[0].replicas[0].structured_error_msg == (
        "stopped after replica main/1 failed"
    )
    # nothing tells them apart: role order, and no replica is said to have been stopped
    b = assess("app", [_replica(0, 137), _replica(1, 5)])
    assert b is not None and b.response.msg == "replica main/0 failed with exit code 137"
    assert [r.structured_error_msg for r in b.response.roles_statuses[0].replicas] == [
        "<NONE>",
        "<NONE>",
    ]
    # a replica that failed on its own later (not a stop's exit code) is not said to be stopped
    c = assess("app", [_replica(0, 1, finished_at=2_000), _replica(1, 5, finished_at=1_000)])
    assert c is not None and c.response.msg == "replica main/1 failed with exit code 5"
    assert c.response.roles_statuses[0].replicas[0].structured_error_msg == "<NONE>"


async def test_failure_msg_names_the_replica_that_failed_not_the_survivor_the_backend_stopped(
    docker_scheduler: DockerScheduler, busybox_image: str, docker_session: str
) -> None:
    """Replica 1 exits 5; the backend then stops replica 0 (SIGKILL after stop_timeout -> 137).
    The app's message keeps naming main/1 and exit code 5, here and in a process that did not
    stop anything (it reads the engine's exit times)."""
    s = docker_scheduler
    script = 'case "$HOSTNAME" in *-1) sleep 1; exit 5;; *) sleep 120;; esac'
    app_id = await s.submit(AppDef("mf", [sh(busybox_image, script, n=2)]), {"stop_timeout": 1})
    first = await wait_for(s, app_id, timeout=60)
    assert first.state == AppState.FAILED
    resp = await wait_for(
        s,
        app_id,
        lambda r: r.roles_statuses[0].replicas[0].exit_code is not None,
        timeout=60,
    )
    assert resp.state == AppState.FAILED
    assert "main/1" in resp.msg and "exit code 5" in resp.msg, (
        f"first message was {first.msg!r}; after the survivor was stopped: {resp.msg!r}"
    )
    survivor = resp.roles_statuses[0].replicas[0]
    assert survivor.exit_code == 137
    assert survivor.structured_error_msg == "stopped after replica main/1 failed"
    other = DockerScheduler(docker_session, watch_events=False)
    try:
        elsewhere = await other.describe(app_id)
    finally:
        await other.close()
    assert elsewhere is not None and elsewhere.msg == resp.msg
    assert elsewhere.roles_statuses[0].replicas[0].structured_error_msg == (
        "stopped after replica main/1 failed"
    )


# -- port_map ports are exposed, not published -------------------------------------------------


def test_port_map_ports_are_exposed_but_not_published_in_the_dry_run() -> None:
    s = DockerScheduler("review", watch_events=False)
    app = AppDef("pm", [Role("main", "img", entrypoint="sh", port_map={"store": 29500})])
    config = s.submit_dryrun(app, {}).request.containers[0].config
    assert config["ExposedPorts"] == {"29500/tcp": {}}
    assert "PortBindings" not in config["HostConfig"]


async def test_port_map_ports_are_not_published_on_every_host_interface(
    docker_scheduler: DockerScheduler, busybox_image: str
) -> None:
    """TorchX's docker scheduler publishes nothing; a role's port_map (e.g. a c10d store, a
    debug server) must not become reachable from the network on 0.0.0.0 / ::."""
    s = docker_scheduler
    app_id = await s.submit(
        AppDef("pm", [sh(busybox_image, "sleep 30", port_map={"store": 29500})]), {}
    )
    async with aiodocker.Docker() as client:
        info = await client.containers.container(f"{app_id}-main-0").show()
    assert "29500/tcp" in info["Config"]["ExposedPorts"]
    assert not info["NetworkSettings"]["Ports"].get("29500/tcp"), info["NetworkSettings"]["Ports"]


# -- text the Docker API cannot carry is refused -----------------------------------------------


@pytest.fixture
def non_utf8_variable() -> Any:
    os.environb[b"RVX_BYTES"] = b"a\xffb"
    try:
        yield "RVX_BYTES"
    finally:
        del os.environb[b"RVX_BYTES"]


def test_a_copied_variable_that_is_not_utf8_is_refused_naming_it(non_utf8_variable: str) -> None:
    s = DockerScheduler("review", watch_events=False)
    app = AppDef("ce", [Role("main", "img", entrypoint="sh")])
    with pytest.raises(InvalidAppDefException) as e:
        s.submit_dryrun(app, {"copy_env": ["RVX_*"]})
    assert e.value.field_name == "copy_env"
    assert "'RVX_BYTES'" in str(e.value) and "byte 0xff" in str(e.value)
    assert "text only" in str(e.value)
    assert "a\udcffb" not in str(e.value)  # the launcher's environment may hold secrets
    # overridden by the env run option or the role's env, it is not sent: not refused
    s.submit_dryrun(app, {"copy_env": ["RVX_*"], "env": {"RVX_BYTES": "ok"}})
    ok = AppDef("ce", [Role("main", "img", entrypoint="sh", env={"RVX_BYTES": "ok"})])
    s.submit_dryrun(ok, {"copy_env": ["RVX_*"]})


@pytest.mark.parametrize(
    ("role_kwargs", "cfg", "named"),
    [
        ({"args": ["-c", "echo a\udcffb"]}, {}, "args[1]"),
        ({"env": {"K": "a\udcffb"}}, {}, "env['K']"),
        ({}, {"env": {"K": "a\udcffb"}}, "env['K']"),
    ],
)
def test_args_and_env_that_are_not_utf8_are_refused_naming_where(
    role_kwargs: dict[str, Any], cfg: dict[str, Any], named: str
) -> None:
    s = DockerScheduler("review", watch_events=False)
    app = AppDef("t", [Role("main", "img", entrypoint="sh", **role_kwargs)])
    with pytest.raises(InvalidAppDefException) as e:
        s.submit_dryrun(app, cfg)
    assert named in str(e.value) and "text only" in str(e.value), str(e.value)
    if role_kwargs:
        assert str(e.value).startswith("role 'main': ")


# -- engine errors say what went wrong ---------------------------------------------------------


async def test_engine_error_without_a_body_still_says_what_went_wrong() -> None:
    """DOCKER_HOST pointing at something that is not a Docker engine (answers 404, no body):
    the error says the HTTP status and asks whether the address is a Docker engine."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    host = f"tcp://127.0.0.1:{port}"
    s = DockerScheduler("rv-notdocker", docker_host=host)
    try:
        with pytest.raises(DockerSchedulerError) as ei:
            await s.describe("x-abcdefgh")
    finally:
        await s.close()
        server.close()
        await server.wait_closed()
    msg = str(ei.value)
    assert msg.startswith("listing containers: HTTP 404 with no message"), msg
    assert f"is {host} a Docker engine?" in msg, msg


async def test_an_address_aiodocker_cannot_use_gives_an_error_naming_it() -> None:
    try:
        import asyncssh  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("asyncssh is installed: an ssh:// address is usable")
    for host, why in (("ssh://user@host.invalid", "asyncssh"), ("host.invalid", "scheme")):
        s = DockerScheduler("rv-badhost", docker_host=host)
        try:
            with pytest.raises(DockerSchedulerError) as ei:
                await s.describe("x-abcdefgh")
        finally:
            await s.close()
        assert f"docker_host={host!r}" in str(ei.value) and why in str(ei.value), str(ei.value)
