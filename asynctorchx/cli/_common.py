"""What several commands share: opening a runner for a handle, backend ownership, times, concurrency."""

from __future__ import annotations

import re
from collections.abc import Coroutine, Iterable
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from asynctorchx.cli._errors import CliError, ExitCode

if TYPE_CHECKING:
    from asynctorchx.runner.api import AsyncRunner

#: Backends whose apps are child processes of the CLI: they stop when the CLI's runner closes.
OWNED_BACKENDS = frozenset({"local_cwd", "local_dir"})


def apps_outlive_cli(scheduler: str) -> bool:
    """True when apps of ``scheduler`` keep running after the CLI exits (Docker, Slurm, Kubernetes)."""
    return scheduler not in OWNED_BACKENDS


def split_handle(handle: str) -> tuple[str, str, str]:
    """``(scheduler, session, app_id)`` of ``handle``.

    Raises:
        MalformedAppHandleException: ``handle`` is not ``{scheduler}://{session}/{app_id}``.
    """
    from asynctorchx.specs.api import parse_app_handle

    parsed = parse_app_handle(handle)
    return parsed.scheduler_backend, parsed.session_name, parsed.app_id


def runner_for_session(session: str | None) -> AsyncRunner:
    """An unopened runner for ``session`` (the default session when None or empty).

    An empty session (``local_cwd:///app``) maps to the default session, as TorchX does.
    """
    from asynctorchx.runner.api import get_runner

    return get_runner(name=session or None)


def runner_for_handle(handle: str) -> tuple[AsyncRunner, str]:
    """An unopened runner of the handle's session, and the handle as that runner names it.

    Raises:
        MalformedAppHandleException: not a handle.
    """
    from asynctorchx.runner.api import DEFAULT_SESSION_NAME
    from asynctorchx.specs.api import make_app_handle

    scheduler, session, app_id = split_handle(handle)
    runner = runner_for_session(session)
    if not session:
        handle = make_app_handle(scheduler, DEFAULT_SESSION_NAME, app_id)
    return runner, handle


def unknown_app(handle: str) -> CliError:
    """The error for a handle whose scheduler does not know the app."""
    scheduler = handle.split("://", 1)[0]
    return CliError(
        f"unknown app {handle!r}: its scheduler does not know it (never existed, or purged)",
        f"'asynctorchx list -s {scheduler}' lists the apps it knows",
        ExitCode.UNKNOWN,
    )


# -- times ---------------------------------------------------------------------------------------

_RELATIVE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)", re.IGNORECASE)
_RELATIVE_ALL = re.compile(r"(?:\d+(?:\.\d+)?(?:ms|s|m|h|d|w))+", re.IGNORECASE)
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def local_time(value: datetime) -> datetime:
    """The aware ``value`` as a naive local time naming the same instant.

    ``fold`` is set in the hour that a change from daylight saving time repeats (the second
    02:30 gets ``fold=1``), so that ``timestamp()`` gives ``value``'s instant back exactly;
    ``astimezone().replace(tzinfo=None)`` alone would name the first one, an hour off.
    """
    local = value.astimezone()
    naive = local.replace(tzinfo=None)
    if naive.astimezone().utcoffset() != local.utcoffset():
        naive = naive.replace(fold=1)
    return naive


def parse_time(text: str, option: str, now: datetime | None = None) -> datetime:
    """Parses an absolute ISO 8601 time or a relative one (``30s``, ``10m``, ``2h``, ``1h30m``, ``1d``).

    A relative time means that long before ``now`` (naive = local time; default: the current
    time), counted in real seconds, across a change of the clocks too; a naive absolute time
    means local time. The result is a naive local time (as the runner's ``log_lines`` takes
    one), with ``fold`` set when it falls in a repeated hour: its ``timestamp()`` is the exact
    instant, so compare results by ``timestamp()``, not by naive comparison or arithmetic.

    Raises:
        CliError: ``text`` is neither (the message names ``option`` and the value).
    """
    value = text.strip()
    compact = value.replace(" ", "")
    try:
        if compact and _RELATIVE_ALL.fullmatch(compact):
            seconds = sum(
                float(n) * _UNIT_SECONDS[unit.lower()] for n, unit in _RELATIVE.findall(compact)
            )
            base = datetime.now(timezone.utc) if now is None else now.astimezone(timezone.utc)
            parsed = local_time(base - timedelta(seconds=seconds))
        else:
            iso = value[:-1] + "+00:00" if value.endswith(("Z", "z")) else value
            try:
                parsed = datetime.fromisoformat(iso)
            except ValueError:
                raise CliError(
                    f"{option} {text!r} is not a time",
                    "give an ISO 8601 time (2024-05-01T12:00:00, with an optional offset) or a "
                    "relative one (30s, 10m, 2h, 1h30m, 1d)",
                ) from None
            if parsed.tzinfo is not None:
                parsed = local_time(parsed)
        parsed.timestamp()  # a time with no POSIX timestamp (year 1, year 9999) fails here
    except (OverflowError, ValueError, OSError) as e:
        raise CliError(
            f"{option} {text!r} is out of range ({e})",
            "give a time well within the years 1 to 9999, or a shorter relative one",
        ) from None
    return parsed


# -- concurrency ---------------------------------------------------------------------------------


async def run_all(coros: Iterable[Coroutine[Any, Any, Any]]) -> None:
    """Runs the coroutines concurrently until all finish; the first error cancels the others.

    Raises:
        Exception: the first error any of them raised (the others are cancelled and awaited).
    """
    import asyncio

    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task in done and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
