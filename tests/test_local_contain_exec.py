"""The marker scans of the local containment see a process in the middle of an ``execve``: between
its two images its environment reads empty for a moment, which must not make it look unmarked."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from asynctorchx.schedulers._local import contain

CHAIN = 'n=$1\nif [ "$n" -gt 0 ]; then exec sh "$0" $((n - 1)); fi\nexec sleep 30\n'


@pytest.mark.timeout(60)
def test_a_process_between_two_images_still_shows_its_marker(tmp_path: Path) -> None:
    """A process that execs itself 300 times, read without pause: every read finds its marker
    (the empty environment of a process caught between two images is read again)."""
    script = tmp_path / "chain.sh"
    script.write_text(CHAIN)
    env = {"PATH": os.environ["PATH"], "ATX_MARK": "yes"}
    proc = subprocess.Popen(["sh", str(script), "300"], env=env)
    reads, misses = 0, []
    try:
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            found = contain.marker_of(proc.pid, b"ATX_MARK")
            reads += 1
            if found != "yes":
                misses.append(found)
            if Path(f"/proc/{proc.pid}/cmdline").read_bytes().startswith(b"sleep\0"):
                break
        else:
            pytest.fail("the chain of execs did not end")
    finally:
        proc.kill()
        proc.wait()
    assert reads > 300
    assert misses == []


@pytest.mark.timeout(30)
def test_an_empty_environment_is_not_waited_for_when_nothing_is_exec_ing(tmp_path: Path) -> None:
    """A process started with no environment (its arguments in place) and a zombie read as empty
    at once, without the wait kept for a process between two images."""
    idle = subprocess.Popen(["/bin/sleep", "30"], env={})
    zombie = subprocess.Popen(["/bin/true"])
    try:
        os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)
        for pid in (idle.pid, zombie.pid):
            start = time.monotonic()
            assert not contain.environ_of(pid)  # (a zombie's cannot be read at all)
            assert time.monotonic() - start < contain.EXEC_WAIT / 2
        assert contain.marker_of(idle.pid, b"ATX_MARK") is None
    finally:
        idle.kill()
        idle.wait()
        zombie.wait()
