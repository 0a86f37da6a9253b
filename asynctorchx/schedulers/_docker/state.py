"""An app's state, read back from the containers Docker lists for it. Pure, no I/O.

Docker keeps no app object, so the app is the set of containers carrying its id label: one per
replica and attempt (attempt 0 is the first run; the backend adds attempts for ROLE/APPLICATION
retries), plus a never-started marker container once the app has been cancelled. ``assess`` turns
them into a ``DescribeAppResponse`` and the follow-up actions the backend owes the app (retry some
replicas, stop the survivors of a failed app, remove its network or containers).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from asynctorchx.schedulers._docker.request import (
    KIND_CANCEL_MARKER,
    LABEL_APP_ID,
    LABEL_APP_NAME,
    LABEL_ATTEMPT,
    LABEL_HOSTNAME,
    LABEL_KIND,
    LABEL_MAX_RETRIES,
    LABEL_NETWORK,
    LABEL_REMOVE_FINISHED,
    LABEL_REPLICA_ID,
    LABEL_RETRY_POLICY,
    LABEL_ROLE_NAME,
    LABEL_ROLES,
    LABEL_SESSION,
)
from asynctorchx.schedulers.api import DescribeAppResponse
from asynctorchx.specs.api import (
    NONE,
    AppState,
    ReplicaStatus,
    RetryPolicy,
    Role,
    RoleStatus,
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
    """

    id: str
    name: str
    image: str
    labels: Mapping[str, str]
    state: str
    exit_code: int | None
    created: int
    restart_count: int = -1

    @property
    def app_id(self) -> str:
        return self.labels.get(LABEL_APP_ID, "")

    @property
    def is_marker(self) -> bool:
        return self.labels.get(LABEL_KIND) == KIND_CANCEL_MARKER

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
        return AppState.PENDING
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


def role_shapes(containers: Iterable[ContainerInfo]) -> list[RoleShape]:
    """The app's roles, in order, read from the labels of its containers."""
    replicas = [c for c in containers if not c.is_marker]
    order: list[tuple[str, int]] = []
    for c in replicas:
        try:
            raw = json.loads(c.labels.get(LABEL_ROLES, "[]"))
            order = [(str(name), int(n)) for name, n in raw]
        except (TypeError, ValueError):
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
    until then); a replica that failed with no retry left fails the app (its live replicas are to be
    stopped); every replica succeeded: SUCCEEDED; a failure with a ROLE/APPLICATION retry left keeps
    the app RUNNING and asks for the retry; otherwise RUNNING if any replica runs, PENDING if all
    are created but not started, UNKNOWN when replicas are missing and nothing runs.
    """
    replicas = [c for c in containers if not c.is_marker]
    markers = [c for c in containers if c.is_marker]
    if not replicas and not markers:
        return None
    shapes = role_shapes(replicas)
    first = replicas[0] if replicas else markers[0]
    current: dict[tuple[str, int], ContainerInfo] = {}
    for c in replicas:
        key = (c.role, c.replica_id)
        if key not in current or c.attempt > current[key].attempt:
            current[key] = c

    states: dict[tuple[str, int], AppState] = {k: replica_state(c) for k, c in current.items()}
    missing = [
        (s.name, k) for s in shapes for k in range(s.num_replicas) if (s.name, k) not in current
    ]
    shape_by_name = {s.name: s for s in shapes}
    attempts = [c.attempt for c in current.values()]
    num_restarts = max(attempts, default=0) + sum(max(c.restart_count, 0) for c in current.values())

    final_failures: list[tuple[str, int]] = []
    retry: Retry | None = None
    for key, state in states.items():
        if state != AppState.FAILED:
            continue
        shape = shape_by_name.get(key[0])
        c = current[key]
        backend_retries = shape is not None and shape.retry_policy in (
            RetryPolicy.ROLE,
            RetryPolicy.APPLICATION,
        )
        if shape is not None and backend_retries and c.attempt < shape.max_retries:
            scope = (
                [(s.name, k) for s in shapes for k in range(s.num_replicas)]
                if shape.retry_policy == RetryPolicy.APPLICATION
                else [(shape.name, k) for k in range(shape.num_replicas)]
            )
            attempt = c.attempt + 1
            todo = tuple(k for k in scope if k not in current or current[k].attempt < attempt)
            if retry is None or attempt > retry.attempt:
                retry = Retry(attempt=attempt, replicas=todo)
        else:
            final_failures.append(key)

    alive = [c for c in replicas if c.alive]
    superseded = [c for c in alive if current.get((c.role, c.replica_id)) is not c]
    to_stop: list[ContainerInfo] = list(superseded)
    msg = ""
    if markers:
        state = AppState.RUNNING if alive else AppState.CANCELLED
        msg = "cancelled" if not alive else "cancelling"
        retry = None
    elif final_failures:
        state = AppState.FAILED
        role, k = sorted(final_failures, key=lambda rk: _role_order(shapes, rk))[0]
        code = current[(role, k)].exit_code
        msg = f"replica {role}/{k} failed" + (f" with exit code {code}" if code is not None else "")
        to_stop.extend(c for c in alive if c not in to_stop)
        retry = None
    elif not missing and states and all(s == AppState.SUCCEEDED for s in states.values()):
        state = AppState.SUCCEEDED
    elif retry is not None:
        state = AppState.RUNNING
        msg = f"retrying (attempt {retry.attempt})"
        to_stop.extend(
            c for c in alive if (c.role, c.replica_id) in retry.replicas and c not in to_stop
        )
    elif any(s == AppState.RUNNING for s in states.values()):
        state = AppState.RUNNING
    elif AppState.PENDING in states.values() and all(
        s in (AppState.PENDING, AppState.SUCCEEDED) for s in states.values()
    ):
        state = AppState.PENDING
    else:
        state = AppState.UNKNOWN
        if missing:
            msg = "containers of this app are missing: " + ", ".join(f"{r}/{k}" for r, k in missing)

    roles_statuses = []
    roles = []
    for shape in shapes:
        reps = []
        for k in range(shape.num_replicas):
            cur = current.get((shape.name, k))
            if cur is None:
                reps.append(
                    ReplicaStatus(id=k, state=AppState.UNKNOWN, role=shape.name, hostname="")
                )
                continue
            rep_state = states[(shape.name, k)]
            if state == AppState.CANCELLED and rep_state != AppState.SUCCEEDED:
                rep_state = AppState.CANCELLED
            reps.append(
                ReplicaStatus(
                    id=k,
                    state=rep_state,
                    role=shape.name,
                    hostname=cur.hostname,
                    exit_code=cur.exit_code,
                )
            )
        roles_statuses.append(RoleStatus(role=shape.name, replicas=reps))
        roles.append(Role(name=shape.name, image=shape.image, num_replicas=shape.num_replicas))

    response = DescribeAppResponse(
        app_id=app_id,
        state=state,
        num_restarts=num_restarts,
        msg=msg or NONE,
        roles_statuses=roles_statuses,
        roles=roles,
        name=first.labels.get(LABEL_APP_NAME, ""),
    )
    return Assessment(
        response=response,
        current=current,
        retry=retry if state == AppState.RUNNING else None,
        to_stop=to_stop,
        network=first.labels.get(LABEL_NETWORK, ""),
        remove_finished=first.labels.get(LABEL_REMOVE_FINISHED) == "true",
        session=first.labels.get(LABEL_SESSION, ""),
        name=first.labels.get(LABEL_APP_NAME, ""),
        containers=list(containers),
    )


def _role_order(shapes: list[RoleShape], key: tuple[str, int]) -> tuple[int, int]:
    names = [s.name for s in shapes]
    return (names.index(key[0]) if key[0] in names else len(names), key[1])
