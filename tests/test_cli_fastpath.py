"""``status``, ``describe`` and ``list`` of local apps answered from the record files (``cli/_fastpath.py``)
print exactly what the runner path prints, and import no event loop.

Real apps are launched by a holder process (a real ``AsyncRunner`` on ``local_cwd`` and
``local_dir``: running, succeeded, failed with a structured error, cancelled), and a few records are
written by hand next to theirs (a lost app, an app whose launcher died but whose replicas run, corrupt
records). Every command line then runs twice through the console script, once as usual and once with
``ASYNCTORCHX_CLI_FASTPATH=0`` (the runner path), and the two runs must agree on stdout, stderr and
the exit code, byte for byte.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _local_env import dead_pid
from test_cli_commands import _script

from asynctorchx.cli import _fastpath
from asynctorchx.schedulers._local import recordfile
from asynctorchx.schedulers._local.records import AppRecord, check_lost
from asynctorchx.specs import NONE, AppState, is_terminal

REPO = Path(__file__).resolve().parent.parent

HOLDER = r"""
import json, os, sys, time

import anyio
import anyio.to_thread

from asynctorchx.runner import get_runner
from asynctorchx.specs import AppDef, AppState, Role

ERROR = json.dumps({"message": {"message": "boom: the loss is NaN", "errorCode": 7,
    "extraInfo": {"py_callstack": "Traceback (most recent call last):\n  File \"t.py\", line 1\nValueError: boom",
    "timestamp": "1700000000"}}})


def role(name, script, n=1, image="."):
    return Role(name, image=image, entrypoint="sh", args=["-c", script], num_replicas=n)


async def until(runner, handle, ok):
    with anyio.fail_after(30):
        while True:
            status = await runner.status(handle)
            if status is not None and ok(status):
                return
            await anyio.sleep(0.02)


async def main():
    image = sys.argv[1]
    out = {}
    async with get_runner() as runner:
        out["running"] = await runner.run(
            AppDef("multi", [role("trainer", "sleep 600", 2), role("ps", "sleep 600")]), "local_cwd"
        )
        await until(runner, out["running"], lambda s: all(
            r.state == AppState.RUNNING for role in s.roles for r in role.replicas
        ) and sum(len(role.replicas) for role in s.roles) == 3)
        out["succeeded"] = await runner.run(AppDef("ok", [role("ok", "exit 0")]), "local_cwd")
        bad = "printf '%s' '" + ERROR + "' > \"$TORCHELASTIC_ERROR_FILE\"; exit 3"
        out["failed"] = await runner.run(
            AppDef("bad", [role("worker", bad), role("side", "sleep 600")]), "local_cwd"
        )
        out["cancelled"] = await runner.run(AppDef("stop", [role("s", "sleep 600")]), "local_cwd")
        await until(runner, out["cancelled"], lambda s: s.state == AppState.RUNNING)
        await runner.cancel(out["cancelled"])
        out["dir"] = await runner.run(AppDef("indir", [role("d", "exit 0", image=image)]), "local_dir")
        for key in ("succeeded", "failed", "cancelled", "dir"):
            await runner.wait(out[key], timeout=30)
        print(json.dumps(out), flush=True)
        await anyio.to_thread.run_sync(sys.stdin.read)


anyio.run(main)
"""


class Apps:
    """The state root, the holder's apps (``handles``) and the environment to run the CLI in."""

    def __init__(self, root: Path, cwd: Path, handles: dict[str, str]) -> None:
        self.root = root
        self.cwd = cwd
        self.handles = handles
        self.records = root / ".apps"
        dropped = ("NO_COLOR", "FORCE_COLOR", "TERM", "LOGLEVEL", _fastpath.SWITCH_ENV)
        self.env = {k: v for k, v in os.environ.items() if k not in dropped}
        self.env.update(
            ASYNCTORCHX_LOCAL_ROOT=str(root), TORCHXCONFIG="", PYTHONPATH=str(REPO), COLUMNS="100"
        )

    def app_id(self, key: str) -> str:
        return self.handles[key].rsplit("/", 1)[1]

    def doc(self, key: str) -> dict[str, Any]:
        doc: dict[str, Any] = recordfile.read_document(self.records / f"{self.app_id(key)}.json")
        return doc

    def write(self, app_id: str, doc: dict[str, Any] | str) -> str:
        text = doc if isinstance(doc, str) else json.dumps(doc)
        (self.records / f"{app_id}.json").write_text(text)
        return f"local_cwd://asynctorchx/{app_id}"

    def run(
        self, *argv: str, runner_path: bool = False, cwd: Path | None = None, **env: str
    ) -> subprocess.CompletedProcess[str]:
        full = {**self.env, **env}
        if runner_path:
            full[_fastpath.SWITCH_ENV] = "0"
        return subprocess.run(
            [_script(), *argv],
            capture_output=True,
            text=True,
            env=full,
            cwd=cwd or self.cwd,
            timeout=60,
        )


@pytest.fixture(scope="module")
def apps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Apps]:
    base = tmp_path_factory.mktemp("fastpath")
    root, cwd, image = base / "root", base / "cwd", base / "image"
    for d in (cwd, image):
        d.mkdir()
    holder_file = base / "holder.py"
    holder_file.write_text(textwrap.dedent(HOLDER))
    env = {**os.environ, "ASYNCTORCHX_LOCAL_ROOT": str(root), "TORCHXCONFIG": ""}
    env["PYTHONPATH"] = str(REPO)
    holder = subprocess.Popen(
        [sys.executable, str(holder_file), str(image)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=env,
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None
        line = holder.stdout.readline()
        assert line, f"the holder exited with {holder.wait(timeout=30)}"
        made = Apps(root, cwd, json.loads(line))
        _add_hand_written_records(made)
        yield made
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        try:
            holder.wait(timeout=60)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()


def _add_hand_written_records(apps: Apps) -> None:
    running = apps.doc("running")
    dead = dead_pid()
    owner = {"pid": dead, "start_ticks": 1, "watchdog_pid": dead, "watchdog_start_ticks": 1}
    lost = {**running, "app_id": "lost-1", "owner": owner, "submitted_at": 1.0}
    lost["replicas"] = [{**r, "pid": dead} for r in running["replicas"]]
    apps.handles["lost"] = apps.write("lost-1", lost)
    # its launcher and watchdog are gone, its replicas (the running app's processes) are not
    orphan = {**running, "app_id": "orphan-1", "owner": owner, "submitted_at": 2.0}
    apps.handles["orphan"] = apps.write("orphan-1", orphan)
    badapp = {**apps.doc("succeeded"), "app_id": "badapp-1", "app": {"roles": [{"image": "x"}]}}
    apps.handles["badapp"] = apps.write("badapp-1", badapp)
    noapp = {**apps.doc("succeeded"), "app_id": "noapp-1", "app": {}, "name": ""}
    apps.handles["noapp"] = apps.write("noapp-1", noapp)
    apps.handles["corrupt"] = apps.write("corrupt-1", "{not json")
    weird = {**apps.doc("succeeded"), "app_id": "weird-1", "replicas": [[1, 2]]}
    apps.handles["weird"] = apps.write("weird-1", weird)
    badstate = {**apps.doc("succeeded"), "app_id": "badstate-1", "state": "EXPLODED"}
    apps.handles["badstate"] = apps.write("badstate-1", badstate)
    badowner = {**apps.doc("succeeded"), "app_id": "badowner-1", "owner": [1]}
    apps.handles["badowner"] = apps.write("badowner-1", badowner)
    # not regular files: a FIFO (opening it for reading blocked status, describe and every list
    # for ever) and a symbolic link to a record (not followed)
    os.mkfifo(apps.records / "fifo-1.json")
    apps.handles["fifo"] = "local_cwd://asynctorchx/fifo-1"
    (apps.records / "link-1.json").symlink_to(apps.records / f"{apps.app_id('succeeded')}.json")
    apps.handles["link"] = "local_cwd://asynctorchx/link-1"


def _same(apps: Apps, *argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    fast = apps.run(*argv, **env)
    slow = apps.run(*argv, runner_path=True, **env)
    assert (fast.returncode, fast.stdout, fast.stderr) == (
        slow.returncode,
        slow.stdout,
        slow.stderr,
    ), argv
    return fast


KEYS = ("running", "succeeded", "failed", "cancelled", "dir", "lost", "orphan", "noapp")


@pytest.mark.parametrize("key", KEYS)
def test_status_and_describe_print_what_the_runner_path_prints(apps: Apps, key: str) -> None:
    """status and describe (text and --json) of each kind of local app match the runner path."""
    handle = apps.handles[key]
    for argv in (
        ("status", handle),
        ("status", "--json", handle),
        ("describe", handle),
        ("describe", "--json", handle),
    ):
        assert _same(apps, *argv).returncode == 0, argv


def test_the_apps_are_in_the_states_the_cases_need(apps: Apps) -> None:
    """The holder's apps and the hand-written records are in the states their names say."""
    want = {
        "running": "RUNNING",
        "succeeded": "SUCCEEDED",
        "failed": "FAILED",
        "cancelled": "CANCELLED",
        "dir": "SUCCEEDED",
        "lost": "FAILED",
        "orphan": "RUNNING",
    }
    for key, state in want.items():
        out = json.loads(apps.run("status", "--json", apps.handles[key]).stdout)
        assert out["state"] == state, key
    lost = json.loads(apps.run("status", "--json", apps.handles["lost"]).stdout)
    assert lost["msg"].startswith("lost: its launching process")
    failed = apps.run("status", apps.handles["failed"]).stdout
    assert "boom: the loss is NaN" in failed


def test_status_roles_match_the_runner_path(apps: Apps) -> None:
    """status --roles (one role, several, --json, an unknown role) matches the runner path."""
    handle = apps.handles["running"]
    assert _same(apps, "status", "--roles", "ps", handle).returncode == 0
    assert _same(apps, "status", "--json", "--roles", "trainer, ps", handle).returncode == 0
    assert _same(apps, "status", "--roles", "ps,nope", handle).returncode == 2


def test_unknown_corrupt_and_foreign_handles_match_the_runner_path(apps: Apps) -> None:
    """Unknown apps, ids that cannot be files, corrupt records, another session or backend in the
    handle, an empty session and a malformed handle: the same output and exit code either way."""
    app_id = apps.app_id("running")
    codes = {}
    for name, handle in (
        ("unknown", "local_cwd://asynctorchx/nope-1"),
        ("hidden", "local_cwd://asynctorchx/.hidden"),
        ("corrupt", apps.handles["corrupt"]),
        ("weird", apps.handles["weird"]),
        ("badstate", apps.handles["badstate"]),
        ("badowner", apps.handles["badowner"]),
        ("badapp", apps.handles["badapp"]),
        ("fifo", apps.handles["fifo"]),
        ("link", apps.handles["link"]),
        ("session", f"local_cwd://someone-else/{app_id}"),
        ("backend", f"local_dir://asynctorchx/{app_id}"),
        ("empty session", f"local_cwd:///{apps.app_id('succeeded')}"),
        ("colon session", f"local_cwd://a:b/{app_id}"),
        ("malformed", "not-a-handle"),
    ):
        for command in ("status", "describe"):
            codes[name, command] = _same(apps, command, handle).returncode
    assert codes["unknown", "status"] == codes["corrupt", "describe"] == 4
    assert codes["weird", "status"] == codes["badstate", "status"] == 4
    assert codes["badowner", "describe"] == 4
    assert codes["fifo", "status"] == codes["fifo", "describe"] == codes["link", "status"] == 4
    assert codes["session", "status"] == codes["backend", "describe"] == 0
    assert codes["malformed", "status"] == 2
    assert codes["badapp", "status"] != 0


def test_list_matches_the_runner_path(apps: Apps) -> None:
    """list (default scheduler, -s local_cwd, -s local_dir, --json) matches the runner path, and
    corrupt records are skipped with a warning rather than failing the list."""
    for argv in (
        ("list",),
        ("list", "-s", "local_cwd"),
        ("list", "-s", "local_dir"),
        ("list", "--json"),
        ("list", "-s", "local_dir", "--json"),
    ):
        assert _same(apps, *argv).returncode == 0, argv
    listed = json.loads(apps.run("list", "--json").stdout)
    ids = [row["app_id"] for row in listed]
    assert ids[:2] == ["lost-1", "orphan-1"] and apps.app_id("running") in ids
    assert "corrupt-1" not in ids and apps.app_id("dir") not in ids
    assert "fifo-1" not in ids and "link-1" not in ids
    warned = apps.run("list").stderr
    assert "ignoring corrupt app record" in warned and "badowner-1.json" in warned


def test_colours_match_the_runner_path(apps: Apps) -> None:
    """With FORCE_COLOR the coloured output is the same either way."""
    for argv in (
        ("status", apps.handles["failed"]),
        ("describe", apps.handles["running"]),
        ("list",),
    ):
        assert "\x1b[" in _same(apps, *argv, FORCE_COLOR="1").stdout, argv


def test_an_empty_state_root_matches_the_runner_path(apps: Apps, tmp_path: Path) -> None:
    """A state root without records: list says so on stderr, status exits 4, either way."""
    empty = {"ASYNCTORCHX_LOCAL_ROOT": str(tmp_path / "none")}
    assert _same(apps, "list", **empty).stderr == "no apps on local_cwd\n"
    assert _same(apps, "list", "--json", **empty).stdout == "[]\n"
    assert _same(apps, "status", apps.handles["running"], **empty).returncode == 4


# -- what is imported --------------------------------------------------------------------------

DRIVER = """
import sys
from asynctorchx.cli.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:  # --help
    code = e.code
heavy = ("asyncio", "anyio", "asynctorchx.runner", "asynctorchx.schedulers",
         "asynctorchx.schedulers.api", "asynctorchx.schedulers.local", "importlib.metadata")
print("IMPORTED=" + ",".join(m for m in heavy if m in sys.modules), file=sys.stderr)
sys.exit(code)
"""


def _imported(apps: Apps, *argv: str, cwd: Path | None = None, **env: str) -> tuple[set[str], str]:
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, *argv],
        capture_output=True,
        text=True,
        env={**apps.env, **env},
        cwd=cwd or apps.cwd,
        timeout=60,
    )
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("IMPORTED="), proc.stderr
    return {m for m in last.removeprefix("IMPORTED=").split(",") if m}, proc.stdout


def test_local_queries_import_no_event_loop_or_runner(apps: Apps) -> None:
    """status, describe and list of local apps import neither asyncio, anyio, the runner, the
    schedulers package nor importlib.metadata (unless ASYNCTORCHX_CLI_FASTPATH=0 asks for the
    runner); --help reads no entry point either."""
    handle = apps.handles["running"]
    for argv in (
        ("status", handle),
        ("status", "--json", "--roles", "ps", handle),
        ("describe", handle),
        ("list", "-s", "local_cwd"),
        ("list", "-s", "local_dir", "--json"),
        ("list",),
        ("status", "local_cwd://asynctorchx/nope-1"),
    ):
        assert _imported(apps, *argv)[0] == set(), argv
    assert _imported(apps, "--help")[0] == set()
    switched = _imported(apps, "status", handle, **{_fastpath.SWITCH_ENV: "0"})[0]
    assert {"asyncio", "anyio", "asynctorchx.runner"} <= switched


def test_a_config_file_sends_the_query_to_the_runner_with_the_same_answer(
    apps: Apps, tmp_path: Path
) -> None:
    """With a .torchxconfig in the working directory the runner answers (it may hold launch
    limits), and prints what the fast path prints without it."""
    (tmp_path / ".torchxconfig").write_text("[cli:run]\nscheduler = local_cwd\n")
    handle = apps.handles["failed"]
    env = {k: v for k, v in apps.env.items() if k != "TORCHXCONFIG"}
    with_config = Apps(apps.root, tmp_path, apps.handles)
    with_config.env = env
    imported, out = _imported(with_config, "status", handle, cwd=tmp_path)
    assert {"asyncio", "asynctorchx.runner"} <= imported
    assert out == apps.run("status", handle).stdout


# -- the shared parsing and lost check -----------------------------------------------------------


def test_the_lost_check_agrees_with_the_scheduler(apps: Apps) -> None:
    """recordfile.lost_message finds lost exactly the records LocalScheduler's check does."""
    running = apps.doc("running")
    dead = dead_pid()
    me = {"pid": os.getpid(), "start_ticks": recordfile.proc_start_ticks(os.getpid())}
    gone = {"pid": dead, "start_ticks": 5}
    cases = []
    for state in ("RUNNING", "PENDING", "SUCCEEDED", "UNKNOWN"):
        for owner in (me, gone, {**gone, "watchdog_pid": os.getpid()}):
            for replicas_alive in (True, False):
                replicas = [
                    r if replicas_alive else {**r, "pid": dead} for r in running["replicas"]
                ]
                cases.append({**running, "state": state, "owner": owner, "replicas": replicas})
    found = []
    for doc in cases:
        record = AppRecord.from_json(doc)
        checked = check_lost(record)
        lost = recordfile.lost_message(
            record.state.name, record.owner, [(r.pid, r.start_ticks) for r in record.replicas]
        )
        assert (checked.state, checked.msg) == (
            (AppState.FAILED, lost) if lost else (record.state, record.msg)
        )
        found.append(lost is not None)
    assert any(found) and not all(found)


def test_non_mapping_parts_of_a_record_make_it_corrupt_not_a_crash() -> None:
    """A record whose owner, replicas or app are not objects, or a replica's role not a string,
    is rejected as corrupt (ValueError): the CLI then says the app is unknown (exit 4), not an
    internal error."""
    base = {"app_id": "a", "state": "RUNNING"}
    replica = {"id": 0, "state": "RUNNING"}
    for doc in (
        {**base, "owner": [1]},
        {**base, "replicas": [[1]]},
        {**base, "replicas": ["x"]},
        {**base, "app": "x"},
        {**base, "app": ["x"]},
        {**base, "replicas": [{**replica, "role": ["x"]}]},
    ):
        with pytest.raises(ValueError, match="not an app record"):
            AppRecord.from_json(doc)


def test_constants_the_fast_path_relies_on_match_their_sources() -> None:
    """The fast path's copies of a few names agree with the modules it does not import."""
    from asynctorchx.runner import config
    from asynctorchx.schedulers import get_default_scheduler_name

    assert get_default_scheduler_name() == _fastpath.DEFAULT_SCHEDULER
    assert (_fastpath.ENV_TORCHXCONFIG, _fastpath.CONFIG_FILE) == (
        config.ENV_TORCHXCONFIG,
        config.CONFIG_FILE,
    )
    assert recordfile.NONE == NONE
    assert {s.name for s in AppState if is_terminal(s)} == recordfile.TERMINAL_NAMES
