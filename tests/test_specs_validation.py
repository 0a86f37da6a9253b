"""AppDef/Role validation names the role, the field and the value; no specs API mutates its input."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest

from asynctorchx.specs import (
    MISSING,
    NULL_RESOURCE,
    AppDef,
    AppDryRunInfo,
    BindMount,
    DeviceMount,
    InvalidAppDefException,
    Resource,
    RetryPolicy,
    Role,
    macros,
    replace_role,
    resource,
    validate_app,
)


def _role(**kw: Any) -> Role:
    args: dict[str, Any] = {"name": "trainer", "image": "/img", "entrypoint": "python"}
    args.update(kw)
    return Role(**args)


def _app(*roles: Role) -> AppDef:
    return AppDef(name="app", roles=list(roles) or [_role()])


def test_role_defaults_match_torchx() -> None:
    """A Role's defaults: MISSING entrypoint, one replica, no retries, APPLICATION policy, NULL_RESOURCE."""
    r = Role(name="r", image="i")
    assert r.entrypoint == MISSING
    assert (r.num_replicas, r.max_retries, r.min_replicas) == (1, 0, None)
    assert r.retry_policy == RetryPolicy.APPLICATION
    assert r.resource == NULL_RESOURCE
    assert r.resource is not NULL_RESOURCE
    assert (r.args, r.env, r.port_map, r.metadata, r.mounts) == ([], {}, {}, {}, [])


def test_retry_policy_values() -> None:
    """RetryPolicy has REPLICA, APPLICATION and ROLE, usable as plain strings."""
    assert [p.value for p in RetryPolicy] == ["REPLICA", "APPLICATION", "ROLE"]
    assert RetryPolicy("ROLE") == "ROLE"


def test_valid_app_passes() -> None:
    """A well-formed multi-role app validates without error."""
    app = _app(
        _role(
            num_replicas=2,
            min_replicas=1,
            max_retries=3,
            retry_policy=RetryPolicy.REPLICA,
            resource=resource(h="cpu.small"),
            port_map={"tcp_store": 29500},
            env={"A": "1"},
            mounts=[BindMount("/a", "/b"), DeviceMount("/dev/fuse", "/dev/fuse", "rw")],
        ),
        _role(name="ps", retry_policy="ROLE"),
    )
    app.validate()
    validate_app(app)


@pytest.mark.parametrize(
    ("changes", "field", "value"),
    [
        ({"num_replicas": 0}, "num_replicas", "0"),
        ({"num_replicas": -2}, "num_replicas", "-2"),
        ({"num_replicas": True}, "num_replicas", "True"),
        ({"num_replicas": "2"}, "num_replicas", "'2'"),
        ({"min_replicas": 3}, "min_replicas", "3"),
        ({"min_replicas": 0}, "min_replicas", "0"),
        ({"min_replicas": True}, "min_replicas", "True"),
        ({"max_retries": -1}, "max_retries", "-1"),
        ({"retry_policy": "SOMETIMES"}, "retry_policy", "'SOMETIMES'"),
        ({"retry_policy": None}, "retry_policy", "None"),
        ({"entrypoint": MISSING}, "entrypoint", repr(MISSING)),
        ({"entrypoint": ""}, "entrypoint", "''"),
        ({"args": ["--n", 3]}, "args", "['--n', 3]"),
        ({"args": "--n 3"}, "args", "'--n 3'"),
        ({"env": {"N": 1}}, "env['N']", "1"),
        ({"env": {"N": None}}, "env['N']", "None"),
        ({"env": {"A=B": "x"}}, "env key", "'A=B'"),
        ({"env": {"": "x"}}, "env key", "''"),
        ({"env": ["A=1"]}, "env", "['A=1']"),
        ({"port_map": {"http": 70000}}, "port_map['http']", "70000"),
        ({"port_map": {"http": -1}}, "port_map['http']", "-1"),
        ({"port_map": {"http": "80"}}, "port_map['http']", "'80'"),
        ({"port_map": [80]}, "port_map", "[80]"),
        ({"metadata": "x"}, "metadata", "'x'"),
        ({"resource": "cpu.small"}, "resource", "'cpu.small'"),
        ({"resource": Resource(cpu=1, gpu=0, memMB=-1)}, "resource.memMB", "-1"),
        ({"mounts": [BindMount("/a", "rel")]}, "mounts[0].dst_path", "'rel'"),
        ({"mounts": [BindMount("/a", 5)]}, "mounts[0].dst_path", "5"),  # type: ignore[arg-type]
        ({"mounts": [BindMount("", "/b")]}, "mounts[0].src", "''"),
        ({"mounts": [DeviceMount("/d", "/d", "rwx")]}, "mounts[0].permissions", "'rwx'"),
        ({"mounts": ["/a:/b"]}, "mounts[0]", "'/a:/b'"),
        ({"mounts": BindMount("/a", "/b")}, "mounts", "BindMount"),
        ({"image": None}, "image", "None"),
    ],
)
def test_bad_role_field_names_role_field_and_value(
    changes: dict[str, Any], field: str, value: str
) -> None:
    """AppDef.validate rejects a bad role field with a message naming the role, the field and the value."""
    app = _app(_role(**changes))
    with pytest.raises(InvalidAppDefException) as ei:
        app.validate()
    message = str(ei.value)
    assert message.startswith("role 'trainer': ")
    assert field in message
    assert value in message
    assert ei.value.role == "trainer"
    assert isinstance(ei.value, ValueError)


@pytest.mark.parametrize("name", ["", "has space", "a/b", "-lead", "x" * 64, None])
def test_bad_role_name_is_rejected(name: Any) -> None:
    """A role name that cannot be a path component or label is rejected naming the value."""
    with pytest.raises(
        InvalidAppDefException, match=r"name must be .*got " + re.escape(repr(name))
    ):
        _app(_role(name=name)).validate()


def test_duplicate_role_names_are_rejected() -> None:
    """Two roles with the same name are rejected naming the duplicate."""
    app = _app(_role(name="worker"), _role(name="worker"))
    with pytest.raises(InvalidAppDefException, match=r"role 'worker': name must be unique"):
        app.validate()


@pytest.mark.parametrize(
    ("app", "pattern"),
    [
        (AppDef(name="app", roles=[]), r"roles must be a non-empty list"),
        (AppDef(name="", roles=[Role("r", "i", "e")]), r"app name.*''"),
        (AppDef(name="a", roles=["trainer"]), r"roles\[0\] must be a Role, got 'trainer'"),  # type: ignore[list-item]
        (AppDef(name="a", roles=Role("r", "i", "e")), r"roles must be a non-empty list.*Role\("),  # type: ignore[arg-type]
    ],
)
def test_bad_app_fields_are_rejected(app: AppDef, pattern: str) -> None:
    """An empty app name, no roles, a Role not in a list or a non-Role entry name the field."""
    with pytest.raises(InvalidAppDefException, match=pattern):
        app.validate()


def test_validate_app_rejects_a_non_app() -> None:
    """validate_app(x) with x not an AppDef names what it got."""
    with pytest.raises(InvalidAppDefException, match=r"app must be an AppDef, got 'nope'"):
        validate_app("nope")  # type: ignore[arg-type]


# -- no API mutates the caller's AppDef ------------------------------------------------------------


def _rich_app() -> AppDef:
    return AppDef(
        name="app",
        roles=[
            _role(
                args=["--id", macros.app_id],
                env={"R": macros.replica_id},
                metadata={"m": [macros.img_root]},
                resource=Resource(cpu=1, gpu=0, memMB=10, capabilities={"c": 1}),
                mounts=[BindMount("/a", "/b")],
                port_map={"p": 1},
            ),
            _role(name="ps", retry_policy="ROLE"),
        ],
        metadata={"k": "v"},
    )


def test_no_specs_api_mutates_the_callers_app() -> None:
    """validate, macros apply, replace_role, Resource.copy and AppDryRunInfo leave the app as it was."""
    app = _rich_app()
    before = copy.deepcopy(app)
    app.validate()
    validate_app(app)
    for role in app.roles:
        role.validate()
        macros.Values(img_root="/x", app_id="id", replica_id="0", rank0_env="E").apply(role)
    changed = replace_role(app.roles[0], num_replicas=5, env={"X": "y"})
    changed.args.append("more")
    changed.resource.capabilities["c"] = 2
    Resource.copy(app.roles[0].resource, c=3)
    info: AppDryRunInfo[str] = AppDryRunInfo("req", str)
    info._app = app
    repr(info)
    assert app == before
    assert app.roles[1].retry_policy == "ROLE"


def test_replace_role_returns_an_independent_copy() -> None:
    """replace_role applies changes to a deep copy; the original keeps its values and objects."""
    role = _rich_app().roles[0]
    new = replace_role(role, num_replicas=3)
    assert new.num_replicas == 3 and role.num_replicas == 1
    assert new.mounts == role.mounts and new.mounts is not role.mounts
    assert new.resource is not role.resource


def _containers(obj: Any) -> list[Any]:
    """Every list, dict and dataclass instance reachable from ``obj`` (``obj`` included)."""
    found: list[Any] = []

    def walk(o: Any) -> None:
        if isinstance(o, (list, dict)) or hasattr(o, "__dataclass_fields__"):
            found.append(o)
        if isinstance(o, list):
            for v in o:
                walk(v)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif hasattr(o, "__dataclass_fields__"):
            for name in o.__dataclass_fields__:
                walk(getattr(o, name))

    walk(obj)
    return found


def test_copy_app_equals_the_app_and_shares_no_mutable_part_with_it() -> None:
    """copy_app (what every submit copies its app with) is a deep copy: equal, nothing shared."""
    from asynctorchx.specs.api import copy_app

    app = _rich_app()
    app.roles[0].metadata = {"nested": {"list": [1, {"x": "y"}]}}
    app.roles[0].resource.capabilities = {"zones": ["a", "b"]}
    app.metadata = {"team": "ml"}
    copied = copy_app(app)
    assert copied == app
    assert type(copied) is AppDef and all(type(r) is Role for r in copied.roles)
    original_ids = {id(o) for o in _containers(app)}
    shared = [o for o in _containers(copied) if id(o) in original_ids]
    assert shared == []


def test_copy_app_deep_copies_role_subclasses_with_their_own_fields() -> None:
    """A Role subclass (e.g. one with a pre_proc hook and fields of its own) keeps its class and
    fields in the copy, and its fields are copied too."""
    from dataclasses import dataclass, field

    from asynctorchx.specs.api import copy_app

    @dataclass
    class TaggedRole(Role):
        tags: list[str] = field(default_factory=list)

    role = TaggedRole(name="r", image="/img", entrypoint="python", tags=["a"])
    copied = copy_app(AppDef("app", [role]))
    new = copied.roles[0]
    assert isinstance(new, TaggedRole) and new == role
    assert new.tags is not role.tags


def test_copy_app_knows_every_field_of_role_resource_and_appdef() -> None:
    """copy_app lists the fields it copies; a field added to Role, Resource or AppDef must be added
    there too, or copies would silently reset it to its default."""
    import inspect
    from dataclasses import fields

    from asynctorchx.specs import api

    source = inspect.getsource(api._copy_role) + inspect.getsource(api.copy_app)
    for cls in (Role, Resource, AppDef):
        for f in fields(cls):
            assert f"{f.name}=" in source, f"copy_app does not copy {cls.__name__}.{f.name}"
