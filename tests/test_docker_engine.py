# ruff: noqa: F811 - the fixtures imported from _docker_env are redefined as test parameters
"""The local_docker backend against the real Docker engine (skipped without one, failed in CI).

Images are the local test images built by ``scripts/engines/docker.sh``; every test runs in a session
of its own and its containers and networks are removed afterwards (``docker_scheduler``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from _docker_env import (  # noqa: F401 - pytest fixtures
    busybox_image,
    collect,
    containers_of,
    docker_engine,
    docker_scheduler,
    docker_session,
    purge_session,
    run_python,
    sh,
    wait_for,
)

from asynctorchx.runner import AsyncRunner
from asynctorchx.runner.hub import PollSettings
from asynctorchx.schedulers.api import Stream
from asynctorchx.schedulers.docker import DockerScheduler, DockerSchedulerError
from asynctorchx.specs import (
    AppDef,
    AppState,
    BindMount,
    MalformedAppHandleException,
    Resource,
    RetryPolicy,
    Role,
    UnknownAppException,
    VolumeMount,
    is_terminal,
    macros,
    parse_app_handle,
)

pytestmark = pytest.mark.docker
REPO = Path(__file__).resolve().parents[1]


async def test_succeeding_app_is_succeeded_with_exit_codes_and_hostnames(
    docker_scheduler: DockerScheduler, busybox_image: str
) -> None:
    """Two replicas exiting 0: SUCCEEDED, each replica with exit code 0 on its own hostname."""
    app_id = await docker_scheduler.submit(AppDef("ok", [sh(busybox_image, "echo hi", n=2)]), {})
    resp = await wait_for(docker_scheduler, app_id)
    assert resp.state == AppState.SUCCEEDED
    replicas = resp.roles_statuses[0].replicas
    assert [(r.id, r.state, r.exit_code) for r in replicas] == [
        (0, AppState.SUCCEEDED, 0),
        (1, AppState.SUCCEEDED, 0),
    ]
    assert [r.hostname for r in replicas] == [f"{app_id}-main-0", f"{app_id}-main-1"]
    assert resp.roles[0].image == busybox_image and resp.roles[0].num_replicas == 2
    assert resp.name == "ok"


async def test_failing_replica_fails_the_app_with_its_exit_code_and_stops_the_others(
    docker_scheduler: DockerScheduler, busybox_image: str
) -> None:
    """Replica 0 exits 3 while replica 1 would run for minutes: the app is FAILED naming exit code
    3, and the backend stops replica 1."""
    script = f"if [ {macros.replica_id} = 0 ]; then exit 3; fi; exec sleep 300"
    app_id = await docker_scheduler.submit(
        AppDef("fail", [sh(busybox_image, script, n=2)]), {"stop_timeout": 1}
    )
    resp = await wait_for(docker_scheduler, app_id)
    assert resp.state == AppState.FAILED
    assert "main/0" in resp.msg and "exit code 3" in resp.msg
    assert resp.roles_statuses[0].replicas[0].exit_code == 3
    stopped = await wait_for(
        docker_scheduler,
        app_id,
        lambda r: is_terminal(r.roles_statuses[0].replicas[1].state),
    )
    assert stopped.roles_statuses[0].replicas[1].exit_code in (137, 143)


async def test_replicas_of_several_roles_reach_each_other_by_hostname(
    docker_scheduler: DockerScheduler, busybox_image: str
) -> None:
    """Two servers (answering one connection per client) and two clients on the app's network: each
    client reaches both servers by their hostnames ({app_id}-server-{k}), and TORCHX_RANK0_HOST names server 0."""
    server = sh(
        busybox_image,
        "for client in 0 1; do\n"
        '  echo "pong from $(hostname) rank0=$TORCHX_RANK0_HOST" | nc -l -p 7000\n'
        "done",
        name="server",
        n=2,
    )
    client_script = textwrap.dedent(
        f"""
        for k in 0 1; do
          until out=$(nc {macros.app_id}-server-$k 7000 </dev/null) && [ -n "$out" ]; do
            sleep 0.1
          done
          echo "client {macros.replica_id} got: $out"
        done
        """
    )
    client = sh(busybox_image, client_script, name="client", n=2)
    app_id = await docker_scheduler.submit(AppDef("net", [server, client]), {})
    resp = await wait_for(docker_scheduler, app_id)
    assert resp.state == AppState.SUCCEEDED, resp
    for k in (0, 1):
        lines = await collect(docker_scheduler.log_iter(app_id, "client", k, streams=Stream.STDOUT))
        assert lines == [
            f"client {k} got: pong from {app_id}-server-0 rank0={app_id}-server-0\n",
            f"client {k} got: pong from {app_id}-server-1 rank0={app_id}-server-0\n",
        ]


async def test_environment_and_macros_reach_each_replica(
    docker_scheduler: DockerScheduler,
    busybox_image: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """copy_env, the env option and the role's env (with macros) are set in every replica, with the
    role's env winning; args get the replica's own macros."""
    monkeypatch.setenv("ATX_TEST_COPIED", "copied")
    monkeypatch.setenv("ATX_TEST_SHADOWED", "copied")
    role = Role(
        name="env",
        image=busybox_image,
        entrypoint="sh",
        args=[
            "-c",
            'echo "args: $0 $1"; env | grep -E "^(ATX_|TORCHX_)" | sort',
            "app=" + macros.app_id,
            "k=" + macros.replica_id,
        ],
        env={"ATX_ROLE": f"{macros.app_id}/{macros.replica_id}", "ATX_TEST_SHADOWED": "role"},
        num_replicas=2,
    )
    cfg = {"copy_env": ["ATX_TEST_*"], "env": {"ATX_OPTION": "option", "ATX_TEST_SHADOWED": "opt"}}
    app_id = await docker_scheduler.submit(AppDef("env", [role]), cfg)
    assert (await wait_for(docker_scheduler, app_id)).state == AppState.SUCCEEDED
    for k in (0, 1):
        lines = await collect(docker_scheduler.log_iter(app_id, "env", k))
        assert lines == [
            f"args: app={app_id} k={k}\n",
            "ATX_OPTION=option\n",
            f"ATX_ROLE={app_id}/{k}\n",
            "ATX_TEST_COPIED=copied\n",
            "ATX_TEST_SHADOWED=role\n",
            f"TORCHX_RANK0_HOST={app_id}-env-0\n",
        ]


LOG_SCRIPT = r"""
echo out-1; echo err-1 >&2
until [ -f /gate/open ]; do sleep 0.05; done
echo out-2; echo err-2 >&2
head -c 40000 /dev/zero | tr '\0' x; echo
printf 'bad \377\376 utf8\n'
printf 'no newline at the end'
"""


async def test_logs_streams_regex_since_until_and_tail(
    docker_scheduler: DockerScheduler, busybox_image: str, tmp_path: Path
) -> None:
    """Following the log sees every line until the app ends; stdout and stderr come apart; regex
    filters; since/until split the log at a moment between two phases; a 40000-character line
    stays whole, invalid UTF-8 is replaced and an unterminated last line is kept."""
    gate = tmp_path / "gate"
    gate.mkdir()
    role = sh(busybox_image, LOG_SCRIPT, mounts=[BindMount(str(gate), "/gate")])
    app_id = await docker_scheduler.submit(AppDef("logs", [role]), {})

    seen_phase1 = asyncio.Event()
    tailed: list[str] = []

    async def tail() -> None:
        async for line in docker_scheduler.log_iter(app_id, "main", should_tail=True):
            tailed.append(line)
            if {"out-1\n", "err-1\n"} <= set(tailed):
                seen_phase1.set()

    tail_task = asyncio.create_task(tail())
    await asyncio.wait_for(seen_phase1.wait(), 20)
    middle = datetime.now()
    (gate / "open").touch()
    await asyncio.wait_for(tail_task, 30)  # ends by itself once the app is terminal
    assert (await docker_scheduler.describe(app_id)).state == AppState.SUCCEEDED  # type: ignore[union-attr]

    stdout = await collect(docker_scheduler.log_iter(app_id, "main", streams=Stream.STDOUT))
    stderr = await collect(docker_scheduler.log_iter(app_id, "main", streams=Stream.STDERR))
    combined = await collect(docker_scheduler.log_iter(app_id, "main"))
    long_line = "x" * 40000 + "\n"
    assert stdout == [
        "out-1\n",
        "out-2\n",
        long_line,
        "bad \ufffd\ufffd utf8\n",
        "no newline at the end",
    ]
    assert stderr == ["err-1\n", "err-2\n"]
    assert sorted(combined) == sorted(stdout + stderr)
    assert sorted(tailed) == sorted(combined)

    assert await collect(docker_scheduler.log_iter(app_id, "main", regex=r"^(out|err)-2")) in (
        ["out-2\n", "err-2\n"],
        ["err-2\n", "out-2\n"],
    )
    before = await collect(docker_scheduler.log_iter(app_id, "main", until=middle))
    after = await collect(docker_scheduler.log_iter(app_id, "main", since=middle))
    assert sorted(before) == ["err-1\n", "out-1\n"]
    assert sorted(after) == sorted(set(combined) - {"out-1\n", "err-1\n"})
    assert await collect(
        docker_scheduler.log_iter(app_id, "main", since=middle, streams=Stream.STDERR)
    ) == ["err-2\n"]


class _DroppingClient:
    """The real aiodocker client, except that the first ``drops_left`` followed log streams break
    after their first chunk."""

    def __init__(self, real: Any, drops_left: int) -> None:
        self._real = real
        self.drops_left = drops_left
        self.drops = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    @contextlib.asynccontextmanager
    async def _query(self, path: str, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        params = kwargs.get("params") or {}
        async with self._real._query(path, *args, **kwargs) as resp:
            if path.endswith("/logs") and params.get("follow") and self.drops_left > 0:
                self.drops_left -= 1
                yield _OneChunkResponse(resp, self)
            else:
                yield resp


class _OneChunkResponse:
    def __init__(self, resp: Any, owner: _DroppingClient) -> None:
        self._resp = resp
        self._owner = owner
        self.content = self

    async def iter_any(self) -> AsyncIterator[bytes]:
        async for chunk in self._resp.content.iter_any():
            yield chunk
            self._owner.drops += 1
            raise aiohttp.ClientPayloadError("connection dropped (test)")

    def close(self) -> None:
        self._resp.close()


async def test_tail_resumes_from_the_last_line_when_the_stream_drops(
    docker_engine: None, busybox_image: str, docker_session: str
) -> None:
    """When the followed log stream breaks while the container runs, tailing reconnects from the
    last line's timestamp: every line arrives exactly once, in order."""
    import aiodocker

    real = aiodocker.Docker()
    client = _DroppingClient(real, drops_left=3)
    scheduler = DockerScheduler(docker_session, client)
    try:
        script = "for i in $(seq 1 30); do echo line-$i; sleep 0.03; done"
        app_id = await scheduler.submit(AppDef("drop", [sh(busybox_image, script)]), {})
        lines = await asyncio.wait_for(
            collect(scheduler.log_iter(app_id, "main", should_tail=True)), 60
        )
        assert lines == [f"line-{i}\n" for i in range(1, 31)]
        assert client.drops == 3
    finally:
        await scheduler.close()
        await real.close()
        await purge_session(docker_session)


async def test_cancel_kills_a_container_that_ignores_sigterm(
    docker_scheduler: DockerScheduler, busybox_image: str
) -> None:
    """Cancel sends SIGTERM, and SIGKILL after stop_timeout to a container ignoring it: the app is
    CANCELLED (exit 137) once the engine has killed it (cancel returns before: see
    test_docker_cancel_prompt.py); cancelling again is a no-op."""
    script = "trap '' TERM; echo ready; while true; do sleep 0.2; done"
    app_id = await docker_scheduler.submit(
        AppDef("stubborn", [sh(busybox_image, script)]), {"stop_timeout": 1}
    )
    await wait_for(docker_scheduler, app_id, lambda r: r.state == AppState.RUNNING)
    await docker_scheduler.cancel(app_id)
    resp = await wait_for(docker_scheduler, app_id)
    assert resp is not None and resp.state == AppState.CANCELLED
    replica = resp.roles_statuses[0].replicas[0]
    assert replica.state == AppState.CANCELLED and replica.exit_code == 137
    await docker_scheduler.cancel(app_id)
    assert (await docker_scheduler.describe(app_id)).state == AppState.CANCELLED  # type: ignore[union-attr]


@pytest.mark.parametrize("canceller", ["the launching process", "another process"])
async def test_a_cancel_sends_each_container_one_sigterm(
    docker_scheduler: DockerScheduler, busybox_image: str, canceller: str
) -> None:
    """A cancel, from the process that launched the app (whose follow-ups of the cancelled app
    run too) or from another, signals a container whose SIGTERM handler keeps it running exactly
    once: the handler runs once."""
    script = "trap 'echo term' TERM; echo up; while :; do sleep 0.001; done"
    app_id = await docker_scheduler.submit(
        AppDef("terms", [sh(busybox_image, script)]), {"stop_timeout": 2}
    )
    other = DockerScheduler("someone-else")
    try:
        with anyio.fail_after(30):
            async with contextlib.aclosing(
                docker_scheduler.log_iter(app_id, "main", should_tail=True)  # type: ignore[type-var]
            ) as tail:
                async for line in tail:
                    assert line == "up\n"
                    break
            await (docker_scheduler if canceller == "the launching process" else other).cancel(
                app_id
            )
            resp = await wait_for(docker_scheduler, app_id)
    finally:
        await other.close()
    assert resp.state == AppState.CANCELLED
    assert await collect(docker_scheduler.log_iter(app_id, "main")) == ["up\n", "term\n"]


async def test_unknown_app_is_none_never_succeeded(docker_scheduler: DockerScheduler) -> None:
    """An app id Docker has no container for: describe is None, exists is False, logs raise."""
    assert await docker_scheduler.describe("no-such-app-12345678") is None
    assert await docker_scheduler.describe_many(["no-such-1", "no-such-2"]) == {
        "no-such-1": None,
        "no-such-2": None,
    }
    assert not await docker_scheduler.exists("no-such-app-12345678")
    with pytest.raises(UnknownAppException):
        await collect(docker_scheduler.log_iter("no-such-app-12345678", "main"))


async def test_an_app_id_that_cannot_name_a_container_is_unknown_and_cancels_nothing(
    docker_scheduler: DockerScheduler, busybox_image: str
) -> None:
    """An empty app id (or one with a slash or a NUL) passed to the API is unknown: describe
    None, exists False, logs raise, and its cancel leaves the other apps alone (an empty id
    listed every app's containers, and its cancel stopped running apps once some app had a
    cancel marker)."""
    running = await docker_scheduler.submit(
        AppDef("keep", [sh(busybox_image, "exec sleep 300")]), {}
    )
    cancelled = await docker_scheduler.submit(
        AppDef("gone", [sh(busybox_image, "exec sleep 300")]), {}
    )
    await docker_scheduler.cancel(cancelled)
    for bad in ["", f"x/../{running}", f"{running}\x00"]:
        assert await docker_scheduler.describe(bad) is None
        assert not await docker_scheduler.exists(bad)
        error = UnknownAppException if bad else MalformedAppHandleException  # no handle has it
        with pytest.raises(error):
            await collect(docker_scheduler.log_iter(bad, "main"))
        await docker_scheduler.cancel(bad)
    assert await _running(running) == [f"/{running}-main-0"]


async def test_list_shows_apps_with_their_handles_and_states(
    docker_scheduler: DockerScheduler, busybox_image: str, docker_session: str
) -> None:
    """list() includes each app once, with its state, name and a handle of its session."""
    ok = await docker_scheduler.submit(AppDef("lister-ok", [sh(busybox_image, "true", n=2)]), {})
    bad = await docker_scheduler.submit(AppDef("lister-bad", [sh(busybox_image, "exit 1")]), {})
    await wait_for(docker_scheduler, ok)
    await wait_for(docker_scheduler, bad)
    listed = {a.app_id: a for a in await docker_scheduler.list()}
    assert listed[ok].state == AppState.SUCCEEDED and listed[ok].name == "lister-ok"
    assert listed[bad].state == AppState.FAILED
    assert listed[ok].app_handle == f"local_docker://{docker_session}/{ok}"


def _run_in_new_process(code: str) -> dict[str, Any]:
    proc = run_python("-c", textwrap.dedent(code))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


async def test_apps_outlive_their_launcher_and_other_processes_can_cancel_them(
    docker_engine: None, busybox_image: str, docker_session: str, docker_scheduler: DockerScheduler
) -> None:
    """A process launches an app and exits; this process sees it RUNNING; a third process that
    did not launch it describes and cancels it (its close lets the stop finish); every process
    then reads CANCELLED."""
    prelude = """
        import asyncio, json
        from asynctorchx.schedulers.docker import DockerScheduler
        from asynctorchx.specs import AppDef, Role
    """
    launched = await asyncio.to_thread(
        _run_in_new_process,
        prelude
        + f"""
        async def main():
            async with DockerScheduler({docker_session!r}) as s:
                role = Role("main", {busybox_image!r}, entrypoint="sh",
                            args=["-c", "exec sleep 300"])
                app_id = await s.submit(AppDef("outlive", [role]), {{"stop_timeout": 1}})
                print(json.dumps({{"app_id": app_id}}))
        asyncio.run(main())
        """,
    )
    app_id = launched["app_id"]
    resp = await wait_for(docker_scheduler, app_id, lambda r: r.state == AppState.RUNNING)
    assert resp.state == AppState.RUNNING

    other = await asyncio.to_thread(
        _run_in_new_process,
        prelude
        + f"""
        async def main():
            async with DockerScheduler("someone-else") as s:
                before = (await s.describe({app_id!r})).state.name
                await s.cancel({app_id!r})
            async with DockerScheduler("someone-else") as s:
                after = (await s.describe({app_id!r})).state.name
                print(json.dumps({{"before": before, "after": after}}))
        asyncio.run(main())
        """,
    )
    assert other == {"before": "RUNNING", "after": "CANCELLED"}
    assert (await docker_scheduler.describe(app_id)).state == AppState.CANCELLED  # type: ignore[union-attr]


PAIR_SCRIPT = f"""
if [ {macros.replica_id} = 0 ]; then echo hi | nc -l -p 7000; exit; fi
until nc "$TORCHX_RANK0_HOST" 7000 </dev/null; do sleep 0.1; done
"""


@pytest.mark.timeout(120)
async def test_twenty_concurrent_submits_all_run_and_succeed(
    docker_scheduler: DockerScheduler, busybox_image: str
) -> None:
    """20 apps submitted at once all get distinct ids and succeed; 4 multi-container apps submitted
    at once each get a network of their own, removed once they end."""
    singles = [AppDef(f"many-{i}", [sh(busybox_image, "true")]) for i in range(20)]
    pairs = [AppDef(f"pair-{i}", [sh(busybox_image, PAIR_SCRIPT, n=2)]) for i in range(4)]
    ids = await asyncio.gather(*(docker_scheduler.submit(a, {}) for a in singles + pairs))
    assert len(set(ids)) == 24
    results = await asyncio.gather(*(wait_for(docker_scheduler, i, timeout=90) for i in ids))
    assert [r.state for r in results] == [AppState.SUCCEEDED] * 24

    import aiodocker

    async with aiodocker.Docker() as client:

        async def networks_left() -> list[str]:
            nets = await client.networks.list()
            return [n["Name"] for n in nets if any(i in n["Name"] for i in ids[20:])]

        deadline = time.monotonic() + 20
        while (left := await networks_left()) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert left == []


async def test_bad_input_is_a_clear_error_and_leaves_nothing_behind(
    docker_scheduler: DockerScheduler, busybox_image: str, tmp_path: Path
) -> None:
    """A missing image, a bind mount of a missing host path, too many CPUs, a missing volume and a
    missing network each fail the submit with a message naming it, and no container or network of
    the app is left."""
    cases: list[tuple[AppDef, dict[str, Any], str]] = [
        (AppDef("a", [sh("asynctorchx-test/no-such-image:1", "true")]), {}, "no-such-image"),
        (
            AppDef(
                "a",
                [
                    sh(busybox_image, "true", n=2),
                    sh(
                        busybox_image,
                        "true",
                        name="b",
                        mounts=[BindMount(str(tmp_path / "missing"), "/m")],
                    ),
                ],
            ),
            {},
            str(tmp_path / "missing"),
        ),
        (
            AppDef("a", [sh(busybox_image, "true", resource=Resource(cpu=512, gpu=0, memMB=64))]),
            {},
            "resource.cpu=512",
        ),
        (
            AppDef("a", [sh(busybox_image, "true", mounts=[VolumeMount("atx-no-vol", "/v")])]),
            {},
            "atx-no-vol",
        ),
        (
            AppDef("a", [sh(busybox_image, "true")]),
            {"network": "atx-no-such-net"},
            "atx-no-such-net",
        ),
    ]
    import aiodocker

    for app, cfg, needle in cases:
        info = docker_scheduler.submit_dryrun(app, cfg)
        with pytest.raises(DockerSchedulerError) as err:
            await docker_scheduler.schedule(info)
        assert needle in str(err.value)
        assert await docker_scheduler.describe(info.request.app_id) is None
        async with aiodocker.Docker() as client:
            nets = await client.networks.list(filters={"name": [info.request.app_id]})
            assert nets == []


async def test_other_replicas_resolve_rank0_at_their_first_lookup(
    docker_scheduler: DockerScheduler, busybox_image: str
) -> None:
    """Replicas 1 and 2, started while rank 0's start is still under way, resolve
    TORCHX_RANK0_HOST at their first and only lookup."""
    script = (
        f"if [ {macros.replica_id} = 0 ]; then exec sleep 300; fi\n"
        'nslookup "$TORCHX_RANK0_HOST" >/dev/null 2>&1 && echo resolved || echo unresolved'
    )
    app_id = await docker_scheduler.submit(AppDef("dns", [sh(busybox_image, script, n=3)]), {})
    try:
        await wait_for(
            docker_scheduler,
            app_id,
            lambda r: all(is_terminal(x.state) for x in r.roles_statuses[0].replicas[1:]),
        )
        for k in (1, 2):
            lines = await collect(
                docker_scheduler.log_iter(app_id, "main", k, streams=Stream.STDOUT)
            )
            assert lines == ["resolved\n"], (k, lines)
    finally:
        await docker_scheduler.cancel(app_id)


async def test_rank0_that_fails_to_start_fails_the_submit_and_leaves_nothing(
    docker_scheduler: DockerScheduler, busybox_image: str
) -> None:
    """Rank 0 whose executable does not exist (its start fails after it joined the network, the
    other replicas already starting): the submit fails with Docker's message for rank 0, and no
    container or network of the app is left."""
    import aiodocker

    bad = Role(name="a", image=busybox_image, entrypoint="/no/such/exe")
    app = AppDef("bad0", [bad, sh(busybox_image, "exec sleep 300", name="b", n=2)])
    info = docker_scheduler.submit_dryrun(app, {})
    with pytest.raises(DockerSchedulerError, match=r"role 'a' replica 0: .*/no/such/exe"):
        await docker_scheduler.schedule(info)
    assert await docker_scheduler.describe(info.request.app_id) is None
    assert await containers_of(info.request.app_id) == []
    async with aiodocker.Docker() as client:
        assert await client.networks.list(filters={"name": [info.request.app_id]}) == []


async def test_a_failure_nobody_watched_is_followed_up_once_a_watcher_connects(
    docker_engine: None, busybox_image: str, docker_session: str
) -> None:
    """An app launched without the event feed: replica 0 fails, and status reads (describe, list)
    change nothing, so replica 1 keeps running; a scheduler that then follows Docker's events stops
    replica 1 (the follow-ups owed by apps that ended unwatched are done on connecting)."""
    unwatched = DockerScheduler(docker_session, watch_events=False)
    watcher = DockerScheduler(docker_session)
    try:
        script = f"if [ {macros.replica_id} = 0 ]; then exit 3; fi; exec sleep 300"
        app_id = await unwatched.submit(
            AppDef("unwatched", [sh(busybox_image, script, n=2)]), {"stop_timeout": 1}
        )
        replicas = await wait_for(
            unwatched,
            app_id,
            lambda r: (
                [x.state for x in r.roles_statuses[0].replicas]
                == [AppState.FAILED, AppState.RUNNING]
            ),
        )
        assert replicas.state == AppState.FAILED
        writes = unwatched.engine.writes
        await unwatched.list()
        resp = await unwatched.describe(app_id)
        assert resp is not None and resp.roles_statuses[0].replicas[1].state == AppState.RUNNING
        assert unwatched.engine.writes == writes
        stopped = await wait_for(
            watcher, app_id, lambda r: is_terminal(r.roles_statuses[0].replicas[1].state)
        )
        assert stopped.roles_statuses[0].replicas[1].exit_code in (137, 143)
    finally:
        await unwatched.close()
        await watcher.close()
        await purge_session(docker_session)


async def test_remove_finished_removes_containers_but_the_launcher_keeps_the_final_state(
    docker_scheduler: DockerScheduler, busybox_image: str, docker_session: str
) -> None:
    """With remove_finished the containers go once the app has ended; the scheduler that saw the
    end still answers SUCCEEDED, a fresh one knows nothing of the app."""
    app_id = await docker_scheduler.submit(
        AppDef("rm", [sh(busybox_image, "true", n=2)]), {"remove_finished": True}
    )
    assert (await wait_for(docker_scheduler, app_id)).state == AppState.SUCCEEDED
    deadline = time.monotonic() + 20
    while await containers_of(app_id):
        assert time.monotonic() < deadline, "containers were not removed"
        await asyncio.sleep(0.1)
    fresh = DockerScheduler(docker_session, watch_events=False)
    try:
        assert await fresh.describe(app_id) is None
    finally:
        await fresh.close()
    kept = await docker_scheduler.describe(app_id)
    assert kept is not None and kept.state == AppState.SUCCEEDED


async def test_replica_retry_policy_restarts_the_container_in_place(
    docker_scheduler: DockerScheduler, busybox_image: str
) -> None:
    """REPLICA policy with max_retries=1: Docker restarts the failed container once; an app whose
    second run succeeds SUCCEEDS, one failing twice FAILS with its exit code; both count 1 restart."""
    script = "if [ -f /tmp/ran ]; then echo second; exit 0; fi; touch /tmp/ran; echo first; exit 1"
    role = sh(busybox_image, script, max_retries=1, retry_policy=RetryPolicy.REPLICA)
    app_id = await docker_scheduler.submit(AppDef("replica-retry", [role]), {})
    always = sh(busybox_image, "echo try; exit 5", max_retries=1, retry_policy=RetryPolicy.REPLICA)
    failing = await docker_scheduler.submit(AppDef("replica-retry-fails", [always]), {})
    resp = await wait_for(docker_scheduler, app_id)
    assert resp.state == AppState.SUCCEEDED and resp.num_restarts == 1
    assert await collect(docker_scheduler.log_iter(app_id, "main")) == ["first\n", "second\n"]
    failed = await wait_for(docker_scheduler, failing)
    assert failed.state == AppState.FAILED and failed.num_restarts == 1
    assert failed.roles_statuses[0].replicas[0].exit_code == 5
    assert await collect(docker_scheduler.log_iter(failing, "main")) == ["try\n", "try\n"]


async def test_application_retry_recreates_every_replica_as_a_new_attempt(
    docker_scheduler: DockerScheduler, busybox_image: str, tmp_path: Path
) -> None:
    """APPLICATION policy with max_retries=1: replica 0 fails on the first attempt, the backend
    recreates both replicas, the second attempt succeeds; replica 0's log holds both attempts,
    and a tail started at submit follows it across the retry to the end."""
    state = tmp_path / "state"
    state.mkdir()
    script = (
        f"if [ {macros.replica_id} = 0 ] && [ ! -f /state/failed ]; then "
        "touch /state/failed; echo attempt-fails; exit 2; fi; echo attempt-ok"
    )
    role = sh(
        busybox_image,
        script,
        n=2,
        max_retries=1,
        retry_policy=RetryPolicy.APPLICATION,
        mounts=[BindMount(str(state), "/state")],
    )
    app_id = await docker_scheduler.submit(AppDef("app-retry", [role]), {})
    tail = asyncio.ensure_future(
        collect(docker_scheduler.log_iter(app_id, "main", 0, should_tail=True))
    )
    resp = await wait_for(docker_scheduler, app_id)
    assert resp.state == AppState.SUCCEEDED and resp.num_restarts == 1
    both = ["attempt-fails\n", "attempt-ok\n"]
    assert await collect(docker_scheduler.log_iter(app_id, "main", 0)) == both
    assert await asyncio.wait_for(tail, 30) == both


async def test_a_retry_started_after_a_cancel_is_stopped_by_the_retry(
    docker_scheduler: DockerScheduler,
    busybox_image: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ROLE retry whose new container is started just after another process cancelled the app
    (the canceller saw it only created): the retry stops it and the app ends CANCELLED (it read
    RUNNING, "cancelling", for as long as the container ran)."""
    state = tmp_path / "state"
    state.mkdir()
    script = "if [ ! -f /state/failed ]; then touch /state/failed; exit 2; fi; exec sleep 300"
    role = sh(
        busybox_image,
        script,
        max_retries=1,
        retry_policy=RetryPolicy.ROLE,
        mounts=[BindMount(str(state), "/state")],
    )
    engine = docker_scheduler.engine
    other = DockerScheduler("someone-else")
    app_ids: list[str] = []
    retried = asyncio.Event()
    real_start = engine.start_container

    async def cancel_then_start(cid: str, *, what: str) -> None:
        if what.startswith("retrying"):
            await other.cancel(app_ids[0])
            await real_start(cid, what=what)
            retried.set()
        else:
            await real_start(cid, what=what)

    monkeypatch.setattr(engine, "start_container", cancel_then_start)
    try:
        app_ids.append(
            await docker_scheduler.submit(AppDef("retry-cancel", [role]), {"stop_timeout": 1})
        )
        with anyio.fail_after(60):
            await retried.wait()
        with anyio.fail_after(20):  # the retry's stop: SIGKILL after the 1 s stop_timeout
            while await _running(app_ids[0]):
                await asyncio.sleep(0.2)
            resp = await wait_for(docker_scheduler, app_ids[0])
    finally:
        await other.close()
    assert resp.state == AppState.CANCELLED and resp.num_restarts == 1


@pytest.mark.timeout(60)
async def test_runner_waits_for_a_docker_app_through_pushed_events(
    docker_engine: None, busybox_image: str, docker_session: str
) -> None:
    """AsyncRunner.wait on a local_docker app returns its final status (woken by Docker events)."""
    try:
        async with AsyncRunner(name=docker_session) as runner:
            handle = await runner.run(
                AppDef("runner", [sh(busybox_image, "sleep 0.5; exit 4")]), "local_docker"
            )
            status = await runner.wait(handle, timeout=30)
            assert status is not None and status.state == AppState.FAILED
            lines = [line async for line in runner.log_lines(handle, "main")]
            assert lines == []
    finally:
        await purge_session(docker_session)


# Never polls within a test's horizon: every pacing knob of the hub at 10 minutes, so a waiter that
# returns sooner was woken by a change the backend pushed (Docker's /events stream).
PUSH_ONLY = PollSettings(min_interval=600.0, max_interval=600.0, push_safety_interval=600.0)


def _docker_time(text: str) -> float:
    """A Docker API timestamp (RFC 3339 with nanoseconds) as seconds since the epoch."""
    head, _, frac = text.rstrip("Z").partition(".")
    seconds = datetime.fromisoformat(head + "+00:00").timestamp()
    return seconds + (float("0." + frac) if frac else 0.0)


@pytest.mark.timeout(60)
async def test_runner_wait_wakes_from_the_event_stream_without_polling(
    docker_engine: None, busybox_image: str, docker_session: str, tmp_path: Path
) -> None:
    """With a hub that never polls (every interval 600 s), runner.wait on a running container that
    then exits returns its final state within a second or two of the exit: the hub ran no round
    after the app was RUNNING other than those Docker's pushed events asked for."""
    gate = tmp_path / "gate"
    gate.mkdir()
    role = sh(
        busybox_image,
        "until [ -f /gate/open ]; do sleep 0.02; done; exit 4",
        mounts=[BindMount(str(gate), "/gate")],
    )
    try:
        async with AsyncRunner(name=docker_session, poll_settings=PUSH_ONLY) as runner:
            hub = runner.hub("local_docker")
            pushes: list[str] = []
            unsubscribe = hub.scheduler.subscribe(pushes.append)
            handle = await runner.run(AppDef("pushed", [role]), "local_docker")
            app_id = parse_app_handle(handle).app_id

            async def running() -> None:
                async for event in runner.watch([handle]):
                    assert not event.is_terminal, event
                    if event.state == AppState.RUNNING:
                        return

            await asyncio.wait_for(running(), 30)  # woken by the initial round or "start"
            rounds_before, pushes_before = hub.rounds, pushes.count(app_id)
            assert rounds_before >= 1  # the initial round(s)

            (gate / "open").touch()  # the container exits 4 within ~20 ms
            started = time.monotonic()
            status = await runner.wait(handle, timeout=30)
            woke_at, waited = time.time(), time.monotonic() - started
            unsubscribe()
            rounds = hub.rounds - rounds_before
            pushed = pushes.count(app_id) - pushes_before

            import aiodocker

            assert await containers_of(app_id) == [f"/{app_id}-main-0"]
            async with aiodocker.Docker() as client:
                info = await client.containers.container(f"{app_id}-main-0").show()
            exited_at = _docker_time(info["State"]["FinishedAt"])
    finally:
        await purge_session(docker_session)

    assert status is not None and status.state == AppState.FAILED
    assert status.roles[0].replicas[0].exit_code == 4
    assert info["State"]["ExitCode"] == 4
    # far from the 600 s at which the hub would first poll: the exit event woke it
    assert waited < 10, f"runner.wait took {waited:.2f}s after the gate opened"
    assert woke_at - exited_at < 2.0, f"woke {woke_at - exited_at:.3f}s after the exit"
    # every round since RUNNING was asked for by a pushed event ("die"), none by a timer
    assert pushed >= 1
    assert 1 <= rounds <= pushed, f"{rounds} rounds for {pushed} pushed events"


async def test_a_submit_cancelled_while_its_creates_are_in_flight_leaves_nothing(
    docker_scheduler: DockerScheduler, busybox_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A schedule() cancelled while its network's or containers' create request is in flight
    leaves no network and no container of the app (the engine finishes a create whose client
    went away, after the clean-up had looked)."""
    import aiodocker

    engine = docker_scheduler.engine
    asked = asyncio.Event()
    for method in ("create_network", "create_container"):
        real = getattr(engine, method)

        async def noted(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            asked.set()
            return await _real(*args, **kwargs)

        monkeypatch.setattr(engine, method, noted)
        app_ids = []
        for _ in range(4):
            info = docker_scheduler.submit_dryrun(
                AppDef("c", [sh(busybox_image, "sleep 300", n=3)]), {"stop_timeout": 1}
            )
            app_ids.append(info.request.app_id)
            asked.clear()
            submit = asyncio.ensure_future(docker_scheduler.schedule(info))
            with anyio.fail_after(30):
                await asked.wait()
            await asyncio.sleep(0)  # the request goes out
            submit.cancel()
            with pytest.raises(asyncio.CancelledError):
                await submit
        monkeypatch.setattr(engine, method, real)
        async with aiodocker.Docker() as client:
            for app_id in app_ids:
                assert await containers_of(app_id) == [], method
                nets = await client.networks.list(filters={"name": [app_id]})
                assert nets == [], method


async def _running(app_id: str) -> list[str]:
    """The names of the app's containers Docker has running (asked directly)."""
    return [name for name, (state, _) in (await _containers_and_logs(app_id)).items() if state]


async def _containers_and_logs(app_id: str) -> dict[str, tuple[bool, str]]:
    """Each container of the app (asked directly): whether it runs, and its log."""
    import aiodocker

    from asynctorchx.schedulers._docker.request import LABEL_APP_ID

    out = {}
    async with aiodocker.Docker() as client:
        label = json.dumps({"label": [f"{LABEL_APP_ID}={app_id}"]})
        for c in await client.containers.list(all=True, filters=label):
            name, running = c["Names"][0], c["State"] in ("running", "restarting")
            out[name] = (running, "".join(await c.log(stdout=True, stderr=True)))
    return out


@pytest.mark.parametrize(
    "point", ["before the first create", "between replicas", "after the last start"]
)
async def test_a_cancel_from_another_process_during_a_submit_leaves_the_app_cancelled(
    docker_scheduler: DockerScheduler,
    busybox_image: str,
    monkeypatch: pytest.MonkeyPatch,
    point: str,
) -> None:
    """A cancel from a scheduler sharing nothing with the submitter (as another process) that
    lands at ``point`` of a 3-replica submit: once both return, the app ends CANCELLED for both
    (the stops the cancel asked for end after it returned), each container started got one
    SIGTERM, and none runs."""
    engine = docker_scheduler.engine
    other = DockerScheduler("someone-else")
    script = "trap 'echo term' TERM; while :; do sleep 0.001; done"
    info = docker_scheduler.submit_dryrun(
        AppDef("c", [sh(busybox_image, script, n=3)]), {"stop_timeout": 1}
    )
    app_id = info.request.app_id
    landed: list[str] = []
    if point == "before the first create":
        real_network = engine.create_network

        async def network_then_cancel(*args: Any, **kwargs: Any) -> Any:
            nid = await real_network(*args, **kwargs)
            if not landed:
                await other.cancel(app_id)
                landed.append(point)
            return nid

        monkeypatch.setattr(engine, "create_network", network_then_cancel)
    else:
        real_start = engine.start_container
        starts = 0

        async def start_then_cancel(*args: Any, **kwargs: Any) -> None:
            nonlocal starts
            await real_start(*args, **kwargs)
            starts += 1
            if starts == (1 if point == "between replicas" else 3):
                await other.cancel(app_id)
                landed.append(point)

        monkeypatch.setattr(engine, "start_container", start_then_cancel)
    try:
        with anyio.fail_after(60):
            assert await docker_scheduler.schedule(info) == app_id
        assert landed == [point]
        with anyio.fail_after(30):
            seen_here = await wait_for(docker_scheduler, app_id)
            seen_there = await other.describe(app_id)
        containers = await _containers_and_logs(app_id)
        assert not any(running for running, _ in containers.values()), containers
        assert all(log.count("term") <= 1 for _, log in containers.values()), containers
    finally:
        await other.close()
    assert seen_there is not None and seen_there.state == AppState.CANCELLED
    assert seen_here.state == AppState.CANCELLED


async def test_the_cli_cancels_an_app_whose_submit_has_made_only_its_network(
    docker_scheduler: DockerScheduler,
    docker_session: str,
    busybox_image: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``asynctorchx cancel`` run while another process's submit of a 3-replica app has made only
    its network: it reports the cancel (not "unknown app"), and the submit then leaves the app
    CANCELLED with no container running; a handle that never existed is still unknown."""
    engine = docker_scheduler.engine
    info = docker_scheduler.submit_dryrun(
        AppDef("c", [sh(busybox_image, "exec sleep 300", n=3)]), {"stop_timeout": 1}
    )
    app_id = info.request.app_id
    handle = f"local_docker://{docker_session}/{app_id}"
    outcome: list[subprocess.CompletedProcess[str]] = []
    real_network = engine.create_network

    async def network_then_cancel(*args: Any, **kwargs: Any) -> Any:
        nid = await real_network(*args, **kwargs)
        if not outcome:
            outcome.append(
                await asyncio.to_thread(run_python, "-m", "asynctorchx", "cancel", handle)
            )
        return nid

    monkeypatch.setattr(engine, "create_network", network_then_cancel)
    with anyio.fail_after(90):
        assert await docker_scheduler.schedule(info) == app_id
    assert outcome[0].returncode == 0, outcome[0].stderr
    assert "cancel requested" in outcome[0].stderr + outcome[0].stdout
    assert await _running(app_id) == []
    with anyio.fail_after(30):
        assert (await wait_for(docker_scheduler, app_id)).state == AppState.CANCELLED
    never_existed = f"local_docker://{docker_session}/never-1a2b3c"
    never = await asyncio.to_thread(run_python, "-m", "asynctorchx", "cancel", never_existed)
    assert never.returncode != 0
    assert "never-1a2b3c" in never.stderr


@pytest.mark.parametrize("point", ["during its checks", "while it creates its containers"])
async def test_a_cancel_in_process_during_a_submit_leaves_the_app_cancelled(
    docker_scheduler: DockerScheduler,
    busybox_image: str,
    monkeypatch: pytest.MonkeyPatch,
    point: str,
) -> None:
    """cancel() from another task of the submitting process while schedule() checks the images
    (no container exists yet) or creates the containers: once both return, no container of the
    app runs and it reads CANCELLED."""
    engine = docker_scheduler.engine
    info = docker_scheduler.submit_dryrun(
        AppDef("c", [sh(busybox_image, "exec sleep 300", n=3)]), {"stop_timeout": 1}
    )
    app_id = info.request.app_id
    cancels: list[asyncio.Future[None]] = []
    method = "inspect_image" if point == "during its checks" else "create_container"
    real = getattr(engine, method)

    async def cancel_meanwhile(*args: Any, **kwargs: Any) -> Any:
        if not cancels:
            cancels.append(asyncio.ensure_future(docker_scheduler.cancel(app_id)))
            if point == "during its checks":
                await cancels[0]  # returns at once: the submit has created nothing yet
        return await real(*args, **kwargs)

    monkeypatch.setattr(engine, method, cancel_meanwhile)
    with anyio.fail_after(60):
        assert await docker_scheduler.schedule(info) == app_id
        await cancels[0]
    assert await _running(app_id) == []
    with anyio.fail_after(30):
        resp = await wait_for(docker_scheduler, app_id)
    assert resp.state == AppState.CANCELLED


async def test_a_cancel_of_an_app_that_never_existed_changes_nothing(
    docker_scheduler: DockerScheduler,
) -> None:
    """cancel() of an id Docker knows nothing of returns; the app stays unknown (describe None,
    exists False) and no container is made for it."""
    await docker_scheduler.cancel("no-such-app-87654321")
    assert await docker_scheduler.describe("no-such-app-87654321") is None
    assert not await docker_scheduler.exists("no-such-app-87654321")
    assert await containers_of("no-such-app-87654321") == []


async def test_close_during_a_submit_lets_the_launch_finish_or_refuses_it_leaving_nothing(
    docker_engine: None, docker_session: str, busybox_image: str
) -> None:
    """close() while a submit checks its images: the submit raises "closed" and creates nothing;
    close() while it creates its containers: the launch completes (the app runs) before the
    engine is closed, instead of failing as "cannot reach the Docker engine" with its network and
    containers left behind."""
    outcomes: dict[str, object] = {}
    try:
        for method in ("inspect_image", "create_container"):
            scheduler = DockerScheduler(docker_session)
            asked = asyncio.Event()
            real = getattr(scheduler.engine, method)

            async def noted(*args: Any, _real: Any = real, _asked: Any = asked, **kw: Any) -> Any:
                _asked.set()
                return await _real(*args, **kw)

            setattr(scheduler.engine, method, noted)
            info = scheduler.submit_dryrun(
                AppDef("c", [sh(busybox_image, "sleep 300", n=3)]), {"stop_timeout": 1}
            )
            submit = asyncio.ensure_future(scheduler.schedule(info))
            with anyio.fail_after(60):
                await asked.wait()
                await scheduler.close()
                outcomes[method] = (await asyncio.gather(submit, return_exceptions=True))[0]
            names = await containers_of(info.request.app_id)
            if method == "inspect_image":
                assert isinstance(outcomes[method], RuntimeError), outcomes[method]
                assert "closed" in str(outcomes[method]) and names == []
            else:
                assert outcomes[method] == info.request.app_id, outcomes[method]
                assert len(names) == 3
    finally:
        await purge_session(docker_session)


async def test_a_replica_removed_behind_our_back_fails_the_app_and_stops_the_others(
    docker_scheduler: DockerScheduler, busybox_image: str
) -> None:
    """`docker rm -f` of one replica of a running app: the app turns FAILED naming that replica
    and the survivor is stopped (it stayed RUNNING, then UNKNOWN, forever: a wait never ended)."""
    import aiodocker

    app = AppDef("gone", [sh(busybox_image, "sleep 300", n=2)])
    app_id = await docker_scheduler.submit(app, {"stop_timeout": 1})
    await wait_for(docker_scheduler, app_id, lambda r: r.state == AppState.RUNNING)
    async with aiodocker.Docker() as client:
        await (await client.containers.get(f"{app_id}-main-1")).delete(force=True)
    resp = await wait_for(
        docker_scheduler,
        app_id,
        lambda r: is_terminal(r.state) and r.roles_statuses[0].replicas[0].exit_code is not None,
    )
    assert resp.state == AppState.FAILED
    assert "main/1" in resp.msg and "removed" in resp.msg
    assert resp.roles_statuses[0].replicas[0].exit_code in (137, 143)


# -- cancels from other processes: real processes (the CLI, or a Python child whose cancel is held
# at, or killed after, the making of the cancel marker), synchronised through their stdin/stdout.

#: A replica whose SIGTERM handler logs "term" and keeps it running (until SIGKILL).
TERM_LOGGER = "trap 'echo term' TERM; echo up; while :; do sleep 0.001; done"

#: A process that cancels ``argv[1]`` through a scheduler of its own; with ``argv[2]`` "hold" it
#: prints "ready" just before making the cancel marker and waits for a line on stdin, with "die"
#: it prints "marked" once the marker exists and then never goes on (to be killed there).
CANCELLER = textwrap.dedent(
    """
    import asyncio, sys
    from asynctorchx.schedulers.docker import DockerScheduler

    app_id, mode = sys.argv[1], sys.argv[2]

    async def main():
        async with DockerScheduler("someone-else") as s:
            real = s.engine.create_container

            async def create(config, name, **kwargs):
                if name != app_id + "-cancelled":
                    return await real(config, name, **kwargs)
                if mode == "hold":
                    print("ready", flush=True)
                    await asyncio.to_thread(sys.stdin.readline)
                made = await real(config, name, **kwargs)
                if mode == "die":
                    print("marked", flush=True)
                    await asyncio.Event().wait()
                return made

            s.engine.create_container = create
            await s.cancel(app_id)
            print("done", flush=True)

    asyncio.run(main())
    """
)


async def _volumes_of(app_id: str) -> list[str]:
    """The names of the volumes labelled with ``app_id`` (asked directly)."""
    import aiodocker

    from asynctorchx.schedulers._docker.request import LABEL_APP_ID

    async with aiodocker.Docker() as client:
        answer = await client.volumes.list(filters={"label": [f"{LABEL_APP_ID}={app_id}"]})
    return [v["Name"] for v in answer.get("Volumes") or []]


async def _canceller(app_id: str, mode: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CANCELLER,
        app_id,
        mode,
        cwd=REPO,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )


async def _says(proc: asyncio.subprocess.Process, word: str) -> None:
    """Waits (bounded by the caller) until ``proc`` prints ``word`` on a line of its own."""
    assert proc.stdout is not None
    line = await proc.stdout.readline()
    assert line.decode().strip() == word, f"the canceller said {line!r}, not {word!r}"


async def _started_and_up(scheduler: DockerScheduler, image: str, stop_timeout: int) -> str:
    """Submits a TERM_LOGGER app and returns its id once its replica has logged "up"."""
    app_id = await scheduler.submit(
        AppDef("terms", [sh(image, TERM_LOGGER)]), {"stop_timeout": stop_timeout}
    )
    async for line in scheduler.log_iter(app_id, "main", should_tail=True):
        assert line == "up\n"
        break
    return app_id


@pytest.mark.parametrize("point", ["during its checks", "while it creates its container"])
async def test_the_cli_cancels_a_single_container_app_before_its_container_exists(
    docker_scheduler: DockerScheduler,
    docker_session: str,
    busybox_image: str,
    monkeypatch: pytest.MonkeyPatch,
    point: str,
) -> None:
    """``asynctorchx cancel`` of a single-container app whose submit (in another process) has
    made no container yet reports the cancel (not "unknown app"); the submit then runs nothing,
    the app reads CANCELLED everywhere, and no launch claim is left behind."""
    engine = docker_scheduler.engine
    info = docker_scheduler.submit_dryrun(
        AppDef("one", [sh(busybox_image, "echo ran; exec sleep 300")]), {"stop_timeout": 1}
    )
    app_id = info.request.app_id
    handle = f"local_docker://{docker_session}/{app_id}"
    method = "inspect_image" if point == "during its checks" else "create_container"
    real, real_claim = getattr(engine, method), engine.create_volume
    seen: list[Any] = []
    claimed = asyncio.Event()  # the launch claim is made while the checks run

    async def claim(*args: Any, **kwargs: Any) -> Any:
        try:
            return await real_claim(*args, **kwargs)
        finally:
            claimed.set()

    async def cancel_first(*args: Any, **kwargs: Any) -> Any:
        if not seen:
            await claimed.wait()
            other = DockerScheduler("someone-else")
            try:
                seen.append(await other.describe(app_id))
            finally:
                await other.close()
            seen.append(await asyncio.to_thread(run_python, "-m", "asynctorchx", "cancel", handle))
        return await real(*args, **kwargs)

    monkeypatch.setattr(engine, method, cancel_first)
    monkeypatch.setattr(engine, "create_volume", claim)
    with anyio.fail_after(90):
        assert await docker_scheduler.schedule(info) == app_id
    pending, cancel = seen
    assert pending is not None and pending.state == AppState.PENDING
    assert cancel.returncode == 0, cancel.stderr
    assert "cancel requested" in cancel.stderr + cancel.stdout
    with anyio.fail_after(30):
        assert (await wait_for(docker_scheduler, app_id)).state == AppState.CANCELLED
    status = await asyncio.to_thread(run_python, "-m", "asynctorchx", "status", "--json", handle)
    assert '"CANCELLED"' in status.stdout, status.stdout + status.stderr
    assert await containers_of(app_id) == [f"/{app_id}-cancelled"]  # nothing else was made
    assert await _volumes_of(app_id) == []


async def test_a_canceller_killed_after_its_marker_leaves_no_app_cancelling_forever(
    docker_scheduler: DockerScheduler, busybox_image: str
) -> None:
    """A cancelling process killed right after making the app's cancel marker (before stopping
    anything): a later describe from another process finishes the cancel, with one SIGTERM
    (the replica's handler runs once), and the app ends CANCELLED."""
    with anyio.fail_after(60):
        app_id = await _started_and_up(docker_scheduler, busybox_image, stop_timeout=1)
        proc = await _canceller(app_id, "die")
        try:
            await _says(proc, "marked")
        finally:
            proc.kill()
            await proc.wait()
        resp = await wait_for(docker_scheduler, app_id)
    assert resp.state == AppState.CANCELLED
    assert await collect(docker_scheduler.log_iter(app_id, "main")) == ["up\n", "term\n"]


async def test_two_processes_cancelling_at_once_send_one_sigterm(
    docker_scheduler: DockerScheduler, busybox_image: str
) -> None:
    """Two processes that cancel a running app at the same moment (both about to make its cancel
    marker) signal its container once between them: the SIGTERM handler runs once, both return,
    and the app ends CANCELLED."""
    with anyio.fail_after(60):
        app_id = await _started_and_up(docker_scheduler, busybox_image, stop_timeout=2)
        procs = [await _canceller(app_id, "hold") for _ in range(2)]
        try:
            for proc in procs:
                await _says(proc, "ready")
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.write(b"go\n")
                await proc.stdin.drain()
            for proc in procs:
                await _says(proc, "done")
                assert await proc.wait() == 0
        finally:
            for proc in procs:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
        resp = await wait_for(docker_scheduler, app_id)
    assert resp.state == AppState.CANCELLED
    assert await collect(docker_scheduler.log_iter(app_id, "main")) == ["up\n", "term\n"]


#: A process that submits a busybox app in ``argv[1]``'s session and prints its id once its
#: submit has made its launch claim (its checks run meanwhile), then waits for good (to be killed).
STUCK_LAUNCHER = textwrap.dedent(
    """
    import asyncio, sys
    from asynctorchx.schedulers.docker import DockerScheduler
    from asynctorchx.specs import AppDef, Role

    async def main():
        async with DockerScheduler(sys.argv[1]) as s:
            role = Role("main", sys.argv[2], entrypoint="sh", args=["-c", "echo ran"])
            info = s.submit_dryrun(AppDef("stuck", [role]), {})
            real_claim = s.engine.create_volume

            async def claim_then_hang(*args, **kwargs):
                await real_claim(*args, **kwargs)
                print(info.request.app_id, flush=True)
                await asyncio.Event().wait()

            s.engine.create_volume = claim_then_hang
            await s.schedule(info)

    asyncio.run(main())
    """
)


async def test_an_app_whose_launcher_was_killed_before_its_containers_is_unknown(
    docker_scheduler: DockerScheduler, docker_session: str, busybox_image: str
) -> None:
    """A submit killed during its checks (no container made yet): other processes see the app
    PENDING while its launcher lives, unknown once it is gone (not PENDING for good), and a
    cancel of it is then a clear "unknown app" error."""
    with anyio.fail_after(60):
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            STUCK_LAUNCHER,
            docker_session,
            busybox_image,
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            assert proc.stdout is not None
            app_id = (await proc.stdout.readline()).decode().strip()
            pending = await docker_scheduler.describe(app_id)
        finally:
            proc.kill()
            await proc.wait()
        assert pending is not None and pending.state == AppState.PENDING
        assert await docker_scheduler.describe(app_id) is None
        handle = f"local_docker://{docker_session}/{app_id}"
        cancel = await asyncio.to_thread(run_python, "-m", "asynctorchx", "cancel", handle)
    assert cancel.returncode != 0 and app_id in cancel.stderr


async def test_a_replica_killed_for_memory_says_so(
    docker_scheduler: DockerScheduler, busybox_image: str
) -> None:
    """A replica the kernel kills for running past its memMB limit fails the app with a message
    that says so, in this process and in another (it read "exit code 137", as a `docker kill`);
    a replica that exits with 137 itself (as one killed by `docker kill` reads) does not."""
    hog = sh(busybox_image, "tail /dev/zero", resource=Resource(cpu=1, gpu=0, memMB=16))
    app_id = await docker_scheduler.submit(AppDef("hog", [hog]), {})
    resp = await wait_for(docker_scheduler, app_id, timeout=60)
    assert resp.state == AppState.FAILED
    assert "exit code 137" in resp.msg and "out of memory" in resp.msg, resp.msg
    other = DockerScheduler("someone-else", watch_events=False)
    try:
        seen = await other.describe(app_id)
    finally:
        await other.close()
    assert seen is not None and seen.msg == resp.msg

    killed = await docker_scheduler.submit(AppDef("killed", [sh(busybox_image, "exit 137")]), {})
    resp = await wait_for(docker_scheduler, killed, timeout=60)
    assert resp.state == AppState.FAILED and "exit code 137" in resp.msg, resp.msg
    assert "memory" not in resp.msg, resp.msg


@pytest.mark.timeout(120)
async def test_the_final_state_of_a_removed_app_keeps_what_only_an_inspect_says(
    docker_scheduler: DockerScheduler, busybox_image: str
) -> None:
    """With remove_finished, the final state the launcher keeps once the containers are gone
    says what only an inspect of them said: a replica killed for running out of memory (it read
    only "exit code 137"), and Docker's restarts of a REPLICA retry (it read 0 restarts)."""
    hog = sh(busybox_image, "tail /dev/zero", resource=Resource(cpu=1, gpu=0, memMB=16))
    oom = await docker_scheduler.submit(AppDef("hog", [hog]), {"remove_finished": True})
    again = sh(busybox_image, "exit 5", max_retries=1, retry_policy=RetryPolicy.REPLICA)
    restarted = await docker_scheduler.submit(AppDef("again", [again]), {"remove_finished": True})
    for app_id in (oom, restarted):
        with anyio.fail_after(60):
            while True:  # until the app has ended and its containers are removed
                resp = await docker_scheduler.describe(app_id)
                assert resp is not None
                if resp.state == AppState.FAILED and not await containers_of(app_id):
                    break
                await asyncio.sleep(0.2)
    resp = await docker_scheduler.describe(oom)
    assert resp is not None and resp.state == AppState.FAILED, resp
    assert "exit code 137" in resp.msg and "out of memory" in resp.msg, resp.msg
    resp = await docker_scheduler.describe(restarted)
    assert resp is not None and resp.state == AppState.FAILED, resp
    assert resp.num_restarts == 1 and "exit code 5" in resp.msg, resp
