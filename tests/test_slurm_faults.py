# ruff: noqa: F811 - the fixtures imported from _slurm_env are redefined as test parameters
"""Faults of the slurm backend found by an attacker review: odd app ids, sacct hung or missing,
jobs requeued after they ended, a tail through a controller outage, a '|' in the job directory,
accounting's placeholder record of a job that has just ended, and the controller-down message.

Against the real test clusters where Slurm's behaviour is the point (faults injected with PATH
shims in a test directory, never on the shared daemons), against a fake command runner for the
error paths. Each test failed before its fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from _slurm_env import (  # noqa: F401 - pytest fixtures, used as test parameters
    CountingRunner,
    accounting,
    job_dir,
    scancel,
    slurm_cluster,
    slurm_runner,
    slurm_scheduler,
    slurm_session,
    wait_for_state,
)

from asynctorchx.runner import AsyncRunner
from asynctorchx.schedulers import slurm as slurm_module
from asynctorchx.schedulers._slurm.parse import SACCT_FIELDS, parse_sacct_parsable
from asynctorchx.schedulers._slurm.script import COMBINED_FILE, log_dir
from asynctorchx.schedulers.slurm import (
    CommandResult,
    SlurmCommandError,
    SlurmScheduler,
    SubprocessRunner,
)
from asynctorchx.specs.api import AppDef, AppState, Resource, Role, is_terminal

SMALL = Resource(cpu=1, gpu=0, memMB=64)
#: What squeue prints once the controller has forgotten every job (MinJobAge): no job at all.
FORGOTTEN = '{"meta": {}, "errors": [], "jobs": []}'
#: What the real squeue printed (exit 0) while the controller was frozen.
DOWN_JSON = json.dumps(
    {
        "meta": {"plugin": {"type": "openapi/v0.0.38", "name": "Slurm OpenAPI v0.0.38"}},
        "errors": [
            {
                "description": "Failed while looking for jobs",
                "error_number": -1,
                "error": "Unspecified error",
                "source": "slurm_load_jobs",
            }
        ],
        "jobs": [],
    }
)


def _app(script: str) -> AppDef:
    role = Role("w", "/tmp", entrypoint="sh", args=["-c", script], resource=SMALL)
    return AppDef("faults", [role])


def _shim(directory: Path, name: str, body: str) -> None:
    """An executable shell script ``name`` in ``directory`` (made if missing)."""
    directory.mkdir(exist_ok=True)
    path = directory / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def _shimmed(shim: Path, timeout: float = 30.0) -> SubprocessRunner:
    """The real runner, with the shims of ``shim`` first on PATH."""
    return SubprocessRunner(env={"PATH": f"{shim}:{os.environ['PATH']}"}, timeout=timeout)


def _slurm_state(app_id: str) -> str:
    """The job's state as squeue lists it (finished jobs included), or ""."""
    out = subprocess.run(
        ["squeue", "-h", "-t", "all", "-j", app_id, "-o", "%T"],
        capture_output=True,
        text=True,
        timeout=20,
    ).stdout.split()
    return out[0] if out else ""


class FakeRunner:
    """A CommandRunner answering from ``answers`` (program -> result), counting the calls."""

    def __init__(self, **answers: CommandResult) -> None:
        self.answers = answers
        self.calls: list[tuple[str, ...]] = []

    def count(self, program: str) -> int:
        return sum(1 for c in self.calls if c[0] == program)

    async def __call__(self, argv: Sequence[str], *, stdin: str | None = None) -> CommandResult:
        self.calls.append(tuple(argv))
        await asyncio.sleep(0)
        result = self.answers.get(argv[0])
        return CommandResult(tuple(argv), 0, "", "") if result is None else result


def _ok(stdout: str) -> CommandResult:
    return CommandResult((), 0, stdout, "")


def _sacct_text(rows: Sequence[dict[str, str]]) -> str:
    lines = ["|".join(SACCT_FIELDS)]
    lines += ["|".join(row.get(f, "") for f in SACCT_FIELDS) for row in rows]
    return "\n".join(lines) + "\n"


# -- 1. ids that are digits to str.isdigit() only ----------------------------------------------

ODD_IDS = ["²", "０", "١٢", "0", "000"]  # noqa: RUF001 - the point: digits that are not ASCII


@pytest.mark.parametrize("app_id", ODD_IDS)
async def test_ids_of_non_ascii_or_zero_digits_are_unknown_without_commands(app_id: str) -> None:
    """Superscript, fullwidth and Arabic-Indic digits pass str.isdigit() and went to squeue and sacct (which dies on them); an
    all-zero id would have made `sacct --jobs 0` list every job. They are unknown, for free."""
    fake = FakeRunner(squeue=_ok(FORGOTTEN))
    sched = SlurmScheduler("s", runner=fake, accounting=True)
    assert await sched.describe(app_id) is None
    assert not await sched.exists(app_id)
    await sched.cancel(app_id)
    assert fake.calls == []
    assert (await sched.describe_many([app_id, "7"])) == {app_id: None, "7": None}
    [sacct] = [c for c in fake.calls if c[0] == "sacct"]
    assert sacct[-2:] == ("--jobs", "7")


@pytest.mark.slurm
@pytest.mark.timeout(60)
@pytest.mark.parametrize("app_id", ["²", "١٢"])
async def test_describe_exists_cancel_of_a_non_ascii_digit_id_on_a_real_cluster(
    slurm_scheduler: SlurmScheduler, slurm_runner: CountingRunner, app_id: str
) -> None:
    """The real sacct dies on such an id ('Bad job/step specified'): describe raised."""
    assert await slurm_scheduler.describe(app_id) is None
    assert await slurm_scheduler.exists(app_id) is False
    await slurm_scheduler.cancel(app_id)
    assert slurm_runner.counts["sacct"] == 0


@pytest.mark.slurm
@pytest.mark.timeout(90)
async def test_one_odd_handle_does_not_stall_waits_on_other_apps(
    accounting: bool, slurm_runner: CountingRunner, slurm_session: str, job_dir: Path
) -> None:
    """One wait on such a handle made every status round of the backend fail, so that the wait
    on a healthy app never saw it finish."""
    async with AsyncRunner(
        slurm_session, slurm_runner=slurm_runner, slurm_accounting=True if accounting else None
    ) as runner:
        good = await runner.run(_app("true"), "slurm", {"job_dir": str(job_dir)})
        stray = asyncio.create_task(runner.wait(f"slurm://{slurm_session}/²", timeout=60))
        try:
            status = await runner.wait(good, timeout=20)
        finally:
            stray.cancel()
            with contextlib.suppress(BaseException):
                await stray
    assert status is not None and status.state == AppState.SUCCEEDED


# -- 2. sacct hung or missing ------------------------------------------------------------------


@pytest.mark.slurm
@pytest.mark.timeout(90)
@pytest.mark.parametrize("fault", ["hung", "missing"])
async def test_a_finished_app_squeue_shows_is_described_when_sacct_hangs_or_is_missing(
    slurm_cluster: None, slurm_session: str, job_dir: Path, tmp_path: Path, fault: str
) -> None:
    """A failing sacct left squeue to answer for a finished app it still lists, but a hung one
    (the runner's timeout) or none on PATH made describe raise."""
    runner = CountingRunner()
    sched = SlurmScheduler(slurm_session, runner=runner, accounting=False)
    shim = tmp_path / "shim"
    try:
        app_id = await sched.submit(_app("true"), {"job_dir": str(job_dir)})
        assert (await wait_for_state(sched, app_id, timeout=40)).state == AppState.SUCCEEDED
        if fault == "hung":
            _shim(shim, "sacct", "exec sleep 600")
            path = f"{shim}:{os.environ['PATH']}"
        else:  # squeue and the others, no sacct
            shim.mkdir()
            for prog in ("squeue", "scancel", "scontrol", "sbatch"):
                os.symlink(f"/usr/bin/{prog}", shim / prog)
            path = str(shim)
        faulty = SlurmScheduler(
            slurm_session,
            runner=SubprocessRunner(env={"PATH": path}, timeout=3),
            accounting=True if fault == "hung" else None,  # missing: left to find out
        )
        resp = await faulty.describe(app_id)
        assert resp is not None and resp.state == AppState.SUCCEEDED
        if fault == "missing":
            assert faulty.accounting is False  # no sacct: no accounting to ask
    finally:
        scancel(runner.submitted)
        await sched.close()


async def test_a_hung_sacct_is_said_to_wait_for_slurmdbd_not_the_controller(
    tmp_path: Path,
) -> None:
    """The runner's timeout message blamed the controller for a hung sacct (slurmdbd answers it)."""
    _shim(tmp_path, "sacct", "exec sleep 600")
    _shim(tmp_path, "squeue", "exec sleep 600")
    runner = _shimmed(tmp_path, timeout=0.5)
    with pytest.raises(TimeoutError, match="slurmdbd") as info:
        await runner(["sacct", "--jobs", "1"])
    assert "controller" not in str(info.value)
    with pytest.raises(TimeoutError, match="controller"):
        await runner(["squeue", "--json"])


# -- 3. a job requeued after it ended ----------------------------------------------------------


async def _requeued_after_seen_failed(sched: SlurmScheduler, job_dir: Path) -> str:
    """An app seen FAILED (and remembered so), then requeued with scontrol: Slurm runs it again."""
    app_id = await sched.submit(_app("exit 3"), {"job_dir": str(job_dir)})
    assert (await wait_for_state(sched, app_id, timeout=40)).state == AppState.FAILED
    await asyncio.sleep(1.5)  # (sacct catches up: the backend now remembers it as final)
    resp = await sched.describe(app_id)
    assert resp is not None and resp.state == AppState.FAILED
    subprocess.run(["scontrol", "requeue", app_id], check=True, timeout=20, capture_output=True)
    deadline = time.monotonic() + 10
    while _slurm_state(app_id) not in ("PENDING", "RUNNING") and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert _slurm_state(app_id) in ("PENDING", "RUNNING")
    return app_id


@pytest.mark.slurm
@pytest.mark.timeout(90)
async def test_describe_of_an_app_requeued_after_it_ended_is_not_the_old_outcome(
    slurm_scheduler: SlurmScheduler, job_dir: Path
) -> None:
    """The remembered outcome was kept for ever. Now squeue is asked again once the outcome is
    older than state_check_interval (2 s): the app reads PENDING/RUNNING within that."""
    app_id = await _requeued_after_seen_failed(slurm_scheduler, job_dir)
    deadline = time.monotonic() + 10
    resp = await slurm_scheduler.describe(app_id)
    while resp is not None and resp.state == AppState.FAILED and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        resp = await slurm_scheduler.describe(app_id)
    assert resp is not None and resp.state in (AppState.PENDING, AppState.RUNNING), resp


@pytest.mark.slurm
@pytest.mark.timeout(90)
async def test_cancel_of_an_app_requeued_after_it_ended_cancels_it(
    slurm_scheduler: SlurmScheduler, job_dir: Path
) -> None:
    """cancel() skipped scancel for an app once seen finished, so the requeued job ran on."""
    app_id = await _requeued_after_seen_failed(slurm_scheduler, job_dir)
    await slurm_scheduler.cancel(app_id)
    deadline = time.monotonic() + 15
    while _slurm_state(app_id) != "CANCELLED" and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert _slurm_state(app_id) == "CANCELLED"


# -- 4. a tail through a controller outage -----------------------------------------------------


def _squeue_outage_shim(tmp_path: Path) -> tuple[Path, Path]:
    """A squeue that prints what the real one printed with the controller frozen while ``flag``
    exists, and runs the real squeue otherwise."""
    shim, flag = tmp_path / "shim", tmp_path / "controller-down"
    _shim(
        shim,
        "squeue",
        f"if [ -e {flag} ]; then cat <<'EOF'\n{DOWN_JSON}\nEOF\nexit 0; fi\n"
        'exec /usr/bin/squeue "$@"',
    )
    return shim, flag


@pytest.mark.slurm
@pytest.mark.timeout(90)
async def test_a_tail_survives_a_short_controller_outage(
    accounting: bool, slurm_session: str, job_dir: Path, tmp_path: Path
) -> None:
    """log_iter(should_tail=True) raised at the first failed state check of a 3 s outage (the
    follower got 2 of 10 lines) while wait() rides the same outage out."""
    shim, flag = _squeue_outage_shim(tmp_path)
    runner = CountingRunner(_shimmed(shim))
    sched = SlurmScheduler(
        slurm_session,
        runner=runner,
        accounting=True if accounting else None,
        state_check_interval=0.5,
    )
    try:
        script = "for i in $(seq 1 10); do echo line $i; sleep 1; done"
        app_id = await sched.submit(_app(script), {"job_dir": str(job_dir)})
        await wait_for_state(sched, app_id, {AppState.RUNNING}, timeout=30)
        lines: list[str] = []

        async def follow() -> None:
            async for line in sched.log_iter(app_id, "w", 0, should_tail=True):
                lines.append(line)

        task = asyncio.create_task(follow())
        await asyncio.sleep(2)
        flag.touch()  # the controller goes away for 3 s ...
        await asyncio.sleep(3)
        flag.unlink()  # ... and is back
        await asyncio.wait_for(task, 60)
        assert lines == [f"line {i}\n" for i in range(1, 11)]
    finally:
        flag.unlink(missing_ok=True)
        scancel(runner.submitted, os.environ.get("SLURM_CONF"))
        await sched.close()


@pytest.mark.timeout(30)
async def test_a_tail_gives_up_after_a_long_outage_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past FOLLOW_OUTAGE_LIMIT seconds without an answer the follow raises, saying so (it raised
    the first failure's 'squeue failed' at once)."""
    monkeypatch.setattr(slurm_module, "FOLLOW_OUTAGE_LIMIT", 1.0, raising=False)
    running = {
        "jobs": [
            {
                "job_id": 5,
                "name": "w-0",
                "job_state": "RUNNING",
                "current_working_directory": str(tmp_path),
            }
        ]
    }
    logs = tmp_path / log_dir("5", "w", 0)
    logs.mkdir(parents=True)
    (logs / COMBINED_FILE).write_text("one\n")
    fake = FakeRunner(squeue=_ok(json.dumps(running)))
    sched = SlurmScheduler("s", runner=fake, accounting=False, state_check_interval=0.1)
    lines: list[str] = []
    with pytest.raises(SlurmCommandError, match="did not answer for") as info:
        async for line in sched.log_iter("5", "w", 0, should_tail=True):
            lines.append(line)
            fake.answers["squeue"] = _ok(DOWN_JSON)  # the controller goes away for good
    assert lines == ["one\n"]
    assert "Failed while looking for jobs" in str(info.value)
    assert 3 <= fake.count("squeue") <= 10  # asked again with a growing delay, not in a loop


# -- 5. a '|' in the job directory -------------------------------------------------------------


def test_sacct_rows_keep_a_workdir_holding_the_separator() -> None:
    """sacct --parsable2 does not escape '|': WorkDir (last) takes every '|' past the others."""
    assert SACCT_FIELDS[-1] == "WorkDir"
    row = {"JobID": "7", "JobIDRaw": "7", "JobName": "w-0", "State": "COMPLETED"}
    text = _sacct_text([{**row, "ExitCode": "0:0", "WorkDir": "/tmp/a|b|c"}])
    [job] = parse_sacct_parsable(text)
    assert (job.name, job.state, job.workdir) == ("w-0", "COMPLETED", "/tmp/a|b|c")


def _sacct_has_workdir(app_id: str) -> bool:
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-j", app_id, "-o", "WorkDir"],
        capture_output=True,
        text=True,
        timeout=20,
    ).stdout
    return bool(out.strip())


@pytest.mark.slurm
@pytest.mark.timeout(90)
async def test_logs_of_an_app_squeue_forgot_are_found_with_a_separator_in_its_job_dir(
    slurm_cluster: None, slurm_session: str, tmp_path: Path
) -> None:
    """With a '|' in job_dir, the job directory was taken to end at the '|' and log_iter of an app
    squeue forgot (a squeue shim listing no job) yielded nothing."""
    runner = CountingRunner()
    sched = SlurmScheduler(slurm_session, runner=runner, accounting=True)
    try:
        app_id = await sched.submit(_app("echo hello"), {"job_dir": str(tmp_path / "we|ird")})
        assert (await wait_for_state(sched, app_id, timeout=40)).state == AppState.SUCCEEDED
        shim = tmp_path / "shim"
        _shim(shim, "squeue", f"cat <<'EOF'\n{FORGOTTEN}\nEOF")
        later = SlurmScheduler(slurm_session, runner=_shimmed(shim), accounting=True)
        deadline = time.monotonic() + 30  # (past accounting's placeholder record, item 6)
        while not _sacct_has_workdir(app_id) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        resp = await later.describe(app_id)
        assert resp is not None and resp.state == AppState.SUCCEEDED
        assert [ln async for ln in later.log_iter(app_id, "w", 0)] == ["hello\n"]
    finally:
        scancel(runner.submitted)
        await sched.close()


# -- 6. accounting's placeholder of a job that has just ended ----------------------------------


async def test_a_placeholder_record_is_not_remembered_as_final(tmp_path: Path) -> None:
    """For a second or two after a job ends slurmdbd may list it as JobName 'allocation' without
    WorkDir: an app squeue forgot was remembered so for ever (role 'allocation', no logs)."""
    done = {"JobID": "9", "JobIDRaw": "9", "State": "COMPLETED", "ExitCode": "0:0"}
    step = {**done, "JobID": "9.0", "JobIDRaw": "9.0", "JobName": "sh"}
    fake = FakeRunner(
        squeue=_ok(FORGOTTEN), sacct=_ok(_sacct_text([{**done, "JobName": "allocation"}, step]))
    )
    sched = SlurmScheduler("s", runner=fake, accounting=True)
    first = await sched.describe("9")
    assert first is not None and is_terminal(first.state)
    fake.answers["sacct"] = _ok(
        _sacct_text([{**done, "JobName": "w-0", "WorkDir": str(tmp_path)}, step])
    )
    resp = await sched.describe("9")
    assert resp is not None and [r.role for r in resp.roles_statuses] == ["w"]
    calls = len(fake.calls)
    assert await sched.describe("9") is resp  # the real record is remembered
    assert len(fake.calls) == calls


@pytest.mark.slurm
@pytest.mark.timeout(60)
async def test_a_finished_app_described_from_sacct_keeps_its_roles_and_logs(
    slurm_cluster: None, slurm_session: str, tmp_path: Path
) -> None:
    """The placeholder replayed by a sacct shim (while ``flag`` exists it rewrites the job rows
    of the real sacct the way slurmdbd's placeholder reads), squeue forgetting at once (a shim
    listing no job): once sacct has the real record, the app's role and logs are found."""
    shim, flag = tmp_path / "shim", tmp_path / "placeholder"
    _shim(shim, "squeue", f"cat <<'EOF'\n{FORGOTTEN}\nEOF")
    _shim(
        shim,
        "sacct",
        f'[ -e {flag} ] || exec /usr/bin/sacct "$@"\n'
        '/usr/bin/sacct "$@" | awk -F"|" -v OFS="|" '
        '\'NR == 1 { for (i = 1; i <= NF; i++) { if ($i == "JobName") n = i; '
        'if ($i == "WorkDir") w = i } } '
        'NR > 1 && $1 !~ /[.]/ { $n = "allocation"; $w = "" } { print }\'',
    )
    flag.touch()
    runner = CountingRunner()
    sched = SlurmScheduler(slurm_session, runner=runner, accounting=True)
    watcher = SlurmScheduler(slurm_session, runner=_shimmed(shim), accounting=True)
    try:
        app_id = await sched.submit(_app("echo hello"), {"job_dir": str(tmp_path / "jobs")})
        deadline = time.monotonic() + 40
        resp = await watcher.describe(app_id)
        while (resp is None or not is_terminal(resp.state)) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            resp = await watcher.describe(app_id)
        assert resp is not None and is_terminal(resp.state)
        assert [r.role for r in resp.roles_statuses] == ["allocation"]  # the placeholder
        flag.unlink()  # sacct now tells the job's real record (once slurmdbd has it)
        deadline = time.monotonic() + 10
        while [r.role for r in resp.roles_statuses] != ["w"] and time.monotonic() < deadline:
            await asyncio.sleep(0.3)
            resp = await watcher.describe(app_id)
            assert resp is not None
        assert [r.role for r in resp.roles_statuses] == ["w"], resp.roles_statuses
        assert [ln async for ln in watcher.log_iter(app_id, "w", 0)] == ["hello\n"]
    finally:
        flag.unlink(missing_ok=True)
        scancel(runner.submitted)
        await sched.close()


# -- 7. the controller-down message ------------------------------------------------------------


async def test_the_controller_down_error_does_not_dump_squeues_json() -> None:
    """The error named what failed, then quoted squeue's whole JSON document as if it were an
    error text."""
    sched = SlurmScheduler("s", runner=FakeRunner(squeue=_ok(DOWN_JSON)), accounting=False)
    with pytest.raises(SlurmCommandError, match="Failed while looking for jobs") as info:
        await sched.describe("1")
    assert '"meta"' not in str(info.value) and '"jobs"' not in str(info.value), str(info.value)
