"""The launcher side of tracking: parent_run_id and .torchxconfig's tracker sections become role env."""

from __future__ import annotations

import json
import os
import textwrap
import warnings
from pathlib import Path

import pytest
from _torchx_env import run_torchx

from asynctorchx import AsyncRunner
from asynctorchx.runner.config import ConfigFileError, apply, configured_trackers
from asynctorchx.specs import AppDef, Role
from asynctorchx.specs.errors import ConfigWarning
from asynctorchx.tracker.api import TrackerSetting

TRACKER_KEYS = ("TORCHX_JOB_ID", "TORCHX_PARENT_RUN_ID", "TORCHX_TRACKERS")


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A .torchxconfig named by TORCHXCONFIG with two trackers; no tracker variables inherited."""
    path = tmp_path / ".torchxconfig"
    path.write_text(
        textwrap.dedent(
            """
            [torchx:tracker]
            fsspec =
            mine = my_pkg.trackers:create

            [tracker:fsspec]
            config = /shared/tracker.conf
            """
        )
    )
    monkeypatch.setenv("TORCHXCONFIG", str(path))
    for key in list(os.environ):
        if key.startswith("TORCHX_") and key != "TORCHX_RANK0_HOST":
            monkeypatch.delenv(key)
    return path


def two_roles() -> AppDef:
    return AppDef(
        "app",
        [
            Role("trainer", image=".", entrypoint="python", env={"A": "1"}, num_replicas=2),
            Role("reader", image=".", entrypoint="python"),
        ],
    )


def tracker_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith((*TRACKER_KEYS, "TORCHX_TRACKER_"))}


def test_dryrun_puts_tracking_env_into_every_role(config: Path) -> None:
    """Every role gets the job id, the parent run, the tracker names, configs and factories."""
    app = two_roles()
    info = AsyncRunner("sess").dryrun(app, "local_cwd", parent_run_id="sweep-7")
    assert info.app is not None
    expected = {
        "TORCHX_JOB_ID": "local_cwd://sess/${app_id}",
        "TORCHX_PARENT_RUN_ID": "sweep-7",
        "TORCHX_TRACKERS": "fsspec,mine",
        "TORCHX_TRACKER_FSSPEC_CONFIG": "/shared/tracker.conf",
        "TORCHX_TRACKER_MINE_FACTORY": "my_pkg.trackers:create",
    }
    for role in info.app.roles:
        assert tracker_env(role.env) == expected
    assert info.app.roles[0].env["A"] == "1"
    assert app.roles[0].env == {"A": "1"} and app.roles[1].env == {}, (
        "the caller's app is untouched"
    )
    request = str(info)
    app_id = request.split("app_id: ")[1].split()[0]
    assert f"env TORCHX_JOB_ID=local_cwd://sess/{app_id}" in request
    assert request.count("env TORCHX_PARENT_RUN_ID=sweep-7") == 3


def test_parent_run_id_argument_wins_over_the_environment(
    config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$TORCHX_PARENT_RUN_ID is the default; an explicit parent_run_id= replaces it."""
    runner = AsyncRunner("sess")
    monkeypatch.setenv("TORCHX_PARENT_RUN_ID", "from-env")
    env = runner.dryrun(two_roles(), "local_cwd").app.roles[0].env  # type: ignore[union-attr]
    assert env["TORCHX_PARENT_RUN_ID"] == "from-env"
    env = runner.dryrun(two_roles(), "local_cwd", parent_run_id="explicit").app.roles[0].env  # type: ignore[union-attr]
    assert env["TORCHX_PARENT_RUN_ID"] == "explicit"


def test_without_parent_or_trackers_only_the_job_id_is_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No config and no parent: roles get TORCHX_JOB_ID alone (as TorchX)."""
    monkeypatch.setenv("TORCHXCONFIG", "")
    monkeypatch.delenv("TORCHX_PARENT_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHX_TRACKERS", raising=False)
    info = AsyncRunner("s").dryrun(two_roles(), "local_docker")
    assert info.app is not None
    assert tracker_env(info.app.roles[1].env) == {"TORCHX_JOB_ID": "local_docker://s/${app_id}"}


@pytest.mark.parametrize("bad", ["", "   ", "a\0b", "two\nlines", 7])
def test_invalid_parent_run_ids_are_rejected_naming_the_field(config: Path, bad: object) -> None:
    """An empty, NUL-carrying, multi-line or non-string parent_run_id is a ValueError naming it."""
    with pytest.raises(ValueError, match="parent_run_id"):
        AsyncRunner("s").dryrun(two_roles(), "local_cwd", parent_run_id=bad)  # type: ignore[arg-type]


def test_launcher_environment_overrides_names_and_configs(
    config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$TORCHX_TRACKERS replaces the configured names and $TORCHX_TRACKER_<N>_CONFIG a config."""
    monkeypatch.setenv("TORCHX_TRACKERS", "fsspec")
    monkeypatch.setenv("TORCHX_TRACKER_FSSPEC_CONFIG", "/other.conf")
    assert configured_trackers() == [TrackerSetting("fsspec", "/other.conf", None)]


def test_tracker_sections_are_read_not_warned_about(config: Path) -> None:
    """[torchx:tracker] and [tracker:NAME] are no longer reported as ignored sections."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        apply("local_cwd", {})
        assert configured_trackers() == [
            TrackerSetting("fsspec", "/shared/tracker.conf", None),
            TrackerSetting("mine", None, "my_pkg.trackers:create"),
        ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[torchx:tracker]\nfsspec =\n[tracker:fsspec]\nconfig = x\nconfg = y\n", "confg = y"),
        ("[torchx:tracker]\nfsspec =\n[tracker:orphan]\nconfig = x\n", r"\[tracker:orphan\]"),
        ("[torchx:trackers]\nfsspec =\n", r"\[torchx:trackers\] is ignored"),
    ],
)
def test_misspelt_tracker_config_is_warned_about(config: Path, text: str, message: str) -> None:
    """An unknown key of [tracker:NAME], a tracker nobody lists, or [torchx:X] get a ConfigWarning."""
    config.write_text(text)
    with pytest.warns(ConfigWarning, match=message):
        configured_trackers()
        apply("local_cwd", {})


def test_an_invalid_tracker_name_is_an_error_naming_it(config: Path) -> None:
    """A tracker name that cannot be part of an environment variable name fails with the file named."""
    config.write_text("[torchx:tracker]\nmy tracker =\n")
    with pytest.raises(ConfigFileError, match="'my tracker'"):
        configured_trackers()


def test_the_same_env_as_torchx_runner_dryrun(config: Path) -> None:
    """TorchX 0.7's Runner.dryrun puts the same tracking variables into the roles as ours."""
    config.write_text("[torchx:tracker]\nfsspec = fsspec\n\n[tracker:fsspec]\nconfig = /t.conf\n")
    code = """
        import json
        from torchx.runner import get_runner
        from torchx.specs import AppDef, Role
        app = AppDef("app", [Role("w", image=".", entrypoint="python")])
        get_runner("sess").dryrun(app, "local_cwd", parent_run_id="sweep-3")
        print(json.dumps(app.roles[0].env))
    """
    theirs = json.loads(run_torchx(code).strip().splitlines()[-1])
    info = AsyncRunner("sess").dryrun(
        AppDef("app", [Role("w", image=".", entrypoint="python")]),
        "local_cwd",
        parent_run_id="sweep-3",
    )
    assert info.app is not None
    assert tracker_env(info.app.roles[0].env) == tracker_env(theirs)
    assert tracker_env(theirs)["TORCHX_TRACKERS"] == "fsspec"
