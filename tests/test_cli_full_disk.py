"""The CLI's errors when a disk is full: the state root's, or the one its standard output goes to.

Found by a full-disk review (the real console script, run as a subprocess on small tmpfs mounts):

* ``asynctorchx run`` refused because the state root is full printed ``error: cannot create the
  app's record of app 'X': No space left on device (its file system is full)``, which does not say
  which file system (the error for any other errno names the records directory), and before it
  a ``WARNING: cannot write the record of app X (will retry)`` and an ``ERROR: writing the logs
  of ... failed`` about the app that was refused, sometimes more warnings and an ``ERROR: the
  records of 1 apps could not be written`` as well: the record writer warned of the failed write
  its caller was about to report (``RecordWriter.write``), the app's log writer of output lost
  by a replica whose launch was being undone, and the task of the app being undone could queue
  its end record after the undo had dropped what was queued. Now the error names the records
  directory, in one line: the write ``write`` awaits is not warned of, the log writers of a
  launch hold their error line until it started (``ReplicaLogWriter.hold_loss_report``), and what
  is put for an app whose submit was undone is dropped (``RecordWriter.forget``).
* ``asynctorchx log/status/list/describe ... > /dev/full`` (or a file on a full disk) said
  ``error: OSError: [Errno 28] No space left on device``, the same words as a full state root.
  Now writing or flushing standard output raises ``StdoutError`` (``cli/main.py``'s
  ``_watch_stdout``), reported as ``cannot write standard output: <strerror>``, exit 1, buffered
  or not (buffered, Python's flush at exit then failed again: a traceback and exit 120). A closed
  pipe is still ended quietly (exit 141), and other errors keep their own words.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from _local_env import tiny_tmpfs
from test_cli_commands import Cli
from test_local_reliability import fill

from asynctorchx.cli._errors import StdoutError, classify
from asynctorchx.schedulers._local import contain, protocol

pytestmark = pytest.mark.timeout(120)

NO_SPACE = os.strerror(28)  # ENOSPC


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs (root only) for a state root or an output file; unmounted afterwards."""
    with tiny_tmpfs(tmp_path / "state", "2m") as mounted:
        try:
            yield mounted
        finally:
            for entry in mounted.glob("filler-*"):  # (before the unmount, which is lazy)
                entry.unlink()


@pytest.fixture
def full_root(state: Path, tmp_path: Path) -> Iterator[tuple[Cli, Path]]:
    """A CLI whose state root (on ``state``) took one app and is full now."""
    root = state / "root"
    cli = Cli(tmp_path, root)
    warm = cli("run", "-s", "local_cwd", "utils.sh", "--", "sh", "-c", "echo warm")
    assert warm.returncode == 0, warm.stderr
    fill(state)
    yield cli, root


@pytest.fixture(scope="module")
def printed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Cli, str]:
    """A CLI (on a state root with room) and the handle of an app that printed 20000 lines."""
    base = tmp_path_factory.mktemp("printed")
    cli = Cli(base, base / "root")
    run = cli("run", "-s", "local_cwd", "utils.sh", "--", "sh", "-c", "seq 1 20000")
    assert run.returncode == 0, run.stderr
    return cli, run.stdout.strip()


def _lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.strip()]


def _env(cli: Cli, buffered: bool) -> dict[str, str]:
    """The CLI's environment, Python's standard streams buffered (its default) or not (``-u``)."""
    env = {k: v for k, v in cli.env.items() if k != "PYTHONUNBUFFERED"}
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    return env


def _to_file(
    cli: Cli, path: str, *args: str, buffered: bool = True
) -> subprocess.CompletedProcess[str]:
    """Runs the CLI with its standard output written to ``path`` (its stderr captured)."""
    with open(path, "w") as out:
        return subprocess.run(
            [cli.script, *args],
            cwd=cli.cwd,
            env=_env(cli, buffered),
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )


def _args(command: str, handle: str) -> list[str]:
    return ["list", "-s", "local_cwd"] if command == "list" else [command, handle]


def _marked(app_id: str) -> list[int]:
    prefix = protocol.app_marker_prefix(app_id)
    return [p for p, _, _ in contain.live_processes(protocol.MARKER_ENV_BYTES, [prefix])]


# -- a run refused by a full state root -------------------------------------------------------


def test_a_run_refused_by_a_full_state_root_names_the_records_directory_in_one_line(
    full_root: tuple[Cli, Path],
) -> None:
    """``asynctorchx run`` of an app that prints and exits, on a full state root: exit 1 and one
    line on stderr, the error naming the records directory (``{root}/.apps``) and saying its
    file system is full: no warning of the record write, no error about the refused app's logs
    or records left to write. Nothing of the app is left (no record, no process). Three times:
    which of the extra lines came depended on timing."""
    cli, root = full_root
    records = root / ".apps"
    for _ in range(3):
        result = cli("run", "-s", "local_cwd", "utils.sh", "--", "sh", "-c", "echo hi")
        assert result.returncode == 1, result.stderr
        assert "Traceback" not in result.stderr
        lines = _lines(result.stderr)
        assert len(lines) == 1, lines
        assert "error: cannot write the record of app " in lines[0], lines
        assert f" under {records}: {NO_SPACE} (its file system is full)" in lines[0], lines
        found = re.search(r"of app '([^']+)'", lines[0])
        assert found is not None, lines
        app_id = found.group(1)
        assert not (records / f"{app_id}.json").exists()
        assert _marked(app_id) == []


def test_a_run_refused_by_a_full_state_root_is_not_said_of_standard_output(
    full_root: tuple[Cli, Path],
) -> None:
    """The same refused run with its standard output on a full disk too (``/dev/full``): the
    error is still the record's, naming the records directory, not standard output's (only an
    error writing standard output is said to be one)."""
    cli, root = full_root
    result = _to_file(cli, "/dev/full", "run", "-s", "local_cwd", "utils.sh", "--", "true")
    assert result.returncode == 1, result.stderr
    lines = _lines(result.stderr)
    assert len(lines) == 1, lines
    assert f" under {root / '.apps'}: {NO_SPACE}" in lines[0], lines
    assert "standard output" not in lines[0], lines


def test_an_app_that_started_still_says_what_its_logs_lost(state: Path, tmp_path: Path) -> None:
    """An app that started and then lost output to its full disk (the state root, where its logs
    are): ``asynctorchx run`` still writes the log writer's error line naming the replica's log
    directory (its lines are held during the launch only, and said once the app started), and
    the app still succeeds."""
    root = state / "root"
    cli = Cli(tmp_path, root)
    go = tmp_path / "go"
    script = f'while [ ! -e "{go}" ]; do sleep 0.01; done; seq 1 200000'
    with cli.popen("run", "-s", "local_cwd", "utils.sh", "--", "sh", "-c", script) as proc:
        assert proc.stdout is not None
        handle = proc.stdout.readline().strip()
        assert "://" in handle, handle
        cli.wait_running(handle, 1)
        fill(state)
        go.touch()
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    app_id = handle.rsplit("/", 1)[-1]
    assert f"ERROR: writing the logs of {root}/asynctorchx/{app_id}/sh/0 failed: " in stderr, stderr


def test_an_app_whose_log_disk_is_full_from_the_start_still_says_what_its_logs_lost(
    state: Path, tmp_path: Path
) -> None:
    """An app launched (its state root has room) with its ``log_dir`` on a full disk: its first
    output, maybe lost while it is being launched (the line held then), is said lost once it
    started, and the app succeeds. Twice: when the output comes depends on timing."""
    cli = Cli(tmp_path, tmp_path / "root")
    cfg = f"log_dir={state / 'logs'}"
    warm = cli("run", "-s", "local_cwd", "-cfg", cfg, "utils.sh", "--", "sh", "-c", "echo warm")
    assert warm.returncode == 0, warm.stderr
    fill(state)
    for _ in range(2):
        result = cli("run", "-s", "local_cwd", "-cfg", cfg, "utils.sh", "--", "sh", "-c", "echo hi")
        assert result.returncode == 0, result.stderr
        app_id = result.stdout.strip().rsplit("/", 1)[-1]
        logs = state / "logs" / "asynctorchx" / app_id / "sh" / "0"
        assert f"ERROR: writing the logs of {logs} failed: " in result.stderr, result.stderr


# -- standard output on a full disk -----------------------------------------------------------


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("command", ["log", "status", "list", "describe"])
def test_output_to_dev_full_is_said_to_be_standard_output(
    printed: tuple[Cli, str], command: str, buffered: bool
) -> None:
    """``asynctorchx log/status/list/describe ... > /dev/full``: exit 1 and one line on stderr,
    ``cannot write standard output: No space left on device`` (not a bare ``OSError``, nor a
    traceback and exit 120 from Python's flush at exit), whether Python buffers its standard
    streams or not."""
    cli, handle = printed
    result = _to_file(cli, "/dev/full", *_args(command, handle), buffered=buffered)
    assert result.returncode == 1, result.stderr
    lines = _lines(result.stderr)
    assert len(lines) == 1, lines
    assert f"error: cannot write standard output: {NO_SPACE}" in lines[0], lines
    assert "OSError" not in result.stderr


@pytest.mark.parametrize("command", ["log", "status"])
def test_output_to_a_file_on_a_full_disk_is_said_to_be_standard_output(
    printed: tuple[Cli, str], state: Path, command: str
) -> None:
    """``asynctorchx log/status H > file`` where the file's disk (a tmpfs) is full: exit 1 and
    the one line ``cannot write standard output: No space left on device``."""
    cli, handle = printed
    fill(state)
    result = _to_file(cli, str(state / "out.txt"), *_args(command, handle))
    assert result.returncode == 1, result.stderr
    lines = _lines(result.stderr)
    assert len(lines) == 1, lines
    assert f"error: cannot write standard output: {NO_SPACE}" in lines[0], lines


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
def test_a_closed_pipe_still_ends_the_command_quietly(
    printed: tuple[Cli, str], buffered: bool
) -> None:
    """``asynctorchx log H | head -1``: the reader closes the pipe after one line, and the command
    ends with 141 (as killed by SIGPIPE) and nothing on stderr, as before: a closed pipe is not
    an error writing standard output."""
    cli, handle = printed
    with subprocess.Popen(
        [cli.script, "log", handle],
        cwd=cli.cwd,
        env=_env(cli, buffered),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:  # (its pipes closed, and the command waited for, on the way out)
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.readline()
        proc.stdout.close()
        stderr = proc.stderr.read()
        code = proc.wait(timeout=60)
    assert first.strip().endswith("| 1"), first
    assert code == 141, stderr
    assert stderr == ""


def test_classify_says_standard_output_only_for_a_stdout_error() -> None:
    """``classify``: a ``StdoutError`` is ``cannot write standard output: <strerror>`` (exit 1,
    with a hint when the disk is full); any other OSError keeps its type and message."""
    message, hint, code = classify(StdoutError(28, NO_SPACE))
    assert (message, code) == (f"cannot write standard output: {NO_SPACE}", 1)
    assert "standard output" in hint
    message, hint, code = classify(StdoutError(5, os.strerror(5)))
    assert (message, hint, code) == (f"cannot write standard output: {os.strerror(5)}", "", 1)
    message, _, code = classify(OSError(28, NO_SPACE))
    assert (message, code) == (f"OSError: [Errno 28] {NO_SPACE}", 1)
