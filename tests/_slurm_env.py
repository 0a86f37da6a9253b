"""Fixtures for the ``slurm`` tests against the real test cluster of ``scripts/engines/slurm.sh``.

Tests import what they use: ``from _slurm_env import slurm_cluster, slurm_scheduler, ...``.

- ``slurm_cluster`` checks (once per session) that ``sbatch`` exists and ``scontrol ping`` finds the
  controller UP with idle nodes; without them the test skips, or fails when
  ``ASYNCTORCHX_REQUIRE_ENGINES=1`` (CI), like every engine-backed test.
- ``accounting`` parametrizes a test over the two ways the backend runs: with ``sacct``
  (``acct``) and with ``squeue`` only (``noacct``, as on clusters without accounting). The
  environment variable ``ASYNCTORCHX_SLURM_ACCOUNTING`` = ``on``, ``off`` or ``both`` (default)
  picks which of them run.
- ``slurm_scheduler`` is a ``SlurmScheduler`` in that mode whose commands go through a
  ``CountingRunner`` (the real subprocess runner, counted); every job it submitted is scancelled at
  teardown.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import pytest
from conftest import engine_missing

from asynctorchx.schedulers._slurm.commands import CommandResult, CommandRunner, SubprocessRunner
from asynctorchx.schedulers.api import DescribeAppResponse
from asynctorchx.schedulers.slurm import SlurmScheduler
from asynctorchx.specs.api import AppState, is_terminal

SETUP_HINT = "run `bash scripts/engines/slurm.sh`"
REPO = Path(__file__).resolve().parents[1]


def _modes() -> list[bool]:
    choice = os.environ.get("ASYNCTORCHX_SLURM_ACCOUNTING", "both").lower()
    return {"on": [True], "off": [False]}.get(choice, [True, False])


class CountingRunner:
    """Runs the Slurm commands for real and counts them by program (``squeue``, ``sacct``...)."""

    def __init__(self, inner: CommandRunner | None = None) -> None:
        self.inner = inner or SubprocessRunner()
        self.counts: Counter[str] = Counter()
        self.submitted: list[str] = []

    async def __call__(self, argv: Sequence[str], *, stdin: str | None = None) -> CommandResult:
        self.counts[argv[0]] += 1
        result = await self.inner(argv, stdin=stdin)
        if argv[0] == "sbatch" and result.returncode == 0:
            self.submitted.append(result.stdout.strip().split(";")[0])
        return result


def _cluster_problem() -> str | None:
    if shutil.which("sbatch") is None:
        return "the Slurm commands (sbatch not on PATH)"
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=20)
        nodes = subprocess.run(
            ["sinfo", "-h", "-N", "-p", "debug", "-o", "%N %t"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"a Slurm controller ({e})"
    if "is UP" not in ping.stdout:
        return f"a running Slurm controller ({ping.stdout.strip() or ping.stderr.strip()})"
    usable = {
        ln.split()[0]
        for ln in nodes.stdout.splitlines()
        if ln.split()[-1:] and ln.split()[-1] in ("idle", "mix", "alloc")
    }
    if len(usable) < 4:
        return f"4 usable Slurm nodes (found: {nodes.stdout.split() or 'none'})"
    return None


_PROBLEM: list[str | None] = []


@pytest.fixture
def slurm_cluster() -> None:
    """The test cluster answers (controller UP, 4 usable nodes; checked once); else skip/fail."""
    if not _PROBLEM:
        _PROBLEM.append(_cluster_problem())
    if _PROBLEM[0] is not None:
        engine_missing(f"{_PROBLEM[0]} ({SETUP_HINT})")


@pytest.fixture(params=_modes(), ids=lambda acct: "acct" if acct else "noacct")
def accounting(request: pytest.FixtureRequest) -> bool:
    """True: the backend uses sacct; False: squeue only (a cluster without accounting)."""
    return bool(request.param)


@pytest.fixture
def slurm_session() -> str:
    """A session name no other test uses."""
    return f"pytest-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    """A job directory for the test's apps (slurmd runs as root here, so any path works)."""
    d = tmp_path / "jobs"
    d.mkdir()
    return d


def scancel(ids: Sequence[str]) -> None:
    """Cancels jobs left behind by a test (synchronously, at teardown)."""
    if ids:
        subprocess.run(["scancel", *ids], capture_output=True, timeout=30, check=False)


@pytest.fixture
def slurm_runner() -> Iterator[CountingRunner]:
    """The real command runner, counting the commands; what it submitted is scancelled at teardown."""
    runner = CountingRunner()
    yield runner
    scancel(runner.submitted)


@pytest.fixture
async def slurm_scheduler(
    slurm_cluster: None, accounting: bool, slurm_session: str, slurm_runner: CountingRunner
) -> AsyncIterator[SlurmScheduler]:
    """A SlurmScheduler in the test's accounting mode whose commands go through ``slurm_runner``."""
    sched = SlurmScheduler(slurm_session, runner=slurm_runner, accounting=accounting)
    try:
        yield sched
    finally:
        await sched.close()


async def wait_for_state(
    sched: SlurmScheduler,
    app_id: str,
    states: set[AppState] | None = None,
    timeout: float = 60.0,
    poll: float = 0.2,
) -> DescribeAppResponse:
    """Polls describe (bounded) until the app is in one of ``states`` (default: any terminal one)."""
    deadline = time.monotonic() + timeout
    last: DescribeAppResponse | None = None
    while time.monotonic() < deadline:
        last = await sched.describe(app_id)
        assert last is not None, f"Slurm does not know app {app_id}"
        if (states is None and is_terminal(last.state)) or (states and last.state in states):
            return last
        if states and is_terminal(last.state):
            raise AssertionError(
                f"app {app_id} ended {last.state} ({last.msg}) before reaching {states}"
            )
        await asyncio.sleep(poll)
    raise TimeoutError(f"app {app_id} still {last and last.state} after {timeout}s")
