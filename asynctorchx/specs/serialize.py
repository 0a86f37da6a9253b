"""AppDefs, roles and mounts as JSON-ready dicts (pure), for backends that store the app they run.

The local backend keeps the AppDef in each app's record; the Kubernetes backend keeps each role on
its Job. Both store the same shape, so that ``describe`` gives back the roles as submitted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from asynctorchx.specs.api import (
    AppDef,
    BindMount,
    DeviceMount,
    Resource,
    RetryPolicy,
    Role,
    VolumeMount,
)

Mount = BindMount | VolumeMount | DeviceMount


def mount_to_dict(m: Mount) -> dict[str, Any]:
    """A mount as a dict with a ``type`` of ``bind``, ``volume`` or ``device``."""
    if isinstance(m, BindMount):
        return {
            "type": "bind",
            "src_path": m.src_path,
            "dst_path": m.dst_path,
            "read_only": m.read_only,
        }
    if isinstance(m, VolumeMount):
        return {"type": "volume", "src": m.src, "dst_path": m.dst_path, "read_only": m.read_only}
    return {
        "type": "device",
        "src_path": m.src_path,
        "dst_path": m.dst_path,
        "permissions": m.permissions,
    }


def mount_from_dict(d: Mapping[str, Any]) -> Mount:
    """The mount ``mount_to_dict`` made.

    Raises:
        ValueError: an unknown mount type.
        KeyError: a field is missing.
    """
    kind = d.get("type")
    if kind == "bind":
        return BindMount(d["src_path"], d["dst_path"], bool(d.get("read_only", False)))
    if kind == "volume":
        return VolumeMount(d["src"], d["dst_path"], bool(d.get("read_only", False)))
    if kind == "device":
        return DeviceMount(d["src_path"], d["dst_path"], d.get("permissions", "rwm"))
    raise ValueError(f"unknown mount type {kind!r} (expected bind, volume or device)")


def role_to_dict(role: Role) -> dict[str, Any]:
    """A role as a JSON-ready dict (``base_image`` only when set)."""
    res = role.resource
    out: dict[str, Any] = {
        "name": role.name,
        "image": role.image,
        "entrypoint": role.entrypoint,
        "args": list(role.args),
        "env": dict(role.env),
        "num_replicas": role.num_replicas,
        "min_replicas": role.min_replicas,
        "max_retries": role.max_retries,
        "retry_policy": RetryPolicy(role.retry_policy).value,
        "resource": {
            "cpu": res.cpu,
            "gpu": res.gpu,
            "memMB": res.memMB,
            "capabilities": dict(res.capabilities),
            "devices": dict(res.devices),
        },
        "port_map": dict(role.port_map),
        "metadata": dict(role.metadata),
        "mounts": [mount_to_dict(m) for m in role.mounts],
    }
    if role.base_image is not None:
        out["base_image"] = role.base_image
    return out


def role_from_dict(d: Mapping[str, Any]) -> Role:
    """The role ``role_to_dict`` made.

    Raises:
        KeyError: ``name`` is missing.
        ValueError, TypeError: a field has a value of the wrong kind.
    """
    res = d.get("resource") or {}
    return Role(
        name=d["name"],
        image=d.get("image", ""),
        entrypoint=d.get("entrypoint", ""),
        args=list(d.get("args") or []),
        env=dict(d.get("env") or {}),
        num_replicas=int(d.get("num_replicas", 1)),
        min_replicas=d.get("min_replicas"),
        max_retries=int(d.get("max_retries", 0)),
        retry_policy=RetryPolicy(d.get("retry_policy", RetryPolicy.APPLICATION.value)),
        resource=Resource(
            cpu=res.get("cpu", -1),
            gpu=res.get("gpu", -1),
            memMB=res.get("memMB", -1),
            capabilities=dict(res.get("capabilities") or {}),
            devices=dict(res.get("devices") or {}),
        ),
        port_map=dict(d.get("port_map") or {}),
        metadata=dict(d.get("metadata") or {}),
        mounts=[mount_from_dict(m) for m in d.get("mounts") or []],
        base_image=d.get("base_image"),
    )


def appdef_to_dict(app: AppDef) -> dict[str, Any]:
    """An AppDef as a JSON-ready dict (``appdef_from_dict`` inverts it)."""
    return {
        "name": app.name,
        "metadata": dict(app.metadata),
        "roles": [role_to_dict(r) for r in app.roles],
    }


def appdef_from_dict(d: Mapping[str, Any]) -> AppDef:
    """The AppDef ``appdef_to_dict`` made (see ``role_from_dict`` for what it raises)."""
    return AppDef(
        name=d.get("name", ""),
        roles=[role_from_dict(r) for r in d.get("roles", [])],
        metadata=dict(d.get("metadata", {})),
    )
