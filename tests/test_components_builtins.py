"""The builtin components: their --help, the AppDefs they build, and the commands they run."""

from __future__ import annotations

import inspect
import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from asynctorchx.components import IMAGE, get_component, get_components
from asynctorchx.components.dist import TORCH_DEBUG_FLAGS, parse_name, parse_nnodes
from asynctorchx.specs import AppDef, BindMount, Resource, macros, validate_app
from asynctorchx.specs.builders import materialize_appdef, parse_args
from asynctorchx.specs.errors import InvalidComponentArgsException

MINIMAL_ARGS: dict[str, list[str]] = {
    "utils.echo": [],
    "utils.touch": ["--file", "/tmp/f"],
    "utils.sh": ["echo", "hi"],
    "utils.python": ["--script", "main.py"],
    "utils.binary": ["--entrypoint", "/bin/true"],
    "utils.copy": ["--src", "/tmp/a", "--dst", "/tmp/b"],
    "utils.booth": ["--x1", "1", "--x2", "2"],
    "dist.ddp": ["--script", "train.py"],
    "dist.spmd": ["--script", "train.py"],
    "serve.torchserve": ["--model_path", "/m.mar", "--management_api", "http://ts:8081"],
    "metrics.tensorboard": ["--logdir", "/logs"],
}


def build(name: str, *args: str) -> AppDef:
    return materialize_appdef(get_component(name).fn, list(args), name=name)


def substituted(app: AppDef, replica_id: int = 0, app_id: str = "app-1") -> list[str]:
    """The role's command line after macro substitution, as a local replica would run it."""
    values = macros.Values(
        img_root="/img", app_id=app_id, replica_id=str(replica_id), rank0_env="TORCHX_RANK0_HOST"
    )
    role = values.apply(app.roles[0])
    return [role.entrypoint, *role.args]


def with_sh_path(argv: list[str]) -> list[str]:
    """``argv`` with ``sh`` resolved now, so that it runs under a PATH holding only fakes."""
    assert argv[0] == "sh"
    return [shutil.which("sh") or "/bin/sh", *argv[1:]]


def test_every_builtin_has_a_minimal_invocation():
    """The table of minimal arguments covers every builtin component."""
    builtins = {n for n, c in get_components().items() if c.origin == "builtin"}
    assert builtins == set(MINIMAL_ARGS)


@pytest.mark.parametrize("name", sorted(MINIMAL_ARGS))
def test_builtin_help(name: str, capsys: pytest.CaptureFixture[str]):
    """--help of every builtin prints its usage, description and every documented parameter, exit 0."""
    component = get_component(name)
    with pytest.raises(SystemExit) as info:
        parse_args(component.fn, ["--help"], name=name)
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: asynctorchx run <run args...> {name}")
    assert component.description in out
    for param in inspect.signature(component.fn).parameters.values():
        if param.kind is param.VAR_POSITIONAL:
            assert f"  {param.name}  " in out or f"  {param.name}\n" in out
        else:
            assert f"--{param.name}" in out


@pytest.mark.parametrize("name", sorted(MINIMAL_ARGS))
def test_builtin_builds_a_valid_app(name: str):
    """Every builtin builds an AppDef that passes validation from its minimal arguments."""
    app = build(name, *MINIMAL_ARGS[name])
    validate_app(app)
    assert app.roles[0].image == IMAGE


@pytest.mark.parametrize("name", ["utils.touch", "utils.copy", "utils.binary"])
def test_builtin_missing_required_argument(name: str):
    """A builtin called without its required argument raises an error naming it."""
    with pytest.raises(InvalidComponentArgsException, match="the following arguments are required"):
        build(name)


def test_echo():
    """utils.echo runs echo with the message, on the requested number of replicas."""
    app = build("utils.echo", "--msg", "hi there", "--num_replicas", "2")
    role = app.roles[0]
    assert (role.entrypoint, role.args, role.num_replicas) == ("echo", ["hi there"], 2)
    assert build("utils.echo").roles[0].args == ["hello world"]


def test_sh_quotes_each_argument_and_runs_in_sh():
    """utils.sh runs its arguments, each quoted, through sh -c (a real sh prints them verbatim)."""
    app = build("utils.sh", "--env", "A=1", "--", "echo", "$HOME", "a b")
    role = app.roles[0]
    assert role.entrypoint == "sh" and role.args[0] == "-c"
    assert role.env["A"] == "1"
    out = subprocess.run([role.entrypoint, *role.args], capture_output=True, text=True, check=True)
    assert out.stdout == "$HOME a b\n"


def test_sh_with_entrypoint_runs_without_shell():
    """utils.sh --entrypoint runs the program directly with the arguments unquoted."""
    role = build("utils.sh", "--entrypoint", "env", "FOO=bar").roles[0]
    assert (role.entrypoint, role.args) == ("env", ["FOO=bar"])


def test_sh_resources_and_mounts():
    """utils.sh takes cpu/gpu/memMB, a named resource with precedence, retries and mounts."""
    role = build("utils.sh", "--cpu", "3", "--memMB", "2048", "true").roles[0]
    assert role.resource == Resource(cpu=3, gpu=0, memMB=2048)
    role = build("utils.sh", "--cpu", "3", "-h", "cpu.small", "--max_retries", "2", "true").roles[0]
    assert role.resource == Resource(cpu=1, gpu=0, memMB=2048) and role.max_retries == 2
    role = build("utils.sh", "--mounts", "type=bind,src=/a,dst=/b,readonly", "true").roles[0]
    assert role.mounts == [BindMount("/a", "/b", read_only=True)]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--script", "main.py", "--", "--lr", "1"], ["main.py", "--lr", "1"]),
        (["-m", "pkg.main", "a"], ["-m", "pkg.main", "a"]),
        (["-c", "print(1)"], ["-c", "print(1)"]),
    ],
)
def test_python_program_forms(args: list[str], expected: list[str]):
    """utils.python runs a script, a module (-m) or a program string (-c) with the rest as argv."""
    role = build("utils.python", *args).roles[0]
    assert (role.entrypoint, role.args) == ("python", expected)


@pytest.mark.parametrize("args", [[], ["-m", "a", "--script", "b.py"]])
def test_python_needs_exactly_one_program(args: list[str]):
    """utils.python without, or with more than one of, -m/-c/--script raises ValueError naming them."""
    with pytest.raises(ValueError, match="exactly one of -m, -c and --script"):
        build("utils.python", *args)


def test_binary():
    """utils.binary runs the entrypoint with the arguments and no shell."""
    app = build("utils.binary", "--entrypoint", "/bin/echo", "--name", "b", "x", "y")
    assert (app.name, app.roles[0].entrypoint, app.roles[0].args) == ("b", "/bin/echo", ["x", "y"])


def test_copy_copies_a_file(tmp_path: Path):
    """utils.copy's program copies a local file (creating the destination directory)."""
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(3 * 1024 * 1024))
    dst = tmp_path / "out" / "nested" / "dst.bin"
    role = build("utils.copy", "--src", str(src), "--dst", f"file://{dst}").roles[0]
    assert role.entrypoint == "python"
    subprocess.run([sys.executable, *role.args], check=True, capture_output=True, timeout=60)
    assert dst.read_bytes() == src.read_bytes()


# ---------------------------------------------------------------------------------------------
# dist.ddp / dist.spmd
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("j", "expected"),
    [
        ("4", (1, 1, 4, "1")),
        ("1x4", (1, 1, 4, "1")),
        ("2x2", (2, 2, 2, "2")),
        ("2:4x8", (2, 4, 8, "2:4")),
        (" 3x1 ", (3, 3, 1, "3")),
    ],
)
def test_j_grammar(j: str, expected: tuple[int, int, int, str]):
    """-j is [MIN:]NxNPROC or NPROC (one node)."""
    spec = parse_nnodes(j)
    assert (spec.min_nnodes, spec.max_nnodes, spec.nproc_per_node, spec.nnodes) == expected


@pytest.mark.parametrize(
    "j", ["", "x", "2x", "x2", "2x2x2", "0x2", "2x0", "3:2x1", "0:2x1", "a:2x1", "-1"]
)
def test_j_grammar_rejects(j: str):
    """A malformed or out-of-range -j raises ValueError naming -j and the value."""
    with pytest.raises(ValueError, match=r"-j"):
        parse_nnodes(j)


def test_bad_j_through_the_component_names_it():
    """dist.ddp -j 2y2 fails with a message naming -j and the value before anything runs."""
    with pytest.raises(ValueError, match=r"-j '2y2' is not of the form"):
        build("dist.ddp", "-j", "2y2", "--script", "t.py")


def test_ddp_single_node_uses_port_zero():
    """A single-node job rendezvouses on localhost:0 (a free port) with c10d."""
    app = build("dist.ddp", "-j", "1x4", "--script", "train.py")
    role = app.roles[0]
    assert (role.num_replicas, role.min_replicas) == (1, 1)
    cmd = shlex.split(substituted(app)[2])
    assert cmd[cmd.index("--rdzv_endpoint") + 1] == "localhost:0"
    assert cmd[cmd.index("--rdzv_backend") + 1] == "c10d"
    assert cmd[cmd.index("--nnodes") + 1] == "1"
    assert cmd[cmd.index("--nproc_per_node") + 1] == "4"
    assert cmd[cmd.index("--rdzv_id") + 1] == "app-1"
    assert cmd[cmd.index("--max_restarts") + 1] == "0"
    assert cmd[cmd.index("--tee") + 1] == "3"
    assert cmd[-1] == "train.py"


def test_ddp_multi_node_rendezvous_on_rank0_env():
    """A multi-node job rendezvouses on ${<rank0 env var>:=localhost}:29500, one replica per node."""
    app = build("dist.ddp", "-j", "2x2", "--script", "examples/ddp/train.py", "--", "--lr", "0.1")
    role = app.roles[0]
    assert (app.name, role.name, role.num_replicas, role.min_replicas) == ("train", "train", 2, 2)
    assert role.entrypoint == "sh" and role.args[0] == "-c"
    assert role.port_map == {"c10d": 29500}
    line = substituted(app)[2]
    assert '--rdzv_endpoint "${TORCHX_RANK0_HOST:=localhost}:29500"' in line
    cmd = shlex.split(line)
    assert cmd[cmd.index("--nnodes") + 1] == "2"
    assert cmd[-3:] == ["examples/ddp/train.py", "--lr", "0.1"]


def test_ddp_endpoint_expands_in_a_real_shell(tmp_path: Path):
    """Run by sh, the endpoint becomes $TORCHX_RANK0_HOST:port, or localhost:port when it is unset."""
    fake = _fake_launcher_dir(tmp_path, "torchrun")
    app = build("dist.ddp", "-j", "2x1", "--script", "t.py", "--rdzv_port", "29611")
    argv = with_sh_path(substituted(app))
    env = {"PATH": str(fake), "TORCHX_RANK0_HOST": "node-0"}
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, timeout=30)
    assert "--rdzv_endpoint node-0:29611" in out.stdout
    out = subprocess.run(argv, env={"PATH": str(fake)}, capture_output=True, text=True, check=True)
    assert "--rdzv_endpoint localhost:29611" in out.stdout


def _fake_launcher_dir(tmp_path: Path, *names: str) -> Path:
    """A PATH directory holding fake launchers that print their name and argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in names:
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\necho {name} "$@"\n')
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return bin_dir


@pytest.mark.parametrize(
    ("on_path", "expected"),
    [
        (("torchrun", "python3"), "torchrun --rdzv_backend c10d"),
        (("python3",), "python3 -m torch.distributed.run --rdzv_backend c10d"),
    ],
)
def test_ddp_launcher_falls_back_to_python_module(
    tmp_path: Path, on_path: tuple[str, ...], expected: str
):
    """The replica runs torchrun when it is on PATH, else python3 -m torch.distributed.run."""
    fake = _fake_launcher_dir(tmp_path, *on_path)
    argv = with_sh_path(substituted(build("dist.ddp", "--script", "t.py")))
    out = subprocess.run(argv, env={"PATH": str(fake)}, capture_output=True, text=True, check=True)
    assert out.stdout.startswith(expected)


def test_ddp_elastic_and_module():
    """-j MIN:MAXxN makes an elastic role; -m runs a module and names the role after its last part."""
    app = build("dist.ddp", "-j", "1:3x2", "-m", "pkg.trainer.main")
    role = app.roles[0]
    assert (role.min_replicas, role.num_replicas, role.name, app.name) == (1, 3, "main", "main")
    cmd = shlex.split(substituted(app)[2])
    assert cmd[cmd.index("--nnodes") + 1] == "1:3"
    assert cmd[-2:] == ["-m", "pkg.trainer.main"]


@pytest.mark.parametrize("args", [[], ["--script", "a.py", "-m", "b"]])
def test_ddp_needs_exactly_one_of_script_and_module(args: list[str]):
    """dist.ddp without, or with both of, --script and -m raises ValueError."""
    with pytest.raises(ValueError, match="exactly one of --script and -m"):
        build("dist.ddp", *args)


def test_ddp_static_rendezvous_passes_node_rank():
    """With --rdzv_backend static each node passes its replica id as --node_rank."""
    app = build("dist.ddp", "-j", "2x1", "--rdzv_backend", "static", "--script", "t.py")
    cmd = shlex.split(substituted(app, replica_id=1)[2])
    assert cmd[cmd.index("--node_rank") + 1] == "1"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("/", ("default-experiment", "train")),
        ("exp/run", ("exp", "run")),
        ("exp/", ("exp", "train")),
        ("/run", ("default-experiment", "run")),
        ("run", ("default-experiment", "run")),
    ],
)
def test_ddp_name_grammar(name: str, expected: tuple[str, str]):
    """--name is EXPERIMENT/RUN, EXPERIMENT/, /RUN or RUN; the app is named after the run."""
    assert parse_name(name, "path/to/train.py", None) == expected
    app = build("dist.ddp", "--name", name, "--script", "path/to/train.py")
    env = app.roles[0].env
    assert (env["TORCHX_TRACKING_EXPERIMENT_NAME"], env["TORCHX_TRACKING_RUN_NAME"]) == expected
    assert app.name == expected[1]


def test_ddp_env_debug_metadata_mounts_resources():
    """--env, --debug, --metadata, --mounts, -h/--cpu and --max_retries reach the AppDef."""
    app = build(
        "dist.ddp",
        "--script", "t.py",
        "--env", "FOO=1,LOGLEVEL=INFO",
        "--debug",
        "--metadata", "team=ml",
        "--mounts", "type=bind,src=/data,dst=/data",
        "-h", "gpu.small",
        "--cpu", "64",
        "--max_retries", "3",
        "--rdzv_conf", "join_timeout=600",
    )  # fmt: skip
    role = app.roles[0]
    assert role.env["FOO"] == "1" and role.env["LOGLEVEL"] == "INFO"
    assert TORCH_DEBUG_FLAGS.items() <= role.env.items()
    assert app.metadata == {"team": "ml"}
    assert role.mounts == [BindMount("/data", "/data")]
    assert role.resource.gpu == 1 and role.resource.cpu == 8
    assert role.max_retries == 3
    assert "--rdzv_conf join_timeout=600" in role.args[1]


def test_ddp_does_not_mutate_callers_env():
    """Calling dist.ddp from Python leaves the caller's env dict alone."""
    from asynctorchx.components.dist import ddp

    env = {"A": "1"}
    ddp(script="t.py", env=env)
    assert env == {"A": "1"}


@pytest.mark.parametrize(
    ("args", "nnodes", "nproc"),
    [
        (["-j", "2"], "2", "1"),
        (["-j", "2", "-h", "gpu.large"], "2", "4"),
        (["-j", "1x3"], "1", "3"),
        ([], "1", "1"),
    ],
)
def test_spmd_topology(args: list[str], nnodes: str, nproc: str):
    """dist.spmd -j N means N nodes with one process per GPU of -h (one without GPUs); NxM as given."""
    app = build("dist.spmd", "--script", "t.py", *args)
    cmd = shlex.split(substituted(app)[2])
    assert (cmd[cmd.index("--nnodes") + 1], cmd[cmd.index("--nproc_per_node") + 1]) == (
        nnodes,
        nproc,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], r"^dist\.spmd needs exactly one of --script and -m$"),
        (["--script", "t.py", "-m", "mod"], r"^dist\.spmd needs exactly one of"),
        (["--script", "t.py", "-j", "0"], r"^-j '0': the number of nodes must be at least 1$"),
    ],
)
def test_spmd_errors_name_spmd_and_the_j_given(args: list[str], message: str):
    """dist.spmd's errors name dist.spmd and the -j as given (not dist.ddp, not '0x1')."""
    with pytest.raises(ValueError, match=message):
        build("dist.spmd", *args)
