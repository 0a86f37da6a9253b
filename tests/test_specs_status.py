"""AppState, ReplicaStatus, RoleStatus, AppStatus (format, raise_for_status, to_json, repr), AppDryRunInfo."""

from __future__ import annotations

import copy
import json
from datetime import datetime

import pytest

from asynctorchx.specs import (
    NONE,
    AppDef,
    AppDryRunInfo,
    AppState,
    AppStatus,
    AppStatusError,
    ReplicaState,
    ReplicaStatus,
    Role,
    RoleStatus,
    is_started,
    is_terminal,
)

_TS = 1_700_000_000
_CALLSTACK = (
    "Traceback (most recent call last):\n"
    '  File "train.py", line 3, in <module>\n'
    "    main()\n"
    "RuntimeError: CUDA out of memory"
)


def _elastic_error(message: str = "RuntimeError: CUDA out of memory", code: int | None = 1) -> str:
    """A torchelastic error file's JSON (what ``torch.distributed.elastic`` ``@record`` writes)."""
    return json.dumps(
        {
            "message": {
                "message": message,
                "errorCode": code,
                "extraInfo": {"py_callstack": _CALLSTACK, "timestamp": str(_TS)},
            }
        }
    )


def _status(**kw: object) -> AppStatus:
    roles = [
        RoleStatus(
            "trainer",
            [
                ReplicaStatus(1, AppState.RUNNING, "trainer", "node-b"),
                ReplicaStatus(
                    0,
                    AppState.FAILED,
                    "trainer",
                    "node-a",
                    structured_error_msg=_elastic_error(),
                    exit_code=1,
                ),
            ],
        ),
        RoleStatus("ps", [ReplicaStatus(0, AppState.SUCCEEDED, "ps", "node-c", exit_code=0)]),
    ]
    args: dict[str, object] = {"state": AppState.FAILED, "num_restarts": 2, "roles": roles}
    args.update(kw)
    return AppStatus(**args)  # type: ignore[arg-type]


# -- AppState --------------------------------------------------------------------------------------


def test_app_state_names_and_int_values_match_torchx() -> None:
    """AppState has TorchX's eight states with the same int values, in order."""
    assert [(s.name, int(s)) for s in AppState] == [
        ("UNSUBMITTED", 0),
        ("SUBMITTED", 1),
        ("PENDING", 2),
        ("RUNNING", 3),
        ("SUCCEEDED", 4),
        ("FAILED", 5),
        ("CANCELLED", 6),
        ("UNKNOWN", 7),
    ]
    assert AppState(5) is AppState.FAILED
    assert ReplicaState is AppState


def test_app_state_str_and_format_are_the_name() -> None:
    """str(), f-strings and format specs all render the state's name, not its number."""
    assert str(AppState.RUNNING) == "RUNNING"
    assert f"{AppState.RUNNING}" == "RUNNING"
    assert f"{AppState.FAILED:>8}|" == "  FAILED|"
    assert format(AppState.CANCELLED, "") == "CANCELLED"


@pytest.mark.parametrize("state", list(AppState))
def test_is_terminal_and_is_started(state: AppState) -> None:
    """Terminal: SUCCEEDED, FAILED, CANCELLED. Started: RUNNING or terminal."""
    terminal = state in (AppState.SUCCEEDED, AppState.FAILED, AppState.CANCELLED)
    assert is_terminal(state) is terminal
    assert AppStatus(state).is_terminal() is terminal
    assert is_started(state) is (terminal or state == AppState.RUNNING)


# -- ReplicaStatus / RoleStatus --------------------------------------------------------------------


def test_replica_status_has_torchx_fields_and_defaults() -> None:
    """ReplicaStatus has id, state, role, hostname and structured_error_msg (NONE by default)."""
    r = ReplicaStatus(id=0, state=AppState.RUNNING, role="trainer", hostname="h")
    assert (r.id, r.state, r.role, r.hostname, r.structured_error_msg) == (
        0,
        AppState.RUNNING,
        "trainer",
        "h",
        NONE,
    )
    assert r.exit_code is None and r.pid is None


def test_role_status_to_json_uses_state_names() -> None:
    """RoleStatus.to_json lists its replicas as JSON-ready dicts with states as names."""
    rs = RoleStatus("ps", [ReplicaStatus(0, AppState.SUCCEEDED, "ps", "h", exit_code=0, pid=7)])
    out = rs.to_json()
    assert out == {
        "role": "ps",
        "replicas": [
            {
                "id": 0,
                "state": "SUCCEEDED",
                "role": "ps",
                "hostname": "h",
                "structured_error_msg": NONE,
                "exit_code": 0,
                "pid": 7,
            }
        ],
    }
    json.dumps(out)


# -- AppStatus.format ------------------------------------------------------------------------------


def test_format_without_structured_error() -> None:
    """format() shows state, restarts, each replica (sorted by id) with exit code and host, msg, url."""
    st = _status(structured_error_msg=NONE, msg="worker died", ui_url="http://ui/app")
    st.roles[0].replicas[1] = ReplicaStatus(0, AppState.FAILED, "trainer", "node-a", exit_code=1)
    text = st.format()
    lines = text.splitlines()
    assert lines[:3] == ["AppStatus:", "  State: FAILED", "  Num Restarts: 2"]
    assert "    trainer[0] FAILED (exit code: 1) on node-a" in lines
    assert "    trainer[1] RUNNING on node-b" in lines
    assert lines.index("    trainer[0] FAILED (exit code: 1) on node-a") < lines.index(
        "    trainer[1] RUNNING on node-b"
    )
    assert "    ps[0] SUCCEEDED (exit code: 0) on node-c" in lines
    assert "  Msg: worker died" in lines
    assert "  UI URL: http://ui/app" in lines
    assert "Error" not in text
    assert "{" not in text


def test_format_with_structured_error_shows_message_stack_and_time() -> None:
    """A torchelastic error JSON (app or replica) is shown as message, call stack and time, not JSON."""
    st = _status(structured_error_msg=_elastic_error())
    text = st.format()
    when = datetime.fromtimestamp(_TS).isoformat(sep=" ")
    assert f"  Error (at {when}, error code 1):" in text.splitlines()
    assert f"      Error (at {when}, error code 1):" in text.splitlines()
    assert "RuntimeError: CUDA out of memory" in text
    assert '    File "train.py", line 3, in <module>' in text
    assert '"extraInfo"' not in text
    assert "{" not in text


def test_format_with_plain_text_structured_error_keeps_the_text() -> None:
    """A structured_error_msg that is not JSON is shown verbatim, never dropped."""
    text = AppStatus(AppState.FAILED, structured_error_msg="segfault in worker").format()
    assert "  Error:" in text.splitlines()
    assert "    segfault in worker" in text.splitlines()


def test_format_with_string_message_and_no_code() -> None:
    """An error JSON whose ``message`` is a string is shown without a code."""
    err = json.dumps({"message": "killed by OOM", "timestamp": _TS})
    text = AppStatus(AppState.FAILED, structured_error_msg=err).format()
    assert "killed by OOM" in text
    assert "error code" not in text


def test_format_filter_roles() -> None:
    """format(filter_roles=[...]) shows only the named roles."""
    text = _status().format(filter_roles=["ps"])
    assert "ps[0]" in text
    assert "trainer[" not in text


# -- raise_for_status / to_json / repr -------------------------------------------------------------


def test_raise_for_status_passes_on_succeeded() -> None:
    """raise_for_status() does not raise for a SUCCEEDED app."""
    AppStatus(AppState.SUCCEEDED).raise_for_status()


@pytest.mark.parametrize("state", [s for s in AppState if s != AppState.SUCCEEDED])
def test_raise_for_status_raises_app_status_error_otherwise(state: AppState) -> None:
    """Any state other than SUCCEEDED raises AppStatusError carrying the status and naming the state."""
    st = AppStatus(state, msg="boom")
    with pytest.raises(AppStatusError) as ei:
        st.raise_for_status()
    assert ei.value.app_status is st
    assert ei.value.status is st
    message = str(ei.value)
    assert message.startswith(f"app ended in state {state.name}")
    assert "Msg: boom" in message
    assert not message.startswith("(")


def test_to_json_is_json_serialisable_with_state_names() -> None:
    """to_json() returns a dict that json.dumps accepts, with states as names."""
    out = _status(msg="m", ui_url="u").to_json()
    assert json.loads(json.dumps(out)) == out
    assert out["state"] == "FAILED"
    assert out["num_restarts"] == 2
    assert out["msg"] == "m" and out["ui_url"] == "u"
    assert [r["role"] for r in out["roles"]] == ["trainer", "ps"]
    assert out["roles"][0]["replicas"][1]["state"] == "FAILED"


def test_repr_is_one_readable_line() -> None:
    """repr(AppStatus) is one line naming the state, restarts, role and replica counts and msg."""
    text = repr(_status(msg="m"))
    assert "\n" not in text
    assert text == "AppStatus(state=FAILED, num_restarts=2, roles=2, replicas=3, msg='m')"


def test_format_and_to_json_do_not_mutate_status() -> None:
    """format(), to_json(), repr() and raise_for_status() leave the status unchanged."""
    st = _status(structured_error_msg=_elastic_error())
    before = copy.deepcopy(st)
    st.format()
    st.to_json()
    repr(st)
    with pytest.raises(AppStatusError):
        st.raise_for_status()
    assert st == before


# -- AppDryRunInfo ---------------------------------------------------------------------------------


def test_dryrun_info_repr_and_str_use_the_formatter() -> None:
    """repr() and str() of AppDryRunInfo are the formatter applied to the request."""
    info = AppDryRunInfo({"script": "#!/bin/sh\necho hi"}, lambda r: f"SCRIPT:\n{r['script']}")
    assert repr(info) == "SCRIPT:\n#!/bin/sh\necho hi"
    assert str(info) == repr(info)
    assert info.request == {"script": "#!/bin/sh\necho hi"}


def test_dryrun_info_back_references() -> None:
    """The app, cfg and scheduler set by the scheduler/runner are readable back from the info
    (before that: no app, an empty cfg as in TorchX, no scheduler)."""
    info: AppDryRunInfo[str] = AppDryRunInfo("req", str)
    assert (info.app, info.cfg, info.scheduler) == (None, {}, None)
    app = AppDef("a", roles=[Role("r", image="i", entrypoint="e")])
    info._app = app
    info._cfg = {"k": "v"}
    info._scheduler = "local_cwd"
    assert info.app is app
    assert info.cfg == {"k": "v"}
    assert info.scheduler == "local_cwd"
