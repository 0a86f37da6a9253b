"""Unit tests of the CLI's pure parts: times, log targets, prefixes, colour rules, exit codes, signals.

The commands themselves are tested end to end through the real console script in the other
``test_cli_*`` modules.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from asynctorchx.cli._common import parse_time
from asynctorchx.cli._errors import (
    CliError,
    ExitCode,
    classify,
    exit_code_for_state,
    worst_exit_code,
)
from asynctorchx.cli._interrupt import Interrupted, Interrupts
from asynctorchx.cli._logs import LogPrinter, app_replicas
from asynctorchx.cli._output import Styler, colour_enabled
from asynctorchx.cli.cmd_log import LogTarget, ReplicaRange, parse_target
from asynctorchx.specs.api import AppState, MalformedAppHandleException, UnknownAppException


class _Tty(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def test_relative_times_count_back_from_now() -> None:
    """'30s', '10m', '2h', '1h30m' and '1d' mean that long before now."""
    now = datetime(2024, 5, 1, 12, 0, 0)
    assert parse_time("30s", "--since", now) == now - timedelta(seconds=30)
    assert parse_time("10m", "--since", now) == now - timedelta(minutes=10)
    assert parse_time("2h", "--since", now) == now - timedelta(hours=2)
    assert parse_time("1h30m", "--since", now) == now - timedelta(minutes=90)
    assert parse_time("1d", "--since", now) == now - timedelta(days=1)


def test_absolute_times_are_iso_8601_naive_local_or_with_an_offset() -> None:
    """A naive ISO time is local time as is; one with an offset (or Z) is converted to local time."""
    assert parse_time("2024-05-01T12:00:00", "--since") == datetime(2024, 5, 1, 12, 0, 0)
    utc = parse_time("2024-05-01T12:00:00Z", "--since")
    expected = datetime(2024, 5, 1, 12, tzinfo=timezone.utc).astimezone().replace(tzinfo=None)
    assert utc == expected
    assert parse_time("2024-05-01 12:00:00.250+00:00", "--until").microsecond == 250000


def test_a_bad_time_names_the_option_and_the_value() -> None:
    """A value that is neither relative nor ISO raises CliError naming the option and the value."""
    with pytest.raises(CliError, match=r"--until 'yesterday' is not a time"):
        parse_time("yesterday", "--until")


@pytest.mark.parametrize(
    "text",
    [
        "99999999999d",
        "1000000000d",
        "3000000w",
        "9" * 30 + "ms",
        "0001-01-01",
        "0001-01-01T00:00+05:00",
    ],
)
def test_a_time_out_of_range_names_the_option_and_the_value(text: str) -> None:
    """A relative time reaching before year 1, or an ISO time at its edge, raises CliError naming
    the option and the value (not an OverflowError)."""
    with pytest.raises(CliError, match=rf"^--since '{re.escape(text)}' is out of range \("):
        parse_time(text, "--since")


def test_log_target_splits_handle_role_and_replicas() -> None:
    """HANDLE[/ROLE[/REPLICA,...]] accepts ids and ranges, and a bare handle."""
    h = "local_cwd://sess/app-1"
    assert parse_target(h) == LogTarget(h, None, None)
    assert parse_target(f"{h}/trainer") == LogTarget(h, "trainer", None)
    ranges = [ReplicaRange(0, 0), ReplicaRange(2, 3)]
    assert parse_target(f"{h}/trainer/0,2-3") == LogTarget(h, "trainer", ranges)
    assert parse_target("local_cwd:///app") == LogTarget("local_cwd:///app", None, None)


def test_log_target_rejects_bad_replica_ids() -> None:
    """A replica that is not an id or a range is a usage error naming it."""
    with pytest.raises(CliError, match="replica 'x'"):
        parse_target("local_cwd://s/a/trainer/x")
    with pytest.raises(CliError, match="is not HANDLE"):
        parse_target("not-a-handle")


def test_log_prefixes_are_aligned_and_mark_stderr() -> None:
    """Plain prefixes are padded to the longest label; stderr lines get '!' and others '|'."""
    replicas = app_replicas([("trainer", 2), ("ps", 1)])
    out = _Tty(False)
    printer = LogPrinter("h", replicas, out)
    printer.write(replicas[0], "stdout", "a\n")
    printer.write(replicas[2], "stderr", "b\n")
    printer.write(replicas[1], None, "c")
    assert out.getvalue().splitlines() == ["trainer/0 | a", "ps/0      ! b", "trainer/1 | c"]


def test_log_prefix_colours_are_stable_per_replica_and_only_when_enabled() -> None:
    """With colour on, each replica's label gets its own colour by position; escapes never pad."""
    replicas = app_replicas([("a", 2)])
    out = _Tty(True)
    printer = LogPrinter("h", replicas, out)
    printer.style = Styler(out, enabled=True)
    printer.write(replicas[0], "stdout", "x\n")
    printer.write(replicas[1], "stdout", "y\n")
    first, second = out.getvalue().splitlines()
    assert first.startswith("\x1b[36ma/0\x1b[0m ") and first.endswith(" x")
    assert second.startswith("\x1b[35ma/1\x1b[0m ")


def test_log_json_lines_carry_handle_role_replica_stream_and_line() -> None:
    """--json writes one object per line without the trailing newline in 'line'."""
    replicas = app_replicas([("trainer", 1)])
    out = _Tty(False)
    LogPrinter("local_cwd://s/a", replicas, out, as_json=True).write(replicas[0], "stderr", "é\n")
    assert json.loads(out.getvalue()) == {
        "handle": "local_cwd://s/a",
        "role": "trainer",
        "replica": 0,
        "stream": "stderr",
        "line": "é",
    }


@pytest.mark.parametrize(
    ("env", "tty", "expected"),
    [
        ({}, True, True),
        ({}, False, False),
        ({"NO_COLOR": "1"}, True, False),
        ({"FORCE_COLOR": "1"}, False, True),
        ({"FORCE_COLOR": "0"}, False, False),
        ({"NO_COLOR": "1", "FORCE_COLOR": "1"}, True, False),
        ({"TERM": "dumb"}, True, False),
    ],
)
def test_colour_rules(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], tty: bool, expected: bool
) -> None:
    """Colour is on for a TTY; NO_COLOR wins over FORCE_COLOR, which wins over the TTY test."""
    for key in ("NO_COLOR", "FORCE_COLOR", "TERM"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert colour_enabled(_Tty(tty)) is expected


def test_exit_codes_of_states_and_the_worst_of_several() -> None:
    """Final states map to 0/1/3, anything else to 4; the worst is UNKNOWN > FAILED > CANCELLED."""
    assert exit_code_for_state(AppState.SUCCEEDED) == 0
    assert exit_code_for_state(AppState.FAILED) == 1
    assert exit_code_for_state(AppState.CANCELLED) == 3
    assert exit_code_for_state(AppState.RUNNING) == 4
    assert exit_code_for_state(None) == 4
    assert worst_exit_code([0, 3, 1, 0]) == 1
    assert worst_exit_code([0, 3]) == 3
    assert worst_exit_code([1, 4]) == 4
    assert worst_exit_code([]) == 0


def test_library_errors_become_one_line_with_a_hint_and_a_code() -> None:
    """Known exceptions get their exit code and hint; others say to use --debug."""
    msg, hint, code = classify(UnknownAppException("local_cwd://s/a"), "local_cwd")
    assert code == ExitCode.UNKNOWN and "list -s local_cwd" in hint and "\n" not in msg
    _, _, code = classify(MalformedAppHandleException("x"))
    assert code == ExitCode.USAGE
    msg, hint, code = classify(RuntimeError("boom\nsecond line"))
    assert code == 1 and msg == "RuntimeError: boom second line" and "--debug" in hint


async def test_first_signal_ends_a_race_and_cancels_the_raced_work() -> None:
    """A SIGINT during Interrupts.race raises Interrupted and cancels the raced coroutine."""
    interrupts = Interrupts()
    interrupts.install()
    cancelled = asyncio.Event()

    async def work() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    try:
        asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGINT)
        with pytest.raises(Interrupted):
            await interrupts.race(work())
    finally:
        interrupts.uninstall()
    assert cancelled.is_set()
    assert interrupts.exit_code == 130


@pytest.mark.timeout(30)
async def test_a_command_slow_to_finish_after_ctrl_c_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The first SIGINT cancels the command; when its clean-up takes longer than SLOW_FINISH (a
    cancel waiting for an engine to stop a container that ignores SIGTERM: its whole stop timeout)
    stderr says what it waits for and that Ctrl+C again exits (it was silent); a quick one says
    nothing."""
    from asynctorchx.cli import _interrupt

    async def command(clean_up: float) -> None:
        interrupts = Interrupts()
        interrupts.install()
        try:
            asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGINT)
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(clean_up)  # the command's clean-up (the runner closing)
        finally:
            interrupts.uninstall()

    await command(0.0)
    assert "Ctrl+C again" not in capsys.readouterr().err
    await command(_interrupt.SLOW_FINISH + 0.5)
    assert "interrupted; finishing what is under way" in capsys.readouterr().err


def test_ctrl_c_while_the_command_is_set_up_exits_130_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl+C that lands while main() still sets itself up (here: setting up logging, ~10-30 ms
    of every command) ends the command with 130 like any later one (the KeyboardInterrupt escaped
    main(): a traceback, and the process died by SIGINT)."""
    import asynctorchx.cli.main as cli_main

    def interrupted(debug: bool, level: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main, "_setup_logging", interrupted)
    try:
        code = cli_main.main(["run", "--dryrun", "utils.echo", "--msg", "hi"])
    except KeyboardInterrupt:  # (caught: escaping, it would stop the whole test session)
        pytest.fail("KeyboardInterrupt escaped main(): a traceback instead of exit 130")
    assert code == 130


async def test_a_race_returns_the_result_when_no_signal_comes() -> None:
    """Without a signal, race returns what the coroutine returned."""
    interrupts = Interrupts()

    async def work() -> int:
        return 7

    assert await interrupts.race(work()) == 7


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", [["builtins"], ["runopts", "local_cwd"]])
def test_a_closed_standard_output_is_reported_as_an_error(
    tmp_path: Path, command: list[str]
) -> None:
    """Started with descriptor 1 closed, a command that prints says that standard output is closed
    (exit 1), instead of failing inside with an AttributeError."""
    result = subprocess.run(
        [sys.executable, "-m", "asynctorchx", *command],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: os.close(1),
        env={**os.environ, "ASYNCTORCHX_LOCAL_ROOT": str(tmp_path)},
        check=False,
        timeout=50,
    )
    assert result.returncode == 1
    assert "standard output is closed" in result.stderr
    assert "AttributeError" not in result.stderr
