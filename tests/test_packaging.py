"""The wheel users install: rule pages inside, torch only behind the `verify` extra."""

from __future__ import annotations

import email
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ddpify.rules import ALL_RULES

ROOT = Path(__file__).resolve().parent.parent
# One worker runs them all, so the wheel is built once, not per worker.
pytestmark = pytest.mark.xdist_group("packaging")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    [path] = out.glob("ddpify-*.whl")
    return zipfile.ZipFile(path)


def test_rule_pages_ship_in_the_wheel(wheel):
    names = set(wheel.namelist())
    for rule in ALL_RULES:
        assert f"ddpify/_rule_docs/{rule.CODE}.md" in names


def test_core_install_does_not_require_torch(wheel):
    [metadata_name] = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    metadata = email.message_from_bytes(wheel.read(metadata_name))
    requires = metadata.get_all("Requires-Dist")
    core = [r for r in requires if "extra ==" not in r]
    assert not any(r.startswith("torch") for r in core), core
    verify = [r.replace('"', "'") for r in requires if r.startswith("torch")]
    assert any("extra == 'verify'" in r for r in verify)
    assert {r.split(">")[0].split(";")[0].strip() for r in core} >= {"libcst", "rich"}
