"""Differences from TorchX 0.7 found by a second side-by-side probe of both CLIs (component
arguments, component files, log targets), each pinned here once fixed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _torchx_env import REPO
from test_cli_commands import Cli

from asynctorchx.components._finder import get_component
from asynctorchx.specs import AppDef
from asynctorchx.specs.builders import materialize_appdef, to_dict
from asynctorchx.specs.errors import InvalidComponentArgsException


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    base = tmp_path_factory.mktemp("dropin2")
    c = Cli(base, base / "root")
    c.env["PYTHONPATH"] = str(REPO)
    yield c


def _builtin(name: str, *args: str) -> AppDef:
    component = get_component(name)
    return materialize_appdef(component.fn, list(args), name=name)


# -- dict arguments: quotes --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("MSG=don't panic", {"MSG": "don't panic"}),
        ("A=it's,B=x", {"A": "it's", "B": "x"}),
        ('Q=say "hi"', {"Q": 'say "hi"'}),
        ("A='x,y',B=it's", {"A": "'x,y'", "B": "it's"}),
        ('A="it\'s"', {"A": '"it\'s"'}),
    ],
)
def test_a_quote_inside_a_dict_value_is_a_character(text: str, expected: dict[str, str]) -> None:
    """A quote is part of the value, as in TorchX (only exactly '' or "" is an empty value)."""
    assert to_dict(text) == expected


def test_an_env_value_with_an_apostrophe_is_launched_as_torchx_launches_it() -> None:
    """--env "MSG=don't panic" sets MSG (TorchX does); it failed as an unterminated quote."""
    app = _builtin("utils.sh", "--env", "MSG=don't panic", "--", "echo", "hi")
    assert app.roles[0].env["MSG"] == "don't panic"


def test_a_quote_left_open_is_a_character_too() -> None:
    """A value starting with a quote that is never closed is kept as written, as TorchX keeps it."""
    app = _builtin("utils.sh", "--env", "A='unclosed", "--", "echo")
    assert app.roles[0].env["A"] == "'unclosed"


# -- component options: abbreviations -------------------------------------------------------------


@pytest.mark.parametrize(
    ("component", "args", "said"),
    [
        ("utils.echo", ["--ms", "hi"], r"--ms abbreviates --msg: give options in full"),
        ("dist.ddp", ["--scr", "t.py"], r"--scr abbreviates --script: give options in full"),
        ("utils.echo", ["--mgs=hi"], r"did you mean --msg\?"),
    ],
)
def test_an_abbreviated_component_option_names_the_option_in_full(
    component: str, args: list[str], said: str
) -> None:
    """TorchX takes --ms for --msg; refused here (options are given in full), the error names the
    option it abbreviates (or the close spelling) instead of only 'unrecognized arguments'."""
    with pytest.raises(InvalidComponentArgsException, match=f"unrecognized arguments: .*{said}"):
        _builtin(component, *args)


# -- --workspace: a directory whose name holds ':' or ',' ---------------------------------------------


@pytest.mark.parametrize(
    ("made", "given", "url"),
    [
        (["runs/exp-10", "runs/exp-10:30"], "runs/exp-10:30", "runs/exp-10%3A30"),
        (["exp", "v2", "exp,v2"], "exp,v2", "exp%2Cv2"),
        (["data,v2"], "data,v2", "data%2Cv2"),
    ],
)
def test_a_workspace_naming_a_directory_with_a_colon_or_comma_is_refused_naming_its_url(
    cli: Cli, tmp_path: Path, made: list[str], given: str, url: str
) -> None:
    """--workspace runs/exp-10:30, where that directory exists, fails naming the file:// URL to
    give, even when the other reading exists too (runs/exp-10 was shipped into 30/, silently,
    instead of the directory named; exp,v2 shipped exp and v2 merged)."""
    for d in made:
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / made[-1] / "mine.txt").write_text("the directory named\n")
    result = cli(
        "run", "--dryrun", "-s", "local_dir", "--workspace", str(tmp_path / given), "utils.echo"
    )
    assert result.returncode == 2, result.stderr
    assert f"file://{tmp_path}/{url}" in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr


def test_a_mapped_workspace_whose_literal_name_is_no_directory_is_mapped(
    cli: Cli, tmp_path: Path
) -> None:
    """DIR:SUBDIR is still DIR going to SUBDIR when no directory is named DIR:SUBDIR."""
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "a.txt").write_text("a\n")
    result = cli(
        "run", "--dryrun", "-s", "local_dir", "--workspace", f"{tmp_path}/proj:sub", "utils.echo"
    )
    assert result.returncode == 0, result.stderr
    assert f"workspace: {tmp_path}/proj:sub" in result.stdout


# -- run: what a component file writes to stdout -------------------------------------------------------

LOW_LEVEL = '''
import subprocess
import sys

import torchx.specs as specs

sys.stdout.buffer.write(b"bytes through sys.stdout.buffer\\n")
sys.stdout.flush()
subprocess.run(["echo", "a child given sys.stdout"], stdout=sys.stdout, check=True)
subprocess.run(["echo", "a child inheriting stdout"], check=True)


def hello(msg: str = "hi") -> specs.AppDef:
    """Says hello.

    Args:
        msg: what to say
    """
    print(f"building with {msg}")
    return specs.AppDef("hello", [specs.Role("r", "img", "echo", args=[msg])])
'''


def test_a_component_file_writing_to_stdouts_bytes_or_descriptor_runs(cli: Cli) -> None:
    """A component file that writes to sys.stdout.buffer or hands sys.stdout to a child (TorchX
    loads it) runs; what it and its children write goes to stderr, stdout is the handle alone.
    It failed: sys.stdout was a StringIO, without a buffer or a descriptor."""
    (cli.cwd / "lowlevel.py").write_text(LOW_LEVEL)
    run = cli("run", "lowlevel.py:hello", "--msg", "x")
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("\n") == 1 and run.stdout.startswith("local_cwd://"), run.stdout
    for said in (
        "bytes through sys.stdout.buffer\n",
        "a child given sys.stdout\n",
        "a child inheriting stdout\n",
        "building with x\n",
    ):
        assert said in run.stderr
    helped = cli("run", "lowlevel.py:hello", "--help")
    assert helped.returncode == 0 and "--msg MSG" in helped.stdout
