"""Turning a component function and command-line style arguments into an ``AppDef``.

A component's signature and Google-style docstring become an ``argparse`` parser, the way TorchX
users know it:

* each parameter ``foo`` is an option ``--foo VALUE``; a one-letter parameter ``j`` is also ``-j``
  (``-h`` too: only ``--help`` asks for help, so a component may take an ``h`` parameter); other
  short flags are declared with ``Annotated``: ``config_name: Annotated[str, "-cn"]``;
* ``*args`` takes the rest of the command line (a leading ``--`` is dropped);
* a parameter without a default is required; defaults come, from highest to lowest precedence, from
  the explicit arguments, ``config``, ``cmpnt_defaults`` (e.g. ``[component:NAME]`` of
  ``.torchxconfig``) and the signature;
* values are decoded from strings by type: ``int``, ``float``, ``str``, ``bool`` (``true``/``false``,
  ``1``/``0``, ``yes``/``no``; a bare ``--flag`` means true), ``list[T]`` (``a,b,c``),
  ``dict[K, V]`` (``K1=v1,K2=v2``; a value may hold ``,``-separated items: ``FOO=a,b,BAR=c``;
  quotes are kept, as in TorchX), each possibly ``Optional``. A parameter of another type (``Any``,
  ``Path``...: TorchX's linter accepts any bare type name) keeps its default: given on the command
  line or in ``.torchxconfig``, it is an error naming it, as TorchX cannot decode it either.

Bad arguments raise ``InvalidComponentArgsException`` whose message is argparse's, naming the
argument; ``--help`` prints the component's help and exits like argparse does.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import shlex
import types
import typing
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, NoReturn, Union, get_args, get_origin

from asynctorchx.specs.api import AppDef
from asynctorchx.specs.errors import (
    ComponentValidationException,
    ConfigWarning,
    InvalidComponentArgsException,
)
from asynctorchx.specs.file_linter import get_fn_docstring

ComponentFn = Callable[..., AppDef]

_TRUE = frozenset({"true", "1", "yes", "y", "on"})
_FALSE = frozenset({"false", "0", "no", "n", "off"})
_PRIMITIVES: tuple[type, ...] = (int, float, str)
_EVAL_NAMESPACE: dict[str, Any] = {
    **{name: getattr(typing, name) for name in ("List", "Dict", "Optional", "Union", "Annotated")},
    "AppDef": AppDef,
}


# ---------------------------------------------------------------------------------------------
# Types
# ---------------------------------------------------------------------------------------------


def is_bool(tp: Any) -> bool:
    """True when ``tp`` is ``bool``."""
    return tp is bool


def is_primitive(tp: Any) -> bool:
    """True when ``tp`` is ``int``, ``float`` or ``str``."""
    return tp in _PRIMITIVES


def _strip_annotated(tp: Any) -> Any:
    if get_origin(tp) is typing.Annotated:
        return get_args(tp)[0]
    return tp


def decode_optional(tp: Any) -> Any:
    """``T`` for ``Optional[T]`` / ``T | None`` (and ``Annotated[...]`` of those), else ``tp``."""
    tp = _strip_annotated(tp)
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return _strip_annotated(args[0])
    return tp


def _resolve(annotation: Any, globalns: Mapping[str, Any] | None = None) -> Any:
    """The annotation as a type; strings (``from __future__ import annotations``) are evaluated."""
    if annotation is inspect.Parameter.empty:
        return str
    if isinstance(annotation, str):
        try:
            return eval(annotation, {**_EVAL_NAMESPACE, **(globalns or {})})
        except Exception:
            return str
    return annotation


def _type_name(tp: Any) -> str:
    tp = _strip_annotated(tp)
    inner = decode_optional(tp)
    if inner is not tp:
        return f"Optional[{_type_name(inner)}]"
    origin = get_origin(tp)
    if origin in (list, dict):
        return f"{'List' if origin is list else 'Dict'}[{', '.join(_type_name(a) for a in get_args(tp))}]"
    return getattr(tp, "__name__", str(tp))


def to_bool(value: str) -> bool:
    """``true``/``false`` (also ``1``/``0``, ``yes``/``no``, ``on``/``off``, any case) as a bool.

    Raises:
        ValueError: any other string.
    """
    low = value.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"{value!r} is not a bool (true or false)")


def to_list(arg: str) -> list[str]:
    """``"a, b,c"`` as ``["a", "b", "c"]``; an empty string is an empty list."""
    if not arg.strip():
        return []
    return [item.strip() for item in arg.split(",")]


def _marks(text: str) -> list[tuple[int, str]]:
    """The positions and characters of the ``=``, ``,`` and ``;`` of ``text``.

    Quotes are ordinary characters, as in TorchX's ``to_dict``: ``MSG='a b'`` keeps its quotes and
    ``MSG=don't`` is a value.
    """
    return [(i, ch) for i, ch in enumerate(text) if ch in "=,;"]


def _empty_quotes(value: str) -> str:
    """``value`` stripped; exactly ``''`` or ``""`` is the empty string (TorchX's only unquoting)."""
    value = value.strip()
    return "" if value in ("''", '""') else value


def to_dict(arg: str) -> dict[str, str]:
    """Parses ``"K1=v1,K2=v2"`` (``,`` or ``;`` between pairs) into a dict of strings.

    As TorchX's ``to_dict``: a value may hold ``,``/``;``-separated items, the last delimiter
    before the next ``KEY=`` separating pairs, so ``"FOO=a,b,BAR=c"`` is ``{"FOO": "a,b", "BAR":
    "c"}``; quotes are kept as written (``"MSG='a b'"`` is ``{"MSG": "'a b'"}``), only a value of
    exactly ``''`` or ``""`` being empty. Unlike TorchX, which rejects it, a ``=`` not preceded by
    a delimiter stays in the value (``"OPTS=-Dx=1"`` is ``{"OPTS": "-Dx=1"}``).

    Raises:
        ValueError: the string has no ``KEY=value`` pair, or an empty key.
    """
    text = arg.strip()
    if text[-1:] in (",", ";"):
        text = text[:-1].rstrip()
    if not text:
        return {}
    marks = _marks(text)
    equals = [i for i, ch in marks if ch == "="]
    if not equals:
        raise ValueError(f"{arg!r} is not of the form KEY=VALUE[,KEY=VALUE...]")
    out: dict[str, str] = {}
    key = text[: equals[0]].strip()
    value_start = equals[0] + 1
    for eq in equals[1:]:
        delims = [i for i, ch in marks if ch in ",;" and value_start <= i < eq]
        if not delims:
            continue  # '=' inside the value: there is no pair delimiter before it
        cut = delims[-1]
        if not key:
            raise ValueError(f"empty key in {arg!r}")
        out[key] = _empty_quotes(text[value_start:cut])
        key = text[cut + 1 : eq].strip()
        value_start = eq + 1
    if not key:
        raise ValueError(f"empty key in {arg!r}")
    out[key] = _empty_quotes(text[value_start:])
    return out


def decode(value: Any, annotation: Any) -> Any:
    """Decodes a command-line string into ``annotation``'s type; non-strings are returned as they are.

    Raises:
        ValueError: the string does not decode to that type.
    """
    if value is None or not isinstance(value, str):
        return value
    return _converter(decode_optional(annotation))(value)


def _not_decodable(tp: Any) -> Callable[[str], Any]:
    """The "converter" of a type no string decodes to (``Any``, ``Path``...): it always raises.

    TorchX's linter accepts such a parameter (any bare type name), and TorchX fails when it is
    given a string (``ValueError: Unknown``); passing the string on as if it were the type would
    hand the component a ``str`` where its code expects, say, a ``Path``.
    """
    name = _type_name(tp)

    def refuse(raw: str) -> Any:
        raise ValueError(
            f"a {name} cannot be given as a string (only int, float, str, bool, lists and dicts "
            "of those can): leave it out to use the component's default"
        )

    refuse.__name__ = name
    return refuse


def _scalar_converter(tp: Any) -> Callable[[str], Any]:
    """A ``str -> value`` function whose ValueError says which item is not of which type."""
    if tp is bool:
        return to_bool
    if tp in (str, object):  # (``object`` elements are strings: TorchX's Dict[str, object])
        return str
    if tp not in (int, float):
        return _not_decodable(tp)
    article = "an" if tp is int else "a"

    def scalar(raw: str) -> Any:
        try:
            return tp(raw)
        except ValueError:
            raise ValueError(f"{raw.strip()!r} is not {article} {tp.__name__}") from None

    return scalar


def _converter(tp: Any) -> Callable[[str], Any]:
    """A ``str -> value`` function for the (non-Optional) type ``tp``; raises ValueError."""
    tp = _strip_annotated(tp)
    origin = get_origin(tp)
    if origin is list:
        (elem,) = get_args(tp) or (str,)
        convert = _scalar_converter(elem)

        def list_value(raw: str) -> list[Any]:
            return [convert(item) for item in to_list(raw)]

        return list_value
    if origin is dict:
        key_t, val_t = get_args(tp) or (str, str)
        convert_k, convert_v = _scalar_converter(key_t), _scalar_converter(val_t)

        def dict_value(raw: str) -> dict[Any, Any]:
            return {convert_k(k): convert_v(v) for k, v in to_dict(raw).items()}

        return dict_value
    return _scalar_converter(tp)


def _argparse_type(tp: Any) -> Callable[[str], object]:
    """Like ``_converter``, but failures are argparse errors naming the expected type."""
    tp = decode_optional(tp)
    if tp in (int, float, str):
        return tp  # type: ignore[no-any-return]
    convert = _converter(tp)
    name = _type_name(tp)

    def value(raw: str) -> object:
        try:
            return convert(raw)
        except ValueError as e:
            if tp is bool:
                raise argparse.ArgumentTypeError(f"invalid bool value: {e}") from None
            raise argparse.ArgumentTypeError(f"invalid {name} value {raw!r}: {e}") from None

    value.__name__ = name
    return value


def get_argparse_param_type(parameter: inspect.Parameter) -> Callable[[str], object]:
    """The argparse ``type=`` of a component parameter: decodes its annotation from a string.

    ``int``, ``float`` and ``str`` are returned as themselves; ``bool``, lists and dicts get a
    decoding function; unannotated or unsupported parameters are strings.
    """
    return _argparse_type(_resolve(parameter.annotation))


# ---------------------------------------------------------------------------------------------
# The parser
# ---------------------------------------------------------------------------------------------


#: The help of a parameter its docstring does not describe. argparse leaves out the help of an
#: option whose help is blank, and with it the ``(required)``/``(default: X)`` the formatter
#: appends; this non-blank stand-in keeps the line, and the formatter prints nothing for it.
_UNDESCRIBED = "\u200b"


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the docstring's layout and appends ``(required)`` or ``(default: X)`` to each help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = "" if action.help == _UNDESCRIBED else action.help or ""
        if action.default is argparse.SUPPRESS:
            suffix = ""
        elif action.nargs == argparse.REMAINDER:
            suffix = f"(default: {shlex.join(action.default)})" if action.default else ""
        elif action.required:
            suffix = "(required)"
        else:
            suffix = f"(default: {action.default})"
        return f"{text} {suffix}".strip().replace("%", "%%")


class _ComponentParser(argparse.ArgumentParser):
    """An ArgumentParser that raises InvalidComponentArgsException instead of exiting on errors."""

    def __init__(self, component: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.component = component

    def error(self, message: str) -> NoReturn:
        raise InvalidComponentArgsException(self.component, message, self.format_usage().strip())

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self.given: set[str] = set()  # the options seen by this parse (see _Once)
        return super().parse_known_args(args, namespace)

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._meant(extras)}")
        return parsed

    def _meant(self, extras: Sequence[str]) -> str:
        """What the first unknown option in ``extras`` may stand for: the option it abbreviates
        (TorchX's parser takes ``--ms`` for ``--msg``; this one takes options in full only, so
        that a parameter added later never changes what a command line means), else a close
        spelling; or, for an option given in full after ``--``, that ``--`` made it a positional
        argument."""
        options = [o for o in self._option_string_actions if o.startswith("--") and o != "--help"]
        after_dashes = False
        for arg in extras:
            if arg == "--":
                after_dashes = True
                continue
            name = arg.partition("=")[0]
            if not name.startswith("--") or len(name) < 3:
                continue
            if name in options:  # (a known option left over: "--" made it positional)
                if after_dashes:
                    positional = "options after '--' are read as positional arguments"
                    return f" ({positional}: give {name} before '--')"
                return ""
            longer = [o for o in options if o.startswith(name)]
            if len(longer) == 1:
                return f" ({name} abbreviates {longer[0]}: give options in full)"
            close = difflib.get_close_matches(name, options, n=1)
            if close:
                return f" (did you mean {close[0]}?)"
            return ""
        return ""


class _Action(argparse.Action):
    """An argparse action that sets ``dest`` to ``value(parser, values)``."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, self.value(parser, values))

    def value(self, parser: argparse.ArgumentParser, values: str | Sequence[Any] | None) -> Any:
        raise NotImplementedError


class _Once(_Action):
    """Stores an option's value; the option given a second time is an error, as in TorchX.

    The later value would replace the earlier one silently: ``--env A=1 --env B=2`` would launch
    without ``A``.
    """

    def value(self, parser: argparse.ArgumentParser, values: str | Sequence[Any] | None) -> Any:
        given: set[str] = getattr(parser, "given", set())
        if self.dest in given:
            parser.error(
                f"argument {'/'.join(self.option_strings)}: given more than once (the last value "
                "would replace the others); give it once"
            )
        given.add(self.dest)
        return values


class _Remainder(_Action):
    """Collects ``*args``; drops a leading ``--``; falls back to the default when nothing is given."""

    def value(self, parser: argparse.ArgumentParser, values: str | Sequence[Any] | None) -> Any:
        given = list(values or [])
        if given[:1] == ["--"]:
            given = given[1:]
        return given or list(self.default or [])


def _annotations(fn: Callable[..., Any]) -> dict[str, Any]:
    """Each parameter's annotation as a type (strings evaluated in the function's module)."""
    params = inspect.signature(fn).parameters
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception:
        hints = {}
    globalns = getattr(fn, "__globals__", {})
    return {
        name: hints[name] if name in hints else _resolve(p.annotation, globalns)
        for name, p in params.items()
    }


def _component_name(fn: Callable[..., Any], name: str | None) -> str:
    return name or str(getattr(fn, "__name__", "component"))


def _default_source(component: str) -> str:
    """Where a component default comes from, for messages."""
    return f"the default set in [component:{component}] (.torchxconfig or component_defaults=)"


def _defaults(
    fn: Callable[..., Any],
    cmpnt_defaults: Mapping[str, Any] | None,
    config: Mapping[str, Any] | None,
    component: str,
    sources: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The defaults that override the signature's; ``sources`` (if given) gets, per parameter,
    where its value came from (for messages)."""
    params = inspect.signature(fn).parameters
    merged: dict[str, Any] = {}
    for source, values in (("component default", cmpnt_defaults), ("config", config)):
        for key, value in (values or {}).items():
            if key not in params:
                close = difflib.get_close_matches(key.lstrip("-"), list(params), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                warnings.warn(
                    f"{source} {key!r} (= {value!r}) is not a parameter of component "
                    f"{component!r} and is ignored{hint}; its parameters: {', '.join(params)}",
                    ConfigWarning,
                    stacklevel=4,
                )
                continue
            merged[key] = value
            if sources is not None:
                sources[key] = (
                    _default_source(component) if source == "component default" else "the config"
                )
    return merged


def _naming_source(
    convert: Callable[[str], Any], default: str, source: str
) -> Callable[[str], Any]:
    """``convert``, saying where a string default that does not decode came from (argparse decodes
    a string default only when the option is not given, with the option's own converter)."""

    def decode_value(value: str) -> Any:
        try:
            return convert(value)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
            if value is not default:
                raise
            what = getattr(convert, "__name__", "")
            said = str(e) if isinstance(e, argparse.ArgumentTypeError) else ""
            said = said or f"invalid {what} value: {value!r}".replace("  ", " ")
            raise argparse.ArgumentTypeError(f"{said} ({source})") from None

    decode_value.__name__ = getattr(convert, "__name__", "value")
    return decode_value


def _keeping(convert: Callable[[str], Any], default: str) -> Callable[[str], Any]:
    """``convert``, except that the signature's own string default is returned as it is.

    argparse decodes a string default with the option's converter; a default of a type no string
    decodes to (``extra: Any = "x"``) must reach the component unchanged, not fail.
    """

    def decode_value(value: str) -> Any:
        try:
            return convert(value)
        except (ValueError, TypeError, argparse.ArgumentTypeError):
            if value is default:
                return value
            raise

    decode_value.__name__ = getattr(convert, "__name__", "value")
    return decode_value


def create_args_parser(
    cmpnt_fn: ComponentFn,
    cmpnt_defaults: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
) -> argparse.ArgumentParser:
    """The argparse parser of a component's arguments.

    Args:
        cmpnt_fn: the component function.
        cmpnt_defaults: defaults overriding the signature's (strings are decoded like arguments).
        config: values overriding ``cmpnt_defaults`` (explicit arguments still win).
        name: the component's name for messages (default: the function's name).

    Raises:
        TypeError: the component takes ``**kwargs``.
        ComponentValidationException: two parameters declare the same option (``Annotated``).
    """
    component = _component_name(cmpnt_fn, name)
    params = inspect.signature(cmpnt_fn).parameters
    description, arg_help = get_fn_docstring(cmpnt_fn)
    annotations = _annotations(cmpnt_fn)
    sources: dict[str, str] = {}
    overrides = _defaults(cmpnt_fn, cmpnt_defaults, config, component, sources)
    parser = _ComponentParser(
        component,
        prog=f"asynctorchx run <run args...> {component}",
        description=description,
        formatter_class=_HelpFormatter,
        add_help=False,
        allow_abbrev=False,
    )
    if "help" not in params:
        parser.add_argument(
            "--help", action="help", default=argparse.SUPPRESS, help="show this help and exit"
        )
    for pname, param in params.items():
        tp = annotations[pname]
        kwargs: dict[str, Any] = {"help": arg_help.get(pname, "") or _UNDESCRIBED}
        has_default = pname in overrides or param.default is not inspect.Parameter.empty
        default = overrides.get(pname, param.default)
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            raise TypeError(
                f"component {component!r}: parameter '**{pname}' is not supported; declare each "
                "parameter, or take a dict[str, str]"
            )
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            if isinstance(default, str):
                default = shlex.split(default)
            parser.add_argument(
                pname,
                nargs=argparse.REMAINDER,
                action=_Remainder,
                default=list(default) if has_default else [],
                metavar=pname,
                **kwargs,
            )
            continue
        flags = [f"--{pname}"]
        aliases = [
            meta
            for meta in (get_args(tp)[1:] if get_origin(tp) is typing.Annotated else ())
            if isinstance(meta, str) and meta.startswith("-")
        ]
        if aliases:
            flags = [*aliases, *flags]
        elif len(pname) == 1:
            flags.insert(0, f"-{pname}")
        kwargs["type"] = _argparse_type(tp)
        if pname in overrides and isinstance(default, str):
            kwargs["type"] = _naming_source(kwargs["type"], default, sources[pname])
        elif has_default and isinstance(default, str):
            kwargs["type"] = _keeping(kwargs["type"], default)
        if decode_optional(tp) is bool:
            kwargs.update(nargs="?", const=True, metavar="{true,false}")
        if has_default:
            kwargs["default"] = default
        else:
            kwargs["required"] = True
        try:
            parser.add_argument(*flags, dest=pname, action=_Once, **kwargs)
        except argparse.ArgumentError as e:  # an Annotated alias taken by another parameter
            raise ComponentValidationException(
                component, reason=f"parameter {pname!r}: {e.message}"
            ) from None
    return parser


def parse_args(
    cmpnt_fn: ComponentFn,
    cmpnt_args: Sequence[str],
    cmpnt_defaults: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
) -> argparse.Namespace:
    """Parses ``cmpnt_args`` into a namespace with one typed attribute per parameter.

    Precedence, highest first: ``cmpnt_args``, ``config``, ``cmpnt_defaults``, the signature.

    Raises:
        InvalidComponentArgsException: a required argument is missing, a value does not decode,
            or an argument is unknown; the message names the argument.
        SystemExit: ``--help`` was given (after printing the help, as argparse does).
    """
    parser = create_args_parser(cmpnt_fn, cmpnt_defaults, config, name=name)
    return parser.parse_args(list(cmpnt_args))


class ComponentArgs(NamedTuple):
    """A component's arguments, decoded and split the way the function takes them.

    Args:
        positional_args: positional (or positional-or-keyword) parameters, in order.
        var_args: the values of ``*args``.
        kwargs: keyword-only parameters.
    """

    positional_args: dict[str, Any]
    var_args: list[Any]
    kwargs: dict[str, Any]


def component_args_from_str(
    cmpnt_fn: ComponentFn,
    cmpnt_args: Sequence[str],
    cmpnt_defaults: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
) -> ComponentArgs:
    """Parses and decodes ``cmpnt_args`` into the arguments to call ``cmpnt_fn`` with.

    Raises:
        InvalidComponentArgsException: see ``parse_args``.
    """
    component = _component_name(cmpnt_fn, name)
    parsed = parse_args(cmpnt_fn, cmpnt_args, cmpnt_defaults, config, name=component)
    annotations = _annotations(cmpnt_fn)
    positional: dict[str, Any] = {}
    var_args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for pname, param in inspect.signature(cmpnt_fn).parameters.items():
        value = getattr(parsed, pname)
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            try:
                var_args = [decode(v, annotations[pname]) for v in value]
            except ValueError as e:
                raise InvalidComponentArgsException(
                    component, f"argument {pname}: {e}", parser_usage(cmpnt_fn, component)
                ) from None
        elif param.kind is inspect.Parameter.KEYWORD_ONLY:
            kwargs[pname] = value
        else:
            positional[pname] = value
    return ComponentArgs(positional, var_args, kwargs)


def parser_usage(cmpnt_fn: ComponentFn, name: str | None = None) -> str:
    """The one-line argparse usage of a component."""
    return create_args_parser(cmpnt_fn, name=name).format_usage().strip()


def format_help(
    cmpnt_fn: ComponentFn,
    cmpnt_defaults: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
) -> str:
    """The ``--help`` text of a component (without printing it or exiting)."""
    return create_args_parser(cmpnt_fn, cmpnt_defaults, name=name).format_help()


def materialize_appdef_from_kwargs(
    cmpnt_fn: ComponentFn,
    kwargs: Mapping[str, Any],
    cmpnt_defaults: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
) -> AppDef:
    """Calls the component with Python values; ``cmpnt_defaults`` fill in the rest, decoded.

    ``kwargs`` are passed as they are (``*args`` is given as a list under its parameter's name);
    string defaults (from ``.torchxconfig``) are decoded by the parameter's type.

    Raises:
        InvalidComponentArgsException: an unknown keyword, a missing required argument or a
            default that does not decode (the message names the argument).
        ComponentValidationException: the component does not return an ``AppDef``.
    """
    component = _component_name(cmpnt_fn, name)
    params = inspect.signature(cmpnt_fn).parameters
    usage = parser_usage(cmpnt_fn, component)
    unknown = [k for k in kwargs if k not in params]
    if unknown:
        raise InvalidComponentArgsException(
            component, f"unknown arguments: {', '.join(unknown)}", usage
        )
    defaults = _defaults(cmpnt_fn, cmpnt_defaults, None, component)
    annotations = _annotations(cmpnt_fn)
    positional: list[Any] = []
    var_args: list[Any] = []
    keywords: dict[str, Any] = {}
    for pname, param in params.items():
        if pname in kwargs:
            value = kwargs[pname]
        elif pname in defaults:
            try:
                if param.kind is inspect.Parameter.VAR_POSITIONAL:
                    raw = defaults[pname]
                    value = shlex.split(raw) if isinstance(raw, str) else list(raw)
                else:
                    value = decode(defaults[pname], annotations[pname])
            except ValueError as e:
                raise InvalidComponentArgsException(
                    component, f"argument --{pname}: {e} ({_default_source(component)})", usage
                ) from None
        elif param.default is not inspect.Parameter.empty:
            value = param.default
        elif param.kind is inspect.Parameter.VAR_POSITIONAL:
            value = []
        else:
            raise InvalidComponentArgsException(
                component, f"the following arguments are required: --{pname}", usage
            )
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            var_args = list(value)
        elif param.kind is inspect.Parameter.KEYWORD_ONLY:
            keywords[pname] = value
        else:
            positional.append(value)
    return call_component(cmpnt_fn, component, *positional, *var_args, **keywords)


def materialize_appdef(
    cmpnt_fn: ComponentFn,
    cmpnt_args: Sequence[str],
    cmpnt_defaults: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
) -> AppDef:
    """Calls the component with the arguments parsed from ``cmpnt_args`` and returns its AppDef.

    Args:
        cmpnt_fn: the component function.
        cmpnt_args: command-line style arguments, e.g. ``["--msg", "hi"]``.
        cmpnt_defaults: defaults overriding the signature's, e.g. from ``[component:NAME]``.
        config: values overriding ``cmpnt_defaults`` (explicit arguments still win).
        name: the component's name for messages.

    Raises:
        InvalidComponentArgsException: the arguments do not parse (names the argument).
        ComponentValidationException: the component does not return an ``AppDef`` (see
            ``call_component``).
        ValueError: the component rejected its arguments.
    """
    component = _component_name(cmpnt_fn, name)
    args = component_args_from_str(cmpnt_fn, cmpnt_args, cmpnt_defaults, config, name=component)
    return call_component(
        cmpnt_fn, component, *args.positional_args.values(), *args.var_args, **args.kwargs
    )


def call_component(fn: Callable[..., Any], component: str, *args: Any, **kwargs: Any) -> AppDef:
    """Calls a component function and returns its ``AppDef``.

    A ``torchx.specs.AppDef`` (from a component written for TorchX, with the ``torchx`` package
    installed) is converted field by field into ours.

    Raises:
        ComponentValidationException: the function returned None or something that is not an
            AppDef (the message names its type and module), its TorchX AppDef holds something with
            no counterpart here, it used a TorchX API asynctorchx does not provide, it called
            ``sys.exit``, or it raised an exception other than ValueError (``KeyError``...; the
            message names the component and the exception, which is kept as the ``__cause__``).
        ValueError: the component rejected its arguments (the component's own message).
    """
    from asynctorchx.specs._torchx import TorchXUnsupportedError

    try:
        app = fn(*args, **kwargs)
    except TorchXUnsupportedError as e:
        raise ComponentValidationException(component, reason=str(e)) from None
    except SystemExit as e:
        raise ComponentValidationException(
            component, reason=f"it called sys.exit({e.code!r}) instead of returning an AppDef"
        ) from None
    except ValueError:
        raise  # the component's own verdict on its arguments (a usage error), said its own way
    except Exception as e:
        # A bare "KeyError: 'missing'" would not say where it came from, and reads as a failed
        # app: it is the component's failure to build its AppDef (a spec error). The original
        # stays the __cause__, so --debug shows where in the component it was raised.
        raise ComponentValidationException(
            component, reason=f"it raised {type(e).__name__}: {e}"
        ) from e
    return as_appdef(app, component)


def as_appdef(app: object, component: str) -> AppDef:
    """``app`` as our ``AppDef``: ours as it is, a TorchX one converted; anything else raises.

    Raises:
        ComponentValidationException: ``app`` is None or not an AppDef, or a TorchX AppDef holding
            something with no counterpart here.
    """
    if isinstance(app, AppDef):
        return app
    from asynctorchx.specs._torchx import (
        TorchXConversionError,
        appdef_from_torchx,
        describe_type,
        is_torchx_object,
    )

    if is_torchx_object(app, "AppDef"):
        try:
            return appdef_from_torchx(app)
        except TorchXConversionError as e:
            raise ComponentValidationException(
                component, reason=f"its TorchX AppDef cannot be converted: {e}"
            ) from None
    if app is None:
        raise ComponentValidationException(
            component, reason="it returned None, not an AppDef (is a return statement missing?)"
        )
    raise ComponentValidationException(
        component,
        reason=f"it returned a {describe_type(app)}, not an AppDef of asynctorchx or TorchX",
    )
