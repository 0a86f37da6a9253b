"""The apps a local scheduler runs, as it holds them in memory: each replica with its process,
pipes and log writer, each app with its replicas, retries and stop requests, and the record
(``records.AppRecord``) it is written as."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from asynctorchx.logs import ReplicaLogWriter
from asynctorchx.schedulers._local import protocol
from asynctorchx.schedulers._local.guard import MoveJob
from asynctorchx.schedulers._local.records import AppRecord, Owner, ReplicaRecord
from asynctorchx.schedulers._local.request import (
    DEFAULT_GRACE_PERIOD,
    LocalRequest,
    ReplicaRequest,
)
from asynctorchx.schedulers._local.state import Exit, Progress
from asynctorchx.specs.api import NONE, AppState, RetryPolicy, Role, is_terminal


class Countdown:
    """An event set once ``count`` replicas have exited."""

    __slots__ = ("count", "event")

    def __init__(self, count: int) -> None:
        self.count = count
        self.event = asyncio.Event()
        if count <= 0:
            self.event.set()

    def one_exited(self) -> None:
        self.count -= 1
        if self.count <= 0:
            self.event.set()


@dataclass(eq=False)
class Replica:
    """One replica: its request and its current (or last) process."""

    req: ReplicaRequest
    index: int
    marker: str
    executable: str = ""
    state: AppState = AppState.PENDING
    pid: int | None = None
    start_ticks: int | None = None
    pidfd: int = -1
    exit_code: int | None = None
    attempts: int = 0
    started_at: float | None = None
    ended_at: float | None = None
    writer: ReplicaLogWriter | None = None
    structured_error_msg: str = NONE
    cgroup: str | None = None  # the cgroup of its current attempt (None: found by its marker)
    moving: MoveJob | None = None  # its move into that cgroup, while a worker thread does it
    moved: asyncio.Future[None] | None = None  # resolves once that move is done
    term_sent: bool = False  # its group got the one SIGTERM of the current stop
    term_at: float = 0.0
    exit_pending: bool = False  # exited; the exit is not judged yet
    reaping: bool = False  # exited; being reaped in a worker thread
    leftovers: bool = False  # something it started outlived its main process
    stop_waiter: Countdown | None = None
    lost_before: dict[str, int] = field(default_factory=dict)  # log bytes lost by closed writers

    @property
    def running(self) -> bool:
        return self.pidfd >= 0

    @property
    def label(self) -> str:
        return f"{self.req.role}[{self.req.replica_id}]"

    def as_exit(self) -> Exit:
        """This replica's exit, for the assessor (``state.py``)."""
        return Exit(self.index, self.req.role, self.label, self.exit_code)

    def lost_bytes(self) -> dict[str, int]:
        """Log bytes that could not be written, per file name."""
        lost = dict(self.lost_before)
        if self.writer is not None:
            for name, n in self.writer.lost_bytes.items():
                lost[name] = lost.get(name, 0) + n
        return lost

    def close_logs(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def record(self) -> ReplicaRecord:
        return ReplicaRecord(
            role=self.req.role,
            id=self.req.replica_id,
            state=self.state,
            pid=self.pid,
            start_ticks=self.start_ticks,
            exit_code=self.exit_code,
            attempts=self.attempts,
            started_at=self.started_at,
            ended_at=self.ended_at,
            log_dir=self.req.log_dir,
            error_file=self.req.error_file,
            structured_error_msg=self.structured_error_msg,
        )


class OwnApp(NamedTuple):
    """An app this scheduler launched, as it describes it: its record now and its roles as
    submitted (a copy: the caller's AppDef is never shared)."""

    record: AppRecord
    roles: list[Role]


@dataclass(eq=False)
class LiveApp:
    """An app this scheduler launched that has not ended (or is being undone)."""

    request: LocalRequest
    app_json: dict[str, Any]
    roles: list[Role]
    replicas: list[Replica]
    retries_left: dict[str, int]  # by role (a REPLICA role's stays at its max_retries)
    policies: dict[str, RetryPolicy]
    submitted_at: float
    # the retries each replica of a REPLICA role has spent, by index: its own budget, as a
    # container's restart policy on local_docker and an index's backoff limit on Kubernetes
    replica_retries: dict[int, int] = field(default_factory=dict)
    state: AppState = AppState.PENDING
    msg: str = ""
    structured_error_msg: str = NONE
    num_restarts: int = 0
    ended_at: float | None = None
    cancel_reason: str | None = None
    exited: list[Replica] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    discard: bool = False
    cgroup: str | None = None
    stop_grace: float = DEFAULT_GRACE_PERIOD
    n_running: int = 0
    n_succeeded: int = 0
    log_loss: str = ""  # why log output was lost (empty: none was)
    # another process left a cancel marker (inotify said so): read it at the next chance
    foreign_cancel: bool = False
    # its id is claimed by this launcher (``AppLauncher.claim``); False once the claim is removed
    claimed: bool = False

    @classmethod
    def create(
        cls, request: LocalRequest, app_json: dict[str, Any], roles: list[Role], now: float
    ) -> LiveApp:
        """The app of a request, before anything is started."""
        app_id = request.app_id
        return cls(
            request=request,
            app_json=app_json,
            roles=roles,
            replicas=[
                Replica(r, i, protocol.replica_marker(app_id, r.role, r.replica_id))
                for i, r in enumerate(request.replicas)
            ],
            retries_left={r.name: r.max_retries for r in request.roles},
            policies={r.name: r.retry_policy for r in request.roles},
            submitted_at=now,
            stop_grace=request.grace_period,
        )

    @property
    def app_id(self) -> str:
        return self.request.app_id

    def running(self) -> list[Replica]:
        return [r for r in self.replicas if r.running]

    def progress(self, rep: Replica) -> Progress:
        """Where the app stands, for judging an exit of ``rep``."""
        role = rep.req.role
        policy = self.policies[role]
        left = self.retries_left[role]
        if policy == RetryPolicy.REPLICA:
            left -= self.replica_retries.get(rep.index, 0)
        return Progress(
            replicas=len(self.replicas),
            succeeded=self.n_succeeded,
            retries_left=left,
            policy=policy,
            num_restarts=self.num_restarts,
        )

    def set_app_state(self, state: AppState, now: float) -> None:
        """Sets the app's state (the only place it changes); a terminal one is its end, at
        ``now``."""
        self.state = state
        if is_terminal(state):
            self.ended_at = now

    def set_state(self, rep: Replica, state: AppState) -> None:
        """Sets a replica's state (the only place it changes), keeping the count of succeeded
        replicas."""
        if rep.state == AppState.SUCCEEDED:
            self.n_succeeded -= 1
        rep.state = state
        if state == AppState.SUCCEEDED:
            self.n_succeeded += 1

    def close_logs(self) -> None:
        for rep in self.replicas:
            rep.close_logs()

    def snapshot(self, owner: Owner) -> AppRecord:
        """The app's record as it stands."""
        req = self.request
        msg = self.msg
        if self.log_loss:
            msg = "; ".join(m for m in (msg, self._loss_note()) if m)
        return AppRecord(
            app_id=req.app_id,
            name=req.app_name,
            backend=req.backend,
            session=req.session,
            state=self.state,
            msg=msg,
            structured_error_msg=self.structured_error_msg,
            num_restarts=self.num_restarts,
            submitted_at=self.submitted_at,
            ended_at=self.ended_at,
            app_dir=req.app_dir,
            grace_period=req.grace_period,
            owner=owner,
            replicas=tuple(r.record() for r in self.replicas),
            app=self.app_json,
            cgroup=self.cgroup,
        )

    def _loss_note(self) -> str:
        parts = []
        for rep in self.replicas:
            lost = rep.lost_bytes()
            if lost:
                files = ", ".join(f"{n} bytes of {name}" for name, n in sorted(lost.items()))
                parts.append(f"{rep.label} {files}")
        if not parts:
            return ""
        return f"log output lost ({self.log_loss}): " + "; ".join(parts)

    def registration(self, owner: Owner) -> bytes:
        """The watchdog's ``A`` line of this app, with the minimal record the watchdog writes if
        the launcher dies before writing the real one."""
        req = self.request
        minimal = AppRecord(
            app_id=req.app_id,
            name=req.app_name,
            backend=req.backend,
            session=req.session,
            state=AppState.PENDING,
            msg="",
            structured_error_msg=NONE,
            num_restarts=0,
            submitted_at=self.submitted_at,
            ended_at=None,
            app_dir=req.app_dir,
            grace_period=req.grace_period,
            owner=owner,
            replicas=(),
            app={},
            cgroup=self.cgroup,
        )
        return protocol.app_line(self.app_id, req.grace_period, self.cgroup, minimal.to_json())

    def registrations(self, owner: Owner) -> list[bytes]:
        """Every watchdog line that describes this app now (after a watchdog restart)."""
        lines = [self.registration(owner)]
        lines += [protocol.start_line(self.app_id, r.pid or 0) for r in self.replicas if r.running]
        return lines
