"""``asynctorchx run [options] COMPONENT [ARGS...]``: launch a component, optionally wait and follow.

stdout gets the app handle alone (so ``h=$(asynctorchx run ...)`` works); everything else — progress,
the final status, and with ``--log`` the replicas' log lines — goes to stderr. ``--dryrun`` prints
TorchX's two sections on stdout instead: ``=== APPLICATION ===`` and ``=== SCHEDULER REQUEST ===``.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TextIO

from asynctorchx.cli._help import HelpFormatter

if TYPE_CHECKING:
    from asynctorchx.cli._interrupt import Interrupts
    from asynctorchx.runner.api import AsyncRunner
    from asynctorchx.specs.api import AppDryRunInfo, AppStatus, CfgVal

_EPILOG = """\
Local apps (local_cwd, local_dir) are child processes of this command: it stays until the app ends
(even without --wait), and Ctrl+C cancels the app. Apps of other schedulers outlive the command:
without --wait it returns once the app is submitted, and Ctrl+C while waiting detaches (the app keeps
running). A second Ctrl+C exits at once (130).

examples:
  asynctorchx run utils.echo --msg hello
  asynctorchx run --log utils.sh --num_replicas 2 -- sh -c 'echo hi; date'
  asynctorchx run -s local_docker --wait dist.ddp -j 1x2 --script train.py
  asynctorchx run --dryrun -s slurm -cfg partition=debug,time=10 utils.echo
  asynctorchx run -s local_docker --workspace . dist.ddp -j 1x2 --script train.py
  asynctorchx run utils.echo --help            the component's arguments
"""


def register(sub: argparse._SubParsersAction[Any], common: argparse.ArgumentParser) -> None:
    """Adds the ``run`` command."""
    p = sub.add_parser(
        "run",
        parents=[common],
        help="launch a component as an app",
        description="Builds the app of a component (a builtin like utils.echo, a plugin, or "
        "path/to/file.py:function) from its arguments and launches it. Prints the app handle "
        "on stdout. Exit code with --wait/--log (and for local apps): the app's final state.",
        epilog=_EPILOG,
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "-s",
        "--scheduler",
        default=None,
        help="where to run (default: [cli:run] scheduler in .torchxconfig, else local_cwd); "
        "'asynctorchx runopts' lists them",
    )
    p.add_argument(
        "-cfg",
        "--scheduler_args",
        action="append",
        default=None,
        metavar="K=V,...",
        help="scheduler run options, e.g. partition=debug,time=10 (see 'asynctorchx runopts "
        "SCHEDULER'); they override the [SCHEDULER] section of .torchxconfig; may be repeated "
        "(a key takes its last value)",
    )
    p.add_argument(
        "--dryrun",
        action="store_true",
        help="print what would be submitted (for local apps: commands, env, log paths) and "
        "launch nothing",
    )
    p.add_argument("--wait", action="store_true", help="wait for the app to end")
    p.add_argument(
        "--log",
        action="store_true",
        help="follow every replica's log lines (prefixed role/replica) until the app ends; "
        "implies --wait",
    )
    p.add_argument(
        "--workspace",
        default=None,
        metavar="DIR",
        help="local code to ship with the app (a directory, or DIR:SUBDIR,DIR2:SUBDIR2): built "
        "into the first role's image (local_docker, kubernetes with -cfg image_repo=...), copied "
        "into the job directory (slurm, with -cfg job_dir=...), snapshot (local_dir), or run in "
        "(local_cwd); default: [cli:run] workspace in .torchxconfig; '' for none. With --dryrun, "
        "the plan is shown and nothing is built",
    )
    p.add_argument(
        "--quiet",
        action="store_true",
        help="do not show the workspace's build, push or copy progress on stderr",
    )
    p.add_argument(
        "--parent_run_id",
        "--parent-run-id",
        default=None,
        metavar="RUN_ID",
        help="the run this app belongs to, for experiment tracking: every role gets "
        "TORCHX_PARENT_RUN_ID (default: $TORCHX_PARENT_RUN_ID); 'asynctorchx tracker list runs "
        "--parent-run-id RUN_ID' lists its children",
    )
    p.add_argument(
        "component_args",
        nargs=argparse.REMAINDER,
        metavar="COMPONENT [ARGS...]",
        help="the component and its arguments (default: [cli:run] component in .torchxconfig); "
        "everything after the component's name is its own, whatever its spelling",
    )
    p.set_defaults(handler=execute, is_async=True, command="run")


def parse_cfg(
    runner: AsyncRunner, scheduler: str, cfg_strs: str | list[str] | None
) -> dict[str, CfgVal]:
    """The typed cfg of ``-cfg`` (each given), with ``.torchxconfig``'s ``[SCHEDULER]`` values as
    defaults.

    Raises:
        CliError: a key is not a run option of the scheduler.
        InvalidRunConfigException: a string is not ``key=value`` pairs, or a value does not have
            its option's type (names the string).
    """
    from asynctorchx.cli._config import apply_scheduler_defaults
    from asynctorchx.cli._errors import CliError

    literals = [cfg_strs] if isinstance(cfg_strs, str) else list(cfg_strs or [])
    opts = runner.scheduler_run_opts(scheduler)
    unknown = [k for literal in literals for k in opts.unknown_keys(literal)]
    if unknown:
        known = ", ".join(k for k, _ in opts) or "none"
        raise CliError(
            f"-cfg: {', '.join(map(repr, dict.fromkeys(unknown)))} is not a run option of "
            f"{scheduler} (its options: {known})",
            f"'asynctorchx runopts {scheduler}' describes them",
        )
    cfg = runner.cfg_from_str(scheduler, *literals)
    return apply_scheduler_defaults(scheduler, cfg, opts)


def _split_component(args: argparse.Namespace) -> tuple[str, list[str]]:
    from asynctorchx.cli._config import run_defaults
    from asynctorchx.cli._errors import CliError

    rest = list(args.component_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if rest and not rest[0].startswith("-"):
        return rest[0], rest[1:]
    component = run_defaults().get("component")
    if not component:
        raise CliError(
            "no component given",
            "name one (asynctorchx run utils.echo --msg hi; 'asynctorchx builtins' lists them) "
            "or set 'component' in the [cli:run] section of .torchxconfig",
        )
    return component, rest


async def execute(args: argparse.Namespace, interrupts: Interrupts) -> int:
    """Launches the component; waits and follows as asked."""
    import sys

    from asynctorchx.cli._common import apps_outlive_cli, runner_for_session
    from asynctorchx.cli._config import default_scheduler, run_defaults
    from asynctorchx.cli._errors import exit_code_for_state
    from asynctorchx.cli._interrupt import Interrupted
    from asynctorchx.cli._output import BOLD, err_styler, info

    args.scheduler = args.scheduler or default_scheduler()
    scheduler: str = args.scheduler
    component, component_args = _split_component(args)
    workspace = args.workspace if args.workspace is not None else run_defaults().get("workspace")
    style = err_styler()
    async with runner_for_session(None) as runner:
        cfg = parse_cfg(runner, scheduler, args.scheduler_args)
        try:
            with _component_prints_on_stderr():
                dryrun = await _dryrun(
                    runner,
                    component,
                    component_args,
                    scheduler,
                    cfg,
                    workspace,
                    args.parent_run_id,
                    interrupts,
                )
        except SystemExit as e:  # the component's --help
            return e.code if isinstance(e.code, int) else 0
        if args.dryrun:
            info(f"dry run of {component} on {scheduler}: nothing is launched or built")
            print(format_dryrun(dryrun))
            return 0
        handle = await _schedule(runner, dryrun, quiet=args.quiet)
        print(handle, flush=True)
        outlives = apps_outlive_cli(scheduler)
        if outlives and not (args.wait or args.log):
            info(f"launched {style(handle, BOLD)}")
            info(f"  follow it: asynctorchx log -f {handle}")
            info(f"  cancel it: asynctorchx cancel {handle}")
            return 0
        if outlives:
            info(f"launched {style(handle, BOLD)} (Ctrl+C detaches; the app keeps running)")
        else:
            info(
                f"launched {style(handle, BOLD)} (this command stays until it ends; Ctrl+C cancels it)"
            )
        roles = [] if dryrun.app is None else [(r.name, r.num_replicas) for r in dryrun.app.roles]
        try:
            status = await interrupts.race(_follow(runner, handle, roles, log=args.log))
        except Interrupted:
            if outlives:
                info(f"\ndetached from {handle}; it keeps running")
                info(f"  follow it: asynctorchx log -f {handle}")
                info(f"  status:    asynctorchx status {handle}")
                info(f"  cancel it: asynctorchx cancel {handle}")
                return interrupts.exit_code
            info(f"\ncancelling {handle} (Ctrl+C again to exit at once)")
            await runner.cancel(handle)
            try:
                final = await runner.wait(handle, timeout=60)
            except TimeoutError:
                final = None
            state = final.state.name if final is not None else "UNKNOWN"
            info(f"{handle} {style.state(state)}")
            return interrupts.exit_code
    _report(handle, status)
    sys.stderr.flush()
    return exit_code_for_state(None if status is None else status.state)


def format_dryrun(dryrun: AppDryRunInfo[Any]) -> str:
    """What ``run --dryrun`` prints: TorchX's two sections, the AppDef the component built
    (``pformat`` of it as a dict, as TorchX prints it) under ``=== APPLICATION ===``, then what
    the scheduler would be given (for local apps: each replica's command, env, log paths) under
    ``=== SCHEDULER REQUEST ===``, so that a reader (or a script) used to TorchX finds both."""
    import dataclasses
    from pprint import pformat

    app = dataclasses.asdict(dryrun.app) if dryrun.app is not None else None
    return (
        f"\n=== APPLICATION ===\n{pformat(app, indent=2, width=80)}\n"
        f"\n=== SCHEDULER REQUEST ===\n{dryrun}"
    )


@contextlib.contextmanager
def _component_prints_on_stderr() -> Iterator[None]:
    """What the component's file writes to stdout while it is loaded and called goes to stderr,
    so that stdout holds the handle alone (``h=$(asynctorchx run file.py:fn)``); its ``--help``
    (which ends the command with ``SystemExit``) stays on stdout. Kept until then, written in
    one piece.

    Descriptor 1 itself points to a spool file meanwhile, and ``sys.stdout`` is a real file on it:
    a file that writes to ``sys.stdout.buffer`` or hands ``sys.stdout`` (or descriptor 1) to a
    child process works as under TorchX, and what its children print is kept too.
    """
    import os
    import sys
    import tempfile

    with contextlib.suppress(OSError, ValueError, AttributeError):
        sys.stdout.flush()
    to = sys.stderr
    with tempfile.TemporaryFile() as spool:
        try:
            saved: int | None = os.dup(1)
        except OSError:  # descriptor 1 was closed: it is again afterwards
            saved = None
        os.dup2(spool.fileno(), 1)
        encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
        stream = open(1, "w", encoding=encoding, errors="backslashreplace", closefd=False)  # noqa: SIM115
        try:
            with contextlib.redirect_stdout(stream):
                yield
        except SystemExit:
            to = sys.stdout
            raise
        finally:
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
            if saved is None:
                if spool.fileno() != 1:  # (the spool itself may have got descriptor 1)
                    os.close(1)
            else:
                os.dup2(saved, 1)
                os.close(saved)
            spool.seek(0)
            _write_bytes(to, spool.read())


def _write_bytes(to: TextIO, data: bytes) -> None:
    """Writes ``data`` to the text stream ``to`` (through its binary buffer when it has one)."""
    if not data:
        return
    to.flush()
    buffer = getattr(to, "buffer", None)
    if buffer is not None:
        buffer.write(data)
        buffer.flush()
    else:
        to.write(data.decode(getattr(to, "encoding", None) or "utf-8", "replace"))
        to.flush()


async def _dryrun(
    runner: AsyncRunner,
    component: str,
    component_args: list[str],
    scheduler: str,
    cfg: dict[str, CfgVal],
    workspace: str | None,
    parent_run_id: str | None,
    interrupts: Interrupts,
) -> AppDryRunInfo[Any]:
    """The dry run; with a workspace, made in a worker thread (it reads and hashes the files).

    Without one it runs on the loop's thread, where a signal interrupts the component's code (a
    file that loops or hangs at import) rather than waiting for it to return.
    """
    if not workspace:
        with interrupts.while_blocking():
            return runner.dryrun_component(
                component, component_args, scheduler, cfg, parent_run_id=parent_run_id
            )
    import functools

    from asynctorchx.schedulers.workspace import run_in_thread

    return await run_in_thread(
        functools.partial(
            runner.dryrun_component,
            component,
            component_args,
            scheduler,
            cfg,
            workspace,
            parent_run_id=parent_run_id,
        )
    )


async def _schedule(runner: AsyncRunner, dryrun: AppDryRunInfo[Any], *, quiet: bool) -> str:
    """Submits the dry run, showing the workspace's progress (and a failed build's last lines)."""
    if dryrun.workspace is None:
        return await runner.schedule(dryrun)
    from asynctorchx.cli._workspace import ProgressPrinter, print_log_tail
    from asynctorchx.schedulers.workspace import WorkspaceBuildError

    printer = ProgressPrinter.for_stderr(quiet)
    try:
        return await runner.schedule(dryrun, progress=printer)
    except WorkspaceBuildError as e:
        printer.close()
        print_log_tail(e.log_tail)
        raise
    finally:
        printer.close()


async def _follow(
    runner: AsyncRunner, handle: str, roles: list[tuple[str, int]], *, log: bool
) -> AppStatus | None:
    """Waits for the app to end (following its logs when ``log``) and returns its final status."""
    if log:
        import sys

        from asynctorchx.cli._errors import one_line
        from asynctorchx.cli._logs import LogPrinter, LogQuery, app_replicas, print_logs
        from asynctorchx.cli._output import info

        replicas = app_replicas(roles)
        printer = LogPrinter(handle, replicas, sys.stderr, flush=True)
        try:
            await print_logs(
                runner, handle, replicas, printer, LogQuery(follow=True), separate_streams=True
            )
        except Exception as e:
            info(f"asynctorchx: warning: cannot follow the logs: {one_line(str(e))}")
    return await runner.wait(handle)


def _report(handle: str, status: AppStatus | None) -> None:
    from asynctorchx.cli._output import err_styler, info

    style = err_styler()
    if status is None:
        info(f"{handle} {style.state('UNKNOWN')}: the scheduler lost track of the app")
        return
    if status.state.name == "SUCCEEDED":
        info(f"{handle} {style.state('SUCCEEDED')}")
        return
    info(f"{handle} {style.state(status.state.name)}")
    info(status.format())
