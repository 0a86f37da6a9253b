"""``asynctorchx tracker list runs|metadata|artifacts``: what jobs recorded through their tracker.

The tracker read is the first of ``[torchx:tracker]`` in ``.torchxconfig`` (as TorchX's
``torchx tracker``), or the one named by ``--tracker``; it is built as a job would build it, with its
``[tracker:NAME] config``. ``list jobs`` is TorchX's name of ``list runs``.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from asynctorchx.cli._help import HelpFormatter

if TYPE_CHECKING:
    from asynctorchx.cli._interrupt import Interrupts
    from asynctorchx.tracker.reader import AsyncTrackerReader

_EPILOG = """\
The tracker is configured in .torchxconfig, as for the jobs:

  [torchx:tracker]
  fsspec =

  [tracker:fsspec]
  config = /shared/tracker.conf     # protocol=file and root_path=/shared/runs lines

examples:
  asynctorchx tracker list runs --parent-run-id sweep-7
  asynctorchx tracker list metadata local_cwd://asynctorchx/trial-0-x1y2z3 --json
  asynctorchx tracker list artifacts --artifact checkpoint RUN_ID
"""


def register(sub: argparse._SubParsersAction[Any], common: argparse.ArgumentParser) -> None:
    """Adds the ``tracker`` command and its ``list`` subcommands."""
    p = sub.add_parser(
        "tracker",
        parents=[common],
        formatter_class=HelpFormatter,
        help="list the runs, metadata and artifacts that jobs recorded",
        description="Reads what jobs recorded through app_run_from_env() (asynctorchx.tracker).",
        epilog=_EPILOG,
    )
    p.set_defaults(handler=_usage(p), is_async=False, command="tracker")
    tracker_sub = p.add_subparsers(title="tracker commands", metavar="list", parser_class=type(p))
    lst = tracker_sub.add_parser(
        "list",
        parents=[common],
        formatter_class=HelpFormatter,
        help="list runs, metadata or artifacts",
        epilog=_EPILOG,
    )
    lst.set_defaults(handler=_usage(lst), is_async=False, command="tracker list")
    what = lst.add_subparsers(title="what", metavar="runs|metadata|artifacts", parser_class=type(p))

    def add(name: str, help_text: str, aliases: list[str] | None = None) -> argparse.ArgumentParser:
        q = what.add_parser(
            name,
            aliases=aliases or [],
            parents=[common],
            formatter_class=HelpFormatter,
            help=help_text,
            description=help_text,
        )
        q.add_argument(
            "--tracker",
            default=None,
            metavar="NAME",
            help="the tracker of [torchx:tracker] to read (default: the first)",
        )
        q.add_argument("--json", action="store_true", help="print JSON")
        q.set_defaults(handler=execute, is_async=True, command=f"tracker list {name}", what=name)
        parser: argparse.ArgumentParser = q
        return parser

    runs = add("runs", "the run ids the tracker knows", aliases=["jobs"])
    runs.add_argument(
        "--parent-run-id",
        "--parent_run_id",
        dest="parent_run_id",
        default=None,
        metavar="RUN_ID",
        help="only the runs launched with this parent run id",
    )
    md = add("metadata", "the metadata of a run")
    md.add_argument("run_id", metavar="RUN_ID", help="the run (an app handle)")
    art = add("artifacts", "the artifacts of a run")
    art.add_argument("--artifact", default=None, metavar="NAME", help="only this artifact")
    art.add_argument("run_id", metavar="RUN_ID", help="the run (an app handle)")


def _usage(parser: argparse.ArgumentParser) -> Any:
    def handler(args: argparse.Namespace) -> int:
        parser.error("say what to list: 'tracker list runs|metadata|artifacts'")

    return handler


def open_reader(name: str | None) -> AsyncTrackerReader:
    """The reader of tracker ``name`` of ``.torchxconfig`` (the first one when None).

    Raises:
        CliError: no tracker is configured, or none of that name.
    """
    from asynctorchx.cli._errors import CliError
    from asynctorchx.runner.config import configured_trackers
    from asynctorchx.tracker.api import build_tracker
    from asynctorchx.tracker.reader import AsyncTrackerReader

    trackers = configured_trackers()
    if not trackers:
        raise CliError(
            "no tracker is configured",
            "add a [torchx:tracker] section to .torchxconfig ('asynctorchx tracker --help' "
            "shows one)",
        )
    if name is None:
        setting = trackers[0]
    else:
        found = [t for t in trackers if t.name == name]
        if not found:
            raise CliError(
                f"--tracker: no tracker {name!r} in [torchx:tracker]",
                f"configured: {', '.join(t.name for t in trackers)}",
            )
        setting = found[0]
    return AsyncTrackerReader(build_tracker(setting.name, setting.config, setting.factory))


async def execute(args: argparse.Namespace, interrupts: Interrupts) -> int:
    """Prints the runs, metadata or artifacts asked for."""
    import json

    from asynctorchx.cli._errors import CliError
    from asynctorchx.cli._output import format_table, info, json_text, out_styler, shown

    if getattr(args, "parent_run_id", None) == "":
        raise CliError(
            "--parent-run-id: the parent run id is empty",
            "give the id of the parent run, or leave the option out to list every run",
        )
    async with open_reader(args.tracker) as reader:
        if args.what in ("runs", "jobs"):
            filters = {} if args.parent_run_id is None else {"parent_run_id": args.parent_run_id}
            ids = await reader.run_ids(**filters)
            if args.json:
                print(json.dumps(ids, indent=2))
            elif not ids:
                info("no runs" + (f" with parent {args.parent_run_id}" if filters else ""))
            else:
                print(format_table(("RUN ID",), [(shown(i),) for i in ids], out_styler()))
            return 0
        if args.what == "metadata":
            metadata = await reader.metadata(args.run_id)
            if args.json:
                print(json_text(metadata))
            elif not metadata:
                info(f"no metadata for {args.run_id}")
            else:
                rows = [(shown(k), _text(v)) for k, v in metadata.items()]
                print(format_table(("KEY", "VALUE"), rows, out_styler()))
            return 0
        artifacts = list((await reader.artifacts(args.run_id)).values())
        if args.artifact is not None:
            artifacts = [a for a in artifacts if a.name == args.artifact]
        if args.json:
            rows_json = [
                {"name": a.name, "path": a.path, "metadata": a.metadata} for a in artifacts
            ]
            print(json_text(rows_json))
        elif not artifacts:
            info(
                f"no artifact {args.artifact!r} for {args.run_id}"
                if args.artifact is not None
                else f"no artifacts for {args.run_id}"
            )
        else:
            table = [(shown(a.name), shown(a.path), _text(a.metadata)) for a in artifacts]
            print(format_table(("ARTIFACT", "PATH", "METADATA"), table, out_styler()))
        return 0


def _text(value: object) -> str:
    """A value as a table cell: a string as itself, anything else as JSON; control characters
    escaped as ``asynctorchx describe`` does (a job's ESC would recolour the terminal, its line
    break forge a row)."""
    import json

    from asynctorchx.cli._output import shown

    return shown(value if isinstance(value, str) else json.dumps(value))
