"""What a local replica is started with: the launcher's environment as it is at the launch (taken as
bytes, undecodable values included), the role's variables over it, and the stray sweep of the
containment only when something else was born meanwhile."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from _local_env import wait_for

from asynctorchx.schedulers._local import contain
from asynctorchx.schedulers.local import LocalScheduler
from asynctorchx.specs import AppDef, AppState, Role


@pytest.fixture
async def sched(tmp_path: Path) -> AsyncIterator[LocalScheduler]:
    s = LocalScheduler("env", local_root=tmp_path / "root")
    yield s
    await s.close()


@pytest.fixture
def raw_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Launcher variables set after the scheduler exists: one not UTF-8, one the role overrides
    (and no PYTHONUNBUFFERED of its own)."""
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    os.environb[b"ATX_RAW"] = b"a\xffb"
    os.environ["ATX_SAME"] = "launcher"
    os.environ["ATX_TEXT"] = "d\u00e9j\u00e0"
    try:
        yield
    finally:
        for key in ("ATX_RAW", "ATX_SAME", "ATX_TEXT"):
            os.environ.pop(key, None)


@pytest.mark.timeout(60)
async def test_a_replica_gets_the_launch_time_environment_with_the_roles_over_it(
    sched: LocalScheduler, raw_env: None
) -> None:
    """Variables set in the launcher after its scheduler was made reach the replica byte for byte
    (an undecodable one included); the role's variables win over the launcher's; the marker and
    PYTHONUNBUFFERED are added."""
    script = (
        'printf "%s" "$ATX_RAW" | od -An -tx1; echo "same=$ATX_SAME text=$ATX_TEXT"; '
        'echo "unbuffered=$PYTHONUNBUFFERED marker=${ASYNCTORCHX_REPLICA:+set}"'
    )
    role = Role("main", image=".", entrypoint="sh", args=["-c", script], env={"ATX_SAME": "role"})
    app_id = await sched.submit(AppDef("env", [role]), {})
    desc = await wait_for(sched, app_id)
    assert desc.state == AppState.SUCCEEDED
    out = [line.rstrip("\n") async for line in sched.log_iter(app_id, "main", 0)]
    assert out[0].split() == ["61", "ff", "62"]
    assert out[1] == "same=role text=d\u00e9j\u00e0"
    assert out[2] == "unbuffered=x marker=set"


@pytest.mark.timeout(60)
async def test_a_role_may_set_pythonunbuffered_itself(sched: LocalScheduler) -> None:
    """PYTHONUNBUFFERED is only a default: a role that sets it keeps its value."""
    role = Role(
        "main",
        image=".",
        entrypoint="sh",
        args=["-c", 'echo "unbuffered=$PYTHONUNBUFFERED"'],
        env={"PYTHONUNBUFFERED": ""},
    )
    app_id = await sched.submit(AppDef("env", [role]), {})
    assert (await wait_for(sched, app_id)).state == AppState.SUCCEEDED
    out = [line async for line in sched.log_iter(app_id, "main", 0)]
    assert out == ["unbuffered=\n"]


class _FakeKernel:
    """Stands in for the cgroup and /proc side of ``contain.adopt``: records what it is asked."""

    def __init__(self, last_pid: int) -> None:
        self.last = last_pid
        self.moved: list[int] = []
        self.sweeps = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(contain, "move", lambda cgroup, pid: self.moved.append(pid))
        monkeypatch.setattr(contain, "_children_of_task", lambda pid, tid: [])
        monkeypatch.setattr(contain, "last_pid", lambda: self.last)
        monkeypatch.setattr(contain, "_move_strays", self._sweep)

    def _sweep(self, *args: object) -> None:
        self.sweeps += 1


@pytest.mark.parametrize(
    ("last_pid", "swept"),
    [(1000, False), (1001, True), (999, True), (None, True)],
    ids=["nothing-born-since", "one-born-since", "pid-counter-wrapped", "last-pid-unknown"],
)
def test_the_stray_sweep_runs_unless_nothing_was_born_since_the_replica(
    monkeypatch: pytest.MonkeyPatch, last_pid: int | None, swept: bool
) -> None:
    """``adopt`` skips the sweep for strays only when the kernel's last pid is still the replica's
    own (nothing at all was created since, so nothing can have escaped); otherwise it sweeps."""
    kernel = _FakeKernel(last_pid)  # type: ignore[arg-type]
    kernel.install(monkeypatch)
    contain.adopt("/cg/app", 1000, "/cg", b"ASYNCTORCHX_REPLICA=app/main/0")
    assert kernel.moved == [1000]
    assert kernel.sweeps == (1 if swept else 0)


def test_no_sweep_without_a_marker_or_a_birth_cgroup(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the cgroup the replica was born in, or without its marker, there is nothing to
    sweep: the replica alone is moved."""
    kernel = _FakeKernel(2000)
    kernel.install(monkeypatch)
    contain.adopt("/cg/app", 1000, None, b"ASYNCTORCHX_REPLICA=app/main/0")
    contain.adopt("/cg/app", 1000, "/cg", b"")
    assert kernel.moved == [1000, 1000]
    assert kernel.sweeps == 0
