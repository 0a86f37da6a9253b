"""A real distributed job: dist.ddp -j 2x2 on local_cwd, 2 nodes x 2 gloo workers all-reducing."""

from __future__ import annotations

import importlib.util
import re
import uuid
from pathlib import Path

import pytest
from conftest import engine_missing

from asynctorchx import AsyncRunner
from asynctorchx.schedulers.api import Stream
from asynctorchx.specs import AppState

REPO = Path(__file__).resolve().parents[1]
WORLD_SIZE = 4
RANK_LINE = re.compile(
    r"rank (\d+)/(\d+) \(node \d+, local rank \d\): all_reduce sum = (\S+), expected (\S+)"
)


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.timeout(180)
async def test_ddp_2x2_succeeds_on_local_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """run_component("dist.ddp", -j 2x2 --script examples/ddp/train.py) on local_cwd, awaited with
    runner.wait, runs 2 torchrun nodes x 2 gloo workers that all-reduce to the right sum and succeed;
    each node's log, read through the runner, shows its two ranks."""
    if importlib.util.find_spec("torch") is None:
        engine_missing("torch (pip install torch==2.13.0, or the [torch] extra)")
    monkeypatch.chdir(REPO)
    root = tmp_path / "local"
    async with AsyncRunner(name=f"ddp-{uuid.uuid4().hex[:8]}", local_root=str(root)) as runner:
        handle = await runner.run_component(
            "dist.ddp", ["-j", "2x2", "--script", "examples/ddp/train.py"], scheduler="local_cwd"
        )
        final = await runner.wait(handle, timeout=150)  # closing the runner stops it on timeout
        assert final is not None
        (role,) = [r.role for r in final.roles]
        assert len(final.roles[0].replicas) == 2
        logs: dict[int, list[str]] = {}
        for k in range(2):
            logs[k] = [line async for line in runner.log_lines(handle, role, k)]
        assert final.state == AppState.SUCCEEDED, (final, logs)
        for k in range(2):
            out = [ln async for ln in runner.log_lines(handle, role, k, streams=Stream.STDOUT)]
            assert sum(bool(RANK_LINE.search(ln)) for ln in out) == 2, (k, out)
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
