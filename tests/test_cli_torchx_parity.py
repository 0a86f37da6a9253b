"""The console script's TorchX parity: component arguments after the component's name, -cfg, log
-t/--tail, status --roles, --log_level, configure and plugin commands (real subprocesses, real local
backend)."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from _torchx_env import REPO, torchx_env, torchx_python
from test_cli_commands import COMPONENT, Cli, _handle_line, _one_error_line

ARGS_COMPONENT = '''
from asynctorchx.specs import AppDef, Role


def comp(d: str = "-", dry: str = "-", s: str = "-", wait: str = "-", log: str = "-") -> AppDef:
    """Echoes its arguments; their names are prefixes or copies of run's own options.

    Args:
        d: d
        dry: dry
        s: s
        wait: wait
        log: log
    """
    return AppDef("comp", [Role("comp", ".", "echo", args=[d, dry, s, wait, log])])
'''


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    base = tmp_path_factory.mktemp("parity")
    (base / "comp.py").write_text(COMPONENT)
    (base / "args.py").write_text(ARGS_COMPONENT)
    c = Cli(base, base / "root")
    c.env["PYTHONPATH"] = str(REPO)
    yield c


@pytest.fixture(scope="module")
def finished(cli: Cli) -> str:
    """A succeeded app with roles trainer (2 replicas) and ps (1)."""
    result = cli("run", "comp.py:job", "--script", "echo hi")
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def in_dir(cli: Cli, cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Runs the console script in ``cwd`` (the fixture's runs in its own directory)."""
    return subprocess.run(
        [cli.script, *args],
        cwd=cwd,
        env=cli.env_with(**env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# -- run: the component's arguments ----------------------------------------------------------------


def test_component_arguments_are_the_components_whatever_their_spelling(cli: Cli) -> None:
    """After the component's name, --d, --dry, -s, --wait, --log go to the component, not to run."""
    result = cli(
        "run", "--dryrun", "args.py:comp", "--d", "1", "--dry", "2", "-s", "3", "--wait", "4",
        "--log", "5",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "cmd: echo 1 2 3 4 5" in result.stdout


def test_run_options_before_the_component_may_be_abbreviated(cli: Cli) -> None:
    """Before the component's name, run's own options keep argparse's abbreviations (--dry)."""
    result = cli("run", "--dry", "--workspace=.", "-slocal_cwd", "args.py:comp", "--d", "x")
    assert result.returncode == 0, result.stderr
    assert "cmd: echo x - - - -" in result.stdout
    assert "nothing is launched" in result.stderr


def test_component_help_after_its_name(cli: Cli) -> None:
    """`run COMPONENT --help` is the component's help (run's --help before it is run's)."""
    component = cli("run", "args.py:comp", "--help")
    own = cli("run", "--help")
    assert component.returncode == own.returncode == 0
    assert "--dry DRY" in component.stdout
    assert "--scheduler_args" in own.stdout and "--dry DRY" not in own.stdout


def test_cfg_without_equals_names_the_string(cli: Cli) -> None:
    """`-cfg log_dir` (no '=') fails with one line naming the string given, not '<EMPTY>'."""
    result = cli("run", "-cfg", "log_dir", "utils.echo")
    assert result.returncode == 2
    line = _one_error_line(result.stderr)
    assert "'log_dir' is not 'key=value'" in line and "Given: 'log_dir'" in line
    assert "<EMPTY>" not in line


def test_cfg_may_be_repeated(cli: Cli, tmp_path: Path) -> None:
    """Several -cfg are merged, a key taking its last value (as cfg_from_str of several strings)."""
    result = cli(
        "run",
        "--dryrun",
        "-cfg",
        f"log_dir={tmp_path / 'first'},prepend_cwd=true",
        "-cfg",
        f"log_dir={tmp_path / 'second'}",
        "utils.echo",
    )
    assert result.returncode == 0, result.stderr
    assert str(tmp_path / "second") in result.stdout
    assert str(tmp_path / "first") not in result.stdout


# -- log -t/--tail, status --roles -----------------------------------------------------------------


@pytest.mark.parametrize("flag", ["-t", "--tail"])
def test_log_tail_follows_until_the_app_ends(cli: Cli, flag: str, tmp_path: Path) -> None:
    """`log -t` / `log --tail` (TorchX's spelling of -f) prints lines as they come, until the end."""
    gate = tmp_path / "go"
    proc = cli.popen(
        "run", "comp.py:job", "--workers", "1", "--ps", "0",
        "--script", f'echo a; while [ ! -e "{gate}" ]; do sleep 0.01; done; echo b',
    )  # fmt: skip
    try:
        handle = _handle_line(proc)
        follow = cli.popen("log", flag, handle)
        assert follow.stdout is not None
        assert follow.stdout.readline() == "trainer/0 | a\n"
        gate.touch()
        rest, _ = follow.communicate(timeout=30)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.communicate()
    assert follow.returncode == 0
    assert rest.splitlines() == ["trainer/0 | b"]


def test_status_roles_filters_text_and_json(cli: Cli, finished: str) -> None:
    """`status --roles ps` shows only the ps replicas, in text and in JSON."""
    text = cli("status", "--roles", "ps", finished)
    assert text.returncode == 0, text.stderr
    assert "ps[0]" in text.stdout and "trainer[" not in text.stdout
    both = cli("status", "--roles", "trainer,ps", finished)
    assert "ps[0]" in both.stdout and "trainer[1]" in both.stdout
    data = json.loads(cli("status", "--json", "--roles", "trainer", finished).stdout)
    assert [r["role"] for r in data["roles"]] == ["trainer"]


def test_status_unknown_role_is_an_error(cli: Cli, finished: str) -> None:
    """An unknown role in --roles fails with one line naming it and listing the app's roles."""
    result = cli("status", "--roles", "ps,nope", finished)
    assert result.returncode == 2
    line = _one_error_line(result.stderr)
    assert "'nope'" in line and "trainer, ps" in line


# -- --log_level -----------------------------------------------------------------------------------


def test_log_level_sets_the_logging_level(cli: Cli, finished: str) -> None:
    """--log_level DEBUG (before or after the command) or $LOGLEVEL turns debug logs on."""
    quiet = cli("status", finished)
    assert "DEBUG" not in quiet.stderr
    for result in (
        cli("--log_level", "DEBUG", "status", finished),
        cli("status", "--log_level", "debug", finished),
        cli("status", finished, LOGLEVEL="DEBUG"),
    ):
        assert result.returncode == 0, result.stderr
        assert "asynctorchx: DEBUG:" in result.stderr


def test_bad_log_level_is_a_usage_error(cli: Cli, finished: str) -> None:
    """A bad --log_level (or LOGLEVEL) is one line naming the value, exit 2."""
    result = cli("--log_level", "LOUD", "status", finished)
    assert result.returncode == 2
    assert "'LOUD' is not a logging level" in _one_error_line(result.stderr)
    result = cli("status", finished, LOGLEVEL="LOUD")
    assert result.returncode == 2
    assert "LOGLEVEL 'LOUD'" in _one_error_line(result.stderr)


# -- configure -------------------------------------------------------------------------------------


def test_configure_writes_a_template_that_loads(cli: Cli, tmp_path: Path) -> None:
    """configure writes .torchxconfig (required options only), -a adds defaults; it loads back."""
    result = in_dir(cli, tmp_path, "configure", "-s", "local_cwd,slurm")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / ".torchxconfig").read_text() == "[local_cwd]\n\n[slurm]\n\n"
    again = in_dir(cli, tmp_path, "configure", "-a", "-s", "local_cwd")
    assert again.returncode == 2
    assert "exists and is left as it is" in _one_error_line(again.stderr)
    assert (tmp_path / ".torchxconfig").read_text() == "[local_cwd]\n\n[slurm]\n\n"
    forced = in_dir(cli, tmp_path, "configure", "-a", "--force", "-s", "local_cwd")
    assert forced.returncode == 0, forced.stderr
    text = (tmp_path / ".torchxconfig").read_text()
    assert "log_dir = None\n" in text and "prepend_cwd = False\n" in text
    dry = in_dir(
        cli, tmp_path, "run", "--dryrun", "utils.echo", TORCHXCONFIG=str(tmp_path / ".torchxconfig")
    )
    assert dry.returncode == 0 and "warning" not in dry.stderr, dry.stderr


def test_configure_output_matches_torchx(cli: Cli, tmp_path: Path) -> None:
    """`configure --print -a` writes TorchX's format: the options both have read the same."""
    ours = cli("configure", "--print", "-a", "-s", "local_cwd")
    theirs = subprocess.run(
        [torchx_python(), "-m", "torchx.cli.main", "configure", "--print", "-a", "-s", "local_cwd"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=torchx_env(),
        check=False,
    )
    assert ours.returncode == theirs.returncode == 0, theirs.stderr
    assert ours.stdout.startswith("[local_cwd]\n")
    their_lines = [ln for ln in theirs.stdout.splitlines() if " = " in ln]
    assert their_lines, theirs.stdout
    for line in their_lines:
        assert line in ours.stdout.splitlines()


def test_configure_unknown_scheduler(cli: Cli, tmp_path: Path) -> None:
    """configure -s with an unknown scheduler fails with one line and writes nothing."""
    result = in_dir(cli, tmp_path, "configure", "-s", "local_cwd,nope")
    assert result.returncode == 2
    assert "unknown scheduler 'nope'" in _one_error_line(result.stderr)
    assert not (tmp_path / ".torchxconfig").exists()


# -- plugin commands -------------------------------------------------------------------------------

PLUGIN = '''
import argparse


class Hello:
    """Says hello (a plugin command)."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--name", default="world")

    def run(self, args: argparse.Namespace) -> int:
        print(f"hello {args.name}")
        return 3


class Components:
    """Counts the components, asynchronously."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        pass

    async def run(self, args: argparse.Namespace) -> None:
        import asyncio

        from asynctorchx.components import get_components

        await asyncio.sleep(0)
        print(len(get_components()))


class Sloppy:
    """Returns a string where an exit status belongs."""

    def add_arguments(self, parser):
        pass

    def run(self, args):
        return "done"


class Shadow:
    def add_arguments(self, parser):
        pass

    def run(self, args):
        print("shadowed!")
'''


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("plugsite")
    (site / "atx_plug.py").write_text(textwrap.dedent(PLUGIN))
    (site / "atx_plug_broken.py").write_text("raise ImportError('missing dependency foo')\n")
    dist = site / "atx_plug-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: atx-plug\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[asynctorchx.cli.cmds]\n"
        "hello = atx_plug:Hello\n"
        "ncomponents = atx_plug:Components\n"
        "status = atx_plug:Shadow\n"
        "broken = atx_plug_broken:Broken\n"
        "sloppy = atx_plug:Sloppy\n"
    )
    return site


def plug_env(site: Path) -> dict[str, str]:
    return {"PYTHONPATH": f"{REPO}{os.pathsep}{site}"}


def test_plugin_commands_run(cli: Cli, plugin_site: Path) -> None:
    """Commands of the asynctorchx.cli.cmds group run, sync or async, with their own arguments."""
    hello = cli("hello", "--name", "you", **plug_env(plugin_site))
    assert (hello.returncode, hello.stdout) == (3, "hello you\n")
    count = cli("ncomponents", **plug_env(plugin_site))
    assert count.returncode == 0, count.stderr
    assert int(count.stdout) >= 11


def test_plugin_commands_are_listed_never_replace_builtins(
    cli: Cli, plugin_site: Path, finished: str
) -> None:
    """--plugins lists the plugins; a plugin named like a builtin is ignored with a warning."""
    helped = cli("--plugins", **plug_env(plugin_site))
    assert helped.returncode == 0
    assert "hello" in helped.stdout and "(plugin atx_plug:Hello)" in helped.stdout
    assert "ignoring plugin command status = atx_plug:Shadow" in helped.stderr
    status = cli("status", finished, **plug_env(plugin_site))
    assert status.returncode == 0 and "shadowed" not in status.stdout
    assert status.stderr == ""  # a builtin command reads no entry point at all


def test_help_reads_no_entry_point_and_points_to_plugins(cli: Cli, plugin_site: Path) -> None:
    """--help, --version and a missing command read no entry point; --help names --plugins."""
    helped = cli("--help", **plug_env(plugin_site))
    assert helped.returncode == 0 and helped.stderr == ""
    assert "atx_plug" not in helped.stdout and "'asynctorchx --plugins'" in helped.stdout
    for args in (("--version",), ()):
        result = cli(*args, **plug_env(plugin_site))
        assert "ignoring plugin command" not in result.stderr, args


def test_broken_plugin_fails_only_its_command(cli: Cli, plugin_site: Path) -> None:
    """A plugin command that does not load fails with one line; the others still work."""
    broken = cli("broken", "--x", **plug_env(plugin_site))
    assert broken.returncode == 2
    errors = [ln for ln in broken.stderr.splitlines() if "warning: ignoring" not in ln]
    line = _one_error_line("\n".join(errors))
    assert line.startswith("asynctorchx broken: error: plugin command 'broken'")
    assert "missing dependency foo" in line
    assert cli("hello", **plug_env(plugin_site)).stdout == "hello world\n"


def test_plugin_returning_a_non_int_names_the_plugin(cli: Cli, plugin_site: Path) -> None:
    """A plugin whose run() returns something else than an int or None fails with one line
    naming the plugin and the value."""
    done = cli("sloppy", **plug_env(plugin_site))
    assert done.returncode != 0
    [line] = [x for x in done.stderr.splitlines() if x.startswith("asynctorchx sloppy: error:")]
    assert "plugin command 'sloppy' returned 'done'" in line, done.stderr


# -- local_cwd: which program a bare name runs ----------------------------------------------------


TORCHX_RUN_WAIT = ("run", "--wait", "-s", "local_cwd")


def test_a_program_in_the_current_directory_wins_over_the_launchers_path_as_in_torchx(
    cli: Cli, tmp_path: Path
) -> None:
    """``run -s local_cwd utils.sh mytool`` with ``./mytool`` and another ``mytool`` on the
    launcher's PATH runs ``./mytool`` under TorchX 0.7 (the role's PATH, the current directory,
    then the launcher's: its effective order, whatever its help text says) and under asynctorchx;
    it ran the PATH's before. (Each program notes its run in a file: TorchX's ``--log`` loses a
    short app's output now and then.)"""
    sysbin, proj, ran = tmp_path / "sysbin", tmp_path / "proj", tmp_path / "ran"
    for d, word in ((sysbin, "SYSTEM-TOOL"), (proj, "CWD-TOOL")):
        d.mkdir()
        (d / "mytool").write_text(f"#!/bin/sh\necho {word} >> {ran}\n")
        (d / "mytool").chmod(0o755)
    path = f"{sysbin}{os.pathsep}{os.environ['PATH']}"
    theirs = subprocess.run(
        [torchx_python(), "-m", "torchx.cli.main", *TORCHX_RUN_WAIT, "utils.sh", "mytool"],
        cwd=proj,
        env=torchx_env(PATH=path, TORCHX_LOG_DIR=str(tmp_path / "torchx-logs")),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert theirs.returncode == 0, theirs.stderr
    assert ran.read_text() == "CWD-TOOL\n"
    ours = in_dir(cli, proj, "run", "--wait", "-s", "local_cwd", "utils.sh", "mytool", PATH=path)
    assert ours.returncode == 0, ours.stderr
    assert ran.read_text() == "CWD-TOOL\nCWD-TOOL\n"
