"""What the README and the examples say, checked where the fourteenth session's review found the
code elsewhere: the example service's answers for an unknown scheduler, limits given as strings,
a retried replica's unterminated line, and the sweep examples' argument checks."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asynctorchx import AsyncRunner
from asynctorchx.runner import Limits
from asynctorchx.schedulers.api import Stream
from asynctorchx.specs import AppDef, AppState, RetryPolicy, Role

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(autouse=True)
def local_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "state"
    monkeypatch.setenv("ASYNCTORCHX_LOCAL_ROOT", str(root))
    return root


def _service_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("example_service_review", EXAMPLES / "service.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "method,path",
    [
        ("GET", "/apps/nosuch/abc"),
        ("POST", "/apps/nosuch/abc/wait"),
        ("DELETE", "/apps/nosuch/abc"),
    ],
)
async def test_the_service_answers_404_for_an_app_of_an_unknown_scheduler(
    method: str, path: str
) -> None:
    """service.py: "GET /apps/{scheduler}/{app_id} answers the app's status (404 when unknown)";
    status, wait and cancel of an unknown scheduler answered 500 (a traceback in the server)."""
    from aiohttp.test_utils import TestClient, TestServer

    service = _service_module()
    async with TestClient(TestServer(service.make_app())) as client:
        resp = await client.request(method, path)
        assert resp.status == 404, (resp.status, await resp.text())
        assert "nosuch" in (await resp.json())["error"]


def test_a_limit_given_as_a_string_in_limits_is_read_as_a_number() -> None:
    """Limits(max_concurrent_submits="8") was accepted and kept as a string: the runner then
    failed with "'<' not supported between 'str' and 'int'"."""
    limits = Limits(max_concurrent_submits="8", max_calls_per_second="2.5")  # type: ignore[arg-type]
    assert limits.max_concurrent_submits == 8 and limits.max_calls_per_second == 2.5
    AsyncRunner(limits={"slurm": limits})


def test_a_bad_limit_names_the_field_and_the_backend_when_given_as_a_mapping() -> None:
    with pytest.raises(ValueError, match=r"max_concurrent_submits.*got 0"):
        Limits(max_concurrent_submits=0)
    with pytest.raises(ValueError, match=r"'slurm'.*max_calls_per_second"):
        AsyncRunner(limits={"slurm": {"max_calls_per_second": "nan"}})


@pytest.mark.timeout(60)
async def test_a_retried_replicas_unterminated_line_ends_in_combined_and_joins_in_its_stream(
    tmp_path: Path,
) -> None:
    """README (log_lines): the restart's output starts a line of its own in combined.log; in the
    replica's stream the unterminated last line is joined to the next attempt's first."""
    marker = tmp_path / "tried"
    script = (
        f"if [ -e {marker} ]; then echo second; else touch {marker}; printf partial; exit 1; fi"
    )
    role = Role(
        "w",
        image=str(tmp_path),
        entrypoint="sh",
        args=["-c", script],
        max_retries=1,
        retry_policy=RetryPolicy.REPLICA,
    )
    async with AsyncRunner(name="docs") as runner:
        handle = await runner.run(AppDef("retry", [role]), "local_cwd")
        status = await runner.wait(handle, timeout=30)
        assert status is not None and status.state == AppState.SUCCEEDED
        combined = [line async for line in runner.log_lines(handle, "w")]
        stdout = [line async for line in runner.log_lines(handle, "w", streams=Stream.STDOUT)]
    assert combined == ["partial\n", "second\n"]
    assert stdout == ["partialsecond\n"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("example", ["sweep.py", "optuna_sweep.py"])
@pytest.mark.parametrize("arg", [["--concurrency", "0"], ["--trials", "-1"], ["--epochs", "0"]])
def test_the_sweep_examples_refuse_a_count_below_one(example: str, arg: list[str]) -> None:
    """sweep.py --concurrency 0 never launched a trial and never ended."""
    if example == "optuna_sweep.py":
        pytest.importorskip("optuna")
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / example), *arg],
        capture_output=True,
        text=True,
        timeout=50,
        cwd=EXAMPLES,
        env=dict(os.environ),
        check=False,
    )
    assert done.returncode == 2, done
    assert "must be at least 1" in done.stderr
