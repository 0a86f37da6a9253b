"""Pins defects of the local backends found by review: each test failed before its fix.

A relative ``TORCHELASTIC_ERROR_FILE`` is the replica's (under its working directory), a
fractional GPU count is refused, a program that appears earlier on PATH is run by the next launch,
a run option that cannot be encoded is refused at the dry run, and a removed current directory is
named at a ``local_cwd`` dry run. Real processes, no mocks; independent of the host's GPUs.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from _local_env import wait_for

from asynctorchx.schedulers.local import LocalScheduler
from asynctorchx.specs import (
    AppDef,
    AppState,
    InvalidAppDefException,
    InvalidRunConfigException,
    Resource,
    Role,
)
from asynctorchx.specs.api import runopts

ERROR_ENV = "TORCHELASTIC_ERROR_FILE"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "root"


@pytest.fixture
async def sched(root: Path) -> AsyncIterator[LocalScheduler]:
    s = LocalScheduler("review", local_root=root)
    yield s
    await s.close()


async def lines(s: LocalScheduler, app_id: str, role: str = "main") -> list[str]:
    return [line async for line in s.log_iter(app_id, role, 0)]


def write_tool(directory: Path, said: str, mode: int = 0o755) -> None:
    """A program ``tool`` in ``directory`` that prints ``said``."""
    (directory / "tool").write_text(f"#!/bin/sh\necho {said}\n")
    (directory / "tool").chmod(mode)


# --- a relative TORCHELASTIC_ERROR_FILE ------------------------------------------------------


async def test_a_relative_error_file_is_the_replicas_and_no_other_file_is_removed(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """local_dir with TORCHELASTIC_ERROR_FILE=error.json (relative, as torchrun users set it): the
    replica writes {image}/error.json, describe() shows that error, and a file of the same name
    in the launching process's current directory survives the restart that removes the
    replica's previous error file."""
    image = tmp_path / "image"
    image.mkdir()
    launcher_cwd = tmp_path / "elsewhere"
    launcher_cwd.mkdir()
    precious = launcher_cwd / "error.json"
    precious.write_text("precious user data\n")
    monkeypatch.chdir(launcher_cwd)
    error = {"message": {"message": "real-error", "extraInfo": {"timestamp": "1700000000"}}}
    script = f"printf '%s' '{json.dumps(error)}' > \"${ERROR_ENV}\"; exit 1"
    role = Role(
        "main",
        image=str(image),
        entrypoint="sh",
        args=["-c", script],
        env={ERROR_ENV: "error.json"},
        max_retries=1,
    )
    async with LocalScheduler("rel", "local_dir", local_root=root) as s:
        app_id = await s.submit(AppDef("a", [role]), {})
        desc = await wait_for(s, app_id)
    assert desc.state == AppState.FAILED
    assert json.loads((image / "error.json").read_text()) == error
    assert precious.read_text() == "precious user data\n"
    assert json.loads(desc.structured_error_msg) == error


@pytest.mark.parametrize("backend", ["local_dir", "local_cwd"])
def test_a_relative_error_file_is_given_to_the_replica_against_its_working_directory(
    backend: str, root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dry run makes a relative error file absolute against the replica's working directory
    (the image for local_dir, the current directory for local_cwd), in the environment the
    replica gets and in the path the supervisor removes and reads; an absolute one and an empty
    one (no error file) are left as they are."""
    image = tmp_path / "image"
    image.mkdir()
    monkeypatch.chdir(image)
    roles = [
        Role("rel", str(image), "true", env={ERROR_ENV: "sub/../err.json"}),
        Role("abs", str(image), "true", env={ERROR_ENV: "/elsewhere/err.json"}),
        Role("empty", str(image), "true", env={ERROR_ENV: ""}),
    ]
    s = LocalScheduler("rel", backend, local_root=root)
    reps = {r.role: r for r in s.submit_dryrun(AppDef("a", roles), {}).request.replicas}
    assert reps["rel"].cwd == str(image)
    expected = {"rel": f"{image}/sub/../err.json", "abs": "/elsewhere/err.json", "empty": ""}
    for name, path in expected.items():
        assert reps[name].env[ERROR_ENV] == path, name
        assert reps[name].error_file == path, name


# --- a fractional GPU count ------------------------------------------------------------------


def test_a_fractional_gpu_count_is_refused_naming_resource_gpu(root: Path) -> None:
    """Resource(gpu=0.5) is refused at the dry run naming resource.gpu and 0.5 (it used to pass
    and, rounded to 0, left the replica without CUDA_VISIBLE_DEVICES: every GPU of the host)."""
    s = LocalScheduler("gpu", local_root=root, gpu_count=4)
    app = AppDef("a", [Role("main", "x", "true", resource=Resource(cpu=1, gpu=0.5, memMB=100))])
    with pytest.raises(InvalidAppDefException, match=r"role 'main': resource\.gpu .*0\.5"):
        s.submit_dryrun(app, {"auto_set_cuda_visible_devices": True})


def test_a_whole_float_gpu_count_is_accepted_and_gets_its_gpus(root: Path) -> None:
    """Resource(gpu=2.0) is two GPUs: accepted, and given a slice of two devices."""
    s = LocalScheduler("gpu", local_root=root, gpu_count=4)
    app = AppDef("a", [Role("main", "x", "true", resource=Resource(cpu=1, gpu=2.0, memMB=100))])
    info = s.submit_dryrun(app, {"auto_set_cuda_visible_devices": True})
    assert info.request.replicas[0].env["CUDA_VISIBLE_DEVICES"] == "0,1"


# --- a program that appears earlier on PATH --------------------------------------------------


@pytest.mark.parametrize("change", ["created", "made executable"])
async def test_a_program_that_appears_earlier_on_path_is_run_by_the_next_launch(
    root: Path, tmp_path: Path, change: str
) -> None:
    """Entrypoint 'tool' on PATH=first:second, only second/tool runnable at the first launch;
    once first/tool is created, or made executable (a chmod, which leaves its directory's mtime
    alone), the next launch runs it, as exec (and TorchX's Popen) would, although the launcher
    caches its PATH lookups."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    write_tool(second, "second")
    if change == "made executable":
        write_tool(first, "first", mode=0o644)
    role = Role("main", "x", "tool", env={"PATH": f"{first}:{second}"})
    async with LocalScheduler("cache", local_root=root) as s:
        a1 = await s.submit(AppDef("a", [role]), {})
        assert (await wait_for(s, a1)).state == AppState.SUCCEEDED
        assert await lines(s, a1) == ["second\n"]
        if change == "created":
            write_tool(first, "first")
        else:
            (first / "tool").chmod(0o755)
        a2 = await s.submit(AppDef("a", [role]), {})
        assert (await wait_for(s, a2)).state == AppState.SUCCEEDED
        assert await lines(s, a2) == ["first\n"]


# --- a run option that cannot be encoded -----------------------------------------------------


async def test_a_log_dir_that_cannot_be_encoded_is_refused_naming_log_dir(
    sched: LocalScheduler, tmp_path: Path
) -> None:
    """A log_dir holding a lone surrogate ('\\ud800': no bytes can name it) is refused at the dry
    run with InvalidRunConfigException naming log_dir and the value, as a NUL byte is, rather
    than failing the launch with a bare UnicodeEncodeError."""
    app = AppDef("a", [Role("main", "x", "true")])
    with pytest.raises(InvalidRunConfigException, match=r"'log_dir'.*logs\\ud800") as info:
        sched.submit_dryrun(app, {"log_dir": f"{tmp_path}/logs\ud800"})
    assert info.value.cfg_key == "log_dir"


def test_run_options_that_cannot_be_encoded_are_refused_and_escaped_bytes_pass() -> None:
    """resolve refuses a lone surrogate in a str, a List[str] or a Dict[str, str] option, naming
    the option; the surrogate escape of an undecodable byte (U+DC80-U+DCFF, as os.fsdecode makes
    it) encodes back to its byte and passes."""
    opts = runopts()
    opts.add("path", str, "a path")
    opts.add("args", list[str], "arguments")
    opts.add("env", dict[str, str], "variables")
    for key, value in (("path", "a\ud800"), ("args", ["ok", "\udfff"]), ("env", {"K": "\ud800"})):
        with pytest.raises(InvalidRunConfigException, match=f"'{key}'") as info:
            opts.resolve({key: value})
        assert info.value.cfg_key == key
    escaped = os.fsdecode(b"logs\xff")
    assert opts.resolve({"path": escaped})["path"] == escaped


# --- a removed current directory -------------------------------------------------------------


def test_a_deleted_current_directory_is_named_at_the_dry_run(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """local_cwd from a process whose current directory was removed (a service that entered a
    per-request directory, since cleaned up): the dry run raises InvalidAppDefException naming
    the role and saying the current directory, local_cwd's image, no longer exists (it used to be
    a bare FileNotFoundError from os.getcwd() naming nothing)."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    s = LocalScheduler("cwd", local_root=root)
    with pytest.raises(
        InvalidAppDefException, match=r"role 'main': the current directory.*no longer exists"
    ):
        s.submit_dryrun(AppDef("a", [Role("main", "x", "true")]), {})


def test_a_relative_log_dir_from_a_deleted_current_directory_is_named(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """local_dir (the image is an absolute directory, so the current one is not needed for it)
    with a relative log_dir, from a current directory that was removed: InvalidRunConfigException
    naming log_dir and its value (a bare FileNotFoundError from os.path.abspath before)."""
    image = tmp_path / "image"
    image.mkdir()
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    s = LocalScheduler("cwd", "local_dir", local_root=root)
    with pytest.raises(InvalidRunConfigException, match=r"log_dir='logs'.*current directory"):
        s.submit_dryrun(AppDef("a", [Role("main", str(image), "true")]), {"log_dir": "logs"})
