# ruff: noqa: F811 - the fixtures imported from _slurm_env are redefined as test parameters
"""The slurm backend against two real Slurm test clusters: one with accounting (acct: sacct and
squeue) and one without (noacct: squeue only, the backend finding out by itself from sacct's
refusal that there is no accounting).

Needs ``scripts/engines/slurm.sh`` (4 virtual nodes, slurmdbd) and ``scripts/engines/slurm_noacct.sh``
(4 more virtual nodes, no accounting); skips without them, fails in CI.
"""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
from pathlib import Path

import anyio
import pytest
from _slurm_env import (  # noqa: F401 - pytest fixtures, used as test parameters
    NO_ACCOUNTING_MESSAGE,
    REPO,
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
from conftest import engine_missing

from asynctorchx.runner import AsyncRunner
from asynctorchx.schedulers.api import Stream
from asynctorchx.schedulers.slurm import SlurmScheduler, SlurmSubmitError
from asynctorchx.specs.api import (
    AppDef,
    AppState,
    InvalidAppDefException,
    InvalidRunConfigException,
    Resource,
    Role,
)

pytestmark = [pytest.mark.slurm]

SMALL = Resource(cpu=1, gpu=0, memMB=64)


def sh(name: str, script: str, replicas: int = 1, retries: int = 0) -> Role:
    return Role(
        name=name,
        image="/tmp",
        entrypoint="sh",
        args=["-c", script],
        num_replicas=replicas,
        max_retries=retries,
        resource=SMALL,
    )


def _my_live_jobs() -> set[str]:
    out = subprocess.run(
        [
            "squeue",
            "-h",
            "--me",
            "-t",
            "PENDING,RUNNING,CONFIGURING,COMPLETING,SUSPENDED",
            "-o",
            "%i",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return set(out.split())


def _cluster_nodes() -> list[str]:
    """The nodes of the test's cluster (node1..4 with accounting, nacct1..4 without)."""
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-p", "debug", "-o", "%N"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return sorted(set(out.split()))


@pytest.mark.timeout(90)
async def test_two_roles_two_replicas_succeed(
    slurm_scheduler: SlurmScheduler, job_dir: Path
) -> None:
    """A 2-role x 2-replica hetjob succeeds: four components on four nodes, each replica SUCCEEDED."""
    app = AppDef(
        "twobytwo",
        [
            sh("trainer", 'echo "trainer $TORCHX_RANK0_HOST"', replicas=2),
            sh("reader", "echo reader", replicas=2),
        ],
    )
    app_id = await slurm_scheduler.submit(app, {"job_dir": str(job_dir)})
    resp = await wait_for_state(slurm_scheduler, app_id)
    assert resp.state == AppState.SUCCEEDED, resp.msg
    assert resp.num_restarts == 0
    replicas = {(r.role, r.id): r for rs in resp.roles_statuses for r in rs.replicas}
    assert sorted(replicas) == [("reader", 0), ("reader", 1), ("trainer", 0), ("trainer", 1)]
    assert {r.state for r in replicas.values()} == {AppState.SUCCEEDED}
    assert {r.exit_code for r in replicas.values()} == {0}
    assert sorted(r.hostname for r in replicas.values()) == _cluster_nodes()  # one node each
    assert {r.name: r.num_replicas for r in resp.roles} == {"trainer": 2, "reader": 2}
    rank0 = replicas[("trainer", 0)].hostname
    lines = [
        ln async for ln in slurm_scheduler.log_iter(app_id, "trainer", 1, streams=Stream.STDOUT)
    ]
    assert lines == [f"trainer {rank0}\n"]  # rank 0's host from het group 0's node list


@pytest.mark.timeout(90)
async def test_failing_replica_fails_app_with_its_exit_code(
    slurm_scheduler: SlurmScheduler, job_dir: Path
) -> None:
    """Replica 1 exiting 3 fails the app with exit code 3; the other replica is stopped."""
    script = 'if [ "$SLURM_PROCID" = 1 ]; then sleep 0.5; exit 3; fi; sleep 60'
    app_id = await slurm_scheduler.submit(
        AppDef("fails", [sh("worker", script, 2)]), {"job_dir": str(job_dir)}
    )
    resp = await wait_for_state(slurm_scheduler, app_id, timeout=60)
    assert resp.state == AppState.FAILED
    assert "exit code 3" in resp.msg
    [worker] = resp.roles_statuses
    by_id = {r.id: r for r in worker.replicas}
    assert by_id[1].exit_code == 3 and by_id[1].state == AppState.FAILED
    # replica 0 was stopped by --kill-on-bad-exit: SIGTERM (128+15) when its wrapper saw it
    assert by_id[0].exit_code in (143, None)
    assert by_id[0].state == AppState.FAILED


@pytest.mark.timeout(60)
async def test_cancel_pending_job(slurm_scheduler: SlurmScheduler, job_dir: Path) -> None:
    """A pending job cancels to CANCELLED; cancelling it again is a no-op."""
    cfg = {"job_dir": str(job_dir), "sbatch_args": ["--begin=now+3600"]}
    app_id = await slurm_scheduler.submit(AppDef("later", [sh("w", "true", 2)]), cfg)
    pending = await wait_for_state(slurm_scheduler, app_id, {AppState.PENDING})
    assert "BeginTime" in pending.msg
    await slurm_scheduler.cancel(app_id)
    resp = await wait_for_state(slurm_scheduler, app_id, timeout=30)
    assert resp.state == AppState.CANCELLED
    await slurm_scheduler.cancel(app_id)
    assert app_id not in _my_live_jobs()


@pytest.mark.timeout(60)
async def test_cancel_running_job(slurm_scheduler: SlurmScheduler, job_dir: Path) -> None:
    """A running 2-replica job cancels to CANCELLED promptly and leaves no job running."""
    app_id = await slurm_scheduler.submit(
        AppDef("long", [sh("w", 'echo "up $SLURM_PROCID"; sleep 120', 2)]),
        {"job_dir": str(job_dir)},
    )
    await wait_for_state(slurm_scheduler, app_id, {AppState.RUNNING})
    # Both replicas run (not only the allocation): a cancel that lands while srun is still
    # starting the step can leave Slurm's step cleanup waiting 60 s for the step's I/O
    # ("Abandoning IO 60 secs after job shutdown initiated"), a Slurm race this test is not about.
    for k in range(2):
        lines = slurm_scheduler.log_iter(app_id, "w", k, should_tail=True, streams=Stream.STDOUT)
        assert await anext(lines) == f"up {k}\n"
        await lines.aclose()
    loop = asyncio.get_running_loop()
    started = loop.time()
    await slurm_scheduler.cancel(app_id)
    assert loop.time() - started < 5  # scancel returns without waiting for the job to end
    resp = await wait_for_state(slurm_scheduler, app_id, timeout=30)
    assert resp.state == AppState.CANCELLED
    await slurm_scheduler.cancel(app_id)
    for _ in range(100):
        if app_id not in _my_live_jobs():
            break
        await asyncio.sleep(0.2)
    assert app_id not in _my_live_jobs()


@pytest.mark.timeout(90)
async def test_logs_per_replica_with_tail_and_regex(
    slurm_scheduler: SlurmScheduler, job_dir: Path
) -> None:
    """Each replica has its own stdout/stderr; tail follows a running replica until the app ends."""
    script = 'for i in 1 2 3; do echo "r$SLURM_PROCID line $i"; sleep 0.3; done; echo "r$SLURM_PROCID oops" >&2'
    app_id = await slurm_scheduler.submit(
        AppDef("logs", [sh("w", script, 2)]), {"job_dir": str(job_dir)}
    )
    await wait_for_state(slurm_scheduler, app_id, {AppState.RUNNING, AppState.SUCCEEDED})
    tailed = [
        ln
        async for ln in slurm_scheduler.log_iter(
            app_id, "w", 1, should_tail=True, streams=Stream.STDOUT
        )
    ]
    assert tailed == ["r1 line 1\n", "r1 line 2\n", "r1 line 3\n"]
    resp = await slurm_scheduler.describe(app_id)
    assert resp is not None and resp.state == AppState.SUCCEEDED  # the tail ended with the app
    only_2 = [
        ln
        async for ln in slurm_scheduler.log_iter(
            app_id, "w", 0, regex=r"line [2]", streams=Stream.STDOUT
        )
    ]
    assert only_2 == ["r0 line 2\n"]
    stderr = [ln async for ln in slurm_scheduler.log_iter(app_id, "w", 0, streams=Stream.STDERR)]
    assert stderr == ["r0 oops\n"]
    # another scheduler object (another process, another cwd) finds the logs through Slurm
    fresh = SlurmScheduler("other", accounting=slurm_scheduler.accounting)
    assert [ln async for ln in fresh.log_iter(app_id, "w", 1, streams=Stream.STDOUT)] == tailed


# The replica writes a line, then waits until it is in its combined.log before it writes the next
# one on the other stream: the order of the lines across the two streams is then known.
_HANDSHAKE = """
log="slurm-$SLURM_JOB_ID/w/0/combined.log"
say() {
    if [ "$1" = out ]; then echo "$2"; else echo "$2" >&2; fi
    for i in $(seq 1000); do grep -qx "$2" "$log" && return; sleep 0.01; done
    exit 9
}
say out o1; say err e1; say out o2; say err e2
"""


@pytest.mark.timeout(90)
async def test_default_log_is_everything_the_replica_wrote_in_order(
    slurm_scheduler: SlurmScheduler, job_dir: Path
) -> None:
    """Without streams, log_iter gives stdout and stderr interleaved in write order, tailed or not;
    a replica that wrote only to stdout is not empty."""
    app = AppDef("both", [sh("w", _HANDSHAKE), sh("quiet", "echo only out")])
    app_id = await slurm_scheduler.submit(app, {"job_dir": str(job_dir)})
    await wait_for_state(slurm_scheduler, app_id, {AppState.RUNNING, AppState.SUCCEEDED})
    tailed = [ln async for ln in slurm_scheduler.log_iter(app_id, "w", 0, should_tail=True)]
    resp = await wait_for_state(slurm_scheduler, app_id)
    assert resp.state == AppState.SUCCEEDED, resp.msg
    assert tailed == ["o1\n", "e1\n", "o2\n", "e2\n"]
    assert [ln async for ln in slurm_scheduler.log_iter(app_id, "w", 0)] == tailed
    out = [ln async for ln in slurm_scheduler.log_iter(app_id, "w", 0, streams=Stream.STDOUT)]
    err = [ln async for ln in slurm_scheduler.log_iter(app_id, "w", 0, streams=Stream.STDERR)]
    assert (out, err) == (["o1\n", "o2\n"], ["e1\n", "e2\n"])
    assert [ln async for ln in slurm_scheduler.log_iter(app_id, "quiet", 0)] == ["only out\n"]


@pytest.mark.timeout(60)
async def test_list_includes_apps_with_handles(
    slurm_scheduler: SlurmScheduler, job_dir: Path
) -> None:
    """list shows a submitted app once (not per component) with its handle and state."""
    app_id = await slurm_scheduler.submit(
        AppDef("listed", [sh("w", "true", 2)]), {"job_dir": str(job_dir)}
    )
    await wait_for_state(slurm_scheduler, app_id)
    apps = {a.app_id: a for a in await slurm_scheduler.list()}
    assert apps[app_id].state == AppState.SUCCEEDED
    assert apps[app_id].app_handle == f"slurm://{slurm_scheduler.session_name}/{app_id}"
    assert str(int(app_id) + 1) not in apps  # the second component is not an app


@pytest.mark.timeout(120)
async def test_retry_by_requeue(slurm_scheduler: SlurmScheduler, job_dir: Path) -> None:
    """A failure with retries left requeues the job; the second run succeeds with num_restarts=1."""
    script = 'echo "attempt ${SLURM_RESTART_COUNT:-0}"; [ "${SLURM_RESTART_COUNT:-0}" -ge 1 ]'
    app = AppDef("retry", [sh("w", script, 1, retries=1), sh("v", "true", 1, retries=1)])
    app_id = await slurm_scheduler.submit(app, {"job_dir": str(job_dir)})
    resp = await wait_for_state(slurm_scheduler, app_id, timeout=100)
    assert resp.state == AppState.SUCCEEDED, resp.msg
    assert resp.num_restarts == 1
    lines = [ln async for ln in slurm_scheduler.log_iter(app_id, "w", 0, streams=Stream.STDOUT)]
    assert lines == ["attempt 0\n", "attempt 1\n"]  # both attempts kept in the log


@pytest.mark.timeout(60)
async def test_exhausted_retries_fail(slurm_scheduler: SlurmScheduler, job_dir: Path) -> None:
    """Without retries left a failing job is not requeued: it fails with num_restarts=0."""
    app_id = await slurm_scheduler.submit(
        AppDef("noretry", [sh("w", "exit 4")]), {"job_dir": str(job_dir)}
    )
    resp = await wait_for_state(slurm_scheduler, app_id)
    assert (resp.state, resp.num_restarts) == (AppState.FAILED, 0)
    assert "exit code 4" in resp.msg


@pytest.mark.parametrize(
    ("cfg", "resource", "words"),
    [
        ({"partition": "nosuchpartition"}, SMALL, "invalid partition specified: nosuchpartition"),
        # (a time limit sbatch refuses is refused at the dry run: test_slurm_review.py)
        ({}, Resource(cpu=1, gpu=0, memMB=50_000_000), "Memory specification can not be satisfied"),
        ({}, Resource(cpu=500, gpu=0, memMB=64), "More processors requested than permitted"),
        # '#' and '\\' are literal, not sbatch's comment and escape (they dropped what followed)
        ({"partition": "debug#", "time": "5"}, SMALL, "invalid partition specified: debug#"),
        ({"partition": "debug\\", "time": "5"}, SMALL, "invalid partition specified: debug\\"),
    ],
    ids=[
        "unknown-partition",
        "too-much-memory",
        "too-many-cpus",
        "partition-with-hash",
        "partition-with-backslash",
    ],
)
@pytest.mark.timeout(60)
async def test_bad_input_is_rejected_with_sbatch_message(
    slurm_cluster: None,
    slurm_runner: CountingRunner,
    job_dir: Path,
    cfg: dict[str, str],
    resource: Resource,
    words: str,
) -> None:
    """sbatch's refusal surfaces as SlurmSubmitError with sbatch's message, and nothing is queued."""
    sched = SlurmScheduler("bad", runner=slurm_runner)
    role = sh("w", "true")
    role.resource = resource
    before = _my_live_jobs()
    with pytest.raises(SlurmSubmitError, match="nothing was queued") as info:
        await sched.submit(AppDef("bad", [role]), {"job_dir": str(job_dir), **cfg})
    assert words in str(info.value)
    assert _my_live_jobs() <= before


@pytest.mark.parametrize("partition", [None, "short"])
@pytest.mark.timeout(60)
async def test_more_replicas_than_the_partition_has_nodes_are_refused_and_nothing_queued(
    slurm_scheduler: SlurmScheduler,
    slurm_runner: CountingRunner,
    tmp_path: Path,
    partition: str | None,
) -> None:
    """An app with one replica more than the partition has nodes (Slurm kept it PENDING, reason
    Resources, forever) is refused before sbatch naming the role, the partition and its nodes."""
    nodes = len(_cluster_nodes())
    app = AppDef("wide", [sh("a", "true", replicas=nodes - 1), sh("b", "true", replicas=2)])
    cfg = {"job_dir": str(tmp_path / "jobs")} | ({"partition": partition} if partition else {})
    before = _my_live_jobs()
    with pytest.raises(InvalidAppDefException) as info:
        await slurm_scheduler.submit(app, cfg)
    words = f"num_replicas {nodes - 1} is more than partition '{partition or 'debug'}'"
    assert words in str(info.value)
    assert f"it has {nodes} nodes" in str(info.value) and info.value.role == "a"
    assert slurm_runner.counts["sbatch"] == 0 and _my_live_jobs() <= before
    assert not (tmp_path / "jobs").exists()


@pytest.mark.timeout(90)
async def test_a_pending_reason_that_means_never_is_in_the_status_message(
    slurm_cluster: None, slurm_runner: CountingRunner, job_dir: Path
) -> None:
    """An app Slurm will never start (here: a dependency on an app that failed) stays PENDING, as
    Slurm and TorchX report it, with Slurm's reason (DependencyNeverSatisfied) in its message."""
    sched = SlurmScheduler("never", runner=slurm_runner)
    cfg = {"job_dir": str(job_dir)}
    try:
        failed = await sched.submit(AppDef("first", [sh("w", "exit 3", replicas=2)]), cfg)
        assert (await wait_for_state(sched, failed)).state == AppState.FAILED
        after = ["--dependency=afterok:" + failed]
        app_id = await sched.submit(
            AppDef("second", [sh("w", "true", replicas=2)]), {**cfg, "sbatch_args": after}
        )
        with anyio.fail_after(30):
            while True:
                resp = await sched.describe(app_id)
                assert resp is not None and resp.state == AppState.PENDING, resp
                if resp.msg == "PENDING: DependencyNeverSatisfied":
                    break
                await asyncio.sleep(0.2)
    finally:
        await sched.close()


@pytest.mark.timeout(60)
async def test_a_script_over_max_script_size_is_refused_naming_the_clusters_limit(
    slurm_cluster: None, slurm_runner: CountingRunner, job_dir: Path
) -> None:
    """A batch script over the controller's max_script_size (4 MiB here) fails naming its size and
    the cluster's limit (sbatch alone says "Pathname ... too long"); nothing is queued."""
    sched = SlurmScheduler("big", runner=slurm_runner)
    role = sh("w", "true")
    role.args.append("x" * 5_000_000)
    before = _my_live_jobs()
    try:
        with pytest.raises(
            SlurmSubmitError, match=r"more than this cluster accepts \(4194304 bytes"
        ):
            await sched.submit(AppDef("big", [role]), {"job_dir": str(job_dir)})
    finally:
        await sched.close()
    assert _my_live_jobs() <= before


@pytest.mark.timeout(60)
async def test_a_refused_submit_leaves_no_job_dir_it_made(
    slurm_cluster: None, slurm_runner: CountingRunner, tmp_path: Path
) -> None:
    """sbatch refusing the job removes the job_dir (and parents) the submit made; a job_dir that
    existed stays, and one an accepted app of the same scheduler uses is kept."""
    sched = SlurmScheduler("refused", runner=slurm_runner)
    bad = {"partition": "nosuchpartition"}
    try:
        with pytest.raises(SlurmSubmitError):
            await sched.submit(
                AppDef("a", [sh("w", "true")]), {"job_dir": str(tmp_path / "n/a/b"), **bad}
            )
        assert list(tmp_path.iterdir()) == []
        existing = tmp_path / "existing"
        existing.mkdir()
        with pytest.raises(SlurmSubmitError):
            await sched.submit(AppDef("a", [sh("w", "true")]), {"job_dir": str(existing), **bad})
        assert existing.is_dir()
        shared = str(tmp_path / "shared")
        apps = [AppDef("a", [sh("w", "sleep 2")]), AppDef("a", [sh("w", "true")])]
        results = await asyncio.gather(
            sched.submit(apps[0], {"job_dir": shared}),
            sched.submit(apps[1], {"job_dir": shared, **bad}),
            return_exceptions=True,
        )
        assert isinstance(results[0], str) and isinstance(results[1], SlurmSubmitError)
        resp = await wait_for_state(sched, results[0])
        assert resp.state == AppState.SUCCEEDED, resp.msg
        assert (Path(shared) / f"slurm-{results[0]}" / "w" / "0" / "exit_code").is_file()
    finally:
        await sched.close()


@pytest.mark.timeout(60)
async def test_a_line_break_in_an_option_starts_no_sbatch_directive(
    slurm_cluster: None, slurm_runner: CountingRunner, tmp_path: Path
) -> None:
    """An sbatch_args value with a line break then '#SBATCH --time=8' sets no time limit (a job_dir
    with a line break is refused at the dry run, naming job_dir)."""
    sched = SlurmScheduler("inject", runner=slurm_runner)
    app = AppDef("inject", [sh("w", "true")])
    with pytest.raises(InvalidRunConfigException, match="job_dir"):
        sched.submit_dryrun(app, {"job_dir": str(tmp_path / "jobs\n#SBATCH --time=7 #")})
    cfg = {"job_dir": str(tmp_path / "jobs"), "sbatch_args": ["--comment=a\n#SBATCH --time=8 #"]}
    try:
        app_id = await sched.submit(app, cfg)
        limit = subprocess.run(
            ["squeue", "-h", "-j", app_id, "-o", "%l"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
        assert limit == "UNLIMITED"
        resp = await wait_for_state(sched, app_id)
        assert resp.state == AppState.SUCCEEDED, resp.msg
    finally:
        await sched.close()


@pytest.mark.timeout(120)
async def test_fifty_apps_waited_cost_one_squeue_per_round(
    accounting: bool,
    slurm_runner: CountingRunner,
    slurm_session: str,
    job_dir: Path,
) -> None:
    """50 apps waited concurrently through AsyncRunner cost one squeue (and at most one sacct) per
    status round of the runner's hub, not one per app; without accounting, one sacct in all (the
    one that finds out there is none)."""
    async with AsyncRunner(
        slurm_session, slurm_runner=slurm_runner, slurm_accounting=True if accounting else None
    ) as runner:
        app = AppDef("many", [sh("w", "sleep 1")])
        handles = await asyncio.gather(
            *(runner.run(app, "slurm", {"job_dir": str(job_dir)}) for _ in range(50))
        )
        before = dict(slurm_runner.counts)
        statuses = await runner.wait_all(handles, timeout=100)
        hub = runner.hub("slurm")
        rounds = hub.rounds
        assert isinstance(hub.scheduler, SlurmScheduler)
        detected = hub.scheduler.accounting
    assert len(statuses) == 50
    assert {s.state for s in statuses.values() if s is not None} == {AppState.SUCCEEDED}
    squeues = slurm_runner.counts["squeue"] - before.get("squeue", 0)
    saccts = slurm_runner.counts["sacct"] - before.get("sacct", 0)
    assert 1 <= squeues <= rounds
    assert saccts <= rounds
    assert detected is accounting
    if not accounting:
        assert saccts == 1  # the refusal that told the backend there is no accounting
    assert squeues < 50  # the point: rounds, not apps


@pytest.mark.timeout(60)
async def test_backend_detects_whether_the_cluster_has_accounting(
    accounting: bool, slurm_runner: CountingRunner, slurm_session: str, job_dir: Path
) -> None:
    """Left to find out (accounting=None), the backend learns from sacct's own answer whether the
    cluster keeps accounting: on the cluster without it, sacct really refuses ("Slurm accounting
    storage is disabled"), the backend asks it once, then describes and lists from squeue only,
    with the replicas' exit codes from the job directory."""
    sacct = subprocess.run(["sacct", "-n", "-X"], capture_output=True, text=True, timeout=30)
    if accounting:
        assert sacct.returncode == 0, sacct.stderr
    else:
        assert sacct.returncode != 0
        assert NO_ACCOUNTING_MESSAGE in sacct.stderr
    sched = SlurmScheduler(slurm_session, runner=slurm_runner)
    try:
        assert sched.accounting is None
        script = '[ "$SLURM_PROCID" = 1 ] && exit 3; exit 0'
        app_id = await sched.submit(
            AppDef("detect", [sh("w", script, 2)]), {"job_dir": str(job_dir)}
        )
        resp = await wait_for_state(sched, app_id)
        assert sched.accounting is accounting
        assert resp.state == AppState.FAILED and "exit code 3" in resp.msg
        [role] = resp.roles_statuses
        assert {r.id: r.exit_code for r in role.replicas}[1] == 3
        saccts = slurm_runner.counts["sacct"]
        if not accounting:
            assert saccts == 1  # asked once; the answer is remembered
        again = await sched.describe(app_id)
        assert again is not None and again.state == AppState.FAILED
        listed = {a.app_id: a.state for a in await sched.list()}
        assert listed[app_id] == AppState.FAILED
        if not accounting:
            assert slurm_runner.counts["sacct"] == saccts  # no sacct since it refused
    finally:
        await sched.close()


DDP_SCRIPT = """\
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
print(
    f"rank {rank}/{world} on {os.environ['SLURMD_NODENAME']} (rank 0 host "
    f"{os.environ['TORCHX_RANK0_HOST']}): all_reduce sum = {value.item():g}, "
    f"expected {world * (world + 1) / 2:g}",
    flush=True,
)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.timeout(240)
async def test_ddp_two_nodes_over_het_components(
    slurm_cluster: None, slurm_runner: CountingRunner, job_dir: Path
) -> None:
    """dist.ddp -j 2x1 runs torchrun on two het components that rendezvous (c10d) at rank 0's host,
    taken from het group 0's node list, and all-reduce with gloo on CPU."""
    if importlib.util.find_spec("torch") is None:
        engine_missing("torch (pip install torch==2.13.0, or the [torch] extra)")
    from asynctorchx.components import get_component
    from asynctorchx.specs.builders import materialize_appdef

    script = job_dir / "allreduce.py"
    script.write_text(DDP_SCRIPT)
    app = materialize_appdef(
        get_component("dist.ddp").fn, ["-j", "2x1", "--script", str(script)], name="dist.ddp"
    )
    sched = SlurmScheduler("ddp", runner=slurm_runner)
    app_id = await sched.submit(app, {"job_dir": str(job_dir)})
    try:
        resp = await wait_for_state(sched, app_id, timeout=200, poll=0.5)
    finally:
        scancel([app_id])
    role = app.roles[0].name
    logs = {}
    for k in (0, 1):
        out = [ln async for ln in sched.log_iter(app_id, role, k, streams=Stream.STDOUT)]
        err = [ln async for ln in sched.log_iter(app_id, role, k, streams=Stream.STDERR)]
        logs[k] = "".join(out + err)
    assert resp.state == AppState.SUCCEEDED, f"{resp.msg}\n{logs}"
    [trainer] = resp.roles_statuses
    hosts = {r.id: r.hostname for r in trainer.replicas}
    assert len(set(hosts.values())) == 2
    for k in (0, 1):
        assert f"on {hosts[k]} (rank 0 host {hosts[0]}): all_reduce sum = 3, expected 3" in logs[k]
