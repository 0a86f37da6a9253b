"""parse_mounts: the CLI mount syntax for bind, volume and device mounts, and its errors; which
mounts the backends that run on the host's own file system accept."""

from __future__ import annotations

from pathlib import Path

import pytest

from asynctorchx.schedulers import get_scheduler_factories
from asynctorchx.specs import (
    AppDef,
    BindMount,
    DeviceMount,
    InvalidAppDefException,
    Mount,
    MountType,
    Role,
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


@pytest.mark.parametrize("backend", ["local_cwd", "local_dir", "slurm"])
@pytest.mark.parametrize(
    "mount",
    [
        BindMount("/data", "/job"),
        BindMount("/data", "/data", read_only=True),
        VolumeMount("cache", "/cache"),
        DeviceMount("/dev/fuse", "/dev/fuse"),
    ],
    ids=["bind-elsewhere", "bind-read-only", "volume", "device"],
)
def test_a_mount_a_host_backend_cannot_apply_fails_its_dry_run_naming_it(
    backend: str, mount: Mount, tmp_path: Path
) -> None:
    """On the backends whose replicas run on the host's own file system, a mount they cannot
    apply fails the dry run naming the role, the mount and the backend (it was accepted and
    ignored)."""
    sched = get_scheduler_factories()[backend]("s")
    app = AppDef("a", [Role("r", image=str(tmp_path), entrypoint="true", mounts=[mount])])
    with pytest.raises(InvalidAppDefException) as info:
        sched.submit_dryrun(app, {})
    message = str(info.value)
    assert "role 'r': mounts[0]" in message and backend in message and repr(mount) in message


@pytest.mark.parametrize("backend", ["local_cwd", "local_dir", "slurm"])
def test_a_bind_mount_of_a_path_onto_itself_holds_on_a_host_backend(
    backend: str, tmp_path: Path
) -> None:
    """A writable bind mount of a path onto itself needs nothing on the host: it is accepted."""
    sched = get_scheduler_factories()[backend]("s")
    mount = BindMount(str(tmp_path) + "/", str(tmp_path))
    app = AppDef("a", [Role("r", image=str(tmp_path), entrypoint="true", mounts=[mount])])
    assert sched.submit_dryrun(app, {}).request is not None
