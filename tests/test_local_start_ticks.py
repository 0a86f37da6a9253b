"""A replica's start time (the pid-reuse guard other processes check before signalling it) taken from
the spawn itself: the same value ``/proc`` shows, derived only when the spawn fell inside one clock
tick, and never trusted on a machine where it once disagreed with ``/proc``."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asynctorchx.schedulers._local import procs, recordfile
from asynctorchx.schedulers.local import LocalScheduler
from asynctorchx.specs import AppDef, AppState, Role

TICK = procs._TICK_NS


@pytest.fixture
def fresh_check(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The derivation as in a new process: not yet compared with ``/proc``."""
    monkeypatch.setattr(procs, "_derived_ticks_ok", None)
    yield


def sleeper() -> procs.Spawned:
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        return procs.spawn("/bin/sleep", ["sleep", "30"], {}, os.getcwd(), null)
    finally:
        os.close(null)


def stop(spawned: procs.Spawned) -> None:
    procs.kill_and_reap_now(spawned.pid)
    os.close(spawned.stdout_fd)
    os.close(spawned.stderr_fd)


def test_spawned_children_carry_the_start_time_proc_shows(fresh_check: None) -> None:
    """Every derived start time is exactly ``/proc``'s. Children are spawned until ten got one (a
    spawn that straddles a tick boundary gets none: one in ~80 on a quiet machine, more than half
    on a loaded one), at most 300."""
    assert os.sysconf("SC_CLK_TCK") * TICK == 10**9
    children: list[procs.Spawned] = []
    try:
        while len(children) < 300 and sum(c.start_ticks is not None for c in children) < 10:
            children.append(sleeper())
        derived = [c for c in children if c.start_ticks is not None]
        assert len(derived) == 10
        for child in derived:
            assert child.start_ticks == recordfile.proc_start_ticks(child.pid)
        assert procs._derived_ticks_ok is True
    finally:
        for child in children:
            stop(child)


def test_a_spawn_that_straddles_a_tick_gets_no_derived_time(fresh_check: None) -> None:
    procs._derived_ticks_ok = True
    tick = time.clock_gettime_ns(time.CLOCK_BOOTTIME) // TICK
    assert procs.spawned_ticks(os.getpid(), tick * TICK, tick * TICK + TICK - 1) == tick
    assert procs.spawned_ticks(os.getpid(), tick * TICK - 1, tick * TICK) is None


def test_one_disagreement_with_proc_turns_the_derivation_off(fresh_check: None) -> None:
    """A kernel whose start times are not the fork's boot-clock tick: the first comparison fails and
    every later spawn leaves the start time to ``/proc`` (the writer's thread reads it)."""
    me = os.getpid()
    real = recordfile.proc_start_ticks(me)
    assert real is not None
    wrong = real + 5  # a bracket in a tick that is not the one /proc shows
    assert procs.spawned_ticks(me, wrong * TICK, wrong * TICK + 1) == real  # /proc's, not derived
    assert procs._derived_ticks_ok is False
    assert procs.spawned_ticks(me, real * TICK, real * TICK + 1) is None


def test_the_first_comparison_waits_for_a_child_still_there(fresh_check: None) -> None:
    """A child gone before it could be compared (``/proc`` has nothing) decides nothing."""
    gone = os.posix_spawn("/bin/true", ["true"], {})
    os.waitpid(gone, 0)
    now = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
    assert procs.spawned_ticks(gone, now, now) is None
    assert procs._derived_ticks_ok is None


@pytest.mark.timeout(60)
async def test_a_launched_apps_record_holds_its_replicas_real_start_times(tmp_path: Path) -> None:
    """What another process checks before signalling a replica is the replica's own start time,
    whether it came from the spawn or from ``/proc``."""
    root = tmp_path / "root"
    sched = LocalScheduler("ticks", local_root=root)
    role = Role("main", image=str(tmp_path), entrypoint="sleep", args=["30"], num_replicas=4)
    app_ids = []
    try:
        for _ in range(5):
            app_ids.append(await sched.schedule(sched.submit_dryrun(AppDef("t", [role]), {})))
        for app_id in app_ids:
            doc = recordfile.read_document(root / ".apps" / f"{app_id}.json")
            for rep in doc["replicas"]:
                assert rep["state"] == AppState.RUNNING.name
                assert rep["start_ticks"] == recordfile.proc_start_ticks(rep["pid"])
    finally:
        for app_id in app_ids:
            await sched.cancel(app_id)
        await sched.close()
