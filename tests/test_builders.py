"""The component -> argparse machinery: flags, typed decoding, defaults and errors."""

from __future__ import annotations

import inspect
from typing import Annotated, Dict, List, Optional  # noqa: UP035 - the typing forms are supported too

import pytest

from asynctorchx.specs import AppDef, Role
from asynctorchx.specs.builders import (
    component_args_from_str,
    create_args_parser,
    decode,
    format_help,
    get_argparse_param_type,
    materialize_appdef,
    materialize_appdef_from_kwargs,
    parse_args,
    to_bool,
    to_dict,
    to_list,
)
from asynctorchx.specs.errors import (
    ComponentValidationException,
    ConfigWarning,
    InvalidComponentArgsException,
)


def _app(*args: str) -> AppDef:
    return AppDef("test", [Role("r", "img", "echo", args=list(args))])


def typed(
    *rest: str,
    count: int,
    ratio: float = 0.5,
    label: str = "x",
    flag: bool = False,
    items: list[str] | None = None,
    numbers: Optional[List[int]] = None,  # noqa: UP006, UP045
    env: dict[str, str] | None = None,
    weights: Dict[str, float] | None = None,  # noqa: UP006
    j: str = "1x2",
    h: Optional[str] = None,  # noqa: UP045
) -> AppDef:
    """A component with one parameter of each supported type.

    This line is part of the description.

    Args:
        rest: everything after the options
        count: how many
            (a required int)
        ratio: a float
        label: a string
        flag: a bool
        items: a list of strings
        numbers: a list of ints
        env: a dict
        weights: a dict of floats
        j: a one-letter option
        h: another one-letter option, short flag -h

    Returns:
        the app
    """
    return _app(str(count), *rest)


def test_long_and_short_flags():
    """Every parameter is --name; one-letter parameters are also -x, including -h."""
    ns = parse_args(typed, ["--count", "1", "-j", "2x4", "-h", "cpu.small"])
    assert (ns.j, ns.h) == ("2x4", "cpu.small")
    ns = parse_args(typed, ["--count", "1", "--j", "3", "--h", "gpu.small"])
    assert (ns.j, ns.h) == ("3", "gpu.small")


def test_typed_decoding():
    """int, float, str, bool, List/Dict (typing and builtin forms) and Optional decode to their types."""
    ns = parse_args(
        typed,
        [
            "--count", "3",
            "--ratio", "0.25",
            "--label", "hello world",
            "--flag", "true",
            "--items", "a,b, c",
            "--numbers", "1,2,3",
            "--env", "FOO=1,BAR=x,y",
            "--weights", "a=0.5;b=2",
        ],
    )  # fmt: skip
    assert ns.count == 3 and isinstance(ns.count, int)
    assert ns.ratio == 0.25
    assert ns.label == "hello world"
    assert ns.flag is True
    assert ns.items == ["a", "b", "c"]
    assert ns.numbers == [1, 2, 3]
    assert ns.env == {"FOO": "1", "BAR": "x,y"}
    assert ns.weights == {"a": 0.5, "b": 2.0}


def test_optional_defaults_stay_none():
    """Optional parameters that are not given keep their None default (not the string 'None')."""
    ns = parse_args(typed, ["--count", "1"])
    assert ns.items is None and ns.numbers is None and ns.env is None and ns.h is None
    assert ns.flag is False and ns.ratio == 0.5


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--flag"], True),
        (["--flag", "True"], True),
        (["--flag", "1"], True),
        (["--flag", "yes"], True),
        (["--flag", "false"], False),
        (["--flag", "0"], False),
        (["--flag", "No"], False),
        ([], False),
    ],
)
def test_bool_forms(argv, expected):
    """A bool is --flag alone (true) or --flag with true/false, 1/0, yes/no in any case."""
    assert parse_args(typed, ["--count", "1", *argv]).flag is expected


def test_missing_required_argument_is_named():
    """Leaving out a parameter without default raises an argparse-style error naming it."""
    with pytest.raises(InvalidComponentArgsException, match=r"required: --count") as info:
        parse_args(typed, [])
    assert info.value.component == "typed"
    assert info.value.usage.startswith("usage: asynctorchx run <run args...> typed")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--count", "x"], r"argument --count: invalid int value: 'x'"),
        (["--count", "1", "--ratio", "fast"], r"argument --ratio: invalid float value: 'fast'"),
        (["--count", "1", "--flag", "maybe"], r"argument --flag: invalid bool value: 'maybe' is not a bool"),
        (["--count", "1", "--numbers", "1,x"], r"argument --numbers: invalid List\[int\] value '1,x': 'x' is not an int"),
        (["--count", "1", "--env", "novalue"], r"argument --env: invalid Dict\[str, str\] value 'novalue'"),
        (["--count", "1", "--weights", "a=heavy"], r"argument --weights: .*'heavy' is not a float"),
        (["--count", "1", "--env", "=1"], r"argument --env: .*empty key"),
    ],
)  # fmt: skip
def test_bad_value_names_argument_and_type(argv, message):
    """A value that does not decode raises an error naming the argument, the type and the value."""
    with pytest.raises(InvalidComponentArgsException, match=message):
        parse_args(typed, argv)


def no_varargs(count: int = 1) -> AppDef:
    """No *args.

    Args:
        count: how many
    """
    return _app(str(count))


def test_unknown_argument_is_rejected():
    """An option the component does not take is an error naming it."""
    with pytest.raises(InvalidComponentArgsException, match=r"unrecognized arguments: --bogus"):
        parse_args(no_varargs, ["--bogus", "1"])


def test_abbreviations_are_not_accepted():
    """A prefix of a parameter name is not accepted for it (no surprising matches)."""
    with pytest.raises(InvalidComponentArgsException, match="unrecognized arguments: --cou"):
        parse_args(no_varargs, ["--cou", "1"])


def test_varargs_take_the_remainder():
    """*args takes everything from the first positional on, options included; a leading -- is dropped."""
    args = component_args_from_str(typed, ["--count", "2", "run", "--lr", "0.1"])
    assert args.var_args == ["run", "--lr", "0.1"]
    args = component_args_from_str(typed, ["--count", "2", "--", "--lr", "0.1"])
    assert args.var_args == ["--lr", "0.1"]
    assert args.kwargs["count"] == 2
    app = materialize_appdef(typed, ["--count", "2", "--", "-x", "y"])
    assert app.roles[0].args == ["2", "-x", "y"]


def test_varargs_default_string_is_split_like_a_shell():
    """A *args default given as a string (from a config file) is split like a shell command line."""
    app = materialize_appdef(typed, ["--count", "1"], {"rest": "-a 'b c' --d=e"})
    assert app.roles[0].args == ["1", "-a", "b c", "--d=e"]
    app = materialize_appdef(typed, ["--count", "1", "x"], {"rest": "-a b"})
    assert app.roles[0].args == ["1", "x"]


def test_precedence_explicit_then_config_then_defaults_then_signature():
    """Explicit arguments beat config, config beats component defaults, which beat the signature."""
    defaults = {"label": "from-defaults", "ratio": "0.75", "j": "4"}
    config = {"label": "from-config"}
    ns = parse_args(typed, ["--count", "1"], defaults, config)
    assert (ns.label, ns.ratio, ns.j, ns.h) == ("from-config", 0.75, "4", None)
    ns = parse_args(typed, ["--count", "1", "--label", "explicit"], defaults, config)
    assert ns.label == "explicit"


def test_defaults_satisfy_required_arguments_and_are_decoded():
    """A string default for a required parameter makes it optional and is decoded by its type."""
    ns = parse_args(
        typed, [], {"count": "5", "flag": "True", "items": "a,b", "env": "A=1", "numbers": "4"}
    )
    assert (ns.count, ns.flag, ns.items, ns.env, ns.numbers) == (
        5,
        True,
        ["a", "b"],
        {"A": "1"},
        [4],
    )


def test_bad_default_value_names_argument():
    """A default that does not decode (e.g. from .torchxconfig) is reported like a bad argument."""
    with pytest.raises(
        InvalidComponentArgsException, match=r"argument --count: invalid int value: 'many'"
    ):
        parse_args(typed, [], {"count": "many"})


def test_a_bad_default_says_where_it_was_set():
    """A default that does not decode names its source ([component:NAME] or config=), since the
    command line the user typed does not hold it."""
    with pytest.raises(
        InvalidComponentArgsException,
        match=r"argument --count: invalid int value: 'many' \(the default set in "
        r"\[component:utils\.typed\] \(\.torchxconfig or component_defaults=\)\)",
    ):
        parse_args(typed, [], {"count": "many"}, name="utils.typed")
    with pytest.raises(InvalidComponentArgsException, match=r"'many' \(the config\)"):
        parse_args(typed, [], None, {"count": "many"})
    with pytest.raises(InvalidComponentArgsException, match=r"\[component:typed\]"):
        materialize_appdef_from_kwargs(typed, {}, {"count": "x"})


def test_a_bad_default_replaced_on_the_command_line_is_no_error():
    """A default is decoded only when used: one replaced by an explicit argument cannot fail."""
    assert parse_args(typed, ["--count", "3"], {"count": "many"}).count == 3
    explicit = "".join(["ma", "ny"])  # (a string of its own, as argv's are: not the constant)
    with pytest.raises(InvalidComponentArgsException) as caught:
        parse_args(typed, ["--count", explicit], {"count": "many"})
    assert "default" not in str(caught.value)  # the explicit value is the bad one


def test_unknown_default_key_warns():
    """A component default that is not a parameter is ignored with a ConfigWarning naming it."""
    with pytest.warns(
        ConfigWarning, match=r"'countt'.*not a parameter of component 'typed'.*did you mean 'count'"
    ):
        ns = parse_args(typed, ["--count", "1"], {"countt": "2"})
    assert ns.count == 1


def test_help_shows_docstring_defaults_and_required():
    """--help prints the description, each argument's docstring text, (required) and defaults."""
    text = format_help(typed, name="test.typed")
    assert text.startswith("usage: asynctorchx run <run args...> test.typed")
    assert "A component with one parameter of each supported type." in text
    assert "This line is part of the description." in text
    assert "Returns:" not in text
    assert "how many (a required int) (required)" in text
    assert "a float (default: 0.5)" in text
    assert "-h H, --h H" in text


def test_help_flag_prints_and_exits_zero(capsys):
    """--help prints the help on stdout and exits 0, like argparse."""
    with pytest.raises(SystemExit) as info:
        parse_args(typed, ["--help"])
    assert info.value.code == 0
    assert "a list of strings" in capsys.readouterr().out


def test_help_shows_config_defaults():
    """Defaults from config appear in the help text as the effective defaults."""
    assert "a string (default: from-config)" in format_help(typed, {"label": "from-config"})


def undocumented(a: int, b: str = "x") -> AppDef:
    return _app(str(a), b)


def test_component_without_docstring_still_parses():
    """A component without docstring gets a hint as description and still parses its arguments."""
    assert "docstring" in format_help(undocumented)
    assert materialize_appdef(undocumented, ["-a", "1"]).roles[0].args == ["1", "x"]


def test_kwargs_component_is_rejected():
    """A component taking **kwargs cannot be turned into a parser; the error names the parameter."""

    def bad(**extra: str) -> AppDef:
        return _app()

    with pytest.raises(TypeError, match=r"'\*\*extra' is not supported"):
        create_args_parser(bad)


def test_component_returning_something_else_is_rejected():
    """materialize_appdef raises naming the component and the returned type and module."""

    def not_an_app(x: str = "a") -> AppDef:
        return "oops"  # type: ignore[return-value]

    with pytest.raises(
        ComponentValidationException,
        match=r"'not_an_app' is not valid: it returned a str \(module builtins\), not an AppDef",
    ):
        materialize_appdef(not_an_app, [])


def test_component_returning_none_is_rejected():
    """A component that returns None gets an error saying so (a missing return statement)."""

    def forgot(x: str = "a") -> AppDef:  # type: ignore[empty-body]
        pass

    with pytest.raises(ComponentValidationException, match="it returned None, not an AppDef"):
        materialize_appdef_from_kwargs(forgot, {})


def test_annotated_short_flag():
    """Annotated[str, "-cn"] declares an extra short flag, as in TorchX."""

    def hydra_like(config_name: Annotated[str, "-cn"], n: Annotated[int, "-N"] = 1) -> AppDef:
        return _app(config_name, str(n))

    assert materialize_appdef(hydra_like, ["-cn", "conf", "-N", "3"]).roles[0].args == ["conf", "3"]
    assert materialize_appdef(hydra_like, ["--config_name", "c"]).roles[0].args == ["c", "1"]


def test_an_option_declared_by_two_parameters_is_a_component_error_naming_them():
    """Two parameters declaring one option is a ComponentValidationException naming it."""

    def clash(a: Annotated[str, "-x"] = "a", b: Annotated[str, "-x"] = "b") -> AppDef:
        return _app(a, b)

    def shadows(j: str = "a", k: Annotated[str, "-j"] = "b") -> AppDef:
        return _app(j, k)

    with pytest.raises(ComponentValidationException, match=r"'clash'.*parameter 'b'.*: -x"):
        materialize_appdef(clash, [], name="clash")
    with pytest.raises(ComponentValidationException, match=r"parameter 'k'.*: -j"):
        format_help(shadows)


def test_positional_and_keyword_parameters_are_passed_correctly():
    """Positional-or-keyword parameters, *args and keyword-only parameters reach the function."""

    def mixed(first: str, *rest: str, last: int = 0) -> AppDef:
        return _app(first, *rest, str(last))

    app = materialize_appdef(mixed, ["--first", "a", "--last", "9", "b", "c"])
    assert app.roles[0].args == ["a", "b", "c", "9"]


def test_int_varargs_are_decoded():
    """*args annotated int are decoded; a bad one names the parameter."""

    def ints(*values: int) -> AppDef:
        return _app(*(str(v * 2) for v in values))

    assert materialize_appdef(ints, ["1", "2"]).roles[0].args == ["2", "4"]
    with pytest.raises(InvalidComponentArgsException, match="argument values: 'x' is not an int"):
        materialize_appdef(ints, ["1", "x"])


def test_unresolvable_annotation_falls_back_to_string():
    """A parameter whose annotation cannot be evaluated is taken as a string."""

    def odd(x: NotAType = "a") -> AppDef:  # type: ignore[name-defined]  # noqa: F821
        return _app(x)

    assert materialize_appdef(odd, ["--x", "b"]).roles[0].args == ["b"]


def test_get_argparse_param_type():
    """Scalars map to themselves; bool, list and dict map to decoding functions; unannotated to str."""
    params = inspect.signature(typed).parameters
    assert get_argparse_param_type(params["count"]) is int
    assert get_argparse_param_type(params["ratio"]) is float
    assert get_argparse_param_type(params["label"]) is str
    assert get_argparse_param_type(params["h"]) is str
    assert get_argparse_param_type(params["numbers"])("1,2") == [1, 2]
    assert get_argparse_param_type(params["flag"])("off") is False
    unannotated = inspect.Parameter("x", inspect.Parameter.KEYWORD_ONLY)
    assert get_argparse_param_type(unannotated) is str


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", {}),
        ("FOO=v1", {"FOO": "v1"}),
        ("FOO=''", {"FOO": ""}),
        ('FOO=""', {"FOO": ""}),
        ("FOO=v1,v2", {"FOO": "v1,v2"}),
        ("FOO=v1;v2", {"FOO": "v1;v2"}),
        ("FOO=v1,v2,BAR=v3", {"FOO": "v1,v2", "BAR": "v3"}),
        ("FOO=v1;v2;BAR=v3", {"FOO": "v1;v2", "BAR": "v3"}),
        ("A=1, B = 2", {"A": "1", "B": "2"}),
        ("A=1,", {"A": "1"}),
        # quotes are characters, as in TorchX (TorchX rejects this one: '=' inside the value)
        ('FOO="value with = and , and ;",B=2', {"FOO": '"value with = and , and ;"', "B": "2"}),
        ("MSG='a b'", {"MSG": "'a b'"}),
        ("OPTS=-Dx=1 -Dy=2", {"OPTS": "-Dx=1 -Dy=2"}),
    ],
)
def test_to_dict(text, expected):
    """KEY=VALUE pairs split on , or ; with list-valued and quoted values."""
    assert to_dict(text) == expected


@pytest.mark.parametrize("text", ["novalue", "=1", "A=1,=2"])
def test_to_dict_rejects_malformed(text):
    """A string without KEY=VALUE or with an empty key raises ValueError."""
    with pytest.raises(ValueError):
        to_dict(text)


def test_to_list_and_to_bool_and_decode():
    """to_list splits on commas; to_bool knows true/false words; decode dispatches on the type."""
    assert to_list("") == [] and to_list("a, b") == ["a", "b"]
    assert to_bool("ON") is True and to_bool("off") is False
    with pytest.raises(ValueError, match="not a bool"):
        to_bool("2")
    assert decode("1,2", Optional[List[int]]) == [1, 2]  # noqa: UP006, UP045
    assert decode("A=1", dict[str, int]) == {"A": 1}
    assert decode(None, int) is None and decode(3, int) == 3


def test_materialize_from_kwargs_decodes_defaults_only():
    """Keyword values pass as they are; string defaults are decoded; explicit beats defaults."""
    app = materialize_appdef_from_kwargs(
        typed, {"count": 2, "rest": ["a"]}, {"count": "9", "label": "y"}
    )
    assert app.roles[0].args == ["2", "a"]
    app = materialize_appdef_from_kwargs(typed, {}, {"count": "9", "rest": "-x 'y z'"})
    assert app.roles[0].args == ["9", "-x", "y z"]


def test_materialize_from_kwargs_errors_name_the_argument():
    """Unknown keywords, missing required arguments and undecodable defaults name the argument."""
    with pytest.raises(InvalidComponentArgsException, match="unknown arguments: bogus"):
        materialize_appdef_from_kwargs(typed, {"count": 1, "bogus": 2})
    with pytest.raises(InvalidComponentArgsException, match="required: --count"):
        materialize_appdef_from_kwargs(typed, {})
    with pytest.raises(InvalidComponentArgsException, match="argument --count: 'x' is not an int"):
        materialize_appdef_from_kwargs(typed, {}, {"count": "x"})
