"""``status``, ``describe`` and ``list`` of local apps answered from their record files, without a runner.

Each of these is the read of one small JSON file (``{state root}/.apps/{app_id}.json``, or every
record for ``list``), yet the runner path imports asyncio, anyio and every part of the local
backend, then starts an event loop: that import is most of what the command costs. Here the records
are read and parsed by ``schedulers/_local/recordfile.py``, the same stdlib-only code the local
scheduler reads them with, loaded by its path so that the ``asynctorchx.schedulers`` package (and
with it asyncio) is never imported; "lost" apps are found by the same check. What the runner path
would build from the record (``AppStatus``, the ``AppDef``, the list rows) is built here from the
parsed fields, and the command prints it with the same code. Tests run both paths over the same
records and compare their output byte for byte (``tests/test_cli_fastpath.py``).

Only what needs nothing else is answered here: a handle (or ``-s``) of ``local_cwd`` or
``local_dir`` with a non-empty session, no ``.torchxconfig`` at all (a config file may hold launch
limits or be invalid, which the runner reports), and a kernel with pidfds (without them the local
backends refuse to start). Anything else returns None, and the command takes the runner path: so
does an app being submitted (its id claimed by a launcher that lives, no record yet), which the
runner path reports PENDING.
``ASYNCTORCHX_CLI_FASTPATH=0`` in the environment sends every command the runner path (to compare
the two, or should they ever disagree).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asynctorchx.specs.api import AppDef, AppStatus

LOCAL_BACKENDS = ("local_cwd", "local_dir")
#: ``asynctorchx.schedulers.DEFAULT_SCHEDULER`` (``list`` without ``-s`` and without a config file).
DEFAULT_SCHEDULER = "local_cwd"
#: ``asynctorchx.runner.config``'s names: the variable naming the one config file, and the file name.
ENV_TORCHXCONFIG = "TORCHXCONFIG"
CONFIG_FILE = ".torchxconfig"
#: Set to ``0``, every command takes the runner path.
SWITCH_ENV = "ASYNCTORCHX_CLI_FASTPATH"

_RECORDFILE = "asynctorchx.schedulers._local.recordfile"

#: Sets logging up, while ``main`` defers that until something is logged (``deferred_logging``).
_deferred_logging: Callable[[], None] | None = None


@contextlib.contextmanager
def deferred_logging(setup: Callable[[], None] | None) -> Iterator[None]:
    """Within the block, ``setup()`` (unless None: logging is set up already) is called, once is
    enough, before anything here is logged: an answer that logs nothing never imports ``logging``."""
    global _deferred_logging
    _deferred_logging = setup
    try:
        yield
    finally:
        _deferred_logging = None


def _warn(message: str, *args: object) -> None:
    """A warning of the record reader, logged as the scheduler logs it (after setting logging up)."""
    if _deferred_logging is not None:
        _deferred_logging()
    _recordfile().log_warning(message, *args)


def _debug(message: str, *args: object) -> None:
    if _deferred_logging is None:  # deferred: the level is WARNING or above, nothing would show
        import logging

        logging.getLogger(__name__).debug(message, *args)


def _recordfile() -> ModuleType:
    """``asynctorchx.schedulers._local.recordfile``, loaded by its path unless it is imported already.

    Importing it by name would import ``asynctorchx.schedulers`` first (the scheduler registry and
    ``schedulers.api``, and with them asyncio and anyio). The module is registered under its own
    name, so a later import of the package finds this one rather than loading a second copy.
    """
    module = sys.modules.get(_RECORDFILE)
    if module is None:
        import importlib
        import importlib.util

        path = os.path.join(
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            "schedulers",
            "_local",
            "recordfile.py",
        )
        if not os.path.isfile(path):  # not installed as files (a zip...): the slow way
            return importlib.import_module(_RECORDFILE)
        spec = importlib.util.spec_from_file_location(_RECORDFILE, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[_RECORDFILE] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[_RECORDFILE]
            raise
    return module


def answer(
    args: argparse.Namespace,
    query: Callable[[str], tuple[Any, ...] | None],
    show: Callable[..., int],
) -> int | None:
    """``show(args, handle, *found)`` of what ``query(args.handle)`` found, or None (the runner path
    must answer) when it found nothing it can answer for."""
    found = query(args.handle)
    if found is None:
        return None
    args.scheduler = args.handle.split("://", 1)[0]
    return show(args, args.handle, *found)


def _no_config() -> bool:
    """True when no ``.torchxconfig`` can apply (conservatively: any entry of that name counts)."""
    named = os.environ.get(ENV_TORCHXCONFIG)
    if named is not None:
        return not named
    try:
        dirs = (os.getcwd(), os.path.expanduser("~"))
    except OSError:
        return False
    return not any(os.path.lexists(os.path.join(d, CONFIG_FILE)) for d in dirs)


def usable(scheduler: str, session: str | None = None) -> bool:
    """Whether a command for ``scheduler`` (and a handle's ``session``) can be answered here."""
    if scheduler not in LOCAL_BACKENDS or not hasattr(os, "pidfd_open"):
        return False
    if os.environ.get(SWITCH_ENV) == "0":
        return False
    if session is not None:
        from asynctorchx.specs.api import is_session_name

        if not session or not is_session_name(session):
            return False  # the runner path maps an empty session, or rejects the name
    return _no_config()


def _split(handle: str) -> tuple[str, str, str] | None:
    """``(scheduler, session, app_id)`` of a handle answerable here, else None.

    Raises:
        MalformedAppHandleException: not a handle (as the runner path raises it, first).
    """
    from asynctorchx.specs.api import parse_app_handle

    parsed = parse_app_handle(handle)
    scheduler, session, app_id = parsed.scheduler_backend, parsed.session_name, parsed.app_id
    if not usable(scheduler, session):
        return None
    return scheduler, session, app_id


def _read(rf: ModuleType, app_id: str, log: bool = True) -> dict[str, Any] | None:
    """The parsed record of ``app_id`` with the lost check applied (``LocalScheduler.describe``'s
    read of an app another process launched), or None when there is none."""
    from asynctorchx.specs.api import AppState

    if not rf.is_app_id(app_id):
        return None
    path = os.path.join(rf.records_dir(rf.root_dir()), f"{app_id}.json")
    if log:
        _debug("reading the app record %s (no runner, no event loop)", path)

    def read() -> dict[str, Any] | None:
        parsed: dict[str, Any] | None = rf.read_record(
            path, lambda d: rf.parse_app(d, AppState.__members__), _warn
        )
        return parsed

    fields = read()
    if fields is None:
        return None
    lost = rf.lost_message(
        fields["state"], fields["owner"], ((r["pid"], r["start_ticks"]) for r in fields["replicas"])
    )
    if lost is not None:
        # all gone: was the end recorded after the read? Nobody is left to write, so a second
        # read is final (``RecordStore.read_checked``)
        again = read()
        if again is not None and again["state"] in rf.TERMINAL_NAMES:
            return again
        fields = {**fields, "state": "FAILED", "msg": lost}
    return fields


def _being_submitted(rf: ModuleType, app_id: str) -> bool:
    """True when ``app_id`` (which had no record) is claimed by a launcher that lives."""
    return rf.claim_holder(rf.records_dir(rf.root_dir()), app_id) is not None


def _recorded_or_gone(rf: ModuleType, app_id: str) -> dict[str, Any] | bool:
    """For an app that had no record when read: True while it is being submitted, else its record
    read again (recorded, perhaps ended and its claim dropped, since), else False
    (``RecordStore.recorded_or_gone``)."""
    if _being_submitted(rf, app_id):
        return True
    return _read(rf, app_id, log=False) or False


def _view(rf: ModuleType, fields: dict[str, Any]) -> tuple[AppStatus, AppDef | None] | None:
    """What the runner makes of a record: its status (``AppRecord.to_response().to_status()``) and,
    when the record holds one, its ``AppDef``; None (with the runner's warning) when that AppDef
    cannot be read back (a corrupt record)."""
    from asynctorchx.specs.api import NONE, AppState, AppStatus, ReplicaStatus, RoleStatus

    statuses: dict[str, list[ReplicaStatus]] = {}
    for r in fields["replicas"]:
        statuses.setdefault(r["role"], []).append(
            ReplicaStatus(
                id=r["id"],
                state=AppState[r["state"]],
                role=r["role"],
                hostname="localhost",
                structured_error_msg=r["structured_error_msg"],
                exit_code=r["exit_code"],
                pid=r["pid"],
            )
        )
    app = None
    if fields["app"]:
        from asynctorchx.specs.serialize import appdef_from_dict

        try:
            app = appdef_from_dict(fields["app"])
        except rf.PARSE_ERRORS as e:
            path = os.path.join(rf.records_dir(rf.root_dir()), f"{fields['app_id']}.json")
            _warn("ignoring corrupt app record %s: %r", path, e)
            return None
    msg = fields["msg"] or NONE
    status = AppStatus(
        state=AppState[fields["state"]],
        num_restarts=fields["num_restarts"],
        msg="" if msg == NONE else msg,
        structured_error_msg=fields["structured_error_msg"],
        ui_url=f"file://{fields['app_dir']}",
        roles=[RoleStatus(role, reps) for role, reps in statuses.items()],
    )
    return status, app


def status(handle: str) -> tuple[AppStatus | None] | None:
    """``(status or None when unknown,)`` of the app, or None when the runner path must answer.

    Raises:
        MalformedAppHandleException: not a handle.
    """
    split = _split(handle)
    if split is None:
        return None
    rf = _recordfile()
    fields = _read(rf, split[2])
    if fields is None:
        found = _recorded_or_gone(rf, split[2])
        if found is True:
            return None
        fields = found or None
    view = None if fields is None else _view(rf, fields)
    return (None if view is None else view[0],)


def describe(handle: str) -> tuple[AppDef | None, str] | None:
    """``(AppDef or None when unknown, state name)`` of the app, or None when the runner path must
    answer.

    Raises:
        MalformedAppHandleException: not a handle.
    """
    from asynctorchx.specs.api import AppDef

    split = _split(handle)
    if split is None:
        return None
    app_id = split[2]
    rf = _recordfile()
    fields = _read(rf, app_id)
    if fields is None:
        found = _recorded_or_gone(rf, app_id)
        if found is True:
            return None
        fields = found or None
    view = None if fields is None else _view(rf, fields)
    if fields is None or view is None:
        return (None, "UNKNOWN")
    status, app = view
    if app is None:
        return AppDef(name=fields["name"] or app_id), status.state.name
    # (the runner's ``describe`` keeps the name of the record, the roles and metadata of its app)
    described = AppDef(name=fields["name"] or app_id, roles=list(app.roles), metadata=app.metadata)
    return described, status.state.name


def list_apps(scheduler: str) -> list[tuple[str, str, str, str]] | None:
    """``(handle, app_id, state name, name)`` of every app of ``scheduler`` in the state root, in
    ``LocalScheduler.list``'s order, or None when the runner path must answer.

    Raises:
        MalformedAppHandleException: a record whose backend or session cannot make a handle.
    """
    if not usable(scheduler):
        return None
    from asynctorchx.specs.api import make_app_handle

    rf = _recordfile()
    _debug("listing the app records of %s (no runner, no event loop)", rf.root_dir())
    records_dir = rf.records_dir(rf.root_dir())
    read = {app_id: _read(rf, app_id, log=False) for app_id in rf.list_ids(records_dir)}
    if rf.held_claims(records_dir, {i for i, r in read.items() if r is not None}):
        return None  # (apps being submitted: the runner lists them)
    # an app claimed when the records were listed may have been recorded (and its claim dropped)
    # since: listed again, its record is read
    for app_id in rf.list_ids(records_dir):
        if app_id not in read:
            read[app_id] = _read(rf, app_id, log=False)
    records = {r["app_id"]: r for r in read.values() if r is not None}
    ordered = sorted(records.values(), key=lambda r: (r["submitted_at"], r["app_id"]))
    rows = [
        (make_app_handle(r["backend"], r["session"], r["app_id"]), r)
        for r in ordered
        if r["backend"] == scheduler
    ]
    return [(handle, r["app_id"], r["state"], r["name"]) for handle, r in rows]
