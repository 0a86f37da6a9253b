"""An app's state, read back from the containers Docker lists for it. Pure, no I/O.

Docker keeps no app object, so the app is the set of containers carrying its id label: one per
replica and attempt (attempt 0 is the first run; the backend adds attempts for ROLE/APPLICATION
retries), plus a never-started marker container once the app has been cancelled. ``assess`` turns
them into a ``DescribeAppResponse`` and the follow-up actions the backend owes the app (retry some
replicas, stop the survivors of a failed app, remove its network or containers): a status read
uses the first, the event-driven follow-up of the backend the second.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from asynctorchx.schedulers._docker.request import (
    KIND_CANCEL_MARKER,
    KIND_RETRY_FAILED,
    LABEL_APP_ID,
    LABEL_APP_NAME,
    LABEL_ATTEMPT,
    LABEL_HOSTNAME,
    LABEL_KIND,
    LABEL_MAX_RETRIES,
    LABEL_NETWORK,
    LABEL_REASON,
    LABEL_REMOVE_FINISHED,
    LABEL_REPLICA_ID,
    LABEL_RETRY_POLICY,
    LABEL_ROLE_NAME,
    LABEL_ROLES,
    LABEL_SESSION,
)
from asynctorchx.schedulers.api import DescribeAppResponse
from asynctorchx.specs.api import (
    LINUX_PID_MAX_LIMIT,
    NONE,
    AppState,
    ReplicaStatus,
    RetryPolicy,
    Role,
    RoleStatus,
    is_terminal,
)

_EXITED_RE = re.compile(r"^Exited \((-?\d+)\)")


@dataclass(frozen=True)
class ContainerInfo:
    """What the backend reads from one entry of ``GET /containers/json``.

    Args:
        id: the container id.
        name: the container name (without Docker's leading ``/``).
        image: the image the container was created from.
        labels: its labels.
        state: Docker's state word: created, running, restarting, paused, removing, exited or dead.
        exit_code: the exit code once exited (parsed from Docker's status text), else None.
        created: creation time (POSIX seconds).
        restart_count: how often Docker's restart policy restarted it (-1 when not looked up).
        launcher_gone: never started, and the process that created it to start it has exited
            (see ``processes.with_launchers_judged``): nobody will start it.
        oom_killed: the kernel killed it for running out of memory (``State.OOMKilled``, looked
            up only for an exit code of 137, which ``docker kill`` gives too).
        finished_at: when it exited, in nanoseconds since the epoch (``State.FinishedAt``, looked
            up only when more than one replica of the app failed), else None.
        stopped_by_backend: the backend stopped it because another replica had failed the app
            (known only to the process that stopped it).
    """

    id: str
    name: str
    image: str
    labels: Mapping[str, str]
    state: str
    exit_code: int | None
    created: int
    restart_count: int = -1
    launcher_gone: bool = False
    oom_killed: bool = False
    finished_at: int | None = None
    stopped_by_backend: bool = False

    @property
    def app_id(self) -> str:
        return self.labels.get(LABEL_APP_ID, "")

    @property
    def is_marker(self) -> bool:
        """A cancel marker (see ``request.cancel_marker``)."""
        return self.labels.get(LABEL_KIND) == KIND_CANCEL_MARKER

    @property
    def is_retry_failure(self) -> bool:
        """The record of a retry that could not be made (see ``request.retry_failed_record``)."""
        return self.labels.get(LABEL_KIND) == KIND_RETRY_FAILED

    @property
    def is_record(self) -> bool:
        """A never-started container that records something of the app, not a replica: a cancel
        marker or a failed-retry record."""
        return self.is_marker or self.is_retry_failure

    @property
    def role(self) -> str:
        return self.labels.get(LABEL_ROLE_NAME, "")

    @property
    def replica_id(self) -> int:
        return _int(self.labels.get(LABEL_REPLICA_ID), -1)

    @property
    def attempt(self) -> int:
        return _int(self.labels.get(LABEL_ATTEMPT), 0)

    @property
    def hostname(self) -> str:
        return self.labels.get(LABEL_HOSTNAME) or self.name

    @property
    def alive(self) -> bool:
        """True while the container runs or Docker is about to restart it."""
        return self.state in ("running", "restarting", "paused")

    @classmethod
    def from_summary(cls, summary: Mapping[str, Any]) -> ContainerInfo:
        """Reads one entry of ``GET /containers/json``."""
        names = summary.get("Names") or []
        name = str(names[0]).lstrip("/") if names else str(summary.get("Id", ""))[:12]
        state = str(summary.get("State") or "")
        exit_code: int | None = None
        if state in ("exited", "dead"):
            m = _EXITED_RE.match(str(summary.get("Status") or ""))
            exit_code = int(m.group(1)) if m else None
        return cls(
            id=str(summary.get("Id", "")),
            name=name,
            image=str(summary.get("Image", "")),
            labels=dict(summary.get("Labels") or {}),
            state=state,
            exit_code=exit_code,
            created=_int(summary.get("Created"), 0),
        )


def _int(value: object, default: int) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return default


def group_by_app(containers: Iterable[ContainerInfo]) -> dict[str, list[ContainerInfo]]:
    """Containers grouped by their app id label (containers without one are dropped)."""
    out: dict[str, list[ContainerInfo]] = {}
    for c in containers:
        if c.app_id:
            out.setdefault(c.app_id, []).append(c)
    return out


def replica_state(c: ContainerInfo) -> AppState:
    """The state of the replica a container runs."""
    if c.state == "created":
        return AppState.FAILED if c.launcher_gone else AppState.PENDING
    if c.state in ("running", "restarting", "paused"):
        return AppState.RUNNING
    if c.state == "exited":
        if c.exit_code is None:
            return AppState.UNKNOWN
        return AppState.SUCCEEDED if c.exit_code == 0 else AppState.FAILED
    if c.state == "dead":
        return AppState.FAILED
    return AppState.UNKNOWN


@dataclass(frozen=True)
class RoleShape:
    """A role as its labels describe it."""

    name: str
    num_replicas: int
    max_retries: int
    retry_policy: RetryPolicy
    image: str


@dataclass(frozen=True)
class Retry:
    """Replicas the backend must recreate as ``attempt`` (a ROLE or APPLICATION retry)."""

    attempt: int
    replicas: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class StopContainer:
    """Stop a live container: a survivor of a failed app, or an attempt a retry superseded."""

    container_id: str


@dataclass(frozen=True)
class RetryReplicas:
    """Recreate replicas as attempt ``attempt`` (a ROLE or APPLICATION retry).

    Args:
        attempt: the new attempt's number.
        olds: the current container of each replica to recreate (killed first, then copied).
    """

    attempt: int
    olds: tuple[ContainerInfo, ...]


@dataclass(frozen=True)
class RemoveApp:
    """Remove every container of a finished app (``remove_finished``), and its own network."""

    container_ids: tuple[str, ...]
    network: bool


@dataclass(frozen=True)
class RemoveNetwork:
    """Remove a finished app's own network, once the engine has let go of its containers."""

    container_ids: tuple[str, ...]


#: A follow-up the backend owes an app (see ``follow_ups``).
Action = StopContainer | RetryReplicas | RemoveApp | RemoveNetwork


@dataclass
class Assessment:
    """An app's description plus what the backend still owes it.

    Args:
        response: the app's description.
        current: the latest container of each replica, by ``(role, replica)``.
        retry: replicas to recreate for a ROLE/APPLICATION retry, or None.
        to_stop: live containers to stop (survivors of a failed app, superseded attempts).
        network: the app's own network (empty when it uses a shared one).
        remove_finished: the app asked for its containers to be removed once finished.
        session: the session that launched the app.
        name: the app's name.
        containers: every container of the app (markers included).
        actions: the follow-ups owed (``follow_ups``).
    """

    response: DescribeAppResponse
    current: dict[tuple[str, int], ContainerInfo] = field(default_factory=dict)
    retry: Retry | None = None
    to_stop: list[ContainerInfo] = field(default_factory=list)
    network: str = ""
    remove_finished: bool = False
    session: str = ""
    name: str = ""
    containers: list[ContainerInfo] = field(default_factory=list)
    actions: tuple[Action, ...] = ()


def role_shapes(containers: Iterable[ContainerInfo]) -> list[RoleShape]:
    """The app's roles, in order, read from the labels of its containers."""
    replicas = [c for c in containers if not c.is_record]
    order: list[tuple[str, int]] = []
    for c in replicas:
        try:
            raw = json.loads(c.labels.get(LABEL_ROLES, "[]"))
            order = [(str(name), int(n)) for name, n in raw]
        except (TypeError, ValueError, OverflowError, RecursionError):
            continue
        if any(n < 0 for _, n in order) or sum(n for _, n in order) > LINUX_PID_MAX_LIMIT:
            order = []  # more replicas than a dry run accepts: not a shape we made
            continue
        if order:
            break
    if not order:
        counts: dict[str, int] = {}
        for c in replicas:
            counts[c.role] = max(counts.get(c.role, 0), c.replica_id + 1)
        order = list(counts.items())
    shapes = []
    for name, n in order:
        sample = next((c for c in replicas if c.role == name), None)
        labels: Mapping[str, str] = sample.labels if sample else {}
        try:
            policy = RetryPolicy(labels.get(LABEL_RETRY_POLICY, RetryPolicy.APPLICATION.value))
        except ValueError:
            policy = RetryPolicy.APPLICATION
        shapes.append(
            RoleShape(
                name=name,
                num_replicas=n,
                max_retries=_int(labels.get(LABEL_MAX_RETRIES), 0),
                retry_policy=policy,
                image=sample.image if sample else "",
            )
        )
    return shapes


def assess(app_id: str, containers: list[ContainerInfo]) -> Assessment | None:
    """The state of app ``app_id`` from its containers, or None when it has none (unknown app).

    Rules, in order: a cancelled app is CANCELLED once none of its containers is alive (RUNNING
    until then); a retry that could not be made (its record, see ``request.retry_failed_record``)
    fails the app (its live replicas are to be stopped); a replica its launcher died before
    starting fails the app; a replica that failed with no retry left fails the app (its live
    replicas are to be stopped; the message names the first failure, see ``first_failure``, and
    the survivors stopped after it say so in their status); every replica succeeded: SUCCEEDED;
    a failure with a ROLE/APPLICATION retry left keeps the app RUNNING and asks for the retry; a
    replica whose container is gone once every replica has been started (removed by someone else:
    it will never end) fails the app; otherwise RUNNING if any replica runs, PENDING if all are
    created but not started, UNKNOWN when replicas are missing and nothing runs
    (``remove_finished`` removing them). The follow-up actions owed (``Assessment.actions``) come from ``follow_ups``.
    """
    replicas = [c for c in containers if not c.is_record]
    markers = [c for c in containers if c.is_marker]
    records = [c for c in containers if c.is_retry_failure]
    if not replicas and not markers and not records:
        return None
    shapes = role_shapes(replicas)
    current: dict[tuple[str, int], ContainerInfo] = {}
    for c in replicas:
        key = (c.role, c.replica_id)
        if key not in current or c.attempt > current[key].attempt:
            current[key] = c
    retry_failure = (
        (records[0].labels.get(LABEL_REASON) or "a retry could not be made") if records else None
    )
    verdict = _verdict(shapes, current, replicas, bool(markers), retry_failure)
    first = replicas[0] if replicas else (markers or records)[0]
    response = DescribeAppResponse(
        app_id=app_id,
        state=verdict.state,
        num_restarts=max((c.attempt for c in current.values()), default=0)
        + sum(max(c.restart_count, 0) for c in current.values()),
        msg=verdict.msg or NONE,
        roles_statuses=_role_statuses(shapes, current, verdict.state, verdict.notes),
        roles=[Role(name=s.name, image=s.image, num_replicas=s.num_replicas) for s in shapes],
        name=first.labels.get(LABEL_APP_NAME, ""),
    )
    a = Assessment(
        response=response,
        current=current,
        retry=verdict.retry if verdict.state == AppState.RUNNING else None,
        to_stop=verdict.to_stop,
        network=first.labels.get(LABEL_NETWORK, ""),
        remove_finished=first.labels.get(LABEL_REMOVE_FINISHED) == "true",
        session=first.labels.get(LABEL_SESSION, ""),
        name=first.labels.get(LABEL_APP_NAME, ""),
        containers=list(containers),
    )
    a.actions = follow_ups(a)
    return a


@dataclass
class _Verdict:
    state: AppState
    msg: str = ""
    retry: Retry | None = None
    to_stop: list[ContainerInfo] = field(default_factory=list)
    #: a note for the status of some replicas (the survivors stopped after a failure)
    notes: dict[tuple[str, int], str] = field(default_factory=dict)


def _retry_or_failures(
    shapes: list[RoleShape], current: Mapping[tuple[str, int], ContainerInfo]
) -> tuple[Retry | None, list[tuple[str, int]]]:
    """The retry the failed replicas ask for (the highest attempt), and those that failed for good."""
    shape_by_name = {s.name: s for s in shapes}
    failures: list[tuple[str, int]] = []
    retry: Retry | None = None
    for key, c in current.items():
        if replica_state(c) != AppState.FAILED:
            continue
        shape = shape_by_name.get(key[0])
        if (
            shape is None
            or shape.retry_policy not in (RetryPolicy.ROLE, RetryPolicy.APPLICATION)
            or c.attempt >= shape.max_retries
        ):
            failures.append(key)
            continue
        scope = (
            [(s.name, k) for s in shapes for k in range(s.num_replicas)]
            if shape.retry_policy == RetryPolicy.APPLICATION
            else [(shape.name, k) for k in range(shape.num_replicas)]
        )
        attempt = c.attempt + 1
        todo = tuple(k for k in scope if k not in current or current[k].attempt < attempt)
        if retry is None or attempt > retry.attempt:
            retry = Retry(attempt=attempt, replicas=todo)
    return retry, failures


def _verdict(
    shapes: list[RoleShape],
    current: Mapping[tuple[str, int], ContainerInfo],
    replicas: list[ContainerInfo],
    cancelled: bool,
    retry_failure: str | None = None,
) -> _Verdict:
    """The app's state and message, the retry it asks for, and the live containers to stop
    (``retry_failure``: why a retry of the app could not be made, if one could not)."""
    states = {k: replica_state(c) for k, c in current.items()}
    missing = [
        (s.name, k) for s in shapes for k in range(s.num_replicas) if (s.name, k) not in current
    ]
    retry, failures = _retry_or_failures(shapes, current)
    alive = [c for c in replicas if c.alive]
    to_stop = [c for c in alive if current.get((c.role, c.replica_id)) is not c]  # superseded
    if cancelled:  # every live replica is to be stopped, those started after the cancel too
        # A replica created and not started yet by a live launch (or retry) may still be started
        # (its starter stops it once it sees the marker) or removed: the app is not over before
        # then, or it would read CANCELLED, then RUNNING again.
        busy = alive or [c for c in replicas if c.state == "created" and not c.launcher_gone]
        return _Verdict(
            AppState.RUNNING if busy else AppState.CANCELLED,
            "cancelling" if busy else "cancelled",
            to_stop=alive,
        )
    if retry_failure is not None:  # nobody will make that retry: the app has failed
        return _Verdict(AppState.FAILED, retry_failure, to_stop=alive)
    orphans = [k for k, c in current.items() if c.launcher_gone]
    if orphans:  # its launcher died before starting them: nobody will
        role, k = sorted(orphans, key=lambda rk: _role_order(shapes, rk))[0]
        return _Verdict(
            AppState.FAILED,
            f"replica {role}/{k} was never started: its launcher exited first",
            to_stop=alive,
        )
    removed_under_us = (
        missing
        and replicas[0].labels.get(LABEL_REMOVE_FINISHED) != "true"  # else: our removal under way
        and AppState.PENDING not in states.values()  # else: a launch may still be creating them
    )
    if removed_under_us:
        role, k = sorted(missing, key=lambda rk: _role_order(shapes, rk))[0]
        return _Verdict(
            AppState.FAILED,
            f"replica {role}/{k} is gone: its container was removed",
            to_stop=alive,
        )
    if failures:
        role, k = first_failure(shapes, current, failures)
        failed = current[(role, k)]
        code = failed.exit_code
        msg = f"replica {role}/{k} failed" + (f" with exit code {code}" if code is not None else "")
        if failed.oom_killed:
            msg += ": killed for running out of memory (its memMB limit, or the host's)"
        note = f"stopped after replica {role}/{k} failed"
        return _Verdict(
            AppState.FAILED,
            msg,
            to_stop=to_stop + [c for c in alive if c not in to_stop],
            notes={key: note for key in failures if _stopped_after(current[key], failed)},
        )
    if not missing and states and all(s == AppState.SUCCEEDED for s in states.values()):
        return _Verdict(AppState.SUCCEEDED, to_stop=to_stop)
    if retry is not None:
        to_stop.extend(
            c for c in alive if (c.role, c.replica_id) in retry.replicas and c not in to_stop
        )
        return _Verdict(AppState.RUNNING, f"retrying (attempt {retry.attempt})", retry, to_stop)
    if any(s == AppState.RUNNING for s in states.values()):
        return _Verdict(AppState.RUNNING, to_stop=to_stop)
    if AppState.PENDING in states.values() and all(
        s in (AppState.PENDING, AppState.SUCCEEDED) for s in states.values()
    ):
        return _Verdict(AppState.PENDING, to_stop=to_stop)
    msg = (
        ("containers of this app are missing: " + ", ".join(f"{r}/{k}" for r, k in missing))
        if missing
        else ""
    )
    return _Verdict(AppState.UNKNOWN, msg, to_stop=to_stop)


#: The exit codes of a container stopped by ``docker stop``: SIGKILL after the stop timeout, or
#: SIGTERM's default action.
_STOP_EXITS = (137, 143)


def first_failure(
    shapes: list[RoleShape],
    current: Mapping[tuple[str, int], ContainerInfo],
    failures: list[tuple[str, int]],
) -> tuple[str, int]:
    """The failure that failed the app: of the replicas that failed on their own (not stopped by
    the backend after another failed), the one that exited first (``finished_at``), then the
    first in role order when the times do not tell."""
    own = [key for key in failures if not current[key].stopped_by_backend] or failures

    def order(key: tuple[str, int]) -> tuple[bool, int, tuple[int, int]]:
        finished = current[key].finished_at
        return (finished is None, finished or 0, _role_order(shapes, key))

    return min(own, key=order)


def _stopped_after(c: ContainerInfo, cause: ContainerInfo) -> bool:
    """True for a failed replica the backend stopped once ``cause`` had failed the app: marked so
    by the process that stopped it, or (read from any process) exited after ``cause`` with the
    exit code of a stop, not killed for memory."""
    if c is cause:
        return False
    if c.stopped_by_backend:
        return True
    return (
        c.exit_code in _STOP_EXITS
        and not c.oom_killed
        and c.finished_at is not None
        and cause.finished_at is not None
        and c.finished_at > cause.finished_at
    )


def _role_statuses(
    shapes: list[RoleShape],
    current: Mapping[tuple[str, int], ContainerInfo],
    state: AppState,
    notes: Mapping[tuple[str, int], str],
) -> list[RoleStatus]:
    out = []
    for shape in shapes:
        reps = []
        for k in range(shape.num_replicas):
            cur = current.get((shape.name, k))
            if cur is None:
                reps.append(
                    ReplicaStatus(id=k, state=AppState.UNKNOWN, role=shape.name, hostname="")
                )
                continue
            rep_state = replica_state(cur)
            if state == AppState.CANCELLED and rep_state != AppState.SUCCEEDED:
                rep_state = AppState.CANCELLED
            reps.append(
                ReplicaStatus(
                    id=k,
                    state=rep_state,
                    role=shape.name,
                    hostname=cur.hostname,
                    structured_error_msg=notes.get((shape.name, k), NONE),
                    exit_code=cur.exit_code,
                )
            )
        out.append(RoleStatus(role=shape.name, replicas=reps))
    return out


def follow_ups(a: Assessment) -> tuple[Action, ...]:
    """What the backend owes an app in the state ``a`` describes, in the order to do it.

    Stop the live containers that must stop; recreate the replicas of a retry; once the app is
    finished and none of its replicas is alive or about to start (created, while a launch may still
    start it), remove its containers (``remove_finished``) or its own network. Every action is
    idempotent: doing it again when it is done already changes nothing.
    """
    actions: list[Action] = [StopContainer(c.id) for c in a.to_stop]
    if a.retry is not None:
        olds = tuple(a.current[k] for k in a.retry.replicas if k in a.current)
        actions.append(RetryReplicas(a.retry.attempt, olds))
    if is_terminal(a.response.state) and all(_settled(c) for c in a.containers):
        ids = tuple(c.id for c in a.containers)
        if a.remove_finished:
            actions.append(RemoveApp(ids, network=bool(a.network)))
        elif a.network:
            actions.append(RemoveNetwork(ids))
    return tuple(actions)


def dead_launch(a: Assessment) -> bool:
    """True when app ``a`` has replicas its launcher died before starting, and is owed
    follow-ups for it (the survivors stopped, its network removed)."""
    return bool(a.actions) and any(c.launcher_gone for c in a.containers)


def restarted_by_docker(labels: Mapping[str, Any]) -> bool:
    """True for a container whose failures Docker's restart policy retries (REPLICA retries)."""
    return labels.get(LABEL_RETRY_POLICY) == RetryPolicy.REPLICA.value and labels.get(
        LABEL_MAX_RETRIES, "0"
    ) not in ("", "0")


def _settled(c: ContainerInfo) -> bool:
    """True for a container that will not run (again) on its own: exited, dead, a record (a
    cancel marker, a failed retry's), or never started by a launcher that exited."""
    return c.is_record or c.launcher_gone or not (c.alive or c.state == "created")


def may_restart(labels: Mapping[str, Any], exit_code: int | None) -> bool:
    """True when Docker's restart policy (our REPLICA retries) may restart a container that exited."""
    return exit_code != 0 and restarted_by_docker(labels)


def with_exits(infos: list[ContainerInfo], died: Mapping[str, int | None]) -> list[ContainerInfo]:
    """``infos`` with the exits ``died`` announces (container id -> exit code, from ``die`` events)
    applied to containers the listing still shows alive, unless Docker may restart them."""
    out = []
    for c in infos:
        if c.id in died and c.alive and not may_restart(c.labels, died[c.id]):
            c = dataclasses.replace(c, state="exited", exit_code=died[c.id])
        out.append(c)
    return out


def recreate_config(info: Mapping[str, Any], attempt: int) -> dict[str, Any]:
    """The create request for attempt ``attempt`` of the container ``info`` (from ``inspect``)."""
    config = dict(info.get("Config") or {})
    labels = dict(config.get("Labels") or {})
    labels[LABEL_ATTEMPT] = str(attempt)
    config["Labels"] = labels
    host = dict(info.get("HostConfig") or {})
    config["HostConfig"] = host
    network = str(host.get("NetworkMode") or "")
    hostname = str(config.get("Hostname") or "")
    if network and network not in ("default", "bridge", "host", "none") and hostname:
        config["NetworkingConfig"] = {"EndpointsConfig": {network: {"Aliases": [hostname]}}}
    return config


def _role_order(shapes: list[RoleShape], key: tuple[str, int]) -> tuple[int, int]:
    names = [s.name for s in shapes]
    return (names.index(key[0]) if key[0] in names else len(names), key[1])
