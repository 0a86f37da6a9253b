"""macros: substitution into a copy of a role's args, env values and metadata, nothing else."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from asynctorchx.specs import Role, macros


def _values() -> macros.Values:
    return macros.Values(img_root="/img", app_id="app-123", replica_id="2", rank0_env="MASTER_ADDR")


def _role() -> Role:
    return Role(
        name="trainer",
        image=f"{macros.img_root}/image",
        entrypoint=f"{macros.img_root}/bin/train",
        args=[
            "--app_id",
            macros.app_id,
            f"--out=/tmp/{macros.app_id}/{macros.replica_id}",
            f"--master={macros.rank0_env}",
            "--keep=${unknown}",
            "$$literal",
        ],
        env={"IMAGE_ROOT_DIR": macros.img_root, "RANK0": macros.rank0_env, "PLAIN": "x"},
        metadata={
            "path": f"{macros.img_root}/meta",
            "nested": {"ids": [macros.replica_id, macros.app_id], "n": 3},
        },
    )


def test_macro_placeholders_are_dollar_brace_names() -> None:
    """Each macro is the ``${name}`` template placeholder of its name."""
    assert macros.img_root == "${img_root}"
    assert macros.app_id == "${app_id}"
    assert macros.replica_id == "${replica_id}"
    assert macros.rank0_env == "${rank0_env}"
    assert macros.base_img_root == "${base_img_root}"


def test_substitute_replaces_known_and_keeps_unknown_placeholders() -> None:
    """substitute() fills known macros, leaves unknown ``${...}`` and folds ``$$`` to ``$``."""
    v = _values()
    assert v.substitute(f"{macros.app_id}:{macros.replica_id}") == "app-123:2"
    assert v.substitute("${unknown} ${img_root}") == "${unknown} /img"
    assert v.substitute("no macros") == "no macros"


def test_apply_substitutes_args() -> None:
    """apply() substitutes every macro in the role's args."""
    new = _values().apply(_role())
    assert new.args == [
        "--app_id",
        "app-123",
        "--out=/tmp/app-123/2",
        "--master=MASTER_ADDR",
        "--keep=${unknown}",
        "$literal",
    ]


def test_apply_substitutes_env_values_only() -> None:
    """apply() substitutes env values; keys are kept as they are."""
    new = _values().apply(_role())
    assert new.env == {"IMAGE_ROOT_DIR": "/img", "RANK0": "MASTER_ADDR", "PLAIN": "x"}


def test_apply_substitutes_metadata_recursively() -> None:
    """apply() substitutes strings in metadata, inside nested dicts and lists; other values stay."""
    new = _values().apply(_role())
    assert new.metadata == {"path": "/img/meta", "nested": {"ids": ["2", "app-123"], "n": 3}}


def test_apply_leaves_entrypoint_and_image_untouched() -> None:
    """Macros in the entrypoint and the image are not substituted."""
    new = _values().apply(_role())
    assert new.entrypoint == "${img_root}/bin/train"
    assert new.image == "${img_root}/image"


def test_apply_returns_a_copy_and_leaves_the_callers_role_unchanged() -> None:
    """apply() returns a new role sharing no mutable state; the given role is not modified."""
    role = _role()
    before = copy.deepcopy(role)
    new = _values().apply(role)
    assert role == before
    assert new is not role
    assert new.args is not role.args
    assert new.env is not role.env
    assert new.metadata is not role.metadata
    assert new.resource is not role.resource
    assert new.mounts is not role.mounts
    new.metadata["nested"]["ids"].append("x")
    new.port_map["p"] = 1
    assert role == before


def test_apply_keeps_every_other_field() -> None:
    """Fields without macros (name, replicas, retries, ports...) are copied unchanged."""
    role = Role(
        name="ps", image="img", entrypoint="run", num_replicas=3, max_retries=2, port_map={"a": 1}
    )
    new = _values().apply(role)
    assert (new.name, new.num_replicas, new.max_retries, new.port_map) == ("ps", 3, 2, {"a": 1})


def test_apply_tolerates_non_string_values() -> None:
    """Non-string env values pass through apply() unchanged so validation can report them."""
    role = Role(name="r", image="i", entrypoint="e", env={"N": 1})  # type: ignore[dict-item]
    assert _values().apply(role).env == {"N": 1}  # type: ignore[comparison-overlap]


def test_values_are_frozen() -> None:
    """macros.Values is immutable, so one instance can be shared across replicas."""
    v = _values()
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.app_id = "other"  # type: ignore[misc]
    assert v.app_id == "app-123"
