# ruff: noqa: F811 - the fixtures imported from _docker_env and _slurm_env are redefined as test parameters
"""Submits cut short at the points a reviewer's cancel-at-every-point harness found leaky leave
nothing of theirs behind.

- ``local_docker``: a submit cancelled while its launch claim (a volume) is being created. The
  engine makes a volume whose client went away, so a clean-up that ran before the engine's answer
  found nothing to remove, and the claim left named the app PENDING "being submitted" for as long
  as the process lived (a runner's ``wait()`` never ended).
- ``slurm`` without a workspace: a submit cancelled while its worker thread makes ``job_dir``
  returns only once the thread has ended, and removes every directory it made (README: "the
  directories it made are removed again").
- ``slurm`` with a workspace: a submit that sbatch refuses, or that is cancelled during the copy,
  removes the parent directories of ``job_dir`` it made, not only ``job_dir``.

Each cancel is made to land at its point by intercepting the call in flight (the engine's create,
``os.mkdir``, the copy), not by timing. The tests use the real engines (they fail rather than skip
when ``ASYNCTORCHX_REQUIRE_ENGINES=1`` and an engine is missing) and remove only what they made.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from _docker_env import busybox_image, docker_engine, docker_scheduler, docker_session, sh  # noqa: F401
from _slurm_env import CountingRunner, slurm, slurm_cluster, slurm_runner, slurm_session  # noqa: F401
from _workspace_env import make_workspace

from asynctorchx.schedulers import workspace as workspace_mod
from asynctorchx.schedulers._docker.request import claim_name
from asynctorchx.schedulers._slurm import workspace as slurm_ws
from asynctorchx.schedulers.docker import DockerScheduler
from asynctorchx.schedulers.slurm import SlurmScheduler, SlurmSubmitError
from asynctorchx.specs import AppDef, Resource, Role

pytestmark = [pytest.mark.timeout(120)]


# -- local_docker: the launch claim -----------------------------------------------------------------


@pytest.mark.docker
async def test_a_submit_cancelled_while_its_launch_claim_is_created_leaves_no_claim(
    docker_scheduler: DockerScheduler, busybox_image: str
) -> None:
    """The submit is cancelled while its ``POST /volumes/create`` of the launch claim is in flight,
    and the engine makes the volume only once the client has gone away and its clean-up has asked
    to remove the claim (what a real engine does when the cancel cuts the request at the wrong
    moment). The cancelled ``schedule()`` must wait for the engine's answer before it cleans up:
    no claim volume is left, and the app reads unknown, not PENDING "being submitted"."""
    engine = docker_scheduler._engine
    app = AppDef("cc", [sh(busybox_image, "sleep 60", name="a")])
    dryrun = docker_scheduler.submit_dryrun(app, {})
    app_id = dryrun.request.app_id
    claim = claim_name(app_id)
    real_create, real_remove = engine.create_volume, engine.remove_volume
    sent = asyncio.Event()  # the claim's create request is in flight
    cancel_sent = asyncio.Event()
    cut = asyncio.Event()  # the submit stopped waiting for the create's answer
    removal_answered = asyncio.Event()  # the engine answered a removal of the claim
    engine_side: list[asyncio.Task[dict[str, Any]]] = []

    async def engine_makes_it(config: dict[str, Any]) -> dict[str, Any]:
        # The engine's side of the request: it carries on whether or not the client waits. When
        # the client went away, the volume is made only after the clean-up's removal was answered.
        await cancel_sent.wait()
        with contextlib.suppress(TimeoutError):  # a client that waits is never cut
            await asyncio.wait_for(cut.wait(), 0.5)
        if cut.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(removal_answered.wait(), 10)
        return await real_create(config)

    async def create_volume(config: dict[str, Any]) -> dict[str, Any]:
        if config.get("Name") != claim:
            return await real_create(config)
        engine_side.append(asyncio.ensure_future(engine_makes_it(config)))
        sent.set()
        try:
            return await asyncio.shield(engine_side[0])
        except asyncio.CancelledError:
            cut.set()
            raise

    async def remove_volume(name: str) -> bool:
        try:
            return await real_remove(name)
        finally:
            if name == claim:
                removal_answered.set()

    engine.create_volume = create_volume  # type: ignore[method-assign]
    engine.remove_volume = remove_volume  # type: ignore[method-assign]
    try:
        task = asyncio.ensure_future(docker_scheduler.schedule(dryrun))
        await asyncio.wait_for(sent.wait(), 60)
        task.cancel()
        cancel_sent.set()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        # the engine has answered every create it was sent before anything is looked at
        await asyncio.gather(*engine_side, return_exceptions=True)
        engine.create_volume, engine.remove_volume = real_create, real_remove  # type: ignore[method-assign]
    left = await engine.volume_exists(claim)
    resp = await docker_scheduler.describe(app_id)
    assert not left, f"the cancelled submit left its launch claim {claim}"
    assert resp is None, f"the cancelled submit's app reads {resp.state.name}: {resp.msg}"


# -- slurm: the directories a submit made ------------------------------------------------------------


def slurm_app() -> AppDef:
    role = Role(
        "sleeper",
        image="/tmp",
        entrypoint="sleep",
        args=["60"],
        resource=Resource(cpu=1, gpu=0, memMB=64),
    )
    return AppDef("jd", [role])


@pytest.mark.slurm
async def test_a_submit_cancelled_while_its_job_dir_is_made_removes_it_once_the_thread_ends(
    slurm: SlurmScheduler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submit without a workspace into ``job_dir`` = ``new/deep`` (neither exists) is cancelled
    while its worker thread is making ``new``. The cancelled ``schedule()`` returns only once the
    thread has made (and the submit removed) every directory: none of them is left, and none is
    made after it returned."""
    top = tmp_path / "new"
    job_dir = top / "deep"
    dryrun = slurm.submit_dryrun(slurm_app(), {"job_dir": str(job_dir)})
    real_mkdir = os.mkdir
    making_top = threading.Event()
    go_on = threading.Event()
    job_dir_made = threading.Event()

    def mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        # holds the thread in the middle of making the directories until the cancel has landed
        if os.fspath(path) == str(top) and not making_top.is_set():
            making_top.set()
            go_on.wait(30)
        try:
            real_mkdir(path, *args, **kwargs)
        finally:
            if os.fspath(path) == str(job_dir):
                job_dir_made.set()

    monkeypatch.setattr(os, "mkdir", mkdir)
    task = asyncio.ensure_future(slurm.schedule(dryrun))
    try:
        assert await asyncio.to_thread(making_top.wait, 30), "job_dir was never made"
        task.cancel()
        # a submit that does not wait for its thread is over by now
        await asyncio.wait({task}, timeout=0.5)
    finally:
        go_on.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    returned_after_the_thread = job_dir_made.is_set()
    assert await asyncio.to_thread(job_dir_made.wait, 30), "the thread never made job_dir"
    monkeypatch.undo()
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert not top.exists(), f"the cancelled submit left {left}"
    assert returned_after_the_thread, "the cancelled submit returned before its thread ended"


@pytest.mark.slurm
async def test_a_submit_whose_job_dir_cannot_be_made_removes_the_parents_it_made(
    slurm: SlurmScheduler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submit without a workspace into ``job_dir`` = ``new/deep`` whose ``deep`` cannot be made
    (a full disk) raises the OSError naming the run option, and leaves no ``new``."""
    top = tmp_path / "new"
    job_dir = top / "deep"
    dryrun = slurm.submit_dryrun(slurm_app(), {"job_dir": str(job_dir)})
    real_mkdir = os.mkdir

    def mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        if os.fspath(path) == str(job_dir):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))
        real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    with pytest.raises(OSError, match="run option 'job_dir' cannot be created"):
        await slurm.schedule(dryrun)
    monkeypatch.undo()
    assert not top.exists(), "the failed submit left the parent directory it made"


@pytest.mark.slurm
@pytest.mark.parametrize("how", ["refused", "cancelled"])
async def test_a_workspace_submit_cut_short_removes_the_parent_directories_it_made(
    slurm: SlurmScheduler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A workspace submit into ``job_dir`` = ``new/deep`` (neither exists) that sbatch refuses
    (an unknown partition), or that is cancelled while the workspace is copied, leaves neither
    ``deep`` nor ``new``: the parents the claim of ``job_dir`` made go too, as they do for a
    submit without a workspace."""
    ws = make_workspace(tmp_path / "ws", {"train.py": "print(1)\n", "lib/a.py": "x = 1\n"})
    top = tmp_path / "new"
    job_dir = top / "deep"
    cfg: dict[str, Any] = {"job_dir": str(job_dir)}
    if how == "refused":
        cfg["partition"] = "nosuchpartition"
    dryrun = await slurm.submit_dryrun_async(slurm_app(), cfg, workspace=str(ws))
    copying = threading.Event()
    real_copy = slurm_ws.copy_scan

    def copy_once_cancelled(*args: Any, **kwargs: Any) -> Any:
        # the copy starts once the submit's cancellation has reached the thread, so it is cut
        # short in the middle (the copy checks for it between files)
        copying.set()
        stop = workspace_mod._stop.get()
        assert stop is not None
        assert stop.wait(30), "the cancellation never reached the copy thread"
        return real_copy(*args, **kwargs)

    if how == "cancelled":
        monkeypatch.setattr(slurm_ws, "copy_scan", copy_once_cancelled)
    task = asyncio.ensure_future(slurm.schedule(dryrun))
    if how == "cancelled":
        assert await asyncio.to_thread(copying.wait, 30), "the copy never started"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        with pytest.raises(SlurmSubmitError, match=r"(?i)partition"):
            await task
    assert not job_dir.exists(), "job_dir itself is left"
    assert not top.exists(), "the parent directory the submit made is left"
