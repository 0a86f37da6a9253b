"""TorchX's own spec objects, converted field by field to ours and back (pure, no I/O).

A component file written for TorchX returns ``torchx.specs.AppDef`` when the ``torchx`` package is
installed. ``appdef_from_torchx`` turns it into an ``asynctorchx.specs.AppDef`` holding the same
values (roles, resources with capabilities and devices, mounts, retry policies, macros in args, env
and metadata, port maps, ``min_replicas``...); ``appdef_to_torchx`` goes the other way. Both are
exact: converting there and back gives an equal object.

Objects are recognised by the module their class comes from (``torchx`` or one of its submodules)
and their class name, so this module never imports ``torchx`` unless asked to build TorchX objects.
A field that TorchX has and asynctorchx does not (e.g. a newer TorchX's ``Role.overrides``) is
converted when it holds its default and is an error naming it otherwise: nothing is dropped
silently.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable
from types import ModuleType
from typing import Any

from asynctorchx.specs.api import (
    AppDef,
    BindMount,
    DeviceMount,
    InvalidAppDefException,
    Mount,
    Resource,
    RetryPolicy,
    Role,
    VolumeMount,
)

_APPDEF_FIELDS = ("name", "roles", "metadata")
_ROLE_FIELDS = (
    "name",
    "image",
    "min_replicas",
    "base_image",
    "entrypoint",
    "args",
    "env",
    "num_replicas",
    "max_retries",
    "retry_policy",
    "resource",
    "port_map",
    "metadata",
    "mounts",
)
_RESOURCE_FIELDS = ("cpu", "gpu", "memMB", "capabilities", "devices")
_MOUNT_FIELDS = {
    "BindMount": ("src_path", "dst_path", "read_only"),
    "VolumeMount": ("src", "dst_path", "read_only"),
    "DeviceMount": ("src_path", "dst_path", "permissions"),
}


class TorchXConversionError(InvalidAppDefException):
    """Raised when a TorchX object holds something asynctorchx has no counterpart for."""


class TorchXUnsupportedError(Exception):
    """Raised when a component file written for TorchX uses a TorchX API with no counterpart here.

    Raised through its two subclasses, so that ``hasattr`` probes and ``try: import ... except
    ImportError`` in component files keep working.
    """


class TorchXMissingAttribute(TorchXUnsupportedError, AttributeError):
    """A name of a TorchX module (``torchx.specs.Workspace``) that asynctorchx does not provide."""


class TorchXMissingModule(TorchXUnsupportedError, ModuleNotFoundError):
    """A TorchX module (``torchx.schedulers``) that asynctorchx does not provide."""


def describe_type(obj: object) -> str:
    """``ClassName (module.name)``, for messages about an object of an unexpected type."""
    cls = type(obj)
    return f"{cls.__qualname__} (module {cls.__module__})"


def is_torchx_object(obj: object, class_name: str | None = None) -> bool:
    """True when ``obj``'s class (or a base) comes from the ``torchx`` package [and is named so]."""
    for cls in type(obj).__mro__:
        module = getattr(cls, "__module__", "") or ""
        if (module == "torchx" or module.startswith("torchx.")) and (
            class_name is None or cls.__name__ == class_name
        ):
            return True
    return False


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _check_known_fields(obj: object, known: Iterable[str], where: str) -> None:
    """Raises naming the first field of ``obj`` we have no counterpart for that is not at its default."""
    if not dataclasses.is_dataclass(obj):
        return
    known_set = set(known)
    for f in dataclasses.fields(obj):
        if f.name in known_set:
            continue
        value = getattr(obj, f.name, dataclasses.MISSING)
        default = _default_of(f)
        if default is dataclasses.MISSING or value != default:
            raise TorchXConversionError(
                f"{where}.{f.name} = {value!r} has no counterpart in asynctorchx "
                f"(TorchX {type(obj).__name__} field unknown here)",
                field_name=f"{where}.{f.name}",
            )


def _plain(value: Any) -> Any:
    """A deep copy of metadata/capabilities; TorchX enums inside become their values."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return copy.deepcopy(value)


def resource_from_torchx(res: Any, where: str = "resource") -> Resource:
    """Our ``Resource`` with the values of a ``torchx.specs.Resource``."""
    if not is_torchx_object(res, "Resource"):
        raise TorchXConversionError(
            f"{where} must be a Resource, got {describe_type(res)}", field_name=where
        )
    _check_known_fields(res, _RESOURCE_FIELDS, where)
    return Resource(
        cpu=res.cpu,
        gpu=res.gpu,
        memMB=res.memMB,
        capabilities=_plain(dict(res.capabilities)),
        devices=dict(res.devices),
    )


def _mount_from_torchx(mount: Any, where: str) -> Mount:
    for name, fields in _MOUNT_FIELDS.items():
        if is_torchx_object(mount, name):
            _check_known_fields(mount, fields, where)
            values = [getattr(mount, f) for f in fields]
            if name == "BindMount":
                return BindMount(*values)
            if name == "VolumeMount":
                return VolumeMount(*values)
            return DeviceMount(*values)
    raise TorchXConversionError(
        f"{where} must be a BindMount, VolumeMount or DeviceMount, got {describe_type(mount)}",
        field_name=where,
    )


def _retry_policy_from_torchx(policy: Any, where: str) -> RetryPolicy:
    value = getattr(policy, "value", policy)
    try:
        return RetryPolicy(value)
    except ValueError:
        raise TorchXConversionError(
            f"{where} = {value!r} has no counterpart in asynctorchx "
            f"(retry policies here: {', '.join(p.value for p in RetryPolicy)})",
            field_name=where,
        ) from None


def role_from_torchx(role: Any, where: str = "role") -> Role:
    """Our ``Role`` with the values of a ``torchx.specs.Role``.

    Raises:
        TorchXConversionError: a field we have no counterpart for holds a value, or the role's class
            overrides ``pre_proc`` (a hook that changes a TorchX scheduler's request).
    """
    if not is_torchx_object(role, "Role"):
        raise TorchXConversionError(
            f"{where} must be a Role, got {describe_type(role)}", field_name=where
        )
    where = f"{where}[{role.name!r}]" if isinstance(getattr(role, "name", None), str) else where
    base: Any = next(c for c in type(role).__mro__ if c.__name__ == "Role")
    if getattr(type(role), "pre_proc", None) is not getattr(base, "pre_proc", None):
        raise TorchXConversionError(
            f"{where} is a {describe_type(role)} overriding pre_proc, which changes a TorchX "
            "scheduler's request: that hook has no counterpart in asynctorchx",
            field_name=f"{where}.pre_proc",
        )
    _check_known_fields(role, _ROLE_FIELDS, where)
    return Role(
        name=role.name,
        image=role.image,
        entrypoint=role.entrypoint,
        args=list(role.args),
        env=dict(role.env),
        num_replicas=role.num_replicas,
        min_replicas=role.min_replicas,
        max_retries=role.max_retries,
        retry_policy=_retry_policy_from_torchx(role.retry_policy, f"{where}.retry_policy"),
        resource=resource_from_torchx(role.resource, f"{where}.resource"),
        port_map=dict(role.port_map),
        metadata=_plain(dict(role.metadata)),
        mounts=[_mount_from_torchx(m, f"{where}.mounts[{i}]") for i, m in enumerate(role.mounts)],
        base_image=role.base_image,
    )


def appdef_from_torchx(app: Any) -> AppDef:
    """Our ``AppDef`` with the values of a ``torchx.specs.AppDef`` (the original is not changed).

    Raises:
        TorchXConversionError: ``app`` is not a TorchX AppDef, or holds something with no
            counterpart here (the message names the field).
    """
    if not is_torchx_object(app, "AppDef"):
        raise TorchXConversionError(
            f"expected a torchx.specs.AppDef, got {describe_type(app)}", field_name="app"
        )
    _check_known_fields(app, _APPDEF_FIELDS, "app")
    return AppDef(
        name=app.name,
        roles=[role_from_torchx(r, f"roles[{i}]") for i, r in enumerate(app.roles)],
        metadata=_plain(dict(app.metadata)),
    )


def _torchx_specs(specs: ModuleType | None) -> ModuleType:
    if specs is not None:
        return specs
    import importlib

    try:
        return importlib.import_module("torchx.specs")
    except ImportError as e:
        raise ImportError(
            f"building TorchX objects needs the torchx package (pip install torchx): {e}"
        ) from None


def resource_to_torchx(res: Resource, specs: ModuleType | None = None) -> Any:
    """A ``torchx.specs.Resource`` with the values of ours."""
    tx = _torchx_specs(specs)
    return tx.Resource(
        cpu=res.cpu,
        gpu=res.gpu,
        memMB=res.memMB,
        capabilities=_plain(dict(res.capabilities)),
        devices=dict(res.devices),
    )


def _mount_to_torchx(mount: Mount, tx: ModuleType) -> Any:
    if isinstance(mount, BindMount):
        return tx.BindMount(mount.src_path, mount.dst_path, mount.read_only)
    if isinstance(mount, VolumeMount):
        return tx.VolumeMount(mount.src, mount.dst_path, mount.read_only)
    return tx.DeviceMount(mount.src_path, mount.dst_path, mount.permissions)


def role_to_torchx(role: Role, specs: ModuleType | None = None) -> Any:
    """A ``torchx.specs.Role`` with the values of ours."""
    tx = _torchx_specs(specs)
    return tx.Role(
        name=role.name,
        image=role.image,
        min_replicas=role.min_replicas,
        base_image=role.base_image,
        entrypoint=role.entrypoint,
        args=list(role.args),
        env=dict(role.env),
        num_replicas=role.num_replicas,
        max_retries=role.max_retries,
        retry_policy=tx.RetryPolicy(RetryPolicy(role.retry_policy).value),
        resource=resource_to_torchx(role.resource, tx),
        port_map=dict(role.port_map),
        metadata=_plain(dict(role.metadata)),
        mounts=[_mount_to_torchx(m, tx) for m in role.mounts],
    )


def appdef_to_torchx(app: AppDef, specs: ModuleType | None = None) -> Any:
    """A ``torchx.specs.AppDef`` with the values of ours (needs the ``torchx`` package).

    Args:
        app: the app (not changed).
        specs: TorchX's ``torchx.specs`` module (default: imported).
    """
    tx = _torchx_specs(specs)
    return tx.AppDef(
        name=app.name,
        roles=[role_to_torchx(r, tx) for r in app.roles],
        metadata=_plain(dict(app.metadata)),
    )
