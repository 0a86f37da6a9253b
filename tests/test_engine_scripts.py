# ruff: noqa: F811 - the fixtures imported from _docker_env/_workspace_env are redefined as parameters
"""The engine scripts' helpers (scripts/engines/lib/slurm_common.sh: pid files, the MariaDB user) and
the registry's script.

A CI run starts with /run as the last run left it: the pid files of daemons that are gone name pids
that other processes may have now. The scripts must tell their daemon from such a stranger, or they
never start the daemon (and would stop the stranger in its place).

The accounting database's user must end up with the configured password and grants whatever MariaDB
held before; ``converge_db_user`` is run against the MariaDB of ``scripts/engines/slurm.sh`` with a
throwaway user and database of the test's own (the cluster's ``slurm`` user is never touched).
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from _docker_env import docker_engine  # noqa: F401 - the registry fixture's dependency
from _workspace_env import registry  # noqa: F401 - pytest fixture
from conftest import engine_missing

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


# -- converge_db_user -------------------------------------------------------------------------------

PASSWORD = "configured-pw"


def _sql(statements: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Runs SQL through MariaDB's socket (as root, or as ``MYSQL_USER``/``MYSQL_PWD`` from ``env``)."""
    user = ["-u", env.pop("MYSQL_USER")] if "MYSQL_USER" in env else []
    return subprocess.run(
        ["mariadb", "--protocol=socket", *user, "-N", "-B", "-e", statements],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
        env={"PATH": "/usr/bin:/bin:/usr/sbin", **env},
    )


@pytest.fixture
def throwaway_db() -> Iterator[tuple[str, str]]:
    """(database, user) names of the test's own, dropped afterwards; needs the slurm.sh MariaDB."""
    try:
        ping = _sql("SELECT 1")
    except (OSError, subprocess.TimeoutExpired) as e:
        engine_missing(f"MariaDB (run `bash scripts/engines/slurm.sh`): {e}")
    if ping.returncode != 0:
        engine_missing(f"MariaDB (run `bash scripts/engines/slurm.sh`): {ping.stderr.strip()}")
    name = f"atx_test_{uuid.uuid4().hex[:10]}"
    try:
        yield name, name
    finally:
        _sql(f"DROP USER IF EXISTS '{name}'@'localhost'; DROP DATABASE IF EXISTS `{name}`;")


def _logs_in(db: str, user: str, password: str) -> bool:
    result = _sql(
        f"CREATE TABLE IF NOT EXISTS `{db}`.t (i INT); SELECT 1",
        MYSQL_USER=user,
        MYSQL_PWD=password,
    )
    return result.returncode == 0


@pytest.mark.parametrize(
    "before",
    [
        pytest.param("", id="nothing"),
        pytest.param(
            "CREATE USER '{u}'@'localhost' IDENTIFIED BY 'another-pw'", id="another-password"
        ),
        pytest.param(
            "CREATE DATABASE `{d}`; CREATE USER '{u}'@'localhost' IDENTIFIED BY '" + PASSWORD + "'",
            id="no-grants",
        ),
        pytest.param(
            "CREATE USER '{u}'@'localhost' IDENTIFIED VIA unix_socket ACCOUNT LOCK",
            id="socket-auth-and-locked",
        ),
        pytest.param(
            "CREATE USER '{u}'@'localhost' IDENTIFIED BY 'old' PASSWORD EXPIRE",
            id="expired-password",
        ),
    ],
)
def test_converge_db_user_leaves_the_configured_user_whatever_was_there(
    throwaway_db: tuple[str, str], before: str
) -> None:
    """After converge_db_user, the user logs in with the configured password and owns the database,
    whether it was missing, had another password or plugin, was locked, expired or had no grants."""
    db, user = throwaway_db
    if before:
        setup = _sql(before.format(u=user, d=db))
        assert setup.returncode == 0, setup.stderr
    assert not _logs_in(db, user, PASSWORD)
    for _ in range(2):  # and again: nothing changes, nothing fails
        result = _bash(f"converge_db_user {db} {user} {PASSWORD}")
        assert result.returncode == 0, result.stderr
        assert _logs_in(db, user, PASSWORD)
    assert not _logs_in(db, user, "another-pw")
    grants = _sql(f"SHOW GRANTS FOR '{user}'@'localhost'").stdout
    assert f"GRANT ALL PRIVILEGES ON `{db}`.* TO `{user}`@`localhost`" in grants


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ("'bad name' user pw", "names must be"),
        ('db user "it\'s"', "without quotes or backslashes"),
        ("db user ''", "must be non-empty"),
    ],
)
def test_converge_db_user_refuses_what_it_cannot_quote(args: str, error: str) -> None:
    """Names or passwords that cannot go into the SQL verbatim are refused before MariaDB is asked."""
    result = _bash(f"converge_db_user {args}")
    assert result.returncode != 0
    assert error in result.stderr


# -- scripts/engines/registry.sh ---------------------------------------------------------------------

REGISTRY_SH = COMMON.parent.parent / "registry.sh"


def test_the_registry_script_refuses_an_address_off_this_host() -> None:
    """ASYNCTORCHX_REGISTRY=0.0.0.0:PORT is refused before anything is installed or started."""
    import os

    if os.getuid() != 0:
        pytest.skip("the script runs as root only")
    result = subprocess.run(
        ["bash", str(REGISTRY_SH)],
        capture_output=True,
        text=True,
        env={**os.environ, "ASYNCTORCHX_REGISTRY": "0.0.0.0:5999"},
        check=False,
    )
    assert result.returncode == 1
    assert "must be 127.0.0.1:PORT" in result.stderr


def test_the_registry_listens_on_127_0_0_1_only_and_a_rerun_keeps_it(registry: str) -> None:
    """Every listening socket on the registry's port is bound to 127.0.0.1; running the script
    again leaves the same daemon running."""
    import os

    port = int(registry.rsplit(":", 1)[1])
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    listening.append(local.rsplit(":", 1)[0])
    assert listening == ["0100007F"]
    pid = Path("/run/asynctorchx-registry.pid").read_text().strip()
    result = subprocess.run(["bash", str(REGISTRY_SH)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert Path("/run/asynctorchx-registry.pid").read_text().strip() == pid
    assert os.path.exists(f"/proc/{pid}")
