"""parse_mounts: the CLI mount syntax for bind, volume and device mounts, and its errors."""

from __future__ import annotations

import pytest

from asynctorchx.specs import (
    BindMount,
    DeviceMount,
    InvalidAppDefException,
    MountType,
    VolumeMount,
    parse_mounts,
)


def test_mount_type_values() -> None:
    """MountType has TorchX's bind, volume and device values."""
    assert [m.value for m in MountType] == ["bind", "volume", "device"]


def test_bind_mount() -> None:
    """type=bind with src and dst gives a read-write BindMount."""
    assert parse_mounts(["type=bind,src=/data,dst=/mnt/data"]) == [
        BindMount(src_path="/data", dst_path="/mnt/data", read_only=False)
    ]


def test_bind_mount_readonly_flag_and_aliases() -> None:
    """``readonly`` (bare or =true) makes it read-only; source/target are aliases of src/dst."""
    assert parse_mounts(["type=bind,source=/a,target=/b,readonly"]) == [
        BindMount("/a", "/b", read_only=True)
    ]
    assert parse_mounts(["type=bind,src=/a,destination=/b,readonly=true"]) == [
        BindMount("/a", "/b", read_only=True)
    ]
    assert parse_mounts(["type=bind,src=/a,dst=/b,readonly=false"]) == [
        BindMount("/a", "/b", read_only=False)
    ]


def test_volume_mount() -> None:
    """type=volume gives a VolumeMount with the volume name as src."""
    assert parse_mounts(["type=volume,src=ckpts,dst=/ckpts,readonly"]) == [
        VolumeMount(src="ckpts", dst_path="/ckpts", read_only=True)
    ]


def test_device_mount_defaults_dst_to_src_and_perm_to_rwm() -> None:
    """type=device without dst mounts at the same path with rwm permissions."""
    assert parse_mounts(["type=device,src=/dev/fuse"]) == [
        DeviceMount(src_path="/dev/fuse", dst_path="/dev/fuse", permissions="rwm")
    ]
    assert parse_mounts(["type=device,src=/dev/a,dst=/dev/b,perm=r"]) == [
        DeviceMount("/dev/a", "/dev/b", permissions="r")
    ]


def test_items_as_separate_list_elements_and_several_mounts() -> None:
    """Items may be separate list elements (as argparse gives them); each ``type=`` starts a mount."""
    mounts = parse_mounts(
        ["type=bind", "src=/a", "dst=/b", "type=volume,src=v,dst=/v", "type=device", "src=/dev/x"]
    )
    assert mounts == [
        BindMount("/a", "/b"),
        VolumeMount("v", "/v"),
        DeviceMount("/dev/x", "/dev/x"),
    ]


def test_empty_input_gives_no_mounts() -> None:
    """No options, or only empty strings, give no mounts."""
    assert parse_mounts([]) == []
    assert parse_mounts(["", " , "]) == []


def test_parse_mounts_does_not_modify_its_input() -> None:
    """The caller's list of options is left unchanged."""
    opts = ["type=bind,src=/a,dst=/b"]
    parse_mounts(opts)
    assert opts == ["type=bind,src=/a,dst=/b"]


@pytest.mark.parametrize(
    ("opts", "pattern"),
    [
        (["type=tmpfs,dst=/t"], r"mount type.*bind, volume, device.*'tmpfs'"),
        (["src=/a,dst=/b"], r"'src=/a'.*before a 'type="),
        (["type=bind,dst=/b"], r"bind mount src.*None"),
        (["type=bind,src=,dst=/b"], r"bind mount src.*''"),
        (["type=bind,src=/a"], r"bind mount dst.*None"),
        (["type=volume,src=v"], r"volume mount dst.*None"),
        (["type=device,dst=/dev/x"], r"device mount src.*None"),
        (["type=bind,src=/a,dst=/b,colour=red"], r"bind mount option.*'colour'"),
        (["type=bind,src=/a,dst=/b,perm=r"], r"bind mount option.*'perm'"),
        (["type=device,src=/dev/x,perm=rwx"], r"device mount perm.*'rwx'"),
        (["type=bind,src=/a,dst=/b,readonly=maybe"], r"mount readonly.*'maybe'"),
    ],
)
def test_bad_input_names_the_field_and_value(opts: list[str], pattern: str) -> None:
    """Unknown types or keys, missing src/dst and bad flags raise InvalidAppDefException naming them."""
    with pytest.raises(InvalidAppDefException, match=pattern) as ei:
        parse_mounts(opts)
    assert isinstance(ei.value, ValueError)
