"""Launch a mixed set of apps at once, follow all their logs interleaved, exit with the worst state.

    python examples/multi_launch.py            # everything succeeds: exit 0
    python examples/multi_launch.py --fail     # one app fails: exit 1

The apps: two builtin components (``utils.echo``, ``utils.sh``) and one multi-role app in the style of
TorchElastic's classic example — a trainer role, a parameter-server role and a reader role that run
together. Every replica's log lines are printed as they come, prefixed ``app/role/replica``. The exit
code follows the CLI's convention: 0 SUCCEEDED, 1 FAILED, 3 CANCELLED, 4 UNKNOWN (the worst wins).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import anyio

from asynctorchx import AsyncRunner
from asynctorchx.specs import AppDef, AppState, Role

EXIT_CODES = {AppState.SUCCEEDED: 0, AppState.FAILED: 1, AppState.CANCELLED: 3}
SEVERITY = [AppState.SUCCEEDED, AppState.CANCELLED, AppState.FAILED, AppState.UNKNOWN]


def sh(script: str) -> tuple[str, list[str]]:
    return "sh", ["-c", script]


def trainer_ps_reader(fail: bool) -> AppDef:
    """A three-role app: 2 trainers, 1 parameter server, 2 readers (plain shell stand-ins)."""
    ps_entry, ps_args = sh('for i in 1 2 3; do echo "ps serving step $i"; sleep 0.05; done')
    tr_script = 'for i in 1 2 3; do echo "trainer $REPLICA step $i"; sleep 0.05; done'
    if fail:
        tr_script += '; [ "$REPLICA" = 1 ] && { echo "trainer 1 diverged" >&2; exit 7; }; true'
    tr_entry, tr_args = sh(tr_script)
    rd_entry, rd_args = sh('echo "reader $REPLICA read shard $REPLICA"')
    return AppDef(
        name="trainer-ps-reader",
        roles=[
            Role(
                "trainer",
                image=".",
                entrypoint=tr_entry,
                args=tr_args,
                num_replicas=2,
                env={"REPLICA": "${replica_id}"},
            ),
            Role("ps", image=".", entrypoint=ps_entry, args=ps_args),
            Role(
                "reader",
                image=".",
                entrypoint=rd_entry,
                args=rd_args,
                num_replicas=2,
                env={"REPLICA": "${replica_id}"},
            ),
        ],
    )


async def follow_app(runner: AsyncRunner, label: str, handle: str, out: anyio.Lock) -> None:
    """Prints every replica's lines of ``handle`` as they arrive, prefixed ``label/role/replica``."""
    app = await runner.describe(handle)
    assert app is not None

    async def one(role: str, k: int) -> None:
        async for line in runner.log_lines(handle, role, k, should_tail=True):
            async with out:
                sys.stdout.write(
                    f"{label}/{role}/{k}: {line if line.endswith(chr(10)) else line + chr(10)}"
                )
                sys.stdout.flush()

    async with anyio.create_task_group() as tg:
        for role in app.roles:
            for k in range(role.num_replicas):
                tg.start_soon(one, role.name, k)


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fail", action="store_true", help="make one trainer replica fail")
    parser.add_argument("-s", "--scheduler", default="local_cwd")
    args = parser.parse_args(argv)

    async with AsyncRunner(name="multi") as runner:
        launches = {
            "echo": runner.run_component(
                "utils.echo", ["--msg", "hello from echo"], args.scheduler
            ),
            "sh": runner.run_component("utils.sh", ["echo", "hello from sh"], args.scheduler),
            "tpr": runner.run(trainer_ps_reader(args.fail), args.scheduler),
        }
        handles: dict[str, str] = {}

        async def launch(label: str, coro: object) -> None:
            handles[label] = await coro  # type: ignore[misc]

        async with anyio.create_task_group() as tg:
            for label, coro in launches.items():
                tg.start_soon(launch, label, coro)
        for label, handle in handles.items():
            print(f"launched {label}: {handle}", file=sys.stderr)

        out = anyio.Lock()
        async with anyio.create_task_group() as tg:
            for label, handle in handles.items():
                tg.start_soon(follow_app, runner, label, handle, out)
        finals = await runner.wait_all(handles.values())

    worst = AppState.SUCCEEDED
    for label, handle in handles.items():
        status = finals[handle]
        state = status.state if status else AppState.UNKNOWN
        print(f"{label}: {state.name}", file=sys.stderr)
        if SEVERITY.index(state if state in SEVERITY else AppState.UNKNOWN) > SEVERITY.index(worst):
            worst = state
    return EXIT_CODES.get(worst, 4)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
