"""Fixtures for the ``slurm`` tests against the real test cluster of ``scripts/engines/slurm.sh``.

Tests import what they use: ``from _slurm_env import slurm_cluster, slurm_scheduler, ...``.

- ``slurm_cluster`` checks (once per session) that ``sbatch`` exists and ``scontrol ping`` finds the
  controller UP with idle nodes; without them the test skips, or fails when
  ``ASYNCTORCHX_REQUIRE_ENGINES=1`` (CI), like every engine-backed test.
- ``accounting`` parametrizes a test over the two clusters the backend is tested on, and selects
  (and checks, like ``slurm_cluster``) the one of the test:

  - ``acct``: the cluster of ``scripts/engines/slurm.sh`` (slurmdbd), the backend forced to use
    ``sacct`` (``accounting=True``);
  - ``noacct``: the second cluster of ``scripts/engines/slurm_noacct.sh``, which has no accounting
    at all (``sacct`` answers "Slurm accounting storage is disabled"). ``SLURM_CONF`` points at it
    for the whole test (every Slurm command the test or the backend starts inherits it), and the
    backend is left to find out by itself that there is no accounting (``accounting=None``).

  The environment variable ``ASYNCTORCHX_SLURM_ACCOUNTING`` = ``on``, ``off`` or ``both``
  (default) picks which of them run; ``ASYNCTORCHX_SLURM_NOACCT_CONF`` overrides the second
  cluster's config path.
- ``slurm_scheduler`` is a ``SlurmScheduler`` in that mode whose commands go through a
  ``CountingRunner`` (the real subprocess runner, counted); every job it submitted is scancelled at
  teardown (on the cluster it was submitted to).
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
from asynctorchx.specs.api import AppDef, AppState, Resource, Role, is_terminal

SETUP_HINT = "run `bash scripts/engines/slurm.sh`"
NOACCT_SETUP_HINT = "run `bash scripts/engines/slurm_noacct.sh`"
# The cluster with accounting is the one the environment names at start (usually /etc/slurm).
MAIN_CONF = os.environ.get("SLURM_CONF")
NOACCT_CONF = os.environ.get("ASYNCTORCHX_SLURM_NOACCT_CONF", "/etc/slurm-noacct/slurm.conf")
NO_ACCOUNTING_MESSAGE = "Slurm accounting storage is disabled"
REPO = Path(__file__).resolve().parents[1]


def _modes() -> list[bool]:
    choice = os.environ.get("ASYNCTORCHX_SLURM_ACCOUNTING", "both").lower()
    return {"on": [True], "off": [False]}.get(choice, [True, False])


def _env(conf: str | None) -> dict[str, str]:
    """The environment of a Slurm command for the cluster of ``conf`` (None: the main cluster)."""
    env = dict(os.environ)
    conf = conf or MAIN_CONF
    if conf is None:
        env.pop("SLURM_CONF", None)
    else:
        env["SLURM_CONF"] = conf
    return env


class CountingRunner:
    """Runs the Slurm commands for real and counts them by program (``squeue``, ``sacct``...).

    Each command goes to the cluster ``SLURM_CONF`` names when it runs; ``submitted`` keeps the
    ids it submitted and ``clusters`` the config each of them was submitted with.
    """

    def __init__(self, inner: CommandRunner | None = None) -> None:
        self.inner = inner or SubprocessRunner()
        self.counts: Counter[str] = Counter()
        self.submitted: list[str] = []
        self.clusters: dict[str, str | None] = {}

    async def __call__(self, argv: Sequence[str], *, stdin: str | None = None) -> CommandResult:
        self.counts[argv[0]] += 1
        conf = os.environ.get("SLURM_CONF")
        result = await self.inner(argv, stdin=stdin)
        if argv[0] == "sbatch" and result.returncode == 0:
            job_id = result.stdout.strip().split(";")[0]
            self.submitted.append(job_id)
            self.clusters[job_id] = conf
        return result


def _cluster_problem(conf: str | None = None) -> str | None:
    """What is missing of the cluster of ``conf`` (default: the main one), or None."""
    if shutil.which("sbatch") is None:
        return "the Slurm commands (sbatch not on PATH)"
    if conf is not None and not os.path.isfile(conf):
        return f"the Slurm cluster config {conf}"
    where = "" if conf is None else f" (SLURM_CONF={conf})"
    try:
        ping = subprocess.run(
            ["scontrol", "ping"], capture_output=True, text=True, timeout=20, env=_env(conf)
        )
        nodes = subprocess.run(
            ["sinfo", "-h", "-N", "-p", "debug", "-o", "%N %t"],
            capture_output=True,
            text=True,
            timeout=20,
            env=_env(conf),
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"a Slurm controller{where} ({e})"
    if "is UP" not in ping.stdout:
        return f"a running Slurm controller{where} ({ping.stdout.strip() or ping.stderr.strip()})"
    usable = {
        ln.split()[0]
        for ln in nodes.stdout.splitlines()
        if ln.split()[-1:] and ln.split()[-1] in ("idle", "mix", "alloc")
    }
    if len(usable) < 4:
        return f"4 usable Slurm nodes{where} (found: {nodes.stdout.split() or 'none'})"
    if conf is not None:
        # The point of that cluster: sacct must refuse for want of accounting.
        sacct = subprocess.run(
            ["sacct", "-n", "-X"], capture_output=True, text=True, timeout=20, env=_env(conf)
        )
        if sacct.returncode == 0 or NO_ACCOUNTING_MESSAGE not in sacct.stderr:
            return (
                f"a Slurm cluster without accounting{where} (sacct exited {sacct.returncode}: "
                f"{sacct.stderr.strip() or 'no error'})"
            )
    return None


_PROBLEMS: dict[str | None, str | None] = {}


def check_cluster(conf: str | None = None, hint: str = SETUP_HINT) -> None:
    """Skips/fails the test unless the cluster of ``conf`` answers (checked once per session)."""
    if conf not in _PROBLEMS:
        _PROBLEMS[conf] = _cluster_problem(conf)
    problem = _PROBLEMS[conf]
    if problem is not None:
        engine_missing(f"{problem} ({hint})")


@pytest.fixture
def slurm_cluster() -> None:
    """The test cluster answers (controller UP, 4 usable nodes; checked once); else skip/fail."""
    check_cluster()


@pytest.fixture(params=_modes(), ids=lambda acct: "acct" if acct else "noacct")
def accounting(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """The test's cluster, checked and selected. True: the cluster with accounting (the backend uses
    sacct); False: the cluster without accounting (``SLURM_CONF`` points at it for the test)."""
    if request.param:
        check_cluster()
    else:
        check_cluster(NOACCT_CONF, NOACCT_SETUP_HINT)
        monkeypatch.setenv("SLURM_CONF", NOACCT_CONF)
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


def scancel(ids: Sequence[str], conf: str | None = None) -> None:
    """Cancels jobs left behind by a test (synchronously, at teardown) on the cluster of ``conf``."""
    if ids:
        subprocess.run(
            ["scancel", *ids], capture_output=True, timeout=30, check=False, env=_env(conf)
        )


@pytest.fixture
def slurm_runner() -> Iterator[CountingRunner]:
    """The real command runner, counting the commands; what it submitted is scancelled at teardown."""
    runner = CountingRunner()
    yield runner
    for conf in dict.fromkeys(runner.clusters.values()):
        scancel([i for i, c in runner.clusters.items() if c == conf], conf)


@pytest.fixture
async def slurm_scheduler(
    accounting: bool, slurm_session: str, slurm_runner: CountingRunner
) -> AsyncIterator[SlurmScheduler]:
    """A SlurmScheduler on the test's cluster whose commands go through ``slurm_runner``: forced to
    use sacct on the cluster with accounting, left to detect it (``accounting=None``) on the other."""
    sched = SlurmScheduler(
        slurm_session, runner=slurm_runner, accounting=True if accounting else None
    )
    try:
        yield sched
    finally:
        await sched.close()
    if not accounting:
        assert sched.accounting is not True, "the backend found accounting on a cluster without it"


@pytest.fixture
async def slurm(
    slurm_cluster: None, slurm_session: str, slurm_runner: CountingRunner
) -> AsyncIterator[SlurmScheduler]:
    """A SlurmScheduler on the test cluster with accounting (its jobs are scancelled after the
    test)."""
    sched = SlurmScheduler(slurm_session, runner=slurm_runner)
    try:
        yield sched
    finally:
        await sched.close()


def sh_app(script: str, name: str = "sh", replicas: int = 1) -> AppDef:
    """An app of ``replicas`` small replicas running ``sh -c script`` (image ``/tmp``)."""
    role = Role(
        "trainer",
        image="/tmp",
        entrypoint="sh",
        args=["-c", script],
        resource=Resource(cpu=1, gpu=0, memMB=64),
        num_replicas=replicas,
    )
    return AppDef(name, [role])


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
