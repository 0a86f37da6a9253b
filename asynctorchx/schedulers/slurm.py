"""The ``slurm`` backend: apps as heterogeneous Slurm batch jobs, driven by the Slurm commands.

Each app is one heterogeneous job with one component per replica (``{role}-{replica}``), submitted
with ``sbatch``; the app id is the job id. Nothing here blocks the event loop: every Slurm command
runs as an asyncio subprocess through an injectable ``CommandRunner``.

Status for any number of apps costs one ``squeue --json`` per round (it lists every job the controller
still holds, finished ones included for ``MinJobAge``), plus, when the cluster has accounting, at most
one ``sacct`` for the apps ``squeue`` no longer shows or has just seen finish (for the replicas' step
records). Finished apps are remembered and cost no ``sacct`` afterwards, and no command at all once
the controller has forgotten them (while it lists them, its ``squeue`` is read again at most every
``state_check_interval`` seconds: Slurm may run a finished job again, ``scontrol requeue``). A record
accounting holds just after a job ended (JobName ``allocation``, no WorkDir) is not remembered;
nor, while the app is live, is it believed over what was last seen of the app: that placeholder lags
(it says PENDING for seconds after the job started), so an app ``squeue`` leaves out for a round
keeps its last answer rather than going back to a state Slurm never put it back to.
Without accounting (detected from ``sacct``'s answer or its absence, or forced with
``accounting=False``) an app the controller has forgotten is reported unknown, never as succeeded.
A ``sacct`` that fails, hangs or is missing costs only the replicas' step records of the apps
``squeue`` still lists. Each replica's exit code is also written by a small wrapper to
``slurm-{app_id}/{role}/{replica}/exit_code``, which wins over accounting's step records.

Logs: each replica writes ``slurm-{app_id}/{role}/{replica}/stdout.log``, ``stderr.log`` and
``combined.log`` (both streams' whole lines, in the order they were completed; see
``_slurm/script.py``) under the job directory (the ``job_dir`` run option, default: the current
directory at submit time), which is recorded by Slurm, so ``log_iter`` finds them from any directory.
``log_iter`` reads ``combined.log`` unless ``streams`` asks for one stream (TorchX reads stderr by
default; everything the replica wrote is what every backend here gives). ``since``/``until`` are
honoured per line, to within the sampling interval of the job's timing samples (``index.txt``,
``SAMPLE_INTERVAL`` = 0.25 s): a line is kept when the interval in which it was written meets the
window. An app submitted before the job wrote ``combined.log`` is read as its ``stdout.log`` then
its ``stderr.log``, and one without timing samples by its files' modification times. A followed
log rides out Slurm not answering its state checks (a controller restarting) for up to
``FOLLOW_OUTAGE_LIMIT`` seconds.

Workspaces (``_slurm/workspace.py``): the workspace is copied into the job directory (``job_dir``,
which must be new or empty), where every role runs.

Limits: an app has at most 128 replicas in all (Slurm's ``MAX_HET_JOB_COMPONENTS``), refused at the
dry run; one with more replicas than its partition has nodes is refused at submit (Slurm would keep it
PENDING, reason ``Resources``, forever: it starts a heterogeneous job only when every component has a
node of its own); a batch script over the controller's ``max_script_size`` fails naming both sizes. A job directory holding a control
character or a backslash is refused at the dry run (Slurm could not write its logs there).
Any other reason Slurm gives for keeping an app pending (``DependencyNeverSatisfied``...) is in the
status message; the app stays PENDING, as Slurm and TorchX report it.

Retries: the batch script requeues the job (``scontrol requeue``) after a failure while
``SLURM_RESTART_COUNT`` is below the smallest ``max_retries`` of the app's roles; a requeued job waits
Slurm's ``cred_expire`` (120 s by default) before it may start again. Every retry restarts the whole app,
whatever the roles' ``retry_policy``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import anyio.to_thread

from asynctorchx._tasks import TaskSupervisor, await_shielded, in_thread_shielded
from asynctorchx.logs import LogQuery, iter_query_entries, iter_query_lines
from asynctorchx.logs._cursor import Position
from asynctorchx.schedulers._slurm import workspace as slurm_workspace
from asynctorchx.schedulers._slurm.commands import CommandResult, CommandRunner, SubprocessRunner
from asynctorchx.schedulers._slurm.parse import (
    SACCT_FIELDS,
    SlurmJob,
    SlurmOutputError,
    SlurmPartition,
    expand_hostlist,
    is_digits,
    is_job_id,
    json_errors,
    parse_max_script_size,
    parse_partitions,
    parse_sacct_parsable,
    parse_sbatch_parsable,
    parse_squeue_json,
)
from asynctorchx.schedulers._slurm.script import (
    COMBINED_FILE,
    EXIT_CODE_FILE,
    SlurmBatchRequest,
    SlurmReplicaRequest,
    build_request,
    log_dir,
    names_option,
)
from asynctorchx.schedulers._slurm.status import SLURM_STATES, app_state_of, describe_from_records
from asynctorchx.schedulers.api import (
    DescribeAppResponse,
    ListAppResponse,
    Scheduler,
    Stream,
    check_replica,
    role_replica_counts,
)
from asynctorchx.schedulers.workspace import WorkspacePlan, current_progress, run_in_thread
from asynctorchx.specs.api import (
    AppDef,
    AppDryRunInfo,
    AppState,
    CfgVal,
    InvalidAppDefException,
    ReplicaStatus,
    UnknownAppException,
    is_terminal,
    make_app_handle,
    runopts,
)
from asynctorchx.specs.workspace import Workspace

__all__ = [
    "SLURM_STATES",
    "CommandResult",
    "CommandRunner",
    "SlurmBatchRequest",
    "SlurmCommandError",
    "SlurmNotFoundError",
    "SlurmReplicaRequest",
    "SlurmScheduler",
    "SlurmSubmitError",
    "SubprocessRunner",
    "create_scheduler",
]

logger = logging.getLogger(__name__)

_INSTALL_HINT = (
    "install the Slurm client commands (Debian/Ubuntu: 'apt-get install slurm-client'; "
    "RHEL/Rocky: 'dnf install slurm') and make sure they are on PATH, or run where they are"
)
_NO_ACCOUNTING = re.compile(r"accounting storage is disabled", re.IGNORECASE)
_GONE = re.compile(
    r"invalid job id|already completing or completed|job/step already completed", re.IGNORECASE
)
_FINAL_CACHE_SIZE = 10_000
#: The most of a failed command's output an error message quotes (characters).
_DETAIL_MAX = 1000
#: How long ``close()`` waits for the sbatch (or scancel of a withdrawn job) still running.
CLOSE_WAIT = 30.0
#: How long the partitions' node counts, asked for at submit, are trusted (seconds).
PARTITIONS_TTL = 60.0
#: How long a followed log rides out Slurm not answering its state checks before it raises (s).
FOLLOW_OUTAGE_LIMIT = 300.0
#: The first and the longest delay between two state checks while Slurm does not answer (s).
_OUTAGE_FIRST_DELAY = 0.5
_OUTAGE_MAX_DELAY = 5.0
#: Environment variables with which sbatch submits to another cluster than scontrol may ask.
_CLUSTERS_ENV = ("SBATCH_CLUSTERS", "SLURM_CLUSTERS")
#: What sbatch prints when the controller finds a field, the batch script among them, too long.
_TOO_LONG = re.compile(r"too long", re.IGNORECASE)


class SlurmCommandError(RuntimeError):
    """Raised when a Slurm command fails; the message carries what the command printed.

    Attributes:
        argv: the command line.
        returncode: its exit status.
        stderr: what it printed on stderr.
    """

    def __init__(self, message: str, result: CommandResult) -> None:
        detail = (result.stderr or result.stdout).strip()
        if len(detail) > _DETAIL_MAX:  # e.g. a whole squeue listing after a banner line
            detail = f"{detail[:_DETAIL_MAX]}... ({len(detail) - _DETAIL_MAX} more characters)"
        super().__init__(f"{message}: {detail}" if detail else message)
        self.argv = result.argv
        self.returncode = result.returncode
        self.stderr = result.stderr


class SlurmSubmitError(SlurmCommandError):
    """Raised when ``sbatch`` rejects an app (unknown partition, bad time limit, resources the
    cluster cannot satisfy...); nothing was queued. The message carries sbatch's own words."""


class SlurmNotFoundError(FileNotFoundError):
    """Raised when a Slurm command is not installed; the message says what to install.

    ``permanent``: no retry mends it, so a runner's waits raise it rather than wait for ever."""

    permanent = True

    def __init__(self, program: str) -> None:
        super().__init__(f"the Slurm command {program!r} was not found: {_INSTALL_HINT}")
        self.program = program


class SlurmScheduler(Scheduler[SlurmBatchRequest]):
    """Runs apps as heterogeneous Slurm jobs (one component per replica).

    Args:
        session_name: the session submitting apps.
        runner: runs the Slurm commands (default: asyncio subprocesses); tests pass a fake.
        accounting: True to use ``sacct`` for apps ``squeue`` no longer lists, False for ``squeue``
            only, None to find out from ``sacct`` on first need.
        state_check_interval: while following a log, the longest time a known non-terminal state is
            trusted before ``squeue`` is asked again (seconds).
    """

    pushes_changes = False
    supports_workspace = True
    log_cursor_kind = "file"

    def __init__(
        self,
        session_name: str,
        *,
        runner: CommandRunner | None = None,
        accounting: bool | None = None,
        state_check_interval: float = 2.0,
    ) -> None:
        super().__init__("slurm", session_name)
        self._runner: CommandRunner = runner if runner is not None else SubprocessRunner()
        self._accounting = accounting
        self._state_check_interval = state_check_interval
        self._final: OrderedDict[str, _Final] = OrderedDict()
        self._workdirs: dict[str, str] = {}
        self._submitting: Counter[str] = Counter()
        self._seen: dict[str, tuple[float, AppState]] = {}
        # the last answer of each app not yet seen finished (most recent last; bounded)
        self._live_answers: OrderedDict[str, DescribeAppResponse] = OrderedDict()
        self._partitions: tuple[float, dict[str, SlurmPartition]] | None = None
        self._partitions_lookup: asyncio.Task[dict[str, SlurmPartition]] | None = None
        self._tasks = TaskSupervisor(f"slurm:{session_name}")

    @property
    def accounting(self) -> bool | None:
        """Whether ``sacct`` is used: True/False, or None while not yet found out."""
        return self._accounting

    # -- options and dry runs ------------------------------------------------------------------

    def _run_opts(self) -> runopts:
        opts = runopts()
        opts.add("partition", str, "The partition to run the job in (every replica).")
        opts.add(
            "time",
            str,
            "The time limit of every replica: 'minutes', 'minutes:seconds', 'hours:minutes:seconds', "
            "'days-hours', 'days-hours:minutes' or 'days-hours:minutes:seconds'.",
        )
        opts.add("constraint", str, "Node features every replica requires (sbatch --constraint).")
        opts.add("qos", str, "The quality of service of every replica.")
        opts.add("comment", str, "A comment set on the job.")
        opts.add("mail-user", str, "Who to mail on job events.")
        opts.add("mail-type", str, "Which events to mail about (e.g. END,FAIL).")
        opts.add(
            "job_dir",
            str,
            "The job's working directory, where its logs go (created if missing). "
            "Default: the current directory at submit time.",
        )
        opts.add(
            "nomem",
            bool,
            "Do not ask for the roles' memory (for clusters that do not schedule memory).",
            default=False,
        )
        opts.add(
            "sbatch_args",
            list[str],
            "Extra sbatch options for the whole job, e.g. ['--account=NAME', '--exclusive'].",
        )
        return opts

    def _submit_dryrun(
        self, app: AppDef, cfg: Mapping[str, CfgVal]
    ) -> AppDryRunInfo[SlurmBatchRequest]:
        job_dir = cfg.get("job_dir")
        directory = os.path.abspath(
            os.path.expanduser(job_dir if isinstance(job_dir, str) else ".")
        )
        request = build_request(app, cfg, directory, self.session_name)
        return AppDryRunInfo(request, repr)

    def plan_workspace(
        self, app: AppDef, cfg: Mapping[str, CfgVal], workspace: Workspace
    ) -> WorkspacePlan:
        """The copy of the workspace into ``job_dir`` (which must be set, and new or empty);
        reads and hashes the workspace, copies nothing."""
        return slurm_workspace.plan_slurm(app, cfg, workspace)

    # -- commands ------------------------------------------------------------------------------

    async def _run(self, argv: Sequence[str], *, stdin: str | None = None) -> CommandResult:
        try:
            return await self._runner(argv, stdin=stdin)
        except FileNotFoundError as e:
            if e.filename in (None, argv[0]) or not os.path.isabs(argv[0]):
                raise SlurmNotFoundError(argv[0]) from None
            raise

    # -- lifecycle -----------------------------------------------------------------------------

    async def schedule(self, dryrun_info: AppDryRunInfo[SlurmBatchRequest]) -> str:
        """Submits the batch script with ``sbatch``; returns the job id.

        A dry run made with a workspace first gets the workspace copied into the job directory
        (removed again if sbatch rejects the job).

        Raises:
            SlurmSubmitError: sbatch rejected the job (nothing was queued); carries sbatch's message.
            SlurmNotFoundError: sbatch is not installed.
            InvalidAppDefException: more replicas than the partition has nodes (see
                ``_check_partition``); nothing was queued.
            OSError: the job directory cannot be created (the message names ``job_dir``).
            InvalidWorkspaceException: the job directory holds files, or the workspace changed.
        """
        req = dryrun_info.request
        await self._check_partition(req)
        if dryrun_info.workspace is None:
            return await self._submit(req)
        shipped = await slurm_workspace.ship(dryrun_info.workspace, current_progress())
        try:
            return await self._submit(req)
        except BaseException:
            await shipped.undo()
            raise

    async def _submit(self, req: SlurmBatchRequest) -> str:
        self._submitting[req.job_dir] += 1
        # The directories the thread made, deepest first: filled by the thread as it makes them,
        # read here only once it has ended (run_in_thread waits for it when the caller fails or
        # is cancelled), so that a submit cancelled while they are made returns only once it
        # knows them all, and none is made after it has removed them.
        made: list[str] = []
        try:
            try:
                await _make_job_dir(req.job_dir, made)
                return await self._sbatch(req)
            except BaseException:
                # A refused (or cancelled) submit leaves no directory it made, unless another app
                # of ours uses it; the removal runs whatever cancellation comes.
                if (
                    made
                    and self._submitting[req.job_dir] == 1
                    and req.job_dir not in self._workdirs.values()
                ):
                    await in_thread_shielded(slurm_workspace.remove_empty_dirs, made)
                raise
        finally:
            self._submitting[req.job_dir] -= 1
            if not self._submitting[req.job_dir]:
                del self._submitting[req.job_dir]

    async def _check_partition(self, req: SlurmBatchRequest) -> None:
        """Refuses an app with more replicas than its partition has nodes, before anything is made.

        Slurm starts a heterogeneous job only when it can give each component a node of its own
        (its backfill scheduler, the only one that starts them, plans so), so such a job would stay
        PENDING with the reason ``Resources`` forever; sbatch takes it without a word. The node
        counts come from one ``scontrol show partition``, trusted for ``PARTITIONS_TTL`` seconds,
        asked only for apps of several replicas; a list of partitions counts each of their nodes
        once (partitions often share nodes). The partition is the one sbatch picks: the
        environment's ``SBATCH_PARTITION``, else the ``partition`` run option, else the default
        one. The check is skipped when it cannot be sure: ``sbatch_args`` choosing the partition or
        the cluster, ``SBATCH_CLUSTERS``/``SLURM_CLUSTERS`` set, a partition scontrol does not
        list, or scontrol failing.
        """
        env = self._runner.environ if isinstance(self._runner, SubprocessRunner) else os.environ
        if (
            len(req.replicas) < 2
            or any(env.get(name) for name in _CLUSTERS_ENV)
            or any(
                names_option(arg, option, letter)
                for arg in req.cmd[1:]
                for option, letter in (("partition", "p"), ("clusters", "M"))
            )
        ):
            return
        partitions = await self._partition_nodes()
        # sbatch takes SBATCH_PARTITION over the script's --partition (and the default partition)
        wanted = env.get("SBATCH_PARTITION") or req.replicas[0].sbatch_opts.get("partition")
        if wanted:
            named = [partitions.get(name) for name in wanted.split(",")]
            chosen = [p for p in named if p is not None]
            if len(chosen) < len(named):
                return
        else:
            chosen = [p for p in partitions.values() if p.default]
        nodes = _node_count(chosen)
        if not chosen or len(req.replicas) <= nodes:
            return
        counts = Counter(r.role for r in req.replicas)
        role, count = counts.most_common(1)[0]
        names = ", ".join(repr(p.name) for p in chosen)
        where = f"partitions {names}" if len(chosen) > 1 else f"partition {names}"
        has = "they have" if len(chosen) > 1 else "it has"
        total = f" (the app has {len(req.replicas)} replicas in all)" if len(counts) > 1 else ""
        raise InvalidAppDefException(
            f"num_replicas {count} is more than {where} can run at once{total}: {has} {nodes} "
            "nodes, and Slurm starts a job only when each replica (one component of a "
            "heterogeneous job) has a node of its own, so it would stay PENDING (Resources) forever",
            role=role,
            field_name="num_replicas",
        )

    async def _partition_nodes(self) -> dict[str, SlurmPartition]:
        """The partitions and their node counts, or {} when scontrol fails, hangs (the runner's
        timeout) or cannot start; either answer is kept for ``PARTITIONS_TTL`` seconds, so that a
        controller that does not answer costs one wait per period, not one per submit. Submits
        that need them at once share one scontrol."""
        if self._partitions is not None and time.monotonic() - self._partitions[0] < PARTITIONS_TTL:
            return self._partitions[1]
        lookup = self._partitions_lookup
        if lookup is None or lookup.done():
            lookup = self._tasks.spawn(self._look_up_partitions(), "scontrol show partition")
            self._partitions_lookup = lookup
        return await asyncio.shield(lookup)

    async def _look_up_partitions(self) -> dict[str, SlurmPartition]:
        """One ``scontrol show partition``, its answer (or {}) kept from now on."""
        now = time.monotonic()
        partitions: dict[str, SlurmPartition] = {}
        try:
            result = await self._run(["scontrol", "--all", "--oneliner", "show", "partition"])
        except (OSError, TimeoutError) as e:
            logger.warning("the partitions' sizes are unknown, not checked: %s", e)
        else:
            if result.returncode == 0:
                partitions = parse_partitions(result.stdout)
            else:
                logger.warning("%s", SlurmCommandError("scontrol show partition failed", result))
        self._partitions = (now, partitions)
        return partitions

    async def _script_too_big(self, script: str) -> str | None:
        """Why the controller refused ``script`` when it is over the cluster's ``max_script_size``
        (asked with ``scontrol show config``), else None."""
        size = len(script.encode())
        try:
            result = await self._run(["scontrol", "show", "config"])
        except (OSError, TimeoutError):  # sbatch's own refusal is said instead
            return None
        limit = parse_max_script_size(result.stdout) if result.returncode == 0 else None
        if limit is None or size <= limit:
            return None
        return (
            f"the batch script is {size} bytes, more than this cluster accepts ({limit} bytes: "
            "max_script_size in slurm.conf's SchedulerParameters); it grows with the replicas and "
            "their arguments and environment; nothing was queued"
        )

    async def _sbatch(self, req: SlurmBatchRequest) -> str:
        script = req.materialize()
        submit = self._tasks.spawn(self._run(req.cmd, stdin=script), "sbatch", observed=True)
        try:
            result = await asyncio.shield(submit)
        except asyncio.CancelledError:
            # The caller gave up while sbatch ran: let it finish and withdraw the job it queued,
            # so that nothing runs that nobody knows about.
            await await_shielded(self._tasks.spawn(self._withdraw(submit), "withdraw"))
            raise
        if result.returncode != 0:
            why = await self._script_too_big(script) if _TOO_LONG.search(result.stderr) else None
            raise SlurmSubmitError(why or "sbatch rejected the job; nothing was queued", result)
        try:
            app_id = parse_sbatch_parsable(result.stdout)
        except SlurmOutputError as e:
            raise SlurmSubmitError(str(e), result) from None
        self._workdirs[app_id] = req.job_dir
        return app_id

    async def _withdraw(self, submit: asyncio.Future[CommandResult]) -> None:
        try:
            result = await submit
            if result.returncode == 0:
                await self._cancel_existing(parse_sbatch_parsable(result.stdout))
        except Exception:
            logger.exception("could not withdraw a job whose submission was cancelled")

    async def describe(self, app_id: str) -> DescribeAppResponse | None:
        """What Slurm knows of the app (one ``squeue``, and ``sacct`` if ``squeue`` has forgotten it)."""
        return (await self.describe_many([app_id]))[app_id]

    async def describe_many(self, app_ids: Sequence[str]) -> dict[str, DescribeAppResponse | None]:
        """Describes every app with at most one ``squeue --json`` and one ``sacct``.

        Finished apps are remembered, so once an app is over it costs no ``sacct`` more, and no
        command at all while its outcome was confirmed less than ``state_check_interval`` seconds
        ago or once ``squeue`` no longer lists it. Until then Slurm may run it again (``scontrol
        requeue`` of a finished job): the round's ``squeue`` shows whether it still reads as it did
        when remembered, else it is described anew. An app neither command knows is None.
        """
        return await self._describe_many(app_ids, recheck=False)

    async def _describe_many(
        self, app_ids: Sequence[str], *, recheck: bool
    ) -> dict[str, DescribeAppResponse | None]:
        """``describe_many``; ``recheck``: also check the finished apps confirmed lately."""
        out: dict[str, DescribeAppResponse | None] = {}
        wanted: list[str] = []
        check: list[str] = []
        now = time.monotonic()
        for app_id in dict.fromkeys(app_ids):
            cached = self._final.get(app_id)
            if not is_job_id(app_id):
                out[app_id] = None
            elif cached is None:
                wanted.append(app_id)
            elif cached.squeue is None or (
                not recheck and now - cached.confirmed < self._state_check_interval
            ):
                out[app_id] = cached.resp
            else:
                check.append(app_id)
        if not wanted and not check:
            return out
        live = _by_app(await self._squeue())
        now = time.monotonic()
        for app_id in check:
            cached = self._final[app_id]
            records = live.get(app_id)
            if records is None or _fingerprint(records) == cached.squeue:
                # unchanged, or forgotten by the controller (then it can never run again)
                self._final[app_id] = _Final(
                    cached.resp, None if records is None else cached.squeue, now
                )
                self._final.move_to_end(app_id)
                out[app_id] = cached.resp
            else:  # requeued since it ended (or the id reused): describe it anew
                del self._final[app_id]
                wanted.append(app_id)
        if not wanted:
            return out
        past = await self._past_runs(wanted, live)
        for app_id in wanted:
            records, runs = live.get(app_id), past.get(app_id)
            fingerprint = None if records is None else _fingerprint(records)
            if records is not None:
                latest = _latest_runs(runs) if runs else []
                records = _merge_steps(records, latest)
                resp = describe_from_records(app_id, records, _restarts(records))
                complete = self._accounting is False or (
                    _all_final(latest, len(records)) and _settled(latest)
                )
            elif runs:
                records = _latest_runs(runs)
                resp = describe_from_records(app_id, records, _sacct_restarts(runs))
                complete = _settled(records)
                last = self._live_answers.get(app_id)
                if not complete and last is not None and not is_terminal(resp.state):
                    # accounting's lagging placeholder of a live app squeue left out (JobName
                    # ``allocation``, PENDING while the job runs): Slurm did not move it back
                    out[app_id] = last
                    continue
            else:
                out[app_id] = None
                continue
            self._remember_live(app_id, resp)
            self._remember_workdir(app_id, records)
            self._seen[app_id] = (time.monotonic(), resp.state)
            if is_terminal(resp.state):
                await self._add_exit_codes(app_id, resp)
                if complete:
                    self._final[app_id] = _Final(resp, fingerprint, time.monotonic())
                    if len(self._final) > _FINAL_CACHE_SIZE:
                        self._final.popitem(last=False)
            out[app_id] = resp
        return out

    async def _past_runs(
        self, wanted: Sequence[str], live: Mapping[str, Sequence[SlurmJob]]
    ) -> dict[str, list[SlurmJob]]:
        """``sacct``'s runs of the apps ``squeue`` no longer shows or shows finished (one call)."""
        if self._accounting is False:
            return {}
        ask = [a for a in wanted if a not in live or _all_final(live[a], 1)]
        if not ask:
            return {}
        try:
            return _by_app(await self._sacct(ask), keep_runs=True)
        except (SlurmCommandError, SlurmNotFoundError, TimeoutError) as e:
            # (failed, not installed, or hung: the runner's timeout)
            if any(a not in live for a in ask):
                raise
            # Only details of finished apps were wanted: answer from squeue, ask again next time.
            logger.warning("%s; per-replica exit codes come from the job directory", e)
            return {}

    async def _squeue(self) -> list[SlurmJob]:
        result = await self._run(["squeue", "--json"])
        if result.returncode != 0:
            raise SlurmCommandError("squeue failed", result)
        errors = json_errors(result.stdout)
        if errors:
            # e.g. the controller is unreachable: squeue exits 0 with an empty job list. The
            # message is the errors' own words, not the whole JSON document around them.
            raise SlurmCommandError(
                f"squeue failed: {'; '.join(errors)}", replace(result, stdout="")
            )
        try:
            return parse_squeue_json(result.stdout)
        except SlurmOutputError as e:
            raise SlurmCommandError(str(e), result) from None

    async def _sacct(self, app_ids: Sequence[str], *, listing: bool = False) -> list[SlurmJob]:
        argv = ["sacct", "--parsable2", "--duplicates", f"--format={','.join(SACCT_FIELDS)}"]
        argv += ["--user", str(os.getuid())] if listing else ["--jobs", ",".join(app_ids)]
        try:
            result = await self._run(argv)
        except SlurmNotFoundError:
            if self._accounting is not None:
                raise
            # Left to find out: a cluster whose clients lack sacct has no accounting to ask.
            logger.info("sacct is not installed: using squeue only")
            self._accounting = False
            return []
        if result.returncode != 0:
            if _NO_ACCOUNTING.search(result.stderr) and self._accounting is not True:
                logger.info("Slurm accounting is disabled: using squeue only")
                self._accounting = False
                return []
            raise SlurmCommandError("sacct failed", result)
        self._accounting = True
        try:
            return parse_sacct_parsable(result.stdout)
        except SlurmOutputError as e:
            raise SlurmCommandError(str(e), result) from None

    def _remember_live(self, app_id: str, resp: DescribeAppResponse) -> None:
        """Keeps ``resp`` as the app's last answer while it is not finished (see the module's
        docstring: a lagging accounting placeholder does not override it)."""
        if is_terminal(resp.state):
            self._live_answers.pop(app_id, None)
            return
        self._live_answers[app_id] = resp
        self._live_answers.move_to_end(app_id)
        if len(self._live_answers) > _FINAL_CACHE_SIZE:
            self._live_answers.popitem(last=False)

    def _remember_workdir(self, app_id: str, records: Iterable[SlurmJob]) -> None:
        for job in records:
            if job.workdir:
                self._workdirs[app_id] = job.workdir
                return

    async def _add_exit_codes(self, app_id: str, resp: DescribeAppResponse) -> None:
        """Sets the replicas' exit codes from the files the batch script's wrapper writes.

        They are what each replica's process returned, so they win over accounting's step records
        (which, for a replica stopped by --kill-on-bad-exit, say 15:0 or 0:15 depending on timing).
        """
        workdir = self._workdirs.get(app_id)
        replicas = [r for role in resp.roles_statuses for r in role.replicas]
        if not workdir or not replicas:
            return
        paths = [
            os.path.join(workdir, log_dir(app_id, r.role, r.id), EXIT_CODE_FILE) for r in replicas
        ]
        codes = await anyio.to_thread.run_sync(_read_exit_codes, paths)
        for replica, code in zip(replicas, codes, strict=True):
            _apply_exit_code(replica, code)

    async def exists(self, app_id: str) -> bool:
        """True when ``squeue`` or ``sacct`` knows the app (a finished app remembered here costs one
        ``squeue``, which tells whether it was requeued; something that is not a job id costs no
        command)."""
        if not is_job_id(app_id):
            return False
        return (await self._describe_many([app_id], recheck=True))[app_id] is not None

    async def _cancel_existing(self, app_id: str) -> None:
        """``scancel`` unless the app was just seen finished (by the ``describe`` of ``exists``,
        which sees a finished job requeued). A job that ends meanwhile is not an error (scancel
        then says it is completed, or an unknown job id).

        Raises:
            SlurmCommandError: scancel failed for another reason (e.g. the controller is down).
        """
        seen = self._seen.get(app_id)
        if seen is not None and is_terminal(seen[1]):
            return
        result = await self._run(["scancel", app_id])
        if result.returncode != 0 and not _GONE.search(result.stderr):
            raise SlurmCommandError(f"scancel {app_id} failed", result)

    async def close(self) -> None:
        """Lets the submissions in flight finish (at most ``CLOSE_WAIT`` seconds: a job is never
        queued without its id reaching the caller, or being withdrawn), then stops what is left."""
        with anyio.move_on_after(CLOSE_WAIT):
            await self._tasks.join()
        await self._tasks.aclose()
        await super().close()

    async def list(self) -> list[ListAppResponse]:
        """This user's apps: the jobs ``squeue`` holds, plus today's from ``sacct`` (if any).

        A ``sacct`` that fails, hangs or is missing (accounting down) costs only the apps
        ``squeue`` no longer holds: the list is then ``squeue``'s, with a warning logged.
        """
        uid = os.getuid()
        live = _by_app([j for j in await self._squeue() if j.user_id in (None, uid)])
        past: dict[str, list[SlurmJob]] = {}
        if self._accounting is not False:
            try:
                past = _by_app(await self._sacct([], listing=True), keep_runs=True)
            except (SlurmCommandError, SlurmNotFoundError, TimeoutError) as e:
                logger.warning("%s; listing only the jobs squeue holds", e)
        apps: dict[str, AppState] = {}
        for app_id, runs in past.items():
            apps[app_id] = describe_from_records(app_id, _latest_runs(runs), -1).state
        for app_id, records in live.items():
            apps[app_id] = describe_from_records(app_id, records, -1).state
        return [
            ListAppResponse(
                app_id=app_id,
                state=state,
                app_handle=make_app_handle(self.backend, self.session_name, app_id),
            )
            for app_id, state in sorted(apps.items(), key=lambda kv: int(kv[0]))
        ]

    # -- logs ----------------------------------------------------------------------------------

    async def _log_iter(self, query: LogQuery) -> AsyncIterator[str]:
        """The lines of one replica: everything it wrote (``combined.log``), or one of its streams.

        ``since``/``until`` use the timing samples the job wrote next to the logs (see
        ``_slurm/script.py``): a line is kept when the interval in which it was written overlaps
        the window. While following, ``squeue`` is asked at most every ``state_check_interval``
        seconds (less when a status round of the runner already described the app).
        """
        directory, streams = await self._log_files(query)
        is_finished = functools.partial(self._is_finished, query.app_id, _Outage())
        for stream in streams:
            lines = iter_query_lines(directory, query, is_finished, stream)
            try:
                async for line in lines:
                    yield line
            finally:
                await lines.aclose()

    async def _log_entries(self, query: LogQuery) -> AsyncGenerator[tuple[Position, str], None]:
        """``_log_iter`` with positions: the stream whose file is read and the byte offset just
        past the line in it (a job older than ``combined.log`` has its two files in turn)."""
        directory, streams = await self._log_files(query)
        skip, start = None, 0
        if query.after is not None:
            skip, start = str(query.after.position[0]), int(query.after.position[1])
            if skip not in {s.value for s in streams}:
                raise ValueError(
                    f"the log cursor's file {skip!r} is not one of this replica's log files "
                    f"({', '.join(s.value for s in streams)})"
                )
        is_finished = functools.partial(self._is_finished, query.app_id, _Outage())
        for stream in streams:
            if skip is not None and stream.value != skip:
                continue  # a file read to its end before the cursor was taken
            entries = iter_query_entries(
                directory, query, is_finished, stream, start if skip is not None else 0
            )
            skip = None
            async with contextlib.aclosing(entries):
                async for offset, line in entries:
                    yield (stream.value, offset), line

    async def _log_files(self, query: LogQuery) -> tuple[Path, tuple[Stream, ...]]:
        """The replica's log directory and the files to read in turn, once the app, role and
        replica are known to exist."""
        app_id = query.app_id
        resp = await self.describe(app_id)
        if resp is None:
            raise UnknownAppException(make_app_handle(self.backend, self.session_name, app_id))
        check_replica(app_id, role_replica_counts(resp.roles), query.role, query.k)
        workdir = self._workdirs.get(app_id)
        if not workdir:
            raise UnknownAppException(
                make_app_handle(self.backend, self.session_name, app_id),
                "Slurm does not say where its logs are",
            )
        directory = Path(workdir, log_dir(app_id, query.role, query.k))
        streams: tuple[Stream, ...] = (query.stream,)
        if query.stream == Stream.COMBINED and await anyio.to_thread.run_sync(
            _predates_combined, directory
        ):
            streams = (Stream.STDOUT, Stream.STDERR)
        return directory, streams

    async def _is_finished(self, app_id: str, outage: _Outage) -> bool:
        """Whether a followed app is over. Slurm not answering (the controller restarting or too
        busy: squeue fails or hangs) is not the end of the log: the follow goes on, asking again
        with a growing delay, and raises only once Slurm has not answered for
        ``FOLLOW_OUTAGE_LIMIT`` seconds."""
        seen = self._seen.get(app_id)
        now = time.monotonic()
        if seen is not None:
            at, state = seen
            if is_terminal(state):
                return True
            if now - at < self._state_check_interval:
                return False
        if outage.since is not None and now < outage.next_try:
            return False
        try:
            resp = await self.describe(app_id)
        except (SlurmCommandError, TimeoutError) as e:
            now = time.monotonic()
            if outage.since is None:
                outage.since, outage.delay = now, _OUTAGE_FIRST_DELAY
                logger.warning(
                    "following the log of app %s: %s; following on, asking again (for up to %g s)",
                    app_id,
                    e,
                    FOLLOW_OUTAGE_LIMIT,
                )
            elif now - outage.since >= FOLLOW_OUTAGE_LIMIT:
                what = (
                    f"Slurm did not answer for {now - outage.since:.0f} s while the log of app "
                    f"{app_id} was followed (the follow gave up; the app may still be running); "
                    f"last error: {e}"
                )
                if isinstance(e, SlurmCommandError):
                    error = SlurmCommandError(what, CommandResult(e.argv, e.returncode, "", ""))
                    error.stderr = e.stderr
                    raise error from e
                raise TimeoutError(what) from e
            else:
                outage.delay = min(outage.delay * 2, _OUTAGE_MAX_DELAY)
            outage.next_try = now + outage.delay
            return False
        if outage.since is not None:
            logger.info("following the log of app %s: Slurm answers again", app_id)
            outage.since = None
        return resp is None or is_terminal(resp.state)


# -- helpers -----------------------------------------------------------------------------------


class _Outage:
    """A log follower's run of state checks Slurm did not answer.

    Attributes:
        since: when the first of them failed (``time.monotonic()``), None while Slurm answers.
        delay: the wait before the next check.
        next_try: when the next check may be made.
    """

    __slots__ = ("delay", "next_try", "since")

    def __init__(self) -> None:
        self.since: float | None = None
        self.delay = 0.0
        self.next_try = 0.0


def _node_count(partitions: Sequence[SlurmPartition]) -> int:
    """How many distinct nodes ``partitions`` hold together (partitions may share nodes: a job that
    may go to any of them has no more); their sum when a node list cannot be read."""
    if len(partitions) == 1:
        return partitions[0].total_nodes
    names: set[str] = set()
    for p in partitions:
        hosts = expand_hostlist(p.nodes)
        if hosts is None or len(hosts) != p.total_nodes:
            return sum(p.total_nodes for p in partitions)
        names |= hosts
    return len(names)


async def _make_job_dir(job_dir: str, made: list[str]) -> None:
    """Creates ``job_dir`` and its missing parents in a worker thread, putting those it made in
    ``made`` (see ``make_dirs``); a cancelled caller returns once the thread has ended.

    Raises:
        OSError: it cannot be created (the message names the run option).
    """
    try:
        await run_in_thread(slurm_workspace.make_dirs, job_dir, made, wait_on_cancel=True)
    except OSError as e:
        raise type(e)(
            e.errno, f"run option 'job_dir' cannot be created: {e.strerror}", job_dir
        ) from None


def _predates_combined(directory: Path) -> bool:
    """True for the log directory of a job submitted before jobs wrote ``combined.log``.

    The batch script creates ``combined.log`` before ``srun`` starts the replicas (and so before
    Slurm creates ``stdout.log``): a directory with ``stdout.log`` or ``stderr.log`` but no
    ``combined.log`` belongs to an older job.
    """
    if (directory / COMBINED_FILE).exists():
        return False
    return (directory / "stdout.log").exists() or (directory / "stderr.log").exists()


def _by_app(records: Iterable[SlurmJob], *, keep_runs: bool = False) -> dict[str, list[SlurmJob]]:
    grouped: dict[str, list[SlurmJob]] = {}
    for job in records:
        grouped.setdefault(job.app_id, []).append(job)
    if not keep_runs:
        return {a: _latest_runs(jobs) for a, jobs in grouped.items()}
    return grouped


def _latest_runs(records: Sequence[SlurmJob]) -> list[SlurmJob]:
    """The last record of each component (``sacct --duplicates`` lists earlier runs first)."""
    latest: dict[int, SlurmJob] = {}
    for job in records:
        latest[job.job_id] = job
    return list(latest.values())


#: What of squeue's records of a finished app changes when Slurm runs it again.
_Fingerprint = tuple[tuple[int, str, int, int | None], ...]


class _Final(NamedTuple):
    """A finished app remembered.

    Args:
        resp: its description.
        squeue: how squeue's records read when it was last seen (None: squeue no longer lists it).
        confirmed: when squeue last confirmed it (``time.monotonic()``).
    """

    resp: DescribeAppResponse
    squeue: _Fingerprint | None
    confirmed: float


def _fingerprint(records: Iterable[SlurmJob]) -> _Fingerprint:
    return tuple(sorted((j.job_id, j.state, j.restarts, j.end_time) for j in records))


def _all_final(records: Sequence[SlurmJob], at_least: int) -> bool:
    """True when there are ``at_least`` records and every one is in a final state."""
    return len(records) >= at_least and all(is_terminal(app_state_of(j.state)) for j in records)


_COMPONENT_NAME = re.compile(r".+-[0-9]+")


def _settled(records: Sequence[SlurmJob]) -> bool:
    """False while accounting holds a placeholder of a job that has just ended (for a second or
    two slurmdbd may have its steps before its own record: JobName ``allocation``, no WorkDir):
    such records are not remembered as final, and are asked for again next time."""
    return all(j.workdir and _COMPONENT_NAME.fullmatch(j.name) for j in records)


def _merge_steps(records: Sequence[SlurmJob], runs: Sequence[SlurmJob]) -> list[SlurmJob]:
    """``squeue``'s records with the steps of ``sacct``'s records of the same finished runs."""
    steps = {j.job_id: j.steps for j in runs if j.steps and is_terminal(app_state_of(j.state))}
    return [replace(j, steps=steps[j.job_id]) if j.job_id in steps else j for j in records]


def _restarts(records: Sequence[SlurmJob]) -> int:
    leader = min(records, key=lambda j: j.het_offset)
    return leader.restarts


def _sacct_restarts(records: Sequence[SlurmJob]) -> int:
    leader_id = min(records, key=lambda j: j.het_offset).job_id
    return sum(1 for j in records if j.job_id == leader_id) - 1


def _read_exit_codes(paths: Sequence[str]) -> list[int | None]:
    codes: list[int | None] = []
    for path in paths:
        try:
            with open(path, encoding="ascii", errors="replace") as f:
                text = f.read(32).strip()
        except OSError:
            text = ""
        codes.append(int(text) if is_digits(text) else None)
    return codes


def _apply_exit_code(replica: ReplicaStatus, code: int | None) -> None:
    if code is None:
        return
    replica.exit_code = code
    if code == 0 and replica.state == AppState.FAILED:
        replica.state = AppState.SUCCEEDED  # it finished fine; another replica failed the app


def create_scheduler(session_name: str, **kwargs: Any) -> SlurmScheduler:
    """Creates the ``slurm`` scheduler.

    Reads ``slurm_runner``, ``slurm_accounting`` and ``slurm_state_check_interval`` (the constructor's
    ``runner``, ``accounting``, ``state_check_interval``, prefixed because a runner passes the same
    parameters to every backend); other keyword arguments are ignored.
    """
    known = {
        name: kwargs[f"slurm_{name}"]
        for name in ("runner", "accounting", "state_check_interval")
        if f"slurm_{name}" in kwargs
    }
    return SlurmScheduler(session_name, **known)
