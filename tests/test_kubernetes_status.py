"""The kubernetes backend's pure mapping of API objects to states, on objects recorded from real
clusters (tests/fixtures/kubernetes, see its README), and its parsing of timestamped log lines."""

from __future__ import annotations

import copy
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from asynctorchx.logs._timestamps import seconds_to_ns, split_timestamp
from asynctorchx.schedulers._k8s import names as n
from asynctorchx.schedulers._k8s.logs import to_rfc3339_seconds
from asynctorchx.schedulers._k8s.manifests import KubernetesOptions, build_request, owned_by
from asynctorchx.schedulers._k8s.status import (
    Forget,
    ManagedApp,
    Restart,
    StopRoles,
    describe_app,
    follow_up,
    job_state,
    newest_pods,
    parse_index_set,
    parse_time_ns,
    pod_exit,
    pod_index,
    pod_started,
    pod_state,
)
from asynctorchx.specs import AppDef, AppState, RetryPolicy, Role

FIXTURES = Path(__file__).parent / "fixtures" / "kubernetes"


def fixture(name: str) -> Any:
    text = (FIXTURES / name).read_text()
    return json.loads(text) if name.endswith(".json") else yaml.safe_load(text)


def test_recorded_jobs_map_to_states() -> None:
    """A running, a completed and a failed Job as recorded map to RUNNING, SUCCEEDED, FAILED."""
    assert job_state(fixture("job_active.yaml")) == AppState.RUNNING
    assert job_state(fixture("job_complete.yaml")) == AppState.SUCCEEDED
    assert job_state(fixture("job_failed.yaml")) == AppState.FAILED


def test_failure_target_alone_is_failed() -> None:
    """FailureTarget (pods still terminating) already means FAILED; SuccessCriteriaMet, SUCCEEDED."""
    failed = fixture("job_failed.yaml")
    failed["status"]["conditions"] = failed["status"]["conditions"][:1]
    assert job_state(failed) == AppState.FAILED
    done = fixture("job_complete.yaml")
    done["status"]["conditions"] = done["status"]["conditions"][:1]
    assert job_state(done) == AppState.SUCCEEDED


def test_missing_status_is_pending_and_suspension_is_cancelled() -> None:
    """A Job without status is PENDING; a suspended one reads as stopped (CANCELLED)."""
    job = fixture("job_active.yaml")
    del job["status"]
    assert job_state(job) == AppState.PENDING
    job["status"] = {"conditions": [{"type": "Suspended", "status": "True"}]}
    assert job_state(job) == AppState.CANCELLED


def test_a_job_queued_by_kueue_is_pending_while_suspended() -> None:
    """A suspended Job with Kueue's queue label waits for admission: PENDING, with a message."""
    svc, jobs = app_objects()
    for job in jobs:
        job["metadata"]["labels"][n.LABEL_KUEUE_QUEUE] = "team-a"
        job["spec"]["suspend"] = True
        job["status"] = {"conditions": [{"type": "Suspended", "status": "True"}]}
    assert job_state(jobs[0]) == AppState.PENDING
    described = describe_app(svc, jobs, [])
    assert described.state == AppState.PENDING
    assert described.msg == "waiting for Kueue to admit it (queue team-a)"


def test_recorded_pods_map_to_replica_states() -> None:
    """The recorded pending pod is PENDING and not started; unknown phases are UNKNOWN."""
    pod = fixture("pod_pending_image_pull.yaml")
    assert pod_state(pod) == AppState.PENDING
    assert not pod_started(pod)
    for phase, state in (
        ("Running", AppState.RUNNING),
        ("Unknown", AppState.UNKNOWN),
        ("Evicted?", AppState.UNKNOWN),
    ):
        changed = copy.deepcopy(pod)
        changed["status"]["phase"] = phase
        assert pod_state(changed) == state


def test_exit_code_from_a_recorded_terminated_container() -> None:
    """A terminated container's exit code and message are read from its state."""
    status = fixture("container_terminated_error.yaml")
    status["state"] = status.pop("lastState")
    status["state"]["terminated"]["message"] = "oops"
    pod = {"status": {"phase": "Failed", "containerStatuses": [status]}}
    assert pod_exit(pod) == (1, "oops")
    assert pod_started(pod)


def test_completion_index_from_a_recorded_indexed_pod() -> None:
    """The completion index comes from the label (or the annotation on older clusters)."""
    pod = fixture("pod_indexed_metadata.yaml")
    assert pod_index(pod) == 0
    del pod["metadata"]["labels"][n.COMPLETION_INDEX]
    pod["metadata"]["annotations"][n.COMPLETION_INDEX] = "3"
    assert pod_index(pod) == 3


def test_index_sets_and_times() -> None:
    """Index lists like '1,3-5,7' and RFC 3339 times with nanoseconds parse exactly."""
    assert parse_index_set("1,3-5,7") == {1, 3, 4, 5, 7}
    assert parse_index_set("") == set()
    assert parse_time_ns("2026-04-26T18:35:42Z") == 1777228542 * 10**9
    assert parse_time_ns("2026-04-26T18:35:42.000000123Z") == 1777228542 * 10**9 + 123
    assert parse_time_ns("2026-04-26T20:35:42+02:00") == 1777228542 * 10**9


def app_objects(restarts: int = 0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    app = AppDef(
        "demo",
        roles=[
            Role("trainer", image="i", entrypoint="e", num_replicas=2),
            Role("ps", image="i", entrypoint="e"),
        ],
    )
    req = build_request(app, KubernetesOptions(), "sess", app_name="demo-abcdefgh")
    svc = copy.deepcopy(req.service)
    svc["metadata"]["uid"] = "svc-uid"
    jobs = []
    for i, job in enumerate(req.jobs):
        j = owned_by(job, svc)
        j["metadata"]["uid"] = f"job-{i}"
        j["status"] = {}
        jobs.append(j)
    return svc, jobs


def pod(job: dict[str, Any], idx: int, phase: str, created: str, **extra: Any) -> dict[str, Any]:
    labels = dict(job["spec"]["template"]["metadata"]["labels"])
    labels[n.COMPLETION_INDEX] = str(idx)
    status: dict[str, Any] = {"phase": phase}
    if phase in ("Succeeded", "Failed"):
        code = 0 if phase == "Succeeded" else extra.pop("exit_code", 1)
        status["containerStatuses"] = [
            {"name": "c", "state": {"terminated": {"exitCode": code, **extra}}}
        ]
    return {
        "metadata": {
            "name": f"{job['metadata']['name']}-{idx}-{created[-3:]}",
            "uid": f"{job['metadata']['uid']}-{idx}-{created}",
            "creationTimestamp": created,
            "labels": labels,
            "annotations": {n.COMPLETION_INDEX: str(idx)},
            "ownerReferences": [
                {"kind": "Job", "uid": job["metadata"]["uid"], "name": job["metadata"]["name"]}
            ],
        },
        "spec": {"hostname": f"{job['metadata']['name']}-{idx}", "subdomain": "demo-abcdefgh"},
        "status": status,
    }


def test_describe_a_running_app() -> None:
    """A pod running makes the app RUNNING; replicas without pods are PENDING with their hostname."""
    svc, jobs = app_objects()
    pods = [pod(jobs[0], 0, "Running", "2026-01-01T00:00:01Z")]
    resp = describe_app(svc, jobs, pods)
    assert resp.app_id == "default:demo-abcdefgh"
    assert resp.state == AppState.RUNNING
    assert resp.name == "demo"
    assert [r.name for r in resp.roles] == ["trainer", "ps"]
    trainer = resp.roles_statuses[0]
    assert [r.state for r in trainer.replicas] == [AppState.RUNNING, AppState.PENDING]
    assert trainer.replicas[1].hostname == "demo-abcdefgh-trainer-1.demo-abcdefgh"


def test_describe_a_failed_app_names_the_replica_and_exit_code() -> None:
    """A failed Job makes the app FAILED with the failed replica's exit code and structured error."""
    svc, jobs = app_objects()
    jobs[1]["status"] = fixture("job_failed.yaml")["status"]
    err = json.dumps({"message": {"message": "boom", "errorCode": 7}})
    pods = [pod(jobs[1], 0, "Failed", "2026-01-01T00:00:01Z", exit_code=7, message=err)]
    resp = describe_app(svc, jobs, pods)
    assert resp.state == AppState.FAILED
    assert "role 'ps' replica 0 failed with exit code 7" in resp.msg
    assert "BackoffLimitExceeded" in resp.msg
    assert resp.structured_error_msg == err
    assert resp.roles_statuses[1].replicas[0].exit_code == 7
    assert describe_app(svc, jobs, pods, restarting=True).state == AppState.RUNNING


def test_describe_counts_restarts() -> None:
    """num_restarts adds app attempts, role attempts and per-index failures of the newest pods."""
    svc, jobs = app_objects()
    jobs[0]["metadata"]["labels"][n.LABEL_APP_ATTEMPT] = "1"
    jobs[1]["metadata"]["labels"][n.LABEL_APP_ATTEMPT] = "1"
    jobs[1]["metadata"]["labels"][n.LABEL_ROLE_ATTEMPT] = "2"
    old = pod(jobs[0], 0, "Failed", "2026-01-01T00:00:01Z")
    new = pod(jobs[0], 0, "Running", "2026-01-01T00:00:05Z")
    new["metadata"]["annotations"][n.INDEX_FAILURE_COUNT] = "1"
    new["metadata"]["annotations"][n.INDEX_IGNORED_FAILURE_COUNT] = "1"
    resp = describe_app(svc, jobs, [new, old])
    assert resp.num_restarts == 1 + 2 + 2
    assert newest_pods([old, new])[0] is new
    assert resp.roles_statuses[0].replicas[0].state == AppState.RUNNING


def test_describe_succeeded_cancelled_and_pending() -> None:
    """All Jobs complete is SUCCEEDED; a Service being deleted is CANCELLED; missing Jobs PENDING."""
    svc, jobs = app_objects()
    for j in jobs:
        j["status"] = fixture("job_complete.yaml")["status"]
    assert describe_app(svc, jobs, []).state == AppState.SUCCEEDED
    assert all(
        r.state == AppState.SUCCEEDED
        for rs in describe_app(svc, jobs, []).roles_statuses
        for r in rs.replicas
    )
    running = copy.deepcopy(jobs)
    running[0]["status"] = fixture("job_active.yaml")["status"]
    deleting = copy.deepcopy(svc)
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert describe_app(deleting, running, []).state == AppState.CANCELLED
    assert describe_app(svc, jobs[:1], []).state in (AppState.PENDING, AppState.RUNNING)
    assert describe_app(svc, [], []).state == AppState.PENDING


def test_unknown_pod_phase_makes_an_otherwise_pending_app_unknown() -> None:
    """An app whose only pod is in an unknown phase is UNKNOWN, never SUCCEEDED."""
    svc, jobs = app_objects()
    pods = [pod(jobs[0], 0, "Unknown", "2026-01-01T00:00:01Z")]
    assert describe_app(svc, jobs, pods).state == AppState.UNKNOWN


def test_log_timestamps_split_and_keep_the_newline() -> None:
    """The kubelet's timestamp prefix is split off (by the parser shared with Docker); the text
    keeps its newline and its \\r; resuming asks for sinceTime rounded down to the second."""
    ts, text = split_timestamp(b"2026-01-01T00:00:00.000000005Z progress\r 50%\n")
    assert ts == int(datetime(2026, 1, 1, tzinfo=timezone.utc).timestamp()) * 10**9 + 5
    assert text == b"progress\r 50%\n"
    assert split_timestamp(b"no timestamp\n") == (None, b"no timestamp\n")
    assert to_rfc3339_seconds(ts) == "2026-01-01T00:00:00Z"
    assert seconds_to_ns(datetime(2026, 1, 1, tzinfo=timezone.utc).timestamp()) == ts - 5


def managed_app(
    policy: RetryPolicy, max_retries: int
) -> tuple[ManagedApp, dict[str, Any], list[dict[str, Any]]]:
    """A looked-after two-role app (trainer x2, ps) with both roles on ``policy``."""
    app = AppDef(
        "demo",
        roles=[
            Role(
                "trainer",
                image="i",
                entrypoint="e",
                num_replicas=2,
                max_retries=max_retries,
                retry_policy=policy,
            ),
            Role("ps", image="i", entrypoint="e", max_retries=max_retries, retry_policy=policy),
        ],
    )
    req = build_request(app, KubernetesOptions(), "sess", app_name="demo-abcdefgh")
    svc, jobs = app_objects()
    return ManagedApp(request=req, service=svc, role_attempts=[0, 0]), svc, jobs


def fail(job: dict[str, Any]) -> list[dict[str, Any]]:
    """Marks ``job`` failed; returns its failed pod."""
    job["status"] = fixture("job_failed.yaml")["status"]
    return [pod(job, 0, "Failed", "2026-01-01T00:00:01Z", exit_code=3)]


def test_follow_up_owes_nothing_while_the_app_runs() -> None:
    """Running roles ask for no action."""
    managed, svc, jobs = managed_app(RetryPolicy.ROLE, 1)
    pods = [pod(jobs[0], 0, "Running", "2026-01-01T00:00:01Z")]
    assert follow_up(managed, svc, jobs, pods) is None


def test_follow_up_restarts_a_failed_role_with_retries_left() -> None:
    """ROLE: the failed role's Job is restarted alone; APPLICATION: every role, as the app's next
    attempt; the failed app reads RUNNING while it is restarted."""
    managed, svc, jobs = managed_app(RetryPolicy.ROLE, 1)
    pods = fail(jobs[1])
    assert follow_up(managed, svc, jobs, pods) == Restart(roles=(1,), whole_app=False)
    managed, svc, jobs = managed_app(RetryPolicy.APPLICATION, 1)
    pods = fail(jobs[1])
    assert follow_up(managed, svc, jobs, pods) == Restart(roles=(0, 1), whole_app=True)


def test_follow_up_stops_the_other_roles_once_retries_are_spent() -> None:
    """A role failed with no retry left: the roles still running (not suspended) are to stop."""
    managed, svc, jobs = managed_app(RetryPolicy.ROLE, 1)
    managed.role_attempts = [0, 1]
    pods = [*fail(jobs[1]), pod(jobs[0], 0, "Running", "2026-01-01T00:00:02Z")]
    assert follow_up(managed, svc, jobs, pods) == StopRoles((jobs[0]["metadata"]["name"],))
    jobs[0]["spec"]["suspend"] = True
    assert follow_up(managed, svc, jobs, pods) == StopRoles(())


def test_follow_up_forgets_a_finished_or_deleted_app() -> None:
    """Every role succeeded, the Service is gone, or it is being deleted: stop looking after it."""
    managed, svc, jobs = managed_app(RetryPolicy.ROLE, 1)
    for job in jobs:
        job["status"] = fixture("job_complete.yaml")["status"]
    assert follow_up(managed, svc, jobs, []) == Forget()
    assert follow_up(managed, None, jobs, []) == Forget()
    svc["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:03Z"
    assert follow_up(managed, svc, [], []) == Forget()
