"""The ``asynctorchx`` entry point: parse the command line, run one command, map errors to exit codes.

Start-up cost matters (``asynctorchx --help``, ``asynctorchx status`` in scripts): this module and the
command modules import only the standard library's argparse at import time; the runner, backends,
components and asyncio itself are imported by the command that runs. When the command line names a
builtin command, only that command's module is imported and its parser built; the entry points of
plugin commands are read only when the command is not a builtin one, or for ``--plugins``. A command
may answer without the runner (``fast`` handlers: ``status``, ``describe`` and ``list`` of local
apps, see ``_fastpath``); logging is then set up only if something is logged.
"""

from __future__ import annotations

import argparse
import errno
import io
import os
import sys
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from asynctorchx.cli._errors import ExitCode, StdoutError, classify
from asynctorchx.cli._help import HelpFormatter

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

    from asynctorchx.cli._interrupt import Interrupts

PROG = "asynctorchx"

AsyncHandler = Callable[[argparse.Namespace, "Interrupts"], Awaitable[int]]
SyncHandler = Callable[[argparse.Namespace], int]
#: A command's answer without the runner (see ``_fastpath``), or None when the runner must answer.
SyncFastHandler = Callable[[argparse.Namespace], "int | None"]

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

_EPILOG = """Installed packages can add commands (entry-point group asynctorchx.cli.cmds): 'asynctorchx \
--plugins' lists them with the builtin ones.
"""


class CliParser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line with a hint, exit code 2."""

    command_parsers: Mapping[str, argparse.ArgumentParser] = {}
    subcommands: argparse._SubParsersAction[Any] | None = None
    common: argparse.ArgumentParser | None = None

    def error(self, message: str) -> NoReturn:
        """Prints a usage error as one line with a hint (no usage dump) and exits 2."""
        from asynctorchx.cli._output import print_error

        print_error(self.prog, message, f"'{self.prog} --help' shows the usage")
        raise SystemExit(ExitCode.USAGE)


#: The builtin commands, in the order ``--help`` lists them, and the module that registers each.
BUILTIN_COMMANDS: Mapping[str, str] = {
    name: f"asynctorchx.cli.cmd_{name}"
    for name in (
        "run",
        "status",
        "describe",
        "log",
        "wait",
        "cancel",
        "list",
        "runopts",
        "builtins",
        "configure",
        "tracker",
    )
}

# commands whose arguments after the first positional one (the component) are passed on verbatim
_COMPONENT_COMMANDS = ("run",)

_LOG_LEVEL_HELP = (
    "Python logging level: DEBUG, INFO, WARNING (default, or $LOGLEVEL), ERROR or CRITICAL"
)


def build_parser(commands: Sequence[str] | None = None) -> CliParser:
    """The parser of the builtin ``commands`` (default: all of them); ``add_commands`` adds more
    builtin commands, ``add_plugins`` the plugin commands.

    A command line naming a builtin command is parsed alike with that command alone: only the help
    listing every command, and the error for a command that does not exist, need the others.
    """
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show tracebacks and debug logs",
    )
    common.add_argument(
        "--log_level", default=argparse.SUPPRESS, metavar="LEVEL", help=_LOG_LEVEL_HELP
    )
    parser = CliParser(
        prog=PROG,
        description=_DESCRIPTION,
        formatter_class=HelpFormatter,
        epilog=_EPILOG,
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    parser.add_argument("--log_level", default=None, metavar="LEVEL", help=_LOG_LEVEL_HELP)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument(
        "--plugins",
        action=_PluginsHelp,
        help="show this help with the commands installed packages add (entry-point group "
        "asynctorchx.cli.cmds) and exit",
    )
    parser.subcommands = parser.add_subparsers(
        title="commands", metavar="COMMAND", parser_class=CliParser
    )
    parser.common = common
    parser.command_parsers = parser.subcommands.choices
    add_commands(parser, BUILTIN_COMMANDS if commands is None else commands)
    return parser


def add_commands(parser: CliParser, commands: Iterable[str]) -> None:
    """Imports the modules of the builtin ``commands`` and adds their parsers to ``parser``."""
    import importlib

    assert parser.subcommands is not None and parser.common is not None
    for name in commands:
        module = importlib.import_module(BUILTIN_COMMANDS[name])
        module.register(parser.subcommands, parser.common)


class _PluginsHelp(argparse.Action):
    """``--plugins``: the help with the plugin commands listed too (reading them costs tens of ms,
    which plain ``--help`` does not pay)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        assert isinstance(parser, CliParser)
        add_plugins(parser, None)
        parser.print_help()
        parser.exit()


def add_plugins(parser: CliParser, command: str | None) -> None:
    """Adds the plugin commands (entry-point group ``asynctorchx.cli.cmds``) to ``parser``.

    Only ``command`` (the one being run, if it is a plugin's) is loaded; the others are listed.
    """
    from asynctorchx.cli import _plugins

    assert parser.subcommands is not None and parser.common is not None
    found = _plugins.entry_points(set(parser.command_parsers))
    _plugins.register(parser.subcommands, parser.common, found, command)


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


def first_positional(parser: argparse.ArgumentParser, argv: Sequence[str]) -> int:
    """The index in ``argv`` of the first argument that is not an option of ``parser`` or an
    option's value (``len(argv)`` when there is none); a ``--`` counts as positional.

    Long options may be abbreviated as argparse allows; an unknown or ambiguous option is taken
    as a flag (argparse reports it when it parses the part before the index).
    """
    options = parser._option_string_actions
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--" or arg == "-" or not arg.startswith("-"):
            return i
        name, eq, _ = arg.partition("=")
        action = options.get(name)
        if action is None and name.startswith("--") and parser.allow_abbrev:
            matches = {options[o] for o in options if o.startswith(name) and o.startswith("--")}
            action = matches.pop() if len(matches) == 1 else None
        if action is None and not name.startswith("--") and len(arg) > 2 and arg[:2] in options:
            action, eq = options[arg[:2]], "="  # -sVALUE
        takes = 0 if action is None or eq else action.nargs
        if takes is None:
            i += 2
        elif isinstance(takes, int):
            i += 1 + takes
        else:
            i += 1  # optional or variable numbers of values: none of the commands' options
    return len(argv)


def _split_argv(parser: CliParser, argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``argv`` cut where a component's own arguments begin (``None``: no such command).

    ``asynctorchx run -s slurm utils.echo --d x`` gives ``["run", "-s", "slurm"]`` and
    ``["utils.echo", "--d", "x"]``: argparse never sees the component's arguments, so none of them
    is mistaken for (a prefix of) an option of ``run``, whatever its spelling.
    """
    at = first_positional(parser, argv)
    if at == len(argv) or argv[at] not in _COMPONENT_COMMANDS:
        return argv, None
    command = parser.command_parsers[argv[at]]
    cut = at + 1 + first_positional(command, argv[at + 1 :])
    return argv[:cut], argv[cut:]


#: ``logging.WARNING``, the default level (known without importing ``logging``).
WARNING = 30


def parse_log_level(value: str) -> int:
    """A logging level from a name (any case) or a number.

    Raises:
        CliError: not a level.
    """
    from asynctorchx.cli._errors import CliError

    text = value.strip()
    if text.isdigit() and len(text) <= 18:
        return int(text)
    if text.upper() == "WARNING":
        return WARNING
    import logging

    level = logging.getLevelName(text.upper())
    if isinstance(level, int) and text:
        return level
    raise CliError(
        f"--log_level {value!r} is not a logging level",
        "give one of DEBUG, INFO, WARNING, ERROR, CRITICAL (or a number)",
    )


def _logging_setup(debug: bool, level: int) -> Callable[[], None]:
    """A function setting logging up for ``debug`` and ``level`` at its first call only."""
    done = False

    def setup() -> None:
        nonlocal done
        if not done:
            done = True
            _setup_logging(debug, level)

    return setup


def _setup_logging(debug: bool, level: int) -> None:
    import logging

    logging.basicConfig(
        level=logging.DEBUG if debug else level,
        format=f"{PROG}: %(levelname)s: %(name)s: %(message)s"
        if debug
        else f"{PROG}: %(levelname)s: %(message)s",
        stream=sys.stderr,
    )


def _setup_warnings(debug: bool) -> None:
    """Python warnings as one line ``asynctorchx: warning: ...`` (with where with ``debug``)."""
    import warnings

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


class _ClosedStdout:
    """``sys.stdout`` when the process started with descriptor 1 closed (Python sets it to None):
    a write fails like a write to a closed descriptor, so the command reports it as an error."""

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, "standard output is closed")

    def flush(self) -> None:
        pass


class _StdoutFile(io.FileIO):
    """The raw file under ``sys.stdout`` (``_watch_stdout``): a write that fails raises
    ``StdoutError``, so that the command's error says standard output could not be written. A
    closed pipe stays ``BrokenPipeError`` (``_main`` ends quietly on it)."""

    def write(self, data: ReadableBuffer, /) -> int:  # (None too, as FileIO: EAGAIN)
        try:
            return super().write(data)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise StdoutError(e.errno, e.strerror) from e


def _watch_stdout() -> None:
    """Puts ``sys.stdout``, when it is the process's own standard output as Python made it, on a
    ``_StdoutFile`` (the same descriptor, encoding, error handler and buffering): whatever writes
    or flushes it (a command's ``print``, ``_flush_stdout``) raises ``StdoutError`` when the
    descriptor cannot be written, and nothing else does. The raw file is only called when the
    buffer is written out, not at each ``print``. A stream replaced already (a test's capture, an
    embedding program's) is left alone."""
    out = sys.stdout
    if out is not sys.__stdout__ or type(out) is not io.TextIOWrapper:
        return
    buffer = out.buffer  # (the raw file itself when Python's streams are unbuffered: -u)
    raw = buffer.raw if type(buffer) is io.BufferedWriter else buffer
    if type(raw) is not io.FileIO:
        return
    try:
        out.flush()
        new_raw = _StdoutFile(raw.fileno(), "w", closefd=False)
    except (OSError, ValueError):  # (its descriptor unusable: the write will say so)
        return
    new_raw.name = raw.name  # ("<stdout>")
    new_buffer: io.BufferedWriter | _StdoutFile = new_raw
    if buffer is not raw:
        size = getattr(raw, "_blksize", 0)
        new_buffer = io.BufferedWriter(new_raw, size if size > 1 else io.DEFAULT_BUFFER_SIZE)
    stdout = io.TextIOWrapper(
        new_buffer,
        encoding=out.encoding,
        errors=out.errors,
        newline="\n",  # (as Python's own: no translation)
        line_buffering=out.line_buffering,
        write_through=out.write_through,
    )
    stdout.mode = "w"  # type: ignore[misc]  # (as Python's own says)
    sys.stdout = stdout


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line ``argv`` (default: ``sys.argv[1:]``) and returns the exit code."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # Ctrl+C before the command's own handling is in place (parsing the line, setting up
        # logging, starting the event loop): the same exit as later, without a traceback
        return ExitCode.INTERRUPTED


def _main(argv: Sequence[str] | None) -> int:
    if sys.stdout is None:
        sys.stdout = _ClosedStdout()
    from asynctorchx.cli._output import tolerant_output

    tolerant_output()
    _watch_stdout()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(())
    at = first_positional(parser, argv)
    command = argv[at] if at < len(argv) else None
    if command is not None and command in BUILTIN_COMMANDS:
        add_commands(parser, (command,))
    else:
        add_commands(parser, BUILTIN_COMMANDS)
        if command is not None:
            # a plugin command, or a mistake: only then are the entry points read
            add_plugins(parser, command)
    parse_argv, component_args = _split_argv(parser, argv)
    args, extras = parser.parse_known_args(parse_argv)
    if component_args is not None:
        args.component_args = component_args
    if extras:
        _unrecognized(parser, args, extras)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_usage(sys.stderr)
        parser.error("a command is required")
    debug = bool(getattr(args, "debug", False)) or os.environ.get("ASYNCTORCHX_DEBUG") == "1"
    try:
        level_name = args.log_level or os.environ.get("LOGLEVEL") or "WARNING"
        level = parse_log_level(level_name)
    except Exception as exc:
        from asynctorchx.cli._output import print_error

        message, hint, code = classify(exc)
        if not args.log_level:
            message = message.replace("--log_level", "LOGLEVEL", 1)
        print_error(PROG, message, hint)
        return code
    _setup_warnings(debug)
    setup_logging = _logging_setup(debug, level)
    fast: SyncFastHandler | None = getattr(args, "fast", None)
    # a fast answer usually logs nothing at these levels: logging is set up only if it does
    lazy = fast is not None and not debug and level >= WARNING
    if not lazy:
        setup_logging()
    try:
        answer = None
        if fast is not None:
            from asynctorchx.cli._fastpath import deferred_logging

            with deferred_logging(setup_logging if lazy else None):
                answer = fast(args)
        if answer is not None:
            code = answer
        elif getattr(args, "is_async", False):
            import asyncio

            setup_logging()
            code = asyncio.run(_run_async(handler, args))
        else:
            setup_logging()
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
        if isinstance(exc, StdoutError):
            # what is left in its buffer cannot be written either: Python's flush at exit must
            # not fail again (a traceback, exit 120) after the error said it
            _silence_stdout()
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
