"""App records: what the local backends persist about each app so any process can find it.

One file per app, ``{state root}/.apps/{app_id}.json``: each change appends the new version of the
record as one line of JSON, the last complete line being the record, and a file that grew large is
replaced by one holding only its latest version (``protocol.write_record_file``; readers:
``recordfile.read_document``). A version holds the app's state, each replica's pid/process group, exit
code, attempts and times, the log directories, the launcher's identity, and the ``AppDef`` as
submitted. The launcher is the only writer while it lives; once it is gone the watchdog (or a
process finishing a cancel) updates the record under a lock file.

A cancel requested by another process is a marker file ``{app_id}.cancel`` next to the record
(it lists the process groups the canceller already sent SIGTERM to), which the launcher notices
through inotify, or when a replica exits; a launcher cancelling its own app leaves one too, so
that a cancel from another process meanwhile sends no second SIGTERM and a watchdog finishing the
app records it CANCELLED. An app being submitted (claimed, see below, and not
started: no record yet) gets one too; its launcher looks for it before the app's first replica
starts, and the app ends CANCELLED with nothing started. Both it and the lock file ``.{app_id}.lock`` are removed
once the record is terminal (``protocol.py``).

A launcher claims an app's id before it starts anything of it (``RecordStore.claim``, a hard
link of its holder file that only one launcher makes), so a dry run scheduled twice at once, even
by two processes, starts once; a claim whose launcher died before its watchdog knew of the app is
taken over by the next launcher of that dry run (``RecordStore.take_stale_claim``). Other
processes see an app claimed by a launcher (or watchdog) that lives, without a record yet, as
being submitted (``RecordStore.claim_held``, ``held_claims``). A write that finds the records directory gone creates it again; one that finds the file system
full rewrites the record in place when it fits in the space the file already holds. A new record's
first version is written into a spare empty file made in a lull (``.apps/.spare/``, ``spares.py``),
which is then linked into place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import secrets
import stat
import threading
import weakref
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asynctorchx.schedulers._local import protocol, recordfile
from asynctorchx.schedulers._local.procs import proc_start_ticks
from asynctorchx.schedulers._local.recordfile import ROOT_ENV as ROOT_ENV
from asynctorchx.schedulers._local.recordfile import TERMINAL_NAMES as TERMINAL_NAMES
from asynctorchx.schedulers._local.recordfile import Owner as Owner
from asynctorchx.schedulers._local.recordfile import default_root as default_root
from asynctorchx.schedulers._local.spares import SparePool
from asynctorchx.schedulers.api import DescribeAppResponse
from asynctorchx.specs.api import (
    NONE,
    AppState,
    ReplicaStatus,
    Role,
    RoleStatus,
)
from asynctorchx.specs.serialize import appdef_from_dict, appdef_to_dict

RECORD_FORMAT = 1

_stores: weakref.WeakSet[RecordStore] = weakref.WeakSet()


def _unlock_in_forked_child() -> None:
    # a fork of the launcher must not keep its claims held after the launcher and its watchdog
    # died (the lock is the open file's: closing the child's copy leaves the parent's)
    for store in list(_stores):
        store._holder_lock = threading.Lock()  # (another thread may have held it at the fork)
        for fd in store.lock_fds():
            with contextlib.suppress(OSError):
                os.close(fd)
        store.holder, store.holder_fd, store._old_holder_fds = None, -1, []
        store._holder_ids.clear()
        store._held = False


os.register_at_fork(after_in_child=_unlock_in_forked_child)
#: ``RecordStore.take_stale_claim``: the app has a record.
RECORDED = "recorded"


# -- the AppDef as JSON --------------------------------------------------------------------------


#: The AppDef kept in a record (``appdef_from_json`` inverts it).
appdef_to_json = appdef_to_dict
appdef_from_json = appdef_from_dict


# -- records -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaRecord:
    """One replica as recorded.

    Args:
        role: its role.
        id: its index within the role.
        state: its state (PENDING before its first start).
        pid: the pid of its current or last process (also its process group id).
        start_ticks: when that process started (guards signals against pid reuse).
        exit_code: its last exit code (negative: killed by that signal).
        attempts: how many times it was started.
        started_at: when its current or last process started (POSIX time).
        ended_at: when it last ended.
        log_dir: its log directory.
        error_file: its torchelastic error file.
        structured_error_msg: the contents of that file after a failure, or NONE.
    """

    role: str
    id: int
    state: AppState
    pid: int | None = None
    start_ticks: int | None = None
    exit_code: int | None = None
    attempts: int = 0
    started_at: float | None = None
    ended_at: float | None = None
    log_dir: str = ""
    error_file: str = ""
    structured_error_msg: str = NONE

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of this record."""
        return {
            "role": self.role,
            "id": self.id,
            "state": self.state.name,
            "pid": self.pid,
            "pgid": self.pid,
            "start_ticks": self.start_ticks,
            "exit_code": self.exit_code,
            "attempts": self.attempts,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "log_dir": self.log_dir,
            "error_file": self.error_file,
            "structured_error_msg": self.structured_error_msg,
        }

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> ReplicaRecord:
        """The record ``to_json`` wrote."""
        return ReplicaRecord._of(recordfile.parse_replica(d, AppState.__members__))

    @staticmethod
    def _of(fields: Mapping[str, Any]) -> ReplicaRecord:
        return ReplicaRecord(**{**fields, "state": AppState[fields["state"]]})

    def to_status(self) -> ReplicaStatus:
        """The ``ReplicaStatus`` view of this record."""
        return ReplicaStatus(
            id=self.id,
            state=self.state,
            role=self.role,
            hostname="localhost",
            structured_error_msg=self.structured_error_msg,
            exit_code=self.exit_code,
            pid=self.pid,
        )


@dataclass(frozen=True)
class AppRecord:
    """One app as recorded; see the module docstring.

    Args:
        app_id: its id.
        name: its name.
        backend: the backend that launched it.
        session: the session that launched it.
        state: its state.
        msg: why it is in that state, when that needs saying.
        structured_error_msg: the torchelastic error of the replica that failed it, or NONE.
        num_restarts: how many times (part of) it was restarted.
        submitted_at: when it was submitted (POSIX time).
        ended_at: when it became terminal.
        app_dir: its log directory.
        grace_period: seconds between SIGTERM and SIGKILL when it is stopped.
        owner: the launching process.
        replicas: every replica, in role order.
        app: the AppDef as submitted (``appdef_to_json``).
        cgroup: the app's cgroup directory (None: its replicas are found by their marker).
    """

    app_id: str
    name: str
    backend: str
    session: str
    state: AppState
    msg: str
    structured_error_msg: str
    num_restarts: int
    submitted_at: float
    ended_at: float | None
    app_dir: str
    grace_period: float
    owner: Owner
    replicas: tuple[ReplicaRecord, ...]
    app: Mapping[str, Any] = field(repr=False)
    cgroup: str | None = None

    def role_counts(self) -> dict[str, int]:
        """``{role: number of replicas}`` in role order."""
        counts: dict[str, int] = {}
        for r in self.replicas:
            counts[r.role] = counts.get(r.role, 0) + 1
        return counts

    def replica(self, role: str, k: int) -> ReplicaRecord | None:
        """Replica ``k`` of ``role``."""
        for r in self.replicas:
            if r.role == role and r.id == k:
                return r
        return None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of this record."""
        return {
            "format": RECORD_FORMAT,
            "app_id": self.app_id,
            "name": self.name,
            "backend": self.backend,
            "session": self.session,
            "state": self.state.name,
            "msg": self.msg,
            "structured_error_msg": self.structured_error_msg,
            "num_restarts": self.num_restarts,
            "submitted_at": self.submitted_at,
            "ended_at": self.ended_at,
            "app_dir": self.app_dir,
            "grace_period": self.grace_period,
            "owner": self.owner.to_json(),
            "replicas": [r.to_json() for r in self.replicas],
            "app": self.app,
            "cgroup": self.cgroup,
        }

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> AppRecord:
        """The record ``to_json`` wrote.

        Raises:
            ValueError: the document is not an app record this version understands.
        """
        fields = recordfile.parse_app(d, AppState.__members__)
        return AppRecord(
            **{
                **fields,
                "state": AppState[fields["state"]],
                "replicas": tuple(ReplicaRecord._of(r) for r in fields["replicas"]),
            }
        )

    def to_response(self, roles: list[Role] | None = None) -> DescribeAppResponse:
        """The ``DescribeAppResponse`` of this record (``roles`` parsed from it when not given)."""
        statuses: dict[str, list[ReplicaStatus]] = {}
        for r in self.replicas:
            statuses.setdefault(r.role, []).append(r.to_status())
        metadata = self.app.get("metadata") if self.app else None
        if roles is None:
            roles = appdef_from_json(self.app).roles if self.app else []
        return DescribeAppResponse(
            app_id=self.app_id,
            state=self.state,
            num_restarts=self.num_restarts,
            msg=self.msg or NONE,
            structured_error_msg=self.structured_error_msg,
            ui_url=f"file://{self.app_dir}",
            roles_statuses=[RoleStatus(role, reps) for role, reps in statuses.items()],
            roles=roles,
            name=self.name,
            metadata=dict(metadata) if isinstance(metadata, dict) else {},
        )


# -- the store -----------------------------------------------------------------------------------


class RecordStore:
    """Reads and writes app records under ``{root}/.apps``. Every method blocks: call it in a thread.

    Args:
        root: the state root.
        launcher: what the launcher says of itself in its holder file (its backend and session:
            other processes list the apps it is submitting with them).
    """

    def __init__(self, root: Path, launcher: Mapping[str, str] | None = None) -> None:
        self.root = root
        self._says = json.dumps(dict(launcher)).encode() if launcher else b""
        self.records_dir = Path(recordfile.records_dir(root))
        self._ready = False
        self._lock = threading.Lock()
        self._ticks: dict[tuple[int, Any], int | None] = {}
        #: empty files the first versions of records are written into (``spares.py``)
        self.spares = SparePool(str(self.records_dir))
        #: the holder file this store's claims link (``protocol.make_holder``), once ``hold`` ran
        self.holder: str | None = None
        #: the descriptor that holds the lock of ``holder`` (-1: none; for the watchdog to inherit)
        self.holder_fd = -1
        #: the locks of the holder files made before (``hold`` again): claims may still link them
        self._old_holder_fds: list[int] = []
        #: ``(st_dev, st_ino)`` of every holder file ``hold`` made (the claims this store made link
        #: one of them: ``confirm_claim``)
        self._holder_ids: set[tuple[int, int]] = set()
        self._held = False
        #: serialises the changes of the holder: ``hold`` runs on the event loop (``claim``) and
        #: in worker threads (``prepare``, a take-over's ``claim``) alike
        self._holder_lock = threading.Lock()
        _stores.add(self)

    def ensure(self) -> None:
        """Creates the state root (private to this user) and the records directory."""
        if self._ready and self.records_dir.is_dir():
            return
        with self._lock:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = self.root.stat()
            if st.st_uid != os.getuid():
                raise PermissionError(
                    f"the local state root {str(self.root)!r} belongs to another user (uid "
                    f"{st.st_uid}); set {ROOT_ENV} or pass local_root= to use another directory"
                )
            self.records_dir.mkdir(mode=0o700, exist_ok=True)
            self._ready = True

    def path(self, app_id: str) -> Path | None:
        """The record file of ``app_id``, or None when ``app_id`` cannot be a local app id."""
        if not recordfile.is_app_id(app_id):
            return None
        return self.records_dir / f"{app_id}.json"

    def _fill_start_ticks(self, doc: Mapping[str, Any]) -> None:
        # a replica's start time (pid-reuse guard for other processes) is read here, in the writer's
        # thread, rather than when it is spawned on the event loop
        for rep in doc.get("replicas", ()):
            pid = rep.get("pid")
            if not pid or rep.get("start_ticks") is not None or rep.get("state") != "RUNNING":
                continue
            key = (pid, rep.get("started_at"))
            if key not in self._ticks:
                if len(self._ticks) > 100_000:
                    self._ticks.clear()
                self._ticks[key] = proc_start_ticks(pid)
            rep["start_ticks"] = self._ticks[key]

    def write_many(self, docs: Mapping[str, dict[str, Any]]) -> dict[str, BaseException]:
        """Writes each record (``protocol.write_record_file``); returns the errors by app id (empty
        when all were written).

        Replicas recorded RUNNING without a start time get it from ``/proc`` (the documents are
        updated in place). A missing records directory is created again. Once a terminal record is
        written, the app's lock file and cancel marker are removed.
        """
        errors: dict[str, BaseException] = {}
        records_dir = str(self.records_dir)
        for app_id, doc in docs.items():
            self._fill_start_ticks(doc)
            try:
                data = json.dumps(doc, separators=(",", ":"), default=str).encode()
                try:
                    protocol.write_record_file(records_dir, app_id, data, self.spares)
                except FileNotFoundError:
                    self._ready = False
                    self.spares.lost()
                    self.ensure()
                    protocol.write_record_file(records_dir, app_id, data)
                if doc.get("state") in TERMINAL_NAMES:
                    # (the record names the app from now on: its claim is no longer needed)
                    protocol.drop_claim(records_dir, app_id)
                    if self._has_side_files(app_id):
                        # (one created after this check finds the record terminal and is removed
                        # by its creator, under the lock)
                        with protocol.locked_record(records_dir, app_id):
                            protocol.drop_lock_files(records_dir, app_id)
            except OSError as e:
                errors[app_id] = e
        return errors

    def hold(self) -> None:
        """Makes this store's holder file (``protocol.make_holder``), which its claims link and
        whose lock says that its launcher or watchdog lives; ``holder_fd`` holds the lock (pass it
        to the watchdog). A holder made again (its file was removed) keeps the older locks, which
        the claims made before still name, until ``release_holder``. Thread-safe (two at once make
        two holders, and keep each older lock once). Raises OSError."""
        self.ensure()
        pid = os.getpid()
        name = f"{pid}.{proc_start_ticks(pid) or 0}.{secrets.token_hex(4)}"
        with self._holder_lock:
            made = protocol.make_holder(str(self.records_dir), name, self._says)
            if made is not None:
                st = os.fstat(made[1])
                self._holder_ids.add((st.st_dev, st.st_ino))
            self._held = True
            if self.holder_fd >= 0:
                self._old_holder_fds.append(self.holder_fd)
            self.holder, self.holder_fd = made if made is not None else (None, -1)

    def drop_dead_holders(self) -> None:
        """Removes the holder files of launchers that are gone and left no claim
        (``protocol.drop_dead_holders``; a SIGKILLed launcher leaves its own), and what a writer
        killed during a record's compaction left (``protocol.drop_compaction_leftovers``)."""
        protocol.drop_dead_holders(str(self.records_dir), self.holder)
        protocol.drop_compaction_leftovers(str(self.records_dir))

    def lock_fds(self) -> tuple[int, ...]:
        """The descriptors holding the locks of this store's claims (for its watchdog)."""
        with self._holder_lock:
            fds = (self.holder_fd, *self._old_holder_fds)
        return tuple(fd for fd in fds if fd >= 0)

    def release_holder(self) -> None:
        """Lets the holder's locks go (the scheduler closed; its watchdog may keep them a little
        longer) and removes the holder file when no claim links it any more."""
        with self._holder_lock:
            if self.holder_fd >= 0 and self.holder is not None:
                with contextlib.suppress(OSError):
                    if os.fstat(self.holder_fd).st_nlink == 1:
                        os.unlink(self.holder)
            for fd in [self.holder_fd, *self._old_holder_fds]:
                if fd >= 0:
                    os.close(fd)
            self.holder, self.holder_fd, self._old_holder_fds = None, -1, []
            self._holder_ids.clear()
            self._held = False

    def claim(self, app_id: str) -> bool:
        """Claims ``app_id`` for this launcher (``protocol.claim_app``); False when it is claimed
        already, or has a record (a dry run scheduled before: the claim is then given back).

        Raises:
            OSError: the claim cannot be made.
        """
        if not self._held:
            self.hold()
        records_dir = str(self.records_dir)
        try:
            claimed = protocol.claim_app(records_dir, app_id, self.holder)
        except FileNotFoundError:  # the records directory or the holder file was removed
            self._ready = False
            self.hold()
            claimed = protocol.claim_app(records_dir, app_id, self.holder)
        if not claimed:
            return False
        if os.path.lexists(protocol.record_path(records_dir, app_id)):
            protocol.drop_claim(records_dir, app_id)
            return False
        return True

    def confirm_claim(self, app_id: str) -> bool:
        """True when the claim this store made of ``app_id`` is still its own (one ``lstat``),
        made again (``claim``) if it was removed (its claims directory, say); False when it is now
        another launcher's, or the app has a record (another launcher claimed it meanwhile, and
        may have started it): nothing is touched then.

        A claim that is a file of its own (``protocol.claim_app`` without hard links or locks)
        cannot be told from another launcher's, and is taken for this store's.

        Raises:
            OSError: the claim cannot be made again.
        """
        try:
            st = os.lstat(protocol.claim_path(str(self.records_dir), app_id))
        except FileNotFoundError:
            return self.claim(app_id)
        return self._is_mine(st)

    def _is_mine(self, claim: os.stat_result) -> bool:
        return (claim.st_dev, claim.st_ino) in self._holder_ids or claim.st_nlink == 1

    def release_claim(self, app_id: str) -> None:
        """``remove`` for an app claimed and not started, when its claim is still this store's;
        nothing when it is not (it was removed meanwhile, and another launcher may have claimed,
        started or recorded the app since: what is there is that launcher's)."""
        try:
            mine = self._is_mine(os.lstat(protocol.claim_path(str(self.records_dir), app_id)))
        except OSError:
            mine = False
        if mine:
            self.remove(app_id)

    def take_stale_claim(self, app_id: str, may_take: Callable[[], bool] = lambda: True) -> str:
        """Takes the claim of ``app_id`` over when it was left by a launcher that died before its
        watchdog knew of the app and ``may_take()`` (``protocol.take_stale_claim``), and the app
        has no record; ``claim`` again when the claim went meanwhile. Returns ``protocol.TAKEN``, ``HELD``,
        ``UNKNOWN`` or ``RECORDED``.

        Raises:
            OSError: the claim cannot be checked or taken.
        """
        records_dir = str(self.records_dir)
        record = protocol.record_path(records_dir, app_id)
        outcome = protocol.HELD
        for _ in range(3):
            if os.path.lexists(record):
                return RECORDED
            if self.holder is None:
                return protocol.UNKNOWN
            outcome = protocol.take_stale_claim(records_dir, app_id, self.holder, may_take)
            if outcome == protocol.GONE:
                if not self.claim(app_id):
                    continue
                outcome = protocol.TAKEN
            if outcome == protocol.TAKEN:
                if os.path.lexists(record):  # (written by a watchdog that ended just before)
                    protocol.drop_claim(records_dir, app_id)
                    return RECORDED
                self.drop_dead_holders()
            return outcome
        return outcome

    def claim_held(self, app_id: str) -> bool:
        """True when ``app_id`` is claimed by a launcher (or its watchdog) that lives
        (``recordfile.claim_holder``): without a record, it is being submitted."""
        return recordfile.claim_holder(str(self.records_dir), app_id) is not None

    def held_claims(self, recorded: Container[str]) -> dict[str, dict[str, Any]]:
        """The apps claimed by a launcher that lives, but those in ``recorded``, with what their
        launcher says of itself (``recordfile.held_claims``)."""
        return recordfile.held_claims(str(self.records_dir), recorded)

    def _has_side_files(self, app_id: str) -> bool:
        records_dir = str(self.records_dir)
        return os.path.exists(protocol.lock_path(records_dir, app_id)) or os.path.exists(
            protocol.cancel_path(records_dir, app_id)
        )

    def read(self, app_id: str) -> AppRecord | None:
        """The record of ``app_id``, or None when there is none (or it is unreadable)."""
        path = self.path(app_id)
        return None if path is None else recordfile.read_record(path, AppRecord.from_json)

    def read_many(self, app_ids: Iterable[str]) -> dict[str, AppRecord | None]:
        """``read`` for each id."""
        return {app_id: self.read(app_id) for app_id in app_ids}

    def read_checked(self, app_id: str) -> AppRecord | None:
        """``read``, with an app whose launcher, watchdog and replicas are all gone reported
        FAILED (``check_lost``) unless a second read finds it ended: its launcher may have
        recorded its end and exited since the first read."""
        record = self.read(app_id)
        if record is None:
            return None
        lost = check_lost(record)
        if lost is record:
            return record
        # all gone: was the end recorded after the read? Nobody is left to write, so a second
        # read is final
        again = self.read(app_id)
        return again if again is not None and again.state.name in TERMINAL_NAMES else lost

    def recorded_or_gone(self, app_id: str) -> AppRecord | bool:
        """For an app that had no record when read: True while it is being submitted (its claim is
        held), else its record read again (the app was recorded, and perhaps ended and its claim
        dropped, since the first read), else False (there is no such app)."""
        if self.claim_held(app_id):
            return True
        record = self.read_checked(app_id)
        return False if record is None else record

    def read_checked_many(self, app_ids: Iterable[str]) -> dict[str, AppRecord | None]:
        """``read_checked`` for each id."""
        return {app_id: self.read_checked(app_id) for app_id in app_ids}

    def list_ids(self) -> list[str]:
        """The ids of every recorded app."""
        return recordfile.list_ids(self.records_dir)

    def remove(self, app_id: str) -> None:
        """Deletes the record of ``app_id`` and its side files (a failed submit leaves none behind).

        A file that cannot be removed (the file system turned read-only) is left, and the others
        are removed all the same: the undo of a failed submit goes on and its error is the one
        raised. A claim left so refuses only its dry run, and is taken over once its launcher is
        gone (``take_stale_claim``). The files go under the record's lock (where it can be
        taken), so that a cancel from another process either leaves its marker before (removed
        here) or finds no claim after (and leaves none).
        """
        if self.path(app_id) is None:
            return
        records_dir = str(self.records_dir)
        try:
            with protocol.locked_record(records_dir, app_id):
                self._remove_files(records_dir, app_id)
        except OSError:
            self._remove_files(records_dir, app_id)

    @staticmethod
    def _remove_files(records_dir: str, app_id: str) -> None:
        for p in (
            protocol.record_path(records_dir, app_id),
            protocol.cancel_path(records_dir, app_id),
            protocol.lock_path(records_dir, app_id),
            protocol.claim_path(records_dir, app_id),  # (last: the id is free once it goes)
        ):
            with contextlib.suppress(OSError):
                os.unlink(p)

    def mark_cancel(self, app_id: str, groups: Iterable[str]) -> tuple[list[str], bool] | None:
        """Leaves the cancel marker of ``app_id`` for its launcher, listing the process groups
        (``pid:start_ticks``) sent SIGTERM. Returns those of ``groups`` the caller is to signal
        (all of them, but those a marker already there lists: a cancel under way, another
        process's or its launcher's own, signalled them, and each group gets one SIGTERM; the
        others are added to it), and whether this call made the marker. None (and no marker)
        when the record is terminal, or there is none and the app is not being submitted
        (``claim_held``).

        Raises:
            OSError: the marker could not be written (a full or read-only file system, say); no
                temporary file is left behind, and a marker already there is left as it was.
        """
        records_dir = str(self.records_dir)
        marker = protocol.cancel_path(records_dir, app_id)
        with protocol.locked_record(records_dir, app_id):
            record = self.read(app_id)
            if record is None and not self.claim_held(app_id):
                # (a stale claim stays: the next launch of the dry run takes it over)
                with contextlib.suppress(OSError):
                    os.unlink(protocol.lock_path(records_dir, app_id))
                return None
            if record is not None and record.state.name in TERMINAL_NAMES:
                protocol.drop_lock_files(records_dir, app_id)
                return None
            try:
                listed = _read_marker(marker).decode(errors="replace").split()
            except FileNotFoundError:
                listed = None
            except OSError:  # (not a regular file: a cancel is under way all the same)
                listed = []
            fresh = [g for g in dict.fromkeys(groups) if listed is None or not _listed(g, listed)]
            if listed is not None and not fresh:
                return [], False
            data = "".join(f"{g}\n" for g in [*(listed or ()), *fresh]).encode()
            # complete when it appears (the launcher may read it the moment it does)
            tmp = os.path.join(records_dir, f".{app_id}.cancel.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                finally:
                    os.close(fd)
                os.replace(tmp, marker)
            except BaseException:
                # (a full or read-only file system, say): no partial file stays behind; the
                # error is the caller's
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        return fresh, listed is None

    def cancel_marked(self, app_id: str) -> bool:
        """True when another process left the cancel marker of ``app_id`` (one lookup)."""
        return os.path.lexists(protocol.cancel_path(str(self.records_dir), app_id))

    def cancel_requested(self, app_id: str) -> set[int] | None:
        """None, or the process groups another process sent SIGTERM when it cancelled ``app_id``."""
        try:
            data = _read_marker(protocol.cancel_path(str(self.records_dir), app_id))
        except FileNotFoundError:
            return None
        except OSError:
            return set()
        specs = (protocol.parse_group_spec(word) for word in data.split())
        return {spec[0] for spec in specs if spec is not None}


def _read_marker(path: str) -> bytes:
    """A cancel marker's bytes (a few lines): it must be a regular file, opened without blocking
    or following a link (a FIFO put in its place would block its reader for ever).

    Raises:
        FileNotFoundError: there is none.
        OSError: it cannot be read, or is not a regular file.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        return os.read(fd, 1 << 20)
    finally:
        os.close(fd)


def _listed(group: str, listed: list[str]) -> bool:
    """Whether a cancel marker's ``listed`` groups hold ``group`` (``pid:start_ticks``; ticks of
    0 are unknown: its launcher may list a group before it knows when the leader started)."""
    spec = protocol.parse_group_spec(group)
    if spec is None:
        return group in listed
    pid, ticks = spec
    for other in map(protocol.parse_group_spec, listed):
        if other is not None and other[0] == pid and (ticks == other[1] or 0 in (ticks, other[1])):
            return True
    return False


def check_lost(record: AppRecord) -> AppRecord:
    """``record``, or a FAILED copy when it is not terminal but its launcher, its watchdog and all
    its replicas are gone (nobody is left to record how it ended; the CLI's fast path asks the same
    ``recordfile.lost_message``)."""
    replicas = ((r.pid, r.start_ticks) for r in record.replicas)
    lost = recordfile.lost_message(record.state.name, record.owner, replicas)
    if lost is None:
        return record
    return dataclasses.replace(record, state=AppState.FAILED, msg=lost)
