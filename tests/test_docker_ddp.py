# ruff: noqa: F811 - the fixtures imported from _docker_env are redefined as test parameters
"""A real multi-container DDP job on local_docker: dist.ddp -j 2x1 in the locally built torch image."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _docker_env import (  # noqa: F401 - pytest fixtures
    collect,
    docker_engine,
    docker_scheduler,
    docker_session,
    torch_image,
    wait_for,
)

from asynctorchx.components.dist import ddp
from asynctorchx.schedulers.docker import DockerScheduler
from asynctorchx.specs import AppState

REPO = Path(__file__).resolve().parents[1]
RANK_LINE = re.compile(r"rank (\d)/2 \(node \d, local rank 0\): all_reduce sum = 3, expected 3")


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.timeout(240)
async def test_ddp_2x1_across_two_containers_succeeds(
    docker_scheduler: DockerScheduler, torch_image: str
) -> None:
    """dist.ddp -j 2x1 runs one torchrun node per container; they rendezvous (c10d) on rank 0's
    hostname over the app's network, all-reduce with gloo to the right sum, and succeed."""
    app = ddp(
        script="train.py",
        image=torch_image,
        j="2x1",
        cpu=1,
        memMB=2048,
        mounts=[f"type=bind,src={REPO / 'examples' / 'ddp'},dst=/workspace,readonly"],
    )
    role = app.roles[0].name
    app_id = await docker_scheduler.submit(app, {"stop_timeout": 2})
    resp = await wait_for(docker_scheduler, app_id, timeout=200)
    logs = {k: await collect(docker_scheduler.log_iter(app_id, role, k)) for k in (0, 1)}
    assert resp.state == AppState.SUCCEEDED, (resp, logs)
    ranks = sorted(
        int(m.group(1))
        for lines in logs.values()
        for line in lines
        if (m := RANK_LINE.search(line))
    )
    assert ranks == [0, 1], logs
    assert [r.hostname for r in resp.roles_statuses[0].replicas] == [
        f"{app_id}-{role}-0",
        f"{app_id}-{role}-1",
    ]
