"""Resource, NULL_RESOURCE, resource(...) and named resources (builtin table and entry points)."""

from __future__ import annotations

import importlib
import importlib.metadata
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from asynctorchx.specs import (
    NULL_RESOURCE,
    InvalidAppDefException,
    Resource,
    get_named_resource,
    get_named_resources,
    named_resource_names,
    resource,
)
from asynctorchx.specs.named_resources import (
    ENTRY_POINT_GROUP,
    NAMED_RESOURCES,
    UnknownNamedResourceException,
    _plugins,
)

# ``asynctorchx.specs.named_resources`` is also the lookup alias, so fetch the module itself.
named_resources_module = importlib.import_module("asynctorchx.specs.named_resources")


@pytest.fixture
def plugin_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A real installed distribution on sys.path declaring named resources in its entry_points.txt."""
    (tmp_path / "atx_test_resources.py").write_text(
        textwrap.dedent(
            """
            from asynctorchx.specs import Resource

            def p4d():
                return Resource(cpu=96, gpu=8, memMB=1_152_000, capabilities={"node.kubernetes.io/instance-type": "p4d.24xlarge"})

            def shadow():
                return Resource(cpu=999, gpu=0, memMB=1)

            def broken():
                raise RuntimeError("quota service down")

            def not_a_resource():
                return {"cpu": 1}
            """
        )
    )
    dist_info = tmp_path / "atx_test_resources-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: atx-test-resources\nVersion: 1.0\n"
    )
    (dist_info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\n"
        "aws.p4d.24xlarge = atx_test_resources:p4d\n"
        "cpu.small = atx_test_resources:shadow\n"
        "broken.one = atx_test_resources:broken\n"
        "odd.one = atx_test_resources:not_a_resource\n"
        "[some.other.group]\n"
        "aws.other = atx_test_resources:p4d\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    _plugins.cache_clear()
    yield tmp_path
    _plugins.cache_clear()


# -- Resource --------------------------------------------------------------------------------------


def test_resource_copy_merges_capabilities_and_leaves_original() -> None:
    """Resource.copy overrides/adds capabilities on a deep copy; the original is unchanged."""
    orig = Resource(cpu=2, gpu=1, memMB=100, capabilities={"a": 1, "b": 2}, devices={"d": 1})
    new = Resource.copy(orig, b=3, c=4)
    assert new.capabilities == {"a": 1, "b": 3, "c": 4}
    assert (new.cpu, new.gpu, new.memMB, new.devices) == (2, 1, 100, {"d": 1})
    assert orig.capabilities == {"a": 1, "b": 2}
    new.devices["d"] = 5
    assert orig.devices == {"d": 1}


def test_null_resource_is_negative_sentinel() -> None:
    """NULL_RESOURCE is cpu=gpu=memMB=-1, TorchX's 'no requirement' sentinel."""
    assert (NULL_RESOURCE.cpu, NULL_RESOURCE.gpu, NULL_RESOURCE.memMB) == (-1, -1, -1)


def test_resource_validate_names_field_and_value() -> None:
    """Resource.validate rejects negatives and non-numbers naming the field and the value."""
    with pytest.raises(InvalidAppDefException, match=r"resource\.memMB.*-5"):
        Resource(cpu=1, gpu=0, memMB=-5).validate()
    with pytest.raises(InvalidAppDefException, match=r"role 'r'.*resource\.cpu.*'2'"):
        Resource(cpu="2", gpu=0, memMB=1).validate("r")  # type: ignore[arg-type]
    with pytest.raises(InvalidAppDefException, match=r"resource\.devices\['efa'\].*-1"):
        Resource(cpu=1, gpu=0, memMB=1, devices={"efa": -1}).validate()


# -- resource() ------------------------------------------------------------------------------------


def test_resource_from_numbers_with_torchx_defaults() -> None:
    """resource() without h builds from numbers, defaulting as TorchX to 2 CPUs, 0 GPU, 1024 MiB."""
    assert resource() == Resource(cpu=2, gpu=0, memMB=1024)
    assert resource(cpu=4, gpu=2, memMB=8192) == Resource(cpu=4, gpu=2, memMB=8192)


def test_resource_h_wins_over_numbers() -> None:
    """resource(h=name) looks the name up and ignores the numbers."""
    assert resource(cpu=99, h="cpu.small") == get_named_resource("cpu.small")


# -- named resources: builtin table ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "cpu", "gpu", "mem_gib"),
    [
        ("cpu.nano", 1, 0, 0.5),
        ("cpu.small", 1, 0, 2),
        ("cpu.medium", 2, 0, 4),
        ("cpu.large", 2, 0, 8),
        ("gpu.small", 8, 1, 32),
        ("gpu.large", 32, 4, 128),
        ("gpu.xlarge", 64, 8, 256),
    ],
)
def test_generic_named_resources(name: str, cpu: int, gpu: int, mem_gib: float) -> None:
    """The generic cpu.*/gpu.* names map to the documented CPU, GPU and memory."""
    res = get_named_resource(name)
    assert (res.cpu, res.gpu, res.memMB) == (cpu, gpu, int(mem_gib * 1024))


def test_named_resource_lookup_returns_a_fresh_object() -> None:
    """Each lookup returns a new Resource, so modifying one does not change the table."""
    a = get_named_resource("gpu.small")
    a.capabilities["x"] = 1
    a.memMB = 1
    assert get_named_resource("gpu.small").capabilities == {}
    assert get_named_resource("gpu.small").memMB == 32 * 1024


def test_misspelt_name_suggests_the_closest_names() -> None:
    """An unknown name raises naming it, suggesting close names and listing the known ones."""
    with pytest.raises(
        InvalidAppDefException, match=r"'cpu\.smal'.*did you mean 'cpu\.small'"
    ) as ei:
        get_named_resource("cpu.smal")
    assert "known: cpu.nano" in str(ei.value)
    assert ei.value.field_name == "resource"


def test_unrelated_unknown_name_has_no_suggestion() -> None:
    """A name close to nothing raises without a 'did you mean'."""
    with pytest.raises(InvalidAppDefException) as ei:
        get_named_resource("zzzzzzzzzzzz")
    assert "did you mean" not in str(ei.value)


def test_named_resources_mapping_interface() -> None:
    """NAMED_RESOURCES supports [], in, get, iteration, len and calling; unknown [] is a KeyError."""
    assert NAMED_RESOURCES["cpu.small"] == get_named_resource("cpu.small")
    assert NAMED_RESOURCES("cpu.small") == get_named_resource("cpu.small")
    assert "gpu.large" in NAMED_RESOURCES
    assert "gpu.huge" not in NAMED_RESOURCES
    assert NAMED_RESOURCES.get("gpu.huge") is None
    assert list(NAMED_RESOURCES) == named_resource_names()
    assert len(NAMED_RESOURCES) == len(named_resource_names())
    with pytest.raises(KeyError):
        NAMED_RESOURCES["gpu.huge"]
    with pytest.raises(UnknownNamedResourceException, match=r"did you mean 'gpu\.large'") as ei:
        NAMED_RESOURCES["gpu.larg"]
    assert not str(ei.value).startswith(("'", '"'))


# -- named resources: entry points -----------------------------------------------------------------


def test_entry_point_named_resource_is_found(plugin_dist: Path) -> None:
    """A name declared in the asynctorchx.named_resources entry-point group resolves to its Resource."""
    res = get_named_resource("aws.p4d.24xlarge")
    assert (res.cpu, res.gpu, res.memMB) == (96, 8, 1_152_000)
    assert res.capabilities == {"node.kubernetes.io/instance-type": "p4d.24xlarge"}
    assert resource(h="aws.p4d.24xlarge") == res
    assert "aws.p4d.24xlarge" in named_resource_names()
    assert "aws.p4d.24xlarge" in NAMED_RESOURCES


def test_entry_points_never_replace_builtins(plugin_dist: Path) -> None:
    """A plugin entry named like a builtin is ignored; the builtin wins."""
    assert get_named_resource("cpu.small").cpu == 1
    assert named_resource_names().count("cpu.small") == 1


def test_other_entry_point_groups_are_ignored(plugin_dist: Path) -> None:
    """Entry points of other groups are not named resources."""
    assert "aws.other" not in named_resource_names()


def test_plugin_misspelling_hint_includes_plugin_names(plugin_dist: Path) -> None:
    """The 'did you mean' hint also considers plugin names."""
    with pytest.raises(InvalidAppDefException, match=r"did you mean 'aws\.p4d\.24xlarge'"):
        get_named_resource("aws.p4d.24xlarg")


def test_broken_plugin_fails_only_its_own_name(plugin_dist: Path) -> None:
    """A plugin whose factory raises fails lookups of that name with a clear error; others work."""
    with pytest.raises(InvalidAppDefException, match=r"'broken\.one'.*quota service down"):
        get_named_resource("broken.one")
    with pytest.raises(InvalidAppDefException, match=r"'odd\.one'.*must return a Resource"):
        get_named_resource("odd.one")
    assert get_named_resource("aws.p4d.24xlarge").gpu == 8


def test_entry_points_are_read_once_per_process(
    plugin_dist: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The entry-point scan is cached; lookups after the first do not scan again."""
    named_resource_names()
    calls: list[str] = []
    real = importlib.metadata.entry_points

    def counting(**kw: str) -> object:
        calls.append(kw["group"])
        return real(**kw)

    monkeypatch.setattr(importlib.metadata, "entry_points", counting)
    get_named_resource("aws.p4d.24xlarge")
    named_resource_names()
    assert calls == []


# -- TorchX's names and values ---------------------------------------------------------------------

_TORCHX_NAMED = """
import json
from torchx.specs import named_resources_aws as aws, named_resources_generic as generic
from torchx.specs import named_resources
names = [*generic.NAMED_RESOURCES, *aws.NAMED_RESOURCES, "NULL", "MISSING"]
out = {}
for n in names:
    r = named_resources[n]
    out[n] = [r.cpu, r.gpu, r.memMB, r.capabilities, r.devices]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def torchx_named() -> dict[str, list[object]]:
    """Every named resource of TorchX 0.7 (generic, AWS, NULL/MISSING) with its values."""
    from _torchx_env import json_from_torchx

    found: dict[str, list[object]] = json_from_torchx(_TORCHX_NAMED)
    return found


_BUILTIN_NAMES = [
    *named_resources_module.GENERIC_NAMED_RESOURCES,
    *named_resources_module.AWS_NAMED_RESOURCES,
    "NULL",
    "MISSING",
]


def test_builtin_names_are_torchx_07s(torchx_named: dict[str, list[object]]) -> None:
    """The builtin names are exactly TorchX 0.7's generic and AWS names (26 AWS instance types)."""
    assert sorted(_BUILTIN_NAMES) == sorted(torchx_named)
    assert len(named_resources_module.AWS_NAMED_RESOURCES) == 26
    assert named_resource_names()[: len(_BUILTIN_NAMES)] == _BUILTIN_NAMES


@pytest.mark.parametrize("name", _BUILTIN_NAMES)
def test_named_resource_has_torchx_07s_values(
    name: str, torchx_named: dict[str, list[object]]
) -> None:
    """Each builtin name gives TorchX 0.7's cpu, gpu, memMB, capabilities and devices."""
    res = get_named_resource(name)
    assert [res.cpu, res.gpu, res.memMB, res.capabilities, res.devices] == torchx_named[name]
    assert get_named_resources(name) == res == NAMED_RESOURCES[name]


def test_aws_resources_carry_instance_type_and_efa() -> None:
    """AWS names carry the instance type capability, and EFA/Neuron devices where TorchX has them."""
    from asynctorchx.specs.named_resources_aws import (
        EFA_DEVICE,
        K8S_ITYPE,
        NEURON_DEVICE,
        aws_p4d_24xlarge,  # type: ignore[attr-defined]
        instance_type_from_resource,
    )

    p4d = get_named_resource("aws_p4d.24xlarge")
    assert (p4d.cpu, p4d.gpu, p4d.memMB) == (96, 8, 1152 * 983)
    assert p4d.capabilities == {K8S_ITYPE: "p4d.24xlarge"}
    assert p4d.devices == {EFA_DEVICE: 4}
    assert aws_p4d_24xlarge() == p4d
    assert instance_type_from_resource(p4d) == "p4d.24xlarge"
    assert get_named_resource("aws_trn1.32xlarge").devices == {EFA_DEVICE: 8, NEURON_DEVICE: 16}
    with pytest.warns(UserWarning, match="instance type is unknown"):
        assert instance_type_from_resource(Resource(cpu=1, gpu=0, memMB=1)) is None


def test_null_and_missing_are_the_null_resource() -> None:
    """'NULL' and 'MISSING' stand for NULL_RESOURCE (as in TorchX), as fresh objects."""
    assert get_named_resource("NULL") == NULL_RESOURCE == get_named_resource("MISSING")
    assert get_named_resource("NULL") is not NULL_RESOURCE


# -- TorchX's entry-point group --------------------------------------------------------------------


@pytest.fixture
def torchx_plugin_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An installed distribution declaring names in both named-resource groups, some clashing."""
    (tmp_path / "atx_tx_resources.py").write_text(
        textwrap.dedent(
            """
            from asynctorchx.specs import Resource

            def big():
                return Resource(cpu=128, gpu=16, memMB=2_000_000, devices={"vpc.amazonaws.com/efa": 32})

            def theirs():
                return Resource(cpu=3, gpu=0, memMB=3)

            def ours():
                return Resource(cpu=5, gpu=0, memMB=5)
            """
        )
    )
    dist_info = tmp_path / "atx_tx_resources-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: atx-tx-resources\nVersion: 1.0\n"
    )
    (dist_info / "entry_points.txt").write_text(
        "[torchx.named_resources]\n"
        "custom_big = atx_tx_resources:big\n"
        "aws_p3.2xlarge = atx_tx_resources:theirs\n"
        "shared = atx_tx_resources:theirs\n"
        f"[{ENTRY_POINT_GROUP}]\n"
        "shared = atx_tx_resources:ours\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    _plugins.cache_clear()
    yield tmp_path
    _plugins.cache_clear()


def test_torchx_group_names_are_found(torchx_plugin_dist: Path) -> None:
    """A name registered in TorchX's torchx.named_resources group resolves like ours."""
    res = get_named_resource("custom_big")
    assert (res.cpu, res.gpu, res.memMB, res.devices) == (
        128,
        16,
        2_000_000,
        {"vpc.amazonaws.com/efa": 32},
    )
    assert "custom_big" in named_resource_names()


def test_ours_win_clashes_with_a_warning(
    torchx_plugin_dist: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On a clash builtins beat both groups, asynctorchx's group beats TorchX's; each is warned."""
    with caplog.at_level("WARNING", logger="asynctorchx.specs.named_resources"):
        assert get_named_resource("aws_p3.2xlarge").cpu == 8
        assert get_named_resource("shared").cpu == 5
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        "aws_p3.2xlarge = atx_tx_resources:theirs (group 'torchx.named_resources')" in m
        and "builtin" in m
        for m in messages
    ), messages
    assert any(
        "shared = atx_tx_resources:theirs (group 'torchx.named_resources')" in m
        and f"(group '{ENTRY_POINT_GROUP}')" in m
        for m in messages
    ), messages
