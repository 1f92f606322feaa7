"""Modules imported by a computed name (`importlib.import_module("models." + name +
"_model")`): which local modules fit, which one the code's own values pick, and that the
project follows them without importing anything."""

from __future__ import annotations

from pathlib import Path

from ddpify.analysis.project import Project

REGISTRY = """\
import importlib


def find_model_using_name(model_name):
    model_filename = "models." + model_name + "_model"
    modellib = importlib.import_module(model_filename)
    for name, cls in modellib.__dict__.items():
        if name.lower() == model_name + "model":
            return cls


def create_model(opt):
    return find_model_using_name(opt.model)(opt)
"""


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root / "train.py"


def _project(tmp_path: Path, files: dict[str, str]) -> Project:
    base = {
        "models/__init__.py": REGISTRY,
        "models/networks.py": "import torch\n",
        "models/gan_model.py": "class GanModel:\n    pass\n",
        "models/pix_model.py": "class PixModel:\n    pass\n",
        "train.py": "from models import create_model\nfrom options import parse\n"
        "model = create_model(parse())\n",
    }
    return Project.discover([_write(tmp_path, {**base, **files})])


def _names(project: Project, paths) -> list[str]:
    return [project.relative(path) for path in paths]


def _options(default: str) -> str:
    return (
        "import argparse\n\n\ndef parse():\n    parser = argparse.ArgumentParser()\n"
        f"    parser.add_argument('--model', type=str, default={default!r})\n"
        "    return parser.parse_args()\n"
    )


def test_the_option_default_picks_one_of_the_modules_that_fit(tmp_path):
    project = _project(tmp_path, {"options.py": _options("pix")})
    [found] = project.computed
    assert found.pattern == "models.*_model"
    assert _names(project, found.candidates) == ["models/gan_model.py", "models/pix_model.py"]
    assert _names(project, found.chosen) == ["models/pix_model.py"]
    assert "the default of `--model` ('pix')" in found.why
    modules = _names(project, project.modules)
    assert "models/pix_model.py" in modules
    assert "models/gan_model.py" not in modules


def test_a_name_not_known_before_run_time_follows_every_candidate(tmp_path):
    # `--model` has no default: the value comes from the command line only
    options = "import argparse\n\n\ndef parse():\n    p = argparse.ArgumentParser()\n"
    options += "    p.add_argument('--model', required=True)\n    return p.parse_args()\n"
    project = _project(tmp_path, {"options.py": options})
    [found] = project.computed
    assert _names(project, found.chosen) == ["models/gan_model.py", "models/pix_model.py"]
    assert "not known before run time" in found.why
    modules = _names(project, project.modules)
    assert {"models/gan_model.py", "models/pix_model.py"} <= set(modules)


def test_set_defaults_elsewhere_makes_the_default_unknown(tmp_path):
    options = _options("pix").replace(
        "    return parser.parse_args()\n",
        "    parser.set_defaults(model='gan')\n    return parser.parse_args()\n",
    )
    project = _project(tmp_path, {"options.py": options})
    assert len(project.computed[0].chosen) == 2


def test_callers_that_pass_different_values_leave_the_name_unknown(tmp_path):
    train = (
        "from models import find_model_using_name\n"
        "a = find_model_using_name('gan')\nb = find_model_using_name('pix')\n"
    )
    project = _project(tmp_path, {"train.py": train})
    [found] = project.computed
    assert len(found.chosen) == 2 and not found.known


def test_a_function_of_the_same_name_in_another_module_is_not_a_caller(tmp_path):
    # data.find_model_using_name('gan') is another function: only the registry's own
    # caller, through opt.model, counts
    files = {
        "options.py": _options("pix"),
        "data.py": "def find_model_using_name(x):\n    return x\n\n\n"
        "find_model_using_name('gan')\n",
        "train.py": "import data\nfrom models import create_model\nfrom options import parse\n"
        "model = create_model(parse())\n",
    }
    project = _project(tmp_path, files)
    assert _names(project, project.computed[0].chosen) == ["models/pix_model.py"]


def test_fstring_percent_and_format_spellings_resolve_alike(tmp_path):
    for spelling in (
        'f"models.{model_name}_model"',
        '"models.%s_model" % model_name',
        '"models.{}_model".format(model_name)',
    ):
        registry = REGISTRY.replace('"models." + model_name + "_model"', spelling)
        root = tmp_path / str(abs(hash(spelling)))
        files = {"options.py": _options("gan"), "models/__init__.py": registry}
        project = _project(root, files)
        [found] = project.computed
        assert found.pattern == "models.*_model", spelling
        assert _names(project, found.chosen) == ["models/gan_model.py"], spelling


def test_no_local_module_fits_so_nothing_is_followed(tmp_path):
    registry = REGISTRY.replace('"_model"', '"_net"')
    project = _project(tmp_path, {"options.py": _options("pix"), "models/__init__.py": registry})
    [found] = project.computed
    assert found.pattern == "models.*_net"
    assert found.candidates == [] and found.chosen == []
    assert not any(p.name.endswith("_model.py") for p in project.modules)


def test_a_name_with_no_literal_part_is_not_resolved(tmp_path):
    # `import_module(module)`: any module at all, so no candidate is guessed
    registry = (
        "import importlib\n\n\ndef load(module):\n    return importlib.import_module(module)\n"
    )
    project = _project(tmp_path, {"models/__init__.py": registry, "train.py": "import models\n"})
    assert project.computed == []


def test_resolution_reads_the_code_and_never_runs_it(tmp_path):
    marker = tmp_path / "ran"
    files = {
        "options.py": _options("pix"),
        "models/pix_model.py": f"open({str(marker)!r}, 'w').write('x')\n",
    }
    project = _project(tmp_path, files)
    assert "models/pix_model.py" in _names(project, project.modules)
    assert not marker.exists()
