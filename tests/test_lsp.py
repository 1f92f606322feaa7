"""A real language-server session over stdio: `python -m ddpify lsp`, spoken to in JSON-RPC.

initialize -> didOpen -> publishDiagnostics -> hover -> codeAction -> apply the edit ->
didChange -> the diagnostic is gone -> fix-all -> didSave -> shutdown.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ddpify.rules import RULES_BY_CODE

pytest.importorskip("pygls", reason="the language server needs the `lsp` extra (pygls)")

TIMEOUT = 60

# The rocket before the finding makes UTF-16 columns differ from code-point columns.
SCRIPT = """\
import torch

model = torch.nn.DataParallel(torch.nn.Linear(4, 2))
tag = "\U0001f680"; scaler = torch.cuda.amp.GradScaler()  # scaler for fp16


def step(batch):
    with torch.cuda.amp.autocast():  # mixed precision
        return model(batch).sum()
"""


class LspClient:
    """A minimal LSP client: Content-Length framing over a subprocess's pipes."""

    def __init__(self, argv: list[str], cwd: Path | None = None) -> None:
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd
        )
        self.inbox: queue.Queue = queue.Queue()
        self.notifications: list[dict] = []
        self.next_id = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        stream = self.proc.stdout
        while True:
            length = None
            while True:
                line = stream.readline()
                if not line:
                    return
                line = line.strip()
                if not line:
                    break
                name, _, value = line.partition(b":")
                if name.lower() == b"content-length":
                    length = int(value)
            self.inbox.put(json.loads(stream.read(length)))

    def _send(self, message: dict) -> None:
        body = json.dumps({"jsonrpc": "2.0", **message}).encode()
        self.proc.stdin.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        self.proc.stdin.flush()

    def notify(self, method: str, params: dict) -> None:
        self._send({"method": method, "params": params})

    def _next(self, deadline: float) -> dict:
        try:
            message = self.inbox.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no message from the server; stderr: {self.stderr()}") from None
        if "method" in message and "id" in message:  # a request from the server
            self._send({"id": message["id"], "result": None})
        return message

    def request(self, method: str, params: dict | None) -> object:
        self.next_id += 1
        self._send({"id": self.next_id, "method": method, "params": params})
        deadline = time.monotonic() + TIMEOUT
        while True:
            message = self._next(deadline)
            if message.get("id") == self.next_id and "method" not in message:
                assert "error" not in message, message["error"]
                return message.get("result")
            if "method" in message and "id" not in message:
                self.notifications.append(message)

    def wait_for(self, method: str, predicate=lambda params: True) -> dict:
        """The first (earlier or next) notification of `method` whose params match."""
        for index, message in enumerate(self.notifications):
            if message["method"] == method and predicate(message["params"]):
                return self.notifications.pop(index)["params"]
        deadline = time.monotonic() + TIMEOUT
        while True:
            message = self._next(deadline)
            if message.get("method") == method and predicate(message["params"]):
                return message["params"]
            if "method" in message and "id" not in message:
                self.notifications.append(message)

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        return self.proc.stderr.read().decode(errors="replace")

    def close(self) -> int:
        try:
            self.request("shutdown", None)
            self.notify("exit", None)
            return self.proc.wait(timeout=TIMEOUT)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def start_server(root: Path, resolve_edits: bool = True) -> LspClient:
    client = LspClient([sys.executable, "-m", "ddpify", "lsp"], cwd=root)
    code_action: dict = {
        "codeActionLiteralSupport": {"codeActionKind": {"valueSet": ["quickfix", "source.fixAll"]}}
    }
    if resolve_edits:
        code_action["resolveSupport"] = {"properties": ["edit"]}
    client.request(
        "initialize",
        {
            "processId": None,
            "rootUri": root.as_uri(),
            "capabilities": {
                "general": {"positionEncodings": ["utf-16"]},
                "textDocument": {
                    "publishDiagnostics": {},
                    "hover": {"contentFormat": ["markdown", "plaintext"]},
                    "codeAction": code_action,
                },
            },
        },
    )
    client.notify("initialized", {})
    return client


def _offset(text: str, position: dict) -> int:
    """A UTF-16 LSP position -> an index into `text`."""
    lines = text.splitlines(keepends=True)
    start = sum(len(line) for line in lines[: position["line"]])
    line = lines[position["line"]] if position["line"] < len(lines) else ""
    units = index = 0
    while index < len(line) and units < position["character"]:
        units += 2 if ord(line[index]) > 0xFFFF else 1
        index += 1
    return start + index


def apply_edits(text: str, edits: list[dict]) -> str:
    spans = sorted(
        (
            (_offset(text, e["range"]["start"]), _offset(text, e["range"]["end"]), e["newText"])
            for e in edits
        ),
        reverse=True,
    )
    for start, end, new in spans:
        text = text[:start] + new + text[end:]
    return text


def by_code(params: dict, code: str) -> list[dict]:
    return [d for d in params["diagnostics"] if d["code"] == code]


@pytest.fixture
def session(tmp_path):
    (tmp_path / "ddpify.toml").write_text('select = ["DDP043", "DDP070"]\n')
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    client = start_server(tmp_path)
    yield client, path.as_uri()
    assert client.close() == 0


def test_diagnostics_on_open_and_hover_shows_the_rule_page(session):
    client, uri = session
    client.notify(
        "textDocument/didOpen",
        {"textDocument": {"uri": uri, "languageId": "python", "version": 1, "text": SCRIPT}},
    )
    published = client.wait_for("textDocument/publishDiagnostics", lambda p: p["uri"] == uri)
    [dp] = by_code(published, "DDP070")
    assert dp["range"] == {
        "start": {"line": 2, "character": 8},
        "end": {"line": 2, "character": 29},
    }
    assert dp["severity"] == 2 and dp["source"] == "ddpify"
    assert dp["codeDescription"]["href"].endswith("/rules/DDP070.md")

    hover = client.request(
        "textDocument/hover",
        {"textDocument": {"uri": uri}, "position": {"line": 2, "character": 12}},
    )
    assert hover["contents"]["kind"] == "markdown"
    assert hover["contents"]["value"].startswith("# DDP070 dataparallel-usage")
    assert "## Use instead" in hover["contents"]["value"]
    nothing = client.request(
        "textDocument/hover",
        {"textDocument": {"uri": uri}, "position": {"line": 0, "character": 0}},
    )
    assert nothing is None


@pytest.mark.skipif("DDP043" not in RULES_BY_CODE, reason="the fixable rule DDP043 is absent")
def test_code_action_fixes_and_the_diagnostic_goes(session):
    client, uri = session
    client.notify(
        "textDocument/didOpen",
        {"textDocument": {"uri": uri, "languageId": "python", "version": 1, "text": SCRIPT}},
    )
    published = client.wait_for("textDocument/publishDiagnostics", lambda p: p["uri"] == uri)
    amp = by_code(published, "DDP043")
    assert len(amp) == 2
    scaler = next(d for d in amp if d["range"]["start"]["line"] == 3)
    # After `tag = "<rocket>"; ` : 19 code points, 20 UTF-16 units.
    assert scaler["range"]["start"]["character"] == SCRIPT.splitlines()[3].index("torch") + 1

    actions = client.request(
        "textDocument/codeAction",
        {
            "textDocument": {"uri": uri},
            "range": scaler["range"],
            "context": {"diagnostics": [scaler], "only": ["quickfix"]},
        },
    )
    [action] = actions
    assert action["kind"] == "quickfix" and action["isPreferred"] is True
    assert action["diagnostics"][0]["code"] == "DDP043"
    text = apply_edits(SCRIPT, action["edit"]["changes"][uri])
    assert 'tag = "\U0001f680"; scaler = torch.amp.GradScaler' in text
    assert "# scaler for fp16" in text

    client.notify(
        "textDocument/didChange",
        {
            "textDocument": {"uri": uri, "version": 2},
            "contentChanges": [{"text": text}],
        },
    )
    after = client.wait_for(
        "textDocument/publishDiagnostics",
        lambda p: p["uri"] == uri and len(by_code(p, "DDP043")) < 2,
    )
    remaining = by_code(after, "DDP043")
    assert [d["range"]["start"]["line"] for d in remaining] == [7]
    assert len(by_code(after, "DDP070")) == 1

    # The fix-all source action clears the rest in one edit.
    [fix_all] = client.request(
        "textDocument/codeAction",
        {
            "textDocument": {"uri": uri},
            "range": {"start": {"line": 0, "character": 0}, "end": {"line": 0, "character": 0}},
            "context": {"diagnostics": [], "only": ["source.fixAll"]},
        },
    )
    assert fix_all["kind"] == "source.fixAll.ddpify"
    assert "edit" not in fix_all  # computed when the user picks it
    fix_all = client.request("codeAction/resolve", fix_all)
    text = apply_edits(text, fix_all["edit"]["changes"][uri])
    compile(text, "train.py", "exec")
    assert "torch.cuda.amp" not in text and "# mixed precision" in text
    client.notify(
        "textDocument/didChange",
        {"textDocument": {"uri": uri, "version": 3}, "contentChanges": [{"text": text}]},
    )
    client.wait_for(
        "textDocument/publishDiagnostics",
        lambda p: p["uri"] == uri and not by_code(p, "DDP043"),
    )
    client.notify("textDocument/didSave", {"textDocument": {"uri": uri}})
    saved = client.wait_for("textDocument/publishDiagnostics", lambda p: p["uri"] == uri)
    assert [d["code"] for d in saved["diagnostics"]] == ["DDP070"]


@pytest.mark.skipif("DDP043" not in RULES_BY_CODE, reason="the fixable rule DDP043 is absent")
def test_fix_all_comes_with_its_edit_for_clients_that_cannot_resolve(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    client = start_server(tmp_path, resolve_edits=False)
    uri = path.as_uri()
    client.notify(
        "textDocument/didOpen",
        {"textDocument": {"uri": uri, "languageId": "python", "version": 1, "text": SCRIPT}},
    )
    [fix_all] = client.request(
        "textDocument/codeAction",
        {
            "textDocument": {"uri": uri},
            "range": {"start": {"line": 0, "character": 0}, "end": {"line": 0, "character": 0}},
            "context": {"diagnostics": [], "only": ["source.fixAll"]},
        },
    )
    fixed = apply_edits(SCRIPT, fix_all["edit"]["changes"][uri])
    assert "torch.cuda.amp" not in fixed and "# mixed precision" in fixed
    assert client.close() == 0


def test_missing_pygls_is_a_clear_error(tmp_path):
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'pygls':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from ddpify.cli import main\n"
        "sys.exit(main(['lsp']))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", blocker], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert result.returncode == 2
    assert "pip install 'ddpify[lsp]'" in result.stderr
    assert "Traceback" not in result.stderr


BUGGY = Path(__file__).resolve().parent.parent / "fixtures" / "examples" / "buggy_train.py"


def _edits_of_a_session(text: str) -> list[str]:
    """What typing in a real script looks like: texts after each keystroke-sized edit."""
    steps = []
    text = text.replace("    scaler = torch.cuda.amp.GradScaler()\n", "")  # delete a line
    steps.append(text)
    update = "            scaler.update()\n"
    text = text.replace(update, update + "            # note\n")
    steps.append(text)
    text = text.replace("dist.barrier()", "dist.barrier(")
    steps.append(text)  # a syntax error while typing
    text = text.replace("dist.barrier(\n", "dist.barrier()\n")
    steps.append(text)
    text = text.replace("class ConvNet", "LOG_EVERY = 10\n\n\nclass ConvNet")  # a new statement
    steps.append(text)
    text = text.replace(
        '        print(f"epoch', '        torch.save(model, "last.pt")\n        print(f"epoch'
    )
    steps.append(text)
    text = text.replace('"nccl"', '"gloo"') + "\n# the end\n"  # two places at once
    steps.append(text)
    return steps


def test_diagnostics_after_edits_match_a_cold_check_of_the_same_text(tmp_path):
    """The server re-parses only what each edit changed; what it publishes must be what
    `ddpify check` says about the same text, after every edit."""
    from ddpify import engine
    from ddpify.config import load_config

    path = tmp_path / "train.py"
    text = BUGGY.read_text()
    path.write_text(text)
    config = load_config(start=tmp_path)

    def cold(text: str) -> list[tuple]:
        found = engine.check_source(text, str(path), config.rules(), force=True).diagnostics
        return sorted(
            (d.code, d.location.row - 1, d.location.column - 1, d.end_location.row - 1, d.message)
            for d in config.filter(found, str(path))
        )

    def published(params: dict) -> list[tuple]:
        return sorted(
            (
                d["code"],
                d["range"]["start"]["line"],
                d["range"]["start"]["character"],
                d["range"]["end"]["line"],
                d["message"],
            )
            for d in params["diagnostics"]
        )

    client = start_server(tmp_path)
    uri = path.as_uri()
    client.notify(
        "textDocument/didOpen",
        {"textDocument": {"uri": uri, "languageId": "python", "version": 1, "text": text}},
    )
    first = client.wait_for("textDocument/publishDiagnostics", lambda p: p["uri"] == uri)
    assert published(first) == cold(text) and len(first["diagnostics"]) >= 5
    seen_codes = set()
    for version, edited in enumerate(_edits_of_a_session(text), start=2):
        client.notify(
            "textDocument/didChange",
            {
                "textDocument": {"uri": uri, "version": version},
                "contentChanges": [{"text": edited}],
            },
        )
        params = client.wait_for("textDocument/publishDiagnostics", lambda p: p["uri"] == uri)
        assert published(params) == cold(edited), f"after edit {version - 1}"
        seen_codes |= {d["code"] for d in params["diagnostics"]}
    assert "DDP000" in seen_codes  # the syntax error was reported, then went away
    assert "DDP000" not in {d["code"] for d in params["diagnostics"]}
    assert client.close() == 0
