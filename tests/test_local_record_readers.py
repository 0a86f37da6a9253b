"""Readers of app records in another process (``LocalScheduler.describe``/``list`` of a second
scheduler, the CLI's fast and runner paths) against a launcher finishing an app between two of
their steps, and against corrupt record files (found by review).

The races are widened by pausing the reader in this process (fault injection) while the launcher, a
real separate process, goes on: a reader that read the record RUNNING and then found every process
gone re-reads it (the end may have been recorded meanwhile), and one that found no record and then
no claim re-reads it (the app may have been recorded, ended and its claim dropped meanwhile).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asynctorchx.cli import _fastpath
from asynctorchx.schedulers._local import recordfile
from asynctorchx.schedulers.local import LocalScheduler
from asynctorchx.specs import AppDef, RetryPolicy, Role
from asynctorchx.specs.serialize import appdef_to_dict

# A launcher: one app (``sh -c GATE``), waits for it, closes the scheduler, exits.
# With HOLD set, ``AppLauncher.launch`` first waits for the file $HOLD (the app is claimed,
# being submitted, no record yet).
LAUNCHER = r"""
import asyncio, os, sys
from asynctorchx.schedulers.local import LocalScheduler
from asynctorchx.schedulers._local import launch as L
from asynctorchx.specs import AppDef, Role, is_terminal
root, go, hold = sys.argv[1], sys.argv[2], os.environ.get("HOLD")
if hold:
    orig = L.AppLauncher.launch
    async def launch(self, app):
        while not os.path.exists(hold):
            await asyncio.sleep(0.01)
        await orig(self, app)
    L.AppLauncher.launch = launch
async def main():
    s = LocalScheduler("s", local_root=root)
    app = AppDef("toctou", roles=[Role("w", image=os.getcwd(), entrypoint="sh",
        args=["-c", f'while [ ! -e {go} ]; do sleep 0.01; done'])])
    info = s.submit_dryrun(app, {})
    print(info.request.app_id, flush=True)
    await s.schedule(info)
    while not is_terminal((await s.describe(info.request.app_id)).state):
        await asyncio.sleep(0.01)
    await s.close()
asyncio.run(main())
"""


def _start(root: Path, go: Path, hold: Path | None = None) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "ASYNCTORCHX_LOCAL_ROOT": str(root)}
    if hold is not None:
        env["HOLD"] = str(hold)
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(root), str(go)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    app_id = proc.stdout.readline().strip()
    proc.stdout.close()  # (it prints nothing more)
    return proc, app_id


def _record_state(root: Path, app_id: str) -> str | None:
    try:
        return recordfile.read_document(root / ".apps" / f"{app_id}.json")["state"]
    except (OSError, ValueError):
        return None


def _until(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "root"
    monkeypatch.setenv("ASYNCTORCHX_LOCAL_ROOT", str(root))
    monkeypatch.setenv("TORCHXCONFIG", "")  # (the fast path answers)
    return root


def _pause_lost_check(monkeypatch, root, proc, go, app_id):
    """On the reader's first liveness check (it has read the record RUNNING): the app is let go,
    its launcher records it SUCCEEDED and exits, its watchdog exits; then the check runs."""
    real = recordfile.lost_message
    calls = []

    def paused(state, owner, replicas):
        replicas = list(replicas)
        if not calls:
            assert state == "RUNNING"
            go.touch()
            proc.wait(timeout=30)
            _until(
                lambda: not recordfile.pid_alive(owner.watchdog_pid, owner.watchdog_start_ticks),
                "the watchdog to exit",
            )
            assert _record_state(root, app_id) == "SUCCEEDED"
        calls.append(state)
        return real(state, owner, replicas)

    monkeypatch.setattr(recordfile, "lost_message", paused)


@pytest.mark.timeout(60)
def test_fastpath_status_of_an_app_ending_as_it_is_read_is_its_end(
    env: Path, tmp_path: Path, monkeypatch
) -> None:
    go = tmp_path / "go"
    proc, app_id = _start(env, go)
    _until(lambda: _record_state(env, app_id) == "RUNNING", "the app to run")
    _pause_lost_check(monkeypatch, env, proc, go, app_id)
    found = _fastpath.status(f"local_cwd://s/{app_id}")
    assert found is not None and found[0] is not None
    # the record on disk says SUCCEEDED (checked in the hook), and says so to every later read
    assert found[0].state.name == "SUCCEEDED", found[0].msg


@pytest.mark.timeout(60)
def test_describe_of_an_app_ending_as_it_is_read_is_its_end(
    env: Path, tmp_path: Path, monkeypatch
) -> None:
    go = tmp_path / "go"
    proc, app_id = _start(env, go)
    _until(lambda: _record_state(env, app_id) == "RUNNING", "the app to run")
    _pause_lost_check(monkeypatch, env, proc, go, app_id)

    async def main():
        s = LocalScheduler("reader", local_root=str(env))
        try:
            first = await s.describe(app_id)
            again = await s.describe(app_id)
            return first, again
        finally:
            await s.close()

    first, again = asyncio.run(main())
    assert again is not None and again.state.name == "SUCCEEDED"
    assert first is not None and first.state.name == "SUCCEEDED", (
        f"{first.state.name} ({first.msg}) then {again.state.name}: a terminal state changed"
    )


def _pause_claim_check(monkeypatch, root, hold, app_id):
    """On the reader's claim check (it found no record: the app is being submitted): the launcher
    goes on, the app runs, ends, its record is terminal and its claim dropped; then the check."""
    real = recordfile.claim_holder

    def paused(records_dir, aid):
        if aid == app_id and not hold.exists():
            hold.touch()
            _until(lambda: _record_state(root, app_id) in ("SUCCEEDED", "FAILED"), "the app to end")
            _until(lambda: not (root / ".apps" / ".claims" / app_id).exists(), "the claim to go")
        return real(records_dir, aid)

    monkeypatch.setattr(recordfile, "claim_holder", paused)


@pytest.mark.timeout(60)
def test_fastpath_status_finds_an_app_recorded_as_its_claim_is_read(
    env: Path, tmp_path: Path, monkeypatch
) -> None:
    go, hold = tmp_path / "go", tmp_path / "hold"
    go.touch()  # the app ends as soon as it starts
    proc, app_id = _start(env, go, hold)
    _until(lambda: (env / ".apps" / ".claims" / app_id).exists(), "the claim")
    assert _record_state(env, app_id) is None  # being submitted
    _pause_claim_check(monkeypatch, env, hold, app_id)
    found = _fastpath.status(f"local_cwd://s/{app_id}")
    proc.wait(timeout=30)
    assert _record_state(env, app_id) == "SUCCEEDED"
    # the app existed all along (claimed, then recorded): "unknown app" is wrong
    assert found is None or found[0] is not None, "the fast path said the app does not exist"


@pytest.mark.timeout(60)
def test_describe_finds_an_app_recorded_as_its_claim_is_read(
    env: Path, tmp_path: Path, monkeypatch
) -> None:
    go, hold = tmp_path / "go", tmp_path / "hold"
    go.touch()
    proc, app_id = _start(env, go, hold)
    _until(lambda: (env / ".apps" / ".claims" / app_id).exists(), "the claim")
    _pause_claim_check(monkeypatch, env, hold, app_id)

    async def main():
        s = LocalScheduler("reader", local_root=str(env))
        try:
            return await s.describe(app_id)
        finally:
            await s.close()

    desc = asyncio.run(main())
    proc.wait(timeout=30)
    assert desc is not None, "describe said the app does not exist; its record says SUCCEEDED"


def _pause_held_claims(monkeypatch, root, hold, app_id):
    """On the listing's look at the claims (its listing of the records did not have the app): the
    launcher goes on, the app ends, its claim is dropped; then the claims are looked at."""
    real = recordfile.held_claims

    def paused(records_dir, recorded):
        if not hold.exists():
            hold.touch()
            _until(lambda: _record_state(root, app_id) == "SUCCEEDED", "the app to end")
            _until(lambda: not (root / ".apps" / ".claims" / app_id).exists(), "the claim to go")
        return real(records_dir, recorded)

    monkeypatch.setattr(recordfile, "held_claims", paused)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reader", ["fastpath", "scheduler"])
def test_list_finds_an_app_recorded_as_the_claims_are_read(
    env, tmp_path, monkeypatch, reader
) -> None:
    go, hold = tmp_path / "go", tmp_path / "hold"
    go.touch()
    proc, app_id = _start(env, go, hold)
    _until(lambda: (env / ".apps" / ".claims" / app_id).exists(), "the claim")
    _pause_held_claims(monkeypatch, env, hold, app_id)
    if reader == "fastpath":
        rows = _fastpath.list_apps("local_cwd")
        ids = None if rows is None else [r[1] for r in rows]
    else:

        async def main():
            s = LocalScheduler("reader", local_root=str(env))
            try:
                return [r.app_id for r in await s.list()]
            finally:
                await s.close()

        ids = asyncio.run(main())
    proc.wait(timeout=30)
    assert ids is None or app_id in ids, f"list {ids} misses {app_id} (claimed, then recorded)"


# -- corrupt records ---------------------------------------------------------------------------

GOOD = {
    "format": 1,
    "app_id": "good-1",
    "name": "good",
    "backend": "local_cwd",
    "session": "s",
    "state": "SUCCEEDED",
    "msg": "",
    "submitted_at": 1.0,
    "app_dir": "/nowhere",
    "owner": {"pid": 1, "start_ticks": 1},
    "replicas": [],
    "app": {},
}

_APP = appdef_to_dict(
    AppDef("bad", roles=[Role("w", image="/", entrypoint="true", retry_policy=RetryPolicy.REPLICA)])
)


def _bad(**fields) -> bytes:
    doc = {**GOOD, "app_id": "bad-1", "name": "bad", **fields}
    return json.dumps(doc, separators=(",", ":")).encode()


CASES = {
    # json.loads raises RecursionError (not a ValueError)
    "deeply-nested": b"[" * 100_000 + b"]" * 100_000,
    # float(10**400) / int(inf) raise OverflowError
    "huge-submitted_at": _bad().replace(b'"submitted_at":1.0', b'"submitted_at":' + b"9" * 400),
    "infinite-num_restarts": _bad()[:-1] + b',"num_restarts":1e400}',
    "infinite-replica-id": _bad(replicas=[{"role": "w", "id": 0}]).replace(
        b'"id":0', b'"id":1e400'
    ),
    # unchecked field types: crash later, in list (unhashable / len()) or describe (AppDef)
    "app_id-not-a-string": _bad(app_id=["x"]),
    "name-not-a-string": _bad(name=7),
    "roles-not-a-list": _bad(app={"name": "bad", "roles": 5}),
    # one flipped byte in the AppDef kept in the record (seen fuzzing real records)
    "retry_policy-one-byte-off": _bad(app=_APP).replace(b'"REPLICA"', b'"REP{ICA"'),
}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / ".apps").mkdir(parents=True, mode=0o700)
    (root / ".apps" / "good-1.json").write_bytes(json.dumps(GOOD).encode() + b"\n")
    return root


def _cli(
    root: Path, fastpath: bool, *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "ASYNCTORCHX_LOCAL_ROOT": str(root),
        "TORCHXCONFIG": "",
        "ASYNCTORCHX_CLI_FASTPATH": "1" if fastpath else "0",
    }
    return subprocess.run(
        [sys.executable, "-m", "asynctorchx", *args],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fastpath", [True, False], ids=["fast", "slow"])
@pytest.mark.parametrize("case", list(CASES))
def test_cli_reports_the_corrupt_record(root: Path, case: str, fastpath: bool) -> None:
    bad = root / ".apps" / "bad-1.json"
    bad.write_bytes(CASES[case] + b"\n")
    listed = _cli(root, fastpath, "list", "-s", "local_cwd")
    status = _cli(root, fastpath, "status", "local_cwd://s/bad-1")
    for run in (listed, status):
        assert "--debug for the traceback" not in run.stderr, run.stderr  # an internal error
        assert run.returncode in (0, 4), run.stderr
        if run.returncode == 4:
            assert str(bad) in run.stderr, run.stderr
    assert "local_cwd://s/good-1" in listed.stdout, listed.stderr  # the other apps are listed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_scheduler_describe_and_list_do_not_raise(root: Path, case: str) -> None:
    (root / ".apps" / "bad-1.json").write_bytes(CASES[case] + b"\n")

    async def main():
        s = LocalScheduler("reader", local_root=str(root))
        try:
            errors = []
            for call in (lambda: s.describe("bad-1"), s.list):
                try:
                    await call()
                except Exception as e:
                    errors.append(f"{type(e).__name__}: {e}"[:120])
            return errors
        finally:
            await s.close()

    assert asyncio.run(main()) == []


@pytest.mark.timeout(90)
def test_a_record_file_of_many_short_lines_is_called_corrupt_at_once(root: Path) -> None:
    # 8 MB of "x\n": every reader tries json.loads on each of its 4M lines, three times
    # (read_record's retries); a real record is compacted to a few versions (~64 KB)
    (root / ".apps" / "bad-1.json").write_bytes(b"x\n" * 4_000_000)
    try:
        run = _cli(root, True, "status", "local_cwd://s/bad-1", timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("`asynctorchx status` of one 8 MB corrupt record took over 20 s")
    assert run.returncode == 4
