"""``asynctorchx wait HANDLE... [--timeout S]``: wait for apps, one line per state change."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from asynctorchx.cli._help import HelpFormatter

if TYPE_CHECKING:
    from asynctorchx.cli._interrupt import Interrupts
    from asynctorchx.runner.api import AppEvent


def register(sub: argparse._SubParsersAction[Any], common: argparse.ArgumentParser) -> None:
    """Adds the ``wait`` command."""
    p = sub.add_parser(
        "wait",
        parents=[common],
        formatter_class=HelpFormatter,
        help="wait for apps to end, printing each state change",
        description="Waits until every app has ended, printing one line per state change (and "
        "restart). Exits with the worst final state's code: 4 if an app is unknown or lost, "
        "else 1 if one failed, else 3 if one was cancelled, else 0; 124 on --timeout. The apps "
        "keep running when the wait is interrupted or times out.",
    )
    p.add_argument("handles", nargs="+", metavar="HANDLE", help="app handles")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="give up after this many seconds (exit 124)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per change: handle, state, previous_state, num_restarts, time",
    )
    p.set_defaults(handler=execute, is_async=True, command="wait")


class _Expired(Exception):
    """Raised when ``--timeout`` expired with apps still running."""


def _format_event(event: AppEvent, width: int, as_json: bool) -> str:
    import json
    import time

    from asynctorchx.cli._output import out_styler

    if as_json:
        return json.dumps(
            {
                "handle": event.handle,
                "state": event.state.name,
                "previous_state": None
                if event.previous_state is None
                else event.previous_state.name,
                "num_restarts": event.num_restarts,
                "time": event.timestamp,
            }
        )
    clock = time.strftime("%H:%M:%S", time.localtime(event.timestamp))
    style = out_styler()
    restarts = f" (restarts: {event.num_restarts})" if event.num_restarts else ""
    return f"{clock} {event.handle:<{width}} {style.state(event.state.name)}{restarts}"


async def execute(args: argparse.Namespace, interrupts: Interrupts) -> int:
    """Waits for ``args.handles`` and returns the worst final state's exit code."""
    import asyncio
    from contextlib import AsyncExitStack

    from asynctorchx.cli._common import run_all, runner_for_handle, split_handle
    from asynctorchx.cli._errors import CliError, ExitCode, exit_code_for_state, worst_exit_code
    from asynctorchx.cli._output import info
    from asynctorchx.runner.api import AsyncRunner
    from asynctorchx.specs.api import AppState

    if args.timeout is not None and not args.timeout >= 0:  # also rejects nan
        raise CliError(f"--timeout {args.timeout:g} is not >= 0", "give a number of seconds >= 0")
    groups: dict[str, tuple[AsyncRunner, list[str]]] = {}
    handles: list[str] = []
    for raw in dict.fromkeys(args.handles):
        session = split_handle(raw)[1]
        runner, handle = runner_for_handle(raw)
        if session not in groups:
            groups[session] = (runner, [])
        if handle not in handles:
            groups[session][1].append(handle)
            handles.append(handle)
    args.scheduler = handles[0].split("://", 1)[0]
    width = max(len(h) for h in handles)
    final: dict[str, AppState] = {}
    queue: asyncio.Queue[AppEvent] = asyncio.Queue()

    async def pump(runner: AsyncRunner, group: list[str]) -> None:
        async for event in runner.watch(group):
            queue.put_nowait(event)

    def show(event: AppEvent) -> None:
        print(_format_event(event, width, args.json), flush=True)
        if event.is_terminal:
            final[event.handle] = event.state

    async def report() -> None:
        while len(final) < len(handles):
            show(await queue.get())

    ended: set[str] = set()

    async def deadline(runner: AsyncRunner, group: list[str]) -> None:
        # the runner asks the scheduler once more when the deadline passes, so an app that ended
        # long ago is reported ended even with --timeout 0
        try:
            async for handle, _ in runner.as_completed(group, timeout=args.timeout):
                ended.add(handle)
        except TimeoutError:
            raise _Expired from None

    async with AsyncExitStack() as stack:
        for runner, _ in groups.values():
            await stack.enter_async_context(runner)
        jobs = [*(pump(r, g) for r, g in groups.values()), report()]
        if args.timeout is not None:
            jobs += [deadline(r, g) for r, g in groups.values()]
        try:
            await run_all(jobs)
        except _Expired:
            while not queue.empty():
                show(queue.get_nowait())
            running = [h for h in handles if h not in ended]
            info(
                f"asynctorchx wait: timed out after {args.timeout:g}s; still running: "
                + ", ".join(running)
            )
            return ExitCode.TIMEOUT
    return worst_exit_code([exit_code_for_state(final.get(h)) for h in handles])
