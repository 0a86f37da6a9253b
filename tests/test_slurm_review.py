# ruff: noqa: F811 - the fixtures imported from _slurm_env are redefined as test parameters
"""Defects of the slurm backend found by a review: a bare ':' argument (srun's component
separator), every replica's arguments on one srun command line (E2BIG), a '%' in the job
directory, abbreviated and bundled sbatch_args bypassing the ban on --job-name/--chdir, unchecked
``time`` and ``mail-type``, ``list`` failing with sacct, and the combined log gluing a partial
stdout line to a stderr line. On both test clusters where a job runs (faults injected with PATH
shims in a test directory); each test failed before its fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _slurm_env import (  # noqa: F401 - pytest fixtures, used as test parameters
    accounting,
    job_dir,
    slurm_cluster,
    slurm_runner,
    slurm_scheduler,
    slurm_session,
    wait_for_state,
)

from asynctorchx.schedulers._slurm.script import names_option
from asynctorchx.schedulers.api import Stream
from asynctorchx.schedulers.slurm import SlurmScheduler, SubprocessRunner
from asynctorchx.specs.api import (
    AppDef,
    AppState,
    InvalidRunConfigException,
    Resource,
    Role,
    macros,
)

SMALL = Resource(cpu=1, gpu=0, memMB=64)


def _role(name: str, entrypoint: str, args: list[str], replicas: int = 1) -> Role:
    return Role(
        name=name,
        image="/tmp",
        entrypoint=entrypoint,
        args=args,
        num_replicas=replicas,
        resource=SMALL,
    )


def _app(*roles: Role) -> AppDef:
    return AppDef(name="review", roles=list(roles))


async def _lines(
    sched: SlurmScheduler, app_id: str, role: str, k: int = 0, **kw: object
) -> list[str]:
    return [ln async for ln in sched.log_iter(app_id, role, k, **kw)]  # type: ignore[arg-type]


def _batch_out(job_dir: Path, app_id: str) -> str:
    path = job_dir / f"slurm-{app_id}.out"
    return path.read_text()[-500:] if path.exists() else "(no batch output)"


# -- 1. the replica's arguments stay off srun's command line -----------------------------------


@pytest.mark.slurm
@pytest.mark.timeout(120)
async def test_arguments_reach_the_replica_verbatim_bare_colon_included(
    slurm_scheduler: SlurmScheduler, job_dir: Path
) -> None:
    """A bare ':' argument is the replica's, not srun's component separator; spaces, quotes, $,
    backticks, line breaks, % and the app id macro arrive as given."""
    words = [":", "a b", 'it\'s "q"', "$HOME", "`id`", "two\nlines", "%j %%", f"x{macros.app_id}"]
    app = _app(_role("c", "printf", ["[%s]\\n", *words], replicas=2))
    app_id = await slurm_scheduler.submit(app, {"job_dir": str(job_dir)})
    resp = await wait_for_state(slurm_scheduler, app_id, timeout=60)
    assert resp.state == AppState.SUCCEEDED, (resp.msg, _batch_out(job_dir, app_id))
    expected = "".join(f"[{w}]\n" for w in words[:-1]) + f"[x{app_id}]\n"
    for k in (0, 1):
        assert "".join(await _lines(slurm_scheduler, app_id, "c", k, streams=Stream.STDOUT)) == (
            expected
        )


@pytest.mark.slurm
@pytest.mark.timeout(150)
async def test_replicas_whose_arguments_fit_alone_run_together(
    slurm_scheduler: SlurmScheduler, job_dir: Path
) -> None:
    """4 replicas of 600 KB of arguments each (each fits the system's limits alone, together they
    do not fit one command line) run: srun's command line holds none of them."""
    big = ["x" * 100_000 for _ in range(6)]
    app = _app(_role("b", "sh", ["-c", 'echo "$#"', "sh", *big], replicas=4))
    app_id = await slurm_scheduler.submit(app, {"job_dir": str(job_dir)})
    resp = await wait_for_state(slurm_scheduler, app_id, timeout=90)
    assert resp.state == AppState.SUCCEEDED, (resp.msg, _batch_out(job_dir, app_id))
    for k in range(4):
        assert await _lines(slurm_scheduler, app_id, "b", k) == ["6\n"]


# -- 2. the job directory ----------------------------------------------------------------------


@pytest.mark.slurm
@pytest.mark.timeout(120)
async def test_a_job_dir_holding_percent_runs_and_keeps_its_logs(
    slurm_scheduler: SlurmScheduler, tmp_path: Path
) -> None:
    """A job_dir holding '%' (Slurm replaces %j... in output paths) runs the app, and its logs and
    the batch script's output are where they belong."""
    directory = tmp_path / "run%jx%%"
    app = _app(_role("p", "echo", ["hello"]))
    app_id = await slurm_scheduler.submit(app, {"job_dir": str(directory)})
    resp = await wait_for_state(slurm_scheduler, app_id, timeout=60)
    assert resp.state == AppState.SUCCEEDED, (resp.state, resp.msg)
    assert await _lines(slurm_scheduler, app_id, "p") == ["hello\n"]
    assert "asynctorchx: exit code 0" in (directory / f"slurm-{app_id}.out").read_text()


@pytest.mark.parametrize("bad", ["/tmp/a\nb", "/tmp/a\tb", "/tmp/a\x7fb", "/tmp/a\\b"])
def test_a_job_dir_slurm_cannot_log_to_is_refused_at_the_dry_run(bad: str) -> None:
    """A job_dir holding a control character or a backslash (Slurm then writes no log) is refused
    at the dry run, naming job_dir and the value."""
    with pytest.raises(InvalidRunConfigException, match="job_dir") as info:
        SlurmScheduler("s").submit_dryrun(_app(_role("t", "echo", ["x"])), {"job_dir": bad})
    assert repr(bad) in str(info.value)


# -- 3. sbatch_args cannot rename the components or move the job -------------------------------


@pytest.mark.parametrize(
    "arg",
    ["--jo=renamed", "--j=renamed", "-HJrenamed", "-kvJx", "--ch=/tmp", "-sDtmp"],
)
def test_every_spelling_of_job_name_or_chdir_in_sbatch_args_is_refused(arg: str) -> None:
    """sbatch takes abbreviated long options and bundled short flags: each spelling of --job-name
    or --chdir is refused, naming sbatch_args and the word."""
    app = _app(_role("t", "echo", ["hi"]))
    with pytest.raises(InvalidRunConfigException, match="sbatch_args") as info:
        SlurmScheduler("s").submit_dryrun(app, {"sbatch_args": [arg]})
    assert repr(arg) in str(info.value)


def test_bundled_short_flags_are_walked_to_the_first_taking_a_value() -> None:
    """-pJ sets the partition 'J' (not a job name); -HJx and -Jx name the job; --part and
    --partition name the partition, --pa (ambiguous for sbatch) may."""
    assert not names_option("-pJ", "job-name", "J")
    assert not names_option("-Hp", "job-name", "J")
    assert names_option("-HJx", "job-name", "J") and names_option("-Jx", "job-name", "J")
    assert names_option("--part=x", "partition", "p")
    assert names_option("--pa=x", "partition", "p")
    assert not names_option("--parsable", "partition", "p")


# -- 4. time and mail-type ---------------------------------------------------------------------


def test_time_is_checked_against_slurms_formats() -> None:
    """time='-5' (Slurm reads ~8000 years) and other undocumented forms are refused at the dry run
    naming time and the value; the formats of sbatch's man page (and UNLIMITED/INFINITE, which
    sbatch takes) pass."""
    app = _app(_role("t", "echo", ["x"]))
    for good in (
        "0",
        "90",
        "1:30",
        "1:00:00",
        "2-0",
        "2-12:30",
        "2-12:30:15",
        "UNLIMITED",
        "inFinite",
    ):
        req = SlurmScheduler("s").submit_dryrun(app, {"time": good})
        assert f"--time={good}" in req.request.materialize()
    for bad in ("-5", "-1", "1:2:3:4", "5m", "1-", "1.5", "1-2-3", "١٢"):
        with pytest.raises(InvalidRunConfigException, match="'time'") as info:
            SlurmScheduler("s").submit_dryrun(app, {"time": bad})
        assert repr(bad) in str(info.value)


def test_mail_type_is_checked_against_slurms_list() -> None:
    """mail-type takes a comma-separated list of Slurm's types (any case); another word is
    refused at the dry run naming mail-type and the value."""
    app = _app(_role("t", "echo", ["x"]))
    for good in ("END,FAIL", "end", "TIME_LIMIT_90,ARRAY_TASKS", "ALL"):
        SlurmScheduler("s").submit_dryrun(app, {"mail-type": good})
    for bad in ("bogus", "END,sometimes", "END,"):
        with pytest.raises(InvalidRunConfigException, match="mail-type") as info:
            SlurmScheduler("s").submit_dryrun(app, {"mail-type": bad})
        assert repr(bad) in str(info.value)


# -- 5. list with accounting down --------------------------------------------------------------


@pytest.mark.slurm
@pytest.mark.timeout(90)
async def test_list_gives_squeues_jobs_when_sacct_fails(
    slurm_cluster: None, slurm_session: str, job_dir: Path, tmp_path: Path
) -> None:
    """On a cluster with accounting, a failing sacct (slurmdbd down) leaves list() with the jobs
    squeue holds instead of raising."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sacct").write_text(
        "#!/bin/sh\necho 'sacct: error: Problem talking to the database: Connection refused' >&2\n"
        "exit 1\n"
    )
    (shim / "sacct").chmod(0o755)
    runner = SubprocessRunner(env={"PATH": f"{shim}:{os.environ['PATH']}"}, timeout=30)
    sched = SlurmScheduler(slurm_session, runner=runner, accounting=True)
    app_id = ""
    try:
        app_id = await sched.submit(_app(_role("l", "sleep", ["30"])), {"job_dir": str(job_dir)})
        listed = {a.app_id: a.state for a in await sched.list()}
        assert app_id in listed and listed[app_id] in (AppState.PENDING, AppState.RUNNING)
    finally:
        if app_id:
            subprocess.run(["scancel", app_id], capture_output=True, timeout=30, check=False)
        await sched.close()


# -- 6. the combined log holds whole lines ------------------------------------------------------


@pytest.mark.slurm
@pytest.mark.timeout(120)
async def test_the_combined_log_never_glues_a_partial_line_to_the_other_streams(
    slurm_scheduler: SlurmScheduler, job_dir: Path
) -> None:
    """A stdout line written in two parts with a stderr line in between is one line in the
    combined log, and so is the stderr line (they were glued into 'out-start err-line')."""
    script = (
        'printf "out-start "; sleep 0.5; echo err-line >&2; sleep 0.5; echo out-end; '
        'printf "no-newline-at-end" >&2'
    )
    app_id = await slurm_scheduler.submit(
        _app(_role("g", "sh", ["-c", script])), {"job_dir": str(job_dir)}
    )
    resp = await wait_for_state(slurm_scheduler, app_id, timeout=60)
    assert resp.state == AppState.SUCCEEDED, (resp.msg, _batch_out(job_dir, app_id))
    combined = await _lines(slurm_scheduler, app_id, "g")
    assert sorted(combined) == ["err-line\n", "no-newline-at-end\n", "out-start out-end\n"]
    assert combined.index("err-line\n") < combined.index("out-start out-end\n")
    assert await _lines(slurm_scheduler, app_id, "g", streams=Stream.STDOUT) == [
        "out-start out-end\n"
    ]


#: the environment of a CLI with no Slurm command on its PATH (no sbatch, squeue or sacct)
NO_SLURM = {**os.environ, "PATH": "/nonexistent"}


def _cli(
    cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asynctorchx", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=cwd,
        check=False,
    )


@pytest.mark.timeout(120)
def test_run_without_sbatch_prints_one_line_and_no_traceback(
    slurm_cluster: None, tmp_path: Path
) -> None:
    """`asynctorchx run -s slurm` with no sbatch on PATH: one error line naming the command (the
    task supervisor logged the submit's exception with its traceback first, although the submit
    passed it on to its caller)."""
    cfg = f"job_dir={tmp_path / 'jd'}"
    done = _cli(
        tmp_path, "run", "-s", "slurm", "-cfg", cfg, "utils.echo", "--msg", "hi", env=NO_SLURM
    )
    assert done.returncode == 1 and done.stdout == ""
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "sbatch" in lines[0], done.stderr


@pytest.mark.timeout(120)
def test_wait_without_squeue_ends_with_one_line_instead_of_hanging(
    slurm_cluster: None, tmp_path: Path
) -> None:
    """`asynctorchx wait HANDLE` of a Slurm app with no squeue on PATH: one error line naming the
    command, exit 1, as status/list/log say it (it waited for ever, taking each failed round for
    an outage); `wait --timeout` no longer says "still running" of an app it never read."""
    cfg = f"job_dir={tmp_path / 'jd'}"
    run = _cli(tmp_path, "run", "-s", "slurm", "-cfg", cfg, "utils.sh", "true")
    assert run.returncode == 0, run.stderr
    handle = run.stdout.strip()
    for args in ([handle], ["--timeout", "3", handle]):
        done = _cli(tmp_path, "wait", *args, env=NO_SLURM)
        assert done.returncode == 1, done
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert any("squeue" in line and "not found" in line for line in lines), done.stderr
        assert "Traceback" not in done.stderr and "still running" not in done.stderr
