"""examples/service.py driven by aiohttp's test client on asynctorchx.testing's scripted scheduler.

Every test checks that no process was started: the scripted backend is registered as ``local_cwd``
(the service's default), the test process gains no child, and the local backend's state root is
never created. ``tests/test_examples.py`` runs the same service on real local processes.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient, TestServer

from asynctorchx.runner import Limits
from asynctorchx.specs import AppDef, AppState, CfgVal
from asynctorchx.testing import (
    AppScript,
    Fault,
    ScriptedBackend,
    ScriptedScheduler,
    VirtualClock,
    lines,
)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "service.py"


def load_service() -> ModuleType:
    spec = importlib.util.spec_from_file_location("example_service_scripted", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SERVICE = load_service()


def children() -> set[int]:
    """The pids of this process's children (of every thread)."""
    pids: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            pids.update(int(p) for p in (task / "children").read_text().split())
        except OSError:
            continue
    return pids


@pytest.fixture
def local_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the real local backend would keep its state: it must never be created."""
    root = tmp_path / "local-state"
    monkeypatch.setenv("ASYNCTORCHX_LOCAL_ROOT", str(root))
    return root


Serve = Callable[..., Any]


@pytest.fixture
def serve(local_root: Path) -> Serve:
    """Serves the example on a backend: ``async with serve(backend, **runner_options) as client``."""

    @asynccontextmanager
    async def serving(backend: ScriptedBackend, **options: Any) -> AsyncIterator[TestClient]:
        before = children()
        app = SERVICE.make_app("svc", scheduler_factories={"local_cwd": backend}, **options)
        server = TestServer(app, host="127.0.0.1", port=0, handler_cancellation=True)
        async with server, TestClient(server) as client:
            yield client
            runner = app[SERVICE.RUNNER]
            assert all(isinstance(s, ScriptedScheduler) for s in runner._schedulers.values())
        assert children() <= before, "a process was started"
        assert not local_root.exists(), "the local backend was used"

    return serving


class SSE:
    """Reads a Server-Sent Events response event by event: ``(event, payload)``."""

    def __init__(self, response: ClientResponse) -> None:
        self.response = response
        #: the ``id:`` of the last event read (what a reconnecting client sends as Last-Event-ID)
        self.last_id: str | None = None

    async def next(self) -> tuple[str, Any]:
        event, data = "message", ""
        while True:
            raw = await self.response.content.readline()
            if not raw:
                raise EOFError("the stream ended")
            text = raw.decode().rstrip("\n")
            if text.startswith("event: "):
                event = text[len("event: ") :]
            elif text.startswith("id: "):
                self.last_id = text[len("id: ") :]
            elif text.startswith("data: "):
                data = text[len("data: ") :]
            elif text == "":
                return event, json.loads(data)

    async def rest(self) -> tuple[list[str], Any]:
        """The remaining lines, and the payload of the ``end`` event."""
        got: list[str] = []
        while True:
            event, payload = await self.next()
            if event == "end":
                return got, payload
            got.append(payload)


def sh(*words: str) -> dict[str, Any]:
    """The body of a launch of ``utils.sh`` (an app named ``sh`` with one role ``sh``)."""
    return {"component": "utils.sh", "args": list(words)}


LOG = AppScript(
    states=[(0, AppState.RUNNING), (60, AppState.SUCCEEDED)],
    logs=lines("sh", [f"step {i}" for i in range(1, 7)], start=0, every=10),
)


async def test_launch_status_logs_and_wait(serve: Serve) -> None:
    """POST /apps, GET status, the SSE log stream as the app progresses, and /wait, on a scripted app."""
    clock = VirtualClock()
    backend = ScriptedBackend("local_cwd", LOG, clock=clock)
    async with serve(backend) as client:
        resp = await client.post("/apps", json=sh("python", "train.py"))
        assert resp.status == 201, await resp.text()
        launched = await resp.json()
        assert launched == {
            "handle": "local_cwd://svc/sh-1",
            "scheduler": "local_cwd",
            "app_id": "sh-1",
        }
        path = "/apps/local_cwd/sh-1"
        status = await client.get(path)
        assert (await status.json())["state"] == "RUNNING"
        assert backend.app("sh-1").app.roles[0].args[-1] == "python train.py"  # sh -c '...'

        clock.advance(15)
        stream = SSE(await client.get(f"{path}/logs", params={"role": "sh"}))
        assert stream.response.headers["Content-Type"].startswith("text/event-stream")
        assert [await stream.next() for _ in range(2)] == [
            ("message", "step 1\n"),
            ("message", "step 2\n"),
        ]
        clock.advance(45)  # the rest of the lines, and the end
        assert await stream.rest() == (
            ["step 3\n", "step 4\n", "step 5\n", "step 6\n"],
            {"state": "SUCCEEDED"},
        )
        final = await client.post(f"{path}/wait")
        assert (await final.json())["state"] == "SUCCEEDED"


def per_client(app: AppDef, cfg: dict[str, CfgVal]) -> AppScript:
    """The script of a client's app: 100 lines naming the client, over 50 ms, then success."""
    client = app.roles[0].args[-1].split()[-1]  # utils.sh runs sh -c 'echo client-N'

    return AppScript(
        states=[(0, AppState.RUNNING), (0.06, AppState.SUCCEEDED)],
        logs=lines("sh", [f"{client}-line-{i}" for i in range(1, 101)], every=0.0005),
    )


async def test_20_clients_launch_and_stream_without_losing_lines(serve: Serve) -> None:
    """20 concurrent clients each launch and stream their app: every line once, in order, in milliseconds."""
    backend = ScriptedBackend("local_cwd", scripts=per_client)

    async def one(client: TestClient, c: int) -> None:
        resp = await client.post("/apps", json=sh("echo", f"client-{c}"))
        assert resp.status == 201
        app_id = (await resp.json())["app_id"]
        stream = SSE(await client.get(f"/apps/local_cwd/{app_id}/logs", params={"role": "sh"}))
        got, end = await stream.rest()
        assert got == [f"client-{c}-line-{i}\n" for i in range(1, 101)]
        assert end == {"state": "SUCCEEDED"}

    async with serve(backend) as client:
        with anyio.fail_after(30):
            await asyncio.gather(*(one(client, c) for c in range(20)))
    assert len(backend.apps) == 20


async def test_a_log_stream_resumes_from_last_event_id_with_every_line_once(serve: Serve) -> None:
    """A client reads part of a running app's SSE log, disconnects, and reconnects with the last
    event's id as Last-Event-ID while the app goes on writing: every line arrives exactly once."""
    clock = VirtualClock()
    script = AppScript(
        states=[(0, AppState.RUNNING), (100, AppState.SUCCEEDED)],
        logs=lines("sh", [f"line {i}" for i in range(1, 51)], start=0, every=1),
    )
    backend = ScriptedBackend("local_cwd", script, clock=clock)
    expected = [f"line {i}\n" for i in range(1, 51)]
    async with serve(backend) as client:
        with anyio.fail_after(30):
            resp = await client.post("/apps", json=sh("python", "train.py"))
            path = f"/apps/local_cwd/{(await resp.json())['app_id']}/logs"
            clock.advance(20.5)
            first = SSE(await client.get(path, params={"role": "sh"}))
            got = [(await first.next())[1] for _ in range(15)]
            first.response.close()  # the client goes away mid-stream
            clock.advance(10)  # the app writes on while no one reads
            assert first.last_id is not None
            again = SSE(
                await client.get(
                    path, params={"role": "sh"}, headers={"Last-Event-ID": first.last_id}
                )
            )
            assert (await again.next())[1] == "line 16\n"
            clock.advance(80)
            rest, end = await again.rest()
        assert [*got, "line 16\n", *rest] == expected
        assert end == {"state": "SUCCEEDED"}
        assert backend.calls["log_iter"] == 2


async def test_a_last_event_id_of_another_log_is_a_bad_request(serve: Serve) -> None:
    """A Last-Event-ID that is not a cursor, or one of another app's log, answers 400 naming it."""
    backend = ScriptedBackend("local_cwd", LOG)
    async with serve(backend) as client:
        ids = []
        for _ in range(2):
            resp = await client.post("/apps", json=sh("python", "train.py"))
            ids.append((await resp.json())["app_id"])
        other = SSE(await client.get(f"/apps/local_cwd/{ids[1]}/logs", params={"role": "sh"}))
        await other.next()
        assert other.last_id is not None
        other.response.close()
        for bad in ("garbage", other.last_id):
            resp = await client.get(
                f"/apps/local_cwd/{ids[0]}/logs",
                params={"role": "sh"},
                headers={"Last-Event-ID": bad},
            )
            assert resp.status == 400
            assert bad[:40] in (await resp.json())["error"]


class _NoCursorsBackend(ScriptedBackend):
    """A scripted backend whose scheduler cannot resume logs (as a third-party one may be)."""

    def __call__(self, session_name: str, **scheduler_params: Any) -> ScriptedScheduler:
        view = super().__call__(session_name, **scheduler_params)
        view.log_cursor_kind = None  # type: ignore[misc]
        return view


async def test_a_backend_without_cursors_streams_lines_without_ids(serve: Serve) -> None:
    """A backend without log cursors still streams every line (events without id:), and a
    Last-Event-ID for it answers 400 naming the backend."""
    clock = VirtualClock()
    async with serve(_NoCursorsBackend("local_cwd", LOG, clock=clock)) as client:
        resp = await client.post("/apps", json=sh("python", "train.py"))
        path = f"/apps/local_cwd/{(await resp.json())['app_id']}/logs"
        clock.advance(60)
        stream = SSE(await client.get(path, params={"role": "sh"}))
        lines_got, end = await stream.rest()
        assert lines_got == [f"step {i}\n" for i in range(1, 7)] and end == {"state": "SUCCEEDED"}
        assert stream.last_id is None
        resp = await client.get(path, params={"role": "sh"}, headers={"Last-Event-ID": "v1.x"})
        assert resp.status == 400 and "local_cwd" in (await resp.json())["error"]


async def test_delete_cancels_and_wait_reports_cancelled(serve: Serve) -> None:
    """DELETE cancels the scripted app; /wait then answers CANCELLED."""
    backend = ScriptedBackend("local_cwd")  # runs until cancelled
    async with serve(backend) as client:
        launched = await (await client.post("/apps", json=sh("sleep", "60"))).json()
        path = f"/apps/local_cwd/{launched['app_id']}"
        cancelled = await client.delete(path)
        assert await cancelled.json() == {"cancelled": launched["handle"]}
        final = await client.post(f"{path}/wait")
        assert (await final.json())["state"] == "CANCELLED"
        assert backend.app(launched["app_id"]).cancelled


async def test_bad_requests(serve: Serve) -> None:
    """Unknown apps and roles answer 404; unknown components, bad bodies and a missing role 400."""
    backend = ScriptedBackend("local_cwd")
    async with serve(backend) as client:
        assert (await client.get("/apps/local_cwd/no-such-app")).status == 404
        unknown = await client.post("/apps", json={"component": "utils.ehco"})
        assert unknown.status == 400 and "utils.ehco" in (await unknown.json())["error"]
        assert (await client.post("/apps", data=b"not json")).status == 400
        assert (await client.post("/apps", json={"component": 3})).status == 400
        assert (await client.post("/apps", json=[1])).status == 400
        other = await client.post("/apps", json={**sh("true"), "scheduler": "slurm"})
        assert other.status == 400 and "slurm" in (await other.json())["error"]
        launched = await (await client.post("/apps", json=sh("true"))).json()
        path = f"/apps/local_cwd/{launched['app_id']}"
        assert (await client.get(f"{path}/logs")).status == 400
        assert (await client.get(f"{path}/logs", params={"role": "nope"})).status == 404
        assert (
            await client.get(f"{path}/logs", params={"role": "sh", "replica": "x"})
        ).status == 400
    assert list(backend.apps) == [launched["app_id"]]


async def test_a_refused_submit_answers_502_and_launches_nothing(serve: Serve) -> None:
    """When the backend refuses a submission the service answers 502 with its reason."""
    backend = ScriptedBackend(
        "local_cwd",
        AppScript(states=[(0, AppState.SUCCEEDED)]),
        faults=[Fault("submit", 1, RuntimeError("sbatch: QOSMaxSubmitJobPerUserLimit"))],
    )
    async with serve(backend) as client:
        resp = await client.post("/apps", json=sh("true"))
        assert resp.status == 502
        assert "QOSMaxSubmitJobPerUserLimit" in (await resp.json())["error"]
        run = await client.post("/runs", json=sh("true"))  # the second submit is accepted
        assert run.status == 200
        assert await SSE(run).rest() == ([], {"state": "SUCCEEDED"})
    assert backend.calls["submit"] == 2 and len(backend.apps) == 1


async def test_an_attached_run_streams_until_the_app_ends(serve: Serve) -> None:
    """POST /runs launches, streams the log until the app ends, and answers its final state."""
    clock = VirtualClock()
    backend = ScriptedBackend("local_cwd", LOG, clock=clock)
    async with serve(backend) as client:
        task = asyncio.create_task(client.post("/runs", json=sh("python", "train.py")))
        [app] = await backend.wait_for_submissions(1)
        clock.advance(60)
        stream = SSE(await task)
        assert await stream.rest() == ([f"step {i}\n" for i in range(1, 7)], {"state": "SUCCEEDED"})
        assert app.state == AppState.SUCCEEDED and not app.cancelled


async def test_a_client_that_disconnects_has_its_attached_run_cancelled(serve: Serve) -> None:
    """A client that goes away mid-stream of POST /runs gets its app cancelled (runner.launched)."""
    clock = VirtualClock()
    backend = ScriptedBackend("local_cwd", LOG, clock=clock)
    async with serve(backend) as client:
        task = asyncio.create_task(client.post("/runs", json=sh("python", "train.py")))
        [app] = await backend.wait_for_submissions(1)
        stream = SSE(await task)
        assert await stream.next() == ("message", "step 1\n")
        assert app.state == AppState.RUNNING
        stream.response.close()  # the client disconnects
        with anyio.fail_after(10):
            while not (app.cancelled and app.state == AppState.CANCELLED):
                await asyncio.sleep(0.01)


async def test_an_attached_run_of_an_unknown_role_cancels_its_app(serve: Serve) -> None:
    """POST /runs naming a role the app lacks answers 404, and the app it launched is cancelled."""
    backend = ScriptedBackend("local_cwd")
    async with serve(backend) as client:
        resp = await client.post("/runs", json={**sh("true"), "role": "trainer"})
        assert resp.status == 404 and "trainer" in (await resp.json())["error"]
    [app] = backend.apps.values()
    assert app.cancelled and app.state == AppState.CANCELLED


async def test_the_service_honours_the_submit_limit(serve: Serve) -> None:
    """With limits, 30 concurrent launches through the service never have more than 2 submits in flight."""
    backend = ScriptedBackend("local_cwd", submit_latency=0.005)
    async with serve(backend, limits={"local_cwd": Limits(max_concurrent_submits=2)}) as client:
        with anyio.fail_after(30):
            responses = await asyncio.gather(
                *(client.post("/apps", json=sh("echo", str(i))) for i in range(30))
            )
        assert [r.status for r in responses] == [201] * 30
    assert backend.max_in_flight_submits == 2 and len(backend.apps) == 30
