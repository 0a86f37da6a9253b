"""Components for distributed PyTorch jobs launched with ``torchrun`` (``torch.distributed.run``).

A DDP-style job is one role of ``nnodes`` identical replicas (nodes); each replica runs ``torchrun``
which starts ``nproc_per_node`` worker processes and rendezvouses with the other nodes::

    asynctorchx run -s local_cwd dist.ddp -j 1x4 --script main.py      # 1 node x 4 workers
    asynctorchx run -s local_cwd dist.ddp -j 2x2 --script main.py      # 2 nodes x 2 workers
    asynctorchx run -s slurm dist.ddp -j 2:4x8 --script main.py        # elastic, 2 to 4 nodes

Only the scheduler changes between a laptop and a cluster. Multi-node jobs rendezvous (``c10d``)
on rank 0's host, read at run time from the environment variable the scheduler names through the
``rank0_env`` macro (``TORCHX_RANK0_HOST`` locally), on ``rdzv_port`` (29500 by default; that port
must be free on rank 0's host). Single-node jobs use port 0: torchrun picks a free port.

The replica runs ``torchrun`` when it is on the PATH and ``python3 -m torch.distributed.run``
otherwise (e.g. in an image where torch is on the PYTHONPATH but its scripts are not on the PATH);
it is started through ``sh -c`` so that the rendezvous endpoint is expanded on the node.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from asynctorchx.components import IMAGE
from asynctorchx.specs import AppDef, Role, get_named_resource, macros, parse_mounts, resource

DEFAULT_RDZV_PORT = 29500
DEFAULT_EXPERIMENT_NAME = "default-experiment"

TORCH_DEBUG_FLAGS: dict[str, str] = {
    "CUDA_LAUNCH_BLOCKING": "1",
    "NCCL_DESYNC_DEBUG": "1",
    "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
    "TORCH_SHOW_CPP_STACKTRACES": "1",
}
"""Environment variables set by ``--debug``: synchronous CUDA, NCCL desync and c10d debug output."""

_LAUNCHER = (
    "if command -v torchrun >/dev/null 2>&1; then set -- torchrun; "
    'else set -- python3 -m torch.distributed.run; fi; exec "$@"'
)
_J_RE = re.compile(r"^(?:(?:(?P<min>\d+):)?(?P<nnodes>\d+)x)?(?P<nproc>\d+)$")


@dataclass(frozen=True)
class NodeSpec:
    """The topology of ``-j``: ``[MIN:]NxNPROC`` or ``NPROC``.

    Args:
        min_nnodes: the fewest nodes the job may run with (elastic lower bound).
        max_nnodes: how many nodes are started.
        nproc_per_node: worker processes per node.
    """

    min_nnodes: int
    max_nnodes: int
    nproc_per_node: int

    @property
    def nnodes(self) -> str:
        """The value of torchrun's ``--nnodes``: ``N`` or ``MIN:MAX``."""
        if self.min_nnodes == self.max_nnodes:
            return str(self.max_nnodes)
        return f"{self.min_nnodes}:{self.max_nnodes}"


def parse_nnodes(j: str) -> NodeSpec:
    """Parses ``-j``: ``[MIN:]NxNPROC`` (``2x4``, ``1:3x8``) or ``NPROC`` (one node).

    Raises:
        ValueError: ``j`` is not of that form or its numbers are out of range.
    """
    m = _J_RE.match(j.strip())
    if not m:
        raise ValueError(f"-j {j!r} is not of the form [MIN:]NxNPROC or NPROC (e.g. 4, 2x4, 1:2x4)")
    nproc = int(m["nproc"])
    nnodes = int(m["nnodes"]) if m["nnodes"] else 1
    min_nnodes = int(m["min"]) if m["min"] else nnodes
    if nproc < 1 or nnodes < 1:
        raise ValueError(f"-j {j!r}: the number of nodes and of processes must be at least 1")
    if not 1 <= min_nnodes <= nnodes:
        raise ValueError(
            f"-j {j!r}: the minimum number of nodes must be between 1 and {nnodes}, got {min_nnodes}"
        )
    return NodeSpec(min_nnodes, nnodes, nproc)


def parse_name(name: str, script: str | None, m: str | None) -> tuple[str, str]:
    """Splits ``--name`` into (experiment name, run name).

    ``EXPERIMENT/RUN``, ``EXPERIMENT/``, ``/RUN`` or ``RUN``; a missing run name is the script's
    stem or the module's last part, a missing experiment name is ``default-experiment``.
    """
    default_run = _program_name(script, m)
    if "/" not in name:
        return DEFAULT_EXPERIMENT_NAME, name or default_run
    experiment, _, run = name.partition("/")
    return experiment or DEFAULT_EXPERIMENT_NAME, run or default_run


def _program_name(script: str | None, m: str | None) -> str:
    if script:
        return Path(script).stem
    if m:
        return m.rpartition(".")[2]
    raise ValueError("exactly one of --script and -m must be given")


def _role_name(script: str | None, m: str | None) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9_.\-]+", "-", _program_name(script, m)).strip("-_.")
    return cleaned[:63] or "trainer"


def _launch_command(
    spec: NodeSpec,
    program: list[str],
    rdzv_backend: str,
    rdzv_port: int,
    rdzv_conf: str | None,
    max_restarts: int,
    tee: int,
) -> str:
    if spec.max_nnodes == 1:
        endpoint = "localhost:0"
    else:
        # "$$" escapes the macro syntax: the shell on the node sees ${TORCHX_RANK0_HOST:=localhost}
        endpoint = f'"$${{{macros.rank0_env}:=localhost}}:{rdzv_port}"'
    flags = [
        *([("--rdzv_conf", rdzv_conf)] if rdzv_conf else []),
        ("--rdzv_id", macros.app_id),
        ("--nnodes", spec.nnodes),
        ("--nproc_per_node", str(spec.nproc_per_node)),
        ("--max_restarts", str(max_restarts)),
        ("--tee", str(tee)),
        ("--role", ""),
        *([("--node_rank", macros.replica_id)] if rdzv_backend == "static" else []),
    ]
    parts = [_LAUNCHER, "--rdzv_backend", shlex.quote(rdzv_backend), "--rdzv_endpoint", endpoint]
    for flag, value in flags:
        parts += [flag, shlex.quote(value)]
    parts += [shlex.quote(p) for p in program]
    return " ".join(parts)


def ddp(
    *script_args: str,
    script: str | None = None,
    m: str | None = None,
    image: str = IMAGE,
    name: str = "/",
    h: str | None = None,
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 1024,
    j: str = "1x2",
    env: dict[str, str] | None = None,
    metadata: dict[str, str] | None = None,
    max_retries: int = 0,
    max_restarts: int = 0,
    rdzv_port: int = DEFAULT_RDZV_PORT,
    rdzv_backend: str = "c10d",
    rdzv_conf: str | None = None,
    mounts: list[str] | None = None,
    debug: bool = False,
    tee: int = 3,
) -> AppDef:
    """A distributed data parallel job: one role of nodes, each running torchrun.

    The nodes rendezvous with c10d on rank 0's host at rdzv_port (single-node jobs use a free
    port). cpu, gpu and memMB are per node; a named resource (-h) takes precedence over them.
    Put -- before the script's own arguments: dist.ddp -j 2x2 --script train.py -- --lr 0.1

    Args:
        script_args: the arguments of the script or module
        script: the script to run (a path inside the image; the current directory locally)
        m: the Python module to run instead of a script
        image: the image to run in
        name: EXPERIMENT/RUN, EXPERIMENT/, /RUN or RUN; RUN defaults to the script's name
        h: a named resource (e.g. cpu.small, gpu.large); takes precedence over cpu, gpu and memMB
        cpu: CPUs per node
        gpu: GPUs per node
        memMB: memory per node, in MiB
        j: [MIN:]NxNPROC for N nodes (at least MIN) of NPROC processes each, or NPROC for one node
        env: environment variables of the nodes (e.g. FOO=1,BAR=2)
        metadata: scheduler-specific metadata of the app (e.g. KEY1=v1,KEY2=v2)
        max_retries: how many times the scheduler may restart the job after a failure
        max_restarts: how many times torchrun may restart the workers of a node (torchrun's --max_restarts)
        rdzv_port: the rendezvous port on rank 0's host for multi-node jobs
        rdzv_backend: torchrun's rendezvous backend (c10d, or static with a fixed node rank)
        rdzv_conf: extra rendezvous settings (e.g. join_timeout=600,close_timeout=600)
        mounts: mounts for the nodes (e.g. type=bind,src=/host,dst=/job[,readonly])
        debug: set PyTorch's debugging environment variables (TORCH_DISTRIBUTED_DEBUG=DETAIL...)
        tee: which worker streams torchrun copies to its console: 0 none, 1 stdout, 2 stderr, 3 both
    """
    if (script is None) == (m is None):
        raise ValueError("dist.ddp needs exactly one of --script and -m")
    spec = parse_nnodes(j)
    if not 0 <= rdzv_port <= 65535:
        raise ValueError(f"--rdzv_port must be a port number in [0, 65535], got {rdzv_port}")
    if tee not in (0, 1, 2, 3):
        raise ValueError(f"--tee must be 0, 1, 2 or 3, got {tee}")
    experiment, run = parse_name(name, script, m)
    env = dict(env) if env else {}
    env["TORCHX_TRACKING_EXPERIMENT_NAME"] = experiment
    env["TORCHX_TRACKING_RUN_NAME"] = run
    env.setdefault("LOGLEVEL", os.getenv("LOGLEVEL", "WARNING"))
    if debug:
        env.update(TORCH_DEBUG_FLAGS)
    program = [script] if script is not None else ["-m", m or ""]
    command = _launch_command(
        spec, [*program, *script_args], rdzv_backend, rdzv_port, rdzv_conf, max_restarts, tee
    )
    return AppDef(
        name=run,
        roles=[
            Role(
                name=_role_name(script, m),
                image=image,
                entrypoint="sh",
                args=["-c", command],
                num_replicas=spec.max_nnodes,
                min_replicas=spec.min_nnodes,
                resource=resource(cpu=cpu, gpu=gpu, memMB=memMB, h=h),
                env=env,
                port_map={"c10d": rdzv_port},
                max_retries=max_retries,
                mounts=parse_mounts(mounts) if mounts else [],
            )
        ],
        metadata=dict(metadata) if metadata else {},
    )


def spmd(
    *args: str,
    script: str | None = None,
    m: str | None = None,
    image: str = IMAGE,
    name: str = "/",
    h: str | None = None,
    j: str = "1x1",
    env: dict[str, str] | None = None,
    metadata: dict[str, str] | None = None,
    max_retries: int = 0,
    mounts: list[str] | None = None,
    debug: bool = False,
) -> AppDef:
    """A single-program multiple-data job: j = NxM copies of one program on N nodes.

    Use it for any torch.distributed program (DDP, FSDP, RPC); -j 1x1 runs one process that may
    still call init_process_group. Here -j N means N nodes with one process per GPU of the named
    resource -h (one process per node without GPUs). Put -- before the program's arguments.

    Args:
        args: the arguments of the script or module
        script: the script to run
        m: the Python module to run instead of a script
        image: the image to run in
        name: EXPERIMENT/RUN, EXPERIMENT/, /RUN or RUN; RUN defaults to the script's name
        h: the named resource of each node (e.g. gpu.large)
        j: NxM (N nodes of M processes), [MIN:]NxM, or N (N nodes, one process per GPU of -h)
        env: environment variables of the nodes (e.g. FOO=1,BAR=2)
        metadata: scheduler-specific metadata of the app (e.g. KEY1=v1,KEY2=v2)
        max_retries: how many times the scheduler may restart the job after a failure
        mounts: mounts for the nodes (e.g. type=bind,src=/host,dst=/job[,readonly])
        debug: set PyTorch's debugging environment variables
    """
    if (script is None) == (m is None):
        raise ValueError("dist.spmd needs exactly one of --script and -m")
    topology = j.strip()
    if re.fullmatch(r"\d+", topology):
        if int(topology) < 1:
            raise ValueError(f"-j {j!r}: the number of nodes must be at least 1")
        gpus = get_named_resource(h).gpu if h else 0
        topology = f"{topology}x{max(gpus, 1)}"
    return ddp(
        *args,
        script=script,
        m=m,
        image=image,
        name=name,
        h=h,
        j=topology,
        env=env,
        metadata=metadata,
        max_retries=max_retries,
        mounts=mounts,
        debug=debug,
    )
