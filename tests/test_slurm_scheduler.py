"""SlurmScheduler against a fake command runner replaying outputs recorded from the real cluster.

These pin the error paths and the call budget (one squeue, at most one sacct per round); the
behaviour against the real Slurm is in test_slurm_engine.py.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from asynctorchx.schedulers.api import Stream, UnknownRoleException
from asynctorchx.schedulers.slurm import (
    CommandResult,
    SlurmCommandError,
    SlurmNotFoundError,
    SlurmScheduler,
    SlurmSubmitError,
    SubprocessRunner,
)
from asynctorchx.specs.api import (
    AppDef,
    AppState,
    InvalidAppDefException,
    Resource,
    Role,
    UnknownAppException,
)

FIXTURES = Path(__file__).parent / "fixtures" / "slurm"
SCENARIOS: dict[str, dict[str, Any]] = json.loads((FIXTURES / "scenarios.json").read_text())
ERRORS: dict[str, dict[str, Any]] = json.loads((FIXTURES / "errors.json").read_text())
APPS = SCENARIOS["apps"]


class FakeSlurm:
    """A CommandRunner that answers like the recorded cluster and counts the calls per command."""

    def __init__(self, squeue: str, sacct: str = "", sacct_error: str | None = None) -> None:
        self.squeue = squeue
        self.sacct = sacct
        self.sacct_error = sacct_error
        self.scancel: CommandResult | None = None
        self.sbatch: CommandResult | None = None
        self.scontrol: CommandResult | None = None
        self.calls: list[tuple[str, ...]] = []
        self.stdin: list[str | None] = []

    def count(self, program: str) -> int:
        return sum(1 for c in self.calls if c[0] == program)

    async def __call__(self, argv: Sequence[str], *, stdin: str | None = None) -> CommandResult:
        argv = tuple(argv)
        self.calls.append(argv)
        self.stdin.append(stdin)
        await asyncio.sleep(0)
        if argv[0] == "squeue":
            return CommandResult(argv, 0, self.squeue, "")
        if argv[0] == "sacct":
            if self.sacct_error is not None:
                return CommandResult(argv, 1, "", self.sacct_error)
            return CommandResult(argv, 0, self.sacct, "")
        if argv[0] == "scancel" and self.scancel is not None:
            return self.scancel
        if argv[0] == "sbatch" and self.sbatch is not None:
            return self.sbatch
        if argv[0] == "scontrol" and self.scontrol is not None:
            return self.scontrol
        return CommandResult(argv, 0, "", "")


def _recorded(name: str, workdir: Path | None = None) -> str:
    text = (FIXTURES / name).read_text()
    if workdir is not None:
        recorded = SCENARIOS["job_dir"]
        text = text.replace(recorded.replace("/", "\\/"), str(workdir).replace("/", "\\/"))
        text = text.replace(recorded, str(workdir))
    return text


def _error(key: str) -> CommandResult:
    e = ERRORS[key]
    return CommandResult(tuple(e["argv"]), e["returncode"], e["stdout"], e["stderr"])


def _app() -> AppDef:
    return AppDef("a", [Role("w", "/tmp", entrypoint="true", resource=Resource(1, 0, 64))])


# -- submitting --------------------------------------------------------------------------------


async def test_schedule_passes_script_on_stdin_and_returns_job_id(tmp_path: Path) -> None:
    """schedule runs sbatch --parsable with the script on stdin and returns the printed job id."""
    fake = FakeSlurm("")
    fake.sbatch = CommandResult(("sbatch",), 0, "4242\n", "")
    sched = SlurmScheduler("s", runner=fake)
    info = sched.submit_dryrun(_app(), {"job_dir": str(tmp_path / "jobs")})
    assert await sched.schedule(info) == "4242"
    assert fake.calls[0][:2] == ("sbatch", "--parsable")
    assert fake.stdin[0] == info.request.materialize()
    assert (tmp_path / "jobs").is_dir()


@pytest.mark.parametrize(
    ("key", "words"),
    [
        ("unknown_partition", "invalid partition specified: nosuchpartition"),
        ("bad_time", "Invalid --time specification"),
        ("too_much_memory", "Memory specification can not be satisfied"),
        ("too_many_cpus", "More processors requested than permitted"),
        ("time_over_partition_limit", "Requested time limit is invalid"),
    ],
)
async def test_rejected_submit_carries_sbatch_message(key: str, words: str, tmp_path: Path) -> None:
    """A job sbatch rejects raises SlurmSubmitError carrying sbatch's own (recorded) message."""
    fake = FakeSlurm("")
    fake.sbatch = _error(key)
    sched = SlurmScheduler("s", runner=fake)
    with pytest.raises(SlurmSubmitError, match="nothing was queued") as info:
        await sched.submit(_app(), {"job_dir": str(tmp_path)})
    assert words in str(info.value)
    assert info.value.returncode == ERRORS[key]["returncode"]


async def test_a_job_dir_that_is_a_file_is_an_error_naming_the_option(tmp_path: Path) -> None:
    """job_dir naming a file (or a path below one) fails naming 'job_dir' and the path; no sbatch."""
    afile = tmp_path / "afile"
    afile.write_text("")
    fake = FakeSlurm("")
    sched = SlurmScheduler("s", runner=fake)
    for job_dir in (afile, afile / "sub"):
        with pytest.raises(OSError, match="run option 'job_dir'") as info:
            await sched.submit(_app(), {"job_dir": str(job_dir)})
        assert str(job_dir) in str(info.value)
    assert fake.count("sbatch") == 0


async def test_missing_sbatch_names_what_to_install(tmp_path: Path) -> None:
    """Without sbatch on PATH (real subprocess runner) the error names the package to install."""
    sched = SlurmScheduler("s", runner=SubprocessRunner(env={"PATH": str(tmp_path)}))
    with pytest.raises(
        SlurmNotFoundError, match=r"'sbatch' was not found.*apt-get install slurm-client"
    ):
        await sched.submit(_app(), {"job_dir": str(tmp_path)})


async def test_missing_squeue_names_what_to_install(tmp_path: Path) -> None:
    """A missing squeue raises the same install hint from describe."""
    sched = SlurmScheduler("s", runner=SubprocessRunner(env={"PATH": str(tmp_path)}))
    with pytest.raises(SlurmNotFoundError, match="'squeue'"):
        await sched.describe("1")


async def test_a_hung_wrapper_command_times_out_naming_it_and_leaves_no_process(
    tmp_path: Path,
) -> None:
    """A squeue that is a wrapper script whose child hangs: TimeoutError naming squeue at the
    timeout, and the child is killed too (it held the pipes: the call lasted as long as it did)."""
    pidfile = tmp_path / "child.pid"
    squeue = tmp_path / "squeue"
    squeue.write_text(f"#!/bin/sh\nsleep 60 &\necho $! >{pidfile}\nwait\n")
    squeue.chmod(0o755)
    runner = SubprocessRunner(env={"PATH": f"{tmp_path}:{os.environ['PATH']}"}, timeout=0.5)
    sched = SlurmScheduler("s", runner=runner)
    with anyio.fail_after(20):
        with pytest.raises(TimeoutError, match=r"squeue did not finish within 0\.5 s"):
            await sched.describe("1")
    child = int(pidfile.read_text())
    for _ in range(100):  # bounded: the killed child is reaped by init
        try:
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            break
        if state == "Z":
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail(f"the wrapper's child {child} still runs")


async def test_cancelled_submit_withdraws_the_job(tmp_path: Path) -> None:
    """Cancelling schedule() while sbatch runs lets it finish and scancels the job it queued."""
    release = asyncio.Event()
    calls: list[tuple[str, ...]] = []

    async def slow_sbatch(argv: Sequence[str], *, stdin: str | None = None) -> CommandResult:
        calls.append(tuple(argv))
        if argv[0] == "sbatch":
            await release.wait()
            return CommandResult(tuple(argv), 0, "99\n", "")
        return CommandResult(tuple(argv), 0, "", "")

    sched = SlurmScheduler("s", runner=slow_sbatch)
    task = asyncio.ensure_future(sched.submit(_app(), {"job_dir": str(tmp_path)}))
    while not calls:
        await asyncio.sleep(0)
    task.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        if ("scancel", "99") in calls:
            break
        await asyncio.sleep(0.01)
    assert ("scancel", "99") in calls


PARTITIONS = (
    "PartitionName=small Default=YES Nodes=n[1-2] TotalNodes=2\n"
    "PartitionName=big Default=NO Nodes=n[1-8] TotalNodes=8\n"
    "PartitionName=gpu Default=NO Nodes=g[1-4] TotalNodes=4\n"
    "PartitionName=odd Default=NO Nodes=n[1-2]{x} TotalNodes=2\n"
)


def _replicas(n: int) -> AppDef:
    return AppDef("a", [Role("w", "/tmp", entrypoint="true", num_replicas=n)])


@pytest.mark.parametrize(
    ("cfg", "replicas", "refused"),
    [
        ({}, 3, True),  # the default partition has 2 nodes
        ({}, 2, False),
        ({"partition": "big"}, 8, False),
        ({"partition": "big"}, 9, True),
        ({"partition": "small,big"}, 8, False),  # either partition: n1..n8
        ({"partition": "small,big"}, 9, True),  # small's nodes are big's too: 8 nodes in all
        ({"partition": "big,gpu"}, 12, False),  # either partition: up to 8 + 4 nodes
        ({"partition": "big,gpu"}, 13, True),
        ({"partition": "small,odd"}, 4, False),  # an unreadable node list: counted as given
        ({"partition": "unlisted"}, 9, False),  # not listed (hidden, or a typo sbatch reports)
        ({"sbatch_args": ["--partition=small"]}, 9, False),  # sbatch_args decide: not checked
        ({"sbatch_args": ["-Mother"]}, 9, False),  # another cluster: not checked
    ],
)
async def test_more_replicas_than_the_partition_has_nodes_are_refused_before_sbatch(
    cfg: dict[str, Any], replicas: int, refused: bool, tmp_path: Path
) -> None:
    """An app with more replicas than its partition has nodes (which Slurm never starts) is refused
    naming the role, num_replicas, the partition and its node count, and sbatch never runs; several
    partitions count each node once (they may share nodes); the check is skipped when sbatch_args
    choose the partition or the cluster, or scontrol does not list it."""
    fake = FakeSlurm("")
    fake.sbatch = CommandResult(("sbatch",), 0, "7\n", "")
    fake.scontrol = CommandResult(("scontrol",), 0, PARTITIONS, "")
    sched = SlurmScheduler("s", runner=fake)
    cfg = {"job_dir": str(tmp_path / "jobs"), **cfg}
    if not refused:
        assert await sched.submit(_replicas(replicas), cfg) == "7"
        return
    with pytest.raises(
        InvalidAppDefException, match=rf"num_replicas {replicas} .* (has|have) \d+ nodes"
    ):
        await sched.submit(_replicas(replicas), cfg)
    assert fake.count("sbatch") == 0
    assert not (tmp_path / "jobs").exists()


async def test_partition_sizes_cost_one_scontrol_per_ttl_and_none_for_one_replica(
    tmp_path: Path,
) -> None:
    """Apps of one replica ask nothing; apps of several share one scontrol while it is fresh."""
    fake = FakeSlurm("")
    fake.sbatch = CommandResult(("sbatch",), 0, "7\n", "")
    fake.scontrol = CommandResult(("scontrol",), 0, PARTITIONS, "")
    sched = SlurmScheduler("s", runner=fake)
    cfg = {"job_dir": str(tmp_path)}
    await sched.submit(_replicas(1), cfg)
    assert fake.count("scontrol") == 0
    for _ in range(3):
        await sched.submit(_replicas(2), cfg)
    assert fake.count("scontrol") == 1


async def test_a_failing_scontrol_does_not_block_the_submit(tmp_path: Path) -> None:
    """When scontrol cannot list the partitions the app is submitted unchecked (sbatch decides)."""
    fake = FakeSlurm("")
    fake.sbatch = CommandResult(("sbatch",), 0, "7\n", "")
    fake.scontrol = CommandResult(("scontrol",), 1, "", "slurm_load_partitions: Unable to contact")
    sched = SlurmScheduler("s", runner=fake)
    assert await sched.submit(_replicas(5), {"job_dir": str(tmp_path)}) == "7"


# -- describing --------------------------------------------------------------------------------


async def test_fifty_apps_cost_one_squeue_and_at_most_one_sacct_per_round() -> None:
    """describe_many for 50 apps (recorded + unknown ids) runs squeue once and sacct at most once."""
    fake = FakeSlurm(_recorded("squeue-live.json"), _recorded("sacct-final.txt"))
    sched = SlurmScheduler("s", runner=fake, accounting=True)
    known = [a["app_id"] for a in APPS.values()]
    ids = known + [str(90000 + i) for i in range(50 - len(known))]
    for round_no in range(1, 4):
        result = await sched.describe_many(ids)
        assert set(result) == set(ids)
        assert fake.count("squeue") == round_no
        assert fake.count("sacct") <= round_no
    assert all(result[i] is None for i in ids if i.startswith("9"))


async def test_sacct_only_for_apps_squeue_forgot() -> None:
    """Apps gone from squeue are described from sacct: final state, restarts, replica layout."""
    fake = FakeSlurm('{"jobs": []}', _recorded("sacct-final.txt"))
    sched = SlurmScheduler("s", runner=fake, accounting=True)
    result = await sched.describe_many([a["app_id"] for a in APPS.values()])
    for key, app in APPS.items():
        resp = result[app["app_id"]]
        assert resp is not None, key
        assert resp.state == AppState[app["state"]], key
        assert resp.num_restarts == app.get("restarts", 0), key
        assert {rs.role: len(rs.replicas) for rs in resp.roles_statuses} == app["replicas"], key
    assert fake.count("sacct") == 1
    sacct = next(c for c in fake.calls if c[0] == "sacct")
    assert "--duplicates" in sacct and "--parsable2" in sacct


async def test_finished_apps_are_not_asked_again() -> None:
    """Once an app is final (and accounting agrees), describing it again runs no command."""
    fake = FakeSlurm(_recorded("squeue-final.json"), _recorded("sacct-final.txt"))
    sched = SlurmScheduler("s", runner=fake, accounting=True)
    app_id = APPS["failed"]["app_id"]
    first = await sched.describe(app_id)
    calls = len(fake.calls)
    assert await sched.describe(app_id) is first
    assert len(fake.calls) == calls


async def test_failed_app_reports_replica_exit_codes_from_accounting() -> None:
    """With accounting, the failing replica carries its exit code and the killed one 128+SIGTERM."""
    fake = FakeSlurm(_recorded("squeue-final.json"), _recorded("sacct-final.txt"))
    sched = SlurmScheduler("s", runner=fake, accounting=True)
    resp = await sched.describe(APPS["failed"]["app_id"])
    assert resp is not None and resp.state == AppState.FAILED
    assert [(r.id, r.exit_code) for r in resp.roles_statuses[0].replicas] == [(0, 3), (1, 143)]
    assert "exit code 3" in resp.msg


async def test_failed_app_reports_exit_codes_from_job_dir_without_accounting(
    tmp_path: Path,
) -> None:
    """Without accounting the replicas' exit codes come from the exit_code files in the job dir."""
    app_id = APPS["failed"]["app_id"]
    rep0 = tmp_path / f"slurm-{app_id}" / "worker" / "0"
    rep0.mkdir(parents=True)
    (rep0 / "exit_code").write_text("3\n")
    fake = FakeSlurm(_recorded("squeue-final.json", tmp_path))
    sched = SlurmScheduler("s", runner=fake, accounting=False)
    resp = await sched.describe(app_id)
    assert resp is not None and resp.state == AppState.FAILED
    assert [(r.id, r.exit_code) for r in resp.roles_statuses[0].replicas] == [(0, 3), (1, None)]
    assert "exit code 3" in resp.msg
    assert fake.count("sacct") == 0


async def test_accounting_disabled_is_detected_once() -> None:
    """sacct's 'accounting storage is disabled' switches to squeue only; sacct is not asked again."""
    fake = FakeSlurm('{"jobs": []}', sacct_error=ERRORS["sacct_parsable_no_accounting"]["stderr"])
    sched = SlurmScheduler("s", runner=fake)
    assert sched.accounting is None
    assert await sched.describe_many(["5", "6"]) == {"5": None, "6": None}
    assert sched.accounting is False
    assert await sched.describe("7") is None
    assert fake.count("sacct") == 1 and fake.count("squeue") == 2


async def test_forced_accounting_raises_when_disabled() -> None:
    """accounting=True on a cluster without accounting raises instead of guessing."""
    fake = FakeSlurm('{"jobs": []}', sacct_error=ERRORS["sacct_parsable_no_accounting"]["stderr"])
    sched = SlurmScheduler("s", runner=fake, accounting=True)
    with pytest.raises(SlurmCommandError, match="accounting storage is disabled"):
        await sched.describe("5")


async def test_squeue_only_never_calls_sacct_and_absent_is_unknown() -> None:
    """accounting=False: a job squeue does not list is None (unknown), never SUCCEEDED."""
    fake = FakeSlurm(_recorded("squeue-final.json"))
    sched = SlurmScheduler("s", runner=fake, accounting=False)
    result = await sched.describe_many(["123456", APPS["single"]["app_id"]])
    assert result["123456"] is None
    single = result[APPS["single"]["app_id"]]
    assert single is not None and single.state == AppState.SUCCEEDED
    assert fake.count("sacct") == 0


async def test_an_unparsable_listing_of_megabytes_gives_a_short_error() -> None:
    """A squeue listing that a banner line makes unparsable: the error quotes its start, not 2 MB."""
    listing = json.dumps({"jobs": [{"job_id": i, "name": "x" * 100} for i in range(15_000)]})
    fake = FakeSlurm(f"Maintenance on Friday!\n{listing}")
    sched = SlurmScheduler("s", runner=fake, accounting=False)
    with pytest.raises(SlurmCommandError, match="did not print JSON") as info:
        await sched.describe("5")
    assert "Maintenance on Friday!" in str(info.value)
    assert len(str(info.value)) < 2000


@pytest.mark.parametrize("app_id", ["", "abc", "12_3", "1.batch", "../1"])
async def test_malformed_ids_are_unknown_without_calls(app_id: str) -> None:
    """An id that cannot be a Slurm job id is unknown, and asks Slurm nothing."""
    fake = FakeSlurm(_recorded("squeue-final.json"))
    sched = SlurmScheduler("s", runner=fake)
    assert await sched.describe(app_id) is None
    assert not await sched.exists(app_id)
    assert fake.calls == []


async def test_controller_down_raises_instead_of_forgetting_apps() -> None:
    """squeue printing errors (exit 0, empty list) raises, so no app is reported gone."""
    fake = FakeSlurm(ERRORS["squeue_controller_down"]["stdout"])
    sched = SlurmScheduler("s", runner=fake, accounting=False)
    with pytest.raises(SlurmCommandError, match="Failed while looking for jobs"):
        await sched.describe_many(["1", "2"])


async def test_squeue_nonzero_exit_raises() -> None:
    """A failing squeue raises SlurmCommandError with its stderr."""

    async def broken(argv: Sequence[str], *, stdin: str | None = None) -> CommandResult:
        return CommandResult(tuple(argv), 1, "", "squeue: error: something broke")

    with pytest.raises(SlurmCommandError, match="something broke"):
        await SlurmScheduler("s", runner=broken).describe("1")


async def test_sacct_failure_for_finished_apps_falls_back_to_squeue() -> None:
    """If sacct fails (slurmdbd down) but squeue shows the apps, the round still answers."""
    fake = FakeSlurm(
        _recorded("squeue-final.json"), sacct_error="sacct: error: Problem talking to the database"
    )
    sched = SlurmScheduler("s", runner=fake, accounting=True)
    resp = await sched.describe(APPS["single"]["app_id"])
    assert resp is not None and resp.state == AppState.SUCCEEDED


async def test_sacct_failure_for_forgotten_apps_raises() -> None:
    """If sacct fails and squeue has forgotten an app, the round raises (the app is not lost)."""
    fake = FakeSlurm('{"jobs": []}', sacct_error="sacct: error: Problem talking to the database")
    sched = SlurmScheduler("s", runner=fake, accounting=True)
    with pytest.raises(SlurmCommandError, match="database"):
        await sched.describe("5")


# -- cancel and list ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("squeue", "app_id"), [("squeue-final.json", "999"), ("squeue-final.json", "38")]
)
async def test_cancel_of_an_unknown_or_finished_app_runs_no_scancel(
    squeue: str, app_id: str
) -> None:
    """Cancelling an app Slurm does not know (999) or that has finished (38) is a no-op: the
    template's exists() asks squeue (and sacct), and no scancel runs."""
    fake = FakeSlurm(_recorded(squeue))
    await SlurmScheduler("s", runner=fake, accounting=False).cancel(app_id)
    assert fake.count("scancel") == 0 and fake.count("squeue") == 1


@pytest.mark.parametrize("key", ["scancel_unknown_job", "scancel_finished_job", "invalid_job_id"])
async def test_cancel_of_a_job_that_ends_meanwhile_is_not_an_error(key: str) -> None:
    """A running app (33) that ends between squeue and scancel: scancel's answers for an unknown or
    finished job (recorded), or older scancels' 'Invalid job id specified', are not errors."""
    fake = FakeSlurm(_recorded("squeue-live.json"))
    fake.scancel = (
        CommandResult(
            ("scancel",),
            1,
            "",
            "scancel: error: Kill job error on job id 33: Invalid job id specified\n",
        )
        if key == "invalid_job_id"
        else _error(key)
    )
    await SlurmScheduler("s", runner=fake, accounting=False).cancel("33")
    assert fake.calls[-1] == ("scancel", "33")


async def test_cancel_with_controller_down_raises() -> None:
    """scancel failing for another reason raises, carrying scancel's message; so does a squeue that
    cannot reach the controller (nothing is scancelled then)."""
    fake = FakeSlurm(_recorded("squeue-live.json"))
    fake.scancel = _error("scancel_controller_down")
    with pytest.raises(SlurmCommandError, match="Unable to contact slurm controller"):
        await SlurmScheduler("s", runner=fake, accounting=False).cancel("33")
    down = FakeSlurm(_error("squeue_controller_down").stdout)
    with pytest.raises(SlurmCommandError, match="squeue failed"):
        await SlurmScheduler("s", runner=down, accounting=False).cancel("33")
    assert down.count("scancel") == 0


async def test_cancel_of_malformed_id_does_nothing() -> None:
    """Cancelling something that is not a job id runs no command."""
    fake = FakeSlurm("")
    await SlurmScheduler("s", runner=fake).cancel("not-a-job")
    assert fake.calls == []


async def test_list_merges_squeue_and_sacct_with_handles() -> None:
    """list gives one entry per app (not per component) with its handle, from squeue and sacct."""
    fake = FakeSlurm(_recorded("squeue-final.json"), _recorded("sacct-final.txt"))
    apps = await SlurmScheduler("sess", runner=fake, accounting=True).list()
    by_id = {a.app_id: a for a in apps}
    for key, app in APPS.items():
        assert by_id[app["app_id"]].state == AppState[app["state"]], key
        assert by_id[app["app_id"]].app_handle == f"slurm://sess/{app['app_id']}"
    assert "28" not in by_id  # a component id, not an app


# -- logs --------------------------------------------------------------------------------------


async def test_log_iter_rejects_an_unknown_stream() -> None:
    """An unknown stream is a ValueError naming the supported ones, raised by the call."""
    sched = SlurmScheduler("s", runner=FakeSlurm(_recorded("squeue-final.json")))
    with pytest.raises(
        ValueError, match=r"unsupported log stream 'both'; the slurm scheduler reads stdout"
    ):
        sched.log_iter(APPS["single"]["app_id"], "solo", streams="both")  # type: ignore[arg-type]


async def test_log_iter_unknown_app_and_role() -> None:
    """An unknown app raises UnknownAppException; an unknown role or replica UnknownRoleException."""
    sched = SlurmScheduler("s", runner=FakeSlurm(_recorded("squeue-final.json")), accounting=False)
    with pytest.raises(UnknownAppException):
        async for _ in sched.log_iter("999999", "w"):
            pass
    with pytest.raises(UnknownRoleException, match="no role 'nope'"):
        async for _ in sched.log_iter(APPS["single"]["app_id"], "nope"):
            pass
    with pytest.raises(UnknownRoleException, match="out of range"):
        async for _ in sched.log_iter(APPS["single"]["app_id"], "solo", k=1):
            pass


async def test_log_iter_reads_replica_files_with_regex(tmp_path: Path) -> None:
    """log_iter reads combined.log by default, stdout.log/stderr.log on request, under the workdir."""
    app_id = APPS["success_2x2"]["app_id"]
    d = tmp_path / f"slurm-{app_id}" / "reader" / "1"
    d.mkdir(parents=True)
    (d / "stdout.log").write_bytes(b"one\ntwo \xff\nthree")
    (d / "stderr.log").write_text("warn\n")
    (d / "combined.log").write_text("one\nwarn\ntwo\n")
    sched = SlurmScheduler(
        "s", runner=FakeSlurm(_recorded("squeue-final.json", tmp_path)), accounting=False
    )
    lines = [ln async for ln in sched.log_iter(app_id, "reader", 1, streams=Stream.STDOUT)]
    assert lines == ["one\n", "two \ufffd\n", "three"]
    assert [ln async for ln in sched.log_iter(app_id, "reader", 1, streams="stderr")] == ["warn\n"]
    assert [ln async for ln in sched.log_iter(app_id, "reader", 1)] == ["one\n", "warn\n", "two\n"]
    assert [
        ln async for ln in sched.log_iter(app_id, "reader", 1, regex="^t", streams=Stream.STDOUT)
    ] == [
        "two \ufffd\n",
        "three",
    ]


async def test_log_iter_of_a_job_without_combined_log_reads_stdout_then_stderr(
    tmp_path: Path,
) -> None:
    """A replica of a job older than combined.log is read as its stdout.log, then its stderr.log."""
    app_id = APPS["success_2x2"]["app_id"]
    d = tmp_path / f"slurm-{app_id}" / "reader" / "0"
    d.mkdir(parents=True)
    (d / "stdout.log").write_text("out\n")
    (d / "stderr.log").write_text("err\n")
    sched = SlurmScheduler(
        "s", runner=FakeSlurm(_recorded("squeue-final.json", tmp_path)), accounting=False
    )
    assert [ln async for ln in sched.log_iter(app_id, "reader", 0)] == ["out\n", "err\n"]
    assert [ln async for ln in sched.log_iter(app_id, "reader", 0, regex="err")] == ["err\n"]


@pytest.mark.timeout(30)
async def test_tail_asks_squeue_at_most_every_interval(tmp_path: Path) -> None:
    """Following a quiet log asks squeue at most once per state_check_interval, and stops at the end."""
    app_id = APPS["success_2x2"]["app_id"]
    live = _recorded("squeue-live.json", tmp_path)
    final = _recorded("squeue-final.json", tmp_path)
    fake = FakeSlurm(live)
    d = tmp_path / f"slurm-{app_id}" / "trainer" / "0"
    d.mkdir(parents=True)
    log = d / "stdout.log"
    log.write_text("first\n")
    interval = 0.4
    sched = SlurmScheduler("s", runner=fake, accounting=False, state_check_interval=interval)
    got: list[str] = []
    first = asyncio.Event()

    async def follow() -> None:
        async for line in sched.log_iter(
            app_id, "trainer", 0, should_tail=True, streams=Stream.STDOUT
        ):
            got.append(line)
            first.set()

    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(follow())
    await asyncio.wait_for(first.wait(), 10)
    started = loop.time()
    deadline = started + 2.0
    while loop.time() < deadline and not task.done():  # a quiet log for ~2 s
        await asyncio.sleep(0.05)
    quiet_calls = fake.count("squeue")
    elapsed = loop.time() - started
    with log.open("a") as f:
        f.write("last\n")
    fake.squeue = final
    await asyncio.wait_for(task, 15)
    assert got == ["first\n", "last\n"]
    assert quiet_calls <= 2 + elapsed / interval
