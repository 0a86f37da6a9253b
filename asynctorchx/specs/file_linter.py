"""Static checks of component functions (on the source, without importing it) and docstring parsing.

A component is a plain function that returns an ``AppDef`` and whose parameters have types the
command line can express: ``int``, ``float``, ``str``, ``bool``, ``list[T]``/``List[T]`` and
``dict[K, V]``/``Dict[K, V]`` of those scalars, each optionally ``Optional[...]``/``... | None``,
plus one ``*args: str`` taking the rest of the command line. A parameter annotated with any other
bare type name (``Any``, ``Path``...) is accepted when it has a default, as TorchX accepts it: only
Python callers can change it (given on the command line, it is an error naming it). Its docstring
(Google style: summary, then an ``Args:`` section; or reST ``:param x:`` fields; or NumPy
``Parameters`` sections) becomes the ``--help`` of the component.

``validate(path, fn)`` parses the file with ``ast`` and returns one ``LinterMessage`` per problem,
each carrying the line number: errors for what would fail at run time (missing or wrong return
annotation, unsupported or missing parameter types, ``**kwargs``, ``async def``, a syntax error, no
such function), warnings for what only degrades the help text (no docstring, undocumented argument).
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Severity = Literal["error", "warning"]

SCALAR_TYPES = ("int", "float", "str", "bool")
# ``object`` elements are passed as strings (TorchX's serve.torchserve takes ``Dict[str, object]``)
_ELEMENT_TYPES = (*SCALAR_TYPES, "object")
_LIST_NAMES = ("list", "List")
_DICT_NAMES = ("dict", "Dict")
_OPTIONAL_NAMES = ("Optional",)
_RETURN_TYPE = "AppDef"


@dataclass(frozen=True)
class LinterMessage:
    """One problem found in a component file.

    Args:
        name: the check that found it.
        description: what is wrong, naming the function and the argument.
        line: the 1-based line number (0 when the problem is not tied to a line).
        char: the 1-based column (0 when unknown).
        severity: ``"error"`` (the component cannot be used) or ``"warning"``.
        path: the file, when known.
    """

    name: str
    description: str
    line: int
    char: int = 0
    severity: Severity = "error"
    path: str = ""

    def __str__(self) -> str:
        where = self.path or "<component>"
        if self.line:
            where += f":{self.line}"
            if self.char:
                where += f":{self.char}"
        return f"{where}: {self.severity}: {self.description}"


def errors_only(messages: Iterable[LinterMessage]) -> list[LinterMessage]:
    """The messages of severity ``"error"``."""
    return [m for m in messages if m.severity == "error"]


# ---------------------------------------------------------------------------------------------
# Google-style docstrings
# ---------------------------------------------------------------------------------------------

_SECTION_RE = re.compile(
    r"^(Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments|Other Parameters|Returns?|"
    r"Yields?|Raises|Examples?|Notes?|Attributes|Usage|See Also|Warnings?|Todo|References)\s*:\s*$"
)
_ARG_SECTIONS = {
    "Args",
    "Arguments",
    "Parameters",
    "Params",
    "Keyword Args",
    "Keyword Arguments",
    "Other Parameters",
}
_ARG_LINE_RE = re.compile(r"^\*{0,2}(?P<name>[A-Za-z_]\w*)\s*(?:\([^)]*\))?\s*:(?P<desc>.*)$")


def parse_google_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Splits a Google-style docstring into its description and its ``Args:`` entries.

    The description is the text before the first section header (``Args:``, ``Returns:``...).
    An argument's description is its first line plus the lines indented under it, joined with
    spaces; ``*args``/``**kwargs`` are keyed without their stars.
    """
    lines = inspect.cleandoc(doc).splitlines()
    description: list[str] = []
    args: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    entry_indent = -1
    for line in lines:
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        header = _SECTION_RE.match(stripped)
        if header and indent == 0:
            section = header.group(1)
            current = None
            entry_indent = -1
            continue
        if section is None:
            description.append(line)
            continue
        if section not in _ARG_SECTIONS or not stripped:
            continue
        if entry_indent < 0:
            entry_indent = indent
        m = _ARG_LINE_RE.match(stripped)
        if m and indent <= entry_indent:
            current = m.group("name")
            args[current] = m.group("desc").strip()
        elif current is not None:
            args[current] = f"{args[current]} {stripped}".strip()
    return "\n".join(description).strip(), args


_REST_FIELD_RE = re.compile(r"^:(?P<field>[^:]+):(?P<desc>.*)$")
_REST_PARAM_FIELDS = ("param", "parameter", "arg", "argument", "key", "keyword")
_NUMPY_UNDERLINE_RE = re.compile(r"^-{3,}\s*$")
_NUMPY_ARG_SECTIONS = {
    "Parameters",
    "Params",
    "Arguments",
    "Args",
    "Other Parameters",
    "Other Params",
    "Keyword Arguments",
    "Keyword Args",
}
_NUMPY_SECTIONS = {
    *_NUMPY_ARG_SECTIONS,
    *("Returns", "Yields", "Receives", "Raises", "Warns", "Warnings", "See Also", "Notes"),
    *("References", "Examples", "Attributes", "Methods"),
}
_NUMPY_ENTRY_RE = re.compile(r"^(?P<names>\*{0,2}\w+(?:\s*,\s*\*{0,2}\w+)*)\s*(?::.*)?$")


def _docstring_style(lines: Sequence[str]) -> Literal["google", "rest", "numpy"]:
    """Which of the styles TorchX reads (through ``docstring_parser``) ``lines`` are written in:
    reST when a line is a ``:param x:``-like field, NumPy when a section title is underlined with
    dashes, else Google."""
    for i, line in enumerate(lines):
        field = _REST_FIELD_RE.match(line.strip())
        kind = field.group("field").split()[:1] if field else []
        if kind and kind[0] in (*_REST_PARAM_FIELDS, "type", "returns", "return", "raises"):
            return "rest"
        if (
            i
            and _NUMPY_UNDERLINE_RE.match(line.strip())
            and lines[i - 1].strip() in _NUMPY_SECTIONS
        ):
            return "numpy"
    return "google"


def _parse_rest_docstring(lines: Sequence[str]) -> tuple[str, dict[str, str]]:
    """``:param [type] name: text`` fields; the description is the text before the first field."""
    description: list[str] = []
    args: dict[str, str] = {}
    current: str | None = None
    in_fields = False
    for line in lines:
        stripped = line.strip()
        field = _REST_FIELD_RE.match(stripped)
        if field:
            in_fields = True
            words = field.group("field").split()
            current = None
            if len(words) >= 2 and words[0] in _REST_PARAM_FIELDS:
                current = words[-1].lstrip("*")
                args[current] = field.group("desc").strip()
            continue
        if not in_fields:
            description.append(line)
        elif current is not None and stripped:
            args[current] = f"{args[current]} {stripped}".strip()
    return "\n".join(description).strip(), args


def _parse_numpy_docstring(lines: Sequence[str]) -> tuple[str, dict[str, str]]:
    """Sections titled by a line underlined with dashes; in ``Parameters``, ``name : type`` lines
    each followed by their indented description. The description is the text before the first
    section."""
    description: list[str] = []
    args: dict[str, str] = {}
    section: str | None = None
    current: list[str] = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        following = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if stripped and _NUMPY_UNDERLINE_RE.match(following):
            section = stripped
            current = []
            continue
        if _NUMPY_UNDERLINE_RE.match(stripped) and i and lines[i - 1].strip() == section:
            continue
        if section is None:
            description.append(line)
            continue
        if section not in _NUMPY_ARG_SECTIONS or not stripped:
            continue
        entry = _NUMPY_ENTRY_RE.match(stripped)
        if entry and not line[:1].isspace():
            current = [name.strip().lstrip("*") for name in entry.group("names").split(",")]
            args.update(dict.fromkeys(current, ""))
        else:
            for name in current:
                args[name] = f"{args[name]} {stripped}".strip()
    return "\n".join(description).strip(), args


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Splits a component's docstring into its description and its arguments' descriptions.

    Google (``Args:``), reST (``:param msg: ...``) and NumPy (``Parameters`` underlined with
    dashes) styles are read, as TorchX reads them (it uses ``docstring_parser``, which detects the
    style); a component copied from a TorchX project documents its arguments in any of them.
    """
    lines = inspect.cleandoc(doc).splitlines()
    style = _docstring_style(lines)
    if style == "rest":
        return _parse_rest_docstring(lines)
    if style == "numpy":
        return _parse_numpy_docstring(lines)
    return parse_google_docstring(doc)


def get_fn_docstring(fn: Callable[..., object]) -> tuple[str, dict[str, str]]:
    """The description of a component and of each of its parameters, from its docstring.

    The docstring may be in Google, reST or NumPy style (see ``parse_docstring``). Parameters it
    does not describe get an empty description; a function without a docstring gets a description
    that says how to add one.
    """
    params = inspect.signature(fn).parameters
    name = getattr(fn, "__name__", "component")
    doc = inspect.getdoc(fn)
    descriptions = dict.fromkeys(params, "")
    if not doc:
        return (
            f"{name} (add a Google-style docstring to the component to describe it here)",
            descriptions,
        )
    description, documented = parse_docstring(doc)
    for key, value in documented.items():
        if key in descriptions:
            descriptions[key] = value
    return description or name, descriptions


# ---------------------------------------------------------------------------------------------
# Validators
# ---------------------------------------------------------------------------------------------

FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


class ComponentFunctionValidator:
    """A check of one component function's AST; subclasses implement ``validate``."""

    name = "ComponentValidator"

    def validate(self, fn: FunctionNode) -> list[LinterMessage]:
        """The problems found in ``fn``."""
        raise NotImplementedError

    def _msg(self, description: str, node: ast.AST, severity: Severity = "error") -> LinterMessage:
        line = getattr(node, "lineno", 0)
        col = getattr(node, "col_offset", -1) + 1
        return LinterMessage(self.name, description, line, col, severity)


def _dotted_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _is_none(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _optional_inner(node: ast.expr) -> ast.expr | None:
    """``T`` of an annotation ``Optional[T]``, ``T | None`` or ``None | T``; None otherwise."""
    if isinstance(node, ast.Subscript) and _dotted_name(node.value) in _OPTIONAL_NAMES:
        return node.slice
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        if _is_none(node.right):
            return node.left
        if _is_none(node.left):
            return node.right
    return None


def _plain_name(node: ast.expr) -> str | None:
    """The name of an annotation that is a bare name (``Path``), or ``Optional`` of one
    (``Optional[Path]``, ``Path | None``): the types TorchX's linter accepts whatever they are."""
    node = _optional_inner(node) or node
    return node.id if isinstance(node, ast.Name) else None


class ArgTypeValidator(ComponentFunctionValidator):
    """Every parameter is annotated with a type the command line can express; no ``**kwargs``."""

    name = "ArgTypeValidator"

    def validate(self, fn: FunctionNode) -> list[LinterMessage]:
        """The parameters of ``fn`` with a missing or unsupported type."""
        out: list[LinterMessage] = []
        a = fn.args
        positional = [*a.posonlyargs, *a.args]
        # ``defaults`` belong to the last positional parameters; ``kw_defaults`` holds None for a
        # keyword-only parameter without one
        with_default = {arg.arg for arg in positional[len(positional) - len(a.defaults) :]}
        with_default.update(
            arg.arg for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None
        )
        for arg in [*positional, *a.kwonlyargs]:
            out.extend(self._check(fn.name, arg, vararg=False, has_default=arg.arg in with_default))
        if a.vararg is not None:
            out.extend(self._check(fn.name, a.vararg, vararg=True))
        if a.kwarg is not None:
            out.append(
                self._msg(
                    f"parameter '**{a.kwarg.arg}' of function {fn.name!r} is not supported: "
                    "declare each parameter, or take a dict[str, str]",
                    a.kwarg,
                )
            )
        return out

    def _check(
        self, fn_name: str, arg: ast.arg, vararg: bool, has_default: bool = False
    ) -> list[LinterMessage]:
        shown = f"*{arg.arg}" if vararg else arg.arg
        if arg.annotation is None:
            return [
                self._msg(
                    f"parameter {shown!r} of function {fn_name!r} has no type annotation "
                    f"(supported: {', '.join(SCALAR_TYPES)}, list[T], dict[K, V], Optional[...])",
                    arg,
                )
            ]
        annotation = arg.annotation
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            text = annotation.value
            try:
                annotation = ast.parse(text, mode="eval").body
            except SyntaxError:
                return [
                    self._msg(
                        f"parameter {shown!r} of function {fn_name!r} has an annotation that "
                        f"does not parse: {text!r}",
                        arg,
                    )
                ]
        problem = self._type_problem(annotation, allow_optional=not vararg, scalar_only=vararg)
        if problem is None:
            return []
        if has_default and _plain_name(annotation) is not None:
            # TorchX's linter accepts any bare type name (``Any``, ``Path``...): such a parameter
            # keeps its default, and giving it on the command line is the error (builders.py)
            return []
        if _plain_name(annotation) is not None:
            problem += (
                "; a parameter of another plain type (Any, Path...) is accepted when it has a "
                "default, which only Python callers can change"
            )
        return [
            self._msg(
                f"parameter {shown!r} of function {fn_name!r} has unsupported type "
                f"{ast.unparse(arg.annotation)!r}: {problem}",
                arg,
            )
        ]

    def _type_problem(
        self, node: ast.expr, allow_optional: bool = True, scalar_only: bool = False
    ) -> str | None:
        if isinstance(node, ast.Subscript) and _dotted_name(node.value) == "Annotated":
            inner = node.slice.elts[0] if isinstance(node.slice, ast.Tuple) else node.slice
            return self._type_problem(inner, allow_optional, scalar_only)
        optional_inner = _optional_inner(node)
        if (
            optional_inner is None
            and isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.BitOr)
        ):
            return "unions other than Optional[T] (T | None) are not supported"
        if optional_inner is not None:
            if not allow_optional:
                return "*args cannot be Optional"
            return self._type_problem(optional_inner, allow_optional=False, scalar_only=scalar_only)
        name = _dotted_name(node)
        if name in SCALAR_TYPES:
            return None
        if isinstance(node, ast.Subscript) and not scalar_only:
            container = _dotted_name(node.value)
            params = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            if container in _LIST_NAMES:
                if len(params) != 1 or _dotted_name(params[0]) not in _ELEMENT_TYPES:
                    return "list elements must be one of " + ", ".join(_ELEMENT_TYPES)
                return None
            if container in _DICT_NAMES:
                if len(params) != 2 or any(_dotted_name(p) not in _ELEMENT_TYPES for p in params):
                    return "dict keys and values must be one of " + ", ".join(_ELEMENT_TYPES)
                return None
            return f"container {container!r} is not supported (use list[T] or dict[K, V])"
        if scalar_only:
            return "*args must be one of " + ", ".join(SCALAR_TYPES)
        return (
            f"supported types are {', '.join(SCALAR_TYPES)}, list[T], dict[K, V] "
            "and Optional of those"
        )


class ReturnTypeValidator(ComponentFunctionValidator):
    """The function is a plain ``def`` annotated to return ``AppDef`` (or ``specs.AppDef``)."""

    name = "ReturnTypeValidator"

    def __init__(self, return_type: str = _RETURN_TYPE) -> None:
        self._return_type = return_type

    def validate(self, fn: FunctionNode) -> list[LinterMessage]:
        """A message when ``fn`` is async or lacks the ``AppDef`` return annotation."""
        out: list[LinterMessage] = []
        if isinstance(fn, ast.AsyncFunctionDef):
            out.append(
                self._msg(
                    f"function {fn.name!r} is 'async def': a component must be a plain function "
                    f"returning an {self._return_type}",
                    fn,
                )
            )
        returns = fn.returns
        if isinstance(returns, ast.Constant) and isinstance(returns.value, str):
            try:
                returns = ast.parse(returns.value, mode="eval").body
            except SyntaxError:
                returns = None
        if returns is None:
            out.append(
                self._msg(
                    f"function {fn.name!r} has no return annotation: a component must be "
                    f"annotated '-> {self._return_type}'",
                    fn,
                )
            )
        elif _dotted_name(returns) != self._return_type:
            out.append(
                self._msg(
                    f"function {fn.name!r} is annotated to return {ast.unparse(fn.returns)!r}"  # type: ignore[arg-type]
                    f": a component must return '{self._return_type}'",
                    fn,
                )
            )
        return out


class DocstringValidator(ComponentFunctionValidator):
    """The function has a docstring and documents each parameter in ``Args:`` (warnings only)."""

    name = "DocstringValidator"

    def validate(self, fn: FunctionNode) -> list[LinterMessage]:
        """Warnings for a missing docstring or undocumented parameters."""
        doc = ast.get_docstring(fn)
        if not doc:
            return [
                self._msg(
                    f"function {fn.name!r} has no docstring: its --help will only list the "
                    "parameter names (add a Google-style docstring with an Args: section)",
                    fn,
                    "warning",
                )
            ]
        _, documented = parse_docstring(doc)
        a = fn.args
        params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *([a.vararg] if a.vararg else [])]
        return [
            self._msg(
                f"parameter {p.arg!r} of function {fn.name!r} is not described in the "
                "docstring's Args: section",
                p,
                "warning",
            )
            for p in params
            if p.arg not in documented
        ]


def default_validators() -> list[ComponentFunctionValidator]:
    """The checks ``validate`` runs when given none."""
    return [ArgTypeValidator(), ReturnTypeValidator(), DocstringValidator()]


def _module_functions(nodes: Iterable[ast.AST]) -> Iterator[FunctionNode]:
    """The functions defined at a module's top level, under ``if``/``try``/``with``... included
    (as TorchX finds them: ``if sys.version_info...: def comp()`` is a component), not in classes
    or other functions."""
    for node in nodes:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        elif isinstance(node, (ast.stmt, ast.excepthandler, ast.match_case)) and not isinstance(
            node, ast.ClassDef
        ):
            yield from _module_functions(ast.iter_child_nodes(node))


def validate_source(
    source: str,
    component_function: str,
    path: str = "<string>",
    validators: Sequence[ComponentFunctionValidator] | None = None,
) -> list[LinterMessage]:
    """Lints the component ``component_function`` defined at the top level of ``source``.

    Returns:
        The problems found, sorted by line; empty when the component is fine.
    """
    try:
        module = ast.parse(source, filename=path)
    except SyntaxError as e:
        return [
            LinterMessage(
                "SyntaxValidator",
                f"syntax error: {e.msg}",
                e.lineno or 0,
                e.offset or 0,
                "error",
                path,
            )
        ]
    found: FunctionNode | None = None
    defined: list[str] = []
    for node in _module_functions(module.body):
        defined.append(node.name)
        if node.name == component_function:
            found = node
    if found is None:
        known = f"; functions defined there: {', '.join(defined)}" if defined else ""
        return [
            LinterMessage(
                "ComponentFnFinder",
                f"function {component_function!r} is not defined at the top level of the file{known}",
                0,
                0,
                "error",
                path,
            )
        ]
    messages: list[LinterMessage] = []
    for validator in default_validators() if validators is None else validators:
        for m in validator.validate(found):
            messages.append(
                LinterMessage(m.name, m.description, m.line, m.char, m.severity, m.path or path)
            )
    return sorted(messages, key=lambda m: (m.line, m.char))


def validate(
    path: str | Path,
    component_function: str,
    validators: Sequence[ComponentFunctionValidator] | None = None,
) -> list[LinterMessage]:
    """Lints the component ``component_function`` of the file at ``path`` (read, never imported).

    Raises:
        OSError: the file cannot be read.
    """
    source = Path(path).read_text(encoding="utf-8")
    return validate_source(source, component_function, str(path), validators)
