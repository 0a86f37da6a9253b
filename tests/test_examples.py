"""The examples run as their docstrings say: the sweep driver, the web service and multi_launch."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient, TestServer

from asynctorchx.tracker.backend.fsspec import FsspecTracker

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


@pytest.fixture
def local_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private state root for the local backend, for in-process and subprocess runners alike."""
    root = tmp_path / "state"
    monkeypatch.setenv("ASYNCTORCHX_LOCAL_ROOT", str(root))
    return root


def run_example(script: str, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=dict(os.environ),
        check=False,
    )


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- sweep -----------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sweep_runs_every_trial_within_the_concurrency_limit(
    local_root: Path, tmp_path: Path
) -> None:
    """sweep.py --json finishes all trials, never runs more than --concurrency at once, stops the worst."""
    trials, concurrency = 12, 3
    runs = tmp_path / "runs"
    proc = run_example(
        "sweep.py",
        "--trials",
        str(trials),
        "--concurrency",
        str(concurrency),
        "--tracker-root",
        str(runs),
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["trials"] == trials
    states = summary["states"]
    assert len(states) == trials
    assert all(s in ("SUCCEEDED", "CANCELLED") for s in states.values()), states
    assert summary["succeeded"] == sum(s == "SUCCEEDED" for s in states.values())
    assert summary["stopped_early"] == sum(s == "CANCELLED" for s in states.values())
    assert summary["stopped_early"] >= 1
    assert 1 <= summary["max_running"] <= concurrency
    assert 1 <= summary["max_overlap"] <= concurrency
    losses = [row["loss"] for row in summary["best"]]
    assert losses == sorted(losses) and len(losses) == min(5, summary["succeeded"])
    # the metrics came through the tracker: every trial is a child of the driver's run
    tracker = FsspecTracker(None, runs)
    assert tracker.run_ids(parent_run_id=summary["driver_run_id"]) == sorted(states)
    finals = sorted(
        float(tracker.metadata(h)["final_loss"])  # type: ignore[arg-type]
        for h, s in states.items()
        if s == "SUCCEEDED"
    )
    assert losses == finals[: len(losses)]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_optuna_study_finds_its_best_trial_through_the_tracker(
    local_root: Path, tmp_path: Path
) -> None:
    """optuna_sweep.py runs a small study by ask/tell; its best trial is the lowest loss recorded."""
    runs = tmp_path / "runs"
    proc = run_example(
        "optuna_sweep.py",
        "--trials",
        "8",
        "--concurrency",
        "3",
        "--epochs",
        "4",
        "--tracker-root",
        str(runs),
        "--json",
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["trials"] == 8
    assert sum(summary["states"].values()) == 8
    assert summary["states"]["COMPLETE"] >= 1
    assert 1 <= summary["max_running"] <= 3
    best = summary["best"]
    assert best["value"] == min(summary["completed_values"])
    assert 1e-3 <= best["params"]["lr"] <= 0.3 and 0.0 <= best["params"]["momentum"] <= 0.95
    assert best["value"] < 1.0, "the toy problem starts at loss 16; the best trial must have learnt"
    tracker = FsspecTracker(None, runs)
    children = tracker.run_ids(parent_run_id=summary["driver_run_id"])
    assert sorted(children) == sorted(summary["handles"])
    [best_handle] = [h for h, n in summary["handles"].items() if n == best["number"]]
    assert tracker.metadata(best_handle)["final_loss"] == best["value"]


# -- multi_launch ----------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_multi_launch_succeeds_and_prefixes_every_line(local_root: Path) -> None:
    """multi_launch.py exits 0 when all apps succeed and prints each replica's lines with its prefix."""
    proc = run_example("multi_launch.py")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert "echo/echo/0: hello from echo" in out
    assert "sh/sh/0: hello from sh" in out
    for k in (0, 1):
        assert [ln for ln in out if ln.startswith(f"tpr/trainer/{k}: ")] == [
            f"tpr/trainer/{k}: trainer {k} step {i}" for i in (1, 2, 3)
        ]
        assert f"tpr/reader/{k}: reader {k} read shard {k}" in out
    assert [ln for ln in out if ln.startswith("tpr/ps/0: ")] == [
        f"tpr/ps/0: ps serving step {i}" for i in (1, 2, 3)
    ]


@pytest.mark.timeout(120)
def test_multi_launch_exits_with_the_worst_state(local_root: Path) -> None:
    """multi_launch.py --fail exits 1 (FAILED is the worst state) and reports which app failed."""
    proc = run_example("multi_launch.py", "--fail")
    assert proc.returncode == 1, proc.stderr
    assert "tpr: FAILED" in proc.stderr
    assert "echo: SUCCEEDED" in proc.stderr


# -- service ---------------------------------------------------------------------------------------


async def read_sse(response: ClientResponse) -> tuple[list[str], dict[str, Any] | None]:
    """The ``data`` payloads of a Server-Sent Events stream, and the payload of its ``end`` event."""
    lines: list[str] = []
    end: dict[str, Any] | None = None
    event, data = "message", ""
    async for raw in response.content:
        text = raw.decode().rstrip("\n")
        if text.startswith("event: "):
            event = text[len("event: ") :]
        elif text.startswith("data: "):
            data = text[len("data: ") :]
        elif text == "":
            if event == "end":
                end = json.loads(data)
            else:
                lines.append(json.loads(data))
            event, data = "message", ""
    return lines, end


@pytest.fixture
async def service(local_root: Path) -> Any:
    app = load_example("service").make_app("svc-test")
    async with TestServer(app, host="127.0.0.1", port=0) as server, TestClient(server) as client:
        yield client


@pytest.mark.timeout(120)
async def test_service_20_clients_launch_and_stream_without_losing_lines(
    service: TestClient,
) -> None:
    """20 concurrent clients each launch utils.sh and stream its log: every line once, in order."""
    n_lines = 100

    async def client(c: int) -> None:
        script = f"for i in $(seq 1 {n_lines}); do echo client-{c}-line-$i; sleep 0.005; done"
        resp = await service.post(
            "/apps", json={"component": "utils.sh", "args": ["sh", "-c", script]}
        )
        assert resp.status == 201, await resp.text()
        launched = await resp.json()
        assert launched["handle"].startswith("local_cwd://svc-test/")
        path = f"/apps/{launched['scheduler']}/{launched['app_id']}"
        stream = await service.get(f"{path}/logs", params={"role": "sh"})
        assert stream.status == 200
        assert stream.headers["Content-Type"].startswith("text/event-stream")
        lines, end = await read_sse(stream)
        assert lines == [f"client-{c}-line-{i}\n" for i in range(1, n_lines + 1)]
        assert end == {"state": "SUCCEEDED"}
        status = await service.get(path)
        assert status.status == 200
        assert (await status.json())["state"] == "SUCCEEDED"

    await asyncio.gather(*(client(c) for c in range(20)))


async def test_service_status_wait_and_cancel(service: TestClient) -> None:
    """The status endpoint reports RUNNING, DELETE cancels, and /wait then answers CANCELLED."""
    resp = await service.post("/apps", json={"component": "utils.sh", "args": ["sleep", "60"]})
    assert resp.status == 201
    launched = await resp.json()
    path = f"/apps/{launched['scheduler']}/{launched['app_id']}"
    status = await service.get(path)
    assert status.status == 200 and (await status.json())["state"] == "RUNNING"
    cancelled = await service.delete(path)
    assert cancelled.status == 200
    assert (await cancelled.json()) == {"cancelled": launched["handle"]}
    final = await service.post(f"{path}/wait")
    assert final.status == 200 and (await final.json())["state"] == "CANCELLED"


async def test_service_bad_requests(service: TestClient) -> None:
    """Unknown apps answer 404, unknown components and malformed bodies 400, a missing role 400."""
    assert (await service.get("/apps/local_cwd/no-such-app")).status == 404
    unknown = await service.post("/apps", json={"component": "utils.ehco"})
    assert unknown.status == 400
    assert "utils.ehco" in (await unknown.json())["error"]
    assert (await service.post("/apps", data=b"not json")).status == 400
    resp = await service.post("/apps", json={"component": "utils.echo", "args": ["--msg", "x"]})
    launched = await resp.json()
    path = f"/apps/{launched['scheduler']}/{launched['app_id']}"
    assert (await service.get(f"{path}/logs")).status == 400
    assert (await service.get(f"{path}/logs", params={"role": "nope"})).status == 404
    assert (
        await service.get("/apps/local_cwd/no-such-app/logs", params={"role": "x"})
    ).status == 404


# -- the README's first command --------------------------------------------------------------------


def test_readme_demo_runs_a_two_replica_job(local_root: Path) -> None:
    """``scripts/demo.sh`` (the README's first command, install skipped) runs both replicas to success."""
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "demo.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "ASYNCTORCHX_DEMO_NO_INSTALL": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    handle = done.stdout.strip()
    assert handle.startswith("local_cwd://")
    for k in (0, 1):
        assert f"sh/{k} | hello from replica {k} of {handle}\n" in done.stderr
        assert f"sh/{k} | replica {k} done\n" in done.stderr
    assert f"{handle} SUCCEEDED" in done.stderr


def test_readme_quickstart_runs(local_root: Path, tmp_path: Path) -> None:
    """The README's Quickstart code block, run as a script, follows replica 1 and ends SUCCEEDED."""
    readme = (ROOT / "README.md").read_text()
    code = readme.split("## Quickstart", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "quickstart.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=dict(os.environ),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "worker/1: hi from 1" in lines
    assert sum(line.endswith(" SUCCEEDED") for line in lines) == 2, lines
