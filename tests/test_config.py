""".torchxconfig: where it is read from, precedence, typed run options, sections and warnings."""

from __future__ import annotations

import io
import textwrap
from pathlib import Path

import pytest

from asynctorchx.components import get_component
from asynctorchx.runner.config import (
    ConfigFileError,
    apply,
    dump,
    find_configs,
    get_config,
    get_configs,
    load_sections,
)
from asynctorchx.specs import InvalidRunConfigException, UnknownSchedulerException, runopts
from asynctorchx.specs.builders import materialize_appdef
from asynctorchx.specs.errors import ConfigWarning


def opts() -> runopts:
    o = runopts()
    o.add("log_dir", str, "where logs go", default="/tmp/logs")
    o.add("max_workers", int, "concurrency", default=4)
    o.add("auto_set_cuda_visible_devices", bool, "set CUDA_VISIBLE_DEVICES", default=False)
    o.add("extra_paths", list[str], "paths to prepend", default=None)
    o.add("labels", dict[str, str], "labels", default=None)
    o.add("memMB", int, "memory (case-sensitive key)", default=None)
    o.add("queue", str, "the queue", required=True)
    return o


@pytest.fixture
def homes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """An empty HOME and an empty project directory (the CWD), with TORCHXCONFIG unset."""
    home, project = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    project.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(project)
    monkeypatch.delenv("TORCHXCONFIG", raising=False)
    return home, project


def write(directory: Path, text: str) -> Path:
    path = directory / ".torchxconfig"
    path.write_text(textwrap.dedent(text))
    return path


def test_no_config_files(homes: tuple[Path, Path]):
    """Without config files, apply leaves the cfg as it is and no sections are found."""
    cfg: dict[str, object] = {"queue": "q"}
    assert apply("local_cwd", cfg, run_opts=opts()) == {"queue": "q"}
    assert find_configs() == [] and load_sections("component") == {}


def test_values_are_typed_by_the_run_options(homes: tuple[Path, Path]):
    """Values are cast by the scheduler's runopt types, exactly like -cfg strings; keys keep their case."""
    _, project = homes
    write(
        project,
        """
        [local_cwd]
        log_dir = /var/log/jobs
        max_workers = 8
        auto_set_cuda_visible_devices = true
        extra_paths = /a;/b
        labels = team:ml;env:dev
        memMB = 2048
        """,
    )
    cfg = apply("local_cwd", {}, run_opts=opts())
    assert cfg == {
        "log_dir": "/var/log/jobs",
        "max_workers": 8,
        "auto_set_cuda_visible_devices": True,
        "extra_paths": ["/a", "/b"],
        "labels": {"team": "ml", "env": "dev"},
        "memMB": 2048,
    }


def test_precedence_explicit_then_project_then_home(homes: tuple[Path, Path]):
    """Explicit cfg beats the project's .torchxconfig, which beats the one in HOME; defaults stay unset."""
    home, project = homes
    write(home, "[local_cwd]\nlog_dir = /home-logs\nmax_workers = 1\nqueue = home-q\n")
    write(project, "[local_cwd]\nlog_dir = /project-logs\nmax_workers = 2\n")
    cfg = apply("local_cwd", {"max_workers": 99}, run_opts=opts())
    assert cfg == {"max_workers": 99, "log_dir": "/project-logs", "queue": "home-q"}
    assert opts().resolve(cfg)["auto_set_cuda_visible_devices"] is False
    assert find_configs() == [project / ".torchxconfig", home / ".torchxconfig"]


def test_dirs_are_read_first_wins(tmp_path: Path, homes: tuple[Path, Path]):
    """Explicit dirs replace the defaults; the first directory's values win."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    write(first, "[local_cwd]\nlog_dir = /first\n")
    write(second, "[local_cwd]\nlog_dir = /second\nmax_workers = 3\n")
    cfg = apply("local_cwd", {}, dirs=[first, second, tmp_path / "missing"], run_opts=opts())
    assert cfg == {"log_dir": "/first", "max_workers": 3}


def test_torchxconfig_env_var_names_the_only_file(
    tmp_path: Path, homes: tuple[Path, Path], monkeypatch
):
    """TORCHXCONFIG names the one file read; the project and HOME files are then ignored."""
    _, project = homes
    write(project, "[local_cwd]\nlog_dir = /project\nmax_workers = 2\n")
    named = tmp_path / "custom.ini"
    named.write_text("[local_cwd]\nlog_dir = /custom\n")
    monkeypatch.setenv("TORCHXCONFIG", str(named))
    assert apply("local_cwd", {}, run_opts=opts()) == {"log_dir": "/custom"}
    monkeypatch.setenv("TORCHXCONFIG", "")
    assert find_configs() == []
    monkeypatch.setenv("TORCHXCONFIG", str(tmp_path / "nope.ini"))
    with pytest.raises(FileNotFoundError, match=r"TORCHXCONFIG=.*nope\.ini.* does not exist"):
        find_configs()


def test_none_unsets_a_run_option(homes: tuple[Path, Path]):
    """A value of None sets the option to None (its default applies) and hides lower files' values."""
    home, project = homes
    write(home, "[local_cwd]\nlog_dir = /home-logs\n")
    write(project, "[local_cwd]\nlog_dir = None\n")
    cfg = apply("local_cwd", {}, run_opts=opts())
    assert cfg == {"log_dir": None}
    assert opts().resolve({**cfg, "queue": "q"})["log_dir"] == "/tmp/logs"


def test_unknown_key_warns_and_is_ignored(homes: tuple[Path, Path]):
    """A key that is not a run option gives a ConfigWarning naming file, section, key and a close match."""
    _, project = homes
    path = write(project, "[local_cwd]\nlog_dri = /x\nmax_workers = 2\n")
    with pytest.warns(ConfigWarning) as record:
        cfg = apply("local_cwd", {}, run_opts=opts())
    assert cfg == {"max_workers": 2}
    message = str(record[0].message)
    assert str(path) in message and "[local_cwd] log_dri = /x" in message
    assert "did you mean 'log_dir'" in message


def test_wrong_type_names_the_run_option_and_type(homes: tuple[Path, Path]):
    """A value that does not cast raises InvalidRunConfigException naming the file, key and type."""
    _, project = homes
    write(project, "[local_cwd]\nmax_workers = many\n")
    with pytest.raises(
        InvalidRunConfigException,
        match=r"\.torchxconfig \[local_cwd\]: run option 'max_workers' must be of type int, got 'many'",
    ):
        apply("local_cwd", {}, run_opts=opts())


def test_malformed_file_names_file_and_line(homes: tuple[Path, Path]):
    """An invalid INI file raises ConfigFileError naming the file and the line."""
    _, project = homes
    write(project, "[local_cwd]\nlog_dir = /a\nlog_dir = /b\n")
    with pytest.raises(ConfigFileError, match=r"\.torchxconfig.*line\s+3.*'log_dir'"):
        apply("local_cwd", {}, run_opts=opts())


def test_non_utf8_file_names_file_and_byte(homes: tuple[Path, Path]):
    """A config file that is not UTF-8 raises ConfigFileError naming the file and the bad byte."""
    _, project = homes
    (project / ".torchxconfig").write_bytes(b"[local_cwd]\nlog_dir = /a\xff\n")
    with pytest.raises(ConfigFileError, match=r"\.torchxconfig' line 2 is not UTF-8 .*xff"):
        apply("local_cwd", {}, run_opts=opts())


def test_values_are_interpolated_as_torchx_reads_them(homes: tuple[Path, Path]):
    """As TorchX's ConfigParser(): %(key)s of the section or [DEFAULT], %% a literal %; ${...}
    stays as written."""
    _, project = homes
    write(
        project,
        "[DEFAULT]\nuser = ann\n[local_cwd]\nlog_dir = /logs/%(user)s/100%%/${app_id}\n",
    )
    assert apply("local_cwd", {}, run_opts=opts()) == {"log_dir": "/logs/ann/100%/${app_id}"}


def test_unknown_section_warns(homes: tuple[Path, Path]):
    """A section that is not a scheduler nor [component:...]/[cli:...] gives a ConfigWarning."""
    _, project = homes
    write(
        project,
        "[local_cwdd]\nlog_dir = /x\n[compnent:dist.ddp]\nj = 2\n[cli:run]\nscheduler = local_cwd\n",
    )
    with pytest.warns(ConfigWarning) as record:
        apply("local_cwd", {}, run_opts=opts())
    messages = [str(r.message) for r in record]
    assert any(
        "[local_cwdd] is not a scheduler" in m and "did you mean [local_cwd]" in m for m in messages
    )
    assert any("[compnent:dist.ddp] is ignored" in m for m in messages)
    assert len(messages) == 2


def test_apply_unknown_scheduler(homes: tuple[Path, Path]):
    """apply() for an unregistered scheduler raises UnknownSchedulerException naming the available ones."""
    _, project = homes
    write(project, "[nope]\nx = 1\n")
    with pytest.raises(UnknownSchedulerException, match=r"unknown scheduler 'nope'.*local_cwd"):
        apply("nope", {})


def test_component_and_cli_sections(homes: tuple[Path, Path]):
    """[component:NAME] and [cli:CMD] sections load by name; the project's keys beat HOME's."""
    home, project = homes
    write(home, "[component:dist.ddp]\nj = 4x4\nimage = home-img\n[cli:run]\nscheduler = slurm\n")
    write(project, "[component:dist.ddp]\nj = 2x2\n[component:utils.echo]\nmsg = hi\n")
    assert load_sections("component") == {
        "dist.ddp": {"j": "2x2", "image": "home-img"},
        "utils.echo": {"msg": "hi"},
    }
    assert get_configs("cli", "run") == {"scheduler": "slurm"}
    assert get_config("component", "dist.ddp", "j") == "2x2"
    assert get_config("component", "dist.ddp", "cpu") is None
    assert get_configs("component", "nope") == {}


def test_component_defaults_from_config_precedence(homes: tuple[Path, Path]):
    """[component:NAME] values fill in arguments not given explicitly, over the signature's defaults."""
    _, project = homes
    write(project, "[component:utils.echo]\nmsg = from config\nnum_replicas = 2\n")
    defaults = get_configs("component", "utils.echo")
    echo = get_component("utils.echo").fn
    app = materialize_appdef(echo, [], defaults)
    assert (app.roles[0].args, app.roles[0].num_replicas) == (["from config"], 2)
    app = materialize_appdef(echo, ["--msg", "explicit"], defaults)
    assert (app.roles[0].args, app.roles[0].num_replicas) == (["explicit"], 2)
    assert materialize_appdef(echo, []).roles[0].args == ["hello world"]


def test_unknown_component_default_warns(homes: tuple[Path, Path]):
    """A [component:NAME] key that is not a parameter warns when the component is built."""
    _, project = homes
    write(project, "[component:utils.echo]\nmsgs = hi\n")
    with pytest.warns(
        ConfigWarning,
        match=r"'msgs'.*not a parameter of component 'utils\.echo'.*did you mean 'msg'",
    ):
        materialize_appdef(
            get_component("utils.echo").fn,
            [],
            get_configs("component", "utils.echo"),
            name="utils.echo",
        )


def test_dump_writes_a_template_apply_reads_back(homes: tuple[Path, Path]):
    """dump() writes defaults and FIXME placeholders for required options; the file loads back."""
    _, project = homes
    out = io.StringIO()
    dump(out, ["local_cwd"], run_opts={"local_cwd": opts()})
    text = out.getvalue()
    assert "[local_cwd]" in text and "max_workers = 4" in text
    assert "queue = #FIXME:(str) the queue" in text
    (project / ".torchxconfig").write_text(text.replace("#FIXME:(str) the queue", "default"))
    cfg = apply("local_cwd", {}, run_opts=opts())
    assert cfg["max_workers"] == 4 and cfg["queue"] == "default" and cfg["extra_paths"] is None
    required = io.StringIO()
    dump(required, ["local_cwd"], required_only=True, run_opts={"local_cwd": opts()})
    assert "max_workers" not in required.getvalue() and "queue" in required.getvalue()


def test_fixme_placeholder_is_torchx_format_and_cut_at_60(homes: tuple[Path, Path]) -> None:
    """A required option's placeholder is '#FIXME:(type) help', cut after 60 characters with '...'."""
    from asynctorchx.runner.config import fixme_placeholder

    assert fixme_placeholder(str, "the queue") == "#FIXME:(str) the queue"
    long = fixme_placeholder(list[str], "x" * 100)
    assert long == ("#FIXME:(List[str]) " + "x" * 100)[:60] + "..."


def test_a_placeholder_left_in_the_config_is_an_error(homes: tuple[Path, Path]) -> None:
    """A '#FIXME' value still in .torchxconfig fails naming the file, section and key."""
    _, project = homes
    out = io.StringIO()
    dump(out, ["local_cwd"], required_only=True, run_opts={"local_cwd": opts()})
    (project / ".torchxconfig").write_text(out.getvalue())
    with pytest.raises(
        InvalidRunConfigException,
        match=r"\.torchxconfig \[local_cwd\]: run option 'queue' is still",
    ):
        apply("local_cwd", {}, run_opts=opts())
