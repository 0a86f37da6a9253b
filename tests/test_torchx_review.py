"""TorchX drop-in differences found in review, each fixed to behave as TorchX 0.7 does.

F1 a parameter of a type TorchX's linter accepts (``Any``, ``Path``...) with a default; F2
``.torchxconfig`` interpolation and ``[DEFAULT]``; F3 a component raising something else than
ValueError; F4 reST/NumPy docstrings and undescribed arguments in ``--help``; F5 quotes in dict
values; F6 TorchX's ``structured_arg`` and ``dist`` helpers in a file without torchx; F7 the two
sections of ``run --dryrun``.

The CLI runs as a subprocess (cwd, HOME and the local state root under ``tmp_path``) with the
``asynctorchx`` this test imports. The ``test_torchx_*`` tests check TorchX's own behaviour in its
0.7 venv (``_torchx_env.py``: made by the test command; without it they fail in CI).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from _torchx_env import VENV, torchx_python

import asynctorchx
from asynctorchx.runner.config import ConfigFileError, get_configs, load_sections
from asynctorchx.specs.builders import to_dict
from asynctorchx.specs.file_linter import validate_source

SOURCE_ROOT = str(Path(asynctorchx.__file__).resolve().parents[1])
TORCHX_BIN = VENV / "bin" / "torchx"


def ax(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m asynctorchx ARGS`` in ``tmp_path``, with a private HOME and state root."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHXCONFIG", "PYTHONPATH")}
    env.update(
        PYTHONPATH=SOURCE_ROOT,
        ASYNCTORCHX_LOCAL_ROOT=str(tmp_path / "root"),
        HOME=str(home),
        NO_COLOR="1",
    )
    return subprocess.run(
        [sys.executable, "-m", "asynctorchx", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def tx(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """TorchX 0.7's ``torchx ARGS`` in ``tmp_path`` (its venv missing: the test fails in CI,
    and is skipped elsewhere)."""
    torchx_python()
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHXCONFIG", "PYTHONPATH")}
    env["HOME"] = str(home)
    return subprocess.run(
        [str(TORCHX_BIN), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def cmd_lines(out: str) -> list[str]:
    return [line.strip() for line in out.splitlines() if line.strip().startswith("cmd:")]


def stderr_lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    """The lines of stderr other than the dry run's notice."""
    return [line for line in done.stderr.splitlines() if not line.startswith("dry run of")]


# -- F1: any bare type name, with a default ---------------------------------------------------------

ANY_COMPONENT = '''
from pathlib import Path
from typing import Any, Optional
import torchx.specs as specs


def job(
    msg: str = "hi", extra: Any = None, out: Path = Path("/tmp"), tag: Optional[Any] = "t"
) -> specs.AppDef:
    """Echoes msg; extra, out and tag are for Python callers only.

    Args:
        msg: the message
        extra: anything (Python callers)
        out: an output directory (Python callers)
        tag: a tag (Python callers)
    """
    return specs.AppDef(
        "job", [specs.Role("job", image="i", entrypoint="echo", args=[msg, str(out), str(tag)])]
    )
'''


@pytest.mark.timeout(120)
def test_a_parameter_of_any_or_path_type_with_a_default_runs(tmp_path: Path) -> None:
    """TorchX's linter accepts any bare type name; the component runs with its defaults (a string
    default of such a type included)."""
    (tmp_path / "comp.py").write_text(ANY_COMPONENT)
    done = ax(tmp_path, "run", "--dryrun", "comp.py:job", "--msg", "yo")
    assert done.returncode == 0, done.stderr
    assert cmd_lines(done.stdout) == ["cmd: echo yo /tmp t"]


@pytest.mark.timeout(120)
def test_giving_a_parameter_no_string_decodes_to_is_an_error_naming_it(tmp_path: Path) -> None:
    """TorchX fails (``ValueError: Unknown``) when such a parameter is given; so does asynctorchx,
    in one line naming the parameter, rather than handing the component a str for a Path."""
    (tmp_path / "comp.py").write_text(ANY_COMPONENT)
    done = ax(tmp_path, "run", "--dryrun", "comp.py:job", "--out", "/x")
    assert done.returncode == 2, done.stderr
    (line,) = [x for x in stderr_lines(done) if "error" in x]
    assert "argument --out" in line and "Path" in line and "Traceback" not in done.stderr


@pytest.mark.timeout(120)
def test_a_parameter_of_another_type_without_default_is_still_refused() -> None:
    """Without a default it could never be given: still a linter error, naming the way out."""
    source = (
        "from pathlib import Path\nfrom asynctorchx.specs import AppDef\n\n\n"
        "def job(out: Path) -> AppDef:\n    return AppDef('j')\n"
    )
    (message,) = [m for m in validate_source(source, "job") if m.severity == "error"]
    assert "'out'" in message.description and "has a default" in message.description


@pytest.mark.timeout(120)
def test_torchx_runs_the_any_or_path_component(tmp_path: Path) -> None:
    # (not a str default: TorchX decodes one, and fails, where asynctorchx keeps it)
    (tmp_path / "comp.py").write_text(ANY_COMPONENT.replace('= "t"', "= None"))
    done = tx(tmp_path, "run", "--dryrun", "-s", "local_cwd", "comp.py:job", "--msg", "yo")
    assert done.returncode == 0, done.stderr
    assert "'args': ['yo', '/tmp', 'None']" in done.stdout


# -- F2: .torchxconfig as configparser.ConfigParser() reads it --------------------------------------

INTERPOLATED = """\
[DEFAULT]
greeting = hello

[component:utils.echo]
msg = %(greeting)s@100%%
"""


@pytest.mark.timeout(120)
def test_torchxconfig_values_are_interpolated(tmp_path: Path) -> None:
    """``%(key)s`` takes [DEFAULT]'s value, ``%%`` is a literal %."""
    (tmp_path / ".torchxconfig").write_text(INTERPOLATED)
    done = ax(tmp_path, "run", "--dryrun", "utils.echo")
    assert done.returncode == 0, done.stderr
    assert cmd_lines(done.stdout) == ["cmd: echo hello@100%"]


@pytest.mark.timeout(120)
def test_torchxconfig_default_section_is_shared_with_component_sections(tmp_path: Path) -> None:
    (tmp_path / ".torchxconfig").write_text("[DEFAULT]\nmsg = shared\n\n[component:utils.echo]\n")
    done = ax(tmp_path, "run", "--dryrun", "utils.echo")
    assert done.returncode == 0, done.stderr
    assert cmd_lines(done.stdout) == ["cmd: echo shared"]


@pytest.mark.timeout(120)
def test_a_lone_percent_is_a_one_line_error_naming_file_and_key(tmp_path: Path) -> None:
    (tmp_path / ".torchxconfig").write_text("[component:utils.echo]\nmsg = 100%\n")
    done = ax(tmp_path, "run", "--dryrun", "utils.echo")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = stderr_lines(done)
    assert ".torchxconfig" in line and "[component:utils.echo] msg" in line and "%%" in line


@pytest.mark.timeout(120)
def test_default_keys_stay_out_of_sections_where_they_would_be_names(tmp_path: Path) -> None:
    """[DEFAULT] serves %(key)s in [cli:run], [limits:...], [torchx:tracker] without becoming a key
    there (a tracker named 'root', an unknown limit); keys keep their case, as in TorchX."""
    (tmp_path / ".torchxconfig").write_text(
        "[DEFAULT]\nroot = /data\n\n[cli:run]\nworkspace = %(root)s/ws\n\n"
        "[component:x]\nMixedCase = 1\n"
    )
    assert get_configs("cli", "run", [tmp_path]) == {"workspace": "/data/ws"}
    assert load_sections("component", [tmp_path]) == {"x": {"MixedCase": "1", "root": "/data"}}
    (tmp_path / ".torchxconfig").write_text("[cli:run]\nworkspace = %(nope)s\n")
    with pytest.raises(
        ConfigFileError, match=r"\[cli:run\] workspace = %\(nope\)s: .*names no key"
    ):
        get_configs("cli", "run", [tmp_path])


@pytest.mark.timeout(120)
def test_torchx_interpolates_torchxconfig(tmp_path: Path) -> None:
    (tmp_path / ".torchxconfig").write_text(INTERPOLATED)
    done = tx(tmp_path, "run", "--dryrun", "-s", "local_cwd", "utils.echo")
    assert done.returncode == 0, done.stderr
    assert "'args': ['hello@100%']" in done.stdout


# -- F3: a component raising --------------------------------------------------------------------------

RAISING = '''
import torchx.specs as specs


def job(key: str = "missing") -> specs.AppDef:
    """Looks a key up.

    Args:
        key: the key
    """
    table = {"present": "x"}
    return specs.AppDef("job", [specs.Role("job", image="i", entrypoint="echo", args=[table[key]])])
'''


@pytest.mark.timeout(120)
def test_a_component_raising_keyerror_is_a_spec_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "comp.py").write_text(RAISING)
    done = ax(tmp_path, "run", "--dryrun", "comp.py:job")
    assert done.returncode == 2, (done.returncode, done.stderr)
    (line,) = stderr_lines(done)
    assert "comp.py:job" in line and "it raised KeyError: 'missing'" in line, line
    debug = ax(tmp_path, "--debug", "run", "--dryrun", "comp.py:job")
    assert debug.returncode == 2 and "table[key]" in debug.stderr, debug.stderr


# -- F4: reST and NumPy docstrings; undescribed arguments keep their default in --help ----------------

REST = '''
import torchx.specs as specs


def job(msg: str = "hi", n: int = 1, bare: str = "b") -> specs.AppDef:
    """Echoes a message.

    :param msg: the message
        to echo
    :param int n: how many times
    """
    return specs.AppDef("job", [specs.Role("job", image="i", entrypoint="echo", args=[msg])])
'''

NUMPY = '''
import torchx.specs as specs


def job(msg: str = "hi", n: int = 1) -> specs.AppDef:
    """Echoes a message.

    Parameters
    ----------
    msg : str
        the message to echo
    n : int
        how many times
    """
    return specs.AppDef("job", [specs.Role("job", image="i", entrypoint="echo", args=[msg])])
'''


def option_line(help_text: str, option: str) -> str:
    (line,) = [x for x in help_text.splitlines() if option in x.replace(",", " ").split()[:4]]
    return line


@pytest.mark.timeout(120)
@pytest.mark.parametrize("source", [REST, NUMPY], ids=["rest", "numpy"])
def test_rest_and_numpy_docstrings_describe_the_arguments(tmp_path: Path, source: str) -> None:
    (tmp_path / "comp.py").write_text(source)
    done = ax(tmp_path, "run", "comp.py:job", "--help")
    assert done.returncode == 0, done.stderr
    assert "the message to echo (default: hi)" in option_line(done.stdout, "--msg"), done.stdout
    assert "how many times (default: 1)" in option_line(done.stdout, "--n"), done.stdout
    assert ":param" not in done.stdout and "----------" not in done.stdout
    assert "Echoes a message." in done.stdout


@pytest.mark.timeout(120)
def test_an_undescribed_argument_keeps_its_default_in_help(tmp_path: Path) -> None:
    """argparse drops a blank help, and with it '(default: b)'; TorchX loses it, we keep it."""
    (tmp_path / "comp.py").write_text(REST)
    done = ax(tmp_path, "run", "comp.py:job", "--help")
    assert done.returncode == 0, done.stderr
    assert option_line(done.stdout, "--bare").split() == ["--bare", "BARE", "(default:", "b)"]


def test_docstring_styles_parse_alike() -> None:
    from asynctorchx.specs.file_linter import parse_docstring

    google = parse_docstring("Sum.\n\nArgs:\n    a: first\n    b: second\n")
    rest = parse_docstring("Sum.\n\n:param a: first\n:param str b: second\n:returns: x\n")
    numpy = parse_docstring("Sum.\n\nParameters\n----------\na : int\n    first\nb\n    second\n")
    assert google == rest == numpy == ("Sum.", {"a": "first", "b": "second"})


@pytest.mark.timeout(120)
def test_torchx_parses_rest_docstrings(tmp_path: Path) -> None:
    (tmp_path / "comp.py").write_text(REST)
    done = tx(tmp_path, "run", "-s", "local_cwd", "comp.py:job", "--help")
    assert done.returncode == 0, done.stderr
    assert "the message" in done.stdout and "(default: hi)" in done.stdout


# -- F5: quotes in dict values are kept ---------------------------------------------------------------


@pytest.mark.timeout(120)
def test_dict_value_quotes_are_kept_as_torchx_keeps_them(tmp_path: Path) -> None:
    done = ax(tmp_path, "run", "--dryrun", "utils.sh", "--env", "MSG='a b'", "--", "true")
    assert done.returncode == 0, done.stderr
    assert "env MSG='a b'" in done.stdout, done.stdout


def test_to_dict_only_empties_a_pair_of_quotes() -> None:
    assert to_dict("""A='a b',B="c",C='',D="\"""") == {"A": "'a b'", "B": '"c"', "C": "", "D": ""}


@pytest.mark.timeout(120)
def test_torchx_keeps_dict_value_quotes(tmp_path: Path) -> None:
    done = tx(
        tmp_path,
        "run",
        "--dryrun",
        "-s",
        "local_cwd",
        "utils.sh",
        "--env",
        "MSG='a b'",
        "--",
        "true",
    )
    assert done.returncode == 0, done.stderr
    assert "'MSG': \"'a b'\"" in done.stdout, done.stdout


# -- F6: TorchX's structured_arg and dist helpers without torchx ------------------------------------

COPIED_DDP = '''
import torchx
import torchx.specs as specs
from torchx.components.dist import _args_join, _noquote, get_role_name, parse_nnodes
from torchx.components.structured_arg import StructuredJArgument, StructuredNameArgument


def myddp(*script_args: str, script: str = "t.py", j: str = "1x2", name: str = "/") -> specs.AppDef:
    """A trimmed copy of TorchX's dist.ddp.

    Args:
        script_args: the script's arguments
        script: the script
        j: nodes x procs
        name: experiment/run
    """
    jarg = StructuredJArgument.parse_from(h="gpu.small", j=j)
    argname = StructuredNameArgument.parse_from(name=name, m=None, script=script)
    low, high, nproc, nnodes = parse_nnodes(j)
    cmd = _args_join([_noquote("$${X:=y}"), nnodes, str(nproc), "a b", *script_args])
    return specs.AppDef(argname.run_name, [specs.Role(get_role_name(script, None),
        image=torchx.IMAGE, entrypoint="echo", args=[str(jarg), cmd], num_replicas=high)])
'''


@pytest.mark.timeout(120)
def test_a_component_copied_from_torchx_ddp_loads(tmp_path: Path) -> None:
    (tmp_path / "comp.py").write_text(COPIED_DDP)
    done = ax(tmp_path, "run", "--dryrun", "comp.py:myddp", "-j", "1x3")
    assert done.returncode == 0, done.stderr
    assert cmd_lines(done.stdout) == ["cmd: echo 1x3 ${X:=y} 1 3 'a b'"]
    assert "'name': 't'" in done.stdout


def test_structured_arguments_and_dist_helpers_follow_torchx() -> None:
    from asynctorchx.components._torchx_shim import (
        StructuredJArgument,
        StructuredNameArgument,
        _args_join,
        _noquote,
        get_role_name,
        parse_nnodes,
    )

    assert parse_nnodes("2:4x1") == (2, 4, 1, "2:4")
    assert parse_nnodes("2x3") == (2, 2, 3, "2")
    assert parse_nnodes("8") == (1, 1, 8, "1")
    with pytest.raises(ValueError, match="usage example"):
        parse_nnodes("2x")
    assert _args_join(["a b", _noquote("$X y")]) == "'a b' $X y"
    assert get_role_name("dir/train.py", None) == "train"
    assert get_role_name(None, "pkg.mod") == "mod"
    assert StructuredNameArgument.parse_from("foo/", m="a.b.c") == StructuredNameArgument(
        "foo", "c"
    )
    assert str(StructuredNameArgument.parse_from("/bar", script="x.py")) == "default-experiment/bar"
    assert StructuredNameArgument.parse_from("run", script="x.py").run_name == "run"
    with pytest.raises(ValueError):
        StructuredNameArgument.parse_from("a/b")
    assert str(StructuredJArgument.parse_from(h="aws_p4d.24xlarge", j="2")) == "2x8"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert StructuredJArgument.parse_from(h="aws_p4d.24xlarge", j="2x4").nproc_per_node == 4
    with pytest.raises(ValueError, match="no GPU"):
        StructuredJArgument.parse_from(h="cpu.small", j="2")


# -- F7: run --dryrun prints TorchX's two sections -------------------------------------------------


@pytest.mark.timeout(120)
def test_dryrun_prints_the_application_then_the_scheduler_request(tmp_path: Path) -> None:
    done = ax(tmp_path, "run", "--dryrun", "utils.echo", "--msg", "hi there")
    assert done.returncode == 0, done.stderr
    application, _, request = done.stdout.partition("=== SCHEDULER REQUEST ===")
    assert application.strip().startswith("=== APPLICATION ===")
    assert "'args': ['hi there']" in application and "'entrypoint': 'echo'" in application
    assert cmd_lines(request) == ["cmd: echo hi there"]


@pytest.mark.timeout(120)
def test_torchx_dryrun_sections(tmp_path: Path) -> None:
    done = tx(tmp_path, "run", "--dryrun", "-s", "local_cwd", "utils.echo", "--msg", "hi there")
    assert done.returncode == 0, done.stderr
    assert "=== APPLICATION ===" in done.stdout and "=== SCHEDULER REQUEST ===" in done.stdout
    assert "'args': ['hi there']" in done.stdout
