"""The fake API server's storage: objects, resourceVersions, the watch history, label selectors.

Semantics follow the real API server where the backend depends on them:

- one global, increasing ``resourceVersion`` (as etcd's revision), returned on every object and list;
- a bounded history of change events; ``compact()`` forgets it, so that a watch resuming from an
  older version gets ``410 Gone`` (reason ``Expired``), as after etcd compaction;
- ``generateName``, ``uid``, ``creationTimestamp`` (seconds, UTC), ``generation``;
- deletion with ``propagationPolicy``: ``Orphan`` (the default for ``batch/v1`` Jobs) strips the
  owner from dependents, ``Background`` deletes at once and leaves the dependents to the garbage
  collector, ``Foreground`` keeps the object (``deletionTimestamp`` + the ``foregroundDeletion``
  finalizer) until the collector has deleted its blocking dependents;
- pods are deleted gracefully: they get a ``deletionTimestamp`` and disappear once the fake kubelet
  has stopped their container (``finalize_delete``).
"""

from __future__ import annotations

import copy
import itertools
import random
import re
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

RESOURCES: dict[str, tuple[str, str]] = {
    "services": ("v1", "Service"),
    "jobs": ("batch/v1", "Job"),
    "pods": ("v1", "Pod"),
}
DEFAULT_PROPAGATION = {"jobs": "Orphan", "services": "Background", "pods": "Background"}
FOREGROUND_FINALIZER = "foregroundDeletion"

_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_GENERATE_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"


def now_rfc3339() -> str:
    """Now, as the API server writes metav1.Time (seconds, UTC)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiError(Exception):
    """An API error, rendered as a ``Status`` body by the server."""

    def __init__(
        self, code: int, reason: str, message: str, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
        }
        if self.details is not None:
            body["details"] = self.details
        body["code"] = self.code
        return body


def not_found(resource: str, name: str) -> ApiError:
    group = "batch" if resource == "jobs" else ""
    details: dict[str, Any] = {"name": name, "kind": resource}
    if group:
        details["group"] = group
    qualified = f"{resource}.{group}" if group else resource
    return ApiError(404, "NotFound", f'{qualified} "{name}" not found', details)


# -- label selectors ------------------------------------------------------------------------------

_SET_REQ = re.compile(r"\s*([^\s,!=()]+)\s+(in|notin)\s+\(([^)]*)\)\s*")


def parse_selector(selector: str) -> list[Callable[[dict[str, str]], bool]]:
    """Parses a label selector (``a=b``, ``a==b``, ``a!=b``, ``a in (x,y)``, ``a notin (x)``, ``a``, ``!a``).

    Raises:
        ApiError: 400 BadRequest for a selector that does not parse.
    """
    reqs: list[Callable[[dict[str, str]], bool]] = []
    rest = selector.strip()
    while rest:
        m = _SET_REQ.match(rest)
        if m:
            key, op, values = (
                m.group(1),
                m.group(2),
                {v.strip() for v in m.group(3).split(",") if v.strip()},
            )
            if op == "in":
                reqs.append(lambda lab, k=key, vs=values: lab.get(k) in vs)
            else:
                reqs.append(lambda lab, k=key, vs=values: lab.get(k) not in vs)
            rest = rest[m.end() :]
        else:
            part, _, rest = rest.partition(",")
            part = part.strip()
            if "!=" in part:
                k, v = (x.strip() for x in part.split("!=", 1))
                reqs.append(lambda lab, k=k, v=v: lab.get(k) != v)
            elif "==" in part or "=" in part:
                k, v = (x.strip() for x in re.split("==?", part, maxsplit=1))
                reqs.append(lambda lab, k=k, v=v: lab.get(k) == v)
            elif part.startswith("!"):
                absent = part[1:].strip()
                reqs.append(lambda lab, k=absent: k not in lab)
            elif part:
                if not re.fullmatch(r"[A-Za-z0-9./_-]+", part):
                    raise ApiError(400, "BadRequest", f"unable to parse requirement: {part!r}")
                reqs.append(lambda lab, k=part: k in lab)
            rest = rest.lstrip(", ")
            continue
        rest = rest.lstrip(", ")
    return reqs


def matches(obj: dict[str, Any] | None, reqs: list[Callable[[dict[str, str]], bool]]) -> bool:
    if obj is None:
        return False
    lab = (obj.get("metadata") or {}).get("labels") or {}
    return all(r(lab) for r in reqs)


# -- events ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """One change: ``type`` is ADDED, MODIFIED or DELETED; ``old`` is the previous object."""

    rv: int
    resource: str
    namespace: str
    type: str
    obj: dict[str, Any]
    old: dict[str, Any] | None


@dataclass(frozen=True)
class Request:
    """One HTTP request the server received (for assertions)."""

    method: str
    path: str
    query: dict[str, str]
    body: Any


class Store:
    """Objects by (resource, namespace, name), with a change history for watches."""

    def __init__(self, history_limit: int = 100_000) -> None:
        self.rv = 1000
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.history: list[Event] = []
        self.history_limit = history_limit
        self.compacted_rv = 0
        self.listeners: list[Callable[[Event], None]] = []
        self.requests: list[Request] = []
        self._names = itertools.count()

    # -- helpers ---------------------------------------------------------------------------------

    def _bump(self) -> int:
        self.rv += 1
        return self.rv

    def _emit(
        self, type_: str, resource: str, obj: dict[str, Any], old: dict[str, Any] | None
    ) -> None:
        ev = Event(self.rv, resource, obj["metadata"]["namespace"], type_, obj, old)
        self.history.append(ev)
        if len(self.history) > self.history_limit:
            dropped = self.history[: len(self.history) - self.history_limit]
            self.compacted_rv = dropped[-1].rv
            del self.history[: len(dropped)]
        for listener in list(self.listeners):
            listener(ev)

    def compact(self) -> None:
        """Forgets the history, as etcd compaction does after other writes in the cluster: the
        revision moves on and resuming a watch from any version seen so far gets 410 Gone."""
        self.rv += 1
        self.compacted_rv = self.rv
        self.history.clear()

    def subscribe(self, listener: Callable[[Event], None]) -> Callable[[], None]:
        self.listeners.append(listener)
        return lambda: self.listeners.remove(listener) if listener in self.listeners else None

    def events_since(self, rv: int) -> list[Event]:
        """The history after ``rv``. Raises 410 Expired when it has been compacted."""
        if rv < self.compacted_rv:
            raise ApiError(410, "Expired", f"too old resource version: {rv} ({self.compacted_rv})")
        return [e for e in self.history if e.rv > rv]

    # -- validation ------------------------------------------------------------------------------

    def _validate_meta(self, resource: str, meta: dict[str, Any]) -> None:
        name = meta.get("name", "")
        kind = RESOURCES[resource][1]
        ok = (
            _DNS1035_LABEL.fullmatch(name) and len(name) <= 63
            if resource == "services"
            else _SUBDOMAIN.fullmatch(name) and len(name) <= 253
        )
        if not ok:
            what = (
                "a DNS-1035 label" if resource == "services" else "a lowercase RFC 1123 subdomain"
            )
            raise ApiError(
                422,
                "Invalid",
                f'{kind} "{name}" is invalid: metadata.name: Invalid value: "{name}": must be {what}',
                {"name": name, "kind": resource},
            )
        for value in (meta.get("labels") or {}).values():
            if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
                raise ApiError(
                    422,
                    "Invalid",
                    f'{kind} "{name}" is invalid: metadata.labels: Invalid value: "{value}": '
                    "a valid label must be an empty string or consist of alphanumeric characters, "
                    "'-', '_' or '.', and must start and end with an alphanumeric character "
                    "(max 63 characters)",
                    {"name": name, "kind": resource},
                )
        if resource == "jobs" and "job-name" in (meta.get("labels") or {}):
            pass

    # -- verbs -----------------------------------------------------------------------------------

    def create(self, resource: str, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(body)
        api_version, kind = RESOURCES[resource]
        meta = obj.setdefault("metadata", {})
        if meta.get("namespace", namespace) != namespace:
            raise ApiError(
                400,
                "BadRequest",
                "the namespace of the provided object does not match the namespace sent on the request",
            )
        if not meta.get("name"):
            prefix = meta.get("generateName")
            if not prefix:
                raise ApiError(422, "Invalid", f"{kind} is invalid: metadata.name: Required value")
            meta["name"] = prefix + "".join(random.choices(_GENERATE_ALPHABET, k=5))
        self._validate_meta(resource, meta)
        key = (resource, namespace, meta["name"])
        if key in self.objects:
            group = "batch" if resource == "jobs" else ""
            qualified = f"{resource}.{group}" if group else resource
            raise ApiError(
                409,
                "AlreadyExists",
                f'{qualified} "{meta["name"]}" already exists',
                {"name": meta["name"], "kind": resource, **({"group": group} if group else {})},
            )
        for ref in meta.get("ownerReferences") or []:
            if not ref.get("uid"):
                raise ApiError(
                    422,
                    "Invalid",
                    f"{kind} is invalid: metadata.ownerReferences.uid: Invalid value",
                )
        obj["apiVersion"], obj["kind"] = api_version, kind
        meta["namespace"] = namespace
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        meta["resourceVersion"] = str(self._bump())
        if resource == "jobs":
            meta["generation"] = 1
            _default_job(obj)
        elif resource == "services":
            _default_service(obj)
        elif resource == "pods":
            obj.setdefault("status", {"phase": "Pending", "qosClass": _qos(obj)})
        self.objects[key] = obj
        self._emit("ADDED", resource, obj, None)
        return copy.deepcopy(obj)

    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any]:
        obj = self.objects.get((resource, namespace, name))
        if obj is None:
            raise not_found(resource, name)
        return copy.deepcopy(obj)

    def find(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        obj = self.objects.get((resource, namespace, name))
        return None if obj is None else copy.deepcopy(obj)

    def peek(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The stored object itself (not a copy): read it, never change it."""
        return self.objects.get((resource, namespace, name))

    def list(
        self, resource: str, namespace: str | None, selector: str = "", *, deep: bool = True
    ) -> list[dict[str, Any]]:
        """Copies of the matching objects (``deep=False``: top-level copies, for serializing)."""
        reqs = parse_selector(selector)
        return [
            copy.deepcopy(o) if deep else dict(o)
            for (r, ns, _), o in sorted(self.objects.items())
            if r == resource and (namespace is None or ns == namespace) and matches(o, reqs)
        ]

    def replace(self, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Writes a new version of an existing object (controllers' status and spec updates).

        Stored objects are never changed in place: ``obj`` must not share the nested dicts it changed
        with the stored version (build new ones, or work on a ``find`` copy).
        """
        meta = obj["metadata"]
        key = (resource, meta["namespace"], meta["name"])
        old = self.objects.get(key)
        if old is None:
            raise not_found(resource, meta["name"])
        new = dict(obj)
        new["metadata"] = dict(obj["metadata"], resourceVersion=str(self._bump()))
        if resource == "jobs" and new.get("spec") != old.get("spec"):
            new["metadata"]["generation"] = int(old["metadata"].get("generation", 1)) + 1
        self.objects[key] = new
        self._emit("MODIFIED", resource, new, old)
        return new

    def patch(
        self, resource: str, namespace: str, name: str, patch: dict[str, Any]
    ) -> dict[str, Any]:
        current = self.get(resource, namespace, name)
        merged = _merge_patch(current, patch)
        merged["metadata"]["name"], merged["metadata"]["namespace"] = name, namespace
        merged["metadata"]["uid"] = current["metadata"]["uid"]
        return self.replace(resource, merged)

    def delete(
        self, resource: str, namespace: str, name: str, policy: str | None
    ) -> dict[str, Any]:
        """Deletes with a propagation policy (see the module docstring); returns the object."""
        key = (resource, namespace, name)
        obj = self.objects.get(key)
        if obj is None:
            raise not_found(resource, name)
        policy = policy or DEFAULT_PROPAGATION[resource]
        if policy not in ("Orphan", "Background", "Foreground"):
            raise ApiError(400, "BadRequest", f"unsupported propagationPolicy {policy!r}")
        if obj["metadata"].get("deletionTimestamp"):
            return copy.deepcopy(obj)
        uid = obj["metadata"]["uid"]
        if policy == "Orphan":
            for (r, ns, _), dep in list(self.objects.items()):
                refs = dep["metadata"].get("ownerReferences") or []
                if ns == namespace and any(ref.get("uid") == uid for ref in refs):
                    new = copy.deepcopy(dep)
                    new["metadata"]["ownerReferences"] = [x for x in refs if x.get("uid") != uid]
                    self.replace(r, new)
        if resource == "pods" or policy == "Foreground":
            new = copy.deepcopy(obj)
            new["metadata"]["deletionTimestamp"] = now_rfc3339()
            if resource == "pods":
                new["metadata"]["deletionGracePeriodSeconds"] = 30
            if policy == "Foreground":
                finalizers = new["metadata"].setdefault("finalizers", [])
                if FOREGROUND_FINALIZER not in finalizers:
                    finalizers.append(FOREGROUND_FINALIZER)
            return self.replace(resource, new)
        return self.remove(resource, namespace, name)

    def remove(self, resource: str, namespace: str, name: str) -> dict[str, Any]:
        """Removes an object for good (end of a deletion), emitting DELETED."""
        obj = dict(self.objects.pop((resource, namespace, name)))
        self._bump()
        obj["metadata"] = dict(obj["metadata"], resourceVersion=str(self.rv))
        self._emit("DELETED", resource, obj, None)
        return obj

    def finalize_delete(self, resource: str, namespace: str, name: str) -> None:
        """Completes a graceful or foreground deletion once nothing blocks it any more."""
        if (resource, namespace, name) in self.objects:
            self.remove(resource, namespace, name)

    def dependents(self, uid: str, namespace: str) -> list[tuple[str, dict[str, Any]]]:
        return [
            (r, o)
            for (r, ns, _), o in self.objects.items()
            if ns == namespace
            and any(ref.get("uid") == uid for ref in o["metadata"].get("ownerReferences") or [])
        ]

    def owned(self, resource: str, namespace: str, uid: str) -> list[dict[str, Any]]:
        """The objects of ``resource`` in ``namespace`` that ``uid`` owns (stored ones: read only)."""
        return [
            o
            for (r, ns, _), o in self.objects.items()
            if r == resource
            and ns == namespace
            and any(ref.get("uid") == uid for ref in o["metadata"].get("ownerReferences") or [])
        ]

    def uids(self) -> set[str]:
        return {o["metadata"]["uid"] for o in self.objects.values()}


def _merge_patch(base: Any, patch: Any) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = _merge_patch(out.get(k), v)
        return out
    return copy.deepcopy(patch)


def _qos(pod: dict[str, Any]) -> str:
    containers = (pod.get("spec") or {}).get("containers") or []
    res = [(c.get("resources") or {}) for c in containers]
    if res and all(r.get("limits") and r.get("limits") == r.get("requests") for r in res):
        return "Guaranteed"
    if any(r.get("limits") or r.get("requests") for r in res):
        return "Burstable"
    return "BestEffort"


def _default_job(job: dict[str, Any]) -> None:
    """Fills the defaults the API server sets on a created Job (selector and template labels)."""
    uid = job["metadata"]["uid"]
    name = job["metadata"]["name"]
    spec = job.setdefault("spec", {})
    spec.setdefault("completionMode", "NonIndexed")
    spec.setdefault("parallelism", 1)
    spec.setdefault("completions", spec["parallelism"])
    if "backoffLimitPerIndex" in spec:
        spec.setdefault("backoffLimit", 2147483647)
    else:
        spec.setdefault("backoffLimit", 6)
    spec.setdefault("manualSelector", False)
    spec.setdefault("suspend", False)
    spec.setdefault(
        "podReplacementPolicy", "Failed" if spec.get("podFailurePolicy") else "TerminatingOrFailed"
    )
    generated = {
        "batch.kubernetes.io/controller-uid": uid,
        "batch.kubernetes.io/job-name": name,
        "controller-uid": uid,
        "job-name": name,
    }
    spec["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
    tmeta = spec.setdefault("template", {}).setdefault("metadata", {})
    tmeta["labels"] = {**(tmeta.get("labels") or {}), **generated}
    job["metadata"]["labels"] = {**(job["metadata"].get("labels") or {}), **generated}
    pod_spec = spec["template"].setdefault("spec", {})
    pod_spec.setdefault("dnsPolicy", "ClusterFirst")
    pod_spec.setdefault("schedulerName", "default-scheduler")
    pod_spec.setdefault("securityContext", {})
    pod_spec.setdefault("terminationGracePeriodSeconds", 30)
    job["status"] = {}


def _default_service(svc: dict[str, Any]) -> None:
    spec = svc.setdefault("spec", {})
    spec.setdefault("type", "ClusterIP")
    spec.setdefault("sessionAffinity", "None")
    if spec.get("clusterIP") == "None":
        spec["clusterIPs"] = ["None"]
    spec.setdefault("ipFamilies", ["IPv4"])
    spec.setdefault("ipFamilyPolicy", "SingleStack")
    spec.setdefault("internalTrafficPolicy", "Cluster")
    svc["status"] = {"loadBalancer": {}}


def random_suffix(n: int = 5) -> str:
    return "".join(random.choices(string.ascii_lowercase + string.digits, k=n))
