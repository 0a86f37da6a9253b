"""Slurm job states -> AppState, and job records -> a ``DescribeAppResponse``. Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from asynctorchx.schedulers._slurm.parse import SlurmJob, first_host, is_digits
from asynctorchx.schedulers.api import DescribeAppResponse
from asynctorchx.specs.api import AppState, ReplicaStatus, Role, RoleStatus, is_terminal

#: Every documented Slurm job state and what it means for an app. A state not listed maps to
#: UNKNOWN (never to SUCCEEDED).
SLURM_STATES: Mapping[str, AppState] = {
    "PENDING": AppState.PENDING,
    "CONFIGURING": AppState.PENDING,  # allocated, nodes booting
    "REQUEUED": AppState.PENDING,  # about to run again
    "REQUEUE_FED": AppState.PENDING,
    "REQUEUE_HOLD": AppState.PENDING,  # requeued and held until released
    "SPECIAL_EXIT": AppState.PENDING,  # requeued and held by a special exit value
    "RESV_DEL_HOLD": AppState.PENDING,
    "SUSPENDED": AppState.PENDING,  # stopped by the scheduler, will resume
    "STOPPED": AppState.PENDING,  # SIGSTOPped, keeps its allocation
    "RUNNING": AppState.RUNNING,
    "COMPLETING": AppState.RUNNING,  # processes still ending; the outcome is not final yet
    "SIGNALING": AppState.RUNNING,
    "RESIZING": AppState.RUNNING,
    "STAGE_OUT": AppState.RUNNING,  # burst buffer stage-out after the run
    "COMPLETED": AppState.SUCCEEDED,
    "FAILED": AppState.FAILED,
    "TIMEOUT": AppState.FAILED,
    "OUT_OF_MEMORY": AppState.FAILED,
    "NODE_FAIL": AppState.FAILED,
    "BOOT_FAIL": AppState.FAILED,
    "DEADLINE": AppState.FAILED,
    "PREEMPTED": AppState.FAILED,
    "REVOKED": AppState.FAILED,
    "CANCELLED": AppState.CANCELLED,
}


def app_state_of(slurm_state: str) -> AppState:
    """The AppState of a Slurm state name (``CANCELLED by 0`` and lower case accepted)."""
    words = slurm_state.split()
    return SLURM_STATES.get(words[0].upper(), AppState.UNKNOWN) if words else AppState.UNKNOWN


def aggregate_state(states: Sequence[AppState]) -> AppState:
    """The state of an app from the states of its components.

    Any component still going keeps the app going (RUNNING if one runs, else PENDING); once all are
    final, one CANCELLED makes the app CANCELLED, one FAILED makes it FAILED, and it SUCCEEDED only
    if every component did. Any UNKNOWN component makes the app UNKNOWN until the others say more.
    """
    if not states:
        return AppState.UNKNOWN
    live = [s for s in states if not is_terminal(s)]
    if live:
        if AppState.RUNNING in live:
            return AppState.RUNNING
        if all(s == AppState.PENDING for s in live):
            return AppState.PENDING
        return AppState.UNKNOWN
    if AppState.CANCELLED in states:
        return AppState.CANCELLED
    if AppState.FAILED in states:
        return AppState.FAILED
    return AppState.SUCCEEDED


def split_job_name(name: str, offset: int) -> tuple[str, int]:
    """``(role, replica)`` from a component name ``{role}-{replica}``; foreign names keep the offset."""
    role, sep, replica = name.rpartition("-")
    if sep and role and is_digits(replica):
        return role, int(replica)
    return name or "job", offset


def _replica_exit_code(job: SlurmJob, state: AppState) -> int | None:
    """The exit code of the replica a component ran: its ``srun`` step's, from accounting.

    Without step records (``squeue`` only) the component reports the batch script's exit code, which
    belongs to the whole app, not to one replica: it is left out here and reported in the message.
    """
    srun_steps = [s for s in job.steps if is_digits(s.step_id)]
    if srun_steps:
        step = max(srun_steps, key=lambda s: int(s.step_id))
        return step.exit_code if step.signal is None else 128 + step.signal
    if state == AppState.SUCCEEDED:
        return 0
    return None


def _app_exit_code(leader: SlurmJob, states: Sequence[AppState]) -> int | None:
    batch = [s for s in leader.steps if s.step_id == "batch"]
    if batch and batch[-1].exit_code is not None:
        return batch[-1].exit_code
    if leader.exit_code is not None and (leader.exit_code or AppState.FAILED not in states):
        return leader.exit_code
    return None


def describe_from_records(
    app_id: str, components: Sequence[SlurmJob], restarts: int
) -> DescribeAppResponse:
    """The description of one app from the records of its components (latest run of each).

    Args:
        app_id: the app (heterogeneous job) id.
        components: one record per component; any order.
        restarts: how many times the job was requeued (-1: unknown).
    """
    ordered = sorted(components, key=lambda j: j.het_offset)
    leader = ordered[0]
    roles: dict[str, RoleStatus] = {}
    role_defs: dict[str, Role] = {}
    states: list[AppState] = []
    for job in ordered:
        state = app_state_of(job.state)
        states.append(state)
        role, replica_id = split_job_name(job.name, job.het_offset)
        exit_code = _replica_exit_code(job, state)
        status = roles.setdefault(role, RoleStatus(role=role, replicas=[]))
        status.replicas.append(
            ReplicaStatus(
                id=replica_id,
                # a replica that exited 0 succeeded, even when another one failed the app
                state=AppState.SUCCEEDED if state == AppState.FAILED and exit_code == 0 else state,
                role=role,
                hostname=first_host(job.nodes),
                exit_code=exit_code,
            )
        )
        role_def = role_defs.setdefault(role, Role(name=role, image="", num_replicas=0))
        role_def.num_replicas += 1
    for status in roles.values():
        status.replicas.sort(key=lambda r: r.id)
    app_state = aggregate_state(states)
    msg = leader.state
    if leader.reason and leader.reason not in ("None", "NonZeroExitCode"):
        msg += f": {leader.reason}"
    exit_code = _app_exit_code(leader, states)
    if is_terminal(app_state) and app_state != AppState.SUCCEEDED:
        if exit_code:
            msg += f" (exit code {exit_code})"
        elif leader.signal:
            msg += f" (signal {leader.signal})"
    return DescribeAppResponse(
        app_id=app_id,
        state=app_state,
        num_restarts=restarts,
        msg=msg,
        roles_statuses=list(roles.values()),
        roles=list(role_defs.values()),
    )
