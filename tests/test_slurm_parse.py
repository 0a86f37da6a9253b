"""Parsing what squeue/sacct/sbatch print (recorded from the real test cluster) and mapping states."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from asynctorchx.schedulers._slurm.parse import (
    DEFAULT_MAX_SCRIPT_SIZE,
    KNOWN_STATES,
    SlurmJob,
    SlurmOutputError,
    SlurmPartition,
    base_state,
    first_host,
    json_errors,
    num,
    parse_max_script_size,
    parse_partitions,
    parse_sacct_parsable,
    parse_sbatch_parsable,
    parse_squeue_json,
)
from asynctorchx.schedulers._slurm.status import (
    SLURM_STATES,
    aggregate_state,
    app_state_of,
    describe_from_records,
)
from asynctorchx.specs.api import AppState

FIXTURES = Path(__file__).parent / "fixtures" / "slurm"
SCENARIOS: dict[str, dict[str, Any]] = json.loads((FIXTURES / "scenarios.json").read_text())["apps"]


def _read(name: str) -> str:
    return (FIXTURES / name).read_text()


def _app(records: list[SlurmJob], app_id: str) -> list[SlurmJob]:
    latest: dict[int, SlurmJob] = {}
    for job in records:
        if job.app_id == app_id:
            latest[job.job_id] = job
    return list(latest.values())


# -- the state table ---------------------------------------------------------------------------


def test_every_documented_state_is_in_the_table() -> None:
    """Every Slurm job state squeue/sacct document has an explicit AppState."""
    assert set(SLURM_STATES) == KNOWN_STATES


@pytest.mark.parametrize(
    ("slurm", "expected"),
    [
        ("PENDING", AppState.PENDING),
        ("RUNNING", AppState.RUNNING),
        ("COMPLETING", AppState.RUNNING),
        ("COMPLETED", AppState.SUCCEEDED),
        ("FAILED", AppState.FAILED),
        ("CANCELLED", AppState.CANCELLED),
        ("CANCELLED by 0", AppState.CANCELLED),
        ("cancelled by 1000", AppState.CANCELLED),
        ("TIMEOUT", AppState.FAILED),
        ("OUT_OF_MEMORY", AppState.FAILED),
        ("NODE_FAIL", AppState.FAILED),
        ("PREEMPTED", AppState.FAILED),
        ("REQUEUED", AppState.PENDING),
        ("SUSPENDED", AppState.PENDING),
        ("BOOT_FAIL", AppState.FAILED),
        ("DEADLINE", AppState.FAILED),
    ],
)
def test_state_table(slurm: str, expected: AppState) -> None:
    """Slurm states map to the AppState TorchX users expect."""
    assert app_state_of(slurm) == expected


@pytest.mark.parametrize("slurm", ["", "   ", "FUTURE_STATE", "WEIRD by 3"])
def test_unknown_state_is_unknown_not_a_crash(slurm: str) -> None:
    """A state that is not in the table (or empty) maps to UNKNOWN."""
    assert app_state_of(slurm) == AppState.UNKNOWN


def test_no_state_maps_to_succeeded_except_completed() -> None:
    """Only COMPLETED means SUCCEEDED."""
    assert [s for s, a in SLURM_STATES.items() if a == AppState.SUCCEEDED] == ["COMPLETED"]


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        ([AppState.RUNNING, AppState.PENDING], AppState.RUNNING),
        ([AppState.PENDING, AppState.PENDING], AppState.PENDING),
        ([AppState.SUCCEEDED, AppState.RUNNING], AppState.RUNNING),
        ([AppState.SUCCEEDED, AppState.SUCCEEDED], AppState.SUCCEEDED),
        ([AppState.SUCCEEDED, AppState.FAILED], AppState.FAILED),
        ([AppState.FAILED, AppState.CANCELLED], AppState.CANCELLED),
        ([AppState.SUCCEEDED, AppState.UNKNOWN], AppState.UNKNOWN),
        ([], AppState.UNKNOWN),
    ],
)
def test_aggregate_state(states: list[AppState], expected: AppState) -> None:
    """Components combine: live wins, then CANCELLED > FAILED > SUCCEEDED; unknown stays unknown."""
    assert aggregate_state(states) == expected


# -- field helpers: every shape Slurm versions print ------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (3, 3),
        ("42", 42),
        ({"set": True, "infinite": False, "number": 7}, 7),
        ({"set": False, "number": 0}, None),
        ({"set": True, "infinite": True, "number": 0}, None),
        (4294967294, None),
        (None, None),
        (True, None),
        ("n/a", None),
        ([1], None),
    ],
)
def test_num_accepts_every_number_shape(value: Any, expected: int | None) -> None:
    """Numbers come as ints, strings or {set, infinite, number}; NO_VAL and garbage give None."""
    assert num(value) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("RUNNING", "RUNNING"),
        ("CANCELLED by 0", "CANCELLED"),
        (["PENDING", "REQUEUED"], "PENDING"),
        (["COMPLETING", "CANCELLED"], "COMPLETING"),
        (["FLAG_ONLY", "TIMEOUT"], "TIMEOUT"),
        ({"current": ["FAILED"], "reason": "x"}, "FAILED"),
        ({"current": "COMPLETED"}, "COMPLETED"),
        (None, "UNKNOWN"),
        ([], "UNKNOWN"),
        (12, "UNKNOWN"),
    ],
)
def test_base_state_accepts_every_state_shape(value: Any, expected: str) -> None:
    """States come as strings, lists of flags (23.02+) or {current: ...}; junk gives UNKNOWN."""
    assert base_state(value) == expected


@pytest.mark.parametrize(
    ("nodes", "expected"),
    [
        ("node1", "node1"),
        ("node[3-4,7]", "node3"),
        ("gpu[01-02],cpu1", "gpu01"),
        ("", ""),
        ("(null)", ""),
    ],
)
def test_first_host(nodes: str, expected: str) -> None:
    """The first host of a Slurm host list expression."""
    assert first_host(nodes) == expected


# -- squeue --json (recorded) ------------------------------------------------------------------


def test_squeue_live_snapshot_states() -> None:
    """The live snapshot (running, pending, suspended, requeued jobs) maps to the expected states."""
    records = parse_squeue_json(_read("squeue-live.json"))
    for key, scenario in SCENARIOS.items():
        if scenario["live_state"] is None:
            continue
        comps = _app(records, scenario["app_id"])
        resp = describe_from_records(scenario["app_id"], comps, 0)
        assert resp.state == AppState[scenario["live_state"]], key


def test_squeue_final_snapshot_matches_scenarios() -> None:
    """After the runs, squeue alone gives every scenario's final state and replica layout."""
    records = parse_squeue_json(_read("squeue-final.json"))
    for key, scenario in SCENARIOS.items():
        comps = _app(records, scenario["app_id"])
        resp = describe_from_records(scenario["app_id"], comps, max(c.restarts for c in comps))
        assert resp.state == AppState[scenario["state"]], key
        replicas = {rs.role: len(rs.replicas) for rs in resp.roles_statuses}
        assert replicas == scenario["replicas"], key
        assert {r.name: r.num_replicas for r in resp.roles} == scenario["replicas"], key
        if "restarts" in scenario:
            assert resp.num_restarts == scenario["restarts"], key


def test_squeue_het_components_and_hosts() -> None:
    """A 2x2 app is four components of one het job, each replica on its own node."""
    records = parse_squeue_json(_read("squeue-live.json"))
    app_id = SCENARIOS["success_2x2"]["app_id"]
    comps = _app(records, app_id)
    assert sorted(c.het_offset for c in comps) == [0, 1, 2, 3]
    resp = describe_from_records(app_id, comps, 0)
    hosts = [r.hostname for rs in resp.roles_statuses for r in rs.replicas]
    assert sorted(hosts) == ["node1", "node2", "node3", "node4"]
    trainer = next(rs for rs in resp.roles_statuses if rs.role == "trainer")
    assert [r.id for r in trainer.replicas] == [0, 1]
    assert len({c.workdir for c in comps}) == 1 and comps[0].workdir.startswith("/")


def test_squeue_exit_code_is_decoded_from_wait_status() -> None:
    """squeue's raw wait status (768) is exit code 3; a cancel shows the signal, not an exit code."""
    records = parse_squeue_json(_read("squeue-final.json"))
    failed = _app(records, SCENARIOS["failed"]["app_id"])
    assert {c.exit_code for c in failed} == {3}
    resp = describe_from_records(SCENARIOS["failed"]["app_id"], failed, 0)
    assert "exit code 3" in resp.msg
    cancelled = _app(records, SCENARIOS["cancel_running"]["app_id"])
    assert {(c.exit_code, c.signal) for c in cancelled} == {(None, 15)}


def test_squeue_pending_reason_in_message() -> None:
    """A pending app's message carries Slurm's reason (BeginTime here)."""
    records = parse_squeue_json(_read("squeue-live.json"))
    app_id = SCENARIOS["cancel_pending"]["app_id"]
    resp = describe_from_records(app_id, _app(records, app_id), 0)
    assert resp.msg == "PENDING: BeginTime"
    assert all(r.hostname == "" for rs in resp.roles_statuses for r in rs.replicas)


def test_squeue_requeued_job_counts_restart() -> None:
    """A requeued job waits PENDING with restart_cnt 1."""
    records = parse_squeue_json(_read("squeue-live.json"))
    comps = _app(records, SCENARIOS["requeue"]["app_id"])
    assert {c.state for c in comps} == {"PENDING"}
    assert {c.restarts for c in comps} == {1}


def test_squeue_controller_down_reports_errors() -> None:
    """With the controller unreachable squeue exits 0 with an empty list: its errors are found."""
    errors = json.loads(_read("errors.json"))["squeue_controller_down"]
    assert errors["returncode"] == 0
    assert json_errors(errors["stdout"]) == ["Failed while looking for jobs"]
    assert parse_squeue_json(errors["stdout"]) == []


def test_squeue_23_shapes() -> None:
    """The 23.02+ shapes (state lists, structured numbers and exit codes) parse the same way."""
    doc = {
        "jobs": [
            {
                "job_id": 50,
                "het_job_id": {"set": True, "number": 50},
                "het_job_offset": {"set": True, "number": 0},
                "name": "trainer-0",
                "job_state": ["FAILED"],
                "state_reason": "NonZeroExitCode",
                "exit_code": {"status": ["EXITED"], "return_code": {"set": True, "number": 3}},
                "nodes": "node1",
                "restart_cnt": 2,
                "current_working_directory": "/w",
                "submit_time": {"set": True, "number": 1700000000},
                "user_id": 1000,
            },
            {"job_id": "garbage"},
            "not a record",
        ]
    }
    [job] = parse_squeue_json(json.dumps(doc))
    assert (job.app_id, job.state, job.exit_code, job.restarts, job.submit_time) == (
        "50",
        "FAILED",
        3,
        2,
        1700000000,
    )


@pytest.mark.parametrize("text", ["", "not json", "[1, 2]", "<html>"])
def test_squeue_garbage_raises_output_error(text: str) -> None:
    """Output that is not a JSON object raises SlurmOutputError (one line, quoting the output)."""
    with pytest.raises(SlurmOutputError, match="squeue"):
        parse_squeue_json(text)


def test_squeue_missing_fields_are_tolerated() -> None:
    """A record with only a job id parses to an UNKNOWN-state job instead of raising."""
    [job] = parse_squeue_json('{"jobs": [{"job_id": 9}]}')
    assert (job.state, job.name, job.exit_code, job.restarts) == ("UNKNOWN", "", None, 0)
    resp = describe_from_records("9", [job], 0)
    assert resp.state == AppState.UNKNOWN


# -- sacct --parsable2 (recorded) --------------------------------------------------------------


def test_sacct_final_matches_scenarios() -> None:
    """sacct alone (latest run of each component) gives every scenario's final state and restarts."""
    records = parse_sacct_parsable(_read("sacct-final.txt"))
    for key, scenario in SCENARIOS.items():
        app_id = scenario["app_id"]
        runs = [j for j in records if j.app_id == app_id]
        leader = min(runs, key=lambda j: j.het_offset).job_id
        restarts = sum(1 for j in runs if j.job_id == leader) - 1
        resp = describe_from_records(app_id, _app(records, app_id), restarts)
        assert resp.state == AppState[scenario["state"]], key
        assert {rs.role: len(rs.replicas) for rs in resp.roles_statuses} == scenario["replicas"], (
            key
        )
        assert restarts == scenario.get("restarts", 0), key


def test_sacct_failed_replica_exit_codes_from_steps() -> None:
    """sacct's srun steps give each replica's exit code: the failed one 3, the killed one 128+15."""
    records = parse_sacct_parsable(_read("sacct-final.txt"))
    app_id = SCENARIOS["failed"]["app_id"]
    resp = describe_from_records(app_id, _app(records, app_id), 0)
    [worker] = resp.roles_statuses
    assert [r.exit_code for r in worker.replicas] == [3, 143]
    assert "exit code 3" in resp.msg


def test_sacct_cancelled_by_uid_is_cancelled() -> None:
    """'CANCELLED by 0' rows read as CANCELLED."""
    records = parse_sacct_parsable(_read("sacct-final.txt"))
    app_id = SCENARIOS["cancel_running"]["app_id"]
    assert {j.state for j in _app(records, app_id)} == {"CANCELLED"}


def test_sacct_requeued_runs_keep_their_own_steps() -> None:
    """With --duplicates each run of a requeued job has its own steps; the last run is COMPLETED."""
    records = parse_sacct_parsable(_read("sacct-final.txt"))
    leader = int(SCENARIOS["requeue"]["app_id"])
    runs = [j for j in records if j.job_id == leader]
    assert [j.state for j in runs] == ["REQUEUED", "COMPLETED"]
    assert [s.exit_code for s in runs[0].steps if s.step_id == "0"] == [5]
    assert [s.exit_code for s in runs[1].steps if s.step_id == "0"] == [0]


def test_sacct_never_started_job_has_no_host() -> None:
    """A job cancelled while pending ('None assigned') has no hostname."""
    records = parse_sacct_parsable(_read("sacct-final.txt"))
    assert {j.nodes for j in _app(records, SCENARIOS["cancel_pending"]["app_id"])} == {""}


def test_sacct_default_format_parses() -> None:
    """sacct's default --parsable2 columns (no JobIDRaw, no WorkDir) still parse."""
    records = parse_sacct_parsable(_read("sacct-default.txt"))
    app_id = SCENARIOS["success_2x2"]["app_id"]
    comps = _app(records, app_id)
    assert sorted(j.name for j in comps) == ["reader-0", "reader-1", "trainer-0", "trainer-1"]
    assert describe_from_records(app_id, comps, 0).state == AppState.SUCCEEDED


def test_sacct_without_header_columns_raises() -> None:
    """A table without JobID/State columns raises SlurmOutputError."""
    with pytest.raises(SlurmOutputError):
        parse_sacct_parsable("Foo|Bar\n1|2\n")


def test_sacct_empty_output_is_no_jobs() -> None:
    """Nothing printed (no such job) is an empty list."""
    assert parse_sacct_parsable("") == []
    assert parse_sacct_parsable("JobID|State\n") == []


# -- sbatch ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("out", "expected"), [("123\n", "123"), ("77;cluster\n", "77"), ("warn\n88\n", "88")]
)
def test_sbatch_parsable(out: str, expected: str) -> None:
    """sbatch --parsable prints ID or ID;CLUSTER."""
    assert parse_sbatch_parsable(out) == expected


def test_sbatch_without_id_raises() -> None:
    """No job id in sbatch's output raises SlurmOutputError."""
    with pytest.raises(SlurmOutputError, match="no job id"):
        parse_sbatch_parsable("Submitted nothing\n")


# -- cluster configuration ---------------------------------------------------------------------


def test_partitions_from_scontrol_oneliner() -> None:
    """scontrol --oneliner show partition gives each partition's node count, its nodes and the
    default one; a line without a count is skipped."""
    text = (
        "PartitionName=debug Default=YES MaxNodes=UNLIMITED Nodes=node[1-4] TotalNodes=4 State=UP\n"
        "PartitionName=gpu Default=NO Nodes=g[1-16] TotalCPUs=64 TotalNodes=16\n"
        "PartitionName=broken Default=NO\n"
    )
    assert parse_partitions(text) == {
        "debug": SlurmPartition("debug", 4, True, "node[1-4]"),
        "gpu": SlurmPartition("gpu", 16, False, "g[1-16]"),
    }
    assert parse_partitions("") == {}


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ("bf_interval=1,bf_hetjob_immediate", DEFAULT_MAX_SCRIPT_SIZE),
        ("(null)", DEFAULT_MAX_SCRIPT_SIZE),
        ("bf_interval=1,max_script_size=1000", 1000),
        ("max_script_size=20000000", 20_000_000),
    ],
)
def test_max_script_size_from_scontrol_show_config(params: str, expected: int) -> None:
    """The controller's max_script_size is SchedulerParameters' value, else Slurm's 4 MiB default."""
    text = f"MaxJobCount             = 10000\nSchedulerParameters     = {params}\n"
    assert parse_max_script_size(text) == expected


def test_max_script_size_is_unknown_without_a_configuration_listing() -> None:
    """Output that is no configuration listing (e.g. an error) gives no limit rather than a guess."""
    assert parse_max_script_size("slurm_load_ctl_conf error: Unable to contact controller") is None
