"""A real distributed job: dist.ddp -j 2x2 on local_cwd, 2 nodes x 2 gloo workers all-reducing."""

from __future__ import annotations

import asyncio
import importlib.util
import re
import time
from pathlib import Path

import pytest
from conftest import engine_missing

from asynctorchx.components import get_component
from asynctorchx.schedulers import create_scheduler
from asynctorchx.schedulers.api import DescribeAppResponse, Scheduler
from asynctorchx.specs import AppState, is_terminal
from asynctorchx.specs.builders import materialize_appdef

REPO = Path(__file__).resolve().parents[1]
WORLD_SIZE = 4
RANK_LINE = re.compile(
    r"rank (\d+)/(\d+) \(node \d+, local rank \d\): all_reduce sum = (\S+), expected (\S+)"
)


async def _wait_terminal(scheduler: Scheduler, app_id: str, timeout: float) -> DescribeAppResponse:
    """Polls describe (bounded) until the app is in a terminal state."""
    deadline = time.monotonic() + timeout
    while True:
        resp = await scheduler.describe(app_id)
        assert resp is not None, f"the scheduler lost app {app_id}"
        if is_terminal(resp.state):
            return resp
        if time.monotonic() > deadline:
            raise TimeoutError(f"app {app_id} still {resp.state} after {timeout}s")
        await asyncio.sleep(0.25)


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.timeout(180)
async def test_ddp_2x2_succeeds_on_local_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """dist.ddp -j 2x2 --script examples/ddp/train.py runs 2 torchrun nodes x 2 gloo workers that
    all-reduce to the right sum and succeed; each node's log shows its two ranks."""
    if importlib.util.find_spec("torch") is None:
        engine_missing("torch (pip install torch==2.13.0, or the [torch] extra)")
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("ASYNCTORCHX_LOCAL_ROOT", str(tmp_path / "local"))
    app = materialize_appdef(
        get_component("dist.ddp").fn,
        ["-j", "2x2", "--script", "examples/ddp/train.py"],
        name="dist.ddp",
    )
    role = app.roles[0].name
    scheduler = create_scheduler("local_cwd", "test")
    app_id = None
    try:
        app_id = await scheduler.submit(app, {})
        resp = await _wait_terminal(scheduler, app_id, timeout=150)
        logs: dict[int, list[str]] = {}
        for k in range(2):
            logs[k] = [line async for line in scheduler.log_iter(app_id, role, k)]
        assert resp.state == AppState.SUCCEEDED, (resp, logs)
        ranks_by_node: dict[int, set[int]] = {}
        for k, lines in logs.items():
            for line in lines:
                m = RANK_LINE.search(line)
                if m:
                    rank, world, total, expected = m.groups()
                    assert (int(world), float(total), float(expected)) == (WORLD_SIZE, 10.0, 10.0)
                    ranks_by_node.setdefault(k, set()).add(int(rank))
            assert sum("replicas in sync = True" in line for line in lines) == 2, lines
        assert [len(ranks_by_node.get(k, ())) for k in range(2)] == [2, 2], logs
        assert set().union(*ranks_by_node.values()) == set(range(WORLD_SIZE))
    finally:
        if app_id is not None:
            resp_now = await scheduler.describe(app_id)
            if resp_now is not None and not is_terminal(resp_now.state):
                await scheduler.cancel(app_id)
        await scheduler.close()
