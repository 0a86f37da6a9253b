"""Differences from TorchX 0.7 found by running both CLIs side by side on the same inputs (real
subprocesses, real local backend), each pinned here once fixed."""

from __future__ import annotations

import io
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from _torchx_env import REPO
from test_cli_commands import Cli, _one_error_line
from test_components_builtins import MINIMAL_ARGS

from asynctorchx.cli._errors import CliError
from asynctorchx.cli._logs import _WRITE_SLICE, LogPrinter, app_replicas
from asynctorchx.cli.cmd_describe import format_app
from asynctorchx.cli.cmd_log import ReplicaRange, parse_target
from asynctorchx.components._finder import get_component
from asynctorchx.specs import MISSING, AppDef, Role
from asynctorchx.specs.builders import materialize_appdef
from asynctorchx.specs.errors import ComponentNotFoundException, InvalidComponentArgsException


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    base = tmp_path_factory.mktemp("dropin")
    c = Cli(base, base / "root")
    c.env["PYTHONPATH"] = str(REPO)
    yield c


def _raw(cli: Cli, *args: str) -> subprocess.CompletedProcess[bytes]:
    """Runs the console script keeping its output's bytes (text mode would turn '\\r' into '\\n')."""
    return subprocess.run(
        [cli.script, *args], cwd=cli.cwd, env=cli.env, capture_output=True, timeout=60, check=False
    )


# -- log: carriage returns ------------------------------------------------------------------------


def test_a_carriage_return_inside_a_log_line_repeats_the_prefix() -> None:
    """Each '\\r' inside a line is followed by the prefix again (as TorchX does); a CRLF's is not."""
    replicas = app_replicas([("trainer", 1)])
    out = io.StringIO()
    printer = LogPrinter("h", replicas, out)
    printer.write(replicas[0], "stdout", "10%\r50%\r100%\n")
    printer.write(replicas[0], "stdout", "dos\r\n")
    printer.write(replicas[0], "stdout", "\rredrawn")
    assert out.getvalue() == (
        "trainer/0 | 10%\rtrainer/0 | 50%\rtrainer/0 | 100%\n"
        "trainer/0 | dos\r\n"
        "trainer/0 | \rtrainer/0 | redrawn\n"
    )


def test_a_carriage_return_in_a_line_written_in_slices_repeats_the_prefix() -> None:
    """A line longer than the write slice gets the prefix after its '\\r's too, wherever they fall."""
    replicas = app_replicas([("t", 1)])
    out = io.StringIO()
    line = "a" * (_WRITE_SLICE - 1) + "\r" + "b" * _WRITE_SLICE + "\r" + "c\r\n"
    LogPrinter("h", replicas, out).write(replicas[0], None, line)
    expected = "t/0 | " + "a" * (_WRITE_SLICE - 1) + "\rt/0 | " + "b" * _WRITE_SLICE
    assert out.getvalue() == expected + "\rt/0 | c\r\n"


def test_log_and_run_log_keep_the_prefix_of_a_progress_bar(cli: Cli) -> None:
    """'log' and 'run --log' print a replica's '\\r'-redrawn line with its prefix after each '\\r'."""
    run = _raw(cli, "run", "--log", "utils.sh", "--", "printf", "p1\\rp2\\rp3\\n")
    assert run.returncode == 0, run.stderr
    assert b"sh/0 | p1\rsh/0 | p2\rsh/0 | p3\n" in run.stderr
    handle = run.stdout.decode().strip()
    log = _raw(cli, "log", handle)
    assert log.returncode == 0, log.stderr
    assert log.stdout == b"sh/0 | p1\rsh/0 | p2\rsh/0 | p3\n"


# -- builtins: what TorchX's give -----------------------------------------------------------------


def _builtin(name: str, *args: str) -> AppDef:
    component = get_component(name)
    return materialize_appdef(component.fn, list(args), name=name)


def test_utils_python_with_a_module_names_it_in_hydra_main_module() -> None:
    """utils.python -m sets HYDRA_MAIN_MODULE to the module, as TorchX's does; --env may override."""
    assert _builtin("utils.python", "-m", "pkg.main").roles[0].env == {
        "HYDRA_MAIN_MODULE": "pkg.main"
    }
    role = _builtin("utils.python", "-m", "pkg.main", "--env", "HYDRA_MAIN_MODULE=x,A=1").roles[0]
    assert role.env == {"HYDRA_MAIN_MODULE": "x", "A": "1"}
    assert _builtin("utils.python", "--script", "main.py").roles[0].env == {}


# -- log: replica ids -----------------------------------------------------------------------------


def test_log_replica_ids_may_end_with_one_comma_as_in_torchx() -> None:
    """'ROLE/0,1,' names replicas 0 and 1 (TorchX's form is (\\d+,?)+); ',' or '0,,' stay errors."""
    target = parse_target("local_cwd://s/app/trainer/0,1,")
    assert target.replicas == [ReplicaRange(0, 0), ReplicaRange(1, 1)]
    for bad in (",", "0,,", ",0"):
        with pytest.raises(CliError, match="replica '' in"):
            parse_target(f"local_cwd://s/app/trainer/{bad}")


# -- describe: fields a scheduler does not keep ---------------------------------------------------


def test_describe_leaves_out_a_command_and_image_the_scheduler_did_not_keep() -> None:
    """A role whose entrypoint/image is MISSING (local_docker keeps neither) shows no '<MISSING>'."""
    app = AppDef("sh", [Role("sh", image=MISSING, num_replicas=2)])
    text = format_app("local_docker://s/sh-1", app, "SUCCEEDED")
    assert "MISSING" not in text
    assert "command:" not in text and "image:" not in text
    assert "role sh (2 replicas)" in text
    known = format_app("local_cwd://s/sh-1", AppDef("sh", [Role("sh", "img", "echo", ["a b"])]), "")
    assert "image:    img" in known and "command:  echo 'a b'" in known


# -- component files: any name TorchX loads ------------------------------------------------------


def test_a_component_file_without_a_py_suffix_loads_as_in_torchx(tmp_path: Path) -> None:
    """A component file named comp.txt or comp (no suffix) is Python source, as TorchX reads it."""
    source = (
        "from asynctorchx.specs import AppDef, Role\n\n\n"
        "def hello(msg: str = 'hi') -> AppDef:\n"
        '    """Says hello.\n\n    Args:\n        msg: the message\n    """\n'
        "    return AppDef('hello', [Role('r', 'img', 'echo', args=[msg])])\n"
    )
    for name in ("comp.txt", "comp"):
        (tmp_path / name).write_text(source)
        app = materialize_appdef(get_component(f"{tmp_path / name}:hello").fn, ["--msg", "x"])
        assert app.roles[0].args == ["x"]


def test_a_component_path_that_is_not_a_file_says_so(tmp_path: Path) -> None:
    """A directory or a device as the component's file is 'not a regular file', not missing."""
    for path in (tmp_path, Path("/dev/null")):
        with pytest.raises(ComponentNotFoundException, match="is not a regular file"):
            get_component(f"{path}:hello")
    with pytest.raises(ComponentNotFoundException, match="does not exist"):
        get_component(f"{tmp_path / 'nope.py'}:hello")


# -- component arguments: one value per option ----------------------------------------------------


@pytest.mark.parametrize(
    ("component", "args", "named"),
    [
        ("utils.echo", ["--msg", "a", "--msg", "b"], "--msg"),
        ("utils.echo", ["--msg=a", "--msg", "b"], "--msg"),
        ("dist.ddp", ["--env", "A=1", "--env", "B=2", "--script", "t.py"], "--env"),
        ("dist.ddp", ["-j", "1x1", "--j", "2x2", "--script", "t.py"], "-j/--j"),
        ("dist.ddp", ["--debug", "--debug", "false", "--script", "t.py"], "--debug"),
    ],
)
def test_a_component_option_given_twice_is_an_error(
    component: str, args: list[str], named: str
) -> None:
    """An option repeated (under any of its spellings) is refused, as TorchX refuses it; the later
    value silently replaced the earlier (--env A=1 --env B=2 launched without A)."""
    with pytest.raises(InvalidComponentArgsException, match=f"argument {named}: given more than"):
        _builtin(component, *args)


def test_the_scripts_own_arguments_may_repeat() -> None:
    """After --, the script's arguments repeat freely (TorchX refuses those too, wrongly)."""
    args = ["--script", "t.py", "--", "--x", "1", "--x", "2"]
    assert _builtin("dist.ddp", *args).roles[0].args[-1].endswith("t.py --x 1 --x 2")


# -- builtins --print: a file that runs ------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MINIMAL_ARGS))
def test_builtins_print_gives_a_file_that_runs_as_the_builtin(
    cli: Cli, tmp_path: Path, name: str
) -> None:
    """'builtins --print NAME' saved as a file runs as FILE:FUNCTION and builds the builtin's AppDef
    (as TorchX's prints the whole module); the function alone failed with a NameError."""
    printed = cli("builtins", "--print", name)
    assert printed.returncode == 0, printed.stderr
    path = tmp_path / "copied.py"
    path.write_text(printed.stdout)
    copied = get_component(f"{path}:{name.rpartition('.')[2]}")
    args = MINIMAL_ARGS[name]
    assert materialize_appdef(copied.fn, args) == _builtin(name, *args)


# -- run: stdout holds the handle alone -----------------------------------------------------------

NOISY = '''
import asynctorchx.specs as specs

print("loading the component file")


def hello(msg: str = "hi") -> specs.AppDef:
    """Says hello.

    Args:
        msg: the message
    """
    print(f"building with {msg}")
    return specs.AppDef("hello", [specs.Role("r", "img", "echo", args=[msg])])
'''


def test_what_a_component_file_prints_goes_to_stderr_not_into_the_handle(cli: Cli) -> None:
    """run's stdout is the handle alone even when the component's file prints (TorchX mixes them),
    the prints go to stderr; its --help stays on stdout."""
    (cli.cwd / "noisy.py").write_text(NOISY)
    run = cli("run", "noisy.py:hello", "--msg", "x")
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("\n") == 1 and run.stdout.startswith("local_cwd://")
    assert "loading the component file\nbuilding with x\n" in run.stderr
    helped = cli("run", "noisy.py:hello", "--help")
    assert helped.returncode == 0 and "--msg MSG" in helped.stdout


def test_a_role_name_that_cannot_run_everywhere_is_named_as_the_role_name(cli: Cli) -> None:
    """A role named 'my role' (TorchX's local_cwd takes it) fails saying 'role name', not 'name',
    which read as the component's own --name."""
    (cli.cwd / "spaced.py").write_text(
        "import asynctorchx.specs as specs\n\n\n"
        "def comp(name: str = 'x') -> specs.AppDef:\n"
        '    """A role named as asked.\n\n    Args:\n        name: the role\'s name\n    """\n'
        "    return specs.AppDef('app', [specs.Role(name, 'img', 'echo')])\n"
    )
    result = cli("run", "--dryrun", "spaced.py:comp", "--name", "my role")
    assert result.returncode == 2
    line = _one_error_line(result.stderr)
    assert "role name must be 1-63 letters" in line and "got 'my role'" in line
