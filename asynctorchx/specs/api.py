"""The application data model: pure data and pure functions, no I/O.

These are TorchX's concepts (``AppDef`` of ``Role`` s, ``Resource``, macros, ``AppState``,
``AppStatus``, ``runopts``, app handles) re-implemented with two differences that matter to async
callers: nothing here mutates an object it is given (``Values.apply`` returns a new role), and every
validation error names the role, the field and the offending value.

Exception tree::

    Exception
     ├── AppStatusError                       an app ended in a state other than SUCCEEDED
     ├── InvalidRunConfigException            a scheduler cfg does not satisfy its runopts
     │    └── RunConfigParseError (ValueError)  a cfg string does not parse (cfg_from_str)
     ├── MalformedAppHandleException (ValueError)
     ├── UnknownSchedulerException (ValueError)
     ├── UnknownAppException (LookupError)
     └── InvalidAppDefException (ValueError)  an AppDef/Role/Resource field holds a bad value
          └── MountOptionError (KeyError)       a mount option is unknown, misplaced or missing
"""

from __future__ import annotations

import copy
import functools
import json
import os
import posixpath
import random
import re
import string
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from enum import Enum, IntEnum
from typing import Any, Generic, NamedTuple, TypeVar

# Sentinels, as TorchX defines them: MISSING marks a required field that a builder must fill in,
# NONE an explicit "no value" where None would be ambiguous, ALL a wildcard (e.g. all replicas).
SchedulerBackend = str
MISSING: str = "<MISSING>"
NONE: str = "<NONE>"
ALL: str = "all"

T = TypeVar("T")


class InvalidAppDefException(ValueError):
    """Raised when a field of an ``AppDef``, ``Role``, ``Resource`` or mount holds a bad value.

    The message names the role (where there is one), the field and the value.
    """

    def __init__(self, message: str, *, role: str | None = None, field_name: str = "") -> None:
        prefix = f"role {role!r}: " if role else ""
        super().__init__(f"{prefix}{message}")
        self.role = role
        self.field_name = field_name


def _bad(
    field_name: str, value: object, expected: str, role: str | None = None
) -> InvalidAppDefException:
    return InvalidAppDefException(
        f"{field_name} must be {expected}, got {value!r}", role=role, field_name=field_name
    )


def _check_encodable(field_name: str, value: str, role: str) -> None:
    """Refuses a string that has no bytes to give ``exec`` (as a NUL byte is refused): one holding
    a lone surrogate (``"\\ud800"``), which ``os.fsencode`` cannot encode. The surrogate escapes
    of undecodable bytes (U+DC80-U+DCFF, as ``os.fsdecode`` makes them) encode back to their
    bytes, and pass.

    Raises:
        InvalidAppDefException: naming the role, the field and the value.
    """
    if not _encodable(value):
        raise _bad(
            field_name, value, "a string without lone surrogates (it cannot be encoded)", role
        )


def _encodable(value: str) -> bool:
    """False when ``value`` holds a lone surrogate (see ``_check_encodable``)."""
    try:
        value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Resources
# ---------------------------------------------------------------------------------------------


@dataclass
class Resource:
    """The resources one replica of a role asks for.

    Args:
        cpu: number of logical CPU cores.
        gpu: number of GPUs.
        memMB: memory in MiB.
        capabilities: scheduler-specific extras (e.g. an instance type).
        devices: named devices to mount with their counts (e.g. ``{"vpc.amazonaws.com/efa": 1}``).
    """

    cpu: int
    gpu: int
    memMB: int
    capabilities: dict[str, Any] = field(default_factory=dict)
    devices: dict[str, int] = field(default_factory=dict)

    @staticmethod
    def copy(original: Resource, **capabilities: Any) -> Resource:
        """Returns a deep copy of ``original`` with ``capabilities`` merged over its own."""
        res = copy.deepcopy(original)
        res.capabilities.update(capabilities)
        return res

    def validate(self, role: str | None = None) -> None:
        """Raises InvalidAppDefException naming the field when a value is out of range."""
        for name in ("cpu", "gpu", "memMB"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise _bad(f"resource.{name}", value, "a number", role)
            if not 0 <= value < float("inf"):  # (NaN too)
                raise _bad(f"resource.{name}", value, "a finite number >= 0", role)
        gpu: object = self.gpu  # (typed int, but a float is accepted: 2.0)
        if isinstance(gpu, float) and not gpu.is_integer():
            # GPUs are whole devices (TorchX types gpu as an int): a fraction has no meaning to any
            # backend, and rounding it (to 0 GPUs) would silently give the replica none, or all
            # of the host's. A float that is whole (2.0) means that many and passes.
            raise _bad("resource.gpu", self.gpu, "a whole number of GPUs", role)
        if not isinstance(self.capabilities, dict):
            raise _bad("resource.capabilities", self.capabilities, "a dict", role)
        if not isinstance(self.devices, dict):
            raise _bad("resource.devices", self.devices, "a dict of device name to count", role)
        for dev, count in self.devices.items():
            if not isinstance(count, int) or count < 0:
                raise _bad(f"resource.devices[{dev!r}]", count, "a non-negative int", role)


# A Resource that means "no resource requirement"; schedulers that need one reject it.
NULL_RESOURCE: Resource = Resource(cpu=-1, gpu=-1, memMB=-1)


# ---------------------------------------------------------------------------------------------
# Macros
# ---------------------------------------------------------------------------------------------


class macros:
    """Placeholders substituted at submit time into a role's ``args``, ``env`` values and ``metadata``.

    Use them as ``${name}`` inside strings, e.g. ``args=["--out", f"/tmp/{macros.app_id}"]``.
    """

    img_root = "${img_root}"
    base_img_root = "${base_img_root}"
    app_id = "${app_id}"
    replica_id = "${replica_id}"
    rank0_env = "${rank0_env}"

    @dataclass(frozen=True)
    class Values:
        """The values of the macros for one replica.

        Args:
            img_root: where the role's image is available to the replica (a directory locally).
            app_id: the scheduler-assigned app id.
            replica_id: the replica's index within its role (a string, as it lands in a shell).
            rank0_env: the name of the environment variable holding rank 0's host name.
            base_img_root: TorchX's deprecated macro; ``DEPRECATED`` unless given, as in TorchX.
        """

        img_root: str
        app_id: str
        replica_id: str
        rank0_env: str
        base_img_root: str = "DEPRECATED"

        def substitute(self, arg: str) -> str:
            """Returns ``arg`` with every known macro replaced; unknown ``${...}`` stay as they are."""
            return string.Template(arg).safe_substitute(asdict(self))

        def _substitute_any(self, value: Any) -> Any:
            if isinstance(value, str):
                return self.substitute(value)
            if isinstance(value, list):
                return [self._substitute_any(v) for v in value]
            if isinstance(value, dict):
                return {k: self._substitute_any(v) for k, v in value.items()}
            return value

        def apply(self, role: Role) -> Role:
            """Returns a copy of ``role`` with the macros substituted in args, env values and metadata.

            The entrypoint and the image are left as they are, and ``role`` itself is not changed.
            """
            new = copy.deepcopy(role)
            new.args = [self._substitute_any(a) for a in new.args]
            new.env = {k: self._substitute_any(v) for k, v in new.env.items()}
            new.metadata = self._substitute_any(new.metadata)
            return new


# ---------------------------------------------------------------------------------------------
# Roles, mounts, apps
# ---------------------------------------------------------------------------------------------


class RetryPolicy(str, Enum):
    """What restarts when a replica fails and the role has retries left.

    REPLICA restarts only the failed replica, ROLE restarts every replica of its role, APPLICATION
    restarts every replica of the app.
    """

    REPLICA = "REPLICA"
    APPLICATION = "APPLICATION"
    ROLE = "ROLE"


class MountType(str, Enum):
    """The kind of a mount."""

    BIND = "bind"
    VOLUME = "volume"
    DEVICE = "device"


@dataclass
class BindMount:
    """A host path mounted into the replica.

    Args:
        src_path: the path on the host.
        dst_path: the path inside the replica.
        read_only: mount read-only.
    """

    src_path: str
    dst_path: str
    read_only: bool = False


@dataclass
class VolumeMount:
    """A named persistent volume (Docker volume, Kubernetes PVC) mounted into the replica."""

    src: str
    dst_path: str
    read_only: bool = False


@dataclass
class DeviceMount:
    """A host device (e.g. ``/dev/fuse``) made available inside the replica.

    Args:
        src_path: the device on the host.
        dst_path: where it appears in the replica.
        permissions: cgroup permissions, a combination of ``r``, ``w`` and ``m``.
    """

    src_path: str
    dst_path: str
    permissions: str = "rwm"


Mount = BindMount | VolumeMount | DeviceMount


@dataclass
class Role:
    """A set of identical replicas that run the same entrypoint with the same args.

    Args:
        name: the role's name, unique within its app; used in log paths and replica names.
        image: what the replicas run from (a directory for local backends, a container image else).
        entrypoint: the command to run inside the image.
        args: the command's arguments; may contain macros.
        env: extra environment variables; values may contain macros.
        num_replicas: how many replicas to run.
        min_replicas: the fewest replicas an elastic job may run with (None: not elastic).
        max_retries: how many times the role may be restarted after a failure.
        retry_policy: what restarts when a replica fails.
        resource: what each replica asks for.
        port_map: named ports the replicas listen on.
        metadata: scheduler-specific extras; values may contain macros.
        mounts: mounts for every replica.
        base_image: an optional base image (TorchX's deprecated field, kept for compatibility).
    """

    name: str
    image: str
    entrypoint: str = MISSING
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    num_replicas: int = 1
    min_replicas: int | None = None
    max_retries: int = 0
    retry_policy: RetryPolicy = RetryPolicy.APPLICATION
    resource: Resource = field(default_factory=lambda: copy.deepcopy(NULL_RESOURCE))
    port_map: dict[str, int] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)
    base_image: str | None = None

    def pre_proc(
        self, scheduler: SchedulerBackend, dryrun_info: AppDryRunInfo[Any]
    ) -> AppDryRunInfo[Any]:
        """A hook for role subclasses to adjust a scheduler's request; returns it unchanged here."""
        return dryrun_info

    def validate(self) -> None:
        """Raises InvalidAppDefException naming this role, the field and the value when one is bad."""
        if not isinstance(self.name, str) or not _ROLE_NAME_RE.fullmatch(self.name):
            raise _bad(
                "role name",
                self.name,
                "1-63 letters, digits, '-', '_' or '.', starting with a letter or digit",
            )
        name = self.name
        # a NUL byte cannot pass through execve (nor a container's or a batch script's command
        # line), so every string that becomes part of a process's command or environment is checked
        if not isinstance(self.image, str) or "\0" in self.image:
            raise _bad("image", self.image, "a string without NUL bytes", name)
        _check_encodable("image", self.image, name)
        if (
            not isinstance(self.entrypoint, str)
            or not self.entrypoint
            or self.entrypoint == MISSING
            or "\0" in self.entrypoint
        ):
            raise _bad("entrypoint", self.entrypoint, "a non-empty command without NUL bytes", name)
        _check_encodable("entrypoint", self.entrypoint, name)
        if not isinstance(self.args, list) or not all(isinstance(a, str) for a in self.args):
            raise _bad("args", self.args, "a list of strings", name)
        for i, arg in enumerate(self.args):
            if "\0" in arg:
                raise _bad(f"args[{i}]", arg, "a string without NUL bytes", name)
            _check_encodable(f"args[{i}]", arg, name)
        if not isinstance(self.env, dict):
            raise _bad("env", self.env, "a dict of str to str", name)
        for key, value in self.env.items():
            if not isinstance(key, str) or not key or "=" in key or "\0" in key:
                raise _bad("env key", key, "a non-empty string without '=' or NUL", name)
            _check_encodable("env key", key, name)
            if not isinstance(value, str) or "\0" in value:
                raise _bad(f"env[{key!r}]", value, "a string without NUL bytes", name)
            _check_encodable(f"env[{key!r}]", value, name)
        if (
            isinstance(self.num_replicas, bool)
            or not isinstance(self.num_replicas, int)
            or self.num_replicas < 1
        ):
            raise _bad("num_replicas", self.num_replicas, "an int >= 1", name)
        if self.min_replicas is not None and (
            isinstance(self.min_replicas, bool)
            or not isinstance(self.min_replicas, int)
            or not 0 < self.min_replicas <= self.num_replicas
        ):
            raise _bad(
                "min_replicas",
                self.min_replicas,
                f"an int in [1, num_replicas={self.num_replicas}]",
                name,
            )
        if (
            isinstance(self.max_retries, bool)
            or not isinstance(self.max_retries, int)
            or self.max_retries < 0
        ):
            raise _bad("max_retries", self.max_retries, "an int >= 0", name)
        if not isinstance(self.retry_policy, RetryPolicy):
            try:
                RetryPolicy(self.retry_policy)
            except ValueError:
                raise _bad(
                    "retry_policy",
                    self.retry_policy,
                    f"one of {[p.value for p in RetryPolicy]}",
                    name,
                ) from None
        if not isinstance(self.resource, Resource):
            raise _bad("resource", self.resource, "a Resource", name)
        if self.resource is not NULL_RESOURCE and self.resource != NULL_RESOURCE:
            self.resource.validate(name)
        if not isinstance(self.port_map, dict):
            raise _bad("port_map", self.port_map, "a dict of name to port", name)
        if not isinstance(self.metadata, dict):
            raise _bad("metadata", self.metadata, "a dict", name)
        _check_metadata_depth(self.metadata, name)
        if not isinstance(self.mounts, list):
            raise _bad("mounts", self.mounts, "a list of mounts", name)
        for port_name, port in self.port_map.items():
            if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
                raise _bad(f"port_map[{port_name!r}]", port, "a port number in [0, 65535]", name)
        for i, mount in enumerate(self.mounts):
            if not isinstance(mount, (BindMount, VolumeMount, DeviceMount)):
                raise _bad(f"mounts[{i}]", mount, "a BindMount, VolumeMount or DeviceMount", name)
            src = mount.src if isinstance(mount, VolumeMount) else mount.src_path
            src_field = f"mounts[{i}].{'src' if isinstance(mount, VolumeMount) else 'src_path'}"
            if not isinstance(src, str) or not src or "\0" in src:
                raise _bad(src_field, src, "a non-empty string without NUL", name)
            _check_encodable(src_field, src, name)
            dst = mount.dst_path
            if not isinstance(dst, str) or not dst.startswith("/") or "\0" in dst:
                raise _bad(f"mounts[{i}].dst_path", dst, "an absolute path without NUL", name)
            _check_encodable(f"mounts[{i}].dst_path", dst, name)
            if isinstance(mount, DeviceMount) and (
                not isinstance(mount.permissions, str)
                or not mount.permissions
                or set(mount.permissions) - set("rwm")
            ):
                raise _bad(
                    f"mounts[{i}].permissions", mount.permissions, "a combination of r, w, m", name
                )


_ROLE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}")


@dataclass
class AppDef:
    """A distributed application: one or more roles that run together.

    Args:
        name: the app's name (used to derive the app id).
        roles: the roles, in order; rank 0 is replica 0 of the first role.
        metadata: scheduler-specific extras.
    """

    name: str
    roles: list[Role] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        """Raises InvalidAppDefException naming the role, field and value of the first bad field."""
        if not isinstance(self.name, str) or not self.name.strip():
            raise _bad("app name", self.name, "a non-empty string")
        if not isinstance(self.roles, (list, tuple)) or not self.roles:
            raise _bad("roles", self.roles, "a non-empty list of Role")
        if not isinstance(self.metadata, Mapping):
            raise _bad("metadata", self.metadata, "a dict")
        _check_metadata_depth(self.metadata)
        seen: set[str] = set()
        for i, role in enumerate(self.roles):
            if not isinstance(role, Role):
                raise _bad(f"roles[{i}]", role, "a Role")
            role.validate()
            if role.name in seen:
                raise _bad("name", role.name, "unique within the app", role.name)
            seen.add(role.name)


def copy_app(app: AppDef) -> AppDef:
    """A deep copy of ``app``: nothing in the copy is shared with ``app``.

    Same result as ``copy.deepcopy`` for plain ``AppDef``/``Role``/``Resource``/mount objects, at a
    fraction of its cost (every submit copies its app); subclasses and anything else are copied
    with ``copy.deepcopy``.
    """
    if type(app) is not AppDef:
        return copy.deepcopy(app)
    return AppDef(
        name=app.name,
        roles=[_copy_role(r) for r in app.roles],
        metadata=copy.deepcopy(app.metadata) if app.metadata else {},
    )


_PLAIN_MOUNTS = (BindMount, VolumeMount, DeviceMount)


def _copy_role(role: Role) -> Role:
    if type(role) is not Role or type(role.resource) is not Resource:
        return copy.deepcopy(role)
    res = role.resource
    return Role(
        name=role.name,
        image=role.image,
        entrypoint=role.entrypoint,
        args=list(role.args),
        env=dict(role.env),
        num_replicas=role.num_replicas,
        min_replicas=role.min_replicas,
        max_retries=role.max_retries,
        retry_policy=role.retry_policy,
        resource=Resource(
            cpu=res.cpu,
            gpu=res.gpu,
            memMB=res.memMB,
            capabilities=copy.deepcopy(res.capabilities) if res.capabilities else {},
            devices=dict(res.devices),
        ),
        port_map=dict(role.port_map),
        metadata=copy.deepcopy(role.metadata) if role.metadata else {},
        mounts=[
            copy.copy(m) if type(m) in _PLAIN_MOUNTS else copy.deepcopy(m) for m in role.mounts
        ],
        base_image=role.base_image,
    )


#: How deep the containers of an app's or a role's metadata may nest: every submit copies the
#: metadata and writes it as JSON, both recursively (5000 levels was a bare RecursionError).
MAX_METADATA_DEPTH = 100
#: The containers ``_check_metadata_depth`` looks into.
_CONTAINERS = (dict, list, tuple, set, frozenset)


def _check_metadata_depth(metadata: Mapping[str, Any], role: str | None = None) -> None:
    """Refuses metadata whose dicts, lists, tuples and sets nest more than ``MAX_METADATA_DEPTH``
    deep (a container that holds itself nests without end), walking it without recursion; a
    container held in many places is looked into once per depth it is met at.

    Raises:
        InvalidAppDefException: naming ``metadata`` (and the role, for a role's).
    """
    if not metadata:  # (the common case, on every dry run: nothing to walk)
        return
    seen: set[tuple[int, int]] = set()
    stack: list[tuple[Iterable[object], int]] = [(metadata.values(), 1)]
    while stack:
        items, depth = stack.pop()
        for value in items:
            if not isinstance(value, _CONTAINERS) or (id(value), depth) in seen:
                continue
            if depth >= MAX_METADATA_DEPTH:
                raise InvalidAppDefException(
                    f"metadata must nest at most {MAX_METADATA_DEPTH} levels deep (dicts and "
                    "lists within each other; one that holds itself nests without end), got more",
                    role=role,
                    field_name="metadata",
                )
            seen.add((id(value), depth))
            stack.append((value.values() if isinstance(value, dict) else value, depth + 1))


def validate_app(app: AppDef) -> None:
    """Validates ``app``; see ``AppDef.validate``."""
    if not isinstance(app, AppDef):
        raise _bad("app", app, "an AppDef")
    app.validate()


# ---------------------------------------------------------------------------------------------
# States and statuses
# ---------------------------------------------------------------------------------------------


class AppState(IntEnum):
    """The state of an app (and of a replica), with TorchX's names and int values."""

    UNSUBMITTED = 0
    SUBMITTED = 1
    PENDING = 2
    RUNNING = 3
    SUCCEEDED = 4
    FAILED = 5
    CANCELLED = 6
    UNKNOWN = 7

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"{self.name} ({self.value})"

    def __format__(self, format_spec: str) -> str:
        return format(self.name, format_spec)


ReplicaState = AppState

_TERMINAL_STATES = frozenset({AppState.SUCCEEDED, AppState.FAILED, AppState.CANCELLED})
_STARTED_STATES = frozenset({AppState.RUNNING, *_TERMINAL_STATES})


def is_terminal(state: AppState) -> bool:
    """True for SUCCEEDED, FAILED and CANCELLED: the app will not change state again."""
    return state in _TERMINAL_STATES


def is_started(state: AppState) -> bool:
    """True once the app has started running (RUNNING or terminal)."""
    return state in _STARTED_STATES


def _as_state(state: Any) -> Any:
    """A state given as a plain int (or another int enum, TorchX's AppState) as its AppState, as
    TorchX's statuses take one; anything else (an int that is no state) as it is."""
    if isinstance(state, int) and not isinstance(state, (AppState, bool)):
        try:
            return AppState(int(state))
        except ValueError:
            return state
    return state


def _state_name(state: object) -> str:
    """The name of a state, or its text when it is not an AppState."""
    return state.name if isinstance(state, AppState) else str(state)


@dataclass
class ReplicaStatus:
    """The status of one replica.

    Args:
        id: the replica's index within its role.
        state: the replica's state.
        role: the role's name.
        hostname: where it runs (``localhost`` for local backends).
        structured_error_msg: a JSON error written by the replica (torchelastic's error file), or NONE.
        exit_code: the last exit code, when known.
        pid: the process id (local backends), when known.
    """

    id: int
    state: AppState
    role: str
    hostname: str
    structured_error_msg: str = NONE
    exit_code: int | None = None
    pid: int | None = None

    def __post_init__(self) -> None:
        self.state = _as_state(self.state)


@dataclass
class RoleStatus:
    """The statuses of one role's replicas."""

    role: str
    replicas: list[ReplicaStatus]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of this role status."""
        return {"role": self.role, "replicas": [_replica_json(r) for r in self.replicas]}


def _replica_json(r: ReplicaStatus) -> dict[str, Any]:
    out = asdict(r)
    out["state"] = _state_name(r.state)
    return out


class _StructuredError(NamedTuple):
    message: str
    timestamp: str
    error_code: str

    def format_lines(self, indent: str) -> list[str]:
        details = [f"at {self.timestamp}"] if self.timestamp else []
        if self.error_code:
            details.append(f"error code {self.error_code}")
        head = f"{indent}Error{' (' + ', '.join(details) + ')' if details else ''}:"
        return [head, *(f"{indent}  {ln}" for ln in self.message.splitlines())]


def _parse_structured_error(raw: str) -> _StructuredError | None:
    """Reads a torchelastic error file's JSON; text that is not such JSON is kept as the message.

    The shape is ``{"message": {"message": ..., "errorCode": ..., "extraInfo": {"py_callstack":
    ..., "timestamp": ...}}}``; ``message`` may also be a plain string.
    """
    if not raw or raw == NONE:
        return None
    try:
        return _read_structured_error(raw)
    except RecursionError:  # JSON nested too deep to read (a replica writes its own error file)
        return _StructuredError(raw, "", "")


def _read_structured_error(raw: str) -> _StructuredError:
    try:
        err = json.loads(raw)
    except ValueError:
        return _StructuredError(raw, "", "")
    if not isinstance(err, dict) or "message" not in err:
        return _StructuredError(raw, "", "")
    body = err["message"]
    code: Any = err.get("errorCode")
    if isinstance(body, dict):
        extra = body.get("extraInfo")
        extra = extra if isinstance(extra, dict) else {}
        ts: Any = extra.get("timestamp", "")
        text = str(body.get("message", ""))
        trace = extra.get("py_callstack")
        if trace and str(trace).strip() not in text:
            text = f"{text}\n{trace}".strip("\n")
        code = body.get("errorCode", code)
    else:
        text, ts = str(body), err.get("timestamp", "")
    if ts not in ("", None):
        try:
            ts = datetime.fromtimestamp(int(ts)).isoformat(sep=" ")
        except (TypeError, ValueError, OverflowError, OSError):
            pass
    return _StructuredError(text, str(ts or ""), "" if code in (None, "") else str(code))


class AppStatusError(Exception):
    """Raised by ``AppStatus.raise_for_status`` when the app did not succeed."""

    def __init__(self, app_status: AppStatus, *args: object) -> None:
        reason = (
            " ".join(str(a) for a in args) or f"app ended in state {_state_name(app_status.state)}"
        )
        super().__init__(f"{reason}\n{app_status.format()}")
        self.app_status = app_status

    @property
    def status(self) -> AppStatus:
        """The status that raised (TorchX's name for ``app_status``)."""
        return self.app_status


@dataclass
class AppStatus:
    """The status of an app as a scheduler reports it.

    Args:
        state: the app's state.
        num_restarts: how many times the app (or a part of it) was restarted.
        msg: a human-readable message from the scheduler.
        structured_error_msg: a JSON error (torchelastic error-file format) or NONE.
        ui_url: where to look at the app in a UI, if any.
        roles: per-role replica statuses.
    """

    state: AppState
    num_restarts: int = 0
    msg: str = ""
    structured_error_msg: str = NONE
    ui_url: str | None = None
    roles: list[RoleStatus] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.state = _as_state(self.state)

    def is_terminal(self) -> bool:
        """True when the app has finished (SUCCEEDED, FAILED or CANCELLED)."""
        return is_terminal(self.state)

    def raise_for_status(self) -> None:
        """Raises AppStatusError unless the app SUCCEEDED."""
        if self.state != AppState.SUCCEEDED:
            raise AppStatusError(
                self, f"app ended in state {_state_name(self.state)}, not SUCCEEDED"
            )

    def _error_summary(self) -> tuple[str, str]:
        """(message, timestamp) from the structured error, or ('', '') when there is none."""
        err = _parse_structured_error(self.structured_error_msg)
        return (err.message, err.timestamp) if err else ("", "")

    def format(self, filter_roles: Iterable[str] | None = None) -> str:
        """A multi-line, human-readable summary of the status.

        Structured errors (torchelastic's error-file JSON, on the app or on a replica) are shown as
        their message, call stack, error code and time rather than as raw JSON.

        Args:
            filter_roles: only show these roles (all when None).
        """
        wanted = set(filter_roles) if filter_roles is not None else None
        lines = [
            "AppStatus:",
            f"  State: {_state_name(self.state)}",
            f"  Num Restarts: {self.num_restarts}",
        ]
        roles = [r for r in self.roles if wanted is None or r.role in wanted]
        if roles:
            lines.append("  Roles:")
            for role in roles:
                for rep in sorted(role.replicas, key=lambda r: r.id):
                    code = f" (exit code: {rep.exit_code})" if rep.exit_code is not None else ""
                    lines.append(
                        f"    {role.role}[{rep.id}] {_state_name(rep.state)}{code} on {rep.hostname}"
                    )
                    err = _parse_structured_error(rep.structured_error_msg)
                    if err:
                        lines.extend(err.format_lines("      "))
        if self.msg:
            lines.append(f"  Msg: {self.msg}")
        err = _parse_structured_error(self.structured_error_msg)
        if err:
            lines.extend(err.format_lines("  "))
        if self.ui_url:
            lines.append(f"  UI URL: {self.ui_url}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of this status (states as names)."""
        return {
            "state": _state_name(self.state),
            "num_restarts": self.num_restarts,
            "msg": self.msg,
            "structured_error_msg": self.structured_error_msg,
            "ui_url": self.ui_url,
            "roles": [r.to_json() for r in self.roles],
        }

    def __repr__(self) -> str:
        replicas = sum(len(r.replicas) for r in self.roles)
        extra = f", msg={self.msg!r}" if self.msg else ""
        return (
            f"AppStatus(state={_state_name(self.state)}, num_restarts={self.num_restarts}, "
            f"roles={len(self.roles)}, replicas={replicas}{extra})"
        )


# ---------------------------------------------------------------------------------------------
# Dry runs and run options
# ---------------------------------------------------------------------------------------------

CfgVal = str | int | float | bool | list[str] | dict[str, str] | None


class AppDryRunInfo(Generic[T]):
    """What a scheduler would submit for an app, without submitting it.

    Args:
        request: the scheduler-specific request (a batch script, container configs, manifests...).
        fmt: turns the request into a human-readable string (``repr`` of this object uses it).
    """

    def __init__(self, request: T, fmt: Callable[[T], str]) -> None:
        self.request = request
        self._fmt = fmt
        self._app: AppDef | None = None
        self._cfg: Mapping[str, CfgVal] = {}
        self._scheduler: SchedulerBackend | None = None
        self._session: str | None = None
        self._workspace: Any = None

    @property
    def app(self) -> AppDef | None:
        """The app this dry run was made from."""
        return self._app

    @property
    def cfg(self) -> Mapping[str, CfgVal]:
        """The resolved scheduler cfg this dry run was made with (empty until a scheduler sets it)."""
        return self._cfg

    @property
    def scheduler(self) -> SchedulerBackend | None:
        """The name of the scheduler that made this dry run."""
        return self._scheduler

    @property
    def session(self) -> str | None:
        """The session of the scheduler that made this dry run (its apps are that session's)."""
        return self._session

    @property
    def workspace(self) -> Any:
        """The workspace plan (``asynctorchx.schedulers.workspace.WorkspacePlan``) of a dry run
        made with a workspace: what ``schedule`` builds, pushes or copies first; else None."""
        return self._workspace

    def __repr__(self) -> str:
        text = self._fmt(self.request)
        if self._workspace is not None:
            text = f"{self._workspace}\n\n{text}"
        return text

    __str__ = __repr__


class InvalidRunConfigException(Exception):
    """Raised when a scheduler cfg does not satisfy its runopts (a required key, a wrong type)."""

    def __init__(self, invalid_reason: str, cfg_key: str, cfg: Mapping[str, CfgVal] | str) -> None:
        given: object = repr(cfg) if isinstance(cfg, str) else dict(cfg) if cfg else "<EMPTY>"
        super().__init__(f"{invalid_reason}. Given: {given}")
        self.cfg_key = cfg_key


class RunConfigParseError(InvalidRunConfigException, ValueError):
    """Raised by ``runopts.cfg_from_str`` when a cfg string does not parse: it is not ``key=value``
    pairs, or a value cannot be cast to its option's type (a ValueError, as TorchX raises there)."""


def get_type_name(tp: Any) -> str:
    """The name of a run option type as TorchX writes it: ``__name__`` for a class (``int``),
    ``str(tp)`` for a ``typing`` generic (``typing.List[str]``).

    Args:
        tp: a type, e.g. ``int`` or ``List[str]``.
    """
    if getattr(tp, "__module__", None) != "typing" and hasattr(tp, "__name__"):
        return str(tp.__name__)
    return str(tp)


def _type_name(tp: Any) -> str:
    if _is_list_str(tp):
        return "List[str]"
    if _is_dict_str(tp):
        return "Dict[str, str]"
    return getattr(tp, "__name__", str(tp))


def _is_list_str(tp: Any) -> bool:
    return tp == list[str] or str(tp) in ("typing.List[str]", "list[str]")


def _is_dict_str(tp: Any) -> bool:
    return tp == dict[str, str] or str(tp) in ("typing.Dict[str, str]", "dict[str, str]")


@dataclass(frozen=True)
class runopt:
    """One run option of a scheduler: its default, type, whether it is required, and help."""

    default: CfgVal
    opt_type: Any
    is_required: bool
    help: str


def _holds_nul(value: CfgVal) -> bool:
    """True when ``value`` (a string, or a list or dict of them) holds a NUL character."""
    if isinstance(value, str):
        return "\0" in value
    if isinstance(value, list):
        return any(isinstance(v, str) and "\0" in v for v in value)
    if isinstance(value, dict):
        return any("\0" in f"{k}{v}" for k, v in value.items())
    return False


def _holds_unencodable(value: CfgVal) -> bool:
    """True when ``value`` (a string, or a list or dict of them) holds a string that cannot be
    encoded (a lone surrogate: ``_encodable``)."""
    if isinstance(value, str):
        return not _encodable(value)
    if isinstance(value, list):
        return any(isinstance(v, str) and not _encodable(v) for v in value)
    if isinstance(value, dict):
        return any(not _encodable(f"{k}{v}") for k, v in value.items())
    return False


class runopts:
    """The run options a scheduler accepts, with typed parsing from strings and resolution of defaults."""

    def __init__(self) -> None:
        self._opts: dict[str, runopt] = {}

    def __iter__(self) -> Iterator[tuple[str, runopt]]:
        return iter(self._opts.items())

    def __len__(self) -> int:
        return len(self._opts)

    def __contains__(self, key: object) -> bool:
        return key in self._opts

    @staticmethod
    def is_type(obj: CfgVal, tp: Any) -> bool:
        """True when ``obj`` is of the run option type ``tp`` (List[str] and Dict[str, str] checked deeply)."""
        if _is_list_str(tp):
            return isinstance(obj, list) and all(isinstance(x, str) for x in obj)
        if _is_dict_str(tp):
            return isinstance(obj, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in obj.items()
            )
        if tp is float:
            return isinstance(obj, (int, float)) and not isinstance(obj, bool)
        if tp is int:
            return isinstance(obj, int) and not isinstance(obj, bool)
        try:
            return isinstance(obj, tp)
        except TypeError:
            return False

    def get(self, name: str) -> runopt | None:
        """The run option named ``name``, or None."""
        return self._opts.get(name)

    def add(
        self,
        cfg_key: str,
        type_: Any,
        help: str,
        default: CfgVal = None,
        required: bool = False,
    ) -> None:
        """Declares a run option.

        Raises:
            ValueError: a required option has a default.
            TypeError: the default is not of ``type_``.
        """
        if required and default is not None:
            raise ValueError(
                f"required run option {cfg_key!r} must not have a default, got {default!r}"
            )
        if default is not None and not runopts.is_type(default, type_):
            raise TypeError(
                f"run option {cfg_key!r} must be of type {_type_name(type_)}, "
                f"got default {default!r} ({type(default).__name__})"
            )
        self._opts[cfg_key] = runopt(default, type_, required, help)

    def update(self, other: runopts) -> None:
        """Adds (or replaces) the options of ``other``."""
        self._opts.update(other._opts)

    def resolve(self, cfg: Mapping[str, CfgVal]) -> dict[str, CfgVal]:
        """Checks ``cfg`` against these options and fills in defaults.

        Keys that are not options here are kept as they are (another layer may know them).

        Raises:
            InvalidRunConfigException: a required option is missing, a value has the wrong type, or
                a string in it holds a NUL character or a lone surrogate.
        """
        resolved: dict[str, CfgVal] = dict(cfg)
        for key, opt in self._opts.items():
            val = resolved.get(key)
            if val is None:
                if opt.is_required:
                    raise InvalidRunConfigException(
                        f"Required run option {key!r} ({_type_name(opt.opt_type)}: {opt.help}) is missing",
                        key,
                        cfg,
                    )
                resolved[key] = opt.default
            elif not runopts.is_type(val, opt.opt_type):
                raise InvalidRunConfigException(
                    f"Run option {key!r} must be of type {_type_name(opt.opt_type)}, "
                    f"got {val!r} ({type(val).__name__})",
                    key,
                    cfg,
                )
            elif _holds_nul(val):
                # a path, a command-line argument or an environment value: none can hold one
                raise InvalidRunConfigException(
                    f"Run option {key!r} must not contain a NUL character, got {val!r}", key, cfg
                )
            elif _holds_unencodable(val):
                # as an AppDef's strings are (_check_encodable): a path or an argument with a lone
                # surrogate has no bytes, and would fail at the launch (os.makedirs's bare
                # UnicodeEncodeError) rather than here, naming the option
                raise InvalidRunConfigException(
                    f"Run option {key!r} must not contain a lone surrogate (it cannot be "
                    f"encoded), got {val!r}",
                    key,
                    cfg,
                )
        return resolved

    def cfg_from_str(self, cfg_str: str) -> dict[str, CfgVal]:
        """Parses ``"k1=v1,k2=v2"`` into a typed cfg; unknown keys are dropped.

        Pairs are delimited by ``,`` or ``;``; a List[str] value may itself contain ``,``/``;``
        (the last delimiter before the next ``key=`` separates pairs), and a Dict[str, str] value is
        ``k:v`` pairs. Defaults and required options are not checked: call ``resolve`` for that.

        Raises:
            RunConfigParseError: (an InvalidRunConfigException and a ValueError) the string is
                not ``key=value`` pairs, or a value cannot be cast to its option's type.
        """
        out: dict[str, CfgVal] = {}
        for key, raw in _split_cfg(cfg_str).items():
            opt = self.get(key)
            if opt is None:
                continue
            out[key] = _cast(key, raw, opt.opt_type, cfg_str)
        return out

    def unknown_keys(self, cfg_str: str) -> list[str]:
        """The keys of ``"k1=v1,k2=v2"`` that are not options here, in order (``cfg_from_str``
        drops them).

        Raises:
            RunConfigParseError: the string is not ``key=value`` pairs.
        """
        return [key for key in _split_cfg(cfg_str) if key not in self._opts]

    def cfg_from_json_repr(self, json_repr: str) -> dict[str, CfgVal]:
        """Parses a JSON object into a cfg, keeping only known keys (lists and dicts as they are)."""
        data = json.loads(json_repr)
        return {k: v for k, v in data.items() if k in self._opts}

    def __repr__(self) -> str:
        required = [(k, o) for k, o in self._opts.items() if o.is_required]
        optional = [(k, o) for k, o in self._opts.items() if not o.is_required]
        usage = ",".join(
            f"{k}={k.upper()}" if o.is_required else f"[{k}={k.upper()}]"
            for k, o in required + optional
        )
        out = [f"    usage:\n        {usage}"]
        for title, opts in (("required", required), ("optional", optional)):
            if not opts:
                continue
            out.append(f"\n    {title} arguments:")
            for k, o in opts:
                default = "" if o.is_required else f", {o.default}"
                out.append(f"        {k}={k.upper()} ({_type_name(o.opt_type)}{default})")
                out.append(f"            {o.help}")
        return "\n".join(out)


_CFG_KEY = re.compile(r"(?:^|[,;])\s*([A-Za-z_][\w.\-]*)\s*=")


def _split_cfg(cfg_str: str) -> dict[str, str]:
    """Splits ``"a=1,b=x;y,c=2"`` into ``{"a": "1", "b": "x;y", "c": "2"}``.

    A trailing ``,`` or ``;`` ends the last pair and is not part of its value.
    """
    cfg_str = cfg_str.strip()
    if cfg_str[-1:] in (",", ";"):
        cfg_str = cfg_str[:-1].rstrip()
    if not cfg_str:
        return {}
    matches = list(_CFG_KEY.finditer(cfg_str))
    if not matches or matches[0].start() != 0:
        head = cfg_str[: matches[0].start()] if matches else cfg_str
        raise RunConfigParseError(
            f"cannot parse cfg string {cfg_str!r}: {head.strip(',; ')!r} is not 'key=value' "
            "(pairs are delimited by ',' or ';')",
            "",
            cfg_str,
        )
    out: dict[str, str] = {}
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(cfg_str)
        out[m.group(1)] = cfg_str[m.end() : end].strip()
    return out


def _cast(key: str, raw: str, tp: Any, cfg_str: str) -> CfgVal:
    try:
        if tp is bool:
            low = raw.strip().lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off", ""):
                return False
            raise ValueError(raw)
        if _is_list_str(tp):
            return [v for v in raw.replace(";", ",").split(",") if v]
        if _is_dict_str(tp):
            result: dict[str, str] = {}
            for item in raw.replace(";", ",").split(","):
                if not item:
                    continue
                k, sep, v = item.partition(":")
                if not sep:
                    raise ValueError(item)
                result[k] = v
            return result
        return tp(raw)  # type: ignore[no-any-return]
    except (TypeError, ValueError):
        raise RunConfigParseError(
            f"Run option {key!r} must be of type {_type_name(tp)}, got {raw!r}", key, {key: raw}
        ) from None


# ---------------------------------------------------------------------------------------------
# App handles and ids
# ---------------------------------------------------------------------------------------------

AppHandle = str


class MalformedAppHandleException(ValueError):
    """Raised when a string is not an app handle ``{scheduler}://{session}/{app_id}``."""

    def __init__(self, app_handle: str, reason: str = "") -> None:
        super().__init__(
            f"{app_handle!r} is not an app handle of the form "
            "'<scheduler_backend>://<session_name>/<app_id>' (the session may be empty)"
            + (f": {reason}" if reason else "")
        )
        self.app_handle = app_handle


class UnknownSchedulerException(ValueError):
    """Raised when a scheduler backend name is not registered."""

    def __init__(self, scheduler_backend: str, available: Iterable[str] = ()) -> None:
        names = sorted(available)
        hint = f"; available: {', '.join(names)}" if names else ""
        super().__init__(f"unknown scheduler {scheduler_backend!r}{hint}")
        self.scheduler_backend = scheduler_backend


class UnknownAppException(LookupError):
    """Raised when an app does not exist, or its handle names another session than the runner's
    (an app id names one app whatever the session: local records are read by any process)."""

    def __init__(self, app_handle: AppHandle, reason: str = "") -> None:
        super().__init__(
            f"unknown app {app_handle!r}"
            + (
                f": {reason}"
                if reason
                else " (it may never have existed or been purged by the scheduler)"
            )
        )
        self.app_handle = app_handle


class ParsedAppHandle(NamedTuple):
    """The parts of an app handle."""

    scheduler_backend: str
    session_name: str
    app_id: str


_HANDLE_RE = re.compile(r"(?P<backend>[^:/\s]+)://(?P<session>[^/\s]*)/(?P<app_id>[^\s]+)")


def is_session_name(name: object) -> bool:
    """Whether ``name`` can name a runner's session: a string without '/', ':', whitespace or NUL,
    and not '.' or '..' (the local backends' state root has a directory of that name)."""
    return (
        isinstance(name, str)
        and "/" not in name
        and ":" not in name
        and "\0" not in name
        and name not in (".", "..")
        and not any(c.isspace() for c in name)
    )


def parse_app_handle(app_handle: AppHandle) -> ParsedAppHandle:
    """Splits ``{scheduler}://{session}/{app_id}`` into its parts.

    Raises:
        MalformedAppHandleException: the string is not of that form.
    """
    if not isinstance(app_handle, str):
        raise MalformedAppHandleException(repr(app_handle))
    m = _HANDLE_RE.fullmatch(app_handle)
    if not m:
        raise MalformedAppHandleException(app_handle)
    return ParsedAppHandle(m["backend"], m["session"], m["app_id"])


def make_app_handle(scheduler_backend: str, session_name: str, app_id: str) -> AppHandle:
    """Builds the app handle ``{scheduler}://{session}/{app_id}``; ``parse_app_handle`` inverts it.

    Raises:
        MalformedAppHandleException: a part cannot be read back from a handle (the backend has
            ``:`` or ``/``, the session has ``/``, a part has whitespace, or a required part is empty).
    """
    handle = f"{scheduler_backend}://{session_name}/{app_id}"
    parts = (
        ("scheduler_backend", scheduler_backend, r"[^:/\s]+"),
        ("session_name", session_name, r"[^/\s]*"),
        ("app_id", app_id, r"\S+"),
    )
    for name, value, pattern in parts:
        if not isinstance(value, str) or not re.fullmatch(pattern, value):
            raise MalformedAppHandleException(handle, f"{name}={value!r} is not allowed there")
    return handle


def make_unique(name: str, string_length: int = 8, max_length: int = 40) -> str:
    """A fresh, unique app id derived from ``name``, safe as a Docker name and a Kubernetes DNS label.

    The result is lowercase ``[a-z0-9-]``, starts with a letter, and is at most ``max_length``
    characters: a sanitised prefix of ``name``, a dash, and ``string_length`` random characters
    (from a generator seeded from the OS once per process, and again in a forked child: ids need
    to differ, not to be secret, and a draw from the OS is a system call on every launch).
    """
    if string_length < 1:
        string_length = 8
    if max_length < string_length + 2:
        raise ValueError(
            f"max_length must be at least string_length + 2 = {string_length + 2}, got {max_length}"
        )
    number = _ids.randrange(36**string_length)  # one draw: 8 `choice` calls cost 8 times more
    digits = []
    for _ in range(string_length):
        number, digit = divmod(number, 36)
        digits.append(_ID_ALPHABET[digit])
    return f"{_id_prefix(name, max_length - string_length - 1)}-{''.join(digits)}"


_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
_ids = random.Random()  # seeded from os.urandom


def _reseed_ids() -> None:
    _ids.seed()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reseed_ids)


@functools.lru_cache(maxsize=256)
def _id_prefix(name: str, room: int) -> str:
    """``name`` made ``[a-z0-9-]``, starting with a letter, at most ``room`` characters."""
    prefix = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    prefix = re.sub(r"-{2,}", "-", prefix)
    if not prefix or not prefix[0].isalpha():
        prefix = f"app-{prefix}" if prefix else "app"
    return prefix[:room].rstrip("-")


#: The most processes a Linux host can ever run (the kernel's PID_MAX_LIMIT on 64-bit): a bound
#: on the replicas of a backend that runs each as at least one process of one host.
LINUX_PID_MAX_LIMIT = 4 * 1024 * 1024


def check_replica_count(app: AppDef, backend: str, limit: int, why: str) -> None:
    """Raises InvalidAppDefException when ``app`` has more replicas in all than ``limit``, the most
    ``backend`` can ever run (``why`` says why).

    A count a backend can never run (a typo, ``-j 1000000000x1``) is refused before a request is
    built for every replica, which would exhaust the memory first.
    """
    total = sum(r.num_replicas for r in app.roles)
    if total <= limit:
        return
    role = max(app.roles, key=lambda r: r.num_replicas)
    raise InvalidAppDefException(
        f"num_replicas {role.num_replicas} is more than {backend} can run: {why}"
        + (f"; the app has {total} replicas in all" if total != role.num_replicas else ""),
        role=role.name,
        field_name="num_replicas",
    )


# ---------------------------------------------------------------------------------------------
# Mount parsing (the CLI syntax)
# ---------------------------------------------------------------------------------------------


def check_host_mounts(app: AppDef, backend: str) -> None:
    """Raises InvalidAppDefException for a mount a backend whose replicas run on the host's own
    file system (``local_cwd``, ``local_dir``, ``slurm``) cannot apply: every mount but a bind mount
    of a path onto itself (which holds as it is). Such a backend would otherwise accept the mount and
    do nothing with it."""
    for role in app.roles:
        for i, mount in enumerate(role.mounts):
            if (
                isinstance(mount, BindMount)
                and not mount.read_only
                and posixpath.normpath(mount.src_path) == posixpath.normpath(mount.dst_path)
            ):
                continue
            raise InvalidAppDefException(
                f"mounts[{i}] ({mount!r}) cannot be applied by {backend}: its replicas run on the "
                "host's own file system, where only a writable bind mount of a path onto itself "
                "holds; use the path as it is, or a container backend (local_docker, kubernetes)",
                role=role.name,
                field_name=f"mounts[{i}]",
            )


class MountOptionError(InvalidAppDefException, KeyError):
    """Raised by ``parse_mounts`` when a mount option is unknown, comes before its ``type=``, or a
    required one (``src``, ``dst``) is missing or empty.

    An InvalidAppDefException, and a KeyError as TorchX's ``parse_mounts`` raises there.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _bad_mount(field_name: str, value: object, expected: str) -> MountOptionError:
    return MountOptionError(
        f"{field_name} must be {expected}, got {value!r}", field_name=field_name
    )


_MOUNT_ALIASES = {
    "source": "src",
    "target": "dst",
    "destination": "dst",
    "read_only": "readonly",
    "permissions": "perm",
}
_MOUNT_KEYS = ("type", "src", "dst", "readonly", "perm", *_MOUNT_ALIASES)
# a comma followed by a mount option's name (then '=', ',' or the end) starts the next option ...
_AT_MOUNT_KEY = re.compile(rf",(?=\s*(?:{'|'.join(_MOUNT_KEYS)})\s*(?:=|,|$))", re.IGNORECASE)
# ... and, in an element holding several options, so does one followed by any name (a typo)
_AT_ANY_KEY = re.compile(r",(?=\s*[A-Za-z_][\w-]*\s*(?:=|,|$))")
_COMMA_HINT = "; a value holding a ',' is passed as a list element of its own ('src=/a,b')"


def _mount_items(opt: str) -> list[str]:
    """The ``key[=value]`` items of one element of ``parse_mounts``'s list."""
    parts = _AT_MOUNT_KEY.split(opt)
    if len(parts) > 1:
        parts = [p for part in parts for p in _AT_ANY_KEY.split(part)]
    return [item for item in (p.strip(", \t") for p in parts) if item]


def parse_mounts(opts: list[str]) -> list[Mount]:
    """Parses mounts written the way ``docker run --mount`` takes them.

    Each mount is a run of ``key=value`` items starting with ``type=bind|volume|device``; items may be
    given as separate list elements or comma-joined. Keys: ``src``/``source``, ``dst``/``target``/
    ``destination``, ``readonly``/``read_only`` (flag, or ``=true``/``false``), ``perm``/
    ``permissions`` (device). A ``~`` at the start of a bind mount's src is the home directory.

    A value may hold a comma where the comma is not followed by an option's name: an element that
    holds a single option (``"src=/data/a,b"``, TorchX's form) is kept whole.

    Example: ``["type=bind,src=/data,dst=/data,readonly", "type=device,src=/dev/fuse"]``.

    Raises:
        MountOptionError: (an InvalidAppDefException and a KeyError) an unknown option, one before
            its ``type=``, or a missing or empty ``src``/``dst``, naming the value.
        InvalidAppDefException: an unknown type, a bad ``readonly`` or ``perm`` value.
    """
    groups: list[dict[str, str]] = []
    joined: list[bool] = []  # whether the group has an element of several options (for the hint)
    for opt in opts:
        items = _mount_items(opt)
        for item in items:
            key, sep, value = item.partition("=")
            key = key.strip().lower()
            key = _MOUNT_ALIASES.get(key, key)
            if key == "type":
                groups.append({"type": value.strip()})
                joined.append(len(items) > 1)
                continue
            if not groups:
                raise MountOptionError(
                    f"mount option {item!r} comes before a 'type=bind|volume|device'",
                    field_name="mounts",
                )
            groups[-1][key] = value.strip() if sep else "true"
            joined[-1] = joined[-1] or len(items) > 1

    mounts: list[Mount] = []
    for group, was_joined in zip(groups, joined, strict=True):
        opts_ = dict(group)
        kind = opts_.pop("type")
        readonly_raw = opts_.pop("readonly", "false").lower()
        if readonly_raw not in ("true", "false", "1", "0"):
            raise _bad("mount readonly", readonly_raw, "true or false")
        read_only = readonly_raw in ("true", "1")
        try:
            mtype = MountType(kind)
        except ValueError:
            raise _bad("mount type", kind, "one of bind, volume, device") from None
        allowed = {"src", "dst"} | ({"perm"} if mtype == MountType.DEVICE else set())
        unknown = set(opts_) - allowed
        if unknown:
            err = _bad_mount(
                f"{kind} mount option",
                sorted(unknown)[0],
                f"one of {sorted(allowed | {'readonly'})}",
            )
            if was_joined:
                err.args = (f"{err.args[0]}{_COMMA_HINT}",)
            raise err
        src = opts_.get("src")
        if not src:
            raise _bad_mount(f"{kind} mount src", src, "set (src=...)")
        if mtype == MountType.BIND:
            dst = opts_.get("dst")
            if not dst:
                raise _bad_mount("bind mount dst", dst, "set (dst=...)")
            if src.startswith("~"):
                src = os.path.expanduser(src)
            mounts.append(BindMount(src_path=src, dst_path=dst, read_only=read_only))
        elif mtype == MountType.VOLUME:
            dst = opts_.get("dst")
            if not dst:
                raise _bad_mount("volume mount dst", dst, "set (dst=...)")
            mounts.append(VolumeMount(src=src, dst_path=dst, read_only=read_only))
        else:
            perm = opts_.get("perm", "rwm")
            if not perm or set(perm) - set("rwm"):
                raise _bad("device mount perm", perm, "a combination of r, w, m")
            mounts.append(
                DeviceMount(src_path=src, dst_path=opts_.get("dst") or src, permissions=perm)
            )
    return mounts


def replace_role(role: Role, **changes: Any) -> Role:
    """A copy of ``role`` with ``changes`` applied (the original is left alone)."""
    return replace(copy.deepcopy(role), **changes)
