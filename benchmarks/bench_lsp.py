"""Latency of an LSP diagnostic round trip on a 500-line training script.

    python benchmarks/bench_lsp.py [--lines 500] [--edits 30] [--profile]

Starts `python -m ddpify lsp` over stdio, opens a synthetic training script written for
this benchmark, then sends full-text didChange edits and times each until the matching
publishDiagnostics arrives; also times a codeAction request. Prints a table; asserts
nothing.

Two kinds of edit are timed: a comment line appended at the end (the edit this benchmark
has always made), and a changed line in the body of a function in the middle of the
file (typing in the code: the statement around it must be parsed and every rule run).

Beside wall time, the server's CPU time per edit (its process's user + system time over a
series, from /proc, Linux only): on a shared machine it moves much less than wall time.
Fixes are rendered when a code action first asks for them after an edit: the first
codeAction request after an edit is timed apart from the repeated ones.

`--profile`: where the server's time per edit goes instead, measured in this process
(CPU time, median over the edits): the same two edits through the server's own lint
(`DdpifyServer.lint`, without the JSON-RPC), its incremental parse alone, the engine's
walk with no rule, with every rule, and each rule alone (with the facts it shares with
others: the costs of rules overlap).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.test_lsp import start_server  # noqa: E402

HEADER = """\
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

"""

BLOCK = """\
def train_epoch_{i}(model, loader, optimizer, scaler, epoch):
    # one epoch of block {i}
    model.train()
    loader.sampler.set_epoch(epoch)
    total = 0.0
    for step, (x, y) in enumerate(loader):
        optimizer.zero_grad(set_to_none=True)
        with torch.cuda.amp.autocast():
            loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        total += loss.item()
    if dist.get_rank() == 0:
        print(f"epoch {{epoch}} block {i}: {{total:.3f}}")
    return total


"""


def synthetic_script(lines: int) -> str:
    text, i = HEADER, 0
    while text.count("\n") < lines:
        text += BLOCK.format(i=i)
        i += 1
    return "".join(text.splitlines(keepends=True)[:lines])


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process so far (Linux /proc), or None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _median_cpu(run, versions) -> float:
    times = []
    for version in versions:
        start = time.process_time()
        run(version)
        times.append(time.process_time() - start)
    return statistics.median(times)


def profile(lines: int, edits: int) -> None:
    """Where the time of one edit goes, in this process (see the module's docstring)."""
    from ddpify.config import Config

    text = synthetic_script(lines)
    middle = text.rindex("    total = 0.0\n", 0, len(text) // 2)
    kinds = {
        "comment at the end": lambda v: text + f"# edit {v}\n",
        "in a function body": lambda v: f"{text[:middle]}    total = {v}.0\n{text[middle + 16 :]}",
    }
    rules = Config().rules()
    for label, edit in kinds.items():
        _profile_edit(label, text, edit, rules, edits)
    _profile_rules(edit(1), rules)


def _profile_edit(label: str, text: str, edit, rules, edits: int) -> None:
    import libcst as cst

    from ddpify import engine
    from ddpify.guarded import deep
    from ddpify.lsp import DdpifyServer
    from ddpify.reparse import Reparser

    class Buffer(DdpifyServer):  # the server's lint of an in-memory document
        document = text

        def document_text(self, uri: str) -> tuple[str, str]:
            return self.document, "/nonexistent/train.py"

    server = Buffer()
    server.lint("file:///train.py")

    def lint(version: int) -> None:
        server.document = edit(version)
        server.lint("file:///train.py")

    reparser = Reparser()
    reparser.parse(text)
    versions = range(2, 2 + edits)
    total = _median_cpu(lint, versions)
    parse = _median_cpu(lambda v: reparser.parse(edit(v)), versions)
    module = cst.parse_module(edit(1))
    walk = _median_cpu(lambda v: deep(engine.run_rules, module, []), range(edits))
    every = _median_cpu(lambda v: deep(engine.run_rules, module, rules), range(edits))
    ms = lambda s: f"{s * 1000:8.1f}"  # noqa: E731
    print(f"edit: {label}, CPU ms per edit (median)")
    print(f"  {'the server lint (no JSON-RPC)':<40}{ms(total)}")
    print(f"  {'incremental parse':<40}{ms(parse)}")
    print(f"  {'engine walk, no rule':<40}{ms(walk)}")
    print(f"  {'rules (walk with all, less walk alone)':<40}{ms(every - walk)}")
    print(f"  {'the rest (positions, diagnostics, ...)':<40}{ms(total - parse - every)}")


def _profile_rules(text: str, rules) -> None:
    import libcst as cst

    from ddpify import engine
    from ddpify.guarded import deep

    module = cst.parse_module(text)
    walk = _median_cpu(lambda v: deep(engine.run_rules, module, []), range(7))
    alone = {
        rule.CODE: _median_cpu(lambda v, r=rule: deep(engine.run_rules, module, [r]), range(7))
        - walk
        for rule in rules
    }
    top = sorted(alone.items(), key=lambda item: -item[1])[:10]
    shown = ", ".join(f"{code} {seconds * 1000:.1f}" for code, seconds in top)
    print(f"each rule alone, over the walk (ms): {shown}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=500)
    parser.add_argument("--edits", type=int, default=30)
    parser.add_argument("--profile", action="store_true", help="where an edit's time goes")
    args = parser.parse_args()
    if args.profile:
        profile(args.lines, args.edits)
        return

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        path = root / "train.py"
        text = synthetic_script(args.lines)
        path.write_text(text)
        uri = path.as_uri()
        started = time.perf_counter()
        client = start_server(root)
        startup = time.perf_counter() - started

        def round_trip(send) -> tuple[float, dict]:
            start = time.perf_counter()
            send()
            params = client.wait_for("textDocument/publishDiagnostics", lambda p: p["uri"] == uri)
            return time.perf_counter() - start, params

        doc = {"uri": uri, "languageId": "python", "version": 1, "text": text}
        first, params = round_trip(
            lambda: client.notify("textDocument/didOpen", {"textDocument": doc})
        )
        middle = text.rindex("    total = 0.0\n", 0, len(text) // 2)

        cpu: dict[str, float | None] = {}

        def timed_edits(first_version: int, edit, label: str) -> list[float]:
            times = []
            cpu_before = cpu_seconds(client.proc.pid)
            for version in range(first_version, first_version + args.edits):
                change = {
                    "textDocument": {"uri": uri, "version": version},
                    "contentChanges": [{"text": edit(version)}],
                }
                seconds, _ = round_trip(lambda c=change: client.notify("textDocument/didChange", c))
                times.append(seconds)
            cpu_after = cpu_seconds(client.proc.pid)
            if cpu_before is not None and cpu_after is not None:
                cpu[label] = (cpu_after - cpu_before) / args.edits
            return times

        changes = timed_edits(2, lambda v: text + f"# edit {v}\n", "comment")
        in_code = timed_edits(
            2 + args.edits,
            lambda v: f"{text[:middle]}    total = {v}.0\n{text[middle + 16 :]}",
            "code",
        )
        actions, resolves = [], []
        for _ in range(10):
            start = time.perf_counter()
            listed = client.request(
                "textDocument/codeAction",
                {
                    "textDocument": {"uri": uri},
                    "range": {
                        "start": {"line": 16, "character": 0},
                        "end": {"line": 16, "character": 40},
                    },
                    "context": {"diagnostics": []},
                },
            )
            actions.append(time.perf_counter() - start)
        fix_all = next(a for a in listed if a["kind"].startswith("source.fixAll"))
        for _ in range(3):
            start = time.perf_counter()
            client.request("codeAction/resolve", fix_all)
            resolves.append(time.perf_counter() - start)
        client.close()

    ms = lambda s: f"{s * 1000:8.1f}"  # noqa: E731
    print(f"script: {args.lines} lines, {len(params['diagnostics'])} diagnostics published")
    print(f"{'what':<44}{'ms':>8}")
    print(f"{'server start + initialize':<44}{ms(startup)}")
    print(f"{'didOpen -> publishDiagnostics (first)':<44}{ms(first)}")
    print(f"{'didChange (comment at the end), median':<44}{ms(statistics.median(changes))}")
    print(
        f"{'didChange -> publishDiagnostics, p90':<44}"
        f"{ms(sorted(changes)[int(0.9 * (len(changes) - 1))])}"
    )
    print(f"{'didChange -> publishDiagnostics, best':<44}{ms(min(changes))}")
    print(f"{'didChange in a function body, median':<44}{ms(statistics.median(in_code))}")
    print(
        f"{'didChange in a function body, p90':<44}"
        f"{ms(sorted(in_code)[int(0.9 * (len(in_code) - 1))])}"
    )
    for label, what in (("comment", "comment at the end"), ("code", "in a function body")):
        if cpu.get(label) is not None:
            print(f"{'server CPU per didChange (' + what + ')':<44}{ms(cpu[label])}")
    print(f"{'first codeAction after an edit':<44}{ms(actions[0])}")
    print(f"{'codeAction request, median':<44}{ms(statistics.median(actions))}")
    print(f"{'codeAction/resolve of fix-all, median':<44}{ms(statistics.median(resolves))}")


if __name__ == "__main__":
    main()
