# ruff: noqa: F811 - the fixtures imported from _docker_env and _slurm_env are redefined as test parameters
"""Submits cancelled while their workspace is shipped leave nothing behind.

- Slurm: a submit cancelled just as its worker thread copied the last file into ``job_dir`` (past
  the thread's last check for the cancellation) removes the copy and the claim before it returns,
  so the next submit into that ``job_dir`` is accepted (README: "a cancelled Slurm submit leaves no
  job_dir copy").
- Images (``local_docker``, ``kubernetes``): a build runs as a ``SingleFlight`` job shared by every
  submit of the same workspace. When the last submit waiting for it is cancelled the build is
  stopped (the engine kills the running step and tags nothing); while another submit still waits
  it goes on for that one; and a later submit starts a build of its own instead of inheriting the
  stopped one's cancellation.

The Docker and Slurm tests use the real engines (they fail rather than skip when
``ASYNCTORCHX_REQUIRE_ENGINES=1`` and the engine is missing) and remove only what they made.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiodocker
import pytest
from _docker_env import docker_engine, docker_scheduler, docker_session, python_image  # noqa: F401
from _slurm_env import (  # noqa: F401 - pytest fixtures
    CountingRunner,
    sh_app,
    slurm,
    slurm_cluster,
    slurm_runner,
    slurm_session,
    wait_for_state,
)
from _workspace_env import make_workspace

from asynctorchx._tasks import TaskSupervisor
from asynctorchx.runner import AsyncRunner
from asynctorchx.schedulers import workspace as workspace_mod
from asynctorchx.schedulers._slurm import workspace as slurm_ws
from asynctorchx.schedulers.docker import DockerScheduler
from asynctorchx.schedulers.slurm import SlurmScheduler
from asynctorchx.schedulers.workspace import SingleFlight, WorkspaceEvent
from asynctorchx.specs import AppDef, AppState, Role

pytestmark = [pytest.mark.timeout(180)]

_RUNNING_IN = re.compile(r"Running in ([0-9a-f]{12,64})")


# -- Slurm: the job_dir copy ------------------------------------------------------------------------


@pytest.mark.slurm
async def test_a_slurm_submit_cancelled_as_its_copy_completes_leaves_no_job_dir(
    slurm: SlurmScheduler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submit whose copy thread copied the last file (past its last check) when the submit was
    cancelled returns only once the thread has ended, having removed the whole job_dir (copy,
    claim file, directories); the next submit into that job_dir is accepted and runs."""
    ws = make_workspace(tmp_path / "ws", {"train.py": "print(1)\n", "lib/a.py": "x = 1\n"})
    job_dir = tmp_path / "runs" / "job-1"
    cfg = {"job_dir": str(job_dir)}
    app = sh_app("cat lib/a.py", "wsc")
    dryrun = await slurm.submit_dryrun_async(app, cfg, workspace=str(ws))

    copied = threading.Event()
    thread_ended = threading.Event()
    real_copy = slurm_ws.copy_scan

    def copy_then_wait_for_the_cancellation(*args: Any, **kwargs: Any) -> Any:
        # every file is copied and no check for the cancellation is left: the thread returns
        # normally, once the caller's cancellation has reached it (it sets the thread's stop event)
        try:
            result = real_copy(*args, **kwargs)
            stop = workspace_mod._stop.get()
            assert stop is not None
            copied.set()
            assert stop.wait(60), "the cancellation never reached the copy thread"
            return result
        finally:
            thread_ended.set()

    monkeypatch.setattr(slurm_ws, "copy_scan", copy_then_wait_for_the_cancellation)
    task = asyncio.ensure_future(slurm.schedule(dryrun))
    assert await asyncio.to_thread(copied.wait, 60), "the copy never finished"
    assert (job_dir / "lib" / "a.py").exists()  # the copy is complete when the cancel comes
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    returned_after_the_thread = thread_ended.is_set()
    assert await asyncio.to_thread(thread_ended.wait, 60), "the copy thread never ended"
    left = sorted(p.name for p in job_dir.iterdir()) if job_dir.exists() else None
    assert left is None, f"the cancelled submit left job_dir with {left}"
    assert returned_after_the_thread, "the cancelled submit returned before its copy thread ended"

    monkeypatch.setattr(slurm_ws, "copy_scan", real_copy)
    app_id = await slurm.schedule(await slurm.submit_dryrun_async(app, cfg, workspace=str(ws)))
    resp = await wait_for_state(slurm, app_id)
    assert resp.state == AppState.SUCCEEDED, resp.msg


# -- images: a shared build -------------------------------------------------------------------------


@pytest.fixture
async def runner(
    docker_scheduler: DockerScheduler, docker_session: str
) -> AsyncIterator[AsyncRunner]:
    """A runner on that scheduler."""
    factories = {"local_docker": lambda session, **_: docker_scheduler}
    async with AsyncRunner(name=docker_session, scheduler_factories=factories) as r:
        yield r


class StepWatch:
    """A progress callback noting the id of the container the build runs its RUN step in."""

    def __init__(self) -> None:
        self.container: str | None = None
        self.running = asyncio.Event()
        self.events: list[WorkspaceEvent] = []

    def __call__(self, event: WorkspaceEvent) -> None:
        self.events.append(event)
        found = _RUNNING_IN.search(event.message) if event.stage == "build" else None
        if found and self.container is None:
            self.container = found.group(1)
            self.running.set()


async def exit_code_of(container: str, since: float) -> int:
    """The exit code of ``container``'s death, from the engine's events since ``since`` (which
    replays the ones that came before the call, so no death can be missed)."""
    filters = {"container": [container], "event": ["die"]}
    async with aiodocker.Docker() as client:
        events = client.events.subscribe(since=f"{since:.0f}", filters=json.dumps(filters))
        try:
            event = await events.get()
        finally:
            await client.events.stop()
    if event is not None:
        return int(event["Actor"]["Attributes"]["exitCode"])
    raise AssertionError(f"the engine's event stream ended before {container} died")


@pytest.mark.docker
async def test_cancelling_the_only_submit_during_its_build_stops_the_build_and_tags_nothing(
    tmp_path: Path, runner: AsyncRunner, docker_scheduler: DockerScheduler, python_image: str
) -> None:
    """When the only submit waiting for a workspace build is cancelled, the build is stopped: the
    engine kills the step it was running (instead of letting it end normally) and tags nothing,
    and the build is no longer in flight."""
    ws = make_workspace(
        tmp_path / "ws",
        {"Dockerfile.torchx": "ARG IMAGE\nFROM $IMAGE\nRUN sleep 30\nCOPY . .\n", "a.py": "1\n"},
    )
    app = AppDef("c", [Role("trainer", image=python_image, entrypoint="true")])
    tag = runner.dryrun(app, "local_docker", workspace=str(ws)).workspace.target
    since = time.time() - 1
    watch = StepWatch()
    try:
        task = asyncio.ensure_future(
            runner.run(app, "local_docker", workspace=str(ws), progress=watch)
        )
        await asyncio.wait_for(watch.running.wait(), 60)
        assert watch.container is not None
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        code = await asyncio.wait_for(exit_code_of(watch.container, since), 60)
        assert code != 0, "the build's RUN step ran to its end after every submit was cancelled"
        # a step that did not succeed fails the build: the engine never tags it
        assert await docker_scheduler.engine.image_id(tag) is None
        assert not docker_scheduler._flights.in_flight(("build", tag))
    finally:
        await docker_scheduler.engine.remove_image(tag, force=True)


@pytest.mark.docker
async def test_a_shared_build_goes_on_for_the_other_submit_when_one_is_cancelled(
    tmp_path: Path, runner: AsyncRunner, docker_scheduler: DockerScheduler, python_image: str
) -> None:
    """Two submits of one workspace share one build; cancelling one of them during the build
    leaves the build running for the other, which gets the image and launches its app."""
    ws = make_workspace(
        tmp_path / "ws",
        {"Dockerfile.torchx": "ARG IMAGE\nFROM $IMAGE\nRUN sleep 3\nCOPY . .\n", "a.py": "1\n"},
    )
    app = AppDef("c", [Role("trainer", image=python_image, entrypoint="true")])
    tag = runner.dryrun(app, "local_docker", workspace=str(ws)).workspace.target
    first, second = StepWatch(), StepWatch()
    try:
        cancelled = asyncio.ensure_future(
            runner.run(app, "local_docker", workspace=str(ws), progress=first)
        )
        kept = asyncio.ensure_future(
            runner.run(app, "local_docker", workspace=str(ws), progress=second)
        )
        # both hear the RUN step start: both are waiting for the one build
        await asyncio.wait_for(asyncio.gather(first.running.wait(), second.running.wait()), 60)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert not kept.done()
        assert docker_scheduler._flights.in_flight(("build", tag)), "the shared build was stopped"
        handle = await asyncio.wait_for(kept, 120)
        assert docker_scheduler.engine.builds == 1
        assert await docker_scheduler.engine.image_id(tag) is not None
        assert second.events[-1].final and second.events[-1].stage == "build"
        status = await runner.wait(handle, timeout=60)
        assert status is not None and status.state == AppState.SUCCEEDED
    finally:
        await docker_scheduler.engine.remove_image(tag, force=True)


# -- SingleFlight ----------------------------------------------------------------------------------


async def test_a_job_abandoned_by_its_last_caller_is_cancelled_and_not_reused() -> None:
    """Cancelling the only caller of a job cancels the job; a caller of the same key arriving
    while that job unwinds gets a new job (started once the stopped one has unwound) and its
    result, not the stopped job's cancellation."""
    supervisor = TaskSupervisor("test")
    flights = SingleFlight(supervisor)
    started = asyncio.Event()
    unwinding = asyncio.Event()
    finish = asyncio.Event()
    steps: list[str] = []

    async def slow_to_stop(report: object) -> str:
        steps.append("job started")
        if len(steps) == 1:
            try:
                started.set()
                await asyncio.Event().wait()  # until cancelled
            except asyncio.CancelledError:
                unwinding.set()
                await finish.wait()  # a request being closed, a pushed tag being removed
                steps.append("first job unwound")
                raise
        return "image"

    try:
        waiter = asyncio.ensure_future(flights.run("k", slow_to_stop))
        await started.wait()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        # (bounded: a job its callers abandoned that is never cancelled would hang the test)
        await asyncio.wait_for(unwinding.wait(), 10)
        assert not flights.in_flight("k")
        second = asyncio.ensure_future(flights.run("k", slow_to_stop))
        finish.set()
        assert await asyncio.wait_for(second, 10) == "image"
        assert steps == ["job started", "first job unwound", "job started"]
    finally:
        finish.set()
        await supervisor.aclose()


async def test_a_job_goes_on_while_one_of_its_callers_still_waits() -> None:
    """Cancelling one of two callers of a job leaves the job running; the other gets its result
    and both callers' progress callbacks heard it until they left."""
    supervisor = TaskSupervisor("test")
    flights = SingleFlight(supervisor)
    release = asyncio.Event()
    started = asyncio.Event()

    async def job(report: Any) -> str:
        report(WorkspaceEvent("build", "t", "step 1"))
        started.set()
        await release.wait()
        report(WorkspaceEvent("build", "t", "done", final=True))
        return "image"

    heard: list[list[str]] = [[], []]
    try:
        gone = asyncio.ensure_future(flights.run("k", job, lambda e: heard[0].append(e.message)))
        kept = asyncio.ensure_future(flights.run("k", job, lambda e: heard[1].append(e.message)))
        await started.wait()
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert flights.in_flight("k")
        release.set()
        assert await kept == "image"
        assert heard == [["step 1"], ["step 1", "done"]]
        assert flights.started == 1
    finally:
        release.set()
        await supervisor.aclose()
