"""The Slurm batch script's replica wrapper, run by plain ``sh`` (as ``srun`` runs it on a node, but
without Slurm): the three logs, the exit code, and the timing samples that ``since``/``until``
read. The same wrapper runs on the real cluster in test_slurm_engine.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from datetime import datetime
from pathlib import Path

import anyio
import pytest
from _local_env import group_members, poll_until

from asynctorchx.logs import Stream, iter_log_lines
from asynctorchx.schedulers._slurm.script import (
    REPLICA_WRAPPER,
    SAMPLE_INTERVAL,
    TEE_DRAIN,
    TIMES_FILE,
)

#: Waits for the file named by $GO between its two lines.
SCRIPT = 'echo early; echo oops >&2; while [ ! -e "$GO" ]; do sleep 0.01; done; echo late'


async def run_wrapper(
    log_dir: Path, script: str, env: dict[str, str], *, new_session: bool = False
) -> asyncio.subprocess.Process:
    """Starts ``sh -c REPLICA_WRAPPER LOG_DIR sh -c SCRIPT`` as srun would on a node (in a session
    of its own with ``new_session``, as srun's task group)."""
    log_dir.mkdir(parents=True)
    (log_dir / "combined.log").touch()  # the batch script creates it before srun
    return await asyncio.create_subprocess_exec(
        "sh",
        "-c",
        REPLICA_WRAPPER,
        str(log_dir),
        "sh",
        "-c",
        script,
        env=env,
        start_new_session=new_session,
    )


async def lines(log_dir: Path, **kw: object) -> list[str]:
    """What the log reader gives for ``log_dir``."""
    return [ln async for ln in iter_log_lines(log_dir, **kw)]  # type: ignore[arg-type]


def samples(log_dir: Path) -> list[str]:
    """The lines of the replica's timing samples written so far."""
    try:
        return (log_dir / TIMES_FILE).read_text().splitlines()
    except FileNotFoundError:
        return []


async def sample_started_after(tmp: Path, moment: float) -> float:
    """Waits until the wrapper's sampler (its clock files in the directory under ``tmp``) starts a
    sample after ``moment``; returns that sample's "a" time."""
    started = 0.0

    def check() -> bool:
        nonlocal started
        with contextlib.suppress(FileNotFoundError):
            started = max((a.stat().st_mtime for a in tmp.glob("*/a")), default=0.0)
        return started > moment

    await poll_until(check, "a sample of the wrapper")
    return started


@pytest.mark.timeout(60)
async def test_since_and_until_split_the_lines_of_a_replica_by_when_they_were_written(
    tmp_path: Path,
) -> None:
    """since/until on a wrapped replica's logs keep the lines written on their side of a moment
    (the timing samples date each line to within a sampling interval), on every stream."""
    log_dir, go, tmp = tmp_path / "slurm-1" / "w" / "0", tmp_path / "go", tmp_path / "tmp"
    tmp.mkdir()  # the wrapper's clock files go there (mktemp -d)
    env = {"PATH": "/usr/bin:/bin", "GO": str(go), "TMPDIR": str(tmp)}
    proc = await run_wrapper(log_dir, SCRIPT, env)
    try:
        # the early lines are in a sample, and a later sample closed their interval
        await poll_until(lambda: len(samples(log_dir)) >= 2, "the early lines to be sampled")
        middle = datetime.now()
        # the sample taken just before the late line must come after ``middle``: wait for a
        # sample started after it (its "a" time, which the index gives) and done (the next one
        # has started: this one's stat is behind it)
        started = await sample_started_after(tmp, middle.timestamp())
        await sample_started_after(tmp, started)
        go.touch()
        with anyio.fail_after(30):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    everything = await lines(log_dir)
    assert sorted(everything) == ["early\n", "late\n", "oops\n"]
    assert await lines(log_dir, since=middle.timestamp()) == ["late\n"]
    assert await lines(log_dir, until=middle.timestamp()) == [
        ln for ln in everything if ln != "late\n"
    ]
    assert await lines(log_dir, stream=Stream.STDOUT, until=middle.timestamp()) == ["early\n"]
    assert await lines(log_dir, stream=Stream.STDERR, since=middle.timestamp()) == []
    assert (log_dir / "exit_code").read_text() == "0\n"
    assert not any(p.name.startswith(".") for p in log_dir.iterdir())


@pytest.mark.timeout(60)
async def test_the_last_samples_cover_everything_the_replica_wrote(tmp_path: Path) -> None:
    """Once the wrapper ends, the samples cover every byte of every log (the wrapper takes two last
    samples), and each sample line has the documented nine fields."""
    log_dir = tmp_path / "slurm-2" / "w" / "0"
    proc = await run_wrapper(log_dir, "seq 1 3000; seq 1 5 >&2", {"PATH": "/usr/bin:/bin"})
    with anyio.fail_after(30):
        assert await proc.wait() == 0
    last = samples(log_dir)[-1].split()
    assert len(last) == 9
    sizes = [int(w) for w in last[6:]]
    assert sizes == [
        (log_dir / name).stat().st_size for name in ("stdout.log", "stderr.log", "combined.log")
    ]
    started = time.time() - 60
    assert len(await lines(log_dir, since=started)) == 3005


@pytest.mark.timeout(60)
async def test_after_a_cancel_the_last_samples_cover_what_the_replica_wrote(tmp_path: Path) -> None:
    """When scancel's SIGTERM reaches the whole step, the wrapper outlives it and waits for the
    replica (whose handler prints and exits 143); the samples (the sampler ignores the signal, like
    the tees) cover what the replica wrote to its end, and its exit code is written."""
    log_dir = tmp_path / "slurm-3" / "w" / "0"
    script = "echo started; trap 'echo stopping; exit 143' TERM; while :; do sleep 0.05; done"
    proc = await run_wrapper(log_dir, script, {"PATH": "/usr/bin:/bin"}, new_session=True)
    try:
        await poll_until(lambda: samples(log_dir) != [], "the first sample")
        os.killpg(proc.pid, signal.SIGTERM)
        with anyio.fail_after(30):
            await proc.wait()

        def covered() -> bool:
            last = samples(log_dir)[-1].split()
            size = (log_dir / "combined.log").stat().st_size
            return (
                len(last) == 9
                and int(last[8]) == size
                and b"stopping" in (log_dir / "combined.log").read_bytes()
            )

        await poll_until(covered, "the last samples after the cancel")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert (log_dir / "exit_code").read_text() == "143\n"


@pytest.mark.timeout(60)
async def test_no_process_of_the_wrapper_outlives_it(tmp_path: Path) -> None:
    """Once the wrapper has exited, no process it started lingers (a Slurm step lasts until its last
    process ends): at most the sampler's last ``sleep`` of SAMPLE_INTERVAL s, never a timer of
    TEE_DRAIN s (a timer's ``sleep 5`` used to keep every job running 5 s past its replicas)."""
    log_dir = tmp_path / "slurm-4" / "w" / "0"
    proc = await run_wrapper(log_dir, "echo hi", {"PATH": "/usr/bin:/bin"}, new_session=True)
    try:
        with anyio.fail_after(30):
            assert await proc.wait() == 0
        ended = time.monotonic()
        left = group_members(proc.pid)
        while left and time.monotonic() - ended < SAMPLE_INTERVAL + 2:
            await asyncio.sleep(0.05)
            left = group_members(proc.pid)
        assert left == [], f"left behind by the wrapper: {left}"
        assert (log_dir / "exit_code").read_text() == "0\n"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.timeout(60)
async def test_a_daemon_holding_the_pipes_delays_the_end_by_the_drain_time_only(
    tmp_path: Path,
) -> None:
    """A replica that leaves a daemon holding its stdout open: the tees are killed TEE_DRAIN s after
    the replica exits, what the replica wrote is kept, and its exit code is written."""
    log_dir = tmp_path / "slurm-5" / "w" / "0"
    proc = await run_wrapper(
        log_dir,
        "(sleep 60 &); echo before-exit; exit 3",
        {"PATH": "/usr/bin:/bin"},
        new_session=True,
    )
    try:
        with anyio.fail_after(TEE_DRAIN + 20):
            assert await proc.wait() == 3
        assert (log_dir / "exit_code").read_text() == "3\n"
        assert await lines(log_dir) == ["before-exit\n"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the daemon is still in the wrapper's group
