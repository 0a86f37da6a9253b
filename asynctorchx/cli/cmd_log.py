"""``asynctorchx log HANDLE[/ROLE[/REPLICA,...]]``: print or follow the logs of an app's replicas."""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING, Any, NamedTuple

from asynctorchx.cli._help import HelpFormatter

if TYPE_CHECKING:
    from asynctorchx.cli._interrupt import Interrupts
    from asynctorchx.cli._logs import Replica
    from asynctorchx.runner.api import AsyncRunner


def register(sub: argparse._SubParsersAction[Any], common: argparse.ArgumentParser) -> None:
    """Adds the ``log`` command."""
    p = sub.add_parser(
        "log",
        parents=[common],
        help="print or follow the logs of an app",
        description="Prints the log lines of every replica of an app (or of one role, or of some "
        "replicas), each prefixed 'role/replica'. A '!' after the prefix marks a stderr line, '|' "
        "any other. Fails at once when the app or the role is unknown.",
        epilog="examples:\n"
        "  asynctorchx log local_cwd://asynctorchx/ddp-x1y2          every replica\n"
        "  asynctorchx log -f local_cwd://asynctorchx/ddp-x1y2/trainer/0,1\n"
        "  asynctorchx log --since 10m --regex 'loss=' HANDLE/trainer\n"
        "  asynctorchx log --json HANDLE | jq -r .line",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "identifier",
        metavar="HANDLE[/ROLE[/REPLICA,...]]",
        help="the app handle, optionally followed by a role and replica ids (0,2 or 0-3)",
    )
    p.add_argument(
        "-f",
        "--follow",
        "-t",
        "--tail",
        dest="follow",
        action="store_true",
        help="keep printing new lines until the app ends (-t/--tail: TorchX's spelling)",
    )
    p.add_argument("--regex", default=None, help="only lines matching this regular expression")
    p.add_argument(
        "--since",
        default=None,
        metavar="TIME",
        help="only lines written at or after TIME: ISO 8601 (2024-05-01T12:00:00) or relative "
        "(30s, 10m, 2h, 1d)",
    )
    p.add_argument(
        "--until", default=None, metavar="TIME", help="only lines written at or before TIME"
    )
    p.add_argument(
        "--streams",
        choices=("stdout", "stderr", "combined"),
        default=None,
        help="which output to read (default: the scheduler's default, usually combined)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per line: handle, role, replica, stream, line",
    )
    p.set_defaults(handler=execute, is_async=True, command="log")


class ReplicaRange(NamedTuple):
    """Replica ids ``first`` to ``last`` (inclusive), as written in a log target."""

    first: int
    last: int

    def __str__(self) -> str:
        return str(self.first) if self.first == self.last else f"{self.first}-{self.last}"


class LogTarget(NamedTuple):
    """What ``HANDLE[/ROLE[/REPLICA,...]]`` names; ``replicas`` keeps the ids and ranges as given."""

    handle: str
    role: str | None
    replicas: list[ReplicaRange] | None


_TARGET = re.compile(
    r"(?P<handle>[^:/\s]+://[^/\s]*/[^/\s]+)"
    r"(?:/(?P<role>[^/\s]+)(?:/(?P<replicas>[^/\s]*))?)?/?"
)
_REPLICA = re.compile(r"\s*([0-9]+)\s*(?:-\s*([0-9]+)\s*)?")
#: Longer ids exceed any replica count (and Python's int parsing limit is 4300 digits).
_MAX_ID_DIGITS = 18

#: How much of a user's text an error message quotes: errors stay one short line.
_QUOTE_LIMIT = 60


def _quote(text: str) -> str:
    """``repr(text)``, cut to a readable length (the rest is counted, not printed)."""
    if len(text) <= _QUOTE_LIMIT:
        return repr(text)
    return f"{text[:_QUOTE_LIMIT]!r}... ({len(text)} characters)"


def parse_target(identifier: str) -> LogTarget:
    """Splits ``HANDLE[/ROLE[/REPLICA,...]]``; replicas are ids or ranges: ``0,2,4-6``.

    Linear in the length of ``identifier``: ranges stay ranges until ``select`` bounds them by the
    role's real replica count.

    Raises:
        CliError: the identifier does not have that form, or a range is empty (``5-2``).
    """
    from asynctorchx.cli._errors import CliError

    m = _TARGET.fullmatch(identifier.strip())
    if m is None:
        raise CliError(
            f"{_quote(identifier)} is not HANDLE[/ROLE[/REPLICA,...]]",
            "a handle looks like local_cwd://SESSION/APP_ID, as printed by 'asynctorchx run'",
        )
    replicas: list[ReplicaRange] | None = None
    spec = m["replicas"]
    if spec:
        replicas = []
        parts = spec.split(",")
        if len(parts) > 1 and not parts[-1]:
            parts.pop()  # one trailing comma, as TorchX's ``0,1,`` (its form is ``(\d+,?)+``)
        for part in parts:
            r = _REPLICA.fullmatch(part)
            if r is None:
                raise CliError(
                    f"replica {_quote(part)} in {_quote(identifier)} is not an id or a range",
                    "give replica ids as 0,2 or 0-3",
                )
            if max(len(r[1]), len(r[2] or "")) > _MAX_ID_DIGITS:
                raise CliError(
                    f"replica {_quote(part)} in {_quote(identifier)} is beyond any replica count",
                    "give replica ids as 0,2 or 0-3",
                )
            first = int(r[1])
            last = first if r[2] is None else int(r[2])
            if last < first:
                raise CliError(
                    f"replica range {_quote(part)} in {_quote(identifier)} is empty",
                    "give a range as FIRST-LAST with FIRST <= LAST, e.g. 0-3",
                )
            replicas.append(ReplicaRange(first, last))
    return LogTarget(m["handle"], m["role"], replicas)


async def app_roles(runner: AsyncRunner, handle: str) -> list[tuple[str, int]]:
    """``[(role, num_replicas)]`` of the app, from its definition or else its status.

    Raises:
        CliError: the scheduler does not know the app (exit code 4).
    """
    from asynctorchx.cli._common import unknown_app

    status = await runner.status(handle)
    if status is None:
        raise unknown_app(handle)
    app = await runner.describe(handle)
    if app is not None and app.roles:
        return [(r.name, r.num_replicas) for r in app.roles]
    return [(r.role, max((x.id for x in r.replicas), default=-1) + 1) for r in status.roles]


def replica_ids(ranges: list[ReplicaRange], count: int) -> list[int]:
    """The ids of ``ranges`` in the order given, each once; every id must be below ``count``.

    Near-linear in ``count`` plus the number of ranges, however much the ranges overlap: a
    "next id not yet taken" table (with path halving) skips what earlier ranges took.
    """
    following = list(range(count + 1))  # following[i]: the smallest id >= i not yet taken

    def find(i: int) -> int:
        while following[i] != i:
            following[i] = following[following[i]]
            i = following[i]
        return i

    ids: list[int] = []
    for r in ranges:
        i = find(r.first)
        while i <= r.last:
            ids.append(i)
            following[i] = i + 1
            i = find(i + 1)
    return ids


def _describe_ranges(ranges: list[ReplicaRange], limit: int = 3) -> str:
    shown = ", ".join(str(r) for r in ranges[:limit])
    return shown if len(ranges) <= limit else f"{shown} and {len(ranges) - limit} more"


def select(
    target: LogTarget, replicas: list[Replica], roles: list[tuple[str, int]]
) -> list[Replica]:
    """The replicas ``target`` names among the app's ``replicas``.

    Raises:
        CliError: an unknown role or a replica id out of range (exit code 2).
    """
    from asynctorchx.cli._errors import CliError

    if target.role is None:
        return replicas
    counts = dict(roles)
    if target.role not in counts:
        raise CliError(
            f"app {target.handle!r} has no role {_quote(target.role)} "
            f"(roles: {', '.join(counts) or 'none'})",
            f"'asynctorchx describe {target.handle}' shows the roles",
        )
    of_role = [r for r in replicas if r.role == target.role]
    if target.replicas is None:
        return of_role
    n = counts[target.role]
    bad = [ReplicaRange(max(r.first, n), r.last) for r in target.replicas if not 0 <= r.last < n]
    if bad:
        ids = "none" if n == 0 else "0" if n == 1 else f"0-{n - 1}"
        raise CliError(
            f"role {target.role!r} of app {target.handle!r} has no replica "
            f"{_describe_ranges(bad)} (its replicas: {ids})",
            f"'asynctorchx status {target.handle}' shows the replicas",
        )
    by_index = {r.index: r for r in of_role}
    return [by_index[k] for k in replica_ids(target.replicas, n)]


def _check_regex(regex: str | None) -> None:
    """Refuses a ``--regex`` that does not compile, or that the log reader would refuse
    (``check_log_filter``: one too large to match with a time limit), before anything is read.

    Raises:
        CliError: naming ``--regex`` and the pattern (exit code 2).
    """
    from asynctorchx.cli._errors import CliError
    from asynctorchx.logs._match import check_log_filter
    from asynctorchx.schedulers.api import compile_log_regex

    try:
        pattern = compile_log_regex(regex)
        if pattern is not None:
            check_log_filter(pattern)
    except ValueError as e:
        raise CliError(f"--regex: {e}", "--regex takes a Python regular expression") from None


async def execute(args: argparse.Namespace, interrupts: Interrupts) -> int:
    """Prints (or follows) the selected replicas' logs on stdout."""
    import sys

    from asynctorchx.cli._common import parse_time, runner_for_handle
    from asynctorchx.cli._errors import CliError
    from asynctorchx.cli._logs import LogPrinter, LogQuery, app_replicas, print_logs
    from asynctorchx.schedulers.api import Stream

    target = parse_target(args.identifier)
    since = parse_time(args.since, "--since") if args.since is not None else None
    until = parse_time(args.until, "--until") if args.until is not None else None
    # by instant: naive comparison ignores ``fold`` (the repeated hour when the clocks go back)
    if since is not None and until is not None and since.timestamp() > until.timestamp():
        raise CliError(
            f"--since {args.since!r} is after --until {args.until!r}",
            "give --since an earlier time than --until",
        )
    _check_regex(args.regex)
    runner, handle = runner_for_handle(target.handle)
    target = target._replace(handle=handle)
    args.scheduler = handle.split("://", 1)[0]
    async with runner:
        roles = await app_roles(runner, handle)
        chosen = select(target, app_replicas(roles), roles)
        printer = LogPrinter(handle, chosen, sys.stdout, as_json=args.json, flush=args.follow)
        query = LogQuery(
            regex=args.regex,
            since=since,
            until=until,
            follow=args.follow,
            stream=Stream(args.streams) if args.streams else None,
        )
        await print_logs(runner, handle, chosen, printer, query)
        status = await runner.status(handle)
    if status is not None:
        warn_lost_output(handle, status.msg)
    return 0


#: What a local app's status message says once some of its log output could not be written (a
#: full disk): ``log output lost (REASON): ROLE/K N bytes of FILE; ...``.
LOST_NOTE = "log output lost"


def warn_lost_output(handle: str, msg: str) -> None:
    """Says on stderr that the app lost log output, when its status message says so: the marker
    line each affected log gets may be missing too (no room even for it), and the lines printed
    would then pass for the whole log. Stdout keeps only log lines."""
    from asynctorchx.cli._output import info

    start = msg.find(LOST_NOTE)
    if start >= 0:
        info(f"asynctorchx: warning: {handle}: {msg[start:]} (missing from the log above)")
