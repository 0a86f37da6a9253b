"""The CLI against odd input and surroundings (found by review): handles of a '.' session, regexes
that do not compile without a syntax error, NaN and infinite values in JSON output, text stdout
cannot encode, a bad --timeout of cancel, FIFOs and directories in place of logs, log_dir paths
that loop or are too long, a .torchxconfig link loop, an unreachable engine, a huge --log_level.
Each runs the console entry point in a subprocess with a private state root and no config."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(90)


def env_for(root: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ASYNCTORCHX_", "TORCHX"))}
    env.update({"ASYNCTORCHX_LOCAL_ROOT": str(root), "TORCHXCONFIG": "", **extra})
    return env


def cli(
    root: Path, *args: str | bytes, cwd: Path | None = None, **extra: str
) -> subprocess.CompletedProcess[bytes]:
    argv = [os.fsencode(sys.executable), b"-m", b"asynctorchx", *(os.fsencode(a) for a in args)]
    return subprocess.run(
        argv,
        env=env_for(root, **extra),
        cwd=cwd or root.parent,
        capture_output=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def launch(root: Path, *run_args: str | bytes) -> str:
    """Runs a local app to its end (``run`` of a local app waits); returns its handle."""
    p = cli(root, "run", *run_args)
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    return p.stdout.decode().strip()


def strict_json(data: bytes) -> Any:
    def refuse(token: str) -> Any:
        raise ValueError(f"not JSON: {token}")

    return json.loads(data.decode("utf-8"), parse_constant=refuse)


@pytest.mark.parametrize("command", ["status", "describe"])
@pytest.mark.parametrize("session", ["..", "."])
def test_both_paths_refuse_a_dot_session(tmp_path: Path, command: str, session: str) -> None:
    """A handle whose session is '.' or '..' is refused by the fast path as by the runner's (the
    fast path answered it)."""
    root = tmp_path / "root"
    app_id = launch(root, "utils.echo", "--msg", "hi").rsplit("/", 1)[1]
    odd = f"local_cwd://{session}/{app_id}"
    fast = cli(root, command, odd)
    slow = cli(root, command, odd, ASYNCTORCHX_CLI_FASTPATH="0")
    assert slow.returncode == 2, slow.stderr
    assert (fast.returncode, fast.stdout, fast.stderr) == (
        slow.returncode,
        slow.stdout,
        slow.stderr,
    )


@pytest.mark.parametrize(
    "regex", ["a{99999999999}", "(" * 1000 + ")" * 1000], ids=["repeat", "nested"]
)
def test_a_regex_that_cannot_compile_is_a_usage_error(tmp_path: Path, regex: str) -> None:
    """A repetition count too large or groups nested too deep (OverflowError, RecursionError
    rather than re.error) are refused naming the regex, exit 2."""
    p = cli(tmp_path / "root", "log", "--regex", regex, "local_cwd://s/app-x")
    err = p.stderr.decode()
    assert p.returncode == 2, err
    assert "invalid log regex" in err and "Traceback" not in err, err


ODD_RESOURCES = """
from asynctorchx.specs import AppDef, Role, Resource
def odd(kind: str = "cap") -> AppDef:
    res = {"cpu": Resource(cpu=float("nan"), gpu=0, memMB=64),
           "mem": Resource(cpu=1, gpu=0, memMB=float("inf")),
           "cap": Resource(cpu=1, gpu=0, memMB=64, capabilities={"x": float("nan")})}[kind]
    return AppDef(name="odd", roles=[Role("r", image=".", entrypoint="true", resource=res)])
"""


@pytest.mark.parametrize("kind", ["cpu", "mem"])
def test_a_resource_that_is_not_a_finite_number_is_refused(tmp_path: Path, kind: str) -> None:
    """A role's cpu or memMB of NaN or infinity fails the run naming the field (exit 2)."""
    comp = tmp_path / "comp.py"
    comp.write_text(ODD_RESOURCES)
    p = cli(tmp_path / "root", "run", f"{comp}:odd", "--kind", kind)
    assert p.returncode == 2, p.stderr
    assert f"resource.{'memMB' if kind == 'mem' else 'cpu'}".encode() in p.stderr, p.stderr


@pytest.mark.parametrize("fast", ["1", "0"])
def test_describe_json_of_a_nan_capability_is_strict_json(tmp_path: Path, fast: str) -> None:
    """A NaN among a resource's capabilities is written as the string "NaN" (it was the bare token
    NaN, which JSON parsers refuse)."""
    root = tmp_path / "root"
    comp = tmp_path / "comp.py"
    comp.write_text(ODD_RESOURCES)
    handle = launch(root, f"{comp}:odd", "--kind", "cap")
    p = cli(root, "describe", "--json", handle, ASYNCTORCHX_CLI_FASTPATH=fast)
    assert p.returncode == 0, p.stderr
    doc = strict_json(p.stdout)
    assert doc["roles"][0]["resource"]["capabilities"] == {"x": "NaN"}


SURROGATE_NAME = """
from asynctorchx.specs import AppDef, Role
def sur() -> AppDef:
    return AppDef(name="bad\\ud800name", roles=[Role("r", image=".", entrypoint="true")])
"""


@pytest.mark.parametrize("fast", ["1", "0"])
def test_an_app_name_stdout_cannot_encode_does_not_break_list(tmp_path: Path, fast: str) -> None:
    """One app whose name holds a lone surrogate is listed with it escaped; the other apps are
    listed too (the command failed with a codec error and printed nothing)."""
    root = tmp_path / "root"
    good = launch(root, "utils.echo", "--msg", "hi")
    comp = tmp_path / "comp.py"
    comp.write_text(SURROGATE_NAME)
    launch(root, f"{comp}:sur")
    p = cli(root, "list", ASYNCTORCHX_CLI_FASTPATH=fast)
    assert p.returncode == 0, p.stderr
    assert good.encode() in p.stdout
    assert b"bad\\ud800name" in p.stdout


def test_describe_prints_an_argument_that_is_not_utf8_as_its_bytes(tmp_path: Path) -> None:
    """An argument holding a byte that is not UTF-8 is printed as that byte, on a strict UTF-8
    stdout (the command failed with a codec error)."""
    root = tmp_path / "root"
    handle = launch(root, "utils.sh", "--", "sh", "-c", b"echo \xff")
    p = cli(root, "describe", handle, PYTHONIOENCODING="utf-8")
    assert p.returncode == 0, p.stderr
    assert b"echo \xff" in p.stdout


def test_log_json_on_an_ascii_stdout_is_strict_json(tmp_path: Path) -> None:
    """``log --json`` on an ASCII stdout escapes what ASCII cannot hold as JSON does."""
    root = tmp_path / "root"
    handle = launch(root, "utils.echo", "--msg", "héllo")
    p = cli(root, "log", "--json", handle, PYTHONIOENCODING="ascii")
    assert p.returncode == 0, p.stderr
    lines = [strict_json(line) for line in p.stdout.splitlines()]
    assert [d["line"] for d in lines] == ["héllo"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--wait", "--timeout", "nan"], b"--timeout nan is not >= 0"),
        (["--wait", "--timeout", "-1"], b"--timeout -1 is not >= 0"),
        (["--timeout", "5"], b"--timeout 5 is given without --wait"),
    ],
)
def test_a_bad_cancel_timeout_is_refused_before_anything_is_cancelled(
    tmp_path: Path, args: list[str], message: bytes
) -> None:
    """``cancel --timeout`` that is not a number >= 0, or given without --wait, is refused naming
    it, and the app keeps running (it was cancelled, then the usage error came)."""
    root = tmp_path / "root"
    holder = subprocess.Popen(
        [sys.executable, "-m", "asynctorchx", "run", "utils.sh", "--", "sleep", "60"],
        env=env_for(root),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert holder.stdout is not None
        handle = holder.stdout.readline().decode().strip()
        deadline = time.monotonic() + 30
        while b"RUNNING" not in cli(root, "status", handle).stdout:
            assert time.monotonic() < deadline, "the app never ran"
            time.sleep(0.05)
        p = cli(root, "cancel", *args, handle)
        assert p.returncode == 2, p.stderr
        assert message in p.stderr, p.stderr
        assert b"RUNNING" in cli(root, "status", handle).stdout
    finally:
        cli(root, "cancel", handle)
        try:
            holder.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()


def _combined_log(root: Path, handle: str) -> Path:
    return root / "asynctorchx" / handle.rsplit("/", 1)[1] / "echo" / "0" / "combined.log"


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_log_file_that_is_not_a_regular_file_is_named(tmp_path: Path, kind: str) -> None:
    """A FIFO or a directory in place of a log file fails ``log`` naming the file (a FIFO blocked
    it for ever, even through SIGTERM; a directory gave "Is a directory" naming nothing)."""
    root = tmp_path / "root"
    handle = launch(root, "utils.echo", "--msg", "hi")
    log = _combined_log(root, handle)
    log.unlink()
    os.mkfifo(log) if kind == "fifo" else log.mkdir()
    p = cli(root, "log", handle)
    assert p.returncode == 1, p.stderr
    assert str(log).encode() in p.stderr and b"not a regular file" in p.stderr, p.stderr
    assert b"Traceback" not in p.stderr


@pytest.mark.parametrize("kind", ["loop", "too-long"])
def test_a_log_dir_that_loops_or_is_too_long_is_a_usage_error(tmp_path: Path, kind: str) -> None:
    """A log_dir that is a symbolic link loop, or whose name is too long, is an app that cannot be
    launched as given: exit 2 naming log_dir (exit 1 with a hint to look at a traceback)."""
    if kind == "loop":
        os.symlink("b", tmp_path / "a")
        os.symlink("a", tmp_path / "b")
        log_dir = tmp_path / "a"
    else:
        log_dir = tmp_path / ("x" * 300)
    p = cli(tmp_path / "root", "run", "-cfg", f"log_dir={log_dir}", "utils.echo")
    assert p.returncode == 2, p.stderr
    assert b"log_dir" in p.stderr and b"--debug" not in p.stderr, p.stderr


@pytest.mark.parametrize("command", ["status", "list"])
def test_a_config_link_loop_is_skipped(tmp_path: Path, command: str) -> None:
    """A .torchxconfig in the current directory that is a symbolic link loop is skipped like a
    dangling link (every command failed with a RuntimeError)."""
    root = tmp_path / "root"
    handle = launch(root, "utils.echo", "--msg", "hi")
    work = tmp_path / "work"
    work.mkdir()
    os.symlink(".torchxconfig", work / ".torchxconfig")
    env = env_for(root, HOME=str(tmp_path))
    del env["TORCHXCONFIG"]  # the current directory's config file applies
    args = [command, handle] if command == "status" else [command]
    p = subprocess.run(
        [sys.executable, "-m", "asynctorchx", *args],
        env=env,
        cwd=work,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    assert handle.encode() in p.stdout


def test_wait_with_an_unreachable_engine_prints_no_traceback(tmp_path: Path) -> None:
    """Status rounds failing against an engine that cannot be reached are said in one line, once
    (a traceback was printed every round)."""
    p = cli(
        tmp_path / "root",
        "wait",
        "--timeout",
        "3",
        "local_docker://s/app-x",
        DOCKER_HOST=f"unix://{tmp_path}/no-docker.sock",
    )
    err = p.stderr.decode()
    assert "Traceback" not in err, err
    assert err.count("status round for 1 local_docker apps failed") == 1, err


def test_a_huge_numeric_log_level_names_the_option(tmp_path: Path) -> None:
    """A --log_level of thousands of digits is refused naming the option (the message was
    Python's limit on integer conversions)."""
    p = cli(tmp_path / "root", "--log_level", "9" * 5000, "list")
    assert p.returncode == 2, p.stderr
    assert b"--log_level" in p.stderr, p.stderr


def test_a_torchxconfig_naming_no_file_is_a_usage_error(tmp_path: Path) -> None:
    """TORCHXCONFIG naming a file that does not exist is a configuration mistake: exit 2 with a
    hint, as for a config that does not parse (exit 1 and FileNotFoundError)."""
    p = cli(tmp_path / "root", "list", TORCHXCONFIG=str(tmp_path / "missing.ini"))
    assert p.returncode == 2, p.stderr
    assert b"TORCHXCONFIG=" in p.stderr and b"FileNotFoundError" not in p.stderr, p.stderr
