"""What a review of asynctorchx.specs against torchx.specs 0.7.0 found: parse_mounts' aliases,
``~``, commas and KeyErrors, cfg_from_str's ValueErrors, get_type_name, AppState's repr,
base_img_root, statuses with deep error files or int states, and the validation of devices,
capabilities and mounts."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional  # noqa: UP035

import pytest
from _torchx_env import json_from_torchx

from asynctorchx.specs import (
    AppDryRunInfo,
    AppState,
    AppStatus,
    AppStatusError,
    BindMount,
    DeviceMount,
    InvalidAppDefException,
    InvalidRunConfigException,
    MountOptionError,
    ReplicaStatus,
    Resource,
    Role,
    RoleStatus,
    RunConfigParseError,
    VolumeMount,
    get_type_name,
    macros,
    parse_mounts,
    runopts,
)

_KEY_ERROR_MOUNTS = [
    ["type=bind", "src=/a", "dst=/b", "colour=red"],  # an unknown option
    ["src=/a", "dst=/b"],  # an option before its type
    ["type=bind", "dst=/b"],  # no src
    ["type=bind", "src=/a"],  # no dst
    ["type=volume", "src=v"],  # no dst
    ["type=device", "dst=/dev/x"],  # no src
]
_BAD_CFG_STRINGS = ["i=1.5", "foo", "i=1,,s=x", "b=maybe"]

# One TorchX subprocess for every comparison of this module (each costs a Python start-up).
_TORCHX_REFERENCE = f"""
import json
from typing import Dict, List, Optional
from torchx.specs import AppDryRunInfo, AppState, AppStatus, get_type_name, macros, parse_mounts
from torchx.specs import runopts

def error_of(fn):
    try:
        fn()
    except Exception as e:
        return [c.__name__ for c in type(e).__mro__]
    return None

o = runopts()
o.add("i", type_=int, help="i"); o.add("s", type_=str, help="s"); o.add("b", type_=bool, help="b")
m = parse_mounts(["type=bind", "src=/a", "dst=/b", "read_only"])[0]
v = macros.Values(img_root="/i", app_id="a", replica_id="0", rank0_env="M")
print(json.dumps({{
    "read_only": [m.src_path, m.dst_path, m.read_only],
    "tilde": parse_mounts(["type=bind", "src=~/data", "dst=/data"])[0].src_path,
    "comma": parse_mounts(["type=bind", "src=/data/a,b", "dst=/c"])[0].src_path,
    "mount_errors": [error_of(lambda opts=opts: parse_mounts(opts)) for opts in {_KEY_ERROR_MOUNTS!r}],
    "cfg_errors": [error_of(lambda s=s: o.cfg_from_str(s)) for s in {_BAD_CFG_STRINGS!r}],
    "type_names": [get_type_name(t) for t in (int, str, float, bool, List[str], Dict[str, str],
                                               Optional[str], list)],
    "reprs": [repr(s) for s in AppState],
    "base_img_root": v.substitute("${{base_img_root}}/x"),
    "int_state": AppStatus(5).format().splitlines()[1].strip(),
    "dryrun_cfg": AppDryRunInfo("req", str)._cfg,
}}))
"""


@pytest.fixture(scope="module")
def torchx() -> dict[str, Any]:
    """What TorchX 0.7 answers to each question of this module."""
    reference: dict[str, Any] = json_from_torchx(_TORCHX_REFERENCE)
    return reference


# ---------------------------------------------------------------- parse_mounts


@pytest.mark.parametrize("flag", ["read_only", "read_only=true", "READ_ONLY", "read_only=1"])
def test_parse_mounts_takes_torchx_read_only_alias(torchx: dict[str, Any], flag: str) -> None:
    """``read_only`` is TorchX's alias of ``readonly``: bare or ``=true``, a read-only mount."""
    assert torchx["read_only"] == ["/a", "/b", True]
    assert parse_mounts(["type=bind", "src=/a", "dst=/b", flag]) == [BindMount("/a", "/b", True)]
    assert parse_mounts([f"type=volume,src=v,dst=/v,{flag}"]) == [VolumeMount("v", "/v", True)]


def test_parse_mounts_read_only_false_is_writable() -> None:
    """``read_only=false`` is writable, as ``readonly=false`` is."""
    assert parse_mounts(["type=bind,src=/a,dst=/b,read_only=false"]) == [BindMount("/a", "/b")]


def test_parse_mounts_expands_tilde_in_a_bind_src(torchx: dict[str, Any]) -> None:
    """``~`` at the start of a bind mount's src is the home directory, as TorchX expands it."""
    assert torchx["tilde"] == os.path.expanduser("~/data")
    assert parse_mounts(["type=bind", "src=~/data", "dst=/data"]) == [
        BindMount(torchx["tilde"], "/data")
    ]
    assert parse_mounts(["type=bind,src=~,dst=/h"]) == [BindMount(os.path.expanduser("~"), "/h")]
    # not a volume's name, nor a ~ later in a path
    assert parse_mounts(["type=volume,src=~v,dst=/v"]) == [VolumeMount("~v", "/v")]
    assert parse_mounts(["type=bind,src=/a/~b,dst=/c"]) == [BindMount("/a/~b", "/c")]


def test_parse_mounts_keeps_a_comma_in_a_value_of_its_own_element(torchx: dict[str, Any]) -> None:
    """A value holding a comma, as its own list element (TorchX's form), is kept whole."""
    assert torchx["comma"] == "/data/a,b"
    assert parse_mounts(["type=bind", "src=/data/a,b", "dst=/c"]) == [BindMount("/data/a,b", "/c")]
    assert parse_mounts(["type=bind", "src=/x,y=1", "dst=/c,d"]) == [BindMount("/x,y=1", "/c,d")]


def test_parse_mounts_splits_at_a_comma_before_an_option_name() -> None:
    """Comma-joined options still split (at a comma followed by an option's name, any case and
    alias); a comma followed by anything else stays in the value."""
    assert parse_mounts(["type=bind,src=/a,/b,Target=/c,READONLY"]) == [
        BindMount("/a,/b", "/c", read_only=True)
    ]
    assert parse_mounts(["type=bind,src=/a,dst=/b,,type=device,src=/dev/x,permissions=r,"]) == [
        BindMount("/a", "/b"),
        DeviceMount("/dev/x", "/dev/x", "r"),
    ]


def test_parse_mounts_still_refuses_a_misspelt_option_in_a_joined_element() -> None:
    """In an element of several options, an unknown ``name=`` after a comma is refused (not taken
    into the value before it), with a hint on passing a value that holds a comma."""
    with pytest.raises(MountOptionError, match=r"'colour'.*list element of its own"):
        parse_mounts(["type=bind,src=/a,dst=/b,colour=red"])
    with pytest.raises(MountOptionError, match=r"'ro'"):
        parse_mounts(["type=bind,src=/a,dst=/b,ro"])


@pytest.mark.parametrize("opts", _KEY_ERROR_MOUNTS)
def test_parse_mounts_errors_are_key_errors_where_torchx_raises_one(
    torchx: dict[str, Any], opts: list[str]
) -> None:
    """Where TorchX raises KeyError, MountOptionError is one (and an InvalidAppDefException, a
    ValueError), and reads as its message, not as a quoted repr."""
    assert "KeyError" in torchx["mount_errors"][_KEY_ERROR_MOUNTS.index(opts)]
    with pytest.raises(MountOptionError) as info:
        parse_mounts(opts)
    err = info.value
    assert isinstance(err, KeyError) and isinstance(err, InvalidAppDefException)
    assert isinstance(err, ValueError)
    assert str(err) == err.args[0] and not str(err).startswith(("'", '"'))


@pytest.mark.parametrize(
    "opts", [["type=tmpfs,dst=/t"], ["type=device,src=/dev/x,perm=rwx"]], ids=["type", "perm"]
)
def test_parse_mounts_value_errors_stay_value_errors(opts: list[str]) -> None:
    """A bad type or perm (TorchX's ValueErrors) is an InvalidAppDefException, not a KeyError."""
    with pytest.raises(InvalidAppDefException) as info:
        parse_mounts(opts)
    assert not isinstance(info.value, KeyError)


# ---------------------------------------------------------------- runopts, get_type_name


@pytest.mark.parametrize("cfg_str", _BAD_CFG_STRINGS)
def test_cfg_from_str_parse_errors_are_value_errors(torchx: dict[str, Any], cfg_str: str) -> None:
    """A cfg string that does not parse raises RunConfigParseError: an InvalidRunConfigException,
    and a ValueError where TorchX raises one (``b=maybe`` is True in TorchX: refused here)."""
    tx_error = torchx["cfg_errors"][_BAD_CFG_STRINGS.index(cfg_str)]
    assert tx_error is None if cfg_str == "b=maybe" else "ValueError" in tx_error
    o = runopts()
    o.add("i", type_=int, help="i")
    o.add("s", type_=str, help="s")
    o.add("b", type_=bool, help="b")
    with pytest.raises(RunConfigParseError) as info:
        o.cfg_from_str(cfg_str)
    assert isinstance(info.value, ValueError) and isinstance(info.value, InvalidRunConfigException)


def test_get_type_name_is_torchx_s(torchx: dict[str, Any]) -> None:
    """``get_type_name`` is exported and names types as TorchX does (``typing.List[str]``)."""
    # (TorchX components declare options with the typing generics)
    generics = (List[str], Dict[str, str], Optional[str])  # noqa: UP006, UP045
    types = (int, str, float, bool, *generics, list)
    assert [get_type_name(t) for t in types] == torchx["type_names"]
    assert torchx["type_names"][:5] == ["int", "str", "float", "bool", "typing.List[str]"]


# ---------------------------------------------------------------- states, macros, dry runs


def test_app_state_repr_is_torchx_s(torchx: dict[str, Any]) -> None:
    """``repr(AppState.RUNNING)`` is ``RUNNING (3)``, as in TorchX; str() stays the name."""
    assert [repr(s) for s in AppState] == torchx["reprs"]
    assert repr(AppState.RUNNING) == "RUNNING (3)" and str(AppState.RUNNING) == "RUNNING"


def test_macros_values_base_img_root_defaults_to_deprecated(torchx: dict[str, Any]) -> None:
    """``${base_img_root}`` becomes ``DEPRECATED`` unless given, as in TorchX."""
    v = macros.Values(img_root="/i", app_id="a", replica_id="0", rank0_env="M")
    assert v.substitute("${base_img_root}/x") == torchx["base_img_root"] == "DEPRECATED/x"


def test_dryrun_info_cfg_defaults_to_an_empty_mapping(torchx: dict[str, Any]) -> None:
    """A dry run's cfg is ``{}`` until a scheduler sets it, as in TorchX."""
    assert AppDryRunInfo("req", str).cfg == torchx["dryrun_cfg"] == {}


# ---------------------------------------------------------------- statuses


def _nested_error(depth: int = 5000) -> str:
    return "[" * depth + "]" * depth  # ~10 KB: well under the local backend's 1 MiB error-file cap


def test_format_keeps_a_deeply_nested_replica_error_file_as_text() -> None:
    """A replica's error file nested too deep for JSON is shown as its text, not a RecursionError."""
    raw = _nested_error()
    rep = ReplicaStatus(0, AppState.FAILED, "r", "h", structured_error_msg=raw)
    st = AppStatus(AppState.FAILED, roles=[RoleStatus("r", [rep])])
    text = st.format()
    assert "r[0] FAILED on h" in text and raw in text


def test_raise_for_status_raises_app_status_error_for_a_deeply_nested_error() -> None:
    """raise_for_status raises AppStatusError (holding the text), not RecursionError."""
    st = AppStatus(AppState.FAILED, structured_error_msg=_nested_error())
    with pytest.raises(AppStatusError, match=r"\[\[\["):
        st.raise_for_status()


def test_an_int_state_is_taken_as_its_app_state(torchx: dict[str, Any]) -> None:
    """AppStatus and ReplicaStatus take a plain int state (as TorchX does: ``State: 5`` there) as
    its AppState, so repr, format, to_json and raise_for_status work."""
    assert torchx["int_state"] == "State: 5"
    rep = ReplicaStatus(0, 3, "r", "h")  # type: ignore[arg-type]
    st = AppStatus(5, roles=[RoleStatus("r", [rep])])  # type: ignore[arg-type]
    assert st.state is AppState.FAILED and rep.state is AppState.RUNNING
    assert "State: FAILED" in st.format() and "r[0] RUNNING on h" in st.format()
    assert st.to_json()["state"] == "FAILED"
    assert st.to_json()["roles"][0]["replicas"][0]["state"] == "RUNNING"
    assert "state=FAILED" in repr(st)
    with pytest.raises(AppStatusError, match="FAILED"):
        st.raise_for_status()


def test_an_int_that_is_no_state_is_kept_and_still_formats() -> None:
    """An int that is no AppState (and a bool) is kept as given; format, repr and to_json still
    work."""
    st = AppStatus(42, roles=[RoleStatus("r", [ReplicaStatus(0, True, "r", "h")])])  # type: ignore[arg-type]
    assert st.state == 42 and type(st.state) is int
    assert "State: 42" in st.format() and "r[0] True on h" in st.format()
    assert st.to_json()["state"] == "42" and "state=42" in repr(st)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("devices", [None, ["vpc.amazonaws.com/efa"], "efa"])
def test_resource_validate_names_bad_devices(devices: object) -> None:
    """A devices field that is not a dict is an InvalidAppDefException naming it and the value."""
    res = Resource(1, 0, 1, devices=devices)  # type: ignore[arg-type]
    role = Role(name="r", image="i", entrypoint="e", resource=res)
    with pytest.raises(InvalidAppDefException, match=r"role 'r': resource\.devices") as info:
        role.validate()
    assert repr(devices) in str(info.value)


@pytest.mark.parametrize("capabilities", [None, ["x"], "x"])
def test_resource_validate_names_bad_capabilities(capabilities: object) -> None:
    """A capabilities field that is not a dict is an InvalidAppDefException naming it."""
    res = Resource(1, 0, 1, capabilities=capabilities)  # type: ignore[arg-type]
    with pytest.raises(InvalidAppDefException, match=r"resource\.capabilities"):
        Role(name="r", image="i", entrypoint="e", resource=res).validate()


@pytest.mark.parametrize("perm", [5, 1.0, None, ["r"]])
def test_role_validate_names_non_string_device_permissions(perm: object) -> None:
    """DeviceMount.permissions that is not a string: InvalidAppDefException naming it."""
    mount = DeviceMount("/dev/a", "/dev/a", perm)  # type: ignore[arg-type]
    role = Role(name="r", image="i", entrypoint="e", mounts=[mount])
    with pytest.raises(InvalidAppDefException, match=r"mounts\[0\]\.permissions"):
        role.validate()


@pytest.mark.parametrize(
    ("mount", "field_name"),
    [
        (BindMount("/a\ud800", "/b"), "src_path"),
        (BindMount("/a", "/b\ud800"), "dst_path"),
        (VolumeMount("v\udfff", "/v"), "src"),
        (DeviceMount("/dev/\ud800", "/dev/x"), "src_path"),
        (DeviceMount("/dev/x", "/dev/x\0"), "dst_path"),
        (VolumeMount("v\0", "/v"), "src"),
    ],
)
def test_role_validate_refuses_lone_surrogates_and_nul_in_mount_paths(
    mount: BindMount | VolumeMount | DeviceMount, field_name: str
) -> None:
    """A mount path with a lone surrogate (it cannot be encoded) or a NUL is refused naming the
    field, as the image, args and env are."""
    role = Role(name="r", image="i", entrypoint="e", mounts=[mount])
    with pytest.raises(InvalidAppDefException, match=rf"mounts\[0\]\.{field_name}"):
        role.validate()


def test_role_validate_takes_surrogate_escapes_of_undecodable_bytes_in_mount_paths() -> None:
    """A path with the surrogate escape of an undecodable byte (``os.fsdecode``'s) is a path."""
    path = os.fsdecode(b"/data/\xff")
    Role(name="r", image="i", entrypoint="e", mounts=[BindMount(path, path)]).validate()
