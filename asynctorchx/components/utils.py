"""Ready-to-use components that run well-known programs (``echo``, ``sh``, ``python``...).

They are handy for trying a scheduler out and as glue steps between the stages of a workflow::

    asynctorchx run utils.echo --msg "hello"
    asynctorchx run utils.sh -- ls -l /tmp
    asynctorchx run utils.python --script train.py -- --lr 0.1
"""

from __future__ import annotations

import os
import shlex

from asynctorchx.apps import source
from asynctorchx.components import IMAGE
from asynctorchx.specs import AppDef, Resource, Role, parse_mounts, resource

_COPY_PROGRAM = r"""
import os, shutil, sys
src, dst = sys.argv[1], sys.argv[2]
def local(p):  # a local path, ~ expanded as fsspec does; None for a remote URL
    p = p[len("file://"):] if p.startswith("file://") else (None if "://" in p else p)
    return None if p is None else os.path.expanduser(p)
try:
    import fsspec
except ImportError:
    fsspec = None
if local(dst) is not None and os.path.dirname(local(dst)):
    os.makedirs(os.path.dirname(local(dst)), exist_ok=True)
if local(src) is not None and local(dst) is not None:
    shutil.copyfile(local(src), local(dst))
elif fsspec is None:
    sys.exit(f"copy: {src!r} -> {dst!r} needs fsspec for remote URLs (pip install fsspec)")
else:
    with fsspec.open(src, "rb") as r, fsspec.open(dst, "wb") as w:
        shutil.copyfileobj(r, w, 1 << 20)
print(f"copied {src} to {dst}")
""".strip()


def echo(msg: str = "hello world", image: str = IMAGE, num_replicas: int = 1) -> AppDef:
    """Prints a message to stdout (runs ``echo``).

    Args:
        msg: the message to print
        image: the image to run in
        num_replicas: how many replicas print it
    """
    return AppDef(
        name="echo",
        roles=[
            Role(
                name="echo",
                image=image,
                entrypoint="echo",
                args=[msg],
                num_replicas=num_replicas,
                resource=Resource(cpu=1, gpu=0, memMB=1024),
            )
        ],
    )


def touch(file: str, image: str = IMAGE) -> AppDef:
    """Creates a file or updates its modification time (runs ``touch``).

    Args:
        file: the file to touch
        image: the image to run in
    """
    return AppDef(
        name="touch",
        roles=[
            Role(
                name="touch",
                image=image,
                entrypoint="touch",
                args=[file],
                resource=Resource(cpu=1, gpu=0, memMB=1024),
            )
        ],
    )


def sh(
    *args: str,
    image: str = IMAGE,
    num_replicas: int = 1,
    cpu: int = 1,
    gpu: int = 0,
    memMB: int = 1024,
    h: str | None = None,
    env: dict[str, str] | None = None,
    max_retries: int = 0,
    mounts: list[str] | None = None,
    entrypoint: str | None = None,
) -> AppDef:
    """Runs a command through ``sh -c``.

    Each argument is quoted, so ``utils.sh echo '$HOME'`` prints ``$HOME``; for shell syntax pass
    one script to a shell: ``utils.sh -- sh -c 'echo $HOME && ls'``.

    Args:
        args: the command and its arguments
        image: the image to run in
        num_replicas: how many replicas run the command
        cpu: CPUs per replica
        gpu: GPUs per replica
        memMB: memory per replica, in MiB
        h: a named resource (e.g. cpu.small); takes precedence over cpu, gpu and memMB
        env: environment variables of the replicas (e.g. FOO=1,BAR=2)
        max_retries: how many times the scheduler may restart the role after a failure
        mounts: mounts for the replicas (e.g. type=bind,src=/host,dst=/job[,readonly])
        entrypoint: run the command with this program instead of sh -c
    """
    quoted = [shlex.quote(a) for a in args]
    env = dict(env) if env else {}
    env.setdefault("LOGLEVEL", os.getenv("LOGLEVEL", "WARNING"))
    if entrypoint is not None:
        run, run_args = entrypoint, list(args)
    else:
        run, run_args = "sh", ["-c", " ".join(quoted)]
    return AppDef(
        name="sh",
        roles=[
            Role(
                name="sh",
                image=image,
                entrypoint=run,
                args=run_args,
                num_replicas=num_replicas,
                resource=resource(cpu=cpu, gpu=gpu, memMB=memMB, h=h),
                env=env,
                max_retries=max_retries,
                mounts=parse_mounts(mounts) if mounts else [],
            )
        ],
    )


def python(
    *args: str,
    m: str | None = None,
    c: str | None = None,
    script: str | None = None,
    image: str = IMAGE,
    name: str = "python",
    cpu: int = 1,
    gpu: int = 0,
    memMB: int = 1024,
    h: str | None = None,
    num_replicas: int = 1,
    env: dict[str, str] | None = None,
    max_retries: int = 0,
    mounts: list[str] | None = None,
) -> AppDef:
    """Runs ``python`` with a module (-m), a program string (-c) or a script (--script).

    Put ``--`` between the component's arguments and the program's:
    ``utils.python -m my.main -- --lr 0.1``.

    Args:
        args: the program's arguments (its sys.argv[1:])
        m: the module to run as a script
        c: the program to run, as a string
        script: the .py file to run
        image: the image to run in
        name: the app's name
        cpu: CPUs per replica
        gpu: GPUs per replica
        memMB: memory per replica, in MiB
        h: a named resource (e.g. cpu.small); takes precedence over cpu, gpu and memMB
        num_replicas: how many replicas run the program
        env: environment variables of the replicas (e.g. FOO=1,BAR=2)
        max_retries: how many times the scheduler may restart the role after a failure
        mounts: mounts for the replicas (e.g. type=bind,src=/host,dst=/job[,readonly])
    """
    given = [flag for flag, value in (("-m", m), ("-c", c), ("--script", script)) if value]
    if len(given) != 1:
        raise ValueError(
            "utils.python needs exactly one of -m, -c and --script, "
            f"got {', '.join(given) if given else 'none'}"
        )
    program = [script] if script else ["-m", m] if m else ["-c", c]
    return AppDef(
        name=name,
        roles=[
            Role(
                name="python",
                image=image,
                entrypoint="python",
                args=[*(p for p in program if p is not None), *args],
                num_replicas=num_replicas,
                resource=resource(cpu=cpu, gpu=gpu, memMB=memMB, h=h),
                # TorchX names the module for Hydra (its --info/config search); env may override
                env={**({"HYDRA_MAIN_MODULE": m} if m else {}), **(env or {})},
                max_retries=max_retries,
                mounts=parse_mounts(mounts) if mounts else [],
            )
        ],
    )


def binary(
    *args: str,
    entrypoint: str,
    name: str = "binary",
    image: str = IMAGE,
    num_replicas: int = 1,
    cpu: int = 1,
    gpu: int = 0,
    memMB: int = 1024,
    h: str | None = None,
    env: dict[str, str] | None = None,
) -> AppDef:
    """Runs a program with arguments, without a shell.

    Args:
        args: the program's arguments
        entrypoint: the program to run (a path, or a name looked up on PATH)
        name: the app's name
        image: the image to run in
        num_replicas: how many replicas run the program
        cpu: CPUs per replica
        gpu: GPUs per replica
        memMB: memory per replica, in MiB
        h: a named resource (e.g. cpu.small); takes precedence over cpu, gpu and memMB
        env: environment variables of the replicas (e.g. FOO=1,BAR=2)
    """
    return AppDef(
        name=name,
        roles=[
            Role(
                name="binary",
                image=image,
                entrypoint=entrypoint,
                args=list(args),
                num_replicas=num_replicas,
                resource=resource(cpu=cpu, gpu=gpu, memMB=memMB, h=h),
                env=dict(env) if env else {},
            )
        ],
    )


def copy(src: str, dst: str, image: str = IMAGE, mounts: list[str] | None = None) -> AppDef:
    """Copies one file from src to dst (local paths, or fsspec URLs when fsspec is installed).

    Directories are not copied; the parent directory of a local dst is created.

    Args:
        src: the file to copy (a path or a URL such as s3://bucket/key)
        dst: where to copy it
        image: the image to run in (it needs python)
        mounts: mounts for the replica (e.g. type=bind,src=/host,dst=/job[,readonly])
    """
    return AppDef(
        name="torchx-utils-copy",  # (TorchX's names: roles are addressed by name)
        roles=[
            Role(
                name="torchx-utils-copy",
                image=image,
                entrypoint="python",
                args=["-c", _COPY_PROGRAM, src, dst],
                resource=Resource(cpu=1, gpu=0, memMB=1024),
                mounts=parse_mounts(mounts) if mounts else [],
            )
        ],
    )


def booth(
    x1: float,
    x2: float,
    trial_idx: int = 0,
    tracker_base: str = "/tmp/torchx-util-booth",
    image: str = IMAGE,
) -> AppDef:
    """Evaluates the Booth function, ``f(x1, x2) = (x1 + 2*x2 - 7)^2 + (2*x1 + x2 - 5)^2``.

    The result is written, as TorchX's booth app writes it, as the JSON ``{"booth_eval": f}`` in the
    file ``{tracker_base}/{trial_idx}``: a test objective for hyperparameter searches.

    Args:
        x1: x1
        x2: x2
        trial_idx: the trial's index (the result's key; ignore it outside a search)
        tracker_base: where the results go (a directory, or an fsspec URL such as s3://bucket/dir)
        image: the image to run in (it needs python)
    """
    return AppDef(
        name="torchx-utils-booth",
        roles=[
            Role(
                name="torchx-utils-booth",
                image=image,
                entrypoint="python",
                args=[
                    "-c",
                    source("booth"),
                    "--x1",
                    str(x1),
                    "--x2",
                    str(x2),
                    "--trial_idx",
                    str(trial_idx),
                    "--tracker_base",
                    tracker_base,
                ],
                resource=Resource(cpu=1, gpu=0, memMB=1024),
            )
        ],
    )
