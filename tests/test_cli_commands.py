"""End-to-end tests of the ``asynctorchx`` console script: each test runs the real installed command
as a subprocess against the real local backend (child processes, log files, app records on disk).

Apps are launched from a component file written by the tests (two roles, every replica printing on
stdout and stderr), and the state root is private to the module, so that ``list`` sees only these apps.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from _docker_env import purge_app
from conftest import engine_missing

COMPONENT = '''
import asynctorchx.specs as specs


def job(script: str, workers: int = 2, ps: int = 1) -> specs.AppDef:
    """A trainer role and a ps role whose replicas run one shell script.

    Args:
        script: the shell script every replica runs
        workers: replicas of the trainer role
        ps: replicas of the ps role (0 for none)
    """
    def role(name: str, n: int) -> specs.Role:
        return specs.Role(
            name=name,
            image=".",
            entrypoint="sh",
            args=["-c", script],
            num_replicas=n,
            env={"ROLE": name, "REPLICA": specs.macros.replica_id},
        )

    roles = [role("trainer", workers)] + ([role("ps", ps)] if ps else [])
    return specs.AppDef(name="job", roles=roles)
'''

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _script() -> str:
    candidate = Path(sys.executable).parent / "asynctorchx"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("asynctorchx")
    if found is None:
        pytest.fail("the asynctorchx console script is not installed: pip install -e .")
    return found


class Cli:
    """Runs the console script in a directory with a private state root and no config file."""

    def __init__(self, cwd: Path, root: Path) -> None:
        self.script = _script()
        self.cwd = cwd
        # Bytecode caching stays on (as in any pip install), or every command recompiles the package.
        dropped = ("NO_COLOR", "FORCE_COLOR", "TERM", "PYTHONDONTWRITEBYTECODE")
        self.env = {k: v for k, v in os.environ.items() if k not in dropped}
        self.env.update(ASYNCTORCHX_LOCAL_ROOT=str(root), TORCHXCONFIG="")

    def env_with(self, **extra: str) -> dict[str, str]:
        return {**self.env, **extra}

    def __call__(
        self, *args: str, timeout: float = 30, **env: str
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.script, *args],
            cwd=self.cwd,
            env=self.env_with(**env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def many(
        self, *commands: tuple[str, ...], **env: str
    ) -> list[subprocess.CompletedProcess[str]]:
        """Runs several commands at once (they are independent); results in the same order."""
        procs = [self.popen(*args, **env) for args in commands]
        results = []
        for args, proc in zip(commands, procs, strict=True):
            try:
                out, err = proc.communicate(timeout=60)
            finally:
                proc.kill()
            results.append(
                subprocess.CompletedProcess([self.script, *args], proc.returncode, out, err)
            )
        return results

    def popen(self, *args: str, **env: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [self.script, *args],
            cwd=self.cwd,
            env=self.env_with(**env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def status(self, handle: str) -> dict[str, Any]:
        result = self("status", "--json", handle)
        assert result.returncode == 0, result.stderr
        data: dict[str, Any] = json.loads(result.stdout)
        return data

    def wait_running(self, handle: str, replicas: int, timeout: float = 20) -> list[int]:
        """Polls (bounded) until every replica runs; returns their pids."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.status(handle)
            pids = [r["pid"] for role in st["roles"] for r in role["replicas"]]
            if st["state"] == "RUNNING" and len(pids) == replicas and all(pids):
                return pids
            assert time.monotonic() < deadline, f"{handle} never ran all replicas: {st}"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    base = tmp_path_factory.mktemp("cli")
    (base / "comp.py").write_text(COMPONENT)
    yield Cli(base, base / "root")


def _one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def _live_members(pgids: list[int]) -> list[str]:
    """The processes (not zombies) in any of the process groups ``pgids``, as /proc stat lines."""
    wanted = {str(p) for p in pgids}
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, pgrp, ...
        if fields[2] in wanted and fields[0] not in ("Z", "X"):
            alive.append(stat.strip())
    return alive


def _wait_groups_gone(pgids: list[int], timeout: float = 15) -> None:
    """Polls (bounded) until no live process is left in the groups (zombies awaiting init are dead)."""
    deadline = time.monotonic() + timeout
    while alive := _live_members(pgids):
        assert time.monotonic() < deadline, f"processes survived: {alive}"
        time.sleep(0.05)


def _handle_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.endswith("\n") and "://" in line, line
    return line.strip()


# -- a finished app shared by the read-only commands ----------------------------------------------

SCRIPT_3_LINES = (
    'for i in 1 2 3; do echo "out $ROLE $REPLICA $i"; echo "err $ROLE $REPLICA $i" >&2; done'
)


@pytest.fixture(scope="module")
def finished(cli: Cli) -> str:
    """A succeeded app: trainer x2 and ps x1, each printing three stdout and three stderr lines."""
    result = cli("run", "comp.py:job", "--script", SCRIPT_3_LINES)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


# -- help and usage ---------------------------------------------------------------------------------


def test_help_lists_every_command(cli: Cli) -> None:
    """`asynctorchx --help` exits 0 and names every command and the exit codes."""
    result = cli("--help")
    assert result.returncode == 0
    for command in (
        "run",
        "status",
        "describe",
        "log",
        "wait",
        "cancel",
        "list",
        "runopts",
        "builtins",
        "tracker",
    ):
        assert re.search(rf"^\s+{command}\s", result.stdout, re.M), command
    assert "124" in result.stdout and "130" in result.stdout


def test_usage_errors_exit_2_with_one_line(cli: Cli) -> None:
    """A missing or unknown command, or an unknown option, is one error line and exit code 2."""
    for args in ((), ("frobnicate",), ("status", "--bogus", "x")):
        result = cli(*args)
        assert result.returncode == 2, args
        assert "error:" in result.stderr.splitlines()[-1]
    line = _one_error_line(cli("frobnicate").stderr)
    assert "invalid choice: 'frobnicate'" in line and "hint:" in line


def test_python_dash_m_runs_the_cli(cli: Cli) -> None:
    """`python -m asynctorchx` is the same command line."""
    result = subprocess.run(
        [sys.executable, "-m", "asynctorchx", "--version"],
        capture_output=True,
        text=True,
        check=False,
        env=cli.env,
        timeout=30,
    )
    assert result.returncode == 0 and result.stdout.startswith("asynctorchx ")


# -- run ------------------------------------------------------------------------------------------


def test_run_prints_the_handle_alone_and_exits_0(cli: Cli, finished: str) -> None:
    """`run` prints only the handle on stdout; the local app has ended (SUCCEEDED) when it returns."""
    assert re.fullmatch(r"local_cwd://asynctorchx/job-[a-z0-9]+", finished)
    assert cli.status(finished)["state"] == "SUCCEEDED"


def test_run_exits_1_when_the_app_fails(cli: Cli) -> None:
    """A failed app makes `run` exit 1 and print the failing replica's exit code on stderr."""
    result = cli("run", "comp.py:job", "--workers", "1", "--ps", "0", "--script", "exit 3")
    assert result.returncode == 1
    assert result.stdout.count("\n") == 1
    assert "FAILED" in result.stderr and "exit code: 3" in result.stderr


def test_run_log_prefixes_every_line_of_every_replica(cli: Cli) -> None:
    """`run --log` prints each replica's lines as 'role/replica | line' (stderr: '!'), aligned."""
    result = cli("run", "--log", "comp.py:job", "--workers", "2", "--script", SCRIPT_3_LINES)
    assert result.returncode == 0, result.stderr
    handle = result.stdout.strip()
    lines = result.stderr.splitlines()
    assert lines[0].startswith(f"launched {handle}")
    assert lines[-1] == f"{handle} SUCCEEDED"
    log_lines = lines[1:-1]
    expected = set()
    for role, k in (("trainer", 0), ("trainer", 1), ("ps", 0)):
        label = f"{role}/{k}".ljust(len("trainer/0"))
        for i in (1, 2, 3):
            expected.add(f"{label} | out {role} {k} {i}")
            expected.add(f"{label} ! err {role} {k} {i}")
    assert sorted(log_lines) == sorted(expected)
    for role, k in (("trainer", 0), ("trainer", 1), ("ps", 0)):
        for stream in ("out", "err"):
            mine = [ln for ln in log_lines if f" {stream} {role} {k} " in ln]
            assert [ln[-1] for ln in mine] == ["1", "2", "3"], mine
    assert not ANSI.search(result.stderr)


def test_run_dryrun_prints_the_request_and_launches_nothing(cli: Cli) -> None:
    """`run --dryrun` prints each replica's command and log directory; no app appears."""
    before = json.loads(cli("list", "--json").stdout)
    result = cli("run", "--dryrun", "comp.py:job", "--workers", "1", "--script", "echo hi")
    assert result.returncode == 0, result.stderr
    assert "cmd: sh -c" in result.stdout and "echo hi" in result.stdout
    assert "replica 0:" in result.stdout and "log_dir:" in result.stdout
    assert json.loads(cli("list", "--json").stdout) == before


def test_run_component_help_exits_0(cli: Cli) -> None:
    """`run COMPONENT --help` prints the component's arguments and launches nothing."""
    result = cli("run", "comp.py:job", "--help")
    assert result.returncode == 0
    assert "--script SCRIPT" in result.stdout and "--workers WORKERS" in result.stdout


def test_torchxconfig_defaults_apply_and_explicit_cfg_wins(cli: Cli, tmp_path: Path) -> None:
    """[cli:run] gives the component and scheduler; [local_cwd] gives cfg that -cfg overrides."""
    config = tmp_path / "cfg.ini"
    config.write_text(
        "[cli:run]\ncomponent = utils.echo\n\n[local_cwd]\ncancel_grace_period = 1.5\n"
    )
    result = cli("run", "--dryrun", TORCHXCONFIG=str(config))
    assert result.returncode == 0, result.stderr
    assert "grace_period: 1.5s" in result.stdout and "cmd: echo hello world" in result.stdout
    result = cli(
        "run",
        "--dryrun",
        "-cfg",
        "cancel_grace_period=2",
        "--",
        "--msg",
        "yo",
        TORCHXCONFIG=str(config),
    )
    assert "grace_period: 2.0s" in result.stdout and "cmd: echo yo" in result.stdout
    config.write_text("[cli:run]\nscheduler = nosuchscheduler\n")
    result = cli("run", "utils.echo", TORCHXCONFIG=str(config))
    assert result.returncode == 2
    assert "unknown scheduler 'nosuchscheduler'" in _one_error_line(result.stderr)


def test_unknown_cli_run_key_warns(cli: Cli, tmp_path: Path) -> None:
    """A [cli:run] key run does not read (a typo of workspace) is warned about once, not ignored."""
    config = tmp_path / "cfg.ini"
    config.write_text("[cli:run]\ncomponent = utils.echo\nworksapce = /nowhere\n")
    result = cli("run", "--dryrun", TORCHXCONFIG=str(config))
    assert result.returncode == 0, result.stderr
    warned = [line for line in result.stderr.splitlines() if "warning:" in line]
    assert len(warned) == 1, result.stderr
    assert "[cli:run] worksapce = /nowhere is not an option of run" in warned[0]
    assert "did you mean 'workspace'?" in warned[0]


# -- Ctrl+C ---------------------------------------------------------------------------------------


def test_ctrl_c_cancels_a_local_app_with_no_survivor(cli: Cli) -> None:
    """SIGINT to `run` cancels the local app: exit 130, state CANCELLED, every process group gone."""
    proc = cli.popen("run", "--log", "comp.py:job", "--script", "echo start; sleep 60 & wait")
    try:
        handle = _handle_line(proc)
        pids = cli.wait_running(handle, 3)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert f"cancelling {handle}" in stderr and f"{handle} CANCELLED" in stderr
    _wait_groups_gone(pids, timeout=1)
    assert cli.status(handle)["state"] == "CANCELLED"


@pytest.mark.parametrize("dryrun", [True, False], ids=["dryrun", "run"])
def test_ctrl_c_interrupts_a_component_file_that_loops_at_import(
    cli: Cli, tmp_path: Path, dryrun: bool
) -> None:
    """A first SIGINT ends `run` with 130 while a component file's import never returns."""
    started = tmp_path / "importing"
    path = tmp_path / "loops.py"
    path.write_text(
        "import pathlib\n"
        "from asynctorchx.specs import AppDef\n"
        "def comp() -> AppDef:\n"
        "    return AppDef('x')\n"
        f"pathlib.Path({str(started)!r}).touch()\n"
        "while True:\n"
        "    pass\n"
    )
    proc = cli.popen("run", *(["--dryrun"] if dryrun else []), f"{path}:comp")
    try:
        deadline = time.monotonic() + 30
        while not started.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the file was never imported"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert "interrupted again" not in stderr


def test_second_ctrl_c_exits_at_once_and_leaves_no_survivor(cli: Cli) -> None:
    """A second SIGINT exits 130 at once, even while replicas ignore SIGTERM; none survives."""
    proc = cli.popen(
        "run",
        "-cfg",
        "cancel_grace_period=4",
        "comp.py:job",
        "--workers",
        "1",
        "--ps",
        "0",
        "--script",
        "trap '' TERM; echo start; sleep 60",
    )
    try:
        handle = _handle_line(proc)
        pids = cli.wait_running(handle, 1)
        proc.send_signal(signal.SIGINT)
        assert proc.stderr is not None
        for line in proc.stderr:
            if line.startswith("cancelling"):
                break
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=3)  # well before the 4 s grace period a cancel would wait for
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == 130
    _wait_groups_gone(pids, timeout=15)


# -- status, describe, list, log, wait, cancel ------------------------------------------------------


def test_status_text_and_json(cli: Cli, finished: str) -> None:
    """`status` prints the state and each replica; --json parses with state and roles."""
    text = cli("status", finished)
    assert text.returncode == 0
    assert text.stdout.splitlines()[0] == finished
    assert "State: SUCCEEDED" in text.stdout and "trainer[1] SUCCEEDED" in text.stdout
    data = cli.status(finished)
    assert data["handle"] == finished and data["state"] == "SUCCEEDED"
    assert [(r["role"], len(r["replicas"])) for r in data["roles"]] == [("trainer", 2), ("ps", 1)]


def test_describe_text_and_json(cli: Cli, finished: str) -> None:
    """`describe` shows each role's command and replicas; --json parses with the roles."""
    text = cli("describe", finished)
    assert text.returncode == 0, text.stderr
    assert "role trainer (2 replicas)" in text.stdout and "role ps (1 replica)" in text.stdout
    data = json.loads(cli("describe", "--json", finished).stdout)
    assert data["handle"] == finished and data["state"] == "SUCCEEDED"
    trainer = data["roles"][0]
    assert trainer["name"] == "trainer" and trainer["num_replicas"] == 2
    assert trainer["entrypoint"] == "sh" and trainer["args"] == ["-c", SCRIPT_3_LINES]


def test_list_table_and_json_include_apps_of_other_processes(cli: Cli, finished: str) -> None:
    """`list` shows apps launched by other processes; --json has handle, app_id, state and name."""
    rows = json.loads(cli("list", "-s", "local_cwd", "--json").stdout)
    mine = [r for r in rows if r["handle"] == finished]
    assert mine == [
        {
            "handle": finished,
            "app_id": finished.rsplit("/", 1)[1],
            "state": "SUCCEEDED",
            "name": "job",
        }
    ]
    table = cli("list").stdout.splitlines()
    assert table[0].split() == ["HANDLE", "STATE", "NAME"]
    assert any(line.split() == [finished, "SUCCEEDED", "job"] for line in table[1:])


def test_log_prints_every_replica_or_the_selected_ones(cli: Cli, finished: str) -> None:
    """`log HANDLE` prefixes all replicas' lines; HANDLE/ROLE/IDS and --streams select."""
    everything, one, two = (
        r.stdout.splitlines()
        for r in cli.many(
            ("log", finished),
            ("log", "--streams", "stderr", f"{finished}/trainer/1"),
            ("log", "--streams", "stdout", f"{finished}/trainer/0,1"),
        )
    )
    assert len(everything) == 18
    assert "trainer/0 | out trainer 0 1" in everything and "ps/0      | err ps 0 3" in everything
    assert one == [f"trainer/1 ! err trainer 1 {i}" for i in (1, 2, 3)]
    assert two == [f"trainer/{k} | out trainer {k} {i}" for k in (0, 1) for i in (1, 2, 3)]


def test_log_json_lines_parse(cli: Cli, finished: str) -> None:
    """`log --json` prints one object per line with handle, role, replica, stream and line."""
    result = cli("log", "--json", "--streams", "stdout", f"{finished}/ps")
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert records == [
        {
            "handle": finished,
            "role": "ps",
            "replica": 0,
            "stream": "stdout",
            "line": f"out ps 0 {i}",
        }
        for i in (1, 2, 3)
    ]


def test_log_since_until_and_regex(cli: Cli) -> None:
    """--since/--until (ISO and relative) cut the log by time, --regex by content."""
    result = cli(
        "run",
        "comp.py:job",
        "--workers",
        "1",
        "--ps",
        "0",
        "--script",
        'echo "first $(date +%s.%N)"; sleep 1; echo second',
    )
    handle = result.stdout.strip()
    first = cli("log", handle).stdout.splitlines()[0]
    written = float(first.split()[-1])
    middle = datetime.fromtimestamp(written + 0.5).isoformat()
    since, until, regex, since_rel, until_rel, bad = cli.many(
        ("log", "--since", middle, handle),
        ("log", "--until", middle, handle),
        ("log", "--regex", "^sec", handle),
        ("log", "--since", "1h", handle),
        ("log", "--until", "1h", handle),
        ("log", "--since", "2h", "--until", "3h", handle),
    )
    assert since.stdout == "trainer/0 | second\n"
    assert until.stdout == f"{first}\n"
    assert regex.stdout == "trainer/0 | second\n"
    assert since_rel.stdout.count("\n") == 2
    assert until_rel.returncode == 0 and until_rel.stdout == ""
    assert bad.returncode == 2 and "is after --until" in _one_error_line(bad.stderr)


def test_log_follow_prints_until_the_app_ends(cli: Cli) -> None:
    """`log -f` from another process prints lines as they come and returns when the app ends."""
    proc = cli.popen(
        "run",
        "comp.py:job",
        "--workers",
        "1",
        "--ps",
        "0",
        "--script",
        "echo a; sleep 1; echo b",
    )
    try:
        handle = _handle_line(proc)
        follow = cli("log", "-f", handle)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.communicate()
    assert follow.returncode == 0
    assert follow.stdout.splitlines() == ["trainer/0 | a", "trainer/0 | b"]


def test_colours_follow_force_color_and_no_color(cli: Cli, finished: str) -> None:
    """Piped output is plain; FORCE_COLOR adds colours; NO_COLOR wins over FORCE_COLOR."""
    target = f"{finished}/trainer/0"
    plain = cli.many(("log", target))[0].stdout
    forced = cli.many(("log", target), FORCE_COLOR="1")[0].stdout
    both = cli.many(("log", target), FORCE_COLOR="1", NO_COLOR="1")[0].stdout
    assert plain and not ANSI.search(plain)
    assert "\x1b[36mtrainer/0\x1b[0m" in forced
    assert ANSI.sub("", forced) == plain
    assert both == plain


def test_cancel_from_another_process_ends_run_with_3_and_wait_reports_it(cli: Cli) -> None:
    """`cancel` stops an app that another `run` owns: that run exits 3; `wait` exits 3 and 124."""
    proc = cli.popen("run", "comp.py:job", "--workers", "1", "--ps", "0", "--script", "sleep 60")
    try:
        handle = _handle_line(proc)
        pids = cli.wait_running(handle, 1)
        assert proc.poll() is None  # a local app keeps `run` alive
        timed_out = cli("wait", "--timeout", "0.3", handle)
        assert timed_out.returncode == 124, timed_out.stderr
        assert "RUNNING" in timed_out.stdout and "timed out" in timed_out.stderr
        cancelled = cli("cancel", handle)
        assert cancelled.returncode == 0, cancelled.stderr
        assert proc.wait(timeout=30) == 3
    finally:
        proc.kill()
        proc.communicate()
    _wait_groups_gone(pids, timeout=1)
    waited = cli("wait", handle)
    assert waited.returncode == 3 and waited.stdout.split()[1:] == [handle, "CANCELLED"]
    again = cli("cancel", handle)
    assert again.returncode == 0 and "already ended" in again.stderr


def test_wait_many_prints_transitions_and_exits_with_the_worst(cli: Cli, finished: str) -> None:
    """`wait` on several apps prints a line per change and exits with the worst state's code."""
    failed = cli("run", "comp.py:job", "--workers", "1", "--ps", "0", "--script", "exit 2")
    failed_handle = failed.stdout.strip()
    result = cli("wait", finished, failed_handle)
    assert result.returncode == 1
    states = {line.split()[1]: line.split()[2] for line in result.stdout.splitlines()}
    assert states == {finished: "SUCCEEDED", failed_handle: "FAILED"}
    assert cli("wait", finished).returncode == 0
    unknown = cli("wait", finished, "local_cwd://asynctorchx/job-nosuchapp")
    assert unknown.returncode == 4
    events = [json.loads(x) for x in cli("wait", "--json", finished).stdout.splitlines()]
    assert events[-1]["handle"] == finished and events[-1]["state"] == "SUCCEEDED"


def _read_line(proc: subprocess.Popen[str], timeout: float = 30) -> str:
    """The next line of ``proc``'s stdout, waiting at most ``timeout`` seconds for it."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        assert sel.select(timeout), f"no line from {proc.args} within {timeout}s"
    return proc.stdout.readline()


def _transition(line: str) -> list[str]:
    """``HH:MM:SS HANDLE STATE`` -> [HANDLE, STATE], checking the clock field."""
    clock, *rest = line.split()
    assert re.fullmatch(r"\d\d:\d\d:\d\d", clock), line
    return rest


@pytest.mark.parametrize(
    ("end", "state", "code"),
    [("finish", "SUCCEEDED", 0), ("cancel", "CANCELLED", 3)],
)
def test_wait_on_a_running_app_prints_the_transition(
    cli: Cli, tmp_path: Path, end: str, state: str, code: int
) -> None:
    """`wait` on a RUNNING app prints the RUNNING line, then the final state's line when the app
    ends (by itself or cancelled by `cancel`), and exits with that state's code."""
    go = tmp_path / "go"
    script = f'while [ ! -e "{go}" ]; do sleep 0.01; done'
    run = cli.popen("run", "comp.py:job", "--workers", "1", "--ps", "0", "--script", script)
    waiter = None
    try:
        handle = _handle_line(run)
        pids = cli.wait_running(handle, 1)
        waiter = cli.popen("wait", handle)
        assert _transition(_read_line(waiter)) == [handle, "RUNNING"]
        assert waiter.poll() is None  # still waiting: the app has not ended
        if end == "finish":
            go.touch()
        else:
            cancelled = cli("cancel", handle)
            assert cancelled.returncode == 0, cancelled.stderr
        out, err = waiter.communicate(timeout=30)
        assert waiter.returncode == code, err
        assert [_transition(line) for line in out.splitlines()] == [[handle, state]]
        assert run.wait(timeout=30) == code
    finally:
        for proc in (run, waiter):
            if proc is not None:
                proc.kill()
                proc.communicate()
    _wait_groups_gone(pids, timeout=5)
    assert cli.status(handle)["state"] == state


def test_run_wait_exit_code_matches_the_state(cli: Cli) -> None:
    """`run --wait` on local_cwd exits 0 when the app succeeds and 1 when it fails."""
    ok, bad = cli.many(
        ("run", "--wait", "comp.py:job", "--workers", "1", "--ps", "0", "--script", "true"),
        ("run", "--wait", "comp.py:job", "--workers", "2", "--ps", "0", "--script", "exit 5"),
    )
    assert ok.returncode == 0, ok.stderr
    assert bad.returncode == 1, bad.stderr
    for result, state in ((ok, "SUCCEEDED"), (bad, "FAILED")):
        handle = result.stdout.strip()
        assert result.stdout == f"{handle}\n"  # the handle alone on stdout
        assert cli.status(handle)["state"] == state
    assert "FAILED" in bad.stderr and "exit code: 5" in bad.stderr


# -- errors ---------------------------------------------------------------------------------------


NO_APP = "local_cwd://asynctorchx/job-nosuchapp"

UNKNOWN_APPS = [
    (("status", NO_APP), f"unknown app {NO_APP!r}"),
    (("describe", NO_APP), "unknown app"),
    (("cancel", NO_APP), "unknown app"),
    (("log", "-f", NO_APP), "unknown app"),
]

UNKNOWN_NAMES = [
    (("status", "not-a-handle"), "'not-a-handle' is not an app handle"),
    (("status", "nosuch://asynctorchx/app"), "unknown scheduler 'nosuch'"),
    (("run", "-s", "nosuch", "utils.echo"), "unknown scheduler 'nosuch'; available: "),
    (("list", "-s", "nosuch"), "unknown scheduler 'nosuch'"),
    (("runopts", "nosuch"), "unknown scheduler 'nosuch'"),
    (("run", "utils.ecko"), "unknown component 'utils.ecko'; did you mean 'utils.echo'"),
    (("builtins", "--print", "utils.ecko"), "unknown component 'utils.ecko'"),
]

BAD_INPUT = [
    (("run", "-cfg", "nosuchopt=1", "utils.echo"), "'nosuchopt' is not a run option of local_cwd"),
    (("run", "-cfg", "cancel_grace_period=soon", "utils.echo"), "'cancel_grace_period'"),
    (("run", "comp.py:job"), "required: --script"),
    (("run",), "no component given"),
    (("log", "--since", "yesterday", NO_APP), "--since 'yesterday' is not a time"),
    (("log", "--regex", "(", NO_APP), "invalid log regex"),
]


def _check_errors(cli: Cli, cases: list[tuple[tuple[str, ...], str]], code: int) -> None:
    results = cli.many(*(args for args, _ in cases))
    for (args, message), result in zip(cases, results, strict=True):
        assert result.returncode == code, (args, result.stderr)
        line = _one_error_line(result.stderr)
        assert message in line and "hint:" in line, (args, line)
        assert result.stdout == "", args


def test_unknown_apps_exit_4_with_one_line(cli: Cli) -> None:
    """status/describe/cancel/log of an app its scheduler does not know: exit 4, one line, a hint."""
    _check_errors(cli, UNKNOWN_APPS, 4)


def test_unknown_handles_schedulers_and_components_exit_2_with_one_line(cli: Cli) -> None:
    """A malformed handle, an unknown scheduler or component: exit 2, one line naming it, a hint."""
    _check_errors(cli, UNKNOWN_NAMES, 2)


def test_bad_input_exits_2_with_one_line(cli: Cli) -> None:
    """Bad -cfg keys and values, component arguments, times and regexes: exit 2, one line, a hint."""
    _check_errors(cli, BAD_INPUT, 2)


def test_log_unknown_role_or_replica_fails_fast(cli: Cli, finished: str) -> None:
    """An unknown role or replica id is exit 2 with the app's roles or replica range."""
    role = cli("log", f"{finished}/nosuchrole")
    assert role.returncode == 2
    assert "has no role 'nosuchrole' (roles: trainer, ps)" in _one_error_line(role.stderr)
    replica = cli("log", f"{finished}/trainer/7")
    assert replica.returncode == 2
    assert "has no replica 7 (its replicas: 0-1)" in _one_error_line(replica.stderr)


def test_debug_shows_the_traceback(cli: Cli) -> None:
    """--debug prints the traceback before the one-line error."""
    result = cli("status", "--debug", "not-a-handle")
    assert result.returncode == 2
    assert "Traceback" in result.stderr and "MalformedAppHandleException" in result.stderr


# -- runopts, builtins ----------------------------------------------------------------------------


def test_runopts_lists_schedulers_and_their_options(cli: Cli) -> None:
    """`runopts` lists every scheduler; `runopts local_cwd` its options with types and defaults."""
    every = cli("runopts")
    assert every.returncode == 0
    for name in ("local_cwd:", "local_dir:", "local_docker:", "slurm:", "kubernetes:"):
        assert name in every.stdout
    one = cli("runopts", "local_cwd")
    assert one.returncode == 0 and one.stdout.startswith("local_cwd:")
    assert "cancel_grace_period=CANCEL_GRACE_PERIOD (float, 5.0)" in one.stdout


def test_builtins_lists_components_and_prints_one(cli: Cli) -> None:
    """`builtins` lists the builtin components; --print shows one's source."""
    listing = cli("builtins")
    assert listing.returncode == 0
    names = [line.split()[0] for line in listing.stdout.splitlines()[1:]]
    for name in ("utils.echo", "utils.sh", "dist.ddp", "dist.spmd"):
        assert name in names
    source = cli("builtins", "--print", "utils.echo")
    assert source.returncode == 0 and "\ndef echo(" in source.stdout


# -- a backend whose apps outlive the CLI --------------------------------------------------------


BUSYBOX_IMAGE = "asynctorchx-test/busybox:latest"


@pytest.fixture
def busybox_image() -> str:
    """The busybox image scripts/engines/docker.sh builds, on a running Docker engine."""
    docker = shutil.which("docker")
    if docker is None:
        engine_missing("the docker client (run `bash scripts/engines/docker.sh`)")
    probe = subprocess.run(
        [str(docker), "image", "inspect", BUSYBOX_IMAGE],
        capture_output=True,
        timeout=30,
        check=False,
    )
    if probe.returncode != 0:
        engine_missing(
            f"a Docker engine with {BUSYBOX_IMAGE} (run `bash scripts/engines/docker.sh`)"
        )
    return BUSYBOX_IMAGE


@pytest.mark.docker
def test_ctrl_c_detaches_from_a_docker_app(cli: Cli, busybox_image: str) -> None:
    """On local_docker, Ctrl+C during `run --wait` detaches (exit 130); the app keeps running."""
    proc = cli.popen(
        "run",
        "-s",
        "local_docker",
        "-cfg",
        "stop_timeout=1",
        "--wait",
        "utils.binary",
        "--image",
        busybox_image,
        "--entrypoint",
        "sleep",
        "--",
        "60",
    )
    handle = ""
    try:
        handle = _handle_line(proc)
        deadline = time.monotonic() + 30
        while cli.status(handle)["state"] != "RUNNING":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 130, stderr
        assert f"detached from {handle}" in stderr and f"asynctorchx cancel {handle}" in stderr
        assert cli.status(handle)["state"] == "RUNNING"
    finally:
        proc.kill()
        if handle:
            cli("cancel", "--wait", handle, timeout=60)
            asyncio.run(purge_app(handle.rsplit("/", 1)[1]))  # (the CLI's session is shared)
