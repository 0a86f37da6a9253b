"""App handles ``{scheduler}://{session}/{app_id}`` and unique app ids."""

from __future__ import annotations

import os
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynctorchx.specs import (
    MalformedAppHandleException,
    ParsedAppHandle,
    UnknownAppException,
    UnknownSchedulerException,
    make_app_handle,
    make_unique,
    parse_app_handle,
)

_K8S_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DOCKER_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]+")


def test_parse_app_handle_splits_the_three_parts() -> None:
    """parse_app_handle returns (scheduler_backend, session_name, app_id) by name and position."""
    parsed = parse_app_handle("local_cwd://my-session/trainer-abc123")
    assert parsed == ParsedAppHandle("local_cwd", "my-session", "trainer-abc123")
    assert parsed.scheduler_backend == "local_cwd"
    assert parsed.session_name == "my-session"
    assert parsed.app_id == "trainer-abc123"


def test_parse_app_handle_accepts_an_empty_session() -> None:
    """``scheduler:///app_id`` has an empty session name."""
    assert parse_app_handle("slurm:///1234") == ParsedAppHandle("slurm", "", "1234")


def test_app_id_may_contain_colons_and_slashes() -> None:
    """Everything after the session's slash is the app id (e.g. ``namespace:name`` on Kubernetes)."""
    assert parse_app_handle("kubernetes://s/default:job-1").app_id == "default:job-1"
    assert parse_app_handle("x://s/a/b").app_id == "a/b"


@pytest.mark.parametrize(
    "bad",
    [
        "nonsense",
        "",
        "local_cwd://session",
        "local_cwd://session/",
        "://session/app",
        "local_cwd:/session/app",
        "local cwd://s/app",
        "local_cwd://s/app id",
    ],
)
def test_parse_app_handle_rejects_malformed_handles_naming_the_form(bad: str) -> None:
    """A string that is not a handle raises MalformedAppHandleException naming it and the form."""
    with pytest.raises(MalformedAppHandleException) as ei:
        parse_app_handle(bad)
    assert repr(bad) in str(ei.value)
    assert "<scheduler_backend>://<session_name>/<app_id>" in str(ei.value)
    assert ei.value.app_handle == bad
    assert isinstance(ei.value, ValueError)


def test_parse_app_handle_rejects_non_strings() -> None:
    """A non-string handle raises MalformedAppHandleException, not a TypeError."""
    with pytest.raises(MalformedAppHandleException):
        parse_app_handle(None)  # type: ignore[arg-type]


def test_make_app_handle_formats_the_parts() -> None:
    """make_app_handle joins the parts as ``{scheduler}://{session}/{app_id}``."""
    assert make_app_handle("local_cwd", "s", "a-1") == "local_cwd://s/a-1"
    assert make_app_handle("slurm", "", "42") == "slurm:///42"


@pytest.mark.parametrize(
    ("backend", "session", "app_id", "field"),
    [
        ("", "s", "a", "scheduler_backend"),
        ("a:b", "s", "a", "scheduler_backend"),
        ("local", "s/t", "a", "session_name"),
        ("local", "s t", "a", "session_name"),
        ("local", "s", "", "app_id"),
        ("local", "s", "a b", "app_id"),
    ],
)
def test_make_app_handle_rejects_parts_that_cannot_be_parsed_back(
    backend: str, session: str, app_id: str, field: str
) -> None:
    """A part that would make the handle ambiguous raises MalformedAppHandleException naming it."""
    with pytest.raises(MalformedAppHandleException, match=rf"{field}="):
        make_app_handle(backend, session, app_id)


_BACKENDS = st.from_regex(r"[a-z][a-z0-9_\-]{0,15}", fullmatch=True)
_SESSIONS = st.text(
    alphabet=st.characters(exclude_characters="/", exclude_categories=("Z", "C")), max_size=16
)
_APP_IDS = st.text(alphabet=st.characters(exclude_categories=("Z", "C")), min_size=1, max_size=24)


@settings(deadline=None, max_examples=60)
@given(_BACKENDS, _SESSIONS, _APP_IDS)
def test_make_then_parse_round_trips(backend: str, session: str, app_id: str) -> None:
    """parse_app_handle(make_app_handle(b, s, a)) == (b, s, a), including an empty session."""
    handle = make_app_handle(backend, session, app_id)
    assert parse_app_handle(handle) == (backend, session, app_id)
    assert make_app_handle(*parse_app_handle(handle)) == handle


def test_make_unique_has_name_prefix_and_random_suffix() -> None:
    """make_unique keeps a sanitised name prefix and appends a random suffix of the given length."""
    a, b = make_unique("trainer"), make_unique("trainer")
    assert a != b
    assert re.fullmatch(r"trainer-[a-z0-9]{8}", a)
    assert re.fullmatch(r"my-app-[a-z0-9]{5}", make_unique("My_App", string_length=5))


def test_make_unique_differs_in_a_forked_child() -> None:
    """Ids come from a generator of the process, seeded again in a forked child: a child and its
    parent drawing next do not get the same id (with the state copied by ``fork``, they would)."""
    make_unique("warm")  # the generator is in use before the fork
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.write(w, "".join(make_unique("t") for _ in range(4)).encode())
        finally:
            os._exit(0)
    os.close(w)
    mine = "".join(make_unique("t") for _ in range(4))
    with os.fdopen(r, "rb") as f:
        theirs = f.read().decode()
    os.waitpid(pid, 0)
    assert len(theirs) == len(mine) and theirs != mine


def test_make_unique_rejects_too_small_max_length() -> None:
    """A max_length that cannot hold a prefix, a dash and the suffix raises ValueError naming it."""
    with pytest.raises(ValueError, match="max_length"):
        make_unique("x", string_length=8, max_length=9)


@settings(deadline=None, max_examples=60)
@given(
    st.text(max_size=80),
    st.integers(min_value=0, max_value=16),
    st.integers(min_value=18, max_value=63),
)
def test_make_unique_is_a_valid_k8s_dns_label_and_docker_name(
    name: str, string_length: int, max_length: int
) -> None:
    """For any name the id is a Kubernetes DNS label (and RFC 1035 label) and a Docker name."""
    app_id = make_unique(name, string_length=string_length, max_length=max_length)
    assert len(app_id) <= max_length
    assert _K8S_DNS_LABEL.fullmatch(app_id)
    assert app_id[0].isalpha()
    assert _DOCKER_NAME.fullmatch(app_id)
    assert parse_app_handle(make_app_handle("kubernetes", "s", app_id)).app_id == app_id


def test_unknown_scheduler_exception_names_backend_and_available() -> None:
    """UnknownSchedulerException names the unknown backend and lists the available ones, sorted."""
    err = UnknownSchedulerException("lokal", ["slurm", "local_cwd"])
    assert str(err) == "unknown scheduler 'lokal'; available: local_cwd, slurm"
    assert err.scheduler_backend == "lokal"
    assert isinstance(err, ValueError)


def test_unknown_app_exception_names_the_handle() -> None:
    """UnknownAppException names the handle, with the reason when one is given."""
    err = UnknownAppException("local_cwd://s/a")
    assert "'local_cwd://s/a'" in str(err)
    assert err.app_handle == "local_cwd://s/a"
    assert isinstance(err, LookupError)
    assert str(UnknownAppException("x://s/a", "purged")) == "unknown app 'x://s/a': purged"
