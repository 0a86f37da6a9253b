"""The launcher side of tracking: the environment every role of a job gets at dry run.

Imported by the runner (never by a job); the job reads what this writes through
``asynctorchx.tracker.api``.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence

from asynctorchx.specs.api import AppDef, macros, make_app_handle
from asynctorchx.tracker.api import (
    BUILTIN_TRACKERS,
    ENV_TORCHX_JOB_ID,
    ENV_TORCHX_PARENT_RUN_ID,
    ENV_TORCHX_TRACKERS,
    TrackerError,
    TrackerSetting,
    tracker_config_env_var_name,
    tracker_factory_env_var_name,
)
from asynctorchx.tracker.backend.fsspec import MAX_RUN_ID_BYTES, encode_run_id

_FSSPEC = BUILTIN_TRACKERS["fsspec"]

#: The longest app id each builtin scheduler makes: ``make_unique``'s 40 characters (local,
#: Docker); Kubernetes' ``{namespace}:{name}`` (a 63-character namespace, a 40-character name);
#: a Slurm job number (32 bits: 10 digits).
LONGEST_APP_ID = {
    "local_cwd": 40,
    "local_dir": 40,
    "local_docker": 40,
    "kubernetes": 63 + 1 + 40,
    "slurm": 10,
}
#: Another scheduler's ids are not known: only a session name no app id fits after is refused.
SHORTEST_APP_ID = 1


def _stores_runs(t: TrackerSetting) -> bool:
    """True for the builtin file tracker (whose run ids have a length limit)."""
    return BUILTIN_TRACKERS.get(t.factory or t.name) == _FSSPEC


def check_run_id(field: str, value: object, trackers: Sequence[TrackerSetting] = ()) -> str:
    """``value`` if it can be a run id in an environment variable and every builtin tracker of
    ``trackers`` can store it, else a ValueError naming ``field``.

    Checked at dry run: a job whose trackers cannot record its parent fails at once in
    ``app_run_from_env()``, every replica of every job of the sweep.
    """
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{field} must be a non-empty string, got {value!r}")
    if "\0" in value or "\n" in value:
        raise ValueError(f"{field} must not contain NUL or newline characters, got {value!r}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{field} {value!r} is not valid text ({e.reason}: {value[e.start : e.end]!r})"
        ) from None
    for t in trackers:
        if _stores_runs(t):
            try:
                encode_run_id(value)
            except TrackerError as e:
                raise ValueError(f"{field} cannot be recorded by tracker {t.name!r}: {e}") from None
    return value


def check_job_ids(scheduler: str, session: str, trackers: Sequence[TrackerSetting]) -> None:
    """Raises ValueError naming the session name when the job ids ``scheduler`` makes in session
    ``session`` can be too long for a builtin tracker of ``trackers`` to store.

    Checked at dry run with the longest app id the scheduler makes (``LONGEST_APP_ID``): such a
    job would fail at its first ``add_metadata``, after training started.
    """
    trackers = [t for t in trackers if _stores_runs(t)]
    if not trackers:
        return
    app_id_length = LONGEST_APP_ID.get(scheduler, SHORTEST_APP_ID)
    job_id = make_app_handle(scheduler, session, "x" * app_id_length)
    size = len(job_id.encode("utf-8", "surrogateescape"))
    if size <= MAX_RUN_ID_BYTES:
        return
    room = MAX_RUN_ID_BYTES - (size - len(session.encode("utf-8", "surrogateescape")))
    raise ValueError(
        f"session name {session!r} makes job ids ('{scheduler}://{session}/<app id>', with app ids "
        f"of up to {app_id_length} characters) of up to {size} bytes, longer than tracker "
        f"{trackers[0].name!r} can store (at most {MAX_RUN_ID_BYTES} bytes): use a session name of "
        f"at most {max(room, 0)} bytes"
    )


def tracking_env(
    scheduler: str,
    session: str,
    trackers: Sequence[TrackerSetting],
    parent_run_id: str | None,
) -> dict[str, str]:
    """The variables TorchX's runner puts into every role: job id, parent run, trackers.

    ``parent_run_id`` None falls back to ``$TORCHX_PARENT_RUN_ID`` of the launcher (an explicit
    argument wins over the environment; TorchX lets the environment win).

    Raises:
        ValueError: ``parent_run_id`` is not valid, or it or the job ids cannot be stored by a
            tracker (``check_run_id``, ``check_job_ids``).
    """
    check_job_ids(scheduler, session, trackers)
    env = {ENV_TORCHX_JOB_ID: make_app_handle(scheduler, session, macros.app_id)}
    if parent_run_id is None:
        parent_run_id = os.environ.get(ENV_TORCHX_PARENT_RUN_ID) or None
    if parent_run_id is not None:
        env[ENV_TORCHX_PARENT_RUN_ID] = check_run_id("parent_run_id", parent_run_id, trackers)
    if trackers:
        env[ENV_TORCHX_TRACKERS] = ",".join(t.name for t in trackers)
    for t in trackers:
        if t.config:
            env[tracker_config_env_var_name(t.name)] = t.config
        if t.factory and t.factory != t.name:
            env[tracker_factory_env_var_name(t.name)] = t.factory
    return env


def with_env(app: AppDef, env: Mapping[str, str]) -> AppDef:
    """A copy of ``app`` whose every role has ``env`` added (``app`` is not modified).

    The copy is shallow but for the roles and their ``env``: the scheduler deep-copies what it keeps.
    """
    if not env or not isinstance(app, AppDef) or not isinstance(app.roles, list):
        return app
    new = copy.copy(app)
    roles = []
    for role in app.roles:
        if not isinstance(getattr(role, "env", None), dict):
            roles.append(role)
            continue
        r = copy.copy(role)
        r.env = {**role.env, **env}
        roles.append(r)
    new.roles = roles
    return new
