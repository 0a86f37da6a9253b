"""Component files written for TorchX, unmodified: without torchx (stand-ins) and with TorchX 0.7.

The tx_*.py files of tests/fixtures/torchx_files are loaded here (this environment has no torchx)
and in the TorchX 0.7 virtual environment (``_torchx_env``), and must give the AppDef of their
asynctorchx equivalents. Also: TorchX AppDefs converted both ways exactly, a real torchx left
untouched, the stand-ins never leaking, the entry-point groups, and every kind of bad file.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _torchx_env import REPO, json_from_torchx, run_in_torchx, torchx_env, torchx_python

import asynctorchx
from asynctorchx.components import (
    ComponentValidationException,
    clear_cache,
    get_component,
    get_components,
)
from asynctorchx.specs import AppDef
from asynctorchx.specs.builders import materialize_appdef
from asynctorchx.specs.serialize import appdef_to_dict

FILES = Path(__file__).parent / "fixtures" / "torchx_files"

# (TorchX file, function, arguments): each has an equivalent in atx_equivalents.py
CASES = [
    ("tx_trainer.py", "trainer", []),
    (
        "tx_trainer.py",
        "trainer",
        [
            "--nnodes",
            "4",
            "--h",
            "aws_g5.12xlarge",
            "--env",
            "A=1,B=2",
            "--mounts",
            "type=bind,src=/data,dst=/data,readonly,type=volume,src=v,dst=/v",
            "--",
            "--lr",
            "0.1",
        ],
    ),
    ("tx_from_imports.py", "parameter_server", ["--workers", "3"]),
    ("tx_from_imports.py", "generic", []),
    ("tx_from_imports.py", "generic", ["--size", "gpu.medium"]),
    ("tx_echo.py", "hello", ["--msg", "hi"]),
]
CASE_IDS = [f"{f}:{fn}{'+args' if args else ''}" for f, fn, args in CASES]


def build(component: str, args: list[str]) -> AppDef:
    return materialize_appdef(get_component(component).fn, args, name=component)


@pytest.fixture(scope="module", autouse=True)
def no_torchx_here() -> None:
    """This environment must not have torchx: the stand-ins are what is tested here."""
    assert importlib.util.find_spec("torchx") is None, "torchx is installed in the test env"


@pytest.fixture(scope="module")
def appdefs_with_torchx() -> dict[str, Any]:
    """Each case's AppDef as dict, built in the TorchX 0.7 venv (plus the type the file returned)."""
    code = f"""
import json
from asynctorchx.components import get_component
from asynctorchx.specs.builders import materialize_appdef
from asynctorchx.specs.serialize import appdef_to_dict
out = {{}}
for i, (f, fn, args) in enumerate({CASES!r}):
    c = get_component(f"{FILES}/" + f + ":" + fn)
    returned = c.fn()
    out[str(i)] = {{
        "returned": type(returned).__module__ + "." + type(returned).__name__,
        "app": appdef_to_dict(materialize_appdef(c.fn, args)),
    }}
print(json.dumps(out))
"""
    found: dict[str, Any] = json_from_torchx(code)
    return found


@pytest.mark.parametrize(("index", "case"), list(enumerate(CASES)), ids=CASE_IDS)
def test_torchx_file_gives_the_same_appdef_with_and_without_torchx(
    index: int, case: tuple[str, str, list[str]], appdefs_with_torchx: dict[str, Any]
) -> None:
    """An unmodified TorchX file gives its asynctorchx equivalent's AppDef, with or without torchx."""
    file, fn, args = case
    without = build(f"{FILES / file}:{fn}", args)
    equivalent = build(f"{FILES / 'atx_equivalents.py'}:{fn}", args)
    assert without == equivalent
    with_torchx = appdefs_with_torchx[str(index)]
    assert with_torchx["returned"] == "torchx.specs.api.AppDef"  # converted from TorchX's
    assert with_torchx["app"] == appdef_to_dict(equivalent)


def test_dryrun_of_a_torchx_file_on_the_cli_in_both_environments(tmp_path: Path) -> None:
    """`asynctorchx run --dryrun FILE:fn` prints the same request with and without torchx."""
    argv = ["-m", "asynctorchx", "run", "--dryrun", "-s", "local_cwd", f"{FILES}/tx_echo.py:hello"]
    env = torchx_env(ASYNCTORCHX_LOCAL_ROOT=str(tmp_path))
    here = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    there = subprocess.run(
        [torchx_python(), *argv], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert here.returncode == there.returncode == 0, (here.stderr, there.stderr)
    assert "echo hello from a TorchX file" in here.stdout

    def normalized(out: str) -> str:
        return re.sub(r"hello-[a-z0-9]{8}", "hello-ID", out)

    assert normalized(here.stdout) == normalized(there.stdout)


def test_torchx_file_runs_on_local_cwd_with_torchx_installed(tmp_path: Path) -> None:
    """`asynctorchx run FILE:fn` in the TorchX venv launches the converted app; it succeeds."""
    done = subprocess.run(
        [torchx_python(), "-m", "asynctorchx", "run", "--log", f"{FILES}/tx_echo.py:hello"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=torchx_env(ASYNCTORCHX_LOCAL_ROOT=str(tmp_path / "state")),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "hello from a TorchX file 0" in done.stderr
    assert "hello from a TorchX file 1" in done.stderr


async def test_torchx_file_runs_through_run_component(tmp_path: Path) -> None:
    """run_component of an unmodified TorchX file (no torchx here) runs both replicas."""
    import anyio

    from asynctorchx import AsyncRunner

    async with AsyncRunner(name="txcompat", local_root=str(tmp_path / "state")) as runner:
        handle = await runner.run_component(
            f"{FILES}/tx_echo.py:hello", ["--msg", "hey"], "local_cwd"
        )
        with anyio.fail_after(30):
            status = await runner.wait(handle)
        assert status is not None and status.state.name == "SUCCEEDED"
        lines = [line async for line in runner.log_lines(handle, "hello", k=1)]
    assert lines == ["hey 1\n"]


# -- the stand-ins stay in the file ----------------------------------------------------------------


def test_stand_ins_never_enter_sys_modules() -> None:
    """After loading and calling a TorchX file, no torchx module exists and `import torchx` fails."""
    app = build(f"{FILES}/tx_trainer.py:trainer", [])
    assert app.roles[0].image == asynctorchx.IMAGE == "ghcr.io/pytorch/torchx:0.7.0"
    assert not [m for m in sys.modules if m == "torchx" or m.startswith("torchx.")]
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("torchx")


def test_stand_ins_are_invisible_to_other_threads(tmp_path: Path) -> None:
    """While a TorchX file is loading, another thread importing torchx still gets an ImportError."""
    gate = types.ModuleType("_txcompat_gate")
    gate.reached = threading.Event()  # type: ignore[attr-defined]
    gate.go = threading.Event()  # type: ignore[attr-defined]
    sys.modules["_txcompat_gate"] = gate
    component = tmp_path / "slow.py"
    component.write_text(
        textwrap.dedent(
            '''
            import torchx.specs as specs
            import _txcompat_gate

            _txcompat_gate.reached.set()
            assert _txcompat_gate.go.wait(30)


            def app() -> specs.AppDef:
                """An app."""
                return specs.AppDef("a", [specs.Role("r", "img", "echo")])
            '''
        )
    )
    loaded: list[Any] = []
    loader = threading.Thread(target=lambda: loaded.append(get_component(f"{component}:app")))
    try:
        loader.start()
        assert gate.reached.wait(30)  # type: ignore[attr-defined]
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("torchx.specs")
        assert "torchx" not in sys.modules
    finally:
        gate.go.set()  # type: ignore[attr-defined]
        loader.join(30)
        del sys.modules["_txcompat_gate"]
    assert loaded and materialize_appdef(loaded[0].fn, []).roles[0].name == "r"


def test_real_torchx_is_untouched_by_loading_a_file() -> None:
    """With torchx installed, loading a TorchX file leaves every torchx module TorchX's own."""
    code = f"""
import json, sys
import torchx, torchx.specs
before = {{k: id(v) for k, v in sys.modules.items() if k.split(".")[0] == "torchx"}}
from asynctorchx.components import get_component
from asynctorchx.specs.builders import materialize_appdef
c = get_component("{FILES}/tx_from_imports.py:parameter_server")
app = materialize_appdef(c.fn, [])
after = {{k: id(v) for k, v in sys.modules.items() if k.split(".")[0] == "torchx"}}
module = sys.modules[c.fn.__module__]
print(json.dumps({{
    "same": all(after[k] == v for k, v in before.items()),
    "files": sorted({{getattr(v, "__file__", None) or "" for k, v in sys.modules.items()
                      if k.split(".")[0] == "torchx"}})[:3],
    "file_sees_real": module.specs is sys.modules["torchx.specs"],
    "builtins_untouched": module.__builtins__ is __builtins__.__dict__
        if hasattr(__builtins__, "__dict__") else module.__builtins__ is __builtins__,
    "appdef_module": torchx.specs.AppDef.__module__,
    "ours": type(app).__module__,
}}))
"""
    result = json_from_torchx(code)
    assert result["same"] is True
    assert all("site-packages/torchx" in f for f in result["files"] if f), result["files"]
    assert result["file_sees_real"] is True
    assert result["builtins_untouched"] is True
    assert (result["appdef_module"], result["ours"]) == (
        "torchx.specs.api",
        "asynctorchx.specs.api",
    )


def test_real_torchx_loaded_by_the_file_itself_is_the_real_one() -> None:
    """With torchx installed but not yet imported, the file imports the real package."""
    code = f"""
import json, sys
assert "torchx" not in sys.modules or True
sys.modules.pop("torchx.specs", None)
from asynctorchx.components import get_component
get_component("{FILES}/tx_echo.py:hello")
import torchx.specs
print(json.dumps(torchx.specs.__file__))
"""
    assert "site-packages/torchx/specs/__init__.py" in json_from_torchx(code)


# -- conversion both ways --------------------------------------------------------------------------

_ROUND_TRIP = f"""
import json
import torchx.specs as tx
from asynctorchx.specs import AppDef, BindMount, DeviceMount, Resource, RetryPolicy, Role, VolumeMount
from asynctorchx.specs._torchx import appdef_from_torchx, appdef_to_torchx
import sys
sys.path.insert(0, {str(FILES)!r})
import tx_from_imports, tx_trainer

torchx_apps = [
    tx_trainer.trainer(nnodes=3, env={{"X": "1"}}, mounts=["type=device", "src=/dev/fuse", "dst=/dev/fuse"]),
    tx_from_imports.parameter_server(),
    tx.AppDef("bare", roles=[tx.Role("r", "img")]),
]
ours = [
    AppDef(
        "ours",
        roles=[
            Role(
                "a", "img", "python", ["-m", "x", "${{app_id}}"], {{"K": "${{replica_id}}"}},
                num_replicas=4, min_replicas=2, max_retries=5, retry_policy=RetryPolicy.REPLICA,
                resource=Resource(8, 1, 1000, {{"node.kubernetes.io/instance-type": "p3.2xlarge",
                                                 "nested": {{"a": [1, 2]}}}}, {{"efa": 2}}),
                port_map={{"http": 80}}, metadata={{"k8s": {{"x": "${{app_id}}"}}}},
                mounts=[BindMount("/a", "/b", True), VolumeMount("v", "/v"), DeviceMount("/dev/x", "/dev/y", "r")],
                base_image="base",
            ),
            Role("b", "img2", "sh"),
        ],
        metadata={{"team": "x"}},
    )
]
there_and_back = [appdef_to_torchx(appdef_from_torchx(a)) == a for a in torchx_apps]
back_and_there = [appdef_from_torchx(appdef_to_torchx(a)) == a for a in ours]
converted = appdef_to_torchx(ours[0])
print(json.dumps({{
    "there_and_back": there_and_back,
    "back_and_there": back_and_there,
    "types": [type(converted).__module__, type(converted.roles[0].resource).__module__,
              type(converted.roles[0].retry_policy).__module__,
              [type(m).__name__ for m in converted.roles[0].mounts]],
}}))
"""


def test_conversion_round_trips_exactly_both_ways() -> None:
    """TorchX -> ours -> TorchX and ours -> TorchX -> ours give equal objects, every field kept."""
    result = json_from_torchx(_ROUND_TRIP)
    assert result["there_and_back"] == [True, True, True]
    assert result["back_and_there"] == [True]
    assert result["types"] == [
        "torchx.specs.api",
        "torchx.specs.api",
        "torchx.specs.api",
        ["BindMount", "VolumeMount", "DeviceMount"],
    ]


def test_torchx_fields_without_counterpart_are_errors(tmp_path: Path) -> None:
    """A TorchX AppDef using HOT_SPARE, a pre_proc hook or an unknown field fails, naming it."""
    (tmp_path / "odd.py").write_text(
        textwrap.dedent(
            '''
            import dataclasses
            import torchx.specs as specs


            class MyRole(specs.Role):
                def pre_proc(self, scheduler, dryrun_info):
                    return dryrun_info


            @dataclasses.dataclass
            class NewerRole(specs.Role):
                overrides: dict = dataclasses.field(default_factory=dict)


            def hot_spare() -> specs.AppDef:
                """hot."""
                return specs.AppDef("a", [specs.Role("r", "i", "e", retry_policy=specs.RetryPolicy.HOT_SPARE)])


            def hook() -> specs.AppDef:
                """hook."""
                return specs.AppDef("a", [MyRole("r", "i", entrypoint="e")])


            def newer() -> specs.AppDef:
                """newer."""
                return specs.AppDef("a", [NewerRole("r", "i", entrypoint="e", overrides={"x": 1})])


            def newer_default() -> specs.AppDef:
                """newer, at its default."""
                return specs.AppDef("a", [NewerRole("r", "i", entrypoint="e")])
            '''
        )
    )
    code = f"""
import json
from asynctorchx.components import get_component
from asynctorchx.specs.builders import materialize_appdef
out = {{}}
for fn in ("hot_spare", "hook", "newer", "newer_default"):
    try:
        name = "{tmp_path}/odd.py:" + fn
        out[fn] = materialize_appdef(get_component(name).fn, [], name=name).roles[0].name
    except Exception as e:
        out[fn] = type(e).__name__ + ": " + str(e)
print(json.dumps(out))
"""
    out = json_from_torchx(code)
    assert out["hot_spare"].startswith("ComponentValidationException: component")
    assert f"{tmp_path}/odd.py:hot_spare" in out["hot_spare"]
    assert "retry_policy = 'HOT_SPARE' has no counterpart" in out["hot_spare"]
    assert "MyRole" in out["hook"] and "pre_proc" in out["hook"]
    assert "roles[0]['r'].overrides = {'x': 1} has no counterpart" in out["newer"]
    assert out["newer_default"] == "r"


# -- bad input -------------------------------------------------------------------------------------

BAD_FILES = {
    "raises.py": (
        "raises_on_import",
        '''
        import torchx.specs as specs

        raise RuntimeError("no GPU quota left")


        def raises_on_import() -> specs.AppDef:
            """x."""
        ''',
        r"raises\.py:raises_on_import' is not valid: importing '.*raises\.py' failed: "
        r"RuntimeError: no GPU quota left",
    ),
    "returns_none.py": (
        "forgot",
        '''
        import torchx.specs as specs


        def forgot() -> specs.AppDef:
            """Forgets to return."""
            specs.AppDef("x", [])
        ''',
        r"returns_none\.py:forgot' is not valid: it returned None, not an AppDef",
    ),
    "returns_foreign.py": (
        "foreign",
        '''
        import torchx.specs as specs


        class AppDef:
            pass


        def foreign() -> specs.AppDef:
            """Returns an object that only looks like an AppDef."""
            return AppDef()
        ''',
        r"returns_foreign\.py:foreign' is not valid: it returned a AppDef \(module "
        r"_asynctorchx_component_\w+\), not an AppDef",
    ),
    "no_counterpart_import.py": (
        "uses_scheduler",
        '''
        import torchx.specs as specs
        from torchx.schedulers import get_scheduler_factories


        def uses_scheduler() -> specs.AppDef:
            """x."""
            return specs.AppDef("x")
        ''',
        r"no_counterpart_import\.py:uses_scheduler' is not valid: uses torchx\.schedulers, "
        r"which has no counterpart in asynctorchx",
    ),
    "no_counterpart_name.py": (
        "uses_workspace",
        '''
        from torchx.specs import AppDef, Workspace


        def uses_workspace() -> AppDef:
            """x."""
            return AppDef("x")
        ''',
        r"no_counterpart_name\.py:uses_workspace' is not valid: uses torchx\.specs\.Workspace, "
        r"which has no counterpart",
    ),
    "no_counterpart_at_call.py": (
        "late",
        '''
        import torchx.specs as specs


        def late() -> specs.AppDef:
            """x."""
            return specs.AppDef("x", [specs.Role("r", "i", "e", retry_policy=specs.RetryPolicy.HOT_SPARE)])
        ''',
        r"no_counterpart_at_call\.py:late' is not valid: uses torchx\.specs\.RetryPolicy\.HOT_SPARE, "
        r"which has no counterpart",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_component_file_is_one_line_error_and_launches_nothing(
    name: str, tmp_path: Path
) -> None:
    """A bad TorchX file fails `run` with one line naming the file, the function and the problem."""
    fn, source, pattern = BAD_FILES[name]
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    state = tmp_path / "state"
    done = subprocess.run(
        [sys.executable, "-m", "asynctorchx", "run", "-s", "local_cwd", f"{path}:{fn}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "ASYNCTORCHX_LOCAL_ROOT": str(state)},
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    error_lines = [line for line in done.stderr.splitlines() if line.startswith("asynctorchx")]
    assert len(error_lines) == 1, done.stderr
    assert re.search(pattern, error_lines[0]), error_lines[0]
    assert "Traceback" not in done.stderr
    launched = [p for p in state.glob("*/*") if p.is_dir()] if state.exists() else []
    assert launched == []


def test_torchx_builtins_module_alias(tmp_path: Path) -> None:
    """`import torchx.components.dist` in a file gives asynctorchx's dist builtins."""
    path = tmp_path / "wrap.py"
    path.write_text(
        textwrap.dedent(
            '''
            import torchx.components.dist
            import torchx.specs as specs
            from torchx.components.utils import echo


            def ddp(script: str = "t.py") -> specs.AppDef:
                """ddp.

                Args:
                    script: the script
                """
                return torchx.components.dist.ddp(script=script, j="1x2")


            def hello() -> specs.AppDef:
                """hello."""
                return echo(msg="hi")
            '''
        )
    )
    assert build(f"{path}:ddp", []) == build("dist.ddp", ["--script", "t.py", "-j", "1x2"])
    assert build(f"{path}:hello", []) == build("utils.echo", ["--msg", "hi"])


# -- entry-point groups ----------------------------------------------------------------------------

_TX_PLUGIN = {
    "txplug/__init__.py": "",
    "txplug/comps.py": '''
        from asynctorchx.specs import AppDef, Role


        def train(lr: float = 0.1) -> AppDef:
            """Trains.

            Args:
                lr: learning rate
            """
            return AppDef("train", [Role("t", "img", "python", args=[str(lr)])])
    ''',
    "txplug/pkg/__init__.py": "",
    "txplug/pkg/sub.py": '''
        from asynctorchx.specs import AppDef, Role


        def nested() -> AppDef:
            """Nested."""
            return AppDef("nested", [Role("n", "img", "echo")])
    ''',
    "txplug/torchx_native.py": '''
        import torchx.specs as specs


        def native(n: int = 2) -> specs.AppDef:
            """Returns TorchX's AppDef.

            Args:
                n: replicas
            """
            return specs.AppDef("native", [specs.Role("r", "img", entrypoint="echo", num_replicas=n)])


        def resource() -> specs.Resource:
            return specs.Resource(cpu=7, gpu=1, memMB=7000, devices={"efa": 1})
    ''',
}
_TX_ENTRY_POINTS = """\
[torchx.components]
tx = txplug.comps
_0 = txplug.pkg
utils = txplug.comps
native = txplug.torchx_native
[torchx.named_resources]
tx_res = txplug.torchx_native:resource
"""


@pytest.fixture
def tx_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A distribution with torchx.components and torchx.named_resources entry points."""
    site = tmp_path / "site"
    for rel, source in _TX_PLUGIN.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(textwrap.dedent(source))
    dist = site / "txplug-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: txplug\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(_TX_ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(site))
    clear_cache()
    yield site
    clear_cache()
    for mod in [m for m in sys.modules if m.startswith("txplug")]:
        del sys.modules[mod]


def test_torchx_components_group_is_read_like_ours(tx_plugin: Path) -> None:
    """torchx.components entries add components (`_N` without prefix); builtins are never hidden."""
    components = get_components()
    assert (
        components["tx.train"].origin == "entry point tx = txplug.comps (group 'torchx.components')"
    )
    assert "sub.nested" in components
    assert build("sub.nested", []).name == "nested"
    assert build("tx.train", ["--lr", "0.5"]).roles[0].args == ["0.5"]
    assert components["utils.echo"].origin == "builtin"
    assert "utils.train" in components  # added next to the builtins, not instead of them


def test_torchx_groups_with_torchx_installed(tx_plugin: Path) -> None:
    """With torchx installed, plugin components and resources giving TorchX objects are converted."""
    code = """
import json
from asynctorchx.components import get_component
from asynctorchx.specs import get_named_resource
from asynctorchx.specs.builders import materialize_appdef
app = materialize_appdef(get_component("native.native").fn, ["--n", "3"])
res = get_named_resource("tx_res")
print(json.dumps([type(app).__module__, app.roles[0].num_replicas, type(res).__module__,
                  [res.cpu, res.gpu, res.memMB, res.devices]]))
"""
    result = json_from_torchx(code, PYTHONPATH=str(tx_plugin))
    assert result == ["asynctorchx.specs.api", 3, "asynctorchx.specs.api", [7, 1, 7000, {"efa": 1}]]


def test_torchxconfig_component_defaults_name_torchx_builtins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """[component:utils.booth] of a .torchxconfig supplies defaults to the TorchX builtin."""
    from asynctorchx import get_runner

    (tmp_path / ".torchxconfig").write_text(
        "[component:utils.booth]\nx1 = 1.5\nx2 = 2\ntracker_base = /tmp/b\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TORCHXCONFIG", raising=False)
    runner = get_runner("cfgtest", local_root=str(tmp_path / "state"))
    info = runner.dryrun_component("utils.booth", [], "local_cwd")
    assert info.app is not None
    args = info.app.roles[0].args
    assert args[2:] == [
        "--x1",
        "1.5",
        "--x2",
        "2.0",
        "--trial_idx",
        "0",
        "--tracker_base",
        "/tmp/b",
    ]


def test_image_is_torchx_default() -> None:
    """asynctorchx.IMAGE is torchx.IMAGE of TorchX 0.7."""
    done = run_in_torchx("print(torchx.IMAGE)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == asynctorchx.IMAGE


def test_entry_point_clash_between_groups_prefers_ours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A name in both asynctorchx.components and torchx.components: ours wins, with a warning."""
    site = tmp_path / "site"
    (site / "clashplug").mkdir(parents=True)
    (site / "clashplug" / "__init__.py").write_text("")
    for mod, name in (("a", "ours"), ("b", "theirs")):
        (site / "clashplug" / f"{mod}.py").write_text(
            textwrap.dedent(
                f'''
                from asynctorchx.specs import AppDef, Role


                def comp() -> AppDef:
                    """c."""
                    return AppDef("{name}", [Role("r", "img", "echo")])
                '''
            )
        )
    dist = site / "clashplug-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: clashplug\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[asynctorchx.components]\nclash = clashplug.a\n[torchx.components]\nclash = clashplug.b\n"
    )
    monkeypatch.syspath_prepend(str(site))
    clear_cache()
    try:
        with caplog.at_level("WARNING"):
            assert build("clash.comp", []).name == "ours"
        assert any(
            "clash = clashplug.b in group 'torchx.components'" in r.getMessage()
            for r in caplog.records
        )
    finally:
        clear_cache()
        for mod in [m for m in sys.modules if m.startswith("clashplug")]:
            del sys.modules[mod]


def test_shim_errors_are_attribute_and_import_errors() -> None:
    """Missing TorchX names are AttributeError/ModuleNotFoundError so probes in files keep working."""
    from asynctorchx.components._torchx_shim import scoped_builtins

    scoped, missing = scoped_builtins()
    top = scoped["__import__"]("torchx.specs", fromlist=("AppDef",))
    assert top.AppDef is AppDef
    assert not hasattr(top, "Workspace")
    with pytest.raises(ModuleNotFoundError):
        scoped["__import__"]("torchx.runner")
    assert missing == ["torchx.specs.Workspace", "torchx.runner"]


def test_component_validation_exception_is_raised_for_files_needing_torchx_elsewhere(
    tmp_path: Path,
) -> None:
    """A helper module the file imports is not redirected: the error says only the file is."""
    (tmp_path / "helper_needing_torchx.py").write_text("import torchx.specs\n")
    (tmp_path / "comp.py").write_text(
        textwrap.dedent(
            '''
            import sys
            sys.path.insert(0, __file__.rsplit("/", 1)[0])
            import torchx.specs as specs
            import helper_needing_torchx


            def app() -> specs.AppDef:
                """x."""
                return specs.AppDef("x")
            '''
        )
    )
    with pytest.raises(
        ComponentValidationException, match="only the component file's own imports of torchx"
    ):
        get_component(f"{tmp_path}/comp.py:app")
    sys.modules.pop("helper_needing_torchx", None)
