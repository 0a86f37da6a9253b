"""``AppDef`` → Kubernetes objects: one headless Service per app owning one Indexed Job per role.

Pure and synchronous: nothing here talks to a cluster. The layout:

- the **Service** ``{app}`` (``clusterIP: "None"``, ``publishNotReadyAddresses: true``, selecting the
  app's pods) gives every replica a DNS name before it is ready, and owns the Jobs, so deleting it
  (with an explicit propagation policy) deletes everything;
- one **Job** ``{app}-{role}`` per role, ``completionMode: Indexed`` with ``completions = parallelism =
  num_replicas`` and ``template.spec.subdomain = {app}``: replica ``k`` runs as the pod with hostname
  ``{app}-{role}-{k}``, reachable as ``{app}-{role}-{k}.{app}``; rank 0 is ``{app}-{role0}-0.{app}``
  (``localhost`` on rank 0 itself), exported as ``TORCHX_RANK0_HOST``;
- ``macros.replica_id`` becomes ``$(JOB_COMPLETION_INDEX)``, which Kubernetes expands in args and in
  env values (the variable is declared first so later env values can refer to it);
- queueing: with the ``queue`` run option, each Job carries Kueue's ``kueue.x-k8s.io/queue-name``
  label and is created suspended; Kueue unsuspends it once the LocalQueue admits it. Each role's
  Job is a Kueue workload of its own (a multi-role app may be admitted role by role). The pods'
  ``priority_class`` is also what Kueue orders the workloads of a queue by;
- resources: the limits are the role's CPU, memory (MiB as ``Mi``), GPUs and devices; the CPU and
  memory requests leave out the ``reserved_millicpu`` and ``reserved_memmb`` run options (100 m and
  1024 MiB, as TorchX), so that a role sized to a whole instance fits in a node's allocatable
  amounts (see ``resource_requirements``);
- the pods are annotated ``sidecar.istio.io/inject: "false"`` (as TorchX): an injected sidecar
  would keep a pod running after its trainer exits, and its Job from ever completing;
- retries: ``RetryPolicy.REPLICA`` uses the Job's own per-index backoff (``backoffLimitPerIndex``,
  ``maxFailedIndexes: 0``); ``ROLE`` and ``APPLICATION`` use ``backoffLimit: 0`` and are restarted by
  the backend, which recreates Jobs with a higher attempt label. Every Job ignores pod disruptions
  (preemption, eviction, node drain) through its ``podFailurePolicy`` and replaces pods only once
  they have fully terminated (``podReplacementPolicy: Failed``).

Requires Kubernetes 1.29 or newer (``backoffLimitPerIndex`` and ``podReplacementPolicy`` are beta and on
by default there).
"""

from __future__ import annotations

import copy
import json
import math
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, NoReturn, TypeGuard

from asynctorchx.schedulers._k8s import names as n
from asynctorchx.specs.api import (
    NULL_RESOURCE,
    AppDef,
    BindMount,
    CfgVal,
    InvalidAppDefException,
    InvalidRunConfigException,
    RetryPolicy,
    Role,
    VolumeMount,
    macros,
    make_unique,
    runopts,
)
from asynctorchx.specs.serialize import role_from_dict, role_to_dict
from asynctorchx.version import __version__

MIN_KUBERNETES_VERSION = "1.29"

RANK0_ENV = "TORCHX_RANK0_HOST"
REPLICA_INDEX_ENV = "JOB_COMPLETION_INDEX"
#: why neither a role's env nor a pod overlay may set ``REPLICA_INDEX_ENV``
INDEX_ENV_FIXED = "is set by Kubernetes for Indexed Jobs and cannot be overridden"
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
TERMINATION_LOG = "/dev/termination-log"
GPU_RESOURCE = "nvidia.com/gpu"
#: the pod annotation that keeps Istio from injecting its sidecar, which would outlive the
#: trainer and keep the Job from ever completing (TorchX sets it too)
ISTIO_SIDECAR_ANNOTATION = "sidecar.istio.io/inject"
#: what a container's CPU and memory requests leave out of its limits by default (TorchX's
#: RESERVED_MILLICPU and RESERVED_MEMMB): nodes keep some of their capacity for the kubelet and
#: the system, so a role sized to a whole instance type would otherwise never be scheduled
DEFAULT_RESERVED_MILLICPU = 100
DEFAULT_RESERVED_MEMMB = 1024
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
SHM_VOLUME = "dshm"

_RANK0_SCRIPT = (
    f'if [ "${{{REPLICA_INDEX_ENV}:-}}" = 0 ]; then {RANK0_ENV}=localhost; export {RANK0_ENV}; fi; '
    'exec "$@"'
)

TOLERATION_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
IMAGE_PULL_POLICIES = ("Always", "IfNotPresent", "Never")

_QUANTITY = re.compile(
    r"[+-]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?"
)
_RESOURCE_NAME = re.compile(
    r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
)


def run_options(namespace: str) -> runopts:
    """The run options of the ``kubernetes`` backend (``namespace``: the scheduler's default)."""
    opts = runopts()
    opts.add("namespace", str, "namespace of the app's objects", default=namespace)
    opts.add(
        "queue",
        str,
        "Kueue LocalQueue to submit to: the Jobs are labelled kueue.x-k8s.io/queue-name and "
        "created suspended until Kueue admits them (TorchX's queue is Volcano's)",
    )
    opts.add("service_account", str, "service account the pods run as")
    opts.add(
        "priority_class",
        str,
        "PriorityClass of the pods (with queue: also the workload's priority in Kueue)",
    )
    opts.add("node_selector", dict[str, str], "node labels the pods must match (key:value,...)")
    opts.add(
        "tolerations",
        list[str],
        "taints the pods tolerate: key[=value][:NoSchedule|PreferNoSchedule|NoExecute],...",
    )
    opts.add("image_pull_secrets", list[str], "names of the Secrets used to pull the images")
    opts.add("image_pull_policy", str, "Always, IfNotPresent or Never (default: the cluster's)")
    opts.add("labels", dict[str, str], "extra labels on every object, e.g. team:vision")
    opts.add(
        "pod_overlay",
        str,
        'a JSON object merged into every pod template, e.g. {"spec": {"hostNetwork": true}}',
    )
    opts.add(
        "image_repo",
        str,
        "the repository workspace images are pushed to, as {image_repo}:{content hash} (e.g. "
        "registry.example.com/team/app); the cluster must be able to pull from it",
    )
    opts.add(
        "reserved_millicpu",
        int,
        "millicores left out of each container's CPU request for the node's own reserve, so that "
        "a role sized to a whole instance (a named resource) fits on it; the limit stays the "
        "role's cpu (0: requests equal limits, Guaranteed QoS)",
        default=DEFAULT_RESERVED_MILLICPU,
    )
    opts.add(
        "reserved_memmb",
        int,
        "MiB left out of each container's memory request, as reserved_millicpu for memory "
        "(0: requests equal limits)",
        default=DEFAULT_RESERVED_MEMMB,
    )
    opts.add(
        "rank0_localhost",
        bool,
        "replica 0 of the first role sees TORCHX_RANK0_HOST=localhost (its command runs under "
        "/bin/sh when the role has several replicas); off: every replica gets rank 0's DNS name",
        default=True,
    )
    return opts


def image_repo(cfg: Mapping[str, CfgVal]) -> str | None:
    """The ``image_repo`` run option, checked (None when unset).

    Raises:
        InvalidRunConfigException: it is not a repository name (names the value).
    """
    from asynctorchx.schedulers._docker.engine import check_repository

    value = cfg.get("image_repo")
    if value is None or value == "":
        return None
    try:
        return check_repository(str(value))
    except ValueError as e:
        raise InvalidRunConfigException(str(e), "image_repo", cfg) from None


@dataclass(frozen=True)
class KubernetesOptions:
    """The resolved run options of one submission (see ``KubernetesScheduler.run_opts``)."""

    namespace: str = "default"
    queue: str | None = None
    service_account: str | None = None
    priority_class: str | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    image_pull_secrets: tuple[str, ...] = ()
    image_pull_policy: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    pod_overlay: Mapping[str, Any] | None = None
    rank0_localhost: bool = True
    reserved_millicpu: int = DEFAULT_RESERVED_MILLICPU
    reserved_memmb: int = DEFAULT_RESERVED_MEMMB

    @staticmethod
    def from_cfg(cfg: Mapping[str, CfgVal]) -> KubernetesOptions:
        """Parses resolved run options, raising InvalidRunConfigException naming the bad key."""
        namespace = _text(cfg, "namespace") or "default"
        if not n.is_dns1123_label(namespace):
            _bad_cfg(
                "namespace", namespace, "a DNS label (lowercase a-z, 0-9, '-', at most 63)", cfg
            )
        for key in ("service_account", "priority_class"):
            value = _text(cfg, key)
            if value is not None and not n.is_dns1123_subdomain(value):
                _bad_cfg(key, value, "a DNS subdomain (lowercase a-z, 0-9, '-', '.')", cfg)
        node_selector = _label_map(cfg, "node_selector")
        labels = _label_map(cfg, "labels")
        for key, value in labels.items():
            if is_reserved_label(key):
                _bad_cfg("labels", f"{key}:{value}", f"labels other than {RESERVED_LABELS}", cfg)
        queue = _queue(cfg, labels)
        secrets = _strings(cfg, "image_pull_secrets")
        for secret in secrets:
            if not n.is_dns1123_subdomain(secret):
                _bad_cfg("image_pull_secrets", secret, "names of Secrets (DNS subdomains)", cfg)
        policy = _text(cfg, "image_pull_policy")
        if policy is not None and policy not in IMAGE_PULL_POLICIES:
            _bad_cfg("image_pull_policy", policy, f"one of {', '.join(IMAGE_PULL_POLICIES)}", cfg)
        overlay = _pod_overlay(cfg)
        reserved = {
            key: _reserve(cfg, key, default)
            for key, default in (
                ("reserved_millicpu", DEFAULT_RESERVED_MILLICPU),
                ("reserved_memmb", DEFAULT_RESERVED_MEMMB),
            )
        }
        return KubernetesOptions(
            namespace=namespace,
            queue=queue,
            service_account=_text(cfg, "service_account"),
            priority_class=_text(cfg, "priority_class"),
            node_selector=node_selector,
            tolerations=tuple(parse_toleration(t, cfg) for t in _strings(cfg, "tolerations")),
            image_pull_secrets=tuple(secrets),
            image_pull_policy=policy,
            labels=labels,
            pod_overlay=overlay,
            rank0_localhost=cfg.get("rank0_localhost") is not False,
            reserved_millicpu=reserved["reserved_millicpu"],
            reserved_memmb=reserved["reserved_memmb"],
        )


#: the labels the backend sets on its objects and finds its pods by (the watch's selector, the
#: log reader, the attempts, the replica index): neither the ``labels`` option nor a pod overlay
#: may set them
RESERVED_LABELS = (
    f"{n.LABEL_MANAGED_BY}, {n.DOMAIN}/* and {n.COMPLETION_INDEX}, which the backend sets itself"
)


def is_reserved_label(key: str) -> bool:
    """True for a label key of ``RESERVED_LABELS``."""
    return key in (n.LABEL_MANAGED_BY, n.COMPLETION_INDEX) or key.startswith(f"{n.DOMAIN}/")


def _reserve(cfg: Mapping[str, CfgVal], key: str, default: int) -> int:
    """A ``reserved_*`` option: a whole number of at least 0 (``default`` when unset)."""
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        unit = "millicores" if key == "reserved_millicpu" else "MiB"
        _bad_cfg(key, value, f"a whole number of {unit} of at least 0", cfg)
    return value


def _text(cfg: Mapping[str, CfgVal], key: str) -> str | None:
    value = cfg.get(key)
    return value if isinstance(value, str) and value else None


def _strings(cfg: Mapping[str, CfgVal], key: str) -> list[str]:
    value = cfg.get(key)
    return list(value) if isinstance(value, list) else []


def _label_map(cfg: Mapping[str, CfgVal], key: str) -> dict[str, str]:
    """A ``key:value`` option whose pairs must be valid label keys and values."""
    value = cfg.get(key)
    pairs = dict(value) if isinstance(value, dict) else {}
    for k, v in pairs.items():
        if not n.is_label_key(k):
            _bad_cfg(key, f"{k}:{v}", f"label keys like 'example.com/name', got key {k!r}", cfg)
        if not n.is_label_value(v):
            _bad_cfg(key, f"{k}:{v}", f"label values of at most 63 [A-Za-z0-9_.-], got {v!r}", cfg)
    return pairs


def _queue(cfg: Mapping[str, CfgVal], labels: Mapping[str, str]) -> str | None:
    """The Kueue queue: the ``queue`` option, or the queue label given with ``labels``."""
    queue = _text(cfg, "queue")
    labelled = labels.get(n.LABEL_KUEUE_QUEUE)
    if queue is not None and not (n.is_label_value(queue) and n.is_dns1123_subdomain(queue)):
        _bad_cfg("queue", queue, "the name of a Kueue LocalQueue (a DNS label)", cfg)
    if labelled is not None and not n.is_dns1123_subdomain(labelled):
        _bad_cfg(
            "labels",
            f"{n.LABEL_KUEUE_QUEUE}:{labelled}",
            f"a {n.LABEL_KUEUE_QUEUE} naming a Kueue LocalQueue (a DNS label)",
            cfg,
        )
    if queue is not None and labelled is not None and labelled != queue:
        _bad_cfg(
            "queue",
            queue,
            f"the same queue as labels' {n.LABEL_KUEUE_QUEUE}:{labelled} (give one of them)",
            cfg,
        )
    return queue or labelled or None


def _pod_overlay(cfg: Mapping[str, CfgVal]) -> dict[str, Any] | None:
    raw = _text(cfg, "pod_overlay")
    if raw is None:
        return None
    try:
        overlay = json.loads(raw, parse_constant=_no_constant)
    except ValueError as e:
        _bad_cfg("pod_overlay", raw, f"a JSON object ({e})", cfg)
    problem = overlay_problem(overlay)
    if problem is not None or not isinstance(overlay, dict):
        _bad_cfg("pod_overlay", raw, problem or "a JSON object", cfg)
    return overlay


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


# Where a pod template holds objects, lists of objects or strings: an overlay that puts another
# type there is refused before it is merged (the lint and the API server expect these shapes).
_OVERLAY_OBJECTS = {("metadata",), ("metadata", "labels"), ("metadata", "annotations"), ("spec",)}
_OVERLAY_LISTS = {("spec", "containers"), ("spec", "volumes"), ("spec", "tolerations")}
_CONTAINER_OBJECTS = {("resources",), ("resources", "requests"), ("resources", "limits")}
_CONTAINER_LISTS = {("env",), ("ports",), ("volumeMounts",)}


def overlay_problem(overlay: object) -> str | None:
    """What makes ``overlay`` unfit to merge into a pod template, or None when it is fit.

    A pod overlay is a JSON object with ``metadata`` and/or ``spec``; where the template has an
    object (``spec``, ``metadata.labels``, a container's ``resources``...) or a list of objects
    (``spec.containers``, ``volumes``, ``tolerations``, a container's ``env``, ``ports``,
    ``volumeMounts``), the overlay must have one too (or null, to remove it). Its integer fields
    (``priority``, ``terminationGracePeriodSeconds``, ports...) must be whole numbers in their
    32- or 64-bit range, ports in 1..65535.
    """
    expected = "a JSON object with 'metadata' and/or 'spec'"
    if not isinstance(overlay, dict) or set(overlay) - {"metadata", "spec"}:
        return expected
    try:
        json.dumps(overlay, allow_nan=False)
    except (TypeError, ValueError) as e:
        return f"{expected} of JSON values only ({e})"
    problem = _numbers_problem(overlay, ())
    if problem is not None:
        return f"{expected}, {problem}"
    for path, value in _walk(overlay, ()):
        if path in _OVERLAY_OBJECTS and not isinstance(value, dict):
            return f"{expected}, with an object (or null) at {'.'.join(path)}"
        if path in _OVERLAY_LISTS:
            if not _objects(value):
                return f"{expected}, with a list of objects (or null) at {'.'.join(path)}"
            if path == ("spec", "containers"):
                for i, container in enumerate(value):
                    problem = _container_problem(container, f"spec.containers[{i}]")
                    if problem is not None:
                        return f"{expected}, {problem}"
    problem = _override_problem(overlay)
    if problem is not None:
        return f"{expected}, {problem}"
    return None


def _override_problem(overlay: Mapping[str, Any]) -> str | None:
    """What a well-shaped overlay would override of what the backend (or Kubernetes) sets: a
    reserved pod label (set, or removed with a null), or the replica index variable in a
    container's env (merged by name into the backend's ``valueFrom`` entry, it would make an
    entry with both ``value`` and ``valueFrom``, which the API server refuses)."""
    if "metadata" in overlay and overlay["metadata"] is None:
        return f"without removing the pods' metadata (it holds the labels {RESERVED_LABELS})"
    metadata = overlay.get("metadata") or {}
    if "labels" in metadata and metadata["labels"] is None:
        return f"without removing the pod labels at metadata.labels ({RESERVED_LABELS})"
    for key in metadata.get("labels") or {}:
        if is_reserved_label(key):
            return (
                f"without the pod label {key!r} at metadata.labels (labels other than "
                f"{RESERVED_LABELS})"
            )
    spec = overlay.get("spec") or {}
    for section in ("containers", "initContainers"):
        containers = spec.get(section)
        for i, container in enumerate(containers if _objects(containers) else []):
            env = container.get("env")
            for j, var in enumerate(env if _objects(env) else []):
                if var.get("name") == REPLICA_INDEX_ENV:
                    return (
                        f"without env[{REPLICA_INDEX_ENV!r}] at spec.{section}[{i}].env[{j}] "
                        f"(it {INDEX_ENV_FIXED})"
                    )
    return None


# The integer fields of a pod template (core/v1, from the OpenAPI schemas: each name has one
# format there) and the ports among them; the schemas check neither range nor that a JSON number
# is whole, and the API server refuses the object when it cannot decode it.
_INT32_FIELDS = frozenset(
    {
        "containerPort",
        "defaultMode",
        "failureThreshold",
        "hostPort",
        "initialDelaySeconds",
        "lun",
        "maxSkew",
        "minDomains",
        "mode",
        "partition",
        "periodSeconds",
        "port",
        "priority",
        "successThreshold",
        "timeoutSeconds",
        "weight",
    }
)
_INT64_FIELDS = frozenset(
    {
        "activeDeadlineSeconds",
        "expirationSeconds",
        "fsGroup",
        "runAsGroup",
        "runAsUser",
        "seconds",
        "supplementalGroups",
        "terminationGracePeriodSeconds",
        "tolerationSeconds",
    }
)
_PORT_FIELDS = frozenset({"containerPort", "hostPort", "port"})


def _numbers_problem(value: object, path: tuple[str | int, ...]) -> str | None:
    """What is wrong with the first integer field of ``value`` (at any depth) that Kubernetes
    cannot hold: not a whole number, past 32 or 64 bits, or a port outside 1..65535."""
    if isinstance(value, dict):
        for key, item in value.items():
            problem = _numbers_problem(item, (*path, str(key)))
            if problem is not None:
                return problem
    elif isinstance(value, list):
        for i, item in enumerate(value):
            problem = _numbers_problem(item, (*path, i))
            if problem is not None:
                return problem
    elif isinstance(value, int | float) and not isinstance(value, bool):
        key = next((p for p in reversed(path) if isinstance(p, str)), "")
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
        unset_host_port = key == "hostPort" and value == 0
        if key in _PORT_FIELDS and not unset_host_port and not _is_port(value):
            return f"with a port in [1, 65535] at {where} (not {value!r})"
        if key in _INT32_FIELDS and not (
            isinstance(value, int) and -(MAX_INT32 + 1) <= value <= MAX_INT32
        ):
            return f"with a 32-bit integer at {where} (not {value!r})"
        if key in _INT64_FIELDS and not (
            isinstance(value, int) and -(MAX_INT64 + 1) <= value <= MAX_INT64
        ):
            return f"with a 64-bit integer at {where} (not {value!r})"
    return None


def _is_port(value: object) -> bool:
    return isinstance(value, int) and 1 <= value <= 65535


def _walk(obj: dict[str, Any], path: tuple[str, ...]) -> list[tuple[tuple[str, ...], Any]]:
    """``(path, value)`` of every non-null value of ``obj`` down to two levels."""
    out = []
    for key, value in obj.items():
        if value is None:
            continue
        out.append(((*path, key), value))
        if isinstance(value, dict) and not path:
            out.extend(_walk(value, (key,)))
    return out


def _objects(value: object) -> TypeGuard[list[dict[str, Any]]]:
    return isinstance(value, list) and all(isinstance(x, dict) for x in value)


def _container_problem(container: dict[str, Any], where: str) -> str | None:
    name = container.get("name")
    if name is not None and not isinstance(name, str):
        return f"with a string as {where}.name"
    for path, value in _walk(container, ()):
        if path in _CONTAINER_OBJECTS and not isinstance(value, dict):
            return f"with an object (or null) at {where}.{'.'.join(path)}"
        if path in _CONTAINER_LISTS and not _objects(value):
            return f"with a list of objects (or null) at {where}.{'.'.join(path)}"
    return None


def _bad_cfg(key: str, value: object, expected: str, cfg: Mapping[str, CfgVal]) -> NoReturn:
    raise InvalidRunConfigException(
        f"Run option {key!r} must be {expected}, got {value!r}", key, cfg
    )


def parse_toleration(spec: str, cfg: Mapping[str, CfgVal] | None = None) -> dict[str, Any]:
    """Parses ``key[=value][:Effect]`` into a toleration.

    ``key=value:NoSchedule`` tolerates that taint exactly (operator ``Equal``); ``key:NoExecute``
    tolerates any value (operator ``Exists``); without an effect, every effect is tolerated.

    Raises:
        InvalidRunConfigException: the string does not have that shape or the effect is unknown.
    """
    head, sep, effect = spec.rpartition(":") if ":" in spec else (spec, "", "")
    key, eq, value = head.partition("=")
    expected = f"'key[=value][:Effect]' with Effect one of {', '.join(TOLERATION_EFFECTS)}"
    if (sep and effect not in TOLERATION_EFFECTS) or not key or not n.is_label_key(key):
        _bad_cfg("tolerations", spec, expected, cfg or {})
    if eq and not n.is_label_value(value):
        _bad_cfg("tolerations", spec, expected, cfg or {})
    tol: dict[str, Any] = {"key": key, "operator": "Equal" if eq else "Exists"}
    if eq:
        tol["value"] = value
    if sep:
        tol["effect"] = effect
    return tol


@dataclass
class KubernetesRequest:
    """What the ``kubernetes`` backend submits for one app: a Service and one Job per role.

    Attributes:
        namespace: the namespace of every object.
        name: the app's name in the cluster (the Service's name, prefix of every other name).
        service: the headless Service manifest.
        jobs: one Job manifest per role, in role order (their owner reference to the Service is
            added at submit time, once the Service's uid is known).
        roles: the roles as submitted (retries recreate Jobs from ``jobs``).
    """

    namespace: str
    name: str
    service: dict[str, Any]
    jobs: list[dict[str, Any]]
    roles: list[Role]

    @property
    def app_id(self) -> str:
        """The backend's app id, ``{namespace}:{name}``."""
        return n.make_app_id(self.namespace, self.name)

    @property
    def needs_live_retries(self) -> bool:
        """True when a role restarts by ROLE or APPLICATION policy (done by the submitting process)."""
        return any(
            r.max_retries > 0 and RetryPolicy(r.retry_policy) != RetryPolicy.REPLICA
            for r in self.roles
        )

    def manifests(self) -> list[dict[str, Any]]:
        """Every object, in creation order (the Service first)."""
        return [self.service, *self.jobs]

    def __str__(self) -> str:
        return format_manifests(self.manifests())


def format_manifests(objs: list[dict[str, Any]]) -> str:
    """A multi-document YAML rendering of ``objs`` (JSON when PyYAML is not installed)."""
    try:
        import yaml  # type: ignore[import-untyped]
    except ImportError:
        return "\n---\n".join(json.dumps(o, indent=2) for o in objs)
    return str(yaml.safe_dump_all(objs, sort_keys=False, default_flow_style=False))


def role_to_json(role: Role) -> str:
    """The role as compact JSON, stored on its Job so that ``describe`` can return it."""
    return json.dumps(role_to_dict(role), separators=(",", ":"), sort_keys=True, default=str)


def role_from_json(raw: str) -> Role | None:
    """The role stored by ``role_to_json``, or None when ``raw`` is not such JSON."""
    try:
        return role_from_dict(json.loads(raw))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


# -- names ---------------------------------------------------------------------------------------


def role_dns_names(app: AppDef) -> list[str]:
    """The DNS-label form of every role name, in role order.

    Raises:
        InvalidAppDefException: a role name has no usable characters, or two roles map to the same name.
    """
    seen: dict[str, str] = {}
    out: list[str] = []
    for role in app.roles:
        dns = n.role_dns_name(role.name)
        if not dns:
            raise InvalidAppDefException(
                f"name {role.name!r} has no letters or digits to build Kubernetes names from",
                role=role.name,
                field_name="name",
            )
        if dns in seen:
            raise InvalidAppDefException(
                f"name {role.name!r} and role {seen[dns]!r} both become {dns!r} in Kubernetes names "
                "(lowercase, other characters as '-'); rename one of them",
                role=role.name,
                field_name="name",
            )
        seen[dns] = role.name
        out.append(dns)
    return out


def new_app_name(app: AppDef, role_dns: list[str]) -> str:
    """A fresh, unique app name short enough for every derived name to fit in 63 characters.

    Raises:
        InvalidAppDefException: a role's name (with its replica count) leaves no room for an app id.
    """
    pairs = [(dns, r.num_replicas) for dns, r in zip(role_dns, app.roles, strict=True)]
    budget = n.app_id_budget(pairs)
    if budget < n.APP_ID_MIN_LENGTH:
        role, dns = max(
            zip(app.roles, role_dns, strict=True),
            key=lambda p: len(f"-{p[1]}-{p[0].num_replicas - 1}"),
        )
        index_len = len(str(max(role.num_replicas - 1, 0)))
        allowed = n.MAX_LABEL - n.APP_ID_MIN_LENGTH - index_len - 2
        raise InvalidAppDefException(
            f"name {role.name!r} ({len(dns)} characters as {dns!r}) is too long for Kubernetes: pod "
            f"hostnames '<app_id>-<role>-<index>' must fit in 63 characters and the app id needs at "
            f"least {n.APP_ID_MIN_LENGTH}; use a role name of at most {allowed} characters",
            role=role.name,
            field_name="name",
        )
    return make_unique(
        app.name, string_length=n.APP_ID_SUFFIX_LENGTH, max_length=min(n.APP_ID_MAX_LENGTH, budget)
    )


# -- resources -----------------------------------------------------------------------------------


MAX_INT32 = 2**31 - 1
MAX_INT64 = 2**63 - 1
#: the most cores / MiB a quantity holds: Kubernetes counts CPU in millicores and memory in bytes,
#: as 64-bit ints (larger values are capped or overflow, and the pod can never be placed)
MAX_CPU = MAX_INT64 // 1000
MAX_MEM_MB = MAX_INT64 // 2**20
_UNITS = {"cpu": "millicores", "memMB": "bytes", "gpu": "GPUs"}


def cpu_quantity(cpu: float) -> str:
    """CPU cores as a Kubernetes quantity (``2``, ``500m``)."""
    if float(cpu).is_integer():
        return str(int(cpu))
    return f"{round(cpu * 1000)}m"


def memory_quantity(mem_mb: float) -> str:
    """MiB as a Kubernetes quantity (``4096Mi``; fractional MiB as whole KiB)."""
    if float(mem_mb).is_integer():
        return f"{int(mem_mb)}Mi"
    return f"{round(mem_mb * 1024)}Ki"


_SI_FACTORS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_BINARY_FACTORS = {f"{p}i": 1024 ** (i + 1) for i, p in enumerate("KMGTPE")}
_PAGE_SIZE = re.compile(r"hugepages-([0-9]+)([kMGTPE]|[KMGTPE]i)?")


def _hugepage_size(dev: str) -> int | None:
    """The page size (bytes) of a ``hugepages-SIZE`` resource name, else None."""
    m = _PAGE_SIZE.fullmatch(dev)
    if m is None:
        return None
    suffix = m.group(2) or ""
    return int(m.group(1)) * (_BINARY_FACTORS.get(suffix) or _SI_FACTORS[suffix]) or None


def _device_name_problem(dev: str) -> str | None:
    """Why the API server takes ``dev`` as no container resource name, or None when it does
    (its rules: a standard name without a prefix, or a qualified name whose extended form
    ``requests.NAME`` is one too)."""
    if "/" not in dev:
        if dev in ("cpu", "memory"):
            return "set resource.cpu or resource.memMB instead"
        if dev == "ephemeral-storage" or _hugepage_size(dev) is not None:
            return None
        if dev.startswith("hugepages-"):
            return "a huge page resource is 'hugepages-' and a page size, like 'hugepages-2Mi'"
        return "an extended resource needs a domain prefix, like 'vpc.amazonaws.com/efa'"
    if not n.is_label_key(dev):
        return (
            "a DNS subdomain prefix of at most 253 characters, '/', and a name of at most 63 "
            "characters ([A-Za-z0-9_.-], alphanumeric ends)"
        )
    if "kubernetes.io/" not in dev and (
        dev.startswith("requests.") or not n.is_label_key(f"requests.{dev}")
    ):
        return (
            "an extended resource name must not start with 'requests.', and its prefix must "
            "leave room for one (at most 244 characters)"
        )
    return None


def resource_requirements(
    role: Role,
    reserved_millicpu: int = DEFAULT_RESERVED_MILLICPU,
    reserved_memmb: int = DEFAULT_RESERVED_MEMMB,
) -> dict[str, Any]:
    """Limits of every resource the role asks for, and requests: the same amounts, less the
    reserves for CPU and memory.

    A node's allocatable CPU and memory are less than its capacity (the kubelet and the system
    keep some), so a role asking for a whole instance (``aws_p3_2xlarge``: 8 CPUs, pinned to
    p3.2xlarge nodes) could never be placed if it requested all of it. As TorchX does, the CPU
    request is the limit less ``reserved_millicpu`` and the memory request the limit less
    ``reserved_memmb`` MiB; where the limit is not larger than the reserve the request is the
    limit (a container that small fits anyway). The limits are the role's amounts. With both
    reserves 0, requests equal limits (the pods' QoS class is then Guaranteed).

    Args:
        role: the role.
        reserved_millicpu: millicores left out of the CPU request.
        reserved_memmb: MiB left out of the memory request.

    Raises:
        InvalidAppDefException: a value Kubernetes cannot represent (infinite, past a 64-bit
            quantity, fractional GPUs, a device count that is not an int, a device name that is
            not a resource name).
    """
    res = role.resource
    if res is NULL_RESOURCE or res == NULL_RESOURCE:
        return {}
    amounts: dict[str, Any] = {}
    for fname, value in (("cpu", res.cpu), ("memMB", res.memMB), ("gpu", res.gpu)):
        if not math.isfinite(value):
            raise InvalidAppDefException(
                f"resource.{fname} must be a finite number, got {value!r}",
                role=role.name,
                field_name=f"resource.{fname}",
            )
    for fname, value, most in (
        ("cpu", res.cpu, MAX_CPU),
        ("memMB", res.memMB, MAX_MEM_MB),
        ("gpu", res.gpu, MAX_INT64),
    ):
        if value > most:
            raise InvalidAppDefException(
                f"resource.{fname} must be at most {most} on Kubernetes (a quantity is held as "
                f"a 64-bit count of {_UNITS[fname]}), got {value!r}",
                role=role.name,
                field_name=f"resource.{fname}",
            )
    if res.cpu > 0:
        cpu = cpu_quantity(res.cpu)
        if cpu == "0m":
            raise InvalidAppDefException(
                f"resource.cpu must be at least 0.001 cores, got {res.cpu!r}",
                role=role.name,
                field_name="resource.cpu",
            )
        amounts["cpu"] = cpu
    if res.memMB > 0:
        mem = memory_quantity(res.memMB)
        if mem == "0Ki":
            raise InvalidAppDefException(
                f"resource.memMB must be at least 1 KiB (0.001 MiB), got {res.memMB!r}",
                role=role.name,
                field_name="resource.memMB",
            )
        amounts["memory"] = mem
    if res.gpu > 0:
        if not float(res.gpu).is_integer():
            raise InvalidAppDefException(
                f"resource.gpu must be a whole number of GPUs on Kubernetes, got {res.gpu!r}",
                role=role.name,
                field_name="resource.gpu",
            )
        amounts[GPU_RESOURCE] = int(res.gpu)
    for dev, count in res.devices.items():
        if not _RESOURCE_NAME.fullmatch(dev) or len(dev) > n.MAX_SUBDOMAIN:
            raise InvalidAppDefException(
                f"resource.devices key {dev!r} is not a Kubernetes resource name "
                "(like 'vpc.amazonaws.com/efa')",
                role=role.name,
                field_name="resource.devices",
            )
        hint = _device_name_problem(dev)
        if hint is not None:
            raise InvalidAppDefException(
                f"resource.devices key {dev!r} is not a resource a Kubernetes container can "
                f"request: {hint}",
                role=role.name,
                field_name="resource.devices",
            )
        if isinstance(count, bool) or not isinstance(count, int) or count > MAX_INT64:
            raise InvalidAppDefException(
                f"resource.devices[{dev!r}] must be a whole number of devices of at most "
                f"{MAX_INT64} on Kubernetes, got {count!r}",
                role=role.name,
                field_name="resource.devices",
            )
        page = _hugepage_size(dev)
        if count > 0 and page is not None:
            if count % page:
                problem = f"must be a whole number of pages (bytes, a multiple of {page})"
            elif not (res.cpu > 0 or res.memMB > 0):
                problem = "needs resource.cpu or resource.memMB set too"
            else:
                problem = ""
            if problem:
                raise InvalidAppDefException(
                    f"resource.devices[{dev!r}] {problem} on Kubernetes, got {count!r}",
                    role=role.name,
                    field_name="resource.devices",
                )
        if count > 0:
            amounts[dev] = count
    if not amounts:
        return {}
    requests = dict(amounts)
    cpu_m = round(res.cpu * 1000)
    if "cpu" in amounts and 0 < reserved_millicpu < cpu_m:
        requests["cpu"] = _millicores(cpu_m - reserved_millicpu)
    mem_ki, reserved_ki = round(res.memMB * 1024), reserved_memmb * 1024
    if "memory" in amounts and 0 < reserved_ki < mem_ki:
        requests["memory"] = _kibibytes(mem_ki - reserved_ki)
    return {"limits": dict(amounts), "requests": requests}


def _millicores(millicores: int) -> str:
    """Millicores as a quantity (``7``, ``7900m``)."""
    return str(millicores // 1000) if millicores % 1000 == 0 else f"{millicores}m"


def _kibibytes(kib: int) -> str:
    """KiB as a quantity (``15360Mi``, ``1536Ki``)."""
    return f"{kib // 1024}Mi" if kib % 1024 == 0 else f"{kib}Ki"


# -- the pod template ----------------------------------------------------------------------------


def _volumes(role: Role) -> tuple[list[dict[str, Any]], list[dict[str, Any]], bool]:
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    dsts: dict[str, int] = {}
    for i, m in enumerate(role.mounts):
        dst = posixpath.normpath(m.dst_path)
        if dst in dsts:
            raise InvalidAppDefException(
                f"mounts[{i}].dst_path {m.dst_path!r} is also mounts[{dsts[dst]}]'s: Kubernetes "
                "mounts one volume per path",
                role=role.name,
                field_name=f"mounts[{i}].dst_path",
            )
        dsts[dst] = i
    if "/dev/shm" not in dsts:  # a mount the role makes there replaces the default one
        volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    privileged = False
    for i, m in enumerate(role.mounts):
        name = f"mount-{i}"
        if not isinstance(m, VolumeMount) and ".." in m.src_path.split("/"):
            raise InvalidAppDefException(
                f"mounts[{i}].src_path must not contain '..' on Kubernetes (a hostPath volume "
                f"cannot step back), got {m.src_path!r}",
                role=role.name,
                field_name=f"mounts[{i}].src_path",
            )
        if isinstance(m, BindMount):
            volumes.append({"name": name, "hostPath": {"path": m.src_path}})
            mounts.append({"name": name, "mountPath": m.dst_path, "readOnly": m.read_only})
        elif isinstance(m, VolumeMount):
            if not n.is_dns1123_subdomain(m.src):
                raise InvalidAppDefException(
                    f"mounts[{i}].src must name a PersistentVolumeClaim (a DNS subdomain), got {m.src!r}",
                    role=role.name,
                    field_name=f"mounts[{i}].src",
                )
            volumes.append(
                {
                    "name": name,
                    "persistentVolumeClaim": {"claimName": m.src, "readOnly": m.read_only},
                }
            )
            mounts.append({"name": name, "mountPath": m.dst_path, "readOnly": m.read_only})
        else:
            # as TorchX: a device is writable only with the 'w' (write) or 'm' (mknod) permission
            read_only = "w" not in m.permissions and "m" not in m.permissions
            volumes.append({"name": name, "hostPath": {"path": m.src_path}})
            mounts.append({"name": name, "mountPath": m.dst_path, "readOnly": read_only})
            privileged = True
    return volumes, mounts, privileged


def _env(role: Role, extra: Mapping[str, str]) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {
            "name": REPLICA_INDEX_ENV,
            "valueFrom": {
                "fieldRef": {"fieldPath": f"metadata.annotations['{n.COMPLETION_INDEX}']"}
            },
        }
    ]
    merged = {**extra, **role.env}
    merged.setdefault(ERROR_FILE_ENV, TERMINATION_LOG)
    for key, value in merged.items():
        if key == REPLICA_INDEX_ENV:
            raise InvalidAppDefException(
                f"env[{key!r}] {INDEX_ENV_FIXED}",
                role=role.name,
                field_name="env",
            )
        if not n.is_env_name(key):
            raise InvalidAppDefException(
                f"env key {key!r} is not a valid Kubernetes environment variable name "
                "(letters, digits, '_', '-', '.', not starting with a digit)",
                role=role.name,
                field_name="env",
            )
        env.append({"name": key, "value": value})
    return env


def _ports(role: Role) -> list[dict[str, Any]]:
    ports = []
    for name, port in role.port_map.items():
        if not n.is_port_name(name):
            raise InvalidAppDefException(
                f"port_map key {name!r} is not a Kubernetes port name (at most 15 lowercase letters, "
                "digits and '-', with at least one letter)",
                role=role.name,
                field_name="port_map",
            )
        if not 1 <= port <= 65535:
            raise InvalidAppDefException(
                f"port_map[{name!r}] must be a port in [1, 65535] on Kubernetes, got {port!r}",
                role=role.name,
                field_name="port_map",
            )
        ports.append({"name": name, "containerPort": port})
    return ports


def merge_overlay(base: Any, overlay: Any) -> Any:
    """``overlay`` merged into ``base`` (a copy): dicts key by key, lists of named dicts by name.

    A ``None`` in the overlay removes the key; any other list or value replaces the base's.
    """
    if isinstance(base, dict) and isinstance(overlay, dict):
        out = dict(base)
        for key, value in overlay.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = merge_overlay(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if (
        isinstance(base, list)
        and isinstance(overlay, list)
        and all(isinstance(x, dict) and "name" in x for x in base + overlay)
    ):
        out_list = [copy.deepcopy(x) for x in base]
        index = {x["name"]: i for i, x in enumerate(out_list)}
        for item in overlay:
            if item["name"] in index:
                out_list[index[item["name"]]] = merge_overlay(out_list[index[item["name"]]], item)
            else:
                out_list.append(copy.deepcopy(item))
        return out_list
    return copy.deepcopy(overlay)


def pod_template(
    role: Role,
    role_dns: str,
    *,
    app_name: str,
    labels: Mapping[str, str],
    opts: KubernetesOptions,
    rank0_host: str,
    is_rank0_role: bool,
) -> dict[str, Any]:
    """The PodTemplateSpec of a role's Job (shared by every replica: per-replica values are expanded
    from ``$(JOB_COMPLETION_INDEX)`` by Kubernetes).

    Args:
        role: the role, with macros already substituted.
        role_dns: the role's DNS-label name (the container's name).
        app_name: the app's name in the cluster (the Service, set as the pods' subdomain).
        labels: the pod labels.
        opts: the run options.
        rank0_host: the DNS name of rank 0.
        is_rank0_role: the role holding rank 0 (its replica 0 sees ``localhost``).
    """
    volumes, volume_mounts, privileged = _volumes(role)
    container = _container(role, role_dns, opts, rank0_host, is_rank0_role, volume_mounts)
    if privileged:
        container["securityContext"] = {"privileged": True}
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "subdomain": app_name,
        "enableServiceLinks": False,
        "containers": [container],
        "volumes": volumes,
    }
    node_selector = dict(opts.node_selector)
    itype = role.resource.capabilities.get(INSTANCE_TYPE_LABEL)
    if isinstance(itype, str) and itype:
        node_selector.setdefault(INSTANCE_TYPE_LABEL, itype)
    if node_selector:
        spec["nodeSelector"] = node_selector
    if opts.tolerations:
        spec["tolerations"] = [dict(t) for t in opts.tolerations]
    if opts.service_account:
        spec["serviceAccountName"] = opts.service_account
    if opts.priority_class:
        spec["priorityClassName"] = opts.priority_class
    if opts.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in opts.image_pull_secrets]
    template: dict[str, Any] = {
        "metadata": {"labels": dict(labels), "annotations": {ISTIO_SIDECAR_ANNOTATION: "false"}},
        "spec": spec,
    }
    overlays = [opts.pod_overlay]
    role_k8s = role.metadata.get("kubernetes")
    if isinstance(role_k8s, dict) and role_k8s.get("pod_overlay") is not None:
        role_overlay = role_k8s["pod_overlay"]
        problem = overlay_problem(role_overlay)
        if problem is not None:
            field_name = "metadata['kubernetes']['pod_overlay']"
            raise InvalidAppDefException(
                f"{field_name} must be {problem}, got {role_overlay!r}",
                role=role.name,
                field_name=field_name,
            )
        overlays.append(role_overlay)
    for overlay in overlays:
        if overlay:
            template = merge_overlay(template, overlay)
    return template


def _container(
    role: Role,
    role_dns: str,
    opts: KubernetesOptions,
    rank0_host: str,
    is_rank0_role: bool,
    volume_mounts: list[dict[str, Any]],
) -> dict[str, Any]:
    """The pod's one container (rank 0's replica 0 sees ``localhost`` as its rank 0 host)."""
    command = [role.entrypoint]
    rank0_env = rank0_host
    if is_rank0_role and opts.rank0_localhost:
        if role.num_replicas == 1:
            rank0_env = "localhost"
        else:
            command = ["/bin/sh", "-c", _RANK0_SCRIPT, "asynctorchx-rank0", role.entrypoint]
    container: dict[str, Any] = {
        "name": role_dns,
        "image": role.image,
        "command": command,
        "args": list(role.args),
        "env": _env(role, {RANK0_ENV: rank0_env}),
        "resources": resource_requirements(role, opts.reserved_millicpu, opts.reserved_memmb),
        "volumeMounts": volume_mounts,
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if opts.image_pull_policy:
        container["imagePullPolicy"] = opts.image_pull_policy
    ports = _ports(role)
    if ports:
        container["ports"] = ports
    return container


#: The most pods one Indexed Job may have (its parallelism; Kubernetes' validation).
MAX_INDEXED_PODS = 100_000


def _job_retry_spec(role: Role) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if role.max_retries > 0 and RetryPolicy(role.retry_policy) == RetryPolicy.REPLICA:
        spec["backoffLimitPerIndex"] = role.max_retries
        spec["maxFailedIndexes"] = 0
    else:
        spec["backoffLimit"] = 0
    spec["podFailurePolicy"] = {
        "rules": [
            {
                "action": "Ignore",
                "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
            }
        ]
    }
    spec["podReplacementPolicy"] = "Failed"
    return spec


def build_request(
    app: AppDef, opts: KubernetesOptions, session_name: str, app_name: str | None = None
) -> KubernetesRequest:
    """The Service and Jobs for ``app`` (validated, with a resolved cfg).

    Args:
        app: the app (not modified).
        opts: the run options.
        session_name: the session submitting it (recorded on the Service).
        app_name: the app's name in the cluster; a fresh unique one when None.

    Raises:
        InvalidAppDefException: a role cannot be represented on Kubernetes (the message names it).
    """
    role_dns = role_dns_names(app)
    name = app_name or new_app_name(app, role_dns)
    common = {**opts.labels, n.LABEL_MANAGED_BY: n.MANAGED_BY, n.LABEL_VERSION: __version__}
    app_labels = {**common, n.LABEL_APP_ID: name}
    annotations = {
        n.ANN_APP_NAME: app.name,
        n.ANN_SESSION: session_name,
        n.ANN_ROLES: json.dumps([r.name for r in app.roles]),
    }
    size = annotations_size(annotations)
    if size > MAX_ANNOTATIONS_SIZE:
        raise InvalidAppDefException(
            f"app name ({len(app.name)} characters) and session name ({len(session_name)}) are "
            f"too large for Kubernetes: kept as the Service's annotations, they make {size} bytes "
            f"of annotations where an object may have {MAX_ANNOTATIONS_SIZE} (256 KiB)",
            field_name="name",
        )
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": opts.namespace,
            "labels": dict(app_labels),
            "annotations": annotations,
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {n.LABEL_APP_ID: name},
        },
    }
    rank0_host = f"{n.pod_hostname(name, role_dns[0], 0)}.{name}"
    jobs = [
        _job(role, i, dns, name, app_labels, opts, rank0_host)
        for i, (role, dns) in enumerate(zip(app.roles, role_dns, strict=True))
    ]
    request = KubernetesRequest(
        namespace=opts.namespace, name=name, service=service, jobs=jobs, roles=list(app.roles)
    )
    problems = lint(request.manifests())
    if problems:
        raise InvalidAppDefException(
            "the Kubernetes objects for this app would be rejected: " + "; ".join(problems),
            field_name="kubernetes",
        )
    return request


def _job(
    role: Role,
    index: int,
    role_dns: str,
    app_name: str,
    app_labels: Mapping[str, str],
    opts: KubernetesOptions,
    rank0_host: str,
) -> dict[str, Any]:
    """The Indexed Job of the role at ``index`` (macros expanded per pod by Kubernetes).

    Raises:
        InvalidAppDefException: more replicas than an Indexed Job may run, more retries than
            its per-index backoff limit holds, an empty or whitespace-padded image, or a role too
            large for the Job's annotations (the API server would refuse the Job or its pods).
    """
    if role.num_replicas > MAX_INDEXED_PODS:
        raise InvalidAppDefException(
            f"num_replicas must be at most {MAX_INDEXED_PODS} on Kubernetes (the pods of one "
            f"Indexed Job), got {role.num_replicas}",
            role=role.name,
            field_name="num_replicas",
        )
    if not role.image or role.image != role.image.strip():
        raise InvalidAppDefException(
            f"image must be an image reference without surrounding whitespace on Kubernetes, "
            f"got {role.image!r}",
            role=role.name,
            field_name="image",
        )
    if "backoffLimitPerIndex" in _job_retry_spec(role) and role.max_retries > MAX_INT32:
        raise InvalidAppDefException(
            f"max_retries must be at most {MAX_INT32} on Kubernetes (a Job's backoffLimitPerIndex "
            f"is a 32-bit int), got {role.max_retries}",
            role=role.name,
            field_name="max_retries",
        )
    values = macros.Values(
        img_root="", app_id=app_name, replica_id=f"$({REPLICA_INDEX_ENV})", rank0_env=RANK0_ENV
    )
    labels = {
        **app_labels,
        n.LABEL_ROLE: role_dns,
        n.LABEL_APP_ATTEMPT: "0",
        n.LABEL_ROLE_ATTEMPT: "0",
    }
    template = pod_template(
        values.apply(role),
        role_dns,
        app_name=app_name,
        labels=labels,
        opts=opts,
        rank0_host=rank0_host,
        is_rank0_role=index == 0,
    )
    annotations = {n.ANN_ROLE: role_to_json(role), n.ANN_ROLE_INDEX: str(index)}
    size = annotations_size(annotations)
    if size > MAX_ANNOTATIONS_SIZE:
        big = max(("args", "env"), key=lambda f: len(json.dumps(getattr(role, f))))
        raise InvalidAppDefException(
            f"{big} is too large for Kubernetes: the role, kept as its Job's annotation, makes "
            f"{size} bytes of annotations where an object may have {MAX_ANNOTATIONS_SIZE} "
            "(256 KiB); pass large inputs through a file or a mounted volume",
            role=role.name,
            field_name=big,
        )
    job_labels = dict(labels)
    queued: dict[str, Any] = {}
    if opts.queue:
        # Kueue admits the Job by unsuspending it; pods and the Service are not labelled, so
        # that Kueue's pod integration never takes the Job's pods for workloads of their own
        job_labels[n.LABEL_KUEUE_QUEUE] = opts.queue
        queued["suspend"] = True
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": n.job_name(app_name, role_dns),
            "namespace": opts.namespace,
            "labels": job_labels,
            "annotations": annotations,
        },
        "spec": {
            "completionMode": "Indexed",
            "completions": role.num_replicas,
            "parallelism": role.num_replicas,
            **queued,
            **_job_retry_spec(role),
            "template": template,
        },
    }


def with_attempts(job: Mapping[str, Any], app_attempt: int, role_attempt: int) -> dict[str, Any]:
    """A copy of a Job manifest for a restart: attempt labels set, server-set fields dropped."""
    out = copy.deepcopy(dict(job))
    meta = out["metadata"]
    for key in ("uid", "resourceVersion", "creationTimestamp", "generation", "managedFields"):
        meta.pop(key, None)
    out.pop("status", None)
    for labels in (meta.setdefault("labels", {}), out["spec"]["template"]["metadata"]["labels"]):
        labels[n.LABEL_APP_ATTEMPT] = str(app_attempt)
        labels[n.LABEL_ROLE_ATTEMPT] = str(role_attempt)
    return out


def owned_by(job: Mapping[str, Any], service: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a Job manifest owned by the created Service (deleted with it)."""
    out = copy.deepcopy(dict(job))
    out["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "name": service["metadata"]["name"],
            "uid": service["metadata"]["uid"],
            "blockOwnerDeletion": True,
        }
    ]
    return out


# -- lint: what the OpenAPI schemas do not check -------------------------------------------------


#: the most bytes of annotations (keys and values) one object may have (the API's validation)
MAX_ANNOTATIONS_SIZE = 256 * 1024


def annotations_size(annotations: Mapping[str, Any]) -> int:
    """The size of annotations as the API server counts it: UTF-8 bytes of keys and values."""
    return sum(
        len(str(k).encode("utf-8", "replace")) + len(str(v).encode("utf-8", "replace"))
        for k, v in annotations.items()
    )


def is_quantity(value: object) -> bool:
    """True for a Kubernetes resource quantity (an int, or a string such as ``500m``, ``4Gi``)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 0
    return isinstance(value, str) and _QUANTITY.fullmatch(value) is not None


#: the resources whose request may be below the limit (the others must request their limit)
_OVERCOMMITTED = frozenset({"cpu", "memory", "ephemeral-storage"})
_QUANTITY_SUFFIXES: dict[str, Fraction] = {
    **{k: Fraction(v) for k, v in {**_SI_FACTORS, **_BINARY_FACTORS}.items()},
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
}


def quantity_value(value: object) -> Fraction | None:
    """The amount a Kubernetes quantity stands for (``500m`` is 1/2, ``1Ki`` 1024), or None when
    it is not a quantity."""
    if not is_quantity(value):
        return None
    if isinstance(value, int):
        return Fraction(value)
    text = str(value)
    match = re.fullmatch(r"([+-]?[0-9.]+)([eE][+-]?[0-9.]+)?([a-zA-Z]*)", text)
    if match is None:
        return None
    number, exponent, suffix = match.groups()
    try:
        amount = Fraction(number) * _QUANTITY_SUFFIXES[suffix]
        if exponent:
            amount *= Fraction(10) ** int(Fraction(exponent[1:]))
    except (KeyError, ValueError, ZeroDivisionError):
        return None
    return amount


def _lint_meta(kind: str, meta: Mapping[str, Any], problems: list[str]) -> None:
    for key, value in (meta.get("labels") or {}).items():
        if not n.is_label_key(key):
            problems.append(f"{kind} label key {key!r} is not valid")
        if not isinstance(value, str) or not n.is_label_value(value):
            problems.append(f"{kind} label {key}={value!r} is not a valid label value")
    for key in meta.get("annotations") or {}:
        if not n.is_label_key(key):
            problems.append(f"{kind} annotation key {key!r} is not valid")
    size = annotations_size(meta.get("annotations") or {})
    if size > MAX_ANNOTATIONS_SIZE:
        problems.append(
            f"{kind} annotations are {size} bytes, more than the {MAX_ANNOTATIONS_SIZE} an object "
            "may have"
        )


def _lint_pod_spec(where: str, spec: Mapping[str, Any], problems: list[str]) -> None:
    if spec.get("restartPolicy") not in ("Never", "OnFailure", "Always"):
        problems.append(
            f"{where}.restartPolicy {spec.get('restartPolicy')!r} is not an allowed value"
        )
    volume_names = {v.get("name") for v in spec.get("volumes") or []}
    for tol in spec.get("tolerations") or []:
        if tol.get("operator") not in ("Equal", "Exists"):
            problems.append(f"{where} toleration operator {tol.get('operator')!r} is not allowed")
        if "effect" in tol and tol["effect"] not in TOLERATION_EFFECTS:
            problems.append(f"{where} toleration effect {tol['effect']!r} is not allowed")
    for c in spec.get("containers") or []:
        cname = c.get("name", "")
        if not n.is_dns1123_label(cname):
            problems.append(f"{where} container name {cname!r} is not a DNS label")
        if c.get("imagePullPolicy", "Always") not in IMAGE_PULL_POLICIES:
            problems.append(f"{where} imagePullPolicy {c.get('imagePullPolicy')!r} is not allowed")
        for section in ("requests", "limits"):
            for rname, q in ((c.get("resources") or {}).get(section) or {}).items():
                if not is_quantity(q):
                    problems.append(f"{where} {section}[{rname!r}] = {q!r} is not a quantity")
        requests = (c.get("resources") or {}).get("requests") or {}
        limits = (c.get("resources") or {}).get("limits") or {}
        for rname in requests.keys() & limits.keys():
            request, limit = quantity_value(requests[rname]), quantity_value(limits[rname])
            if request is None or limit is None:
                continue
            if rname in _OVERCOMMITTED and request > limit:
                problems.append(
                    f"{where} container {cname!r} requests more {rname} than its limit "
                    f"({requests[rname]!r} > {limits[rname]!r})"
                )
            elif rname not in _OVERCOMMITTED and request != limit:
                problems.append(
                    f"{where} container {cname!r} requests of {rname!r} differ from its limit"
                )
        for e in c.get("env") or []:
            if not n.is_env_name(str(e.get("name", ""))):
                problems.append(f"{where} env name {e.get('name')!r} is not valid")
            if "value" in e and "valueFrom" in e:
                problems.append(
                    f"{where} container {cname!r} env {e.get('name')!r} has both value and "
                    "valueFrom"
                )
        for p in c.get("ports") or []:
            if "name" in p and not n.is_port_name(p["name"]):
                problems.append(f"{where} port name {p['name']!r} is not an IANA service name")
        paths: set[str] = set()
        for vm in c.get("volumeMounts") or []:
            if vm.get("name") not in volume_names:
                problems.append(f"{where} volumeMount {vm.get('name')!r} has no volume")
            path = vm.get("mountPath")
            if isinstance(path, str) and path in paths:
                problems.append(f"{where} mountPath {path!r} is mounted twice")
            paths.add(str(path))


def lint(objs: list[dict[str, Any]]) -> list[str]:
    """Problems in the backend's manifests that the OpenAPI schemas do not catch.

    Checks name lengths and syntax (DNS labels, label values, the pod hostname budget), the size of
    annotations, enum values, quantities, ``clusterIP: "None"`` as a string, and that each Job
    matches the Service.
    Returns an empty list when there are none.
    """
    problems: list[str] = []
    service = next((o for o in objs if o.get("kind") == "Service"), None)
    if service is None:
        problems.append("no Service")
    else:
        _lint_service(service, problems)
    for job in (o for o in objs if o.get("kind") == "Job"):
        _lint_job(job, service, problems)
    return problems


def _lint_service(service: Mapping[str, Any], problems: list[str]) -> None:
    meta = service["metadata"]
    service_name = meta.get("name", "")
    if not n.is_dns1035_label(service_name):
        problems.append(f"Service name {service_name!r} is not a DNS-1035 label (max 63)")
    _lint_meta("Service", meta, problems)
    spec = service.get("spec") or {}
    if spec.get("clusterIP") != "None":
        problems.append(
            f"Service clusterIP must be the string 'None', got {spec.get('clusterIP')!r}"
        )
    if spec.get("publishNotReadyAddresses") is not True:
        problems.append("Service publishNotReadyAddresses must be true")
    if not spec.get("selector"):
        problems.append("Service has no selector")


def _lint_job(
    job: Mapping[str, Any], service: Mapping[str, Any] | None, problems: list[str]
) -> None:
    meta = job["metadata"]
    name = meta.get("name", "")
    _lint_meta(f"Job {name}", meta, problems)
    if not n.is_dns1123_label(name):
        problems.append(f"Job name {name!r} is not a DNS label of at most 63 characters")
    spec = job["spec"]
    completions = spec.get("completions")
    if spec.get("completionMode") != "Indexed":
        problems.append(f"Job {name} completionMode must be Indexed")
    if (
        not isinstance(completions, int)
        or completions < 1
        or spec.get("parallelism") != completions
    ):
        problems.append(f"Job {name} completions and parallelism must be the same positive int")
    else:
        host = f"{name}-{completions - 1}"
        if not n.is_dns1123_label(host):
            problems.append(f"pod hostname {host!r} of Job {name} exceeds 63 characters")
    if spec.get("podReplacementPolicy") not in (None, "Failed", "TerminatingOrFailed"):
        problems.append(f"Job {name} podReplacementPolicy {spec.get('podReplacementPolicy')!r}")
    if "podFailurePolicy" in spec and spec.get("podReplacementPolicy") not in (None, "Failed"):
        problems.append(f"Job {name} with a podFailurePolicy needs podReplacementPolicy Failed")
    for rule in (spec.get("podFailurePolicy") or {}).get("rules") or []:
        if rule.get("action") not in ("Ignore", "FailJob", "FailIndex", "Count"):
            problems.append(f"Job {name} podFailurePolicy action {rule.get('action')!r}")
    if "maxFailedIndexes" in spec and "backoffLimitPerIndex" not in spec:
        problems.append(f"Job {name} maxFailedIndexes needs backoffLimitPerIndex")
    template = spec.get("template") or {}
    _lint_meta(f"Job {name} template", template.get("metadata") or {}, problems)
    pod_spec = template.get("spec") or {}
    _lint_pod_spec(f"Job {name}", pod_spec, problems)
    if (spec.get("podFailurePolicy") or "backoffLimitPerIndex" in spec) and pod_spec.get(
        "restartPolicy"
    ) != "Never":
        problems.append(f"Job {name} needs restartPolicy Never for its failure policies")
    if service is not None:
        service_name = service["metadata"].get("name", "")
        if pod_spec.get("subdomain") != service_name:
            problems.append(f"Job {name} pods' subdomain must be the Service {service_name!r}")
        selector = (service.get("spec") or {}).get("selector") or {}
        labels = (template.get("metadata") or {}).get("labels") or {}
        if any(labels.get(k) != v for k, v in selector.items()):
            problems.append(f"Job {name} pods are not selected by the Service")
