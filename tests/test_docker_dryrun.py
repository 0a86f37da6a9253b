"""The local_docker dry run: AppDef + cfg -> container and network requests (pure, golden files)."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest

from asynctorchx.schedulers._docker.request import (
    LABEL_VERSION,
    RANK0_ENV,
    build_job,
    copied_env,
    replica_hostnames,
)
from asynctorchx.schedulers.docker import DockerScheduler, create_scheduler
from asynctorchx.specs import (
    AppDef,
    BindMount,
    DeviceMount,
    InvalidAppDefException,
    InvalidRunConfigException,
    Resource,
    RetryPolicy,
    Role,
    VolumeMount,
    macros,
)

GOLDEN = Path(__file__).parent / "golden" / "docker"
UPDATE = os.environ.get("ASYNCTORCHX_UPDATE_GOLDEN") == "1"
IMAGE = "asynctorchx-test/busybox:latest"


def _normalized(info_request: object) -> str:
    """The request as JSON, with the random app id and the library version replaced."""
    data = info_request.to_json()  # type: ignore[attr-defined]
    text = json.dumps(data, indent=2) + "\n"
    text = text.replace(data["app_id"], "<APP_ID>")
    return re.sub(
        rf'"{re.escape(LABEL_VERSION)}": "[^"]*"', f'"{LABEL_VERSION}": "<VERSION>"', text
    )


def _check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if not path.exists():
        pytest.fail(
            f"missing golden file {path}; run with ASYNCTORCHX_UPDATE_GOLDEN=1 to create it"
        )
    assert text == path.read_text(), (
        f"{name} differs from the golden file (ASYNCTORCHX_UPDATE_GOLDEN=1 rewrites it)"
    )


def _scheduler() -> DockerScheduler:
    return DockerScheduler("golden", watch_events=False)


def test_single_container_app_matches_golden() -> None:
    """One replica: one container on the default bridge, no network of its own, macros substituted."""
    app = AppDef(
        name="echo",
        roles=[
            Role(
                name="echo",
                image=IMAGE,
                entrypoint="sh",
                args=["-c", f"echo {macros.app_id} {macros.replica_id} {macros.img_root}."],
            )
        ],
    )
    info = _scheduler().submit_dryrun(app, {})
    _check_golden("single.json", _normalized(info.request))


def test_multi_role_app_with_every_option_matches_golden(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two roles (2 + 1 replicas) with env, copy_env, resources, mounts, ports, retries, privileged,
    stop_timeout and remove_finished give the golden network and container requests."""
    monkeypatch.setenv("ATX_GOLDEN_A", "from-copy-env")
    monkeypatch.setenv("ATX_GOLDEN_B", "overridden")
    trainer = Role(
        name="trainer",
        image=IMAGE,
        entrypoint="python3",
        args=["train.py", "--rank", macros.replica_id, "--out", f"/out/{macros.app_id}"],
        env={"ROLE_ENV": "r-${replica_id}", "ATX_GOLDEN_B": "role-wins"},
        num_replicas=2,
        max_retries=2,
        retry_policy=RetryPolicy.REPLICA,
        resource=Resource(cpu=1, gpu=0, memMB=512),
        port_map={"tensorboard": 6006},
        mounts=[
            BindMount(src_path="/data", dst_path="/data", read_only=True),
            VolumeMount(src="ckpt", dst_path="/ckpt"),
            DeviceMount(src_path="/dev/fuse", dst_path="/dev/fuse", permissions="rw"),
        ],
    )
    ps = Role(
        name="param_server",
        image="asynctorchx-test/python:3.11",
        entrypoint="python3",
        args=["-m", "ps"],
        max_retries=1,
        retry_policy=RetryPolicy.APPLICATION,
        resource=Resource(cpu=0.5, gpu=0, memMB=64),
    )
    cfg = {
        "copy_env": ["ATX_GOLDEN_*"],
        "env": {"FROM_CFG": "1"},
        "privileged": True,
        "stop_timeout": 3,
        "remove_finished": True,
    }
    info = _scheduler().submit_dryrun(AppDef(name="My Trainer!", roles=[trainer, ps]), cfg)
    _check_golden("multi_role.json", _normalized(info.request))


def test_shared_network_and_gpus_match_golden() -> None:
    """The network run option puts every container on that network (none is created); GPUs become
    a device request and an EFA device count becomes device mounts."""
    role = Role(
        name="worker",
        image=IMAGE,
        entrypoint="sleep",
        args=["1"],
        num_replicas=2,
        resource=Resource(cpu=2, gpu=1, memMB=1024, devices={"vpc.amazonaws.com/efa": 2}),
    )
    info = _scheduler().submit_dryrun(AppDef("gpu", [role]), {"network": "my-net"})
    _check_golden("shared_network.json", _normalized(info.request))


def test_dryrun_has_no_side_effects_and_leaves_the_app_unchanged() -> None:
    """submit_dryrun touches no engine (no client is ever created) and does not modify the AppDef."""
    role = Role(name="r", image=IMAGE, entrypoint="echo", args=[macros.replica_id], num_replicas=2)
    app = AppDef("a", [role])
    scheduler = _scheduler()
    info = scheduler.submit_dryrun(app, {})
    assert not scheduler.engine.started
    assert role.args == [macros.replica_id]
    assert info.app is app and info.scheduler == "local_docker"
    assert str(info).startswith("{") and info.request.app_id in str(info)


def test_env_precedence_copy_env_then_env_option_then_role_env_then_rank0() -> None:
    """Role env beats the env run option, which beats copy_env; TORCHX_RANK0_HOST is always set."""
    role = Role(
        name="r",
        image=IMAGE,
        entrypoint="env",
        env={"B": "role", RANK0_ENV: "ignored"},
        num_replicas=2,
    )
    job = build_job(
        AppDef("a", [role]),
        {"copy_env": ["A*", "B"], "env": {"AB": "cfg", "C": "cfg"}},
        app_id="a-1234",
        session_name="s",
        environ={"AA": "copied", "AB": "copied", "B": "copied", "ZZ": "not copied"},
    )
    envs = [dict(e.split("=", 1) for e in c.config["Env"]) for c in job.containers]
    assert envs[0] == {
        "AA": "copied",
        "AB": "cfg",
        "B": "role",
        "C": "cfg",
        RANK0_ENV: "a-1234-r-0",
    }
    assert envs[1][RANK0_ENV] == "a-1234-r-0"


def test_copy_env_matches_globs_and_sorts() -> None:
    """copy_env keeps the variables matching any glob, sorted by name."""
    env = copied_env(["X_*", "Y"], {"X_2": "b", "X_1": "a", "Y": "y", "YY": "no"})
    assert list(env.items()) == [("X_1", "a"), ("X_2", "b"), ("Y", "y")]


def test_hostnames_are_dns_labels_unique_per_role_and_within_63_chars() -> None:
    """Role names that are not DNS labels or too long get a short hashed form; none collide."""
    long_a = "a" * 40 + "_one"
    long_b = "a" * 40 + "_two"
    roles = [
        Role(name="Trainer_X", image=IMAGE, entrypoint="x"),
        Role(name=long_a, image=IMAGE, entrypoint="x", num_replicas=12),
        Role(name=long_b, image=IMAGE, entrypoint="x"),
        Role(name="ps", image=IMAGE, entrypoint="x"),
    ]
    app_id = "a" * 31 + "-abcdefgh"
    names = replica_hostnames(app_id, roles)
    flat = [h for hosts in names.values() for h in hosts]
    assert len(set(flat)) == len(flat) == 15
    assert all(re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", h) for h in flat)
    assert names["ps"] == [f"{app_id}-ps-0"]
    assert names["Trainer_X"][0].startswith(f"{app_id}-trainer-x-")


@pytest.mark.parametrize(
    ("role_kwargs", "field"),
    [
        ({"mounts": [BindMount(src_path="data", dst_path="/data")]}, "mounts[0].src_path"),
        ({"mounts": [VolumeMount(src="bad/name", dst_path="/v")]}, "mounts[0].src"),
        ({"mounts": [DeviceMount(src_path="fuse", dst_path="/dev/fuse")]}, "mounts[0].src_path"),
        ({"resource": Resource(cpu=1, gpu=0, memMB=3)}, "resource.memMB"),
        ({"resource": Resource(cpu=0.001, gpu=0, memMB=0)}, "resource.cpu"),
        (
            {"resource": Resource(cpu=1, gpu=0, memMB=64, devices={"x.io/foo": 1})},
            "resource.devices",
        ),
        ({"port_map": {"http": 0}}, "port_map['http']"),
        ({"mounts": [BindMount(src_path="/tmp", dst_path="/x\0y")]}, "mounts[0].dst_path"),
        ({"mounts": [BindMount(src_path="/tm\0p", dst_path="/x")]}, "mounts[0].src_path"),
        ({"mounts": [DeviceMount(src_path="/dev/n\0", dst_path="/x")]}, "mounts[0].src_path"),
        ({"resource": Resource(cpu=math.nan, gpu=0, memMB=0)}, "resource.cpu"),
        ({"resource": Resource(cpu=math.inf, gpu=0, memMB=0)}, "resource.cpu"),
        ({"resource": Resource(cpu=1e300, gpu=0, memMB=0)}, "resource.cpu"),
        ({"resource": Resource(cpu=1, gpu=math.inf, memMB=0)}, "resource.gpu"),
        ({"resource": Resource(cpu=1, gpu=0, memMB=math.inf)}, "resource.memMB"),
        ({"resource": Resource(cpu=1, gpu=0, memMB=10**20)}, "resource.memMB"),
        ({"resource": Resource(cpu=10**400, gpu=0, memMB=0)}, "resource.cpu"),
        ({"num_replicas": 10**9}, "num_replicas"),  # (built container by container: out of memory)
    ],
)
def test_values_docker_cannot_take_fail_the_dryrun_naming_the_field(
    role_kwargs: dict[str, object], field: str
) -> None:
    """Bad mounts, resources and ports raise InvalidAppDefException naming the role and field."""
    role = Role(name="bad", image=IMAGE, entrypoint="true", **role_kwargs)  # type: ignore[arg-type]
    with pytest.raises(InvalidAppDefException) as info:
        _scheduler().submit_dryrun(AppDef("a", [role]), {})
    assert info.value.field_name == field
    assert "role 'bad'" in str(info.value) and field in str(info.value)


def test_bad_run_options_fail_the_dryrun_naming_the_option() -> None:
    """A wrongly typed run option or a negative or too large stop_timeout is a clear error naming it."""
    app = AppDef("a", [Role(name="r", image=IMAGE, entrypoint="true")])
    with pytest.raises(InvalidRunConfigException, match="privileged"):
        _scheduler().submit_dryrun(app, {"privileged": "yes"})
    with pytest.raises(InvalidAppDefException, match="stop_timeout"):
        _scheduler().submit_dryrun(app, {"stop_timeout": -1})
    with pytest.raises(InvalidAppDefException, match=r"stop_timeout .*100000000000000000000"):
        _scheduler().submit_dryrun(app, {"stop_timeout": 10**20})
    with pytest.raises(InvalidAppDefException, match="network"):
        _scheduler().submit_dryrun(app, {"network": "bad name"})


def test_run_opts_lists_the_docker_options() -> None:
    """run_opts declares copy_env, env, privileged, network, remove_finished and stop_timeout."""
    opts = create_scheduler("s").run_opts()
    assert {k for k, _ in opts} == {
        "copy_env",
        "env",
        "privileged",
        "network",
        "remove_finished",
        "stop_timeout",
    }
    assert opts.get("remove_finished").default is False  # type: ignore[union-attr]
    assert "remove_finished" in repr(opts)
