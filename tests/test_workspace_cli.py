# ruff: noqa: F811 - the fixtures imported from _docker_env/_workspace_env are redefined as parameters
"""``asynctorchx run --workspace``: the real command as a subprocess (local_docker on the real
engine, local_cwd/local_dir with real processes), and the progress printer it uses."""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _docker_env import docker_engine, python_image  # noqa: F401 - fixtures
from _workspace_env import make_workspace, workspace_image_ids, workspace_images  # noqa: F401

from asynctorchx.cli._workspace import ProgressPrinter
from asynctorchx.schedulers.workspace import WorkspaceEvent

pytestmark = pytest.mark.timeout(180)


def cli(
    cwd: Path, *args: str, root: Path | None = None, config: bool = False
) -> subprocess.CompletedProcess[str]:
    """``python -m asynctorchx ARGS`` in ``cwd`` (its own state root; .torchxconfig read only
    when ``config``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR", "TERM")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    env["ASYNCTORCHX_LOCAL_ROOT"] = str(root or cwd / ".state")
    if config:
        env.pop("TORCHXCONFIG", None)
    else:
        env["TORCHXCONFIG"] = ""
    return subprocess.run(
        [sys.executable, "-m", "asynctorchx", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )


@pytest.mark.docker
def test_run_on_local_docker_shows_build_progress_on_stderr_and_the_handle_alone_on_stdout(
    python_image: str, tmp_path: Path, workspace_images: set[str]
) -> None:
    """stdout is the handle; stderr has the build's start and end; the app runs the workspace."""
    ws = make_workspace(tmp_path / "ws", {"train.py": "print('trained')\n"})
    handle = ""
    try:
        result = cli(
            tmp_path, "run", "-s", "local_docker", "--workspace", str(ws), "--wait",
            "utils.sh", "--image", python_image, "python3", "train.py",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        [handle] = result.stdout.splitlines()
        assert handle.startswith("local_docker://")
        assert "build: building asynctorchx/workspace:" in result.stderr
        assert "build: built asynctorchx/workspace:" in result.stderr
        logs = cli(tmp_path, "log", handle)
        assert "trained" in logs.stdout
    finally:
        if handle:
            asyncio.run(remove_app(handle))


async def remove_app(handle: str) -> None:
    """Removes the containers of the app ``handle`` names (only those: the session is shared)."""
    import json

    import aiodocker

    from asynctorchx.schedulers._docker.request import LABEL_APP_ID
    from asynctorchx.specs import parse_app_handle

    app_id = parse_app_handle(handle).app_id
    async with aiodocker.Docker() as client:
        label = json.dumps({"label": [f"{LABEL_APP_ID}={app_id}"]})
        for c in await client.containers.list(all=True, filters=label):
            await c.delete(force=True)


@pytest.mark.docker
def test_dryrun_prints_the_plan_and_builds_nothing(
    python_image: str, tmp_path: Path, workspace_images: set[str]
) -> None:
    """--dryrun prints the workspace plan (base image, recipe, files, hash, target); no image appears."""
    ws = make_workspace(tmp_path / "ws", {"train.py": "print('x')\n"})
    result = cli(
        tmp_path, "run", "--dryrun", "-s", "local_docker", "--workspace", str(ws),
        "utils.sh", "--image", python_image, "python3", "train.py",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for part in (
        "workspace: ",
        f"base image: {python_image} (sha256:",
        "FROM $IMAGE",
        "files: 2",
        "content hash: ",
        "target: asynctorchx/workspace:",
    ):
        assert part in result.stdout
    assert "nothing is launched or built" in result.stderr
    assert asyncio.run(workspace_image_ids()) == workspace_images


@pytest.mark.docker
def test_a_failing_build_shows_its_last_lines_and_exits_1(
    python_image: str, tmp_path: Path, workspace_images: set[str]
) -> None:
    """A broken Dockerfile.torchx: exit 1, the step's output and the error on stderr, no handle."""
    ws = make_workspace(
        tmp_path / "ws",
        {"Dockerfile.torchx": "ARG IMAGE\nFROM $IMAGE\nRUN echo the-step-output && false\n"},
    )
    result = cli(
        tmp_path, "run", "-s", "local_docker", "--workspace", str(ws),
        "utils.sh", "--image", python_image, "true",
    )  # fmt: skip
    assert result.returncode == 1 and result.stdout == ""
    assert "last lines of the output:" in result.stderr and "the-step-output" in result.stderr
    assert "error: building image asynctorchx/workspace:" in result.stderr
    assert asyncio.run(workspace_image_ids()) == workspace_images


def test_the_torchxconfig_workspace_applies_and_an_empty_flag_disables_it(tmp_path: Path) -> None:
    """[cli:run] workspace makes local_cwd run in it; --workspace '' runs in the current directory."""
    ws = make_workspace(tmp_path / "ws", {"a.txt": ""})
    (tmp_path / ".torchxconfig").write_text(f"[cli:run]\nworkspace = {ws}\n")
    configured = cli(tmp_path, "run", "--dryrun", "utils.sh", "pwd", config=True)
    disabled = cli(tmp_path, "run", "--dryrun", "--workspace", "", "utils.sh", "pwd", config=True)
    assert configured.returncode == 0 and disabled.returncode == 0, (
        configured.stderr + disabled.stderr
    )
    assert f"cwd: {ws}\n" in configured.stdout and f"workspace: {ws}" in configured.stdout
    assert f"cwd: {tmp_path}\n" in disabled.stdout and "workspace:" not in disabled.stdout


@pytest.mark.parametrize("quiet", [False, True])
def test_local_dir_progress_is_shown_unless_quiet(tmp_path: Path, quiet: bool) -> None:
    """The snapshot's end is a line on stderr, or nothing with --quiet; stdout is the handle."""
    ws = make_workspace(tmp_path / "ws", {"data.txt": "d"})
    args = ["run", "-s", "local_dir", "--workspace", str(ws), *(["--quiet"] if quiet else [])]
    result = cli(tmp_path, *args, "utils.sh", "--image", str(tmp_path), "cat", "data.txt")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("local_dir://") and len(result.stdout.splitlines()) == 1
    assert ("snapshot: made " in result.stderr) is not quiet
    assert "snapshot:" not in result.stderr if quiet else True


def test_a_missing_workspace_is_a_usage_error_naming_it(tmp_path: Path) -> None:
    """--workspace of a directory that does not exist exits 2 with a one-line error naming it."""
    result = cli(
        tmp_path,
        "run",
        "-s",
        "local_dir",
        "--workspace",
        str(tmp_path / "nope"),
        "utils.sh",
        "true",
    )
    assert result.returncode == 2 and result.stdout == ""
    [line] = result.stderr.strip().splitlines()
    assert f"workspace directory '{tmp_path / 'nope'}' does not exist" in line


def event(message: str, final: bool = False) -> WorkspaceEvent:
    return WorkspaceEvent("build", "img:1", message, final)


def test_the_live_printer_rewrites_one_line_and_leaves_one_per_finished_stage() -> None:
    """On a terminal each event rewrites the line (\\r, erase); a final event ends it with \\n."""
    out = io.StringIO()
    printer = ProgressPrinter(out, live=True)
    for e in (event("start"), event("Step 1/2"), event("Step 2/2"), event("built", final=True)):
        printer(e)
    assert out.getvalue() == (
        "\r\x1b[Kbuild: start\r\x1b[Kbuild: Step 1/2\r\x1b[Kbuild: Step 2/2\r\x1b[Kbuild: built\n"
    )


def test_the_plain_printer_writes_only_starts_and_ends_and_quiet_nothing() -> None:
    """Off a terminal: the first and the final event of a stage, one line each; quiet: nothing."""
    out, silent = io.StringIO(), io.StringIO()
    plain, quiet = ProgressPrinter(out, live=False), ProgressPrinter(silent, live=False, quiet=True)
    for e in (event("start"), event("Step 1/2"), event("built", final=True)):
        plain(e)
        quiet(e)
    assert out.getvalue() == "build: start\nbuild: built\n" and silent.getvalue() == ""
