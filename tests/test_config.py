"""[tool.ddpify] / ddpify.toml: discovery, selection, per-file ignores, excludes, errors."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from ddpify.cli import main
from ddpify.config import ConfigError, MigrateConfig, find_config, load_config

DP_SCRIPT = "import torch\nmodel = torch.nn.DataParallel(torch.nn.Linear(2, 2))\n"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def findings(capsys, *argv) -> tuple[int, list[str], str]:
    """Exit code, `path:CODE` of each finding (paths relative to the cwd), stderr."""
    code = main(["check", "--output-format", "json-lines", *argv])
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    return code, sorted(f"{Path(r['filename']).as_posix()}:{r['code']}" for r in rows), err


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "train.py", DP_SCRIPT)
    write(tmp_path / "tests" / "test_train.py", DP_SCRIPT)
    write(tmp_path / "tools" / "legacy" / "old.py", DP_SCRIPT)
    return tmp_path


def test_per_file_ignores(capsys, project):
    write(
        project / "pyproject.toml",
        """
        [project]
        name = "demo"

        [tool.ddpify]
        select = ["DDP070"]
        per-file-ignores = { "tests/*" = ["DDP07"], "old.py" = ["DDP070"] }
        """,
    )
    code, found, _ = findings(capsys, ".")
    assert code == 1
    assert found == ["train.py:DDP070"]


def test_nearest_config_wins_and_pyproject_without_our_table_is_skipped(capsys, project):
    write(project / "pyproject.toml", '[tool.ddpify]\nignore = ["DDP070"]\n')
    # tools/ has a pyproject.toml without [tool.ddpify]: not ours, keep looking upwards.
    write(project / "tools" / "pyproject.toml", '[project]\nname = "tools"\n')
    # tools/legacy/ has its own ddpify.toml: nearest, so it wins there.
    write(project / "tools" / "legacy" / "ddpify.toml", 'select = ["DDP070"]\n')

    assert find_config(project / "tools" / "x.py") == project / "pyproject.toml"
    assert find_config(project / "tools" / "legacy") == project / "tools" / "legacy" / "ddpify.toml"
    code, found, _ = findings(capsys, "tools/legacy/old.py")
    assert (code, found) == (1, ["tools/legacy/old.py:DDP070"])
    code, found, _ = findings(capsys, "train.py")
    assert (code, found) == (0, [])


def test_config_flag_and_isolated(capsys, project):
    write(project / "pyproject.toml", '[tool.ddpify]\nignore = ["DDP070"]\n')
    write(project / "strict.toml", 'select = ["DDP070"]\n')
    assert findings(capsys, "train.py")[1] == []
    assert findings(capsys, "train.py", "--isolated")[1] == ["train.py:DDP070"]
    assert findings(capsys, "train.py", "--config", "strict.toml")[1] == ["train.py:DDP070"]


def test_command_line_selection_on_top_of_the_file(capsys, project):
    write(project / "pyproject.toml", '[tool.ddpify]\nselect = ["DDP001"]\n')
    assert "train.py:DDP070" not in findings(capsys, "train.py")[1]
    assert findings(capsys, "train.py", "--select", "DDP070")[1] == ["train.py:DDP070"]
    assert "train.py:DDP070" in findings(capsys, "train.py", "--extend-select", "DDP070")[1]


def test_exclude_and_extend_exclude(capsys, project):
    write(
        project / "pyproject.toml",
        """
        [tool.ddpify]
        select = ["DDP070"]
        exclude = ["tests"]
        extend-exclude = ["tools/legacy"]
        """,
    )
    assert findings(capsys, ".")[1] == ["train.py:DDP070"]
    # Files named explicitly (as pre-commit passes them) are excluded too.
    assert findings(capsys, "tests/test_train.py", "train.py")[1] == ["train.py:DDP070"]


def test_migrate_defaults_are_read_and_validated(project):
    write(
        project / "pyproject.toml",
        """
        [tool.ddpify.migrate]
        batch-policy = "global"
        lr-scaling = "sqrt"
        amp = "off"
        sync-bn = false
        """,
    )
    migrate = load_config(start=project).migrate
    assert migrate == MigrateConfig(
        batch_policy="global", lr_scaling="sqrt", amp="off", sync_bn=False
    )
    assert load_config(isolated=True).migrate.as_dict() == {}


@pytest.mark.parametrize(
    ("table", "named"),
    [
        ('selct = ["DDP070"]', "`tool.ddpify.selct` is not a known setting"),
        ("per_file_ignores = {}", "did you mean `per-file-ignores`?"),
        ('select = "DDP070"', "`tool.ddpify.select` must be a list of strings"),
        ('ignore = ["DDP999"]', "`tool.ddpify.ignore` has an unknown rule selector 'DDP999'"),
        ('per-file-ignores = { "a.py" = ["XYZ1"] }', "per-file-ignores.'a.py'"),
        ('per-file-ignores = ["a.py"]', "`tool.ddpify.per-file-ignores` must be a table"),
        ('unsafe-fixes = "yes"', "`tool.ddpify.unsafe-fixes` must be true or false"),
        ("exclude = [1]", "`tool.ddpify.exclude` must be a list of strings"),
        ('[tool.ddpify.migrate]\namp = "fp8"', "`tool.ddpify.migrate.amp` must be one of"),
        ('[tool.ddpify.migrate]\nbatch-policy = "all"', "`tool.ddpify.migrate.batch-policy`"),
        ('[tool.ddpify.migrate]\nsync-bn = "no"', "`tool.ddpify.migrate.sync-bn` must be true"),
        ("[tool.ddpify.migrate]\nworld-size = 8", "`tool.ddpify.migrate.world-size` is not"),
    ],
)
def test_bad_settings_are_errors_naming_the_key(capsys, project, table, named):
    write(project / "pyproject.toml", "[tool.ddpify]\n" + table + "\n")
    with pytest.raises(ConfigError) as raised:
        load_config(start=project)
    assert named in str(raised.value)
    assert str(project / "pyproject.toml") in str(raised.value)
    code, _, err = findings(capsys, "train.py")
    assert code == 2
    assert named in err and "Traceback" not in err


def test_broken_toml_and_missing_config_file(capsys, project):
    write(project / "ddpify.toml", "select = [\n")
    code, _, err = findings(capsys, "train.py")
    assert code == 2 and "invalid TOML" in err
    code, _, err = findings(capsys, "train.py", "--config", "nowhere.toml")
    assert code == 2 and "nowhere.toml: no such configuration file" in err


def test_config_and_isolated_exclude_each_other(capsys, project):
    with pytest.raises(SystemExit) as raised:
        main(["check", "--config", "x.toml", "--isolated", "."])
    assert raised.value.code == 2
    assert "not allowed with" in capsys.readouterr().err
