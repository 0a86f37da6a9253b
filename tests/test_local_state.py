"""The local backend's status assessor (``_local/state.py``): what an exit, a cancel or a failed
restart means for an app and its replicas. Pure functions, no processes (the behaviour with real
processes is pinned by test_local_scheduler.py, test_local_retries.py and test_local_reliability.py).
"""

from __future__ import annotations

import signal

import pytest

from asynctorchx.schedulers._local.state import (
    Exit,
    Progress,
    describe_exit,
    final_state,
    judge_cancel,
    judge_exit,
    judge_restart_failure,
    restart_scope,
    stopped_by_cancel,
)
from asynctorchx.specs.api import AppState, RetryPolicy


def progress(succeeded: int = 0, retries: int = 0, restarts: int = 0) -> Progress:
    return Progress(
        replicas=3,
        succeeded=succeeded,
        retries_left=retries,
        policy=RetryPolicy.ROLE,
        num_restarts=restarts,
    )


def test_a_replica_that_exits_0_succeeds_and_the_last_one_ends_the_app() -> None:
    """Exit 0: the replica SUCCEEDED; the app goes on until every replica did, then SUCCEEDED."""
    first = judge_exit(Exit(0, "w", "w[0]", 0), progress(succeeded=0))
    assert (first.replica, first.app, first.restart, first.stop_others) == (
        AppState.SUCCEEDED,
        None,
        None,
        False,
    )
    last = judge_exit(Exit(2, "w", "w[2]", 0), progress(succeeded=2))
    assert (last.replica, last.app) == (AppState.SUCCEEDED, AppState.SUCCEEDED)


def test_a_failure_with_retries_left_restarts_by_the_roles_policy() -> None:
    """A failure while the role has retries: the replica FAILED, a restart of its policy's scope,
    the app goes on, and its message names the restart and the exit."""
    verdict = judge_exit(Exit(1, "w", "w[1]", 3), progress(retries=2, restarts=1))
    assert verdict.replica == AppState.FAILED
    assert verdict.restart == RetryPolicy.ROLE and verdict.uses_retry
    assert verdict.app is None and not verdict.stop_others and not verdict.takes_error
    assert verdict.msg == "restart 2 after w[1] exited with code 3"


def test_a_failure_without_retries_fails_the_app_and_stops_the_others() -> None:
    """No retry left: the app FAILED with the replica's exit and structured error, the others are
    stopped."""
    verdict = judge_exit(Exit(1, "w", "w[1]", -signal.SIGKILL), progress(retries=0))
    assert (verdict.replica, verdict.app) == (AppState.FAILED, AppState.FAILED)
    assert verdict.stop_others and verdict.takes_error and not verdict.uses_retry
    assert verdict.msg == "w[1] was killed by SIGKILL"


def test_a_cancel_and_a_failed_restart_end_the_app() -> None:
    """A cancel stops everything and ends the app CANCELLED with its reason; a restart that cannot
    start fails it with the failed replica's error."""
    cancel = judge_cancel("cancelled")
    assert (cancel.replica, cancel.app, cancel.stop_others, cancel.msg) == (
        None,
        AppState.CANCELLED,
        True,
        "cancelled",
    )
    failed = judge_restart_failure("no such program")
    assert (failed.app, failed.stop_others, failed.takes_error) == (AppState.FAILED, True, True)
    assert failed.msg == "restart failed: no such program"


@pytest.mark.parametrize(
    ("app", "replica", "code", "unjudged", "expected"),
    [
        (AppState.FAILED, AppState.SUCCEEDED, 0, False, AppState.SUCCEEDED),
        (AppState.CANCELLED, AppState.FAILED, 1, False, AppState.FAILED),
        (AppState.FAILED, AppState.RUNNING, 0, True, AppState.SUCCEEDED),
        (AppState.FAILED, AppState.RUNNING, 1, True, AppState.FAILED),
        (AppState.CANCELLED, AppState.RUNNING, 143, True, AppState.CANCELLED),
        (AppState.CANCELLED, AppState.PENDING, 0, False, AppState.CANCELLED),
        (AppState.SUCCEEDED, AppState.RUNNING, None, False, AppState.CANCELLED),
    ],
)
def test_final_states_of_replicas(
    app: AppState, replica: AppState, code: int | None, unjudged: bool, expected: AppState
) -> None:
    """When the app ends, terminal replicas keep their state, unjudged exits are judged (0:
    SUCCEEDED, else as the app ended), and the rest (stopped, or waiting for a restart) are
    CANCELLED."""
    assert final_state(app, replica, code, unjudged) == expected


def test_restart_scope_follows_the_policy() -> None:
    """REPLICA restarts the failed one, ROLE its role's replicas, APPLICATION all of them."""
    roles = ["ps", "w", "w", "w"]
    assert restart_scope(RetryPolicy.REPLICA, 2, roles) == [2]
    assert restart_scope(RetryPolicy.ROLE, 2, roles) == [1, 2, 3]
    assert restart_scope(RetryPolicy.APPLICATION, 2, roles) == [0, 1, 2, 3]


def test_exits_are_described_and_judged_under_a_cancel() -> None:
    """Exit codes read as words; a replica that exits 0 while a cancel stops it SUCCEEDED."""
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-signal.SIGTERM) == "was killed by SIGTERM"
    assert describe_exit(-99) == "was killed by signal 99"
    assert describe_exit(None) == "ended"
    assert stopped_by_cancel(0) == AppState.SUCCEEDED
    assert stopped_by_cancel(-signal.SIGTERM) == AppState.CANCELLED
