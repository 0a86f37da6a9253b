"""What a person sees: `asynctorchx run --log` typed into a real terminal (tmux), then read back.

tmux runs a shell in a pseudo-terminal; the test types the command with ``send-keys`` and reads the
screen with ``capture-pane`` (``-e`` keeps the colours as SGR escapes, without ``-e`` the text as
shown). Without tmux the test skips, or fails when ``ASYNCTORCHX_REQUIRE_ENGINES=1``
(``scripts/engines/tmux.sh`` installs it).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import engine_missing

COMPONENT = '''
import asynctorchx.specs as specs


def pair(script: str) -> specs.AppDef:
    """One trainer and one ps replica running a shell script.

    Args:
        script: the shell script both replicas run
    """
    env = {"REPLICA": specs.macros.replica_id}
    return specs.AppDef(
        name="pair",
        roles=[
            specs.Role(name="trainer", image=".", entrypoint="sh", args=["-c", script], env=env),
            specs.Role(name="ps", image=".", entrypoint="sh", args=["-c", script], env=env),
        ],
    )
'''

SGR = re.compile(r"\x1b\[[0-9;]*m")
LOG_LINE = re.compile(r"^(trainer/0|ps/0)( *) ([|!]) (out|err) (\d)$")


class Tmux:
    """A private tmux server (its own socket) with one session running ``sh``."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        tmux = shutil.which("tmux")
        assert tmux is not None
        self.tmux = tmux
        self.socket = f"asynctorchx-test-{uuid.uuid4().hex[:8]}"
        env_args = [arg for k, v in env.items() for arg in ("-e", f"{k}={v}")]
        self._run(
            "new-session",
            "-d",
            "-s",
            "t",
            "-x",
            "200",
            "-y",
            "40",
            "-c",
            str(cwd),
            *env_args,
            "sh",
        )

    def _run(self, *args: str) -> str:
        result = subprocess.run(
            [self.tmux, "-L", self.socket, "-f", "/dev/null", *args],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return result.stdout

    def type_line(self, line: str) -> None:
        self._run("send-keys", "-t", "t", "-l", line)
        self._run("send-keys", "-t", "t", "Enter")

    def screen(self, escapes: bool = False) -> str:
        return self._run("capture-pane", "-p", "-t", "t", *(["-e"] if escapes else []))

    def wait_for(self, pattern: str, timeout: float = 60) -> str:
        """Polls the screen (bounded) until a line matches ``pattern``; returns the screen."""
        deadline = time.monotonic() + timeout
        while not re.search(pattern, screen := self.screen(), re.M):
            assert time.monotonic() < deadline, f"{pattern!r} never appeared:\n{screen}"
            time.sleep(0.1)
        return screen

    def close(self) -> None:
        subprocess.run(
            [self.tmux, "-L", self.socket, "kill-server"], capture_output=True, check=False
        )


@pytest.fixture
def tmux(tmp_path: Path) -> Iterator[Tmux]:
    if shutil.which("tmux") is None:
        engine_missing("tmux (run `bash scripts/engines/tmux.sh`)")
    (tmp_path / "comp.py").write_text(COMPONENT)
    script_dir = str(Path(sys.executable).parent)
    env = {
        "PATH": f"{script_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "ASYNCTORCHX_LOCAL_ROOT": str(tmp_path / "root"),
        "TORCHXCONFIG": "",
        "NO_COLOR": "",
        "FORCE_COLOR": "",
    }
    term = Tmux(tmp_path, env)
    try:
        yield term
    finally:
        term.close()


def test_run_log_in_a_terminal_is_aligned_coloured_and_clean(tmux: Tmux) -> None:
    """Two replicas' lines are aligned and coloured per replica, stderr marked, no stray escapes."""
    script = "echo out $REPLICA; echo err $REPLICA >&2; sleep 0.2; echo out $REPLICA"
    tmux.type_line(
        f"asynctorchx run --log comp.py:pair --script {shlex.quote(script)}; echo EXIT=$?"
    )
    plain = tmux.wait_for(r"^EXIT=\d+$")
    coloured = tmux.screen(escapes=True)

    assert re.search(r"^EXIT=0$", plain, re.M), plain
    log_lines = [ln.rstrip() for ln in plain.splitlines() if LOG_LINE.match(ln.rstrip())]
    assert sorted(log_lines) == sorted(
        [
            "trainer/0 | out 0",
            "trainer/0 ! err 0",
            "trainer/0 | out 0",
            "ps/0      | out 0",
            "ps/0      ! err 0",
            "ps/0      | out 0",
        ]
    ), plain
    assert {ln.index(" | ") if " | " in ln else ln.index(" ! ") for ln in log_lines} == {9}

    # What is shown holds no escape debris: tmux interprets well-formed sequences and prints the rest.
    assert "\x1b" not in plain and "^[" not in plain
    assert not re.search(r"\[[0-9;]*m", plain), plain

    colours: dict[str, set[str]] = {}
    for line in coloured.splitlines():
        text = SGR.sub("", line).rstrip()
        if not LOG_LINE.match(text):
            continue
        m = re.match(r"\x1b\[([0-9;]+)m(trainer/0|ps/0)\x1b\[", line)
        assert m, f"the prefix is not coloured: {line!r}"
        colours.setdefault(m[2], set()).add(m[1])
        if " ! " in text:
            assert re.search(r"\x1b\[[0-9;]*31m!", line), f"the stderr marker is not red: {line!r}"
        # Nothing but SGR sequences: no cursor movement or other control codes.
        assert "\x1b" not in SGR.sub("", line), repr(line)
    assert set(colours) == {"trainer/0", "ps/0"}
    assert all(len(c) == 1 for c in colours.values()), colours  # stable per replica
    assert colours["trainer/0"] != colours["ps/0"]
    assert re.search(r"\x1b\[[0-9;]*32mSUCCEEDED", coloured)
