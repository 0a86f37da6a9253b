"""The local backends' dry run: an ``AppDef`` and a resolved cfg become one launch request per replica.

Everything here is pure: it reads the current directory, the environment and (for
``auto_set_cuda_visible_devices``) the GPU count, but creates and starts nothing.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from asynctorchx.specs.api import (
    AppDef,
    CfgVal,
    InvalidAppDefException,
    InvalidRunConfigException,
    RetryPolicy,
    Role,
    check_host_mounts,
    check_replica_count,
    macros,
    make_app_handle,
    make_unique,
)

logger = logging.getLogger(__name__)

RANK0_HOST_ENV = "TORCHX_RANK0_HOST"
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
JOB_ID_ENV = "TORCHX_JOB_ID"
PET_LOG_DIR_ENV = "PET_LOG_DIR"
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
#: The directory, in a session's log directory, of its replicas' default torchelastic error files.
ERRORS_DIR = ".errors"
#: Space set aside in a session's ``.errors`` directory (``space_reserve_of``): freed when a full
#: disk leaves a log file without room for the marker line of the output it lost.
SPACE_RESERVE = ".space-for-loss-markers"
SPACE_RESERVE_SIZE = 1 << 18

#: The longest string (an argument, or an environment entry ``KEY=VALUE``) ``exec`` takes, its
#: terminating NUL included: Linux's ``MAX_ARG_STRLEN``, 32 pages of 4 KiB.
MAX_ARG_STRLEN = 32 * 4096

DEFAULT_GRACE_PERIOD = 5.0
#: The longest ``cancel_grace_period`` accepted (seconds): an hour is already longer than any
#: checkpoint should take, and a larger value is a typo (or ``inf``) that would make stops hang.
MAX_GRACE_PERIOD = 3600.0


def check_grace_period(value: object, cfg: Mapping[str, CfgVal]) -> float:
    """``cancel_grace_period`` as a float in [0, MAX_GRACE_PERIOD] seconds.

    Raises:
        InvalidRunConfigException: it is not a finite number in that range (names it and its value).
    """
    if value is None:
        return DEFAULT_GRACE_PERIOD
    number = (
        float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    )
    if number is None or not math.isfinite(number) or not 0 <= number <= MAX_GRACE_PERIOD:
        raise InvalidRunConfigException(
            f"cancel_grace_period must be a number of seconds in [0, {MAX_GRACE_PERIOD:g}], "
            f"got {value!r}",
            "cancel_grace_period",
            cfg,
        )
    return number


@dataclass(frozen=True)
class ReplicaRequest:
    """How to start one replica.

    Args:
        role: the role's name.
        replica_id: the replica's index within its role.
        entrypoint: the command (resolved against ``env["PATH"]`` and ``cwd`` at launch).
        args: its arguments, macros substituted.
        env: variables set over the launcher's environment (role env, TorchX's variables, PATH).
        cwd: the working directory (the image directory).
        log_dir: where its ``stdout.log``, ``stderr.log`` and ``combined.log`` go.
        error_file: the torchelastic error file the replica may write on failure.
    """

    role: str
    replica_id: int
    entrypoint: str
    args: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str
    log_dir: str
    error_file: str


@dataclass(frozen=True)
class RoleRequest:
    """The replicas of one role and its retry settings."""

    name: str
    max_retries: int
    retry_policy: RetryPolicy
    replicas: tuple[ReplicaRequest, ...]


@dataclass(frozen=True)
class LocalRequest:
    """What ``schedule`` starts for one app.

    Args:
        app_id: the new app's id.
        app_name: the app's name.
        backend: ``local_cwd`` or ``local_dir``.
        session: the session that submits it.
        app_dir: the app's log directory ``{log root}/{session}/{app_id}``.
        roles: the roles in the app's order.
        grace_period: seconds between SIGTERM and SIGKILL when replicas are stopped.
    """

    app_id: str
    app_name: str
    backend: str
    session: str
    app_dir: str
    roles: tuple[RoleRequest, ...]
    grace_period: float = DEFAULT_GRACE_PERIOD

    @property
    def replicas(self) -> list[ReplicaRequest]:
        """Every replica of every role, in role order."""
        return [r for role in self.roles for r in role.replicas]


def format_request(request: LocalRequest) -> str:
    """A readable rendering of a request (what ``print(dryrun_info)`` shows)."""
    lines = [
        f"app_id: {request.app_id}",
        f"app_dir: {request.app_dir}",
        f"grace_period: {request.grace_period}s",
    ]
    for role in request.roles:
        lines.append(
            f"role {role.name}: max_retries={role.max_retries} "
            f"retry_policy={role.retry_policy.value}"
        )
        for rep in role.replicas:
            lines.append(f"  replica {rep.replica_id}:")
            lines.append(f"    cmd: {' '.join([rep.entrypoint, *rep.args])}")
            lines.append(f"    cwd: {rep.cwd}")
            lines.append(f"    log_dir: {rep.log_dir}")
            for key in sorted(rep.env):
                lines.append(f"    env {key}={rep.env[key]}")
    return "\n".join(lines)


def join_path(*parts: str | None) -> str:
    """Joins PATH fragments, dropping empty ones and stray separators."""
    return os.pathsep.join(p.strip(os.pathsep) for p in parts if p and p.strip(os.pathsep))


def resolve_image(backend: str, role: Role) -> str:
    """The image directory of ``role``: the current directory (``local_cwd``) or ``role.image``.

    Raises:
        InvalidAppDefException: ``local_dir`` and the image is not an absolute path to an existing
            directory (names the role and the value); ``local_cwd`` and the current directory was
            removed (or cannot be read).
    """
    if backend != "local_dir":
        try:
            return os.getcwd()
        except FileNotFoundError:
            # (the process's directory was removed after it entered it, e.g. a per-request
            # directory cleaned up under a service: getcwd's bare ENOENT names nothing)
            raise InvalidAppDefException(
                "the current directory, local_cwd's image (where replicas run), no longer "
                "exists: it was removed after this process entered it; change to an existing "
                "directory or use local_dir with an absolute image",
                role=role.name,
                field_name="image",
            ) from None
        except OSError as e:
            raise InvalidAppDefException(
                f"the current directory, local_cwd's image (where replicas run), cannot be read: "
                f"{e.strerror or e}",
                role=role.name,
                field_name="image",
            ) from None
    image = role.image
    if not image or not os.path.isabs(image):
        raise InvalidAppDefException(
            f"image must be an absolute path to an existing directory for local_dir, got {image!r}",
            role=role.name,
            field_name="image",
        )
    if not os.path.isdir(image):
        raise InvalidAppDefException(
            f"image {image!r} does not exist or is not a directory (local_dir runs replicas in it)",
            role=role.name,
            field_name="image",
        )
    return os.path.normpath(image)


def _substituter(values: macros.Values) -> Callable[[str], str]:
    """``values.substitute`` with the mapping built once (it runs for every arg of every replica)."""
    mapping = vars(values)  # its fields are all strings: asdict's deep copy is not needed

    def substitute(arg: str) -> str:
        return string.Template(arg).safe_substitute(mapping) if "$" in arg else arg

    return substitute


_NVIDIA_DEV = re.compile(r"nvidia\d+")


def detect_gpu_count() -> int:
    """The number of NVIDIA GPUs on this host, from the driver's ``/proc`` entries or ``/dev``."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        pass
    try:
        return sum(1 for name in os.listdir("/dev") if _NVIDIA_DEV.fullmatch(name))
    except OSError:
        return 0


def cuda_slices(app: AppDef, device_count: int) -> dict[tuple[str, int], str] | None:
    """Contiguous ``CUDA_VISIBLE_DEVICES`` per ``(role, replica)`` for the roles that ask for GPUs.

    Returns None (and logs why) when the app asks for more GPUs than the host has.
    """
    wanted = sum(max(r.resource.gpu, 0) * r.num_replicas for r in app.roles)
    if wanted > device_count:
        logger.warning(
            "app %s asks for %d GPUs but this host has %d; CUDA_VISIBLE_DEVICES is not set",
            app.name,
            wanted,
            device_count,
        )
        return None
    slices: dict[tuple[str, int], str] = {}
    start = 0
    for role in app.roles:
        gpus = int(role.resource.gpu)
        if gpus <= 0:
            continue
        for i in range(role.num_replicas):
            slices[(role.name, i)] = ",".join(str(d) for d in range(start, start + gpus))
            start += gpus
    return slices


def errors_dir_of(app_dir: str) -> str:
    """Where the default torchelastic error files of an app's replicas go: ``.errors`` in its
    session's log directory, beside the app's directory. The replica writes its error file itself,
    so the directory must exist before it starts; one made once per session (not three per app)
    lets a replica that writes nothing make no directory at all (its logs appear on its first
    output)."""
    return os.path.join(os.path.dirname(app_dir), ERRORS_DIR)


def space_reserve_of(app_dir: str) -> str:
    """The file of the space set aside for the loss markers of the logs of ``app_dir``'s session
    (see ``ReplicaLogWriter``'s ``space_reserve``)."""
    return os.path.join(errors_dir_of(app_dir), SPACE_RESERVE)


def app_dir_of(cfg: Mapping[str, CfgVal], *, session: str, log_root: Path, app_id: str) -> str:
    """The log directory of an app: ``{log_dir or log_root}/{session}/{app_id}``."""
    log_dir = cfg.get("log_dir")
    if not (isinstance(log_dir, str) and log_dir):
        return os.path.join(log_root, session or "default", app_id)
    try:
        base = os.path.abspath(os.path.expanduser(log_dir))
    except OSError as e:  # a relative one, from a current directory that was deleted
        raise InvalidRunConfigException(
            f"run option log_dir={log_dir!r} is relative to the current directory, which "
            f"cannot be read ({e.strerror or e}): give an absolute path",
            "log_dir",
            cfg,
        ) from e
    return os.path.join(base, session or "default", app_id)


class _Context(NamedTuple):
    """What every replica's request of one app is built from."""

    app_id: str
    app_dir: str
    handle: str
    prepend_cwd: bool
    parent_path: str | None
    slices: dict[tuple[str, int], str] | None


def _replica_request(role: Role, i: int, img_root: str, ctx: _Context) -> ReplicaRequest:
    """The request of replica ``i`` of ``role``, running in ``img_root``: macros substituted, the
    environment TorchX gives a replica, its log directory and error file."""
    values = macros.Values(
        img_root=img_root, app_id=ctx.app_id, replica_id=str(i), rank0_env=RANK0_HOST_ENV
    )
    sub = _substituter(values)
    env = {k: sub(v) for k, v in role.env.items()}
    rep_dir = os.path.join(ctx.app_dir, role.name, str(i))
    default_error_file = os.path.join(
        errors_dir_of(ctx.app_dir), f"{ctx.app_id}.{role.name}.{i}.error.json"
    )
    error_file = env.setdefault(ERROR_FILE_ENV, default_error_file)
    if error_file and not os.path.isabs(error_file):
        # The replica resolves a relative path against its own working directory (img_root); the
        # supervisor, which removes the file before a restart and reads it after a failure, runs
        # elsewhere. Joined here (not normalised: "a/../b" means what the kernel makes of it), so
        # both name the replica's file and the replica is told the same path. An empty value
        # (torchelastic writes no file) stays as it is.
        error_file = env[ERROR_FILE_ENV] = os.path.join(img_root, error_file)
    env[RANK0_HOST_ENV] = "localhost"
    env.setdefault(PET_LOG_DIR_ENV, os.path.join(ctx.app_dir, "torchelastic", role.name))
    env.setdefault(JOB_ID_ENV, ctx.handle)
    if ctx.prepend_cwd:
        env["PATH"] = join_path(img_root, env.get("PATH"), ctx.parent_path)
    else:  # TorchX's order: it appends the image dir to the role's PATH, then the launcher's
        env["PATH"] = join_path(env.get("PATH"), img_root, ctx.parent_path)
    if ctx.slices is not None and (role.name, i) in ctx.slices:
        env[CUDA_VISIBLE_DEVICES] = ctx.slices[(role.name, i)]
    return ReplicaRequest(
        role=role.name,
        replica_id=i,
        entrypoint=role.entrypoint,
        args=tuple(sub(a) for a in role.args),
        env=env,
        cwd=img_root,
        log_dir=rep_dir,
        error_file=error_file,
    )


def check_arg_sizes(app: AppDef) -> None:
    """Refuses an argument or environment entry longer than ``exec`` takes (``MAX_ARG_STRLEN``)
    at the dry run, naming it, rather than at the launch ("Argument list too long").

    Read before macros are substituted (they add a few hundred bytes at most; the launch refuses
    what they make too long); the limit on all of them together (a quarter of the stack's) is left
    to the launch, which refuses it as a usage error too.

    Raises:
        InvalidAppDefException: naming the role, the field (``args[i]``, ``env['KEY']``) and size.
    """
    for role in app.roles:
        # (at most 4 bytes a character: a role whose strings are all short enough is passed at
        # once, which is every role but a few on every dry run)
        longest = max(map(len, role.args), default=0)
        if role.env:
            longest = max(longest, max(len(k) + len(v) + 1 for k, v in role.env.items()))
        if 4 * longest < MAX_ARG_STRLEN:
            continue
        for i, arg in enumerate(role.args):
            _check_arg_size(role.name, f"args[{i}]", arg)
        for key, value in role.env.items():
            _check_arg_size(role.name, f"env[{key!r}]", f"{key}={value}")


def _check_arg_size(role: str, field_name: str, text: str) -> None:
    if 4 * len(text) < MAX_ARG_STRLEN:  # (at most 4 bytes a character: short enough)
        return
    size = len(text.encode("utf-8", "surrogateescape"))
    if size >= MAX_ARG_STRLEN:
        raise InvalidAppDefException(
            f"{field_name} is {size} bytes long, more than the {MAX_ARG_STRLEN - 1} bytes exec "
            "takes in one argument or environment entry (Argument list too long); pass that much "
            "data in a file",
            role=role,
            field_name=field_name,
        )


@functools.cache
def max_processes() -> int | None:
    """The most processes this host can ever hold at once (``kernel.pid_max``), None if unknown.

    Read once per process: every dry run checks against it, and it is a bound, not a measure."""
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def build_request(
    app: AppDef,
    cfg: Mapping[str, CfgVal],
    *,
    backend: str,
    session: str,
    log_root: Path,
    gpu_count: int | None,
    parent_path: str | None,
    app_id: str | None = None,
    workdirs: Mapping[str, str] | None = None,
) -> LocalRequest:
    """Builds the launch request of a validated app with a resolved cfg.

    Args:
        app: the app (already validated; not modified).
        cfg: the resolved cfg (``log_dir``, ``prepend_cwd``, ``auto_set_cuda_visible_devices``,
            ``cancel_grace_period``).
        backend: ``local_cwd`` or ``local_dir``.
        session: the submitting session.
        log_root: where app directories go when ``cfg["log_dir"]`` is not set.
        gpu_count: GPUs on this host (detected when None and needed).
        parent_path: the launcher's PATH, which the replicas' PATH extends.
        app_id: the app's id (a new unique one when None).
        workdirs: ``{role: directory}`` for roles that run from a workspace instead of their
            image (the directory may not exist yet: ``schedule`` makes it).

    Raises:
        InvalidAppDefException: more replicas than this host can hold processes; a mount that
            cannot be applied on the host (``check_host_mounts``); an argument longer than exec
            takes (``check_arg_sizes``).
    """
    limit = max_processes()
    if limit is not None:
        check_replica_count(
            app,
            backend,
            limit,
            f"each replica is a process and this host holds at most {limit} (kernel.pid_max)",
        )
    check_host_mounts(app, backend)
    check_arg_sizes(app)
    app_id = app_id or make_unique(app.name)
    app_dir = app_dir_of(cfg, session=session, log_root=log_root, app_id=app_id)
    handle = make_app_handle(backend, session, app_id)
    prepend_cwd = bool(cfg.get("prepend_cwd"))
    grace_period = check_grace_period(cfg.get("cancel_grace_period"), cfg)

    slices: dict[tuple[str, int], str] | None = None
    if cfg.get("auto_set_cuda_visible_devices") and any(r.resource.gpu > 0 for r in app.roles):
        count = detect_gpu_count() if gpu_count is None else gpu_count
        slices = cuda_slices(app, count)

    ctx = _Context(app_id, app_dir, handle, prepend_cwd, parent_path, slices)
    roles = []
    for role in app.roles:
        img_root = (workdirs or {}).get(role.name) or resolve_image(backend, role)
        replicas = [_replica_request(role, i, img_root, ctx) for i in range(role.num_replicas)]
        roles.append(
            RoleRequest(
                name=role.name,
                max_retries=role.max_retries,
                retry_policy=RetryPolicy(role.retry_policy),
                replicas=tuple(replicas),
            )
        )
    return LocalRequest(
        app_id=app_id,
        app_name=app.name,
        backend=backend,
        session=session,
        app_dir=app_dir,
        roles=tuple(roles),
        grace_period=grace_period,
    )
