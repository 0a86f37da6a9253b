"""The state of an app from its Service, Jobs and Pods (pure: plain JSON objects in, a response out).

Rules:

- a Job with a true ``Complete`` or ``SuccessCriteriaMet`` condition succeeded; ``Failed`` or
  ``FailureTarget`` failed; but only once none of its pods is still pending or running (the pods are
  watched apart from the Jobs, so a Job's verdict can arrive before its pods' last states: until
  they agree the Job reads as RUNNING, and the final status always shows the replicas' exit codes);
  a deleted Job was stopped, and so was a suspended one unless Kueue queues it (then it is PENDING:
  Kueue suspends a Job until its queue admits it, and again when it is preempted); otherwise it is RUNNING once one of its pods runs (or an
  index completed) and PENDING before; a missing ``status`` means PENDING;
- a replica is the newest pod of its completion index; pod phases map one to one and any phase the
  backend does not know (``Unknown``, or a new one) is UNKNOWN;
- the app: a Service being deleted means CANCELLED (unless every role had succeeded); any failed
  role means FAILED, unless the backend is restarting it (ROLE/APPLICATION retries), which reads as
  RUNNING; all roles succeeded means SUCCEEDED; fewer Jobs than roles means PENDING;
- a restart recorded on the Service (``RestartRecord``) whose Jobs are not all recreated yet: FAILED
  when it failed (its Job could not be recreated: the message names the roles and the reason), or
  when its record went unrefreshed for ``RESTART_STALE_NS`` (the process doing it stopped between
  deleting and recreating: without this the app would read PENDING forever); else the app reads
  as restarting (RUNNING), in any process;
- ``num_restarts`` counts application restarts, role restarts (the attempt labels the backend puts on
  recreated Jobs) and replica restarts (the per-index failure counts the Job controller records on
  each replacement pod, disruptions included).

Follow-ups (``follow_up``), for an app the scheduler submitted and looks after (``ManagedApp``): a
failed role with a ROLE or APPLICATION retry left is restarted (``Restart``: its Jobs, or all the
app's, deleted and recreated as the next attempt); a role failed for good stops the others
(``StopRoles``: their Jobs suspended); a finished or deleted app is no longer looked after
(``Forget``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from asynctorchx.logs._timestamps import format_rfc3339_seconds, parse_rfc3339_ns
from asynctorchx.schedulers._k8s import names as n
from asynctorchx.schedulers._k8s.manifests import KubernetesRequest, role_from_json
from asynctorchx.schedulers.api import DescribeAppResponse
from asynctorchx.specs.api import (
    NONE,
    AppState,
    ReplicaStatus,
    RetryPolicy,
    Role,
    RoleStatus,
    is_terminal,
)

Obj = Mapping[str, Any]

_POD_PHASES = {
    "Pending": AppState.PENDING,
    "Running": AppState.RUNNING,
    "Succeeded": AppState.SUCCEEDED,
    "Failed": AppState.FAILED,
}


def parse_time_ns(value: str | None) -> int | None:
    """An RFC 3339 time (with up to nanoseconds) as integer nanoseconds since the epoch, or None
    when it is missing or malformed (the shared parser of ``asynctorchx.logs``)."""
    if not value:
        return None
    try:
        return parse_rfc3339_ns(value.strip())
    except ValueError:
        return None


def meta(obj: Obj) -> Obj:
    """The object's metadata (empty when missing)."""
    m = obj.get("metadata")
    return m if isinstance(m, Mapping) else {}


def labels_of(obj: Obj) -> Mapping[str, str]:
    """The object's labels."""
    return meta(obj).get("labels") or {}


def annotations_of(obj: Obj) -> Mapping[str, str]:
    """The object's annotations."""
    return meta(obj).get("annotations") or {}


def _int(value: object, default: int = 0) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return default


def pod_index(pod: Obj) -> int | None:
    """The completion index of a pod of an Indexed Job (label, else annotation)."""
    raw = labels_of(pod).get(n.COMPLETION_INDEX, annotations_of(pod).get(n.COMPLETION_INDEX))
    if raw is None:
        return None
    idx = _int(raw, -1)
    return idx if idx >= 0 else None


def pod_sort_key(pod: Obj) -> tuple[int, int, str]:
    """Orders pods oldest first: creation time, then resource version, then name."""
    m = meta(pod)
    return (
        parse_time_ns(m.get("creationTimestamp")) or 0,
        _int(m.get("resourceVersion")),
        str(m.get("name", "")),
    )


def newest_pods(pods: Iterable[Obj]) -> dict[int, Obj]:
    """The newest pod of every completion index."""
    out: dict[int, Obj] = {}
    for pod in sorted(pods, key=pod_sort_key):
        idx = pod_index(pod)
        if idx is not None:
            out[idx] = pod
    return out


def parse_index_set(text: str | None) -> set[int]:
    """Parses the Job status' index lists (``"1,3-5,7"``)."""
    out: set[int] = set()
    for part in (text or "").split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.strip().isdigit():
            continue
        if sep and hi.strip().isdigit():
            out.update(range(int(lo), int(hi) + 1))
        else:
            out.add(int(lo))
    return out


def _main_container_status(pod: Obj) -> Obj:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return statuses[0] if statuses else {}


def pod_exit(pod: Obj) -> tuple[int | None, str]:
    """The exit code and termination message of a pod's (first) container, when it terminated."""
    term = (_main_container_status(pod).get("state") or {}).get("terminated") or {}
    code = term.get("exitCode")
    return (code if isinstance(code, int) else None), str(term.get("message") or "")


def pod_state(pod: Obj) -> AppState:
    """The replica state of a pod: its phase, UNKNOWN for a phase the backend does not know."""
    phase = (pod.get("status") or {}).get("phase")
    if phase is None:
        return AppState.PENDING
    return _POD_PHASES.get(phase, AppState.UNKNOWN)


def pod_started(pod: Obj) -> bool:
    """True once the pod's container has started (running or terminated): its log can be read."""
    state = _main_container_status(pod).get("state") or {}
    return "running" in state or "terminated" in state


def pod_restarts(pod: Obj) -> int:
    """How many pods of this index failed before this one (failures and ignored disruptions)."""
    ann = annotations_of(pod)
    return _int(ann.get(n.INDEX_FAILURE_COUNT)) + _int(ann.get(n.INDEX_IGNORED_FAILURE_COUNT))


def _true_conditions(obj: Obj) -> dict[str, Obj]:
    conds = (obj.get("status") or {}).get("conditions") or []
    return {c.get("type", ""): c for c in conds if c.get("status") == "True"}


def job_condition_message(job: Obj) -> str:
    """``reason: message`` of the Job's failure condition, or ''."""
    conds = _true_conditions(job)
    cond = conds.get("Failed") or conds.get("FailureTarget")
    if not cond:
        return ""
    reason, message = cond.get("reason", ""), cond.get("message", "")
    return f"{reason}: {message}" if reason and message else reason or message


def job_finished(job: Obj) -> bool:
    """True once the Job has a condition that says it succeeded or failed."""
    conds = _true_conditions(job)
    return bool(conds.keys() & {"Complete", "SuccessCriteriaMet", "Failed", "FailureTarget"})


def job_state(job: Obj, pods: Sequence[Obj] = ()) -> AppState:
    """The state of one role's Job (see the module docstring)."""
    conds = _true_conditions(job)
    states = [pod_state(p) for p in newest_pods(pods).values()]
    settled = AppState.PENDING not in states and AppState.RUNNING not in states
    if "Complete" in conds or "SuccessCriteriaMet" in conds:
        return AppState.SUCCEEDED if settled else AppState.RUNNING
    if "Failed" in conds or "FailureTarget" in conds:
        return AppState.FAILED if settled else AppState.RUNNING
    if meta(job).get("deletionTimestamp"):
        return AppState.CANCELLED
    if is_queued(job) and _suspended(job):
        return AppState.PENDING  # Kueue suspends it until admitted, and again when preempted
    if "Suspended" in conds:
        return AppState.CANCELLED
    status = job.get("status") or {}
    if AppState.RUNNING in states or _int(status.get("succeeded")) > 0:
        return AppState.RUNNING
    if AppState.UNKNOWN in states:
        return AppState.UNKNOWN
    return AppState.PENDING


def _suspended(job: Obj) -> bool:
    return bool((job.get("spec") or {}).get("suspend")) or "Suspended" in _true_conditions(job)


def is_queued(job: Obj) -> bool:
    """True for a Job handed to Kueue (it carries a ``kueue.x-k8s.io/queue-name`` label)."""
    return bool(labels_of(job).get(n.LABEL_KUEUE_QUEUE))


def job_attempts(job: Obj) -> tuple[int, int]:
    """``(app attempt, role attempt)`` of a Job (0 for the first submission)."""
    lab = labels_of(job)
    return _int(lab.get(n.LABEL_APP_ATTEMPT)), _int(lab.get(n.LABEL_ROLE_ATTEMPT))


def job_role(job: Obj) -> Role | None:
    """The role a Job runs, as stored on it at submission."""
    raw = annotations_of(job).get(n.ANN_ROLE)
    return role_from_json(raw) if raw else None


def job_role_index(job: Obj) -> int:
    """The role's position in the app."""
    return _int(annotations_of(job).get(n.ANN_ROLE_INDEX), 1 << 30)


def service_role_names(service: Obj) -> list[str]:
    """The names of the app's roles as recorded on the Service."""
    try:
        names = json.loads(annotations_of(service).get(n.ANN_ROLES, "[]"))
    except ValueError:
        return []
    return [str(x) for x in names] if isinstance(names, list) else []


def pods_of_job(job: Obj, pods: Iterable[Obj]) -> list[Obj]:
    """The pods created for this Job (by owner uid, else by role label)."""
    uid = meta(job).get("uid")
    role = labels_of(job).get(n.LABEL_ROLE)
    out = []
    for pod in pods:
        owners = meta(pod).get("ownerReferences") or []
        if uid and owners:
            if any(o.get("uid") == uid for o in owners):
                out.append(pod)
        elif labels_of(pod).get(n.LABEL_ROLE) == role:
            out.append(pod)
    return out


def _replica(
    role_name: str,
    idx: int,
    pod: Obj | None,
    job: Obj,
    job_st: AppState,
    hostname: str,
) -> ReplicaStatus:
    if pod is None:
        status = job.get("status") or {}
        if idx in parse_index_set(status.get("completedIndexes")):
            state = AppState.SUCCEEDED
        elif idx in parse_index_set(status.get("failedIndexes")):
            state = AppState.FAILED
        elif job_st in (AppState.FAILED, AppState.CANCELLED):
            state = AppState.CANCELLED
        elif job_st == AppState.SUCCEEDED:
            state = AppState.SUCCEEDED
        else:
            state = AppState.PENDING
        return ReplicaStatus(id=idx, state=state, role=role_name, hostname=hostname)
    spec = pod.get("spec") or {}
    if spec.get("hostname") and spec.get("subdomain"):
        hostname = f"{spec['hostname']}.{spec['subdomain']}"
    code, message = pod_exit(pod)
    state = pod_state(pod)
    return ReplicaStatus(
        id=idx,
        state=state,
        role=role_name,
        hostname=hostname,
        structured_error_msg=message if message and state == AppState.FAILED else NONE,
        exit_code=code,
    )


@dataclass
class _Roles:
    """What ``describe_app`` gathers from the app's Jobs, in role order."""

    roles: list[Role] = field(default_factory=list)
    statuses: list[RoleStatus] = field(default_factory=list)
    states: list[AppState] = field(default_factory=list)
    restarts: int = 0
    #: the first failure: (role, replica or -1, exit code, termination message, Job condition)
    failure: tuple[str, int, int | None, str, str] | None = None


def _read_roles(app_name: str, jobs: Sequence[Obj], pods: Sequence[Obj]) -> _Roles:
    out = _Roles()
    restarts_app = 0
    for job in jobs:
        role = job_role(job)
        role_dns = labels_of(job).get(n.LABEL_ROLE, "")
        role_name = role.name if role else role_dns
        if role:
            out.roles.append(role)
        jpods = pods_of_job(job, pods)
        st = job_state(job, jpods)
        out.states.append(st)
        app_attempt, role_attempt = job_attempts(job)
        restarts_app = max(restarts_app, app_attempt)
        newest = newest_pods(jpods)
        out.restarts += role_attempt + sum(pod_restarts(p) for p in newest.values())
        completions = _int(
            (job.get("spec") or {}).get("completions"), role.num_replicas if role else 0
        )
        replicas = []
        for idx in range(completions):
            host = f"{n.pod_hostname(app_name, role_dns, idx)}.{app_name}"
            replica = _replica(role_name, idx, newest.get(idx), job, st, host)
            replicas.append(replica)
            if out.failure is None and replica.state == AppState.FAILED:
                out.failure = (
                    role_name,
                    idx,
                    replica.exit_code,
                    replica.structured_error_msg,
                    job_condition_message(job),
                )
        if st == AppState.FAILED and out.failure is None:
            out.failure = (role_name, -1, None, NONE, job_condition_message(job))
        out.statuses.append(RoleStatus(role=role_name, replicas=replicas))
    out.restarts += restarts_app
    return out


def _failure_message(failure: tuple[str, int, int | None, str, str] | None) -> tuple[str, str]:
    """``(msg, structured error)`` of a failed app."""
    if failure is None:
        return NONE, NONE
    role_name, idx, code, message, reason = failure
    where = f"role {role_name!r}" + (f" replica {idx}" if idx >= 0 else "")
    msg = f"{where} failed" + (f" with exit code {code}" if code is not None else "")
    if reason:
        msg += f" ({reason})"
    return msg, message if message != NONE and _is_json_error(message) else NONE


def _app_state(
    read: _Roles,
    expected: int,
    jobs: int,
    deleting: bool,
    restarting: bool,
    restart_failure: str | None = None,
) -> tuple[AppState, str, str]:
    """The app's state, message and structured error (see the module docstring)."""
    states = read.states
    if states and len(states) == expected and all(s == AppState.SUCCEEDED for s in states):
        return AppState.SUCCEEDED, NONE, NONE
    if deleting:
        return AppState.CANCELLED, "cancelled: the app's objects are being deleted", NONE
    if restart_failure is not None:
        return AppState.FAILED, restart_failure, NONE
    if AppState.FAILED in states:
        if restarting:
            return AppState.RUNNING, "restarting after a failure", NONE
        return (AppState.FAILED, *_failure_message(read.failure))
    if AppState.CANCELLED in states:
        return (AppState.RUNNING if restarting else AppState.CANCELLED), NONE, NONE
    if jobs < expected:
        return (AppState.RUNNING if restarting else AppState.PENDING), NONE, NONE
    if AppState.RUNNING in states or AppState.SUCCEEDED in states:
        return AppState.RUNNING, NONE, NONE
    if AppState.UNKNOWN in states:
        return AppState.UNKNOWN, NONE, NONE
    return AppState.PENDING, NONE, NONE


def describe_app(
    service: Obj,
    jobs: Sequence[Obj],
    pods: Sequence[Obj],
    *,
    restarting: bool = False,
    now_ns: int | None = None,
) -> DescribeAppResponse:
    """The description of one app from its objects.

    Args:
        service: the app's Service.
        jobs: the app's Jobs (any order).
        pods: the app's pods (any order, replaced ones included).
        restarting: this process is restarting a failed role or the whole app (a failed Job then
            reads as RUNNING, whatever the Service records).
        now_ns: the time (ns since the epoch) a restart recorded on the Service is judged at
            (default: the clock's).
    """
    smeta = meta(service)
    name = str(smeta.get("name", ""))
    jobs = sorted(jobs, key=job_role_index)
    read = _read_roles(name, jobs, pods)
    expected = max(len(service_role_names(service)), len(jobs))
    deleting = bool(smeta.get("deletionTimestamp"))
    restart_failure: str | None = None
    if not restarting:
        restart_failure, restarting = _recorded_restart(
            service, jobs, time.time_ns() if now_ns is None else now_ns
        )
    state, msg, structured = _app_state(
        read, expected, len(jobs), deleting, restarting, restart_failure
    )
    if state == AppState.PENDING:
        waiting = sorted(
            {labels_of(j)[n.LABEL_KUEUE_QUEUE] for j in jobs if is_queued(j) and _suspended(j)}
        )
        if waiting:
            msg = f"waiting for Kueue to admit it (queue {', '.join(waiting)})"
    return DescribeAppResponse(
        app_id=n.make_app_id(str(smeta.get("namespace", "default")), name),
        state=state,
        num_restarts=read.restarts,
        msg=msg,
        structured_error_msg=structured,
        roles_statuses=read.statuses,
        roles=read.roles,
        name=str(annotations_of(service).get(n.ANN_APP_NAME, name)),
    )


#: how long a restart recorded on the Service may go unrefreshed before it reads as interrupted
#: (the process doing it refreshes it every ``RESTART_HEARTBEAT`` seconds while it waits for the
#: old Jobs to go, and recreates them within a request timeout after that)
RESTART_STALE_NS = 120 * 10**9
RESTART_HEARTBEAT = 30.0


@dataclass(frozen=True)
class RestartRecord:
    """A ROLE or APPLICATION restart as recorded on the app's Service (``n.ANN_RESTART``): written
    before the failed Jobs are deleted, removed once they are recreated, and given the reason when
    they could not be, so that any process reads such an app as FAILED rather than PENDING.

    Args:
        roles: the indexes of the roles restarted.
        app_attempt: the app attempt the Jobs are recreated as.
        role_attempts: the role attempt each of ``roles`` is recreated as.
        at_ns: when the restart began or last said it was still under way (ns since the epoch).
        error: why the Jobs could not be recreated ('' while under way).
    """

    roles: tuple[int, ...]
    app_attempt: int
    role_attempts: tuple[int, ...]
    at_ns: int
    error: str = ""

    def to_json(self) -> str:
        """The annotation's value."""
        data: dict[str, Any] = {
            "roles": list(self.roles),
            "app_attempt": self.app_attempt,
            "role_attempts": list(self.role_attempts),
            "at": format_rfc3339_seconds(self.at_ns),
        }
        if self.error:
            data["error"] = self.error
        return json.dumps(data, separators=(",", ":"))

    @staticmethod
    def of(service: Obj) -> RestartRecord | None:
        """The restart recorded on the Service, or None (none, or not the backend's JSON)."""
        raw = annotations_of(service).get(n.ANN_RESTART)
        try:
            data: Any = json.loads(raw) if isinstance(raw, str) else None
            roles = tuple(int(i) for i in data["roles"])
            attempts = tuple(int(i) for i in data["role_attempts"])
            at_ns = parse_time_ns(str(data["at"]))
            if len(roles) != len(attempts) or at_ns is None:
                return None
            return RestartRecord(
                roles, int(data["app_attempt"]), attempts, at_ns, str(data.get("error") or "")
            )
        except (TypeError, ValueError, KeyError):
            return None

    def pending(self, jobs: Sequence[Obj]) -> list[int]:
        """The recorded roles that have no Job of the attempt they are recreated as yet."""
        done = set()
        for job in jobs:
            app_attempt, role_attempt = job_attempts(job)
            i = job_role_index(job)
            if (
                i in self.roles
                and app_attempt >= self.app_attempt
                and role_attempt >= self.role_attempts[self.roles.index(i)]
            ):
                done.add(i)
        return [i for i in self.roles if i not in done]


def _recorded_restart(service: Obj, jobs: Sequence[Obj], now_ns: int) -> tuple[str | None, bool]:
    """``(failure message or None, restarting)`` from the restart recorded on the Service."""
    record = RestartRecord.of(service)
    pending = record.pending(jobs) if record is not None else []
    if record is None or not pending:
        return None, False
    names = service_role_names(service)
    which = ", ".join(repr(names[i]) if 0 <= i < len(names) else f"#{i}" for i in pending)
    roles = f"role{'s' if len(pending) > 1 else ''} {which}"
    if record.error:
        return f"{roles} failed and could not be restarted: {record.error}", False
    if now_ns - record.at_ns > RESTART_STALE_NS:
        since = format_rfc3339_seconds(record.at_ns)
        jobs_were = "its Job was" if len(pending) == 1 else "their Jobs were"
        return (
            f"the restart of {roles} was interrupted: {jobs_were} not recreated (the process "
            f"restarting it stopped; its last news was at {since})",
            False,
        )
    return None, True


def _is_json_error(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


# -- follow-ups ----------------------------------------------------------------------------------


@dataclass
class ManagedApp:
    """An app this scheduler submitted and looks after (restarts, stopping roles after a failure).

    Args:
        request: what was submitted (the Jobs are recreated from it).
        service: the Service as created (the recreated Jobs' owner).
        app_attempt: APPLICATION restarts done so far.
        role_attempts: ROLE restarts done so far, per role.
        restarting: a restart is under way (the app then reads RUNNING, not FAILED).
    """

    request: KubernetesRequest
    service: dict[str, Any]
    app_attempt: int = 0
    role_attempts: list[int] = field(default_factory=list)
    restarting: bool = False


@dataclass(frozen=True)
class Restart:
    """Delete these roles' Jobs and recreate them as the next attempt (the whole app's, or each
    role's)."""

    roles: tuple[int, ...]
    whole_app: bool


@dataclass(frozen=True)
class StopRoles:
    """The app failed for good: suspend these Jobs (their pods stop) and stop looking after it."""

    jobs: tuple[str, ...]


@dataclass(frozen=True)
class Forget:
    """Stop looking after the app: it succeeded, or it is gone or being deleted."""


#: A follow-up the backend owes an app it looks after.
KubeAction = Restart | StopRoles | Forget


def restart_plan(managed: ManagedApp, jobs: Sequence[Obj], pods: Sequence[Obj]) -> list[int] | None:
    """The role indexes to restart for the app's failed Jobs, or None when none can restart."""
    failed = [
        job_role_index(j) for j in jobs if job_state(j, pods_of_job(j, pods)) == AppState.FAILED
    ]
    roles = managed.request.roles
    for i in failed:
        if not 0 <= i < len(roles):
            return None
        role = roles[i]
        policy = RetryPolicy(role.retry_policy)
        if policy == RetryPolicy.APPLICATION and managed.app_attempt < role.max_retries:
            return list(range(len(roles)))
        if policy == RetryPolicy.ROLE and managed.role_attempts[i] < role.max_retries:
            continue
        return None
    return failed or None


def follow_up(
    managed: ManagedApp, service: Obj | None, jobs: Sequence[Obj], pods: Sequence[Obj]
) -> KubeAction | None:
    """What the backend owes an app it looks after, from the app's objects (None: nothing now)."""
    if service is None or meta(service).get("deletionTimestamp"):
        return Forget()
    states = [job_state(j, pods_of_job(j, pods)) for j in jobs]
    roles = managed.request.roles
    if len(jobs) == len(roles) and all(s == AppState.SUCCEEDED for s in states):
        return Forget()
    if AppState.FAILED not in states:
        return None
    plan = restart_plan(managed, jobs, pods)
    if plan is None:
        running = [
            str(meta(j).get("name", ""))
            for j, st in zip(jobs, states, strict=True)
            if not is_terminal(st) and not (j.get("spec") or {}).get("suspend")
        ]
        return StopRoles(tuple(running))
    whole_app = len(plan) == len(roles) and any(
        RetryPolicy(roles[i].retry_policy) == RetryPolicy.APPLICATION for i in plan
    )
    return Restart(tuple(plan), whole_app)
