"""The ``asynctorchx`` entry point: parse the command line, run one command, map errors to exit codes.

Start-up cost matters (``asynctorchx --help``, ``asynctorchx status`` in scripts): this module and the
command modules import only the standard library's argparse at import time; the runner, backends,
components and asyncio itself are imported by the command that runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from asynctorchx.cli import (
    cmd_builtins,
    cmd_cancel,
    cmd_describe,
    cmd_list,
    cmd_log,
    cmd_run,
    cmd_runopts,
    cmd_status,
    cmd_tracker,
    cmd_wait,
)
from asynctorchx.cli._errors import ExitCode, classify
from asynctorchx.cli._help import HelpFormatter

if TYPE_CHECKING:
    from asynctorchx.cli._interrupt import Interrupts

PROG = "asynctorchx"

AsyncHandler = Callable[[argparse.Namespace, "Interrupts"], Awaitable[int]]
SyncHandler = Callable[[argparse.Namespace], int]

_DESCRIPTION = """\
Launch, follow and cancel distributed PyTorch apps on local processes, Docker, Slurm or Kubernetes.

examples:
  asynctorchx run utils.echo --msg hello          launch a builtin component (local, waits)
  asynctorchx run --log utils.sh --num_replicas 2 -- sh -c 'echo hi; date'
  asynctorchx run -s slurm -cfg partition=debug dist.ddp -j 2x2 --script train.py
  asynctorchx status local_cwd://asynctorchx/echo-a1b2c3
  asynctorchx log -f local_cwd://asynctorchx/echo-a1b2c3/echo/0
  asynctorchx wait HANDLE HANDLE --timeout 600

exit codes: 0 succeeded, 1 failed, 2 usage or spec error, 3 cancelled, 4 unknown or lost app,
124 wait timed out, 130 interrupted.
"""


class CliParser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line with a hint, exit code 2."""

    def error(self, message: str) -> NoReturn:
        """Prints a usage error as one line with a hint (no usage dump) and exits 2."""
        from asynctorchx.cli._output import print_error

        print_error(self.prog, message, f"'{self.prog} --help' shows the usage")
        raise SystemExit(ExitCode.USAGE)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show tracebacks and debug logs",
    )
    parser = CliParser(
        prog=PROG,
        description=_DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=CliParser)
    for module in (
        cmd_run,
        cmd_status,
        cmd_describe,
        cmd_log,
        cmd_wait,
        cmd_cancel,
        cmd_list,
        cmd_runopts,
        cmd_builtins,
        cmd_tracker,
    ):
        module.register(sub, common)
    return parser


def _unrecognized(
    parser: argparse.ArgumentParser, args: argparse.Namespace, extras: list[str]
) -> NoReturn:
    from asynctorchx.cli._output import print_error

    command = getattr(args, "command", None)
    prog = f"{PROG} {command}" if command else PROG
    hint = f"'{prog} --help' shows the usage"
    if command == "run":
        hint = (
            "options of run go before the component; the component's own arguments after its "
            "name (or after -- when [cli:run] names the component)"
        )
    print_error(prog, f"unrecognized arguments: {' '.join(extras)}", hint)
    raise SystemExit(ExitCode.USAGE)


def _version() -> str:
    from asynctorchx.version import __version__

    return __version__


def _setup_logging(debug: bool) -> None:
    import logging
    import warnings

    logging.basicConfig(
        level=logging.DEBUG if debug else logging.WARNING,
        format=f"{PROG}: %(levelname)s: %(name)s: %(message)s"
        if debug
        else f"{PROG}: %(levelname)s: %(message)s",
        stream=sys.stderr,
    )

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        where = f" ({filename}:{lineno})" if debug else ""
        print(f"{PROG}: warning: {message}{where}", file=sys.stderr, flush=True)

    warnings.showwarning = show


async def _run_async(handler: AsyncHandler, args: argparse.Namespace) -> int:
    import asyncio

    from asynctorchx.cli._interrupt import Interrupts

    interrupts = Interrupts()
    interrupts.install()
    try:
        return await handler(args, interrupts)
    except asyncio.CancelledError:
        if interrupts.interrupted:
            return interrupts.exit_code
        raise
    finally:
        interrupts.uninstall()


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line ``argv`` (default: ``sys.argv[1:]``) and returns the exit code."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        _unrecognized(parser, args, extras)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_usage(sys.stderr)
        parser.error("a command is required")
    debug = bool(getattr(args, "debug", False)) or os.environ.get("ASYNCTORCHX_DEBUG") == "1"
    _setup_logging(debug)
    try:
        if getattr(args, "is_async", False):
            import asyncio

            code = asyncio.run(_run_async(handler, args))
        else:
            code = handler(args)
        _flush_stdout()
        return code
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return 141
    except SystemExit:
        raise
    except BaseException as exc:
        if debug:
            import traceback

            traceback.print_exc()
        from asynctorchx.cli._output import print_error

        message, hint, code = classify(exc, getattr(args, "scheduler", "") or "")
        print_error(f"{PROG} {getattr(args, 'command', '')}".strip(), message, hint)
        return code


def _flush_stdout() -> None:
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()


def _silence_stdout() -> None:
    # Python flushes stdout again at exit; point it at /dev/null so a closed pipe stays quiet.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
