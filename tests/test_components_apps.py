"""The builtins TorchX runs ``torchx.apps`` for (utils.booth, serve.torchserve, metrics.tensorboard):
their AppDefs, their programs (asynctorchx.apps), and real runs on local_cwd."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.parse
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anyio
import pytest

from asynctorchx import AsyncRunner
from asynctorchx.apps import booth, process_monitor, source
from asynctorchx.components import IMAGE, get_component
from asynctorchx.specs import AppDef, AppState, Resource
from asynctorchx.specs.builders import materialize_appdef

LOCAL = "local_cwd"


def build(name: str, *args: str) -> AppDef:
    return materialize_appdef(get_component(name).fn, list(args), name=name)


@pytest.fixture
def bin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory first on PATH whose ``python`` is this interpreter (replicas run ``python``)."""
    d = tmp_path / "bin"
    d.mkdir()
    (d / "python").symlink_to(sys.executable)
    monkeypatch.setenv("PATH", f"{d}{os.pathsep}{os.environ['PATH']}")
    return d


@pytest.fixture
async def runner(tmp_path: Path, bin_dir: Path) -> AsyncIterator[AsyncRunner]:
    async with AsyncRunner(
        name=f"apps-{uuid.uuid4().hex[:8]}", local_root=str(tmp_path / "state")
    ) as r:
        yield r


async def log_of(runner: AsyncRunner, handle: str, role: str) -> str:
    return "".join([line async for line in runner.log_lines(handle, role)])


# -- the AppDefs ---------------------------------------------------------------------------------


def test_booth_appdef_has_torchx_arguments() -> None:
    """utils.booth takes TorchX's x1, x2, trial_idx, tracker_base, image; runs the booth program."""
    app = build("utils.booth", "--x1", "1.5", "--x2", "-2", "--trial_idx", "7")
    role = app.roles[0]
    assert (app.name, role.name, role.image, role.entrypoint) == (
        "torchx-utils-booth",
        "torchx-utils-booth",
        IMAGE,
        "python",
    )
    assert role.args == [
        "-c",
        source("booth"),
        "--x1",
        "1.5",
        "--x2",
        "-2.0",
        "--trial_idx",
        "7",
        "--tracker_base",
        "/tmp/torchx-util-booth",
    ]
    assert role.resource == Resource(cpu=1, gpu=0, memMB=1024)


def test_torchserve_appdef_has_torchx_arguments() -> None:
    """serve.torchserve passes model_path, management_api, each param and --dryrun; port 8222."""
    app = build(
        "serve.torchserve",
        "--model_path",
        "s3://b/m.mar",
        "--management_api",
        "http://ts:8081",
        "--params",
        "model_name=resnet,initial_workers=2",
        "--dryrun",
    )
    role = app.roles[0]
    assert (app.name, role.name, role.port_map) == (
        "torchx-torchserve",
        "worker",
        {"model-download": 8222},
    )
    assert role.args[:2] == ["-c", source("serve")]
    assert role.args[2:] == [
        "--model_path",
        "s3://b/m.mar",
        "--management_api",
        "http://ts:8081",
        "--model_name",
        "resnet",
        "--initial_workers",
        "2",
        "--dryrun",
    ]


def test_tensorboard_appdef_has_torchx_arguments() -> None:
    """metrics.tensorboard monitors `tensorboard --bind_all --port P --logdir L` with the files."""
    app = build("metrics.tensorboard", "--logdir", "/logs", "--port", "7007", "--timeout", "30")
    role = app.roles[0]
    assert (app.name, role.name, role.port_map) == ("tensorboard", "tensorboard", {"http": 7007})
    assert role.args[:2] == ["-c", source("process_monitor")]
    assert role.args[2:] == [
        "--timeout",
        "30.0",
        "--start_on_file",
        "",
        "--exit_on_file",
        "",
        "--",
        "tensorboard",
        "--bind_all",
        "--port",
        "7007",
        "--logdir",
        "/logs",
    ]


@pytest.mark.parametrize("name", ["booth", "serve", "process_monitor"])
def test_app_programs_need_only_the_standard_library(name: str, tmp_path: Path) -> None:
    """Each app program runs with `python -I -c SOURCE --help` where asynctorchx is not importable."""
    done = subprocess.run(
        [sys.executable, "-I", "-c", source(name), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


# -- utils.booth ---------------------------------------------------------------------------------


def test_booth_program_records_like_torchx(tmp_path: Path) -> None:
    """The booth program writes {"booth_eval": f} to tracker_base/trial_idx, as TorchX's tracker."""
    from _torchx_env import json_from_torchx

    assert (
        booth.main(["--x1", "2", "--x2", "1", "--trial_idx", "3", "--tracker_base", str(tmp_path)])
        == 0
    )
    expected = booth.booth(2, 1)
    assert json.loads((tmp_path / "3").read_text()) == {"booth_eval": expected}
    read_back = json_from_torchx(
        "import json\n"
        "from torchx.runtime.tracking import FsspecResultTracker\n"
        f"print(json.dumps(FsspecResultTracker({str(tmp_path)!r})[3]))\n"
    )
    assert read_back == {"booth_eval": expected}


async def test_booth_runs_on_local_cwd(runner: AsyncRunner, tmp_path: Path) -> None:
    """utils.booth runs on local_cwd and leaves its result in the tracker directory."""
    base = tmp_path / "tracker"
    handle = await runner.run_component(
        "utils.booth",
        ["--x1", "1", "--x2", "3", "--trial_idx", "0", "--tracker_base", f"file://{base}"],
        LOCAL,
    )
    with anyio.fail_after(30):
        status = await runner.wait(handle)
    assert status is not None and status.state == AppState.SUCCEEDED, status
    assert json.loads((base / "0").read_text()) == {"booth_eval": 0.0}


# -- serve.torchserve ----------------------------------------------------------------------------


class FakeTorchServe:
    """A TorchServe management API on 127.0.0.1 that downloads what it is asked to register."""

    def __init__(self, status: int = 200) -> None:
        self.registered: list[dict[str, Any]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                url = urllib.parse.urlparse(self.path)
                query = dict(urllib.parse.parse_qsl(url.query))
                if url.path != "/models" or "url" not in query:
                    self.send_error(404)
                    return
                with urllib.request.urlopen(query["url"], timeout=30) as r:
                    model = r.read()
                fake.registered.append({"query": query, "model": model})
                body = json.dumps(
                    {"status": f"Model {query.get('model_name', 'model')} registered"}
                    if status == 200
                    else {"code": status, "message": "workers failed to start"}
                ).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def torchserve() -> Iterator[FakeTorchServe]:
    fake = FakeTorchServe()
    yield fake
    fake.close()


async def test_torchserve_registers_the_model(
    runner: AsyncRunner, torchserve: FakeTorchServe, tmp_path: Path
) -> None:
    """serve.torchserve on local_cwd serves the archive; TorchServe gets it with the parameters."""
    model = tmp_path / "resnet.mar"
    model.write_bytes(os.urandom(200_000))
    handle = await runner.run_component(
        "serve.torchserve",
        [
            "--model_path",
            str(model),
            "--management_api",
            torchserve.url,
            "--params",
            "model_name=resnet,initial_workers=2,port=0",
        ],
        LOCAL,
    )
    with anyio.fail_after(30):
        status = await runner.wait(handle)
    assert status is not None and status.state == AppState.SUCCEEDED, await log_of(
        runner, handle, "worker"
    )
    [registration] = torchserve.registered
    assert registration["model"] == model.read_bytes()
    assert registration["query"]["model_name"] == "resnet"
    assert registration["query"]["initial_workers"] == "2"
    assert registration["query"]["url"].endswith(".mar")
    assert "Model resnet registered" in await log_of(runner, handle, "worker")


async def test_torchserve_failure_fails_the_app(runner: AsyncRunner, tmp_path: Path) -> None:
    """When TorchServe answers an error, the app fails and its log shows TorchServe's answer."""
    fake = FakeTorchServe(status=500)
    model = tmp_path / "m.mar"
    model.write_bytes(b"model")
    try:
        handle = await runner.run_component(
            "serve.torchserve",
            ["--model_path", str(model), "--management_api", fake.url, "--params", "port=0"],
            LOCAL,
        )
        with anyio.fail_after(30):
            status = await runner.wait(handle)
    finally:
        fake.close()
    assert status is not None and status.state == AppState.FAILED
    log = await log_of(runner, handle, "worker")
    assert "workers failed to start" in log and "500" in log


def test_torchserve_dryrun_registers_nothing() -> None:
    """--dryrun starts the program and registers nothing, as in TorchX."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            source("serve"),
            "--model_path",
            "/nonexistent.mar",
            "--management_api",
            "http://127.0.0.1:9",
            "--dryrun",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout.strip()) == (0, "App serve started successfully")


# -- metrics.tensorboard -------------------------------------------------------------------------

FAKE_TENSORBOARD = """#!/bin/sh
# stands in for tensorboard: records its arguments, then serves until SIGTERM
trap 'echo terminated >> "$TB_RECORD"; exit 0' TERM
echo "$@" > "$TB_RECORD"
while :; do sleep 0.05; done
"""


def test_monitor_returns_the_programs_exit_code() -> None:
    """A program that ends by itself gives the monitor its exit code."""
    assert process_monitor.main(["--poll_rate", "0.05", "--", "sh", "-c", "exit 3"]) == 3


def test_monitor_start_file_timeout(tmp_path: Path) -> None:
    """Without the start file before the timeout, the program never starts: exit 34."""
    marker = tmp_path / "started"
    code = process_monitor.main(
        [
            "--timeout",
            "0.3",
            "--poll_rate",
            "0.05",
            "--start_on_file",
            str(tmp_path / "never"),
            "--",
            "touch",
            str(marker),
        ]
    )
    assert code == process_monitor.TIMEOUT_EXIT_CODE
    assert not marker.exists()


def test_monitor_starts_on_file_and_stops_on_timeout(tmp_path: Path) -> None:
    """The program starts once the start file exists and is stopped (SIGTERM) at the timeout."""
    start = tmp_path / "start"
    start.touch()
    record = tmp_path / "record"
    code = process_monitor.main(
        [
            "--timeout",
            "1",
            "--poll_rate",
            "0.05",
            "--start_on_file",
            f"file://{start}",
            "--",
            "sh",
            "-c",
            f"trap 'echo term > {record}; exit 0' TERM; while :; do sleep 0.05; done",
        ]
    )
    assert code == process_monitor.TIMEOUT_EXIT_CODE
    assert record.read_text().strip() == "term"


async def test_tensorboard_runs_until_exit_file(
    runner: AsyncRunner, bin_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """metrics.tensorboard on local_cwd starts tensorboard with TorchX's flags; exit_on_file stops it."""
    (bin_dir / "tensorboard").write_text(FAKE_TENSORBOARD)
    (bin_dir / "tensorboard").chmod(0o755)
    record = tmp_path / "tb-record"
    monkeypatch.setenv("TB_RECORD", str(record))
    done_file = tmp_path / "done"
    handle = await runner.run_component(
        "metrics.tensorboard",
        ["--logdir", str(tmp_path / "logs"), "--port", "7007", "--exit_on_file", str(done_file)],
        LOCAL,
    )
    with anyio.fail_after(30):
        while not record.exists():
            await anyio.sleep(0.05)
    assert record.read_text().split() == [
        "--bind_all",
        "--port",
        "7007",
        "--logdir",
        str(tmp_path / "logs"),
    ]
    status = await runner.status(handle)
    assert status is not None and status.state == AppState.RUNNING
    done_file.touch()
    with anyio.fail_after(30):
        status = await runner.wait(handle)
    assert status is not None and status.state == AppState.SUCCEEDED, await log_of(
        runner, handle, "tensorboard"
    )
    assert record.read_text().splitlines()[-1] == "terminated"
