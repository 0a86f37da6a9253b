"""AppDef -> Docker requests: one container per replica, plus the app's network. Pure, no I/O.

Each container request is the JSON body of ``POST /containers/create`` (Docker Engine API 1.41), so a
dry run shows exactly what ``schedule`` sends. The labels carry everything the backend needs to
describe, retry, cancel and clean up the app later from any process: app id, session, role, replica,
attempt, the app's shape, retry settings and the library version.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from asynctorchx.specs.api import (
    AppDef,
    BindMount,
    CfgVal,
    DeviceMount,
    InvalidAppDefException,
    Resource,
    RetryPolicy,
    Role,
    VolumeMount,
    macros,
    runopts,
)
from asynctorchx.version import __version__

LABEL_PREFIX = "asynctorchx.io/"
LABEL_APP_ID = LABEL_PREFIX + "app-id"
LABEL_APP_NAME = LABEL_PREFIX + "app-name"
LABEL_SESSION = LABEL_PREFIX + "session"
LABEL_ROLE_NAME = LABEL_PREFIX + "role-name"
LABEL_REPLICA_ID = LABEL_PREFIX + "replica-id"
LABEL_ATTEMPT = LABEL_PREFIX + "attempt"
LABEL_HOSTNAME = LABEL_PREFIX + "hostname"
LABEL_ROLES = LABEL_PREFIX + "roles"
LABEL_MAX_RETRIES = LABEL_PREFIX + "max-retries"
LABEL_RETRY_POLICY = LABEL_PREFIX + "retry-policy"
LABEL_NETWORK = LABEL_PREFIX + "network"
LABEL_REMOVE_FINISHED = LABEL_PREFIX + "remove-finished"
LABEL_KIND = LABEL_PREFIX + "kind"
LABEL_VERSION = LABEL_PREFIX + "version"
#: on a cancel marker: the process that made it, and so owes the stops (see ``_docker/cancel.py``)
LABEL_CANCELLER = LABEL_PREFIX + "canceller"
#: on a launch claim (a volume, see ``claim_name``): the process that launches the app, and the
#: launch (a claim of the same name made by another launch carries another token)
LABEL_LAUNCHER = LABEL_PREFIX + "launcher"
LABEL_LAUNCH_TOKEN = LABEL_PREFIX + "launch-token"
#: on a cancel marker: 1 for the first, n + 1 for the one that took over from a dead canceller n
LABEL_CANCEL_TURN = LABEL_PREFIX + "cancel-turn"
#: on a failed-retry record: why the retry could not be made
LABEL_REASON = LABEL_PREFIX + "reason"

KIND_REPLICA = "replica"
KIND_CANCEL_MARKER = "cancel-marker"
KIND_LAUNCH_CLAIM = "launch-claim"
KIND_LAUNCH_CANCELLED = "launch-cancelled"
KIND_RETRY_FAILED = "retry-failed"

RANK0_ENV = "TORCHX_RANK0_HOST"
DEFAULT_BRIDGE = "bridge"
DEFAULT_STOP_TIMEOUT = 10

#: Docker refuses memory limits below 6 MiB and CPU limits below 0.01.
MIN_MEMORY_MB = 6
MIN_CPUS = 0.01
#: Docker's numbers (NanoCpus, Memory, StopTimeout) are 64-bit signed integers.
_INT64_MAX = 2**63 - 1

# Named devices of ``Resource.devices`` that map to host device files (as TorchX maps them).
_NAMED_DEVICES: dict[str, str] = {"vpc.amazonaws.com/efa": "/dev/infiniband/uverbs{index}"}

_HOST_LABEL_MAX = 63
_VOLUME_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")
_NETWORK_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


@dataclass
class ContainerRequest:
    """One replica's container.

    Args:
        name: the container's name; also its hostname and its alias on the app's network.
        role: the role's name.
        replica_id: the replica's index within its role.
        config: the body of ``POST /containers/create``.
    """

    name: str
    role: str
    replica_id: int
    config: dict[str, Any]


@dataclass
class NetworkRequest:
    """The app's own network: created before its containers, removed once the app has ended.

    Args:
        name: the network's name.
        config: the body of ``POST /networks/create``.
    """

    name: str
    config: dict[str, Any]


@dataclass
class DockerJob:
    """Everything ``schedule`` submits for one app.

    Args:
        app_id: the app's id (also the prefix of every container name).
        app_name: the AppDef's name.
        network: the network every container joins.
        network_request: the app's own network to create, or None to use an existing one.
        containers: one request per replica, in role order.
        images: each image the app needs, with the first role that uses it.
        volumes: each named volume the app mounts, with the first role that mounts it.
        remove_finished: remove the app's containers once it has finished.
    """

    app_id: str
    app_name: str
    network: str
    network_request: NetworkRequest | None
    containers: list[ContainerRequest] = field(default_factory=list)
    images: dict[str, str] = field(default_factory=dict)
    volumes: dict[str, str] = field(default_factory=dict)
    remove_finished: bool = False

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready view of the whole request (what the dry run shows, and golden files hold)."""
        return {
            "app_id": self.app_id,
            "app_name": self.app_name,
            "network": self.network,
            "network_request": (
                None
                if self.network_request is None
                else {"name": self.network_request.name, "config": self.network_request.config}
            ),
            "images": self.images,
            "volumes": self.volumes,
            "remove_finished": self.remove_finished,
            "containers": [
                {"name": c.name, "role": c.role, "replica_id": c.replica_id, "config": c.config}
                for c in self.containers
            ],
        }

    def __str__(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=False)


def run_options() -> runopts:
    """The run options of ``local_docker`` (each one read by ``build_job``)."""
    opts = runopts()
    opts.add(
        "copy_env",
        list[str],
        "glob patterns of environment variables of the launching process to copy into every "
        "replica (e.g. FOO_*,BAR); the env run option and the role's env take precedence",
    )
    opts.add(
        "env",
        dict[str, str],
        "environment variables for every replica (KEY:VALUE pairs), over those of copy_env",
    )
    opts.add("privileged", bool, "run the containers privileged (docker run --privileged)", False)
    opts.add(
        "network",
        str,
        "an existing Docker network to attach every container to, instead of a network of the "
        "app's own (created for apps with more than one container, removed when they end)",
    )
    opts.add(
        "remove_finished",
        bool,
        "remove the app's containers once it has finished (their logs go with them); by "
        "default they are kept, as TorchX does",
        False,
    )
    opts.add(
        "stop_timeout",
        int,
        "seconds a replica gets to exit after SIGTERM when the app is cancelled or stopped, "
        "before SIGKILL",
        DEFAULT_STOP_TIMEOUT,
    )
    return opts


def network_name_for(app_id: str) -> str:
    """The name of the network an app gets for itself."""
    return f"asynctorchx-{app_id}"


def _dns_label(text: str) -> str:
    label = re.sub(r"[^a-z0-9-]+", "-", text.lower())
    return re.sub(r"-{2,}", "-", label).strip("-")


def replica_hostnames(app_id: str, roles: list[Role]) -> dict[str, list[str]]:
    """``{role name: [hostname of replica 0, 1, ...]}``: ``{app_id}-{role}-{replica}``.

    Each hostname is a valid DNS label (lowercase ``[a-z0-9-]``, at most 63 characters) and doubles as
    the container's name. A role name that is not already a DNS label, or that is too long to fit, is
    shortened and given a 6-character hash of its full name, so that distinct roles never collide.

    Raises:
        InvalidAppDefException: two roles still map to the same hostname.
    """
    out: dict[str, list[str]] = {}
    seen: dict[str, str] = {}
    for role in roles:
        digits = len(str(max(role.num_replicas - 1, 0)))
        room = _HOST_LABEL_MAX - len(app_id) - digits - 2
        part = _dns_label(role.name)
        if part != role.name or len(part) > room or not part:
            digest = hashlib.sha1(role.name.encode()).hexdigest()[:6]
            part = f"{part[: max(room - 7, 0)]}-{digest}".strip("-")
        prefix = f"{app_id}-{part}"
        if prefix in seen:
            raise InvalidAppDefException(
                f"roles {seen[prefix]!r} and {role.name!r} map to the same container name "
                f"{prefix!r}; rename one of them",
                role=role.name,
                field_name="name",
            )
        seen[prefix] = role.name
        out[role.name] = [f"{prefix}-{k}" for k in range(role.num_replicas)]
    return out


def copied_env(patterns: list[str] | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` whose names match one of the glob ``patterns``, sorted by name."""
    if not patterns:
        return {}
    keys = {k for pattern in patterns for k in fnmatch.filter(environ.keys(), pattern)}
    return {k: environ[k] for k in sorted(keys)}


def _check_env(source: str, env: Mapping[str, str]) -> None:
    for key, value in env.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise InvalidAppDefException(
                f"{source} key must be a non-empty string without '=' or NUL, got {key!r}",
                field_name=source,
            )
        if not isinstance(value, str) or "\0" in value:
            raise InvalidAppDefException(
                f"{source}[{key!r}] must be a string without NUL, got {value!r}",
                field_name=source,
            )
        _check_text(f"{source} key {key!r}", key, source)
        _check_text(f"{source}[{key!r}]", value, source)


def _not_text(value: str) -> str | None:
    """What in ``value`` is not text the Docker API can carry, or None when it all is.

    The API is JSON: a string with surrogate escapes (bytes that were not UTF-8, as
    ``os.fsdecode`` and ``os.environ`` make them) or a lone surrogate would reach the engine with
    U+FFFD in their place.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(value[e.start])
        if 0xDC80 <= code <= 0xDCFF:
            return f"byte 0x{code - 0xDC00:02x} (at character {e.start}), which is not UTF-8"
        return f"a lone surrogate U+{code:04X} (at character {e.start})"
    return None


def _check_text(where: str, value: str, field_name: str, role: str | None = None) -> None:
    """Refuses a string the Docker API cannot carry as it is (see ``_not_text``).

    Raises:
        InvalidAppDefException: naming ``where`` it came from, the value and what is wrong.
    """
    wrong = _not_text(value)
    if wrong is not None:
        raise InvalidAppDefException(
            f"{where} holds {wrong}: the Docker API carries text only (JSON), so Docker would get "
            f"U+FFFD in its place; got {value!r}",
            role=role,
            field_name=field_name,
        )


def _check_role_text(role: Role) -> None:
    """Refuses what of ``role`` the Docker API cannot carry as it is: its entrypoint, args, env
    and mount paths must be UTF-8 text.

    Raises:
        InvalidAppDefException: naming the role, the field (``args[i]``, ``env[key]``...) and the
            value.
    """
    _check_text("entrypoint", role.entrypoint, "entrypoint", role.name)
    for i, arg in enumerate(role.args):
        _check_text(f"args[{i}]", arg, f"args[{i}]", role.name)
    for key, value in role.env.items():
        _check_text(f"env key {key!r}", key, "env", role.name)
        _check_text(f"env[{key!r}]", value, f"env[{key!r}]", role.name)
    for i, mount in enumerate(role.mounts):
        for attr in ("src_path", "dst_path"):
            path = getattr(mount, attr, None)
            if isinstance(path, str):
                _check_text(f"mounts[{i}].{attr}", path, f"mounts[{i}].{attr}", role.name)


def _check_copied(key: str, value: str) -> None:
    """Refuses a variable ``copy_env`` copies that the Docker API cannot carry as it is; its value
    is not quoted (the launching process's environment may hold secrets), only what is wrong.

    Raises:
        InvalidAppDefException: naming the variable and the ``copy_env`` option.
    """
    for what, text in (("name", key), ("value", value)):
        wrong = _not_text(text)
        if wrong is not None:
            raise InvalidAppDefException(
                f"copy_env copies variable {key!r}, whose {what} holds {wrong}: the Docker API "
                "carries text only (JSON), so the container would get U+FFFD in its place; unset "
                "it, or narrow the copy_env patterns",
                field_name="copy_env",
            )


def _resource_config(role: Role) -> dict[str, Any]:
    res: Resource = role.resource
    for name, value, scale in (
        ("cpu", res.cpu, 10**9),
        ("gpu", res.gpu, 1),
        ("memMB", res.memMB, 1024 * 1024),
    ):
        if (isinstance(value, float) and not math.isfinite(value)) or value * scale > _INT64_MAX:
            raise InvalidAppDefException(
                f"resource.{name} must be a finite number Docker can take "
                f"(at most {_INT64_MAX // scale}), got {value!r}",
                role=role.name,
                field_name=f"resource.{name}",
            )
    host: dict[str, Any] = {}
    if res.cpu > 0:
        if res.cpu < MIN_CPUS:
            raise InvalidAppDefException(
                f"resource.cpu must be 0 (no limit) or at least {MIN_CPUS} for Docker, got {res.cpu!r}",
                role=role.name,
                field_name="resource.cpu",
            )
        host["NanoCpus"] = round(res.cpu * 1e9)
    if res.memMB > 0:
        if res.memMB < MIN_MEMORY_MB:
            raise InvalidAppDefException(
                f"resource.memMB must be 0 (no limit) or at least {MIN_MEMORY_MB} for Docker, "
                f"got {res.memMB!r}",
                role=role.name,
                field_name="resource.memMB",
            )
        mem = int(res.memMB * 1024 * 1024)
        host["Memory"] = mem
        host["ShmSize"] = mem
    if res.gpu > 0:
        host["DeviceRequests"] = [
            {"Driver": "", "Count": int(res.gpu), "DeviceIDs": None, "Capabilities": [["gpu"]]}
        ]
    return host


def _mount_config(role: Role) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """(``HostConfig.Mounts``, ``HostConfig.Devices``, named volumes) of a role."""
    mounts: list[dict[str, Any]] = []
    devices: list[dict[str, Any]] = []
    volumes: list[str] = []
    for i, mount in enumerate(role.mounts):
        if isinstance(mount, DeviceMount):
            devices.append(_device(role, i, mount))
        elif isinstance(mount, BindMount | VolumeMount):
            mounts.append(_mount(role, i, mount))
            if isinstance(mount, VolumeMount):
                volumes.append(mount.src)
    for name, count in role.resource.devices.items():
        pattern = _NAMED_DEVICES.get(name)
        if pattern is None:
            raise InvalidAppDefException(
                f"resource.devices has {name!r}, which local_docker cannot map to a host device "
                f"(known: {', '.join(sorted(_NAMED_DEVICES))}); mount it with a DeviceMount instead",
                role=role.name,
                field_name="resource.devices",
            )
        for index in range(count):
            path = pattern.format(index=index)
            devices.append(
                {"PathOnHost": path, "PathInContainer": path, "CgroupPermissions": "rwm"}
            )
    return mounts, devices, volumes


def _mount(role: Role, i: int, mount: BindMount | VolumeMount) -> dict[str, Any]:
    """The ``HostConfig.Mounts`` entry of a bind mount or a named volume."""
    if isinstance(mount, BindMount):
        kind, source = "bind", mount.src_path
        if not source.startswith("/"):
            raise InvalidAppDefException(
                f"mounts[{i}].src_path must be an absolute host path, got {source!r}",
                role=role.name,
                field_name=f"mounts[{i}].src_path",
            )
    else:
        kind, source = "volume", mount.src
        if not _VOLUME_NAME_RE.fullmatch(source or ""):
            raise InvalidAppDefException(
                f"mounts[{i}].src must be a Docker volume name ([A-Za-z0-9][A-Za-z0-9_.-]*), "
                f"got {source!r}",
                role=role.name,
                field_name=f"mounts[{i}].src",
            )
    return {"Type": kind, "Source": source, "Target": mount.dst_path, "ReadOnly": mount.read_only}


def _device(role: Role, i: int, mount: DeviceMount) -> dict[str, Any]:
    """The ``HostConfig.Devices`` entry of a device mount."""
    if not mount.src_path.startswith("/"):
        raise InvalidAppDefException(
            f"mounts[{i}].src_path must be an absolute device path, got {mount.src_path!r}",
            role=role.name,
            field_name=f"mounts[{i}].src_path",
        )
    return {
        "PathOnHost": mount.src_path,
        "PathInContainer": mount.dst_path,
        "CgroupPermissions": mount.permissions,
    }


def _port_config(role: Role) -> dict[str, Any]:
    """The ``ExposedPorts`` of ``role``'s ``port_map``. Nothing is published on the host (as
    TorchX's docker scheduler publishes nothing): the replicas reach each other's ports on the
    app's network, and a port published on every host interface would open a c10d store or a
    debug server to anyone who can reach the host."""
    exposed: dict[str, Any] = {}
    for name, port in role.port_map.items():
        if not 1 <= port <= 65535:
            raise InvalidAppDefException(
                f"port_map[{name!r}] must be a port in [1, 65535] for Docker, got {port!r}",
                role=role.name,
                field_name=f"port_map[{name!r}]",
            )
        exposed[f"{port}/tcp"] = {}
    return exposed


def _restart_policy(role: Role) -> dict[str, Any]:
    """Docker restarts a failed replica by itself only when that is what the RetryPolicy asks."""
    if role.max_retries > 0 and RetryPolicy(role.retry_policy) == RetryPolicy.REPLICA:
        return {"Name": "on-failure", "MaximumRetryCount": role.max_retries}
    return {"Name": "no", "MaximumRetryCount": 0}


@dataclass(frozen=True)
class _JobOptions:
    """What ``build_job`` takes from the resolved run options."""

    env: dict[str, str]
    privileged: bool
    remove_finished: bool
    stop_timeout: int
    copied: frozenset[str] = frozenset()  # the keys of ``env`` copy_env gave (not overridden)

    @classmethod
    def from_cfg(cls, cfg: Mapping[str, CfgVal], environ: Mapping[str, str]) -> _JobOptions:
        copy_patterns = cfg.get("copy_env")
        env = copied_env(copy_patterns if isinstance(copy_patterns, list) else None, environ)
        copied = set(env)
        extra_env = cfg.get("env")
        if isinstance(extra_env, dict):
            _check_env("env", extra_env)
            env.update(extra_env)
            copied.difference_update(extra_env)
        raw = cfg.get("stop_timeout")
        stop_timeout = DEFAULT_STOP_TIMEOUT if raw is None else raw
        if (
            isinstance(stop_timeout, bool)
            or not isinstance(stop_timeout, int)
            or not 0 <= stop_timeout <= _INT64_MAX
        ):
            raise InvalidAppDefException(
                f"stop_timeout must be a whole number of seconds in [0, {_INT64_MAX}], "
                f"got {stop_timeout!r}",
                field_name="stop_timeout",
            )
        return cls(
            env=env,
            privileged=bool(cfg.get("privileged") or False),
            remove_finished=bool(cfg.get("remove_finished") or False),
            stop_timeout=stop_timeout,
            copied=frozenset(copied),
        )


def _network(
    cfg: Mapping[str, CfgVal], app_id: str, session_name: str, containers: int
) -> tuple[str, NetworkRequest | None]:
    """The network every container joins, and the app's own network to create (if any)."""
    network_cfg = cfg.get("network")
    if network_cfg:
        network = str(network_cfg)
        if not _NETWORK_NAME_RE.fullmatch(network):
            raise InvalidAppDefException(
                f"network must be the name or id of an existing Docker network, got {network!r}",
                field_name="network",
            )
        return network, None
    if containers == 1:
        # One container has no peers to reach: it runs on Docker's default bridge, so that many
        # single-container apps (sweeps) do not use up Docker's pool of network address ranges.
        return DEFAULT_BRIDGE, None
    network = network_name_for(app_id)
    config = {
        "Name": network,
        "CheckDuplicate": True,
        "Driver": "bridge",
        "Attachable": False,
        "Labels": {LABEL_APP_ID: app_id, LABEL_SESSION: session_name, LABEL_VERSION: __version__},
    }
    return network, NetworkRequest(name=network, config=config)


def build_job(
    app: AppDef,
    cfg: Mapping[str, CfgVal],
    *,
    app_id: str,
    session_name: str,
    environ: Mapping[str, str],
) -> DockerJob:
    """Builds the requests for ``app`` (validated) with the resolved ``cfg``. Pure.

    The environment of each replica is, in increasing priority: the variables of ``environ`` that
    match ``copy_env``, the ``env`` run option, the role's ``env``, and ``TORCHX_RANK0_HOST`` (the
    hostname of replica 0 of the first role). Macros are substituted per replica.

    Raises:
        InvalidAppDefException: a value Docker cannot take, naming the role, field and value.
        InvalidRunConfigException: is not raised here; ``cfg`` is expected to be resolved.
    """
    opts = _JobOptions.from_cfg(cfg, environ)
    total = sum(r.num_replicas for r in app.roles)
    network, network_request = _network(cfg, app_id, session_name, total)
    job = DockerJob(
        app_id=app_id,
        app_name=app.name,
        network=network,
        network_request=network_request,
        remove_finished=opts.remove_finished,
    )
    hostnames = replica_hostnames(app_id, app.roles)
    shared = _Shared(
        app_id=app_id,
        head_labels={LABEL_APP_ID: app_id, LABEL_APP_NAME: app.name, LABEL_SESSION: session_name},
        roles_label=json.dumps(
            [[r.name, r.num_replicas] for r in app.roles], separators=(",", ":")
        ),
        tail_labels={
            LABEL_NETWORK: network_request.name if network_request else "",
            LABEL_REMOVE_FINISHED: "true" if opts.remove_finished else "false",
            LABEL_KIND: KIND_REPLICA,
            LABEL_VERSION: __version__,
        },
        rank0_host=hostnames[app.roles[0].name][0],
        network=network,
        opts=opts,
    )
    for role in app.roles:
        _check_role_text(role)
        for key in sorted(shared.opts.copied.difference(role.env)):  # those the role sends
            _check_copied(key, shared.opts.env[key])
        job.images.setdefault(role.image, role.name)
        host_config, exposed, volumes = _role_host_config(role, network, opts.privileged)
        for volume in volumes:
            job.volumes.setdefault(volume, role.name)
        for replica_id, hostname in enumerate(hostnames[role.name]):
            config = _replica_config(shared, role, replica_id, hostname, host_config, exposed)
            job.containers.append(ContainerRequest(hostname, role.name, replica_id, config))
    return job


@dataclass(frozen=True)
class _Shared:
    """What every replica's container request of one app shares."""

    app_id: str
    head_labels: dict[str, str]
    roles_label: str
    tail_labels: dict[str, str]
    rank0_host: str
    network: str
    opts: _JobOptions


def _replica_config(
    shared: _Shared,
    role: Role,
    replica_id: int,
    hostname: str,
    host_config: Mapping[str, Any],
    exposed: Mapping[str, Any],
) -> dict[str, Any]:
    """The body of ``POST /containers/create`` for one replica (the role's macros applied)."""
    replica = macros.Values(
        img_root="", app_id=shared.app_id, replica_id=str(replica_id), rank0_env=RANK0_ENV
    ).apply(role)
    env = dict(shared.opts.env)
    env.update(replica.env)
    env[RANK0_ENV] = shared.rank0_host
    labels = {
        **shared.head_labels,
        LABEL_ROLE_NAME: role.name,
        LABEL_REPLICA_ID: str(replica_id),
        LABEL_ATTEMPT: "0",
        LABEL_HOSTNAME: hostname,
        LABEL_ROLES: shared.roles_label,
        LABEL_MAX_RETRIES: str(role.max_retries),
        LABEL_RETRY_POLICY: RetryPolicy(role.retry_policy).value,
        **shared.tail_labels,
    }
    config: dict[str, Any] = {
        "Image": role.image,
        "Entrypoint": [replica.entrypoint],
        "Cmd": list(replica.args),
        "Env": [f"{k}={v}" for k, v in env.items()],
        "Labels": labels,
        "Hostname": hostname,
        "StopTimeout": shared.opts.stop_timeout,
        "HostConfig": dict(host_config),
    }
    if exposed:
        config["ExposedPorts"] = dict(exposed)
    if shared.network not in (DEFAULT_BRIDGE, "host", "none"):
        config["NetworkingConfig"] = {"EndpointsConfig": {shared.network: {"Aliases": [hostname]}}}
    return config


def _role_host_config(
    role: Role, network: str, privileged: bool
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """The ``HostConfig`` of every replica of ``role``, its ``ExposedPorts`` and named volumes."""
    resources = _resource_config(role)
    mounts, devices, volumes = _mount_config(role)
    exposed = _port_config(role)
    if not role.image:
        raise InvalidAppDefException(
            "image must name a Docker image, got ''", role=role.name, field_name="image"
        )
    host_config: dict[str, Any] = {
        "NetworkMode": network,
        "Privileged": privileged,
        "RestartPolicy": _restart_policy(role),
        "Mounts": mounts,
        "Devices": devices,
        **resources,
    }
    return host_config, exposed, volumes


def cancel_marker(
    app_id: str, app_name: str, session: str, image: str, *, canceller: str, turn: int = 1
) -> ContainerRequest:
    """The never-started container that marks app ``app_id`` as cancelled, for every process.

    It carries the app's labels with the cancel-marker kind, runs nothing and joins no network;
    its name is fixed per app and ``turn``, so a second cancel (from any process) cannot make
    another. ``canceller`` names the process that makes it (it owes the stops); a process that
    takes over from a canceller that died makes the marker of the next turn.
    """
    name = marker_name(app_id) + (f"-{turn}" if turn > 1 else "")
    labels = {LABEL_CANCELLER: canceller, LABEL_CANCEL_TURN: str(turn)}
    return _record_container(name, app_id, app_name, session, image, KIND_CANCEL_MARKER, labels)


def _record_container(
    name: str,
    app_id: str,
    app_name: str,
    session: str,
    image: str,
    kind: str,
    labels: dict[str, str],
) -> ContainerRequest:
    """A never-started container ``name`` that records something of an app for every process:
    the app's labels, ``kind`` and ``labels``; it runs nothing and joins no network."""
    config = {
        "Image": image,
        "Entrypoint": ["true"],
        "Cmd": [],
        "Labels": {
            LABEL_APP_ID: app_id,
            LABEL_APP_NAME: app_name,
            LABEL_SESSION: session,
            LABEL_KIND: kind,
            **labels,
            LABEL_VERSION: __version__,
        },
        "HostConfig": {"NetworkMode": "none"},
    }
    return ContainerRequest(name=name, role="", replica_id=-1, config=config)


#: the most of an engine's message a failed-retry record keeps
_REASON_MAX = 1000


def retry_failed_record(
    app_id: str, app_name: str, session: str, image: str, *, reason: str
) -> ContainerRequest:
    """The never-started container that records, for every process, that a ROLE/APPLICATION
    retry of app ``app_id`` could not be made (the engine refused it): the app is FAILED then,
    ``reason`` says why, and its other replicas are to be stopped.

    Like the cancel marker it carries the app's labels with a kind of its own, runs nothing and
    joins no network (the app's may be what is gone); its name is fixed per app, so that of
    several processes following the app, one makes it.
    """
    return _record_container(
        retry_failed_name(app_id),
        app_id,
        app_name,
        session,
        image,
        KIND_RETRY_FAILED,
        {LABEL_REASON: reason[:_REASON_MAX]},
    )


def retry_failed_name(app_id: str) -> str:
    """The name of the container that records a retry of app ``app_id`` that could not be made."""
    return f"{app_id}-retry-failed"


#: What Docker takes as a container name; every container of an app is named ``{app_id}-...``.
_NAMEABLE_RE = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]*")


def is_app_id(app_id: str) -> bool:
    """True when ``app_id`` can name a ``local_docker`` app (its containers are named after it);
    any other id (empty, with a slash, a NUL...) is unknown without asking the engine."""
    return _NAMEABLE_RE.fullmatch(app_id) is not None


def marker_name(app_id: str) -> str:
    """The name of the (first) container that marks app ``app_id`` as cancelled."""
    return f"{app_id}-cancelled"


def claim_name(app_id: str) -> str:
    """The name of the volume that names app ``app_id`` while its submit has made no container.

    Whoever removes it decides: the launch, once it has created the app's containers (the app
    is then known by them), or a cancel before that (the launch then starts nothing).
    """
    return f"asynctorchx-launch-{app_id}"


def cancel_record_name(app_id: str) -> str:
    """The name of the volume that says app ``app_id`` was cancelled before its containers
    existed, until its launch has made the cancel marker (see ``cancel_record``)."""
    return f"asynctorchx-cancelled-{app_id}"


def cancel_record(claim_labels: Mapping[str, str]) -> dict[str, Any]:
    """The create request of the record a cancel leaves in place of a launch claim (whose
    labels it keeps: the app, its session and its launcher), so that every process reads the
    app CANCELLED while the launch, which finds its claim gone, makes the cancel marker."""
    labels = {**claim_labels, LABEL_KIND: KIND_LAUNCH_CANCELLED}
    labels.pop(LABEL_LAUNCH_TOKEN, None)
    return {"Name": cancel_record_name(labels[LABEL_APP_ID]), "Labels": labels}


def claim_request(job: DockerJob, launcher: str, token: str) -> dict[str, Any]:
    """The create request of the launch claim of ``job`` (see ``claim_name``), made by the
    process ``launcher`` names, for the launch ``token`` names (a claim of the same name with
    another token is another launch's)."""
    session = str(job.containers[0].config["Labels"].get(LABEL_SESSION, ""))
    return {
        "Name": claim_name(job.app_id),
        "Labels": {
            LABEL_APP_ID: job.app_id,
            LABEL_APP_NAME: job.app_name,
            LABEL_SESSION: session,
            LABEL_KIND: KIND_LAUNCH_CLAIM,
            LABEL_LAUNCHER: launcher,
            LABEL_LAUNCH_TOKEN: token,
            LABEL_VERSION: __version__,
        },
    }
