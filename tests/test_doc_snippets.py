"""What the README, docs/ and the help texts show must work when copied."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from ddpify.cli import build_parser, main
from ddpify.commands import check as check_command
from ddpify.commands import migrate as migrate_command
from ddpify.commands import verify as verify_command
from ddpify.config import load_config

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"ddpify (?:check|migrate|verify|rule|lsp)\b.*")
# A code-block line that runs ddpify: at its start, after a `$ ` prompt, a YAML `- run:`,
# or as a JSON "command".
SHELL_LINE = re.compile(r'^\s*(?:\$\s+|-\s+run:\s+|"command":\s*")?(ddpify \w.*)')
# Where a shell line stops being the command: a comment, a redirection, a pipe, the end
# of a JSON string.
COMMAND_END = re.compile(r"\s+#.*|\s*[<|>].*|\".*")


def _blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S)


def _commands() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for _, body in _blocks(text):
            for line in body.splitlines():
                match = SHELL_LINE.match(line.replace("<path>", "train.py"))
                if match and COMMAND.match(match.group(1)):
                    found.append((doc.name, COMMAND_END.sub("", match.group(1)).strip()))
        for span in re.findall(r"`(ddpify [^`]+)`", text):
            if len(span.split()) > 2 or span.split()[1] in ("check", "lsp"):  # not just a name
                found.append((doc.name, COMMAND_END.sub("", span.replace("<path>", "train.py"))))
    for module in (check_command, migrate_command, verify_command):
        for line in module.EXAMPLES.splitlines():
            if line.strip().startswith("ddpify "):
                command = re.split(r"\s{2,}", line.strip())[0]  # drop the explanation
                found.append((f"{module.__name__} --help", COMMAND_END.sub("", command)))
    return sorted(set(found))


COMMANDS = _commands()


def test_the_docs_show_commands_of_every_kind():
    shown = {command.split()[1] for _, command in COMMANDS}
    assert {"check", "migrate", "verify", "rule", "lsp"} <= shown


@pytest.mark.parametrize("where, command", COMMANDS)
def test_every_shown_command_parses(where, command):
    argv = shlex.split(command)[1:]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse reports the problem on stderr
        pytest.fail(f"{where}: `{command}` does not parse (exit {exc.code})")
    if args.command == "migrate":
        migrate_command._split_rest(args)  # the options given after SCRIPT


def test_the_shipped_example_runs_as_the_readme_shows(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    blocks = _blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    shown = next(body for _, body in blocks if "$ ddpify check" in body).splitlines()
    argv = shlex.split(shown[0].lstrip("$ "))[1:]
    code = main([*argv, "--no-cache"])
    out = capsys.readouterr().out.splitlines()
    assert code == 1
    findings = [line for line in shown[1:] if line.startswith("fixtures/")]
    assert findings and all(line in out for line in findings)
    assert shown[-1] == out[-1]  # the summary line


def _toml_snippets() -> list[tuple[str, str]]:
    return [
        (doc.name, body)
        for doc in DOCS
        for lang, body in _blocks(doc.read_text(encoding="utf-8"))
        if lang == "toml"
    ]


@pytest.mark.parametrize("where, snippet", _toml_snippets())
def test_every_configuration_snippet_works_when_copied(where, snippet, tmp_path, capsys):
    name = "pyproject.toml" if "[tool.ddpify" in snippet else "ddpify.toml"
    (tmp_path / name).write_text(snippet, encoding="utf-8")
    script = tmp_path / "train.py"
    script.write_text("import torch\nmodel = torch.nn.DataParallel(torch.nn.Linear(2, 2))\n")
    config = load_config(start=script)
    assert config.path == tmp_path / name
    config.rules()
    assert main(["check", str(script), "--no-cache"]) in (0, 1), capsys.readouterr().err
    assert main(["migrate", str(script), "--diff"]) in (0, 1), capsys.readouterr().err


def test_every_ignore_example_ignores_a_rule_that_is_on_by_default():
    from ddpify.rules import select_rules

    default = {rule.CODE for rule in select_rules(None, [], [])}
    examples = [
        (where, command.split("--ignore ", 1)[1].split()[0])
        for where, command in COMMANDS
        if "--ignore " in command
    ]
    assert examples
    for where, selector in examples:
        assert any(code.startswith(selector) for code in default), (where, selector)
