"""Real pre-commit runs against a snapshot of this checkout.

pre-commit builds the hook's own virtualenv and pip-installs ddpify into it (core
dependencies only: a test proves torch is not pulled in), which takes about a minute.
`pre-commit try-repo` does that in a throw-away store on every call, so it is used once;
the other tests point a `.pre-commit-config.yaml` at the same snapshot and share one
PRE_COMMIT_HOME, so the environment is built once for them all.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ddpify.rules import RULES_BY_CODE

pytest.importorskip("pre_commit", reason="pre-commit is not installed (the `dev` extra)")
# One worker runs them all, so the hook environment in `hooks` is built once, not per worker.
pytestmark = pytest.mark.xdist_group("precommit")

ROOT = Path(__file__).resolve().parent.parent
GIT = [
    "git",
    "-c",
    "user.name=ddpify tests",
    "-c",
    "user.email=tests@ddpify.invalid",
    "-c",
    "commit.gpgsign=false",
    "-c",
    "init.defaultBranch=main",
]

BAD = "import torch\n\nmodel = torch.nn.DataParallel(torch.nn.Linear(4, 2))\n"
CLEAN = "import torch\n\nmodel = torch.nn.Linear(4, 2)\n"
LEGACY_AMP = "import torch\n\nscaler = torch.cuda.amp.GradScaler()  # fp16 scaler\n"


def git(cwd: Path, *args: str) -> str:
    return subprocess.run([*GIT, *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def snapshot_checkout(dest: Path) -> Path:
    """This checkout's files as they are now (tracked and untracked, not ignored),
    committed in a fresh repository: what `pre-commit try-repo` would install."""
    try:
        listed = git(ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("the checkout is not a git repository")
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    git(dest, "init", "-q")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", "snapshot")
    return dest


def _env(home: Path) -> dict[str, str]:
    env = {**os.environ, "PRE_COMMIT_HOME": str(home), "PRE_COMMIT_COLOR": "never"}
    env.pop("PRE_COMMIT", None)
    return env


def try_repo(project: Path, source: Path, home: Path, hook: str, *files: str):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pre_commit",
            "try-repo",
            str(source),
            hook,
            "--verbose",
            "--files",
            *files,
        ],
        cwd=project,
        env=_env(home),
        capture_output=True,
        text=True,
        timeout=900,
    )


def pre_commit(project: Path, source: Path, home: Path, hook: str, *files: str):
    """`pre-commit run HOOK --files ...` with the project's config naming the snapshot."""
    rev = git(source, "rev-parse", "HEAD").strip()
    (project / ".pre-commit-config.yaml").write_text(
        f"repos:\n  - repo: {source}\n    rev: {rev}\n"
        "    hooks:\n      - id: ddpify-check\n      - id: ddpify-fix\n"
    )
    git(project, "add", ".pre-commit-config.yaml")
    return subprocess.run(
        [sys.executable, "-m", "pre_commit", "run", hook, "--verbose", "--files", *files],
        cwd=project,
        env=_env(home),
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.fixture(scope="module")
def hooks(tmp_path_factory):
    """(snapshot of ddpify, PRE_COMMIT_HOME), shared so the hook env is built once."""
    base = tmp_path_factory.mktemp("precommit")
    source = snapshot_checkout(base / "ddpify-src")
    return source, base / "home"


@pytest.fixture
def project(tmp_path):
    repo = tmp_path / "project"
    repo.mkdir()
    git(repo, "init", "-q")
    return repo


def add(repo: Path, files: dict[str, str]) -> list[str]:
    for name, text in files.items():
        path = repo / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    git(repo, "add", "-A")
    return list(files)


def test_try_repo_bad_script_fails_with_the_diagnostics(hooks, project):
    names = add(project, {"train.py": BAD, "ok.py": CLEAN})
    source, _ = hooks
    result = try_repo(project, source, project.parent / "try-home", "ddpify-check", *names)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "ddpify check" in result.stdout and "Failed" in result.stdout
    assert "train.py:3:9: DDP070 " in result.stdout
    assert "ok.py:" not in result.stdout


def test_bad_script_fails_and_clean_script_passes(hooks, project):
    add(project, {"train.py": BAD})
    failed = pre_commit(project, *hooks, "ddpify-check", "train.py")
    assert failed.returncode == 1 and "train.py:3:9: DDP070 " in failed.stdout
    names = add(project, {"ok.py": CLEAN, "notes.txt": "not python\n"})
    result = pre_commit(project, *hooks, "ddpify-check", *names)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Passed" in result.stdout


def test_zero_one_and_many_files(hooks, project):
    many = {f"pkg/mod_{i}.py": (BAD if i % 3 == 0 else CLEAN) for i in range(7)}
    names = add(project, {**many, "README.md": "# demo\n"})
    none = pre_commit(project, *hooks, "ddpify-check", "README.md")
    assert none.returncode == 0 and "no files to check" in none.stdout
    one = pre_commit(project, *hooks, "ddpify-check", "pkg/mod_1.py")
    assert one.returncode == 0
    result = pre_commit(project, *hooks, "ddpify-check", *names)
    assert result.returncode == 1
    flagged = sorted(line.split(":")[0] for line in result.stdout.splitlines() if "DDP070" in line)
    assert flagged == ["pkg/mod_0.py", "pkg/mod_3.py", "pkg/mod_6.py"]


def test_the_hook_respects_the_configuration(hooks, project):
    names = add(
        project,
        {
            "pyproject.toml": '[tool.ddpify]\nper-file-ignores = { "legacy/*" = ["DDP070"] }\n',
            "legacy/old_train.py": BAD,
            "train.py": CLEAN,
        },
    )
    result = pre_commit(project, *hooks, "ddpify-check", *names)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif("DDP043" not in RULES_BY_CODE, reason="the fixable rule DDP043 is absent")
def test_fix_hook_rewrites_and_reports_the_change(hooks, project):
    names = add(project, {"train.py": LEGACY_AMP})
    result = pre_commit(project, *hooks, "ddpify-fix", *names)
    assert result.returncode == 1  # pre-commit fails a hook that modified files
    assert "files were modified by this hook" in result.stdout
    fixed = (project / "train.py").read_text()
    assert "torch.cuda.amp" not in fixed and "# fp16 scaler" in fixed
    git(project, "add", "-A")
    again = pre_commit(project, *hooks, "ddpify-fix", *names)
    assert again.returncode == 0, again.stdout


def test_the_hook_environment_has_no_torch(hooks, project):
    names = add(project, {"ok.py": CLEAN})
    assert pre_commit(project, *hooks, "ddpify-check", *names).returncode == 0
    _, home = hooks
    site_packages = list(home.glob("*/py_env-*/lib/python*/site-packages"))
    assert site_packages, "pre-commit built no python environment"
    for packages in site_packages:
        installed = {p.name.lower() for p in packages.iterdir()}
        assert any(name.startswith("ddpify") for name in installed)
        assert any(name.startswith("libcst") for name in installed)
        assert not any(name == "torch" or name.startswith("torch-") for name in installed)
