"""The slurm backend's dry run: AppDef + cfg -> sbatch command line and batch script (pure, golden)."""

from __future__ import annotations

import copy
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from asynctorchx.schedulers.slurm import SlurmBatchRequest, SlurmScheduler, create_scheduler
from asynctorchx.specs.api import (
    AppDef,
    InvalidAppDefException,
    InvalidRunConfigException,
    Resource,
    Role,
    macros,
)

GOLDEN = Path(__file__).parent / "golden" / "slurm"
UPDATE = os.environ.get("ASYNCTORCHX_UPDATE_GOLDEN") == "1"


def _scheduler() -> SlurmScheduler:
    return SlurmScheduler("sess")


def _two_by_two() -> AppDef:
    trainer = Role(
        name="trainer",
        image="/code",
        entrypoint="python",
        args=[
            "-m",
            "train",
            "--out",
            f"/ckpt/{macros.app_id}/r{macros.replica_id}",
            "--img",
            macros.img_root,
        ],
        env={
            "RANK0": f"${{{macros.rank0_env}}}",
            "RUN": f"run-{macros.app_id}",
            "QUOTED": "a b,'c'",
        },
        num_replicas=2,
        max_retries=3,
        resource=Resource(cpu=2, gpu=1, memMB=1024),
    )
    reader = Role(
        name="reader",
        image="/code",
        entrypoint="sh",
        args=["-c", "echo reading $0 && sleep 1", macros.replica_id],
        num_replicas=2,
        max_retries=1,
        resource=Resource(cpu=1, gpu=0, memMB=512),
    )
    return AppDef(name="two-by-two", roles=[trainer, reader])


def _check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE or not path.exists():
        if not UPDATE:
            pytest.fail(
                f"missing golden file {path}; run with ASYNCTORCHX_UPDATE_GOLDEN=1 to create it"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), (
        f"{name} differs from the golden file (ASYNCTORCHX_UPDATE_GOLDEN=1 rewrites it)"
    )


def test_two_roles_two_replicas_all_options_matches_golden() -> None:
    """A 2x2 app with every option gives the golden sbatch command line and heterogeneous script."""
    cfg: dict[str, Any] = {
        "partition": "debug",
        "time": "1:00:00",
        "constraint": "virtual",
        "qos": "normal",
        "comment": "my sweep, trial 3",
        "mail-user": "me@example.com",
        "mail-type": "END,FAIL",
        "job_dir": "/work/jobs",
        "sbatch_args": ["--account=research", "exclusive"],
    }
    info = _scheduler().submit_dryrun(_two_by_two(), cfg)
    _check_golden("two_by_two.txt", repr(info))


def test_single_replica_defaults_matches_golden() -> None:
    """One replica without a Resource and no options gives a plain (non-het) job script."""
    app = AppDef("echo", [Role("echo", image="/x", entrypoint="echo", args=["hello", "$HOME"])])
    info = _scheduler().submit_dryrun(app, {"job_dir": "/work/jobs"})
    _check_golden("single.txt", repr(info))


def test_nomem_drops_memory_requests() -> None:
    """With nomem=True no component asks for --mem, the other resources stay."""
    info = _scheduler().submit_dryrun(_two_by_two(), {"nomem": True, "job_dir": "/j"})
    script = info.request.materialize()
    assert "--mem" not in script
    assert "--cpus-per-task=2" in script and "--gpus-per-task=1" in script


def test_component_per_replica_in_rank_order() -> None:
    """Every replica of every role is one het component named {role}-{replica}, in rank order."""
    req = _scheduler().submit_dryrun(_two_by_two(), {"job_dir": "/j"}).request
    assert [r.name for r in req.replicas] == ["trainer-0", "trainer-1", "reader-0", "reader-1"]
    script = req.materialize()
    assert script.count("#SBATCH hetjob") == 3
    assert script.count(" :\\\n") == 3  # one srun, four components


def test_max_retries_is_smallest_of_roles() -> None:
    """The job is requeued at most min(role.max_retries) times."""
    req = _scheduler().submit_dryrun(_two_by_two(), {"job_dir": "/j"}).request
    assert req.max_retries == 1
    assert "export TORCHX_MAX_RETRIES=1\n" in req.materialize()


def test_job_dir_defaults_to_absolute_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without job_dir the job runs (and logs) in the absolute current directory at submit time."""
    monkeypatch.chdir(tmp_path)
    req = _scheduler().submit_dryrun(_two_by_two(), {}).request
    assert req.job_dir == str(tmp_path)
    assert f"--chdir={tmp_path}" in req.cmd


def test_relative_job_dir_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A relative job_dir is resolved once, at dry run, so logs never depend on a later cwd."""
    monkeypatch.chdir(tmp_path)
    req = _scheduler().submit_dryrun(_two_by_two(), {"job_dir": "jobs/a"}).request
    assert req.job_dir == str(tmp_path / "jobs" / "a")


def test_dryrun_does_not_modify_app_or_touch_disk(tmp_path: Path) -> None:
    """submit_dryrun leaves the AppDef unchanged and creates nothing (not even job_dir)."""
    app = _two_by_two()
    before = copy.deepcopy(app)
    _scheduler().submit_dryrun(app, {"job_dir": str(tmp_path / "new")})
    assert app == before
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("key", ["partition", "time", "constraint", "qos"])
def test_group_option_with_whitespace_is_rejected(key: str) -> None:
    """A per-component option holding whitespace cannot go on an #SBATCH line: clear cfg error."""
    with pytest.raises(InvalidRunConfigException, match=key):
        _scheduler().submit_dryrun(_two_by_two(), {key: "a b"})


def test_bad_sbatch_arg_is_rejected_naming_it() -> None:
    """An sbatch_args item that is not an option is rejected, naming the item."""
    with pytest.raises(InvalidRunConfigException, match="not an option"):
        _scheduler().submit_dryrun(_two_by_two(), {"sbatch_args": ["not an option"]})


@pytest.mark.parametrize(
    "arg", ["--job-name=myexp", "job-name=myexp", "--job=myexp", "-Jmyexp", "--chdir=/x", "-Djobs"]
)
def test_sbatch_args_cannot_rename_components_or_move_the_job(arg: str) -> None:
    """--job-name (it renamed every component: roles and logs were lost) and --chdir (it overrode
    job_dir) in sbatch_args are refused, naming the option, in any spelling sbatch accepts."""
    with pytest.raises(InvalidRunConfigException, match=r"cannot set --(job-name|chdir)"):
        _scheduler().submit_dryrun(_two_by_two(), {"sbatch_args": [arg]})


@pytest.mark.parametrize("replicas", [[129], [10**9], [100, 29]])
def test_more_replicas_than_a_het_job_has_components_fail_the_dryrun(replicas: list[int]) -> None:
    """More than 128 replicas in all (Slurm's MAX_HET_JOB_COMPONENTS) fail the dry run at once,
    naming the role, num_replicas and the limit (10**9 built the script until memory ran out)."""
    roles = [
        Role(f"r{i}", "/code", entrypoint="true", num_replicas=n) for i, n in enumerate(replicas)
    ]
    with pytest.raises(InvalidAppDefException, match=r"num_replicas \d+ .*at most 128") as info:
        _scheduler().submit_dryrun(AppDef("big", roles), {})
    assert info.value.role == "r0" and info.value.field_name == "num_replicas"


def test_a_het_job_of_128_replicas_is_built() -> None:
    """128 replicas, Slurm's most components of a job, still make a dry run of 128 components."""
    app = AppDef("full", [Role("w", "/code", entrypoint="true", num_replicas=128)])
    script = _scheduler().submit_dryrun(app, {}).request.materialize()
    assert script.count("#SBATCH hetjob") == 127


def test_wrong_cfg_type_names_the_key() -> None:
    """A cfg value of the wrong type is rejected by runopts with the key in the message."""
    with pytest.raises(InvalidRunConfigException, match="sbatch_args"):
        _scheduler().submit_dryrun(_two_by_two(), {"sbatch_args": "--exclusive"})


def test_run_opts_lists_slurm_options() -> None:
    """run_opts declares the group, job, directory and pass-through options."""
    opts = _scheduler().run_opts()
    for key in (
        "partition",
        "time",
        "constraint",
        "qos",
        "comment",
        "mail-user",
        "mail-type",
        "job_dir",
        "nomem",
        "sbatch_args",
    ):
        assert key in opts


def test_create_scheduler_ignores_unknown_kwargs() -> None:
    """The registry factory builds a SlurmScheduler and ignores parameters it does not know."""
    sched = create_scheduler("s", cache_size=3, slurm_accounting=False)
    assert isinstance(sched, SlurmScheduler)
    assert sched.accounting is False


def test_script_is_valid_bash_and_resolves_app_id_at_run_time(tmp_path: Path) -> None:
    """The generated script parses with bash -n, and ${app_id} becomes "$SLURM_JOB_ID" at run time."""
    req: SlurmBatchRequest = _scheduler().submit_dryrun(_two_by_two(), {"job_dir": "/j"}).request
    script = req.materialize()
    assert macros.app_id not in script
    path = tmp_path / "job.sh"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)
    # The quoting of a replica's words survives the shell: evaluate one replica's command file
    # (run as `sh command.sh APP_ID`) with printf instead of exec.
    command = req.replicas[0].command()
    assert command.startswith("exec ")
    out = subprocess.run(
        ["sh", "-c", f"printf '%s\\n' {command[len('exec ') :]}", "sh", "77"],
        env={"PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert "RUN=run-77" in out
    assert "QUOTED=a b,'c'" in out
    assert "/ckpt/77/r0" in out
    assert "RANK0=${TORCHX_RANK0_HOST}" in out
