"""The component file linter: line-numbered errors and warnings, and Google docstring parsing."""

from __future__ import annotations

import inspect
import textwrap
from pathlib import Path

from asynctorchx.components import get_components
from asynctorchx.specs.file_linter import (
    LinterMessage,
    errors_only,
    parse_google_docstring,
    validate,
    validate_source,
)

GOOD = '''
import asynctorchx.specs as specs
from typing import Annotated, Dict, List, Optional


def train(
    *script_args: str,
    script: str,
    nnodes: int = 1,
    lr: float = 0.1,
    debug: bool = False,
    tags: list[str] | None = None,
    env: Optional[Dict[str, str]] = None,
    ids: List[int] = [],
    name: Annotated[str, "-n"] = "x",
    quoted: "Optional[int]" = None,
) -> specs.AppDef:
    """Trains.

    Args:
        script_args: args
        script: the script
        nnodes: nodes
        lr: learning rate
        debug: debug
        tags: tags
        env: env
        ids: ids
        name: name
        quoted: a string annotation
    """
    return specs.AppDef("x")
'''


def _lint(source: str, fn: str = "comp") -> list[LinterMessage]:
    return validate_source(textwrap.dedent(source), fn, "comp.py")


def test_good_component_has_no_messages():
    """A component using every supported type, documented and annotated, lints clean."""
    assert validate_source(GOOD, "train", "good.py") == []


BAD = '''\
from pathlib import Path
from asynctorchx.specs import AppDef


def comp(
    a,
    b: Path,
    c: set[str],
    d: dict[str, list[str]],
    e: int | str,
    *args: list[str],
    **kwargs: str,
):
    """Has problems.

    Args:
        a: a
        b: b
        c: c
        d: d
        e: e
        args: args
        kwargs: kwargs
    """
    return AppDef("x")
'''


def test_errors_are_line_numbered_and_name_the_problem():
    """Each bad parameter and the missing return annotation gets an error at its own line."""
    messages = validate_source(BAD, "comp", "bad.py")
    by_line = {m.line: m for m in messages}
    assert all(m.severity == "error" for m in messages)
    assert sorted(by_line) == [5, 6, 7, 8, 9, 10, 11, 12]
    assert "function 'comp' has no return annotation" in by_line[5].description
    assert "parameter 'a' of function 'comp' has no type annotation" in by_line[6].description
    assert "parameter 'b'" in by_line[7].description and "'Path'" in by_line[7].description
    assert "container 'set' is not supported" in by_line[8].description
    assert "dict keys and values must be one of" in by_line[9].description
    assert "unions other than Optional" in by_line[10].description
    assert "parameter '*args'" in by_line[11].description
    assert "'**kwargs'" in by_line[12].description and "not supported" in by_line[12].description
    assert str(by_line[7]).startswith("bad.py:7:5: error: parameter 'b'")


def test_wrong_return_annotation_and_async_def():
    """A non-AppDef return annotation and an async def are errors at the def's line."""
    messages = _lint(
        '''
        async def comp(x: int = 1) -> str:
            """Doc.

            Args:
                x: x
            """
        '''
    )
    assert [m.line for m in messages] == [2, 2]
    text = " ".join(m.description for m in messages)
    assert "'async def'" in text
    assert "annotated to return 'str'" in text


def test_missing_docstring_is_only_a_warning():
    """A component without docstring gets a warning, not an error."""
    messages = _lint(
        """
        from asynctorchx.specs import AppDef
        def comp(x: int = 1) -> AppDef:
            return AppDef("x")
        """
    )
    assert [(m.severity, m.line) for m in messages] == [("warning", 3)]
    assert "no docstring" in messages[0].description
    assert errors_only(messages) == []


def test_undocumented_parameter_is_a_warning():
    """A parameter missing from the docstring's Args: section is a warning at its line."""
    messages = _lint(
        '''
        def comp(
            x: int = 1,
            y: str = "a",
        ) -> "AppDef":
            """Doc.

            Args:
                x: documented
            """
        '''
    )
    assert [(m.severity, m.line) for m in messages] == [("warning", 4)]
    assert "'y'" in messages[0].description


def test_syntax_error_reports_its_line():
    """A file that does not parse gives one error at the line of the syntax error."""
    messages = validate_source("x = 1\ndef comp(:\n    pass\n", "comp", "broken.py")
    assert len(messages) == 1
    assert messages[0].line == 2 and messages[0].severity == "error"
    assert "syntax error" in messages[0].description


def test_missing_function_lists_the_defined_ones():
    """Asking for a function that the file does not define names the ones it does."""
    messages = validate_source("def a(): pass\ndef b(): pass\n", "comp", "f.py")
    assert len(messages) == 1 and messages[0].line == 0
    assert "'comp' is not defined" in messages[0].description
    assert "a, b" in messages[0].description
    assert str(messages[0]).startswith("f.py: error:")


def test_nested_function_is_not_a_component():
    """Only top-level functions are components."""
    messages = validate_source("def outer():\n    def comp(): pass\n", "comp", "f.py")
    assert "not defined at the top level" in messages[0].description


def test_a_function_defined_under_if_or_try_at_the_top_level_is_a_component():
    """A function defined in an if/try/with block of the module is found, as TorchX finds it."""
    source = textwrap.dedent(
        """
        import sys
        from asynctorchx.specs import AppDef
        if sys.version_info >= (3, 8):
            try:
                import json
            except ImportError:
                pass
            else:
                def comp(n: int = 1) -> AppDef:
                    return AppDef("x")
        class C:
            def method(self) -> AppDef:
                return AppDef("x")
        """
    )
    assert errors_only(validate_source(source, "comp", "f.py")) == []
    messages = validate_source(source, "method", "f.py")
    assert "not defined at the top level" in messages[0].description


def test_validate_reads_the_file(tmp_path: Path):
    """validate() lints a file on disk without importing it."""
    path = tmp_path / "c.py"
    path.write_text("import does_not_exist\n" + GOOD)
    assert validate(path, "train") == []


def test_builtin_components_lint_clean():
    """Every builtin component has no linter error nor warning."""
    builtins = [c for c in get_components().values() if c.origin == "builtin"]
    assert len(builtins) >= 8
    for component in builtins:
        source = inspect.getsourcefile(component.fn)
        assert source is not None
        assert validate(source, component.fn.__name__) == [], component.name


def test_parse_google_docstring():
    """The description stops at the first section; Args entries join their continuation lines."""
    description, args = parse_google_docstring(
        """Summary line.

        More description.

        Args:
            alpha (int): the first
                argument, continued
            *rest: the remainder
            beta: the second

        Returns:
            something
        """
    )
    assert description == "Summary line.\n\nMore description."
    assert args == {
        "alpha": "the first argument, continued",
        "rest": "the remainder",
        "beta": "the second",
    }
