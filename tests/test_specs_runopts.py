"""runopts: declaring options, resolving cfgs, parsing cfg strings, and the help text."""

from __future__ import annotations

import math
from typing import Dict, List  # noqa: UP035

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynctorchx.specs import CfgVal, InvalidRunConfigException, runopt, runopts

# TorchX users declare options with the typing generics; both spellings must work.
LIST_STR = List[str]  # noqa: UP006
DICT_STR = Dict[str, str]  # noqa: UP006


def _opts() -> runopts:
    opts = runopts()
    opts.add("run_as_user", type_=str, help="user to run the job as")
    opts.add("cluster_id", type_=int, help="cluster to submit the job", required=True)
    opts.add("priority", type_=float, default=0.5, help="job priority")
    opts.add("preemptible", type_=bool, default=False, help="is the job preemptible")
    opts.add("tags", type_=LIST_STR, default=["a"], help="tags")
    opts.add("labels", type_=DICT_STR, help="labels")
    return opts


def _doc_opts() -> runopts:
    opts = runopts()
    opts.add("FOO", type_=LIST_STR, default=["a"], help="an optional list option")
    opts.add("BAR", type_=str, required=True, help="a required str option")
    return opts


# -- add -------------------------------------------------------------------------------------------


def test_add_required_with_default_is_value_error() -> None:
    """A required option that also declares a default is rejected with ValueError naming it."""
    with pytest.raises(ValueError, match=r"'illegal'.*10"):
        runopts().add("illegal", type_=int, help="x", default=10, required=True)


def test_add_default_of_wrong_type_is_type_error() -> None:
    """A default that is not of the declared type is rejected with TypeError naming key and value."""
    with pytest.raises(TypeError, match=r"'bad_type'.*str.*10"):
        runopts().add("bad_type", type_=str, help="x", default=10)
    with pytest.raises(TypeError, match=r"List\[str\]"):
        runopts().add("bad_list", type_=LIST_STR, help="x", default=[1, 2])  # type: ignore[list-item]


def test_add_records_option_and_supports_len_iter_contains_get() -> None:
    """add() registers a runopt visible through len, iteration, ``in`` and get()."""
    opts = _opts()
    assert len(opts) == 6
    assert "priority" in opts and "nope" not in opts
    assert opts.get("priority") == runopt(0.5, float, False, "job priority")
    assert opts.get("nope") is None
    names = [name for name, _ in opts]
    assert names == ["run_as_user", "cluster_id", "priority", "preemptible", "tags", "labels"]


def test_update_merges_other_options() -> None:
    """update() adds the other runopts' options and replaces same-named ones."""
    a = runopts()
    a.add("x", type_=int, help="old", default=1)
    b = runopts()
    b.add("x", type_=int, help="new", default=2)
    b.add("y", type_=str, help="y")
    a.update(b)
    assert a.get("x") == runopt(2, int, False, "new")
    assert "y" in a


# -- is_type ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("obj", "tp", "expected"),
    [
        (["a", "b"], LIST_STR, True),
        ([], LIST_STR, True),
        (["a", 1], LIST_STR, False),
        ("a", LIST_STR, False),
        (["a"], list[str], True),
        ({"k": "v"}, DICT_STR, True),
        ({}, DICT_STR, True),
        ({"k": 1}, DICT_STR, False),
        ({1: "v"}, DICT_STR, False),
        (["k"], DICT_STR, False),
        ([1], List[int], False),  # noqa: UP006
        ({"k": "v"}, dict[str, str], True),
        (1, int, True),
        (True, int, False),
        (1.5, float, True),
        (1, float, True),
        (True, bool, True),
        ("s", str, True),
        (1, str, False),
    ],
)
def test_is_type(obj: CfgVal, tp: object, expected: bool) -> None:
    """is_type checks List[str] and Dict[str, str] element-wise and keeps bools out of int/float."""
    assert runopts.is_type(obj, tp) is expected


# -- resolve ---------------------------------------------------------------------------------------


def test_resolve_fills_defaults_and_keeps_given_values() -> None:
    """Unset options get their defaults (None when there is none); given values are kept."""
    resolved = _opts().resolve({"cluster_id": 3, "priority": 0.9})
    assert resolved == {
        "cluster_id": 3,
        "priority": 0.9,
        "run_as_user": None,
        "preemptible": False,
        "tags": ["a"],
        "labels": None,
    }


def test_resolve_missing_required_names_the_key() -> None:
    """A missing (or None) required option raises InvalidRunConfigException naming the key."""
    with pytest.raises(InvalidRunConfigException, match="'cluster_id'") as ei:
        _opts().resolve({})
    assert ei.value.cfg_key == "cluster_id"
    with pytest.raises(InvalidRunConfigException, match="'cluster_id'"):
        _opts().resolve({"cluster_id": None})


def test_resolve_type_error_names_key_type_and_value() -> None:
    """A value of the wrong type raises InvalidRunConfigException naming key, type and value."""
    with pytest.raises(InvalidRunConfigException, match=r"'cluster_id'.*int.*'three'") as ei:
        _opts().resolve({"cluster_id": "three"})
    assert ei.value.cfg_key == "cluster_id"
    with pytest.raises(InvalidRunConfigException, match=r"'tags'.*List\[str\]"):
        _opts().resolve({"cluster_id": 1, "tags": "a,b"})
    with pytest.raises(InvalidRunConfigException, match=r"'preemptible'.*bool"):
        _opts().resolve({"cluster_id": 1, "preemptible": "yes"})


def test_resolve_refuses_nul_characters_naming_the_key() -> None:
    """A NUL in a str, List[str] or Dict[str, str] value raises InvalidRunConfigException naming it."""
    for key, value in (
        ("run_as_user", "a\0b"),
        ("tags", ["ok", "a\0b"]),
        ("labels", {"k": "a\0b"}),
        ("labels", {"a\0b": "v"}),
    ):
        with pytest.raises(
            InvalidRunConfigException, match=rf"'{key}' must not contain a NUL"
        ) as ei:
            _opts().resolve({"cluster_id": 1, key: value})
        assert ei.value.cfg_key == key


def test_resolve_keeps_unknown_keys() -> None:
    """Keys that are not options are passed through untouched (another layer may know them)."""
    resolved = _opts().resolve({"cluster_id": 1, "image_repo": "r", "n": 3})
    assert resolved["image_repo"] == "r"
    assert resolved["n"] == 3


def test_resolve_does_not_mutate_the_given_cfg() -> None:
    """resolve() returns a new dict; the caller's cfg is unchanged."""
    cfg: dict[str, CfgVal] = {"cluster_id": 1}
    resolved = _opts().resolve(cfg)
    assert cfg == {"cluster_id": 1}
    assert resolved is not cfg


# -- cfg_from_str ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cfg_str", "expected"),
    [
        ("", {}),
        ("UNKNOWN=VALUE", {}),
        ("FOO=v1", {"FOO": ["v1"]}),
        ("FOO=v1,v2", {"FOO": ["v1", "v2"]}),
        ("FOO=v1;v2", {"FOO": ["v1", "v2"]}),
        ("FOO=v1,v2,BAR=v3", {"FOO": ["v1", "v2"], "BAR": "v3"}),
        ("FOO=v1;v2,BAR=v3", {"FOO": ["v1", "v2"], "BAR": "v3"}),
        ("FOO=v1;v2;BAR=v3", {"FOO": ["v1", "v2"], "BAR": "v3"}),
        ("BAR=v3,FOO=v1;v2", {"FOO": ["v1", "v2"], "BAR": "v3"}),
        ("FOO=v1,v2,", {"FOO": ["v1", "v2"]}),
        ("BAR=v3;", {"BAR": "v3"}),
        (" FOO = v1 , BAR = v3 ", {"FOO": ["v1"], "BAR": "v3"}),
        ("BAR=--flag=x", {"BAR": "--flag=x"}),
        ("BAR=", {"BAR": ""}),
    ],
)
def test_cfg_from_str_documented_examples(cfg_str: str, expected: dict[str, CfgVal]) -> None:
    """The reference's examples: ',' or ';' delimit pairs and list items; unknown keys are dropped.

    A single list item still parses to a list (the option's type), and a trailing delimiter ends
    the last pair rather than becoming part of its value.
    """
    assert _doc_opts().cfg_from_str(cfg_str) == expected


def test_cfg_from_str_does_not_check_required_or_defaults() -> None:
    """cfg_from_str only parses; resolve(cfg_from_str(...)) fills defaults and checks required."""
    opts = _doc_opts()
    assert opts.cfg_from_str("FOO=x") == {"FOO": ["x"]}
    with pytest.raises(InvalidRunConfigException, match="'BAR'"):
        opts.resolve(opts.cfg_from_str("FOO=x"))
    assert opts.resolve(opts.cfg_from_str("BAR=b")) == {"BAR": "b", "FOO": ["a"]}


def test_cfg_from_str_casts_each_type() -> None:
    """Values are cast to int, float, bool, List[str] and Dict[str, str] as declared."""
    cfg = _opts().cfg_from_str(
        "cluster_id=7,priority=0.25,preemptible=True,tags=x;y,labels=team:ml;env:dev,run_as_user=bob"
    )
    assert cfg == {
        "cluster_id": 7,
        "priority": 0.25,
        "preemptible": True,
        "tags": ["x", "y"],
        "labels": {"team": "ml", "env": "dev"},
        "run_as_user": "bob",
    }
    assert _opts().cfg_from_str("preemptible=false") == {"preemptible": False}
    assert _opts().cfg_from_str("labels=url:http://h:80") == {"labels": {"url": "http://h:80"}}


@pytest.mark.parametrize(
    ("cfg_str", "key"),
    [
        ("cluster_id=three", "cluster_id"),
        ("priority=high", "priority"),
        ("preemptible=maybe", "preemptible"),
        ("labels=novalue", "labels"),
    ],
)
def test_cfg_from_str_bad_value_names_key_and_value(cfg_str: str, key: str) -> None:
    """A value that cannot be cast raises InvalidRunConfigException naming the key and the raw value."""
    raw = cfg_str.split("=", 1)[1]
    with pytest.raises(InvalidRunConfigException, match=rf"'{key}'.*'{raw}'") as ei:
        _opts().cfg_from_str(cfg_str)
    assert ei.value.cfg_key == key


@pytest.mark.parametrize("cfg_str", ["nonsense", "=v", "v1,v2"])
def test_cfg_from_str_without_pairs_is_rejected(cfg_str: str) -> None:
    """A string that does not start with a key=value pair is rejected with the string in the message."""
    with pytest.raises(InvalidRunConfigException, match="key=value"):
        _opts().cfg_from_str(cfg_str)


def test_cfg_from_json_repr_keeps_known_keys() -> None:
    """cfg_from_json_repr parses a JSON object, keeping only declared options."""
    cfg = _opts().cfg_from_json_repr('{"tags": ["x"], "cluster_id": 2, "other": 1}')
    assert cfg == {"tags": ["x"], "cluster_id": 2}


# -- hypothesis round trip ------------------------------------------------------------------------

_KEYS = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,11}", fullmatch=True)
_ATOM = st.text(
    alphabet=st.characters(
        codec="ascii", categories=("L", "N", "P", "S"), exclude_characters=",;=:"
    ),
    min_size=1,
    max_size=10,
)
_STR_VAL = st.text(
    alphabet=st.characters(
        codec="utf-8", exclude_characters="\0,;=\r\n\t\x0b\x0c\x1c\x1d\x1e\x1f\x85"
    ),  # NUL: resolve refuses it (test_resolve_refuses_nul_characters_naming_the_key)
    max_size=12,
).map(str.strip)
_FLOATS = st.floats(allow_nan=False)

_TYPED_VALUES: list[tuple[object, st.SearchStrategy[CfgVal]]] = [
    (str, _STR_VAL),
    (int, st.integers()),
    (float, _FLOATS),
    (bool, st.booleans()),
    (LIST_STR, st.lists(_ATOM, max_size=4)),
    (DICT_STR, st.dictionaries(_ATOM, _ATOM | st.just("http://h:80"), max_size=4)),
]


@st.composite
def _cfgs(draw: st.DrawFn) -> tuple[runopts, dict[str, CfgVal]]:
    keys = draw(st.lists(_KEYS, unique_by=str.lower, min_size=1, max_size=6))
    opts = runopts()
    cfg: dict[str, CfgVal] = {}
    for key in keys:
        tp, values = draw(st.sampled_from(_TYPED_VALUES))
        opts.add(key, type_=tp, help=f"{key} option")
        cfg[key] = draw(values)
    return opts, cfg


def _render(val: CfgVal, delim: str) -> str:
    if isinstance(val, list):
        return delim.join(val)
    if isinstance(val, dict):
        return delim.join(f"{k}:{v}" for k, v in val.items())
    if isinstance(val, float):
        return repr(val)
    return str(val)


@settings(deadline=None)
@given(_cfgs(), st.sampled_from([",", ";"]), st.sampled_from([",", ";"]))
def test_cfg_from_str_round_trips_rendered_cfgs(
    opts_cfg: tuple[runopts, dict[str, CfgVal]], pair_delim: str, item_delim: str
) -> None:
    """Any cfg of str/int/float/bool/List[str]/Dict[str, str] rendered as a cfg string parses back."""
    opts, cfg = opts_cfg
    cfg_str = pair_delim.join(f"{k}={_render(v, item_delim)}" for k, v in cfg.items())
    parsed = opts.cfg_from_str(cfg_str)
    assert parsed == cfg
    for key, val in cfg.items():
        assert type(parsed[key]) is type(val)
        if isinstance(val, float) and math.isinf(val):
            assert parsed[key] == val
    assert opts.resolve(parsed) == cfg


# -- help repr -------------------------------------------------------------------------------------


def test_help_repr_lists_required_then_optional_with_types_defaults_and_help() -> None:
    """repr(runopts) shows a usage line, then required and optional sections with type, default, help."""
    text = repr(_opts())
    assert "usage:" in text
    usage = text.splitlines()[1].strip()
    assert usage.startswith("cluster_id=CLUSTER_ID,[run_as_user=RUN_AS_USER]")
    assert "required arguments:" in text and "optional arguments:" in text
    assert text.index("required arguments:") < text.index("optional arguments:")
    assert "cluster_id=CLUSTER_ID (int)" in text
    assert "priority=PRIORITY (float, 0.5)" in text
    assert "tags=TAGS (List[str], ['a'])" in text
    assert "labels=LABELS (Dict[str, str], None)" in text
    assert "job priority" in text


def test_help_repr_omits_empty_sections() -> None:
    """A runopts without required options has no 'required arguments' section."""
    opts = runopts()
    opts.add("x", type_=int, help="an x", default=1)
    assert "required arguments" not in repr(opts)
    assert "optional arguments" in repr(opts)
