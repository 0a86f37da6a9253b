"""The builtin components and apps against TorchX 0.7 where the fourteenth session's review found
them apart.

TorchX 0.7's apps resolve every path through fsspec, whose local filesystem expands ``~`` to the
home directory; asynctorchx's stdlib-only apps treat a local path literally, so ``~/x`` becomes a
directory named ``~`` under the replica's working directory.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _torchx_env import json_from_torchx

from asynctorchx.apps import booth as booth_app
from asynctorchx.apps import process_monitor
from asynctorchx.apps import serve as serve_app
from asynctorchx.components import utils


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake $HOME and a separate working directory (the replica's cwd)."""
    home = tmp_path / "home"
    cwd = tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    return home


def test_booth_tracker_base_with_tilde_writes_under_home_like_torchx(home: Path):
    """utils.booth --tracker_base ~/booth: TorchX (FsspecResultTracker) writes $HOME/booth/0;
    the result must land there, not in a directory literally named '~' under the cwd."""
    assert booth_app.main(["--x1", "1", "--x2", "3", "--tracker_base", "~/booth"]) == 0
    stray = Path.cwd() / "~"
    assert not stray.exists(), f"booth created a literal '~' directory: {stray}"
    result = home / "booth" / "0"
    assert result.is_file(), "booth's result is not at $HOME/booth/0"
    assert json.loads(result.read_text()) == {"booth_eval": 0.0}


def test_copy_with_tilde_paths_copies_under_home_like_torchx(home: Path):
    """utils.copy --src ~/src.txt --dst ~/out/dst.txt: TorchX's copy_main (fsspec) copies within
    $HOME; the replica's program must do the same (and exit 0)."""
    (home / "src.txt").write_text("hello")
    role = utils.copy(src="~/src.txt", dst="~/out/dst.txt").roles[0]
    done = subprocess.run(
        [sys.executable, *role.args], capture_output=True, text=True, timeout=60, check=False
    )
    assert not (Path.cwd() / "~").exists(), "copy created a literal '~' directory in the cwd"
    assert done.returncode == 0, done.stderr
    assert (home / "out" / "dst.txt").read_text() == "hello"


def test_process_monitor_exit_on_file_with_tilde_stops_the_program(home: Path):
    """metrics.tensorboard --exit_on_file ~/done: TorchX's process monitor (fsspec) sees
    $HOME/done and stops the program; ours must stop it (exit 0), not run until the timeout (34)."""
    (home / "done").write_text("")
    started = time.monotonic()
    code = process_monitor.main(
        [
            "--poll_rate",
            "0.1",
            "--timeout",
            "10",
            "--kill_timeout",
            "2",
            "--exit_on_file",
            "~/done",
            "--",
            "sleep",
            "30",
        ]
    )
    assert code == 0, f"exit code {code}: ~/done was not seen (TIMEOUT_EXIT_CODE is 34)"
    assert time.monotonic() - started < 8


def test_copy_app_and_role_names_match_torchx():
    """utils.copy names its app and role 'torchx-utils-copy' in TorchX 0.7 (roles are addressed by
    name: `log APP/ROLE`, status.roles); the README lists no difference for copy (only
    utils.python/binary are renamed), so the names must be TorchX's."""
    theirs = json_from_torchx(
        "import json; from torchx.components.utils import copy\n"
        "app = copy(src='a', dst='b')\n"
        "print(json.dumps([app.name, app.roles[0].name]))"
    )
    app = utils.copy(src="a", dst="b")
    assert [app.name, app.roles[0].name] == theirs == ["torchx-utils-copy", "torchx-utils-copy"]


def test_serve_model_path_with_tilde_is_read_under_home_like_torchx(home: Path):
    """serve.torchserve --model_path ~/m.mar: the model is read from $HOME/m.mar (fsspec expands
    ~), not from a directory named '~' under the replica's cwd."""
    (home / "m.mar").write_bytes(b"model")
    dst = Path.cwd() / "copied.mar"
    serve_app.download("~/m.mar", str(dst))
    assert dst.read_bytes() == b"model"
