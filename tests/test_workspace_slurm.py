# ruff: noqa: F811 - the fixtures imported from _slurm_env are redefined as test parameters
"""Workspaces on slurm, against the real test cluster of ``scripts/engines/slurm.sh``: the
workspace is copied into the job directory and every role runs there."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import anyio
import pytest
from _local_env import tiny_tmpfs
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

from asynctorchx.schedulers.api import Stream
from asynctorchx.schedulers.slurm import SlurmScheduler, SlurmSubmitError
from asynctorchx.schedulers.workspace import WorkspaceCopyError, WorkspaceEvent, reporting
from asynctorchx.specs import (
    AppState,
    InvalidRunConfigException,
    InvalidWorkspaceException,
)

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(120)]


async def stdout_of(sched: SlurmScheduler, app_id: str) -> str:
    return "".join([x async for x in sched.log_iter(app_id, "trainer", streams=Stream.STDOUT)])


async def test_the_job_runs_the_copied_workspace_and_torchxignore_is_honoured(
    slurm: SlurmScheduler, tmp_path: Path
) -> None:
    """The job runs in job_dir from the copy; what .torchxignore excludes was not copied."""
    ws = make_workspace(
        tmp_path / "ws",
        {
            "run.sh": "echo running $(basename $0) with $(cat data.txt)\n",
            "data.txt": "v1",
            "big.bin": b"\0" * 1000,
            "notes/x.txt": "n",
            ".torchxignore": "big.bin\nnotes\n",
        },
    )
    job_dir = tmp_path / "jobs" / "run-1"
    script = 'sh run.sh; pwd; for f in big.bin notes/x.txt data.txt; do if [ -e "$f" ]; then echo "present $f"; else echo "absent $f"; fi; done'
    events: list[WorkspaceEvent] = []
    with reporting(events.append):
        app_id = await slurm.submit(
            sh_app(script, "wss"), {"job_dir": str(job_dir)}, workspace=str(ws)
        )
    resp = await wait_for_state(slurm, app_id)
    assert resp.state == AppState.SUCCEEDED, resp.msg
    assert (await stdout_of(slurm, app_id)).splitlines() == [
        "running run.sh with v1",
        str(job_dir),
        "absent big.bin",
        "absent notes/x.txt",
        "present data.txt",
    ]
    assert [e.stage for e in events] == ["copy", "copy"] and events[-1].final


async def test_an_app_keeps_running_its_own_copy_when_the_workspace_is_edited(
    slurm: SlurmScheduler, tmp_path: Path
) -> None:
    """A job that reads a file after the workspace was edited in place reads the submitted bytes."""
    ws = make_workspace(tmp_path / "ws", {"data.txt": "submitted"})
    flag = tmp_path / "go"
    script = f'while [ ! -e "{flag}" ]; do sleep 0.1; done; cat data.txt'
    app_id = await slurm.submit(
        sh_app(script, "wss"), {"job_dir": str(tmp_path / "jobs" / "a")}, workspace=str(ws)
    )
    await wait_for_state(slurm, app_id, {AppState.RUNNING})
    with open(ws / "data.txt", "r+") as f:  # in place, as an editor that truncates and rewrites
        f.truncate(0)
        f.write("edited!!!")
    flag.touch()
    resp = await wait_for_state(slurm, app_id)
    assert resp.state == AppState.SUCCEEDED, resp.msg
    assert await stdout_of(slurm, app_id) == "submitted"


async def test_an_earlier_job_dir_inside_the_workspace_is_not_copied_into_the_next(
    slurm: SlurmScheduler, tmp_path: Path
) -> None:
    """With job_dir=ws/runs/N, the second job's copy holds the workspace's files, not the first
    job's directory (each trial of a sweep would otherwise copy every trial before it)."""
    ws = make_workspace(tmp_path / "ws", {"data.txt": "d"})
    first = await slurm.submit(
        sh_app("true", "wss"), {"job_dir": str(ws / "runs" / "a")}, workspace=str(ws)
    )
    assert (await wait_for_state(slurm, first)).state == AppState.SUCCEEDED
    script = "ls -A; ls -A runs"
    second = await slurm.submit(
        sh_app(script, "wss"), {"job_dir": str(ws / "runs" / "b")}, workspace=str(ws)
    )
    resp = await wait_for_state(slurm, second)
    assert resp.state == AppState.SUCCEEDED, resp.msg
    listed = (await stdout_of(slurm, second)).split()
    assert "a" not in listed and {".nonce", "data.txt", "runs"} <= set(listed), listed


async def test_a_job_dir_that_holds_files_is_refused_before_any_job(
    slurm: SlurmScheduler, slurm_runner: CountingRunner, tmp_path: Path
) -> None:
    """A job_dir with another app's files is refused, naming it and a file; nothing is queued."""
    ws = make_workspace(tmp_path / "ws", {"data.txt": "x"})
    job_dir = tmp_path / "jobs" / "used"
    job_dir.mkdir(parents=True)
    (job_dir / "slurm-123.out").write_text("another app's log")
    with pytest.raises(
        InvalidWorkspaceException,
        match=rf"job_dir '{job_dir}' already holds files \(slurm-123\.out\)",
    ):
        await slurm.submit(sh_app("true", "wss"), {"job_dir": str(job_dir)}, workspace=str(ws))
    assert slurm_runner.counts["sbatch"] == 0
    assert sorted(p.name for p in job_dir.iterdir()) == ["slurm-123.out"]


async def test_two_submits_into_one_job_dir_the_second_is_refused(
    slurm: SlurmScheduler, slurm_runner: CountingRunner, tmp_path: Path
) -> None:
    """Two apps racing for one empty job_dir: one is submitted, the other refused, and the
    winner's copy is untouched."""
    ws1 = make_workspace(tmp_path / "ws1", {"data.txt": "one"})
    ws2 = make_workspace(tmp_path / "ws2", {"data.txt": "two"})
    job_dir = tmp_path / "jobs" / "shared"
    job_dir.mkdir(parents=True)
    cfg = {"job_dir": str(job_dir)}
    info1 = await slurm.submit_dryrun_async(sh_app("cat data.txt", "wss"), cfg, workspace=str(ws1))
    info2 = await slurm.submit_dryrun_async(sh_app("cat data.txt", "wss"), cfg, workspace=str(ws2))
    results: list[object] = []

    async def schedule(info: object) -> None:
        try:
            results.append(await slurm.schedule(info))  # type: ignore[arg-type]
        except InvalidWorkspaceException as e:
            results.append(e)

    async with anyio.create_task_group() as tg:
        tg.start_soon(schedule, info1)
        tg.start_soon(schedule, info2)
    errors = [r for r in results if isinstance(r, InvalidWorkspaceException)]
    [app_id] = [r for r in results if isinstance(r, str)]
    assert len(errors) == 1 and str(job_dir) in str(errors[0])
    assert slurm_runner.counts["sbatch"] == 1
    resp = await wait_for_state(slurm, app_id)
    assert resp.state == AppState.SUCCEEDED, resp.msg
    assert await stdout_of(slurm, app_id) in ("one", "two")


async def test_a_workspace_without_job_dir_is_refused_saying_to_set_it(
    slurm: SlurmScheduler, slurm_runner: CountingRunner, tmp_path: Path
) -> None:
    """Without job_dir the dry run fails, saying to set it; nothing is queued."""
    ws = make_workspace(tmp_path / "ws", {"data.txt": "x"})
    with pytest.raises(InvalidRunConfigException, match="set the job_dir run option"):
        await slurm.submit(sh_app("true", "wss"), {}, workspace=str(ws))
    assert slurm_runner.counts["sbatch"] == 0


async def test_a_job_sbatch_rejects_leaves_no_copy_behind(
    slurm: SlurmScheduler, tmp_path: Path
) -> None:
    """When sbatch rejects the job, the copy (and the job_dir the submit made) is removed."""
    ws = make_workspace(tmp_path / "ws", {"data.txt": "x"})
    job_dir = tmp_path / "jobs" / "rejected"
    with pytest.raises(SlurmSubmitError):
        await slurm.submit(
            sh_app("true", "wss"),
            {"job_dir": str(job_dir), "partition": "no-such-partition"},
            workspace=str(ws),
        )
    assert not job_dir.exists()


async def test_a_missing_workspace_is_refused_before_any_job(
    slurm: SlurmScheduler, slurm_runner: CountingRunner, tmp_path: Path
) -> None:
    """A workspace directory that does not exist is an error naming it; nothing is queued."""
    with pytest.raises(InvalidWorkspaceException, match=rf"'{tmp_path / 'nope'}' does not exist"):
        await slurm.submit(
            sh_app("true", "wss"),
            {"job_dir": str(tmp_path / "jobs" / "x")},
            workspace=str(tmp_path / "nope"),
        )
    assert slurm_runner.counts["sbatch"] == 0
    assert not (tmp_path / "jobs").exists()


async def test_a_job_dir_on_a_full_disk_fails_naming_it_and_leaves_no_copy(
    slurm: SlurmScheduler, slurm_runner: CountingRunner, tmp_path: Path
) -> None:
    """A workspace that does not fit job_dir's disk fails the submit with WorkspaceCopyError
    naming job_dir and the file (it was a bare "[Errno 28] No space left on device"); nothing is
    queued and the job_dir it made is removed."""
    ws = make_workspace(tmp_path / "ws", {"main.py": "print(1)\n", "data.bin": os.urandom(3 << 20)})
    with tiny_tmpfs(tmp_path / "fs", "1m") as fs:
        job_dir = fs / "jobs" / "run-1"
        with pytest.raises(WorkspaceCopyError) as info:
            await slurm.submit(sh_app("true", "wss"), {"job_dir": str(job_dir)}, workspace=str(ws))
        assert info.value.errno == errno.ENOSPC
        assert f"into {str(job_dir)!r}: No space left on device (writing 'data.bin')" in str(
            info.value
        )
        assert slurm_runner.counts["sbatch"] == 0
        assert not job_dir.exists()
