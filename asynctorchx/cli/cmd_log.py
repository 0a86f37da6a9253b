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


class LogTarget(NamedTuple):
    """What ``HANDLE[/ROLE[/REPLICA,...]]`` names."""

    handle: str
    role: str | None
    replicas: list[int] | None


_TARGET = re.compile(
    r"(?P<handle>[^:/\s]+://[^/\s]*/[^/\s]+)"
    r"(?:/(?P<role>[^/\s]+)(?:/(?P<replicas>[^/\s]*))?)?/?"
)


def parse_target(identifier: str) -> LogTarget:
    """Splits ``HANDLE[/ROLE[/REPLICA,...]]``; replicas are ids or ranges: ``0,2,4-6``.

    Raises:
        CliError: the identifier does not have that form.
    """
    from asynctorchx.cli._errors import CliError

    m = _TARGET.fullmatch(identifier.strip())
    if m is None:
        raise CliError(
            f"{identifier!r} is not HANDLE[/ROLE[/REPLICA,...]]",
            "a handle looks like local_cwd://SESSION/APP_ID, as printed by 'asynctorchx run'",
        )
    replicas: list[int] | None = None
    spec = m["replicas"]
    if spec:
        replicas = []
        for part in spec.split(","):
            lo, dash, hi = part.strip().partition("-")
            if not lo.isdigit() or (dash and not hi.isdigit()):
                raise CliError(
                    f"replica {part!r} in {identifier!r} is not an id or a range",
                    "give replica ids as 0,2 or 0-3",
                )
            ids = range(int(lo), int(hi) + 1) if dash else [int(lo)]
            replicas.extend(i for i in ids if i not in replicas)
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
            f"app {target.handle!r} has no role {target.role!r} "
            f"(roles: {', '.join(counts) or 'none'})",
            f"'asynctorchx describe {target.handle}' shows the roles",
        )
    of_role = [r for r in replicas if r.role == target.role]
    if target.replicas is None:
        return of_role
    n = counts[target.role]
    bad = [k for k in target.replicas if not 0 <= k < n]
    if bad:
        ids = "0" if n == 1 else f"0-{n - 1}"
        raise CliError(
            f"role {target.role!r} of app {target.handle!r} has no replica "
            f"{', '.join(map(str, bad))} (its replicas: {ids})",
            f"'asynctorchx status {target.handle}' shows the replicas",
        )
    by_index = {r.index: r for r in of_role}
    return [by_index[k] for k in target.replicas]


async def execute(args: argparse.Namespace, interrupts: Interrupts) -> int:
    """Prints (or follows) the selected replicas' logs on stdout."""
    import sys

    from asynctorchx.cli._common import parse_time, runner_for_handle
    from asynctorchx.cli._errors import CliError
    from asynctorchx.cli._logs import LogPrinter, LogQuery, app_replicas, print_logs
    from asynctorchx.schedulers.api import Stream, compile_log_regex

    target = parse_target(args.identifier)
    since = parse_time(args.since, "--since") if args.since else None
    until = parse_time(args.until, "--until") if args.until else None
    if since is not None and until is not None and since > until:
        raise CliError(
            f"--since {args.since!r} is after --until {args.until!r}",
            "give --since an earlier time than --until",
        )
    try:
        compile_log_regex(args.regex)
    except ValueError as e:
        raise CliError(str(e), "--regex takes a Python regular expression") from None
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
    return 0
