"""specs.serialize: AppDefs, roles and mounts to JSON-ready dicts and back."""

from __future__ import annotations

import json

import pytest

from asynctorchx.specs import AppDef, Resource, RetryPolicy, Role
from asynctorchx.specs.api import BindMount, DeviceMount, VolumeMount
from asynctorchx.specs.serialize import (
    appdef_from_dict,
    appdef_to_dict,
    mount_from_dict,
    role_from_dict,
    role_to_dict,
)


def full_role() -> Role:
    return Role(
        "trainer",
        image="img:1",
        entrypoint="python",
        args=["-m", "train", "--lr", "0.1"],
        env={"A": "1"},
        num_replicas=3,
        min_replicas=2,
        max_retries=4,
        retry_policy=RetryPolicy.REPLICA,
        resource=Resource(cpu=2, gpu=1, memMB=1024, capabilities={"x": 1}, devices={"d": 2}),
        port_map={"tb": 6006},
        metadata={"m": "v"},
        mounts=[
            BindMount("/data", "/mnt/data", read_only=True),
            VolumeMount("vol", "/mnt/vol"),
            DeviceMount("/dev/fuse", "/dev/fuse", permissions="rw"),
        ],
        base_image="base:2",
    )


def test_appdef_round_trips_through_json() -> None:
    """Every field of every role (mounts of all three kinds included) survives a JSON round trip."""
    app = AppDef("app", roles=[full_role(), Role("ps", image="img:1")], metadata={"k": "v"})
    back = appdef_from_dict(json.loads(json.dumps(appdef_to_dict(app))))
    assert back == app


def test_base_image_is_left_out_when_unset() -> None:
    """A role without base_image stores no such key (the stored shape of older records)."""
    assert "base_image" not in role_to_dict(Role("r", image="i"))
    assert role_to_dict(full_role())["base_image"] == "base:2"


def test_bad_input_is_rejected_with_a_clear_error() -> None:
    """An unknown mount type names itself; a role without a name is a KeyError."""
    with pytest.raises(ValueError, match="unknown mount type 'nfs'"):
        mount_from_dict({"type": "nfs", "src_path": "/a", "dst_path": "/b"})
    with pytest.raises(KeyError):
        role_from_dict({"image": "i"})
