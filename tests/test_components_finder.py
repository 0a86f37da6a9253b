"""Finding components: builtins (lazily), entry-point plugins, files; suggestions and lint errors."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from asynctorchx.components import (
    ComponentNotFoundException,
    ComponentValidationException,
    clear_cache,
    get_component,
    get_components,
)
from asynctorchx.specs.builders import materialize_appdef

BUILTINS = [
    "dist.ddp",
    "dist.spmd",
    "utils.binary",
    "utils.copy",
    "utils.echo",
    "utils.python",
    "utils.sh",
    "utils.touch",
]

PLUGIN_MODULES = {
    "components.py": '''
        from asynctorchx.specs import AppDef, Role


        def train(epochs: int = 1) -> AppDef:
            """Trains a model.

            Args:
                epochs: how many epochs
            """
            return AppDef("train", [Role("trainer", "img", "python", args=[str(epochs)])])


        def helper() -> int:
            return 1


        def _private() -> AppDef:
            return AppDef("x")
    ''',
    "shadow.py": '''
        from asynctorchx.specs import AppDef, Role


        def echo(msg: str = "plugin") -> AppDef:
            """A plugin trying to replace utils.echo.

            Args:
                msg: message
            """
            return AppDef("shadow", [Role("shadow", "img", "echo", args=[msg])])


        def extra(msg: str = "extra") -> AppDef:
            """An extra component in the utils namespace.

            Args:
                msg: message
            """
            return AppDef("extra", [Role("extra", "img", "echo", args=[msg])])
    ''',
    "broken.py": """
        raise ImportError("this plugin is broken")
    """,
    "badtypes.py": '''
        from asynctorchx.specs import AppDef


        def comp(names: set[str]) -> AppDef:
            """Bad types.

            Args:
                names: a set
            """
            return AppDef("x")
    ''',
}

ENTRY_POINTS = """\
[asynctorchx.components]
fake = fake_plugin_pkg.components
utils = fake_plugin_pkg.shadow
single = fake_plugin_pkg.components:train
broken = fake_plugin_pkg.broken
lint = fake_plugin_pkg.badtypes
"""


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Installs a real (if tiny) distribution with asynctorchx.components entry points on sys.path."""
    site = tmp_path / "site"
    pkg = site / "fake_plugin_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for name, source in PLUGIN_MODULES.items():
        (pkg / name).write_text(textwrap.dedent(source))
    dist_info = site / "fake_plugin-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-plugin\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(site))
    clear_cache()
    yield
    clear_cache()
    for mod in [m for m in sys.modules if m.startswith("fake_plugin_pkg")]:
        del sys.modules[mod]


def test_builtins_are_listed():
    """get_components() lists every builtin component by module.function with a description."""
    components = get_components()
    assert set(BUILTINS) <= set(components)
    for name in BUILTINS:
        assert components[name].origin == "builtin"
        assert components[name].description
        assert components[name].validation_errors == ()


def test_only_component_functions_are_components():
    """Helpers in a component module (private, or not returning AppDef) are not components."""
    names = set(get_components())
    assert "dist.parse_nnodes" not in names and "dist.parse_name" not in names


def test_get_builtin_imports_only_its_module():
    """Importing the package imports no component module; get_component imports only the one asked for."""
    code = (
        "import sys, asynctorchx.components as c\n"
        "assert 'asynctorchx.components.utils' not in sys.modules\n"
        "c.get_component('utils.echo')\n"
        "print('asynctorchx.components.utils' in sys.modules, 'asynctorchx.components.dist' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30
    )
    assert out.stdout.split() == ["True", "False"]


@pytest.mark.parametrize(
    ("name", "suggestion"),
    [
        ("utils.ech", "utils.echo"),
        ("dist.dpp", "dist.ddp"),
        ("echo", "utils.echo"),
        ("util.sh", "utils.sh"),
        ("ddp", "dist.ddp"),
    ],
)
def test_unknown_component_suggests_close_names(name: str, suggestion: str):
    """An unknown name raises ComponentNotFoundException that suggests the closest names."""
    with pytest.raises(ComponentNotFoundException) as info:
        get_component(name)
    assert suggestion in info.value.suggestions
    assert "did you mean" in str(info.value) and repr(suggestion) in str(info.value)
    assert isinstance(info.value, LookupError)


def test_unknown_component_without_close_name():
    """A name unlike any component raises without a suggestion but with a pointer to the list."""
    with pytest.raises(ComponentNotFoundException, match=r"unknown component 'zzz\.qqq'") as info:
        get_component("zzz.qqq")
    assert info.value.suggestions == []
    assert "asynctorchx builtins" in str(info.value)


def test_entry_point_module_contributes_prefixed_components(plugins: None):
    """An entry point name = pkg.module contributes the module's component functions as name.fn."""
    components = get_components()
    assert components["fake.train"].origin == "entry point fake = fake_plugin_pkg.components"
    assert components["fake.train"].description == "Trains a model."
    assert "fake.helper" not in components and "fake._private" not in components
    app = materialize_appdef(get_component("fake.train").fn, ["--epochs", "3"])
    assert app.roles[0].args == ["3"]


def test_entry_point_naming_a_function(plugins: None):
    """An entry point name = pkg.module:fn contributes that function as name."""
    assert get_component("single").fn.__name__ == "train"


def test_entry_points_never_hide_builtins(plugins: None, caplog: pytest.LogCaptureFixture):
    """A plugin component with a builtin's name is ignored (with a warning); its others are merged."""
    with caplog.at_level(logging.WARNING, logger="asynctorchx.components._finder"):
        components = get_components()
    assert components["utils.echo"].origin == "builtin"
    assert components["utils.echo"].fn.__module__ == "asynctorchx.components.utils"
    assert components["utils.extra"].origin.startswith("entry point utils")
    assert get_component("utils.echo").origin == "builtin"
    assert get_component("utils.extra").fn.__name__ == "extra"
    assert "'utils.echo'" in caplog.text and "builtin component has that name" in caplog.text


def test_broken_entry_point_is_skipped(plugins: None, caplog: pytest.LogCaptureFixture):
    """A plugin that fails to import is skipped with a warning; the other components still load."""
    with caplog.at_level(logging.WARNING, logger="asynctorchx.components._finder"):
        components = get_components()
    assert "fake.train" in components and "utils.echo" in components
    assert "this plugin is broken" in caplog.text


def test_plugin_component_with_lint_errors(plugins: None):
    """A plugin component whose source fails the linter raises with line-numbered errors."""
    with pytest.raises(
        ComponentValidationException, match=r"badtypes\.py:5:\d+: error: parameter 'names'"
    ):
        get_component("lint.comp")


def _write(path: Path, source: str) -> Path:
    path.write_text(textwrap.dedent(source))
    return path


def test_file_component(tmp_path: Path):
    """path/to/file.py:fn loads the function of a file and keeps linter warnings."""
    path = _write(
        tmp_path / "my_component.py",
        """
        from asynctorchx.specs import AppDef, Role

        def hello(who: str = "world") -> AppDef:
            return AppDef("hello", [Role("hello", "img", "echo", args=[who])])
        """,
    )
    component = get_component(f"{path}:hello")
    assert component.origin == f"file {path}"
    assert [m.severity for m in component.validation_errors] == ["warning"]
    assert materialize_appdef(component.fn, ["--who", "you"]).roles[0].args == ["you"]


def test_file_component_relative_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A relative file path is resolved against the current directory."""
    _write(
        tmp_path / "rel.py",
        '''
        import dataclasses
        from asynctorchx.specs import AppDef

        @dataclasses.dataclass
        class Options:
            n: int = 1

        def comp(n: int = 1) -> AppDef:
            """Doc.

            Args:
                n: n
            """
            return AppDef(f"n{Options(n).n}")
        ''',
    )
    monkeypatch.chdir(tmp_path)
    assert materialize_appdef(get_component("rel.py:comp").fn, ["-n", "2"]).name == "n2"


def test_file_component_with_lint_errors_is_rejected(tmp_path: Path):
    """A component file with lint errors raises ComponentValidationException listing each error line."""
    path = _write(
        tmp_path / "bad.py",
        '''\
        from pathlib import Path


        def comp(
            out: Path,
            count,
        ):
            """Doc.

            Args:
                out: out
                count: count
            """
            return None
        ''',
    )
    with pytest.raises(ComponentValidationException) as info:
        get_component(f"{path}:comp")
    message = str(info.value)
    assert message.splitlines()[0] == f"component '{path}:comp' is not valid"
    assert f"{path}:4:1: error: function 'comp' has no return annotation" in message
    assert (
        f"{path}:5:5: error: parameter 'out' of function 'comp' has unsupported type 'Path'"
        in message
    )
    assert (
        f"{path}:6:5: error: parameter 'count' of function 'comp' has no type annotation" in message
    )
    assert [e.line for e in info.value.errors] == [4, 5, 6]


def test_file_component_never_imported_when_lint_fails(tmp_path: Path):
    """A file failing the linter is not executed (its side effects do not happen)."""
    marker = tmp_path / "imported"
    path = _write(
        tmp_path / "side_effect.py",
        f"""
        open({str(marker)!r}, "w").close()
        def comp(x):
            return None
        """,
    )
    with pytest.raises(ComponentValidationException):
        get_component(f"{path}:comp")
    assert not marker.exists()


def test_file_component_missing_file_or_function(tmp_path: Path):
    """A missing file or function raises ComponentNotFoundException naming what is missing."""
    with pytest.raises(ComponentNotFoundException, match="does not exist"):
        get_component(f"{tmp_path}/nope.py:comp")
    path = _write(tmp_path / "c.py", "def a():\n    pass\n")
    with pytest.raises(ComponentNotFoundException, match=r"'comp' is not defined .*: a"):
        get_component(f"{path}:comp")
    with pytest.raises(ComponentNotFoundException, match=r"path/to/file\.py:function"):
        get_component(f"{path}:")


def test_file_component_import_error(tmp_path: Path):
    """A file whose import fails raises ComponentValidationException with the cause."""
    path = _write(
        tmp_path / "imp.py",
        '''
        import not_a_module_anywhere
        from asynctorchx.specs import AppDef

        def comp() -> AppDef:
            """Doc."""
            return AppDef("x")
        ''',
    )
    with pytest.raises(
        ComponentValidationException, match=r"ModuleNotFoundError.*not_a_module_anywhere"
    ):
        get_component(f"{path}:comp")


@pytest.mark.parametrize("code", ["0", "3", "'bye'"])
def test_a_file_that_exits_at_import_is_an_error_naming_the_call(tmp_path: Path, code: str):
    """A file calling sys.exit at import (a script parsing sys.argv) is an error, not an exit."""
    path = _write(
        tmp_path / "script.py",
        f'''
        import sys
        from asynctorchx.specs import AppDef

        def comp() -> AppDef:
            """Doc."""
            return AppDef("x")

        sys.exit({code})
        ''',
    )
    with pytest.raises(
        ComponentValidationException, match=rf"script\.py' called sys\.exit\({code}\)"
    ):
        get_component(f"{path}:comp")


def test_a_component_that_calls_sys_exit_is_an_error_naming_it(tmp_path: Path):
    """A component function calling sys.exit is an error naming it, not a silent exit."""
    path = _write(
        tmp_path / "c.py",
        '''
        import sys
        from asynctorchx.specs import AppDef

        def comp() -> AppDef:
            """Doc."""
            sys.exit(0)
        ''',
    )
    component = get_component(f"{path}:comp")
    with pytest.raises(ComponentValidationException, match=r"comp.*called sys\.exit\(0\)"):
        materialize_appdef(component.fn, [], name=component.name)
