"""The engine scripts' pid-file checks (scripts/engines/lib/slurm_common.sh).

A CI run starts with /run as the last run left it: the pid files of daemons that are gone name pids
that other processes may have now. The scripts must tell their daemon from such a stranger, or they
never start the daemon (and would stop the stranger in its place).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

COMMON = Path(__file__).resolve().parent.parent / "scripts" / "engines" / "lib" / "slurm_common.sh"

pytestmark = pytest.mark.timeout(30)


def _bash(script: str) -> subprocess.CompletedProcess[str]:
    prelude = f"set -euo pipefail\nSCRIPT_NAME=test WAIT_SECONDS=5\nsource {COMMON}\n"
    return subprocess.run(
        ["bash", "-c", prelude + script], capture_output=True, text=True, check=False
    )


@pytest.fixture
def stranger() -> Iterator[subprocess.Popen[bytes]]:
    """A live process that is not a Slurm daemon, though it has `-N node1` among its arguments."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "-N", "node1"],
    )
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.parametrize(
    ("texts", "expected"),
    [
        pytest.param('"-c import time" "-N node1 "', "alive", id="its-own-command-line"),
        pytest.param('slurmd "-N node1 "', "stale", id="a-stranger-with-that-pid"),
    ],
)
def test_pid_alive_tells_the_daemon_from_a_stranger_by_its_command_line(
    tmp_path: Path, stranger: subprocess.Popen[bytes], texts: str, expected: str
) -> None:
    """A live pid counts only when its command line has every text the caller names."""
    pidfile = tmp_path / "slurmd-node1.pid"
    pidfile.write_text(f"{stranger.pid}\n")
    result = _bash(f"if pid_alive {pidfile} {texts}; then echo alive; else echo stale; fi")
    assert result.stdout.strip() == expected, result.stderr


@pytest.mark.parametrize("content", ["", "not-a-pid\n", "999999999\n"])
def test_pid_alive_rejects_empty_garbled_and_dead_pid_files(tmp_path: Path, content: str) -> None:
    pidfile = tmp_path / "d.pid"
    pidfile.write_text(content)
    result = _bash(f"pid_alive {pidfile} slurmd || echo stale")
    assert result.stdout.strip() == "stale"
    assert result.stderr == ""


def test_stop_pidfile_leaves_a_stranger_running_and_drops_the_stale_file(
    tmp_path: Path, stranger: subprocess.Popen[bytes]
) -> None:
    pidfile = tmp_path / "slurmd-node1.pid"
    pidfile.write_text(f"{stranger.pid}\n")
    result = _bash(f'stop_pidfile {pidfile} "slurmd node1" slurmd "-N node1 "')
    assert result.returncode == 0, result.stderr
    assert stranger.poll() is None, "stop_pidfile killed a process that is not the daemon"
    assert not pidfile.exists()


def test_stop_pidfile_stops_the_daemon_it_names(tmp_path: Path) -> None:
    daemon = subprocess.Popen(["sleep", "60"])
    try:
        pidfile = tmp_path / "sleep.pid"
        pidfile.write_text(f"{daemon.pid}\n")
        result = _bash(f"stop_pidfile {pidfile} sleeper sleep")
        assert result.returncode == 0, result.stderr
        assert daemon.wait(timeout=10) is not None
        assert not pidfile.exists()
    finally:
        daemon.kill()
        daemon.wait()
