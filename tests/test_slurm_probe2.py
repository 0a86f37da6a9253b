# ruff: noqa: F811 - the fixtures imported from _slurm_env are redefined as test parameters
"""Probes of the slurm backend's submit-time limits: against the real test clusters where Slurm's
own behaviour is the point, against a fake command runner for the error paths.

Each test pins a defect found by probing: it failed before its fix.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from _slurm_env import (  # noqa: F401 - pytest fixtures, used as test parameters
    CountingRunner,
    accounting,
    slurm_runner,
    slurm_scheduler,
    slurm_session,
)

from asynctorchx.schedulers._slurm.parse import expand_hostlist
from asynctorchx.schedulers.slurm import (
    CommandResult,
    SlurmScheduler,
    SlurmSubmitError,
    SubprocessRunner,
)
from asynctorchx.specs.api import AppDef, InvalidAppDefException, Resource, Role

SMALL = Resource(cpu=1, gpu=0, memMB=64)


def _app(replicas: int) -> AppDef:
    role = Role("w", "/tmp", entrypoint="true", num_replicas=replicas, resource=SMALL)
    return AppDef("wide", [role])


def _partition_nodes(partition: str) -> set[str]:
    """The nodes of one partition of the test's cluster."""
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-p", partition, "-o", "%N"],
        capture_output=True,
        text=True,
        check=True,
        timeout=20,
    ).stdout
    return set(out.split())


@pytest.mark.slurm
@pytest.mark.timeout(60)
async def test_partitions_that_share_their_nodes_count_each_node_once(
    slurm_scheduler: SlurmScheduler, slurm_runner: CountingRunner, tmp_path: Path
) -> None:
    """An app wider than the nodes of 'debug,short' (two partitions of the same nodes) is refused:
    their node counts were added up, and the job Slurm accepted stayed PENDING (Resources)."""
    nodes = _partition_nodes("debug") | _partition_nodes("short")
    assert nodes == _partition_nodes("debug"), "the test clusters' partitions share their nodes"
    cfg = {"job_dir": str(tmp_path / "jobs"), "partition": "debug,short"}
    with pytest.raises(InvalidAppDefException, match=f"they have {len(nodes)} nodes"):
        await slurm_scheduler.submit(_app(len(nodes) + 1), cfg)
    assert slurm_runner.counts["sbatch"] == 0 and not (tmp_path / "jobs").exists()


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node[1-3,07],gpu1", {"node1", "node2", "node3", "node07", "gpu1"}),
        ("r[1-2]n[01-02]", {"r1n01", "r1n02", "r2n01", "r2n02"}),
        ("node[8-10]-ib", {"node8-ib", "node9-ib", "node10-ib"}),
        ("(null)", set()),
        ("n[1-4", None),
        ("n[a-b]", None),
        ("n[5-1]", None),
        ("n[0-2000000]", None),
    ],
)
def test_host_lists_expand_to_their_hosts(text: str, hosts: set[str] | None) -> None:
    """A Slurm host list expression gives its host names (zero padding kept, several bracket
    groups multiplied); one this cannot read, or naming over a million hosts, gives None."""
    assert expand_hostlist(text) == hosts


PARTITIONS = (
    "PartitionName=small Default=YES Nodes=n[1-2] TotalNodes=2\n"
    "PartitionName=big Default=NO Nodes=n[1-8] TotalNodes=8\n"
)


class FakeSlurm:
    """Answers scontrol with ``PARTITIONS`` and sbatch with job 7; records every command."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    async def __call__(self, argv: Sequence[str], *, stdin: str | None = None) -> CommandResult:
        self.calls.append(tuple(argv))
        out = {"scontrol": PARTITIONS, "sbatch": "7\n"}.get(argv[0], "")
        return CommandResult(tuple(argv), 0, out, "")


@pytest.mark.parametrize(
    ("env", "cfg", "replicas", "refused"),
    [
        ({"SBATCH_PARTITION": "big"}, {}, 8, False),  # not the 2-node default partition
        ({"SBATCH_PARTITION": "big"}, {"partition": "small"}, 8, False),  # over the script's
        ({"SBATCH_PARTITION": "small"}, {"partition": "big"}, 3, True),
        ({"SBATCH_PARTITION": ""}, {}, 3, True),  # empty: unset
        ({"SBATCH_CLUSTERS": "other"}, {}, 3, False),  # another cluster: not checked
        ({"SLURM_CLUSTERS": "other"}, {}, 3, False),
    ],
)
async def test_the_partition_checked_is_the_one_sbatch_takes_from_the_environment(
    env: dict[str, str],
    cfg: dict[str, Any],
    replicas: int,
    refused: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SBATCH_PARTITION (which sbatch puts before the script's --partition and the default
    partition) is the partition whose nodes are counted, and SBATCH_CLUSTERS/SLURM_CLUSTERS skip
    the check: the default or cfg partition was checked, refusing apps the cluster would run."""
    for name in ("SBATCH_PARTITION", "SBATCH_CLUSTERS", "SLURM_CLUSTERS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    fake = FakeSlurm()
    sched = SlurmScheduler("s", runner=fake)
    cfg = {"job_dir": str(tmp_path / "jobs"), **cfg}
    if not refused:
        assert await sched.submit(_app(replicas), cfg) == "7"
        return
    with pytest.raises(InvalidAppDefException, match=r"partition 'small' .* it has 2 nodes"):
        await sched.submit(_app(replicas), cfg)
    assert not any(call[0] == "sbatch" for call in fake.calls)


def test_the_command_runner_tells_the_environment_its_commands_get() -> None:
    """SubprocessRunner.environ is what sbatch reads SBATCH_* options from: the process's
    environment, with the runner's extra variables over it."""
    assert SubprocessRunner().environ is os.environ
    env = SubprocessRunner(env={"SBATCH_PARTITION": "big"}).environ
    assert env["SBATCH_PARTITION"] == "big" and env["PATH"] == os.environ["PATH"]


def _commands(tmp_path: Path, sbatch: str) -> tuple[SubprocessRunner, Path]:
    """A real runner whose PATH starts with an ``sbatch`` running ``sbatch`` (sh) and a
    ``scontrol`` that hangs (a controller that does not answer), each call of it written to the
    returned file; commands are killed after 0.5 s."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol.calls"
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\ncat >/dev/null\n{sbatch}\n")
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$*" >>{calls}\nexec sleep 60\n')
    for name in ("sbatch", "scontrol"):
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return SubprocessRunner(env=env, timeout=0.5), calls


async def test_a_hung_scontrol_does_not_replace_sbatchs_refusal(tmp_path: Path) -> None:
    """When sbatch refuses a script as too long and scontrol (asked for max_script_size) hangs,
    the submit fails with sbatch's own refusal: it raised scontrol's TimeoutError instead."""
    runner, _ = _commands(
        tmp_path,
        "echo 'sbatch: error: Batch job submission failed: Pathname of a file, directory or "
        "other parameter too long' >&2; exit 1",
    )
    sched = SlurmScheduler("s", runner=runner)
    with anyio.fail_after(20), pytest.raises(SlurmSubmitError, match="parameter too long"):
        await sched.submit(_app(1), {"job_dir": str(tmp_path / "jobs")})


async def test_a_hung_scontrol_leaves_the_partition_unchecked_once_per_ttl(tmp_path: Path) -> None:
    """When scontrol (asked for the partitions' node counts) hangs, apps are submitted unchecked
    as when it fails, and the next submits do not wait for it again while the answer would be
    trusted: the submit raised scontrol's TimeoutError."""
    runner, calls = _commands(tmp_path, "echo 7")
    sched = SlurmScheduler("s", runner=runner)
    with anyio.fail_after(20):
        for _ in range(3):
            assert await sched.submit(_app(2), {"job_dir": str(tmp_path / "jobs")}) == "7"
    assert calls.read_text().splitlines() == ["--all --oneliner show partition"]


async def test_submits_at_once_share_one_partition_lookup(tmp_path: Path) -> None:
    """Twenty apps of several replicas submitted at once (a sweep's start) ask scontrol for the
    partitions once: each ran its own scontrol while none had answered yet."""
    called, release = asyncio.Event(), asyncio.Event()
    fake = FakeSlurm()

    async def runner(argv: Sequence[str], *, stdin: str | None = None) -> CommandResult:
        if argv[0] == "scontrol":
            called.set()
            await release.wait()
        return await fake(argv, stdin=stdin)

    sched = SlurmScheduler("s", runner=runner)
    cfg = {"job_dir": str(tmp_path / "jobs")}
    try:
        with anyio.fail_after(20):
            submits = [asyncio.ensure_future(sched.submit(_app(2), cfg)) for _ in range(20)]
            await called.wait()  # every submit has reached the lookup: they started before it
            release.set()
            assert await asyncio.gather(*submits) == ["7"] * 20
    finally:
        await sched.close()
    assert [c for c in fake.calls if c[0] == "scontrol"] == [
        ("scontrol", "--all", "--oneliner", "show", "partition")
    ]
