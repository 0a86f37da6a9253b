"""The CLI against hostile input and surroundings (found by review): a log regex whose repeat
counts ``regex`` would write out, the metadata ``describe`` dropped, a state root that cannot be
read, a lone surrogate or an argument too long for exec, metadata nested thousands deep, options
after ``--``, log output lost to a tiny full disk, a read-only state root for ``cancel``, control
characters in ``describe``.

Each runs the console entry point in a subprocess with a private state root and no config. Some
need root (``mount``, another user); they are skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import engine_missing

NOBODY = 65534
IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="needs root (mount, another user)")


def env_for(root: Path | str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ASYNCTORCHX_", "TORCHX"))}
    env.update({"ASYNCTORCHX_LOCAL_ROOT": str(root), "TORCHXCONFIG": "", **extra})
    return env


def cli(
    root: Path | str,
    *args: str,
    cwd: Path | str | None = None,
    python: str = sys.executable,
    preexec: Callable[[], None] | None = None,
    **extra: str,
) -> subprocess.CompletedProcess[bytes]:
    """``python -m asynctorchx ARGS`` with the state root ``root`` (and ``extra`` environment)."""
    return subprocess.run(
        [python, "-m", "asynctorchx", *args],
        env=env_for(root, **extra),
        cwd=cwd or Path(root).parent,
        capture_output=True,
        timeout=50,
        stdin=subprocess.DEVNULL,
        preexec_fn=preexec,
        check=False,
    )


def launch(root: Path | str, *run_args: str, cwd: Path | str | None = None) -> str:
    """Runs a local app to its end (``run`` of a local app waits); returns its handle."""
    p = cli(root, "run", *run_args, cwd=cwd)
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    return p.stdout.decode().strip()


COMPONENTS = """
import asynctorchx.specs as specs

def role(args=("x",), env=None, metadata=None):
    return specs.Role("r", image=".", entrypoint="echo", args=list(args), env=env or {},
                      metadata=metadata or {})

def with_metadata() -> specs.AppDef:
    return specs.AppDef("meta", roles=[role()], metadata={"team": "ml", "ticket": "JIRA-7"})

def lone_surrogate_arg() -> specs.AppDef:
    return specs.AppDef("bad", roles=[role(args=["ok", "\\ud800"])])

def lone_surrogate_env() -> specs.AppDef:
    return specs.AppDef("bad", roles=[role(env={"E": "\\ud800"})])

def surrogate_escape() -> specs.AppDef:
    return specs.AppDef("esc", roles=[role(args=["a\\udcffb"], env={"E": "\\udc80"})])

def huge_arg(msg: str = "x" * 1_000_000) -> specs.AppDef:
    return specs.AppDef("big", roles=[role(args=["small", msg])])

def many_args() -> specs.AppDef:
    return specs.AppDef("many", roles=[role(args=["y" * 100_000] * 80)])

def nested(levels: int = 5000, where: str = "app") -> specs.AppDef:
    d = cur = {}
    for _ in range(levels):
        cur["x"] = {}
        cur = cur["x"]
    if where == "app":
        return specs.AppDef("deep", roles=[role()], metadata={"d": d})
    return specs.AppDef("deep", roles=[role(metadata={"d": d})])

def escape_codes() -> specs.AppDef:
    return specs.AppDef("esc", roles=[role(args=["\\x1b[2J\\x1b[31mred", "two\\nlines"])])
"""


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "root"


@pytest.fixture
def comp(tmp_path: Path) -> Path:
    f = tmp_path / "comp.py"
    f.write_text(COMPONENTS)
    return f


# -- log --regex: repeat counts -------------------------------------------------------------------


def _peak_rss_mb(root: Path, *args: str, limit: int) -> tuple[int, bytes, float]:
    """Runs the CLI under an address-space limit; its exit code, output and peak RSS (MB)."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    p = subprocess.Popen(
        [sys.executable, "-m", "asynctorchx", *args],
        env=env_for(root),
        cwd=root.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=cap,
    )
    assert p.stdout is not None
    out = p.stdout.read()
    p.stdout.close()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, out, usage.ru_maxrss / 1024


@pytest.mark.timeout(60)
def test_a_big_repeat_count_in_a_plain_regex_stays_on_re(root: Path) -> None:
    """``a{4000000}`` is not risky: ``re`` matches it in constant memory. It was compiled with
    ``regex`` all the same, which writes the repeat out: 1.1 GB (``a{99999999}``: 24 GB, until
    the OOM killer)."""
    handle = launch(root, "utils.echo", "--msg", "hello")
    code, out, peak = _peak_rss_mb(root, "log", "--regex", "a{4000000}", handle, limit=6 << 30)
    assert code == 0, out.decode(errors="replace")
    assert out == b""  # nothing matches, and nothing is said
    assert peak < 300, f"peaked at {peak:.0f} MB"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("regex", ["(a{100000000}|b)+", "(?:(a|b)+x{100000})+"])
def test_a_risky_regex_that_would_expand_beyond_the_bound_is_refused(
    root: Path, regex: str
) -> None:
    """A risky pattern (matched by ``regex``, with a time limit) whose repeats multiply out past
    ``MAX_EXPANSION`` items is refused naming --regex and the pattern, exit 2 (it was written out
    in memory: under a 2 GiB limit ``regex`` failed and ``re`` matched it without one)."""
    handle = launch(root, "utils.echo", "--msg", "hello")
    code, out, _ = _peak_rss_mb(root, "log", "--regex", regex, handle, limit=2 << 30)
    text = out.decode(errors="replace")
    assert code == 2, text
    assert "--regex" in text and repr(regex) in text and "repeat" in text, text


@pytest.mark.timeout(60)
def test_line_filter_compiles_only_risky_patterns_with_regex_and_bounds_them() -> None:
    """The library's filter: a plain pattern has no ``regex`` twin; a risky one within the bound
    has; one beyond it raises ValueError naming it."""
    from asynctorchx.logs._match import MAX_EXPANSION, LineFilter, check_log_filter

    plain = LineFilter(re.compile("a{99999999}"))
    assert plain._bounded is None
    small = LineFilter(re.compile("(a{1000}|b)+"))
    assert small._bounded is not None
    check_log_filter(re.compile(f"(a{{{MAX_EXPANSION // 2}}}|b)+"))
    with pytest.raises(ValueError, match=r"'\(a\{99999999\}\|b\)\+'"):
        LineFilter(re.compile("(a{99999999}|b)+"))


# -- describe: metadata; control characters ------------------------------------------------------


@pytest.mark.timeout(60)
def test_describe_json_keeps_the_app_metadata_on_the_fast_path(root: Path, comp: Path) -> None:
    """The record holds ``app.metadata``; ``describe --json`` printed ``"metadata": {}``."""
    handle = launch(root, f"{comp}:with_metadata")
    p = cli(root, "describe", "--json", handle)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["metadata"] == {"team": "ml", "ticket": "JIRA-7"}


@pytest.mark.timeout(60)
def test_describe_json_keeps_the_app_metadata_on_the_runner_path(root: Path, comp: Path) -> None:
    handle = launch(root, f"{comp}:with_metadata")
    p = cli(root, "describe", "--json", handle, ASYNCTORCHX_CLI_FASTPATH="0")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["metadata"] == {"team": "ml", "ticket": "JIRA-7"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fast", ["1", "0"])
def test_describe_shows_control_characters_escaped(root: Path, comp: Path, fast: str) -> None:
    """An argument holding ESC sequences or a line break is shown escaped in text (the terminal
    obeyed them); ``--json`` keeps the value itself."""
    handle = launch(root, f"{comp}:escape_codes")
    p = cli(root, "describe", handle, ASYNCTORCHX_CLI_FASTPATH=fast)
    assert p.returncode == 0, p.stderr
    assert b"\x1b" not in p.stdout and b"\\x1b[2J\\x1b[31mred" in p.stdout, p.stdout
    assert b"two\\nlines" in p.stdout, p.stdout
    doc = json.loads(cli(root, "describe", "--json", handle).stdout)
    assert doc["roles"][0]["args"] == ["\x1b[2J\x1b[31mred", "two\nlines"]


# -- run: values exec cannot take ----------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("fn", "field"), [("lone_surrogate_arg", "args[1]"), ("lone_surrogate_env", "env['E']")]
)
def test_a_lone_surrogate_is_refused_at_dry_run_naming_role_and_field(
    root: Path, comp: Path, fn: str, field: str
) -> None:
    """Like a NUL byte, a string with no bytes for exec is refused at the dry run naming the role
    and the field (the dry run passed; ``run`` failed with a bare codec error)."""
    for argv in (("run", "--dryrun", f"{comp}:{fn}"), ("run", f"{comp}:{fn}")):
        p = cli(root, *argv)
        err = p.stderr.decode(errors="replace")
        assert p.returncode == 2, (argv, err)
        assert "role 'r'" in err and field in err and "surrogate" in err, err
        assert "codec" not in err, err


@pytest.mark.timeout(60)
def test_surrogate_escapes_of_undecodable_bytes_still_run(root: Path, comp: Path) -> None:
    """U+DC80-U+DCFF stand for bytes that are not UTF-8 (``os.fsdecode``): they pass, as bytes."""
    handle = launch(root, f"{comp}:surrogate_escape")
    p = cli(root, "describe", handle, PYTHONIOENCODING="utf-8")
    assert p.returncode == 0, p.stderr
    assert b"a\xffb" in p.stdout, p.stdout


@pytest.mark.timeout(60)
def test_an_argument_longer_than_exec_takes_is_refused_at_dry_run(root: Path, comp: Path) -> None:
    """A 1 MB argument (a component's default) is refused at the dry run naming the role, the
    argument and the limit, exit 2 (the dry run passed; ``run`` exited 1)."""
    for argv in (("run", "--dryrun", f"{comp}:huge_arg"), ("run", f"{comp}:huge_arg")):
        p = cli(root, *argv)
        err = p.stderr.decode(errors="replace")
        assert p.returncode == 2, (argv, err)
        assert "role 'r'" in err and "args[1]" in err and "Argument list too long" in err, err


@pytest.mark.timeout(60)
def test_an_argument_list_too_long_for_exec_is_a_usage_error(root: Path, comp: Path) -> None:
    """80 arguments of 100 kB, each short enough, are too many together (E2BIG at the launch): an
    app that cannot be launched as given, exit 2 (it was 1)."""
    p = cli(root, "run", f"{comp}:many_args")
    err = p.stderr.decode(errors="replace")
    assert "Argument list too long" in err, err
    assert p.returncode == 2, (p.returncode, err)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["app", "role"])
def test_deeply_nested_metadata_is_a_clear_error(root: Path, comp: Path, where: str) -> None:
    """Metadata 5000 levels deep is refused at the dry run naming metadata, exit 2 (a bare
    RecursionError from copying it, exit 1); 50 levels pass."""
    p = cli(root, "run", "--dryrun", f"{comp}:nested", "--where", where)
    err = p.stderr.decode(errors="replace")
    assert p.returncode == 2, err
    assert "RecursionError" not in err and "metadata" in err, err
    if where == "role":
        assert "role 'r'" in err, err
    ok = cli(root, "run", "--dryrun", f"{comp}:nested", "--where", where, "--levels", "50")
    assert ok.returncode == 0, ok.stderr


@pytest.mark.timeout(60)
def test_options_after_double_dash_get_a_sensible_hint(root: Path) -> None:
    """``run utils.echo -- --msg x`` said "(--msg abbreviates --msg: give options in full)"."""
    p = cli(root, "run", "--dryrun", "utils.echo", "--", "--msg", "x")
    err = p.stderr.decode()
    assert p.returncode == 2, err
    assert "abbreviates" not in err, err
    assert "after '--' are read as positional arguments" in err and "--msg" in err, err
    abbreviated = cli(root, "run", "--dryrun", "utils.echo", "--ms", "x").stderr.decode()
    assert "--ms abbreviates --msg" in abbreviated, abbreviated


# -- an unusable state root ----------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fast", ["1", "0"])
@pytest.mark.parametrize("what", ["root", "records"])
def test_list_with_a_state_root_that_is_not_a_directory_names_it(
    tmp_path: Path, fast: str, what: str
) -> None:
    """A state root (or its records directory) that is a file: ``list`` said only
    "NotADirectoryError: [Errno 20] Not a directory: '.../.apps'"."""
    root = tmp_path / "root"
    if what == "root":
        root.write_text("x")
    else:
        root.mkdir()
        (root / ".apps").write_text("x")
    p = cli(root, "list", ASYNCTORCHX_CLI_FASTPATH=fast)
    err = p.stderr.decode()
    assert p.returncode == 1, err
    assert "NotADirectoryError" not in err, err
    assert f"cannot use the local state root {str(root)!r}" in err, err
    assert "ASYNCTORCHX_LOCAL_ROOT" in err, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fast", ["1", "0"])
@pytest.mark.parametrize("command", ["status", "describe", "cancel"])
def test_an_app_whose_records_directory_is_a_file_is_not_called_unknown(
    root: Path, fast: str, command: str
) -> None:
    """``.apps`` turned into a file: the app was "unknown ... never existed, or purged", exit 4."""
    handle = launch(root, "utils.echo", "--msg", "hi")
    shutil.rmtree(root / ".apps")
    (root / ".apps").write_text("x")
    p = cli(root, command, handle, ASYNCTORCHX_CLI_FASTPATH=fast)
    err = p.stderr.decode()
    assert p.returncode == 1, err
    assert "never existed" not in err and "ASYNCTORCHX_LOCAL_ROOT" in err, err
    assert err.count("cannot use the local state root") == 1, err


@pytest.fixture(scope="module")
def nobody_python() -> Iterator[tuple[str, str]]:
    """A python the user nobody can run (a bind mount of this interpreter's prefix, which may lie
    under a directory nobody cannot enter, as /root is) and its lib directory."""
    if not IS_ROOT:
        pytest.skip("needs root")
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))
    mnt = tempfile.mkdtemp(prefix="asynctorchx-pymnt-")
    os.chmod(mnt, 0o755)
    subprocess.run(["mount", "--bind", prefix, mnt], check=True)
    try:
        python = os.path.join(mnt, "bin", os.path.basename(os.path.realpath(sys.executable)))
        lib = os.path.join(mnt, "lib")
        probe = subprocess.run(
            [python, "-c", "import asynctorchx"],
            env={**env_for("/nonexistent"), "LD_LIBRARY_PATH": lib, "HOME": "/tmp"},
            cwd="/",
            preexec_fn=_as_nobody,
            capture_output=True,
            check=False,
        )
        if probe.returncode != 0:
            engine_missing(f"a python the user nobody can run ({probe.stderr[-200:]!r})")
        yield python, lib
    finally:
        subprocess.run(["umount", mnt], check=False)
        os.rmdir(mnt)


def _as_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


@pytest.fixture
def shared_root() -> Iterator[Path]:
    """A state root in a directory anyone can enter (pytest's tmp_path is private to root)."""
    base = tempfile.mkdtemp(prefix="asynctorchx-shared-")
    os.chmod(base, 0o755)
    root = Path(base) / "root"
    root.mkdir()
    try:
        yield root
    finally:
        shutil.rmtree(base, ignore_errors=True)


@needs_root
@pytest.mark.timeout(60)
@pytest.mark.parametrize("fast", ["1", "0"])
@pytest.mark.parametrize("command", ["status", "describe", "cancel", "list"])
def test_a_state_root_another_user_cannot_read_is_named(
    shared_root: Path, nobody_python: tuple[str, str], fast: str, command: str
) -> None:
    """root runs an app; the user nobody asks about it. Its record cannot be read (EACCES): the
    CLI said "unknown app ... (never existed, or purged)", exit 4, the warning printed twice
    (``list``: a bare PermissionError)."""
    python, lib = nobody_python
    handle = launch(shared_root, "utils.echo", "--msg", "hi", cwd="/tmp")
    argv = (command,) if command == "list" else (command, handle)
    p = cli(
        shared_root,
        *argv,
        cwd="/tmp",
        python=python,
        preexec=_as_nobody,
        LD_LIBRARY_PATH=lib,
        HOME="/tmp",
        ASYNCTORCHX_CLI_FASTPATH=fast,
    )
    err = p.stderr.decode()
    assert p.returncode == 1, err
    assert "never existed" not in err and "PermissionError" not in err, err
    assert err.count(f"cannot use the local state root {str(shared_root)!r}") == 1, err
    assert "Permission denied" in err and "cannot read app record" not in err, err


@needs_root
@pytest.mark.timeout(60)
def test_cancel_on_a_read_only_state_root_stops_the_app_and_says_why_it_may_read_failed(
    root: Path, tmp_path: Path
) -> None:
    """``cancel`` of a running app whose state root is read-only: its cancel marker cannot be
    written, but the app is stopped all the same (exit 0), with one warning that names the marker
    and says the app may then read FAILED. (It failed with a bare OSError naming the lock file,
    then with an error naming the state root, and the app ran on.)"""
    holder = subprocess.Popen(
        [sys.executable, "-m", "asynctorchx", "run", "utils.sh", "--", "sleep", "60"],
        env=env_for(root),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    mounted = False
    try:
        assert holder.stdout is not None
        handle = holder.stdout.readline().decode().strip()
        deadline = time.monotonic() + 30
        while b"RUNNING" not in cli(root, "status", handle).stdout:
            assert time.monotonic() < deadline, "the app never ran"
            time.sleep(0.05)
        subprocess.run(["mount", "--bind", "-o", "ro", str(root), str(root)], check=True)
        mounted = True
        p = cli(root, "cancel", handle)
        err = p.stderr.decode()
        assert p.returncode == 0, err
        assert "the cancel marker" in err and "Read-only file system" in err, err
        assert "may then read FAILED" in err and "Traceback" not in err, err
        holder.wait(20)  # its app ended: the launcher returns (else: 60 s)
    finally:
        if mounted:
            subprocess.run(["umount", str(root)], check=False)
        cli(root, "cancel", handle)
        try:
            holder.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()


# -- log output lost to a tiny full disk ---------------------------------------------------------


@needs_root
@pytest.mark.timeout(60)
def test_log_of_output_lost_to_a_tiny_full_disk_says_so_on_stderr(tmp_path: Path) -> None:
    """On a 64 KiB state root the status message counts the lost bytes, but the log has no room
    even for its marker line: ``log`` printed nothing at all and exited 0."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], check=True)
    try:
        script = 'head -c 200000 /dev/zero | tr "\\0" a; echo; echo done'
        handle = launch(mnt, "utils.sh", "--", "sh", "-c", script, cwd=tmp_path)
        status = cli(mnt, "status", handle, cwd=tmp_path)
        assert b"log output lost" in status.stdout, status.stdout
        p = cli(mnt, "log", handle, cwd=tmp_path)
        err = p.stderr.decode()
        assert p.returncode == 0, err
        assert "warning" in err and "log output lost" in err and "bytes of combined.log" in err
        assert b"log output lost" not in p.stdout  # stdout: the log's lines only
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.timeout(60)
def test_log_of_an_app_that_lost_nothing_warns_of_nothing(root: Path) -> None:
    handle = launch(root, "utils.echo", "--msg", "hello")
    p = cli(root, "log", handle)
    assert p.returncode == 0 and p.stderr == b"", p.stderr
    assert p.stdout.endswith(b"hello\n"), p.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("option", ["--since", "--until"])
def test_an_empty_time_bound_is_an_error_naming_it(root: Path, option: str) -> None:
    """``log --since ''`` (an unset shell variable) is refused naming the option, exit 2; it was
    taken as no bound at all, and the whole log printed."""
    handle = launch(root, "utils.echo", "--msg", "hello")
    p = cli(root, "log", option, "", handle)
    assert p.returncode == 2, p.stderr
    assert f"{option} '' is not a time".encode() in p.stderr, p.stderr
    assert p.stdout == b"", p.stdout
