"""`ddpify migrate`: fixture pairs, gates, the CLI, the report.

`DDPIFY_UPDATE_FIXTURES=1 python -m pytest tests/test_migrate.py` rewrites the after.py
files; read the diff before committing it.
"""

from __future__ import annotations

import io
import os
import shlex

import libcst as cst
import pytest

from ddpify.cli import main
from ddpify.engine import check_source
from ddpify.gates import GateError
from ddpify.migrate import PASSES, Options, migrate_source
from ddpify.migrate.edits import Edits
from ddpify.rules import ALL_RULES
from tests.helpers import FIXTURES

CASES_DIR = FIXTURES / "migrate"
CASES = sorted(p.name for p in CASES_DIR.iterdir() if (p / "before.py").is_file())
UNTOUCHED = {"accelerate_script", "lightning_script"}
UPDATE = os.environ.get("DDPIFY_UPDATE_FIXTURES") == "1"


def case_options(case: str) -> list[str]:
    path = CASES_DIR / case / "options.txt"
    return shlex.split(path.read_text()) if path.exists() else []


def options_of(case: str) -> Options:
    flags = case_options(case)
    options = Options()
    for flag, value in zip(flags, flags[1:] + [""]):
        if flag == "--batch-policy":
            options.batch_policy = value
        elif flag == "--amp":
            options.amp = value
        elif flag == "--lr-scaling":
            options.lr_scaling = value
        elif flag == "--no-sync-bn":
            options.sync_bn = False
    return options


# -- the fixture pairs ------------------------------------------------------------------


def test_there_are_enough_cases_of_every_shape():
    shapes = {}
    for case in CASES:
        shape = migrate_source((CASES_DIR / case / "before.py").read_text(), case).shape
        shapes[shape] = shapes.get(shape, 0) + 1
    assert len(CASES) >= 12
    assert set(shapes) >= {
        "single-GPU",
        "DataParallel",
        "mp.spawn DDP",
        "torch.distributed.launch DDP",
        "torchrun DDP",
        "framework",
    }


@pytest.mark.parametrize("case", CASES)
def test_cli_output_equals_after(case, tmp_path, capsys):
    before = CASES_DIR / case / "before.py"
    expected = CASES_DIR / case / "after.py"
    out = tmp_path / "after.py"
    code = main(["migrate", str(before), "-o", str(out), *case_options(case)])
    report = capsys.readouterr().out
    if case in UNTOUCHED:
        assert code == 1
        assert "not migrated" in report
        assert not out.exists()
        assert expected.read_text() == before.read_text()
        return
    assert code == 0, report
    if UPDATE:
        expected.write_text(out.read_text())
    assert out.read_text() == expected.read_text()


@pytest.mark.parametrize("case", [c for c in CASES if c not in UNTOUCHED])
def test_migrating_after_again_changes_nothing(case):
    after = (CASES_DIR / case / "after.py").read_text()
    again = migrate_source(after, "after.py", options_of(case))
    assert again.migrated
    assert again.output == after
    assert not again.changes


@pytest.mark.parametrize("case", [c for c in CASES if c not in UNTOUCHED])
def test_check_reports_none_of_the_fixed_codes(case):
    before = (CASES_DIR / case / "before.py").read_text()
    result = migrate_source(before, "before.py", options_of(case), gates=False)
    found = check_source(result.output, "after.py", ALL_RULES, force=True).diagnostics
    if case != "torchrun_clean":
        assert result.fixed_codes, "every migration fixes something"
    assert not [d.code for d in found if d.code in result.fixed_codes]


@pytest.mark.parametrize("case", [c for c in CASES if c not in UNTOUCHED])
def test_unedited_lines_survive_byte_for_byte(case):
    before = (CASES_DIR / case / "before.py").read_text()
    after = (CASES_DIR / case / "after.py").read_text()
    comments = [line for line in before.splitlines() if line.lstrip().startswith("#")]
    for comment in comments:
        assert comment.strip() in after
    # Code inline under the __main__ guard moves into the `try:` that destroys the
    # process group: one indent deeper, otherwise unchanged.
    after_lines = set(after.splitlines())
    kept = [
        line
        for line in before.splitlines()
        if line in after_lines or (line.strip() and "    " + line in after_lines)
    ]
    assert len(kept) >= 0.6 * len(before.splitlines())


# -- what the converted scripts contain -------------------------------------------------


def migrate_case(case: str, **options) -> str:
    text = (CASES_DIR / case / "before.py").read_text()
    return migrate_source(text, "before.py", Options(**options)).output


def test_sampler_takes_the_loaders_shuffle_and_epochs_reshuffle():
    out = migrate_case("single_main_argparse")
    assert "sampler=DistributedSampler(train_set, shuffle=True))" in out
    assert "shuffle=True," not in out
    loop = out.index("for epoch in range(args.epochs):")
    assert out.index("train_loader.sampler.set_epoch(epoch)", loop) < out.index(
        "model.train()", loop
    )


def test_evaluation_loader_is_left_whole_and_reported():
    text = (CASES_DIR / "single_main_argparse" / "before.py").read_text()
    result = migrate_source(text, "before.py")
    assert "val_loader = DataLoader(TensorDataset(x[:64], y[:64]), batch_size=64)" in result.output
    assert any("not sharded" in item.why and item.line for item in result.needs_human)


def test_accumulation_the_wrap_brings_about_is_reported_at_its_backward():
    """Gradients accumulated over a config's `subdivisions`: once wrapped, every micro-step
    all-reduces. No pass adds the `no_sync` (the step test reads a counter the loop body
    sets), so the report names the backward, the step test and the remedy."""
    result = migrate_source((CASES_DIR / "accumulation_by_setting" / "before.py").read_text())
    lines = result.output.splitlines()
    items = [h for h in result.needs_human if "(DDP040" in h.why]
    assert [lines[h.line - 1].strip() for h in items] == ["SCALER.scale(loss).backward()"]
    assert 'only when `batches_done % model.module.hyperparams["subdivisions"] == 0`' in (
        items[0].why
    )
    assert "under `model.no_sync()`" in items[0].why
    # A critic stepped every batch and a generator every n-th is no accumulation.
    critic = (FIXTURES / "verify" / "critic_gp" / "original.py").read_text()
    assert not any("DDP040" in h.why for h in migrate_source(critic).needs_human)


def test_a_hand_made_batch_is_split_once_where_it_enters_not_again_where_converted():
    """`x, y = random_batch(4)`, then `x = torch.Tensor(np.array(x))` and `.to(device)`:
    split again at each conversion, the batch shrank to an empty block on two ranks
    (graykode's Word2Vec crashed). Its numpy draw is what the ranks must seed alike."""
    result = migrate_source((CASES_DIR / "hand_batch_converted" / "before.py").read_text())
    splits = [line.strip() for line in result.output.splitlines() if "RANK * len(" in line]
    assert [line.split(" = ")[0] for line in splits] == ["input_batch", "target_batch"]
    seeding = [h.why for h in result.needs_human if "draws the same one" in h.why]
    assert len(seeding) == 1 and "the script does not seed numpy" in seeding[0]
    assert "(`np.random.seed(0)`)" in seeding[0] and "torch" not in seeding[0]


def test_dataparallel_on_one_branch_becomes_ddp_on_every_branch():
    """`DataParallel(m).cuda() if cuda else m` and `if cuda: m = DataParallel(m).cuda()`
    left CPU runs unwrapped: N processes training N models. DDP must hold on every path."""
    out = migrate_case("dp_conditional")
    assert (
        "regressor = DDP(net.cuda(LOCAL_RANK) if use_cuda else net, "
        "device_ids=[LOCAL_RANK] if use_cuda else None)"
    ) in out
    assert "if use_cuda:\n    critic = critic.cuda(LOCAL_RANK)\ncritic = DDP(critic," in out
    # `.module` is now right on every path, the CPU one included.
    assert 'torch.save(critic.module.state_dict(), "critic.pt")' in out


def test_a_part_of_the_model_called_in_the_step_is_reported_not_hidden():
    """`model.encoder(x)` must become `model.module.encoder(x)` to run at all, and that runs
    outside DDP's forward: its gradients are never averaged, so the report must say so."""
    result = migrate_source((CASES_DIR / "submodule_call" / "before.py").read_text(), "b.py")
    bypasses = [item for item in result.needs_human if "outside DDP's forward" in item.why]
    lines = result.output.splitlines()
    assert [lines[item.line - 1].strip()[:26] for item in bypasses] == [
        "code = model.module.encode",
        "loss = F.mse_loss(model.mo",
    ]
    # A method that calls no submodule (it makes a tensor) is not a bypass.
    assert not any("noise_like" in item.why for item in result.needs_human)


@pytest.mark.parametrize("case", ["submodule_call", "seq2seq_module_methods"])
def test_check_on_the_output_reports_each_bypass_migrate_reported(case):
    """`model.module.encode(x)` in a step that never calls `model(...)`: migrate cannot
    fix it and says so (DDP033); `ddpify check` on its output says so on the same lines."""
    result = migrate_source((CASES_DIR / case / "before.py").read_text(), "b.py")
    reported = sorted(item.line for item in result.needs_human if "(DDP033)" in item.why)
    found = check_source(result.output, "after.py", ALL_RULES, force=True).diagnostics
    assert reported and sorted(d.location.row for d in found if d.code == "DDP033") == reported


@pytest.mark.parametrize(
    ("case", "policy", "scaling", "expected"),
    [
        ("single_main_argparse", "per-rank", None, "lr=args.lr * WORLD_SIZE,"),
        ("single_toplevel", "per-rank", None, "lr=1e-3 * WORLD_SIZE**0.5)"),
        ("single_toplevel", "per-rank", "linear", "lr=1e-3 * WORLD_SIZE)"),
        ("single_main_argparse", "per-rank", "none", "lr=args.lr,"),
        ("single_main_argparse", "global", None, "lr=args.lr,"),
    ],
)
def test_learning_rate_follows_the_batch_policy(case, policy, scaling, expected):
    out = migrate_case(case, batch_policy=policy, lr_scaling=scaling)
    assert expected in out
    if "WORLD_SIZE" in expected:
        rule = "linear LR scaling (Goyal" if "**" not in expected else "square-root LR scaling"
        line = out[: out.index(expected)].splitlines()[-2]
        assert "# ddpify: " in line and rule in line


def test_global_batch_policy_divides_the_batch():
    out = migrate_case("single_main_argparse", batch_policy="global")
    assert "batch_size=args.batch_size // WORLD_SIZE" in out
    assert "# ddpify: batch policy global" in out


def test_result_tells_verify_the_policy_and_scale():
    text = (CASES_DIR / "single_toplevel" / "before.py").read_text()
    result = migrate_source(text, "t.py")
    assert (result.batch_policy, result.lr_scaling) == ("per-rank", "sqrt")
    assert result.lr_scale_for(4) == pytest.approx(2.0)
    flat = migrate_source(text, "t.py", Options(batch_policy="global"))
    assert flat.lr_scale_for(4) == 1.0


def test_amp_off_and_no_sync_bn():
    default = migrate_case("single_trainer_class")
    assert "convert_sync_batchnorm" in default and "torch.autocast(" in default
    bare = migrate_case("single_trainer_class", amp="off", sync_bn=False)
    assert "convert_sync_batchnorm" not in bare
    assert "autocast" not in bare and "SCALER" not in bare


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_amp_dtype_choice(amp):
    out = migrate_case("single_main_argparse", amp=amp)
    dtype = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[amp]
    assert f"AMP_DTYPE = {dtype}\n" in out


def test_process_group_lifecycle_in_every_converted_script():
    for case in CASES:
        if case in UNTOUCHED or case.startswith("torchrun"):
            continue
        out = (CASES_DIR / case / "after.py").read_text()
        if 'init_process_group("gloo"' not in out:  # a CPU-only script needs no device
            assert out.index("torch.cuda.set_device(LOCAL_RANK)") < out.index("init_process_group(")
        assert "destroy_process_group()" in out
        for launcher in ("mp.spawn(", '"MASTER_ADDR"', "args.local_rank", '"--local'):
            assert launcher not in out


def test_spawn_rank_as_device_becomes_local_rank():
    out = (CASES_DIR / "spawn_tutorial" / "after.py").read_text()
    assert 'f"cuda:{LOCAL_RANK}"' in out and "device_ids=[LOCAL_RANK]" in out
    assert "demo_basic(RANK, world_size)" in out and "world_size = WORLD_SIZE" in out


def test_dataparallel_wrap_moves_after_the_device_move():
    out = (CASES_DIR / "dp_toplevel" / "after.py").read_text()
    assert "DataParallel(" not in out
    assert out.index("model.to(device)") < out.index("model = DDP(model")


# -- not understood, left alone ---------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        (
            "import torch\nfrom accelerate import Accelerator\nm = torch.nn.Linear(1, 1)\n",
            "Accelerate",
        ),
        ("import os\nprint(os.getcwd())\n", "does not import torch"),
        ("import torch\nmodel = torch.nn.Linear(2, 2)\nmodel(torch.ones(2))\n", "no training step"),
        (
            "import torch\nmodel = torch.nn.Linear(2, 1)\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "x, y = torch.randn(64, 2), torch.randn(64, 1)\n"
            "for i in range(0, 64, 8):\n"
            "    loss = ((model(x[i:i + 8]) - y[i:i + 8]) ** 2).mean()\n"
            "    loss.backward()\n    opt.step()\n",
            "hand-made batches",
        ),
        (
            "import torch\nfrom torch.utils.data import DataLoader, IterableDataset\n"
            "class Stream(IterableDataset):\n    def __iter__(self):\n"
            "        yield torch.randn(2), torch.randn(1)\n"
            "model = torch.nn.Linear(2, 1)\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "loader = DataLoader(Stream(), batch_size=4)\n"
            "for x, y in loader:\n    ((model(x) - y) ** 2).mean().backward()\n    opt.step()\n",
            "IterableDataset",
        ),
    ],
)
def test_scripts_it_does_not_understand_are_left_untouched(source, reason):
    result = migrate_source(source, "t.py")
    assert not result.migrated
    assert reason in result.reason
    assert result.output == source


HAND_MADE = (
    "import torch\nmodel = torch.nn.Linear(2, 1)\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "x, y = torch.randn(64, 2), torch.randn(64, 1)\n"
)


UNSPLITTABLE = [
    (
        "for epoch in range(3):\n    loss = ((model(x) - y) ** 2).mean()\n"
        "    loss.backward()\n    opt.step()\n",
        "full batch",
        "`loss = ((model(x) - y) ** 2).mean()`",
    ),
    (
        "for i in range(64):\n    xb, yb = x[[i]], y[[i]]\n"
        "    ((model(xb) - yb) ** 2).mean().backward()\n    opt.step()\n",
        "one example per step",
        "`xb, yb = x[[i]], y[[i]]`",
    ),
    (
        "h = torch.zeros(8, 1)\nfor i in range(0, 64, 8):\n    xb = x[i:i + 8]\n"
        "    out, h = model(xb, h)\n    out.sum().backward()\n    opt.step()\n",
        "carried state",
        "`xb = x[i:i + 8]`",
    ),
]


@pytest.mark.parametrize(("loop", "kind", "line"), UNSPLITTABLE)
def test_hand_made_batches_that_cannot_be_split_are_replicated(loop, kind, line):
    """No split computes these steps as the original did: every rank runs the whole step
    (migrate/replicate.py), nothing is split, and the report says so."""
    result = migrate_source(HAND_MADE + loop, "t.py")
    assert result.migrated, result.reason
    assert f"# ddpify: replicated step ({kind})" in result.output
    assert "RANK * len(" not in result.output and "lr=0.1)" in result.output
    assert "Replication: replicated" in render(result)


@pytest.mark.parametrize(("loop", "kind", "line"), UNSPLITTABLE)
def test_they_are_refused_with_the_line_when_a_loader_may_feed_them(loop, kind, line):
    loader = "from torch.utils.data import DataLoader\nstray = DataLoader(x, batch_size=8)\n"
    result = migrate_source(HAND_MADE + loader + loop, "t.py")
    assert not result.migrated
    assert f"keeps its batch whole ({kind}: {line})" in result.reason
    assert "`stray = DataLoader(x, batch_size=8)` may feed it" in result.reason


def test_hand_made_batch_is_split_where_it_enters_the_step():
    loop = (
        "for i in range(0, 64, 8):\n    xb, yb = x[i:i + 8], y[i:i + 8]\n"
        "    ((model(xb) - yb) ** 2).mean().backward()\n    opt.step()\n"
    )
    result = migrate_source(HAND_MADE + loop, "t.py")
    assert result.migrated
    body = result.output.split("xb, yb = x[i:i + 8], y[i:i + 8]\n", 1)[1].splitlines()
    assert (
        body[1].strip()
        == "xb = xb[RANK * len(xb) // WORLD_SIZE : (RANK + 1) * len(xb) // WORLD_SIZE]"
    )
    assert (
        body[2].strip()
        == "yb = yb[RANK * len(yb) // WORLD_SIZE : (RANK + 1) * len(yb) // WORLD_SIZE]"
    )
    assert "lr=0.1)" in result.output  # same global batch: the learning rate stays
    assert result.hand_made and "Sharding:" in render(result)


def render(result) -> str:
    stream = io.StringIO()
    result.render(stream)
    return stream.getvalue()


# -- gates ------------------------------------------------------------------------------

SIMPLE = (CASES_DIR / "single_main_argparse" / "before.py").read_text()


def _append(code: str):
    def run(tree, plan):
        edits = Edits()
        edits.after[tree.module.body[-1]].append(cst.parse_statement(code))
        return edits

    return run


def test_a_pass_that_breaks_compilation_is_named():
    passes = [*PASSES[:2], ("broken", _append("return 1\n"))]
    with pytest.raises(GateError) as info:
        migrate_source(SIMPLE, "t.py", passes=passes)
    assert info.value.pass_name == "broken"
    assert "does not compile" in info.value.reason


def test_a_pass_that_breaks_compilation_is_named_though_later_passes_ran():
    # Each pass's output is compiled once, at the end: the blame still finds the pass.
    passes = [*PASSES[:2], ("broken", _append("return 1\n")), *PASSES[2:]]
    with pytest.raises(GateError) as info:
        migrate_source(SIMPLE, "t.py", passes=passes)
    assert info.value.pass_name == "broken"
    assert "'return' outside function" in info.value.reason


def test_a_pass_that_is_not_idempotent_is_named():
    def noisy(tree, plan):
        plan.change("noisy", "adds a line every time", None)
        return _append("_ddpify_marker = 1\n")(tree, plan)

    with pytest.raises(GateError) as info:
        migrate_source(SIMPLE, "t.py", passes=[*PASSES, ("noisy", noisy)])
    assert "noisy" in info.value.pass_name
    assert "idempotent" in info.value.reason


def test_a_pass_that_claims_a_fix_check_still_reports_is_named():
    def liar(tree, plan):
        plan.change("liar", "claims to fix map_location", None, "DDP012")
        return Edits()

    passes = [p for p in PASSES if p[0] != "data"] + [("liar", liar)]
    with pytest.raises(GateError) as info:
        migrate_source(SIMPLE, "t.py", passes=passes)
    assert info.value.pass_name == "liar"
    assert "DDP012" in info.value.reason


def test_a_crashing_pass_is_reported_as_a_gate_failure():
    def crash(tree, plan):
        raise RuntimeError("boom")

    with pytest.raises(GateError) as info:
        migrate_source(SIMPLE, "t.py", passes=[("crash", crash)])
    assert info.value.pass_name == "crash" and "boom" in info.value.reason


def test_a_failed_gate_writes_nothing(tmp_path, monkeypatch, capsys):
    script = tmp_path / "train.py"
    script.write_text(SIMPLE)
    import ddpify.migrate.pipeline as pipeline

    monkeypatch.setattr(pipeline, "PASSES", [*PASSES[:1], ("broken", _append("return 1\n"))])
    assert main(["migrate", str(script)]) == 2
    assert script.read_text() == SIMPLE
    assert "broken pass failed" in capsys.readouterr().err


def test_input_must_parse():
    with pytest.raises(GateError) as info:
        migrate_source("def broken(:\n", "t.py")
    assert info.value.pass_name == "parse"


@pytest.mark.parametrize("compiled", ["here", "in a forked child", "beside the analysis"])
@pytest.mark.parametrize(
    "bad, message",
    [
        ("def broken(:\n", "line 1"),  # neither parser accepts it
        ("return 1\n", "'return' outside function (line 1)"),  # libcst accepts it
    ],
)
def test_input_that_python_rejects_is_refused_with_pythons_message(
    compiled, bad, message, monkeypatch
):
    import ddpify.gates as gates
    import ddpify.migrate.pipeline as pipeline

    if compiled != "here":
        if not hasattr(os, "fork"):
            pytest.skip("needs fork")
        monkeypatch.setattr(gates, "PARALLEL_CHARS", 0)
    if compiled == "beside the analysis":  # a large input: parsed in two, compiled later
        monkeypatch.setattr(pipeline, "PARALLEL_CHARS", 0)
    with pytest.raises(GateError) as info:
        migrate_source(bad + SIMPLE, "t.py")
    assert info.value.pass_name == "parse" and message in info.value.reason


def test_a_large_project_module_python_rejects_is_named(monkeypatch):
    # Compiled beside the analysis, a module of a project that CPython rejects (libcst
    # parses `return` at the top level) is still named in the refusal.
    if not hasattr(os, "fork"):
        pytest.skip("needs fork")
    import ddpify.migrate.pipeline as pipeline

    monkeypatch.setattr(pipeline, "PARALLEL_CHARS", 0)
    texts = {"train.py": SIMPLE, "helpers.py": "import torch\nreturn 1\n"}
    with pytest.raises(GateError) as info:
        pipeline.migrate_sources(texts)
    assert info.value.pass_name == "parse"
    assert info.value.reason.startswith("helpers.py: ")
    assert "'return' outside function" in info.value.reason


# -- CLI --------------------------------------------------------------------------------


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SIMPLE)
    return path


def test_default_rewrites_in_place_and_reports(script, capsys):
    mode = 0o750
    script.chmod(mode)
    assert main(["migrate", str(script)]) == 0
    out = capsys.readouterr().out
    assert script.read_text() == (CASES_DIR / "single_main_argparse" / "after.py").read_text()
    assert script.stat().st_mode & 0o777 == mode
    assert "Changes:" in out and "Needs a human:" in out
    assert f"torchrun --standalone --nproc_per_node=gpu {script}" in out
    assert "--rdzv_backend=c10d --rdzv_endpoint=HOST:29500" in out
    assert "line   " in out


def test_diff_prints_and_writes_nothing(script, capsys):
    assert main(["migrate", str(script), "--diff"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("--- ")
    assert "+    model = DDP(model" in captured.out
    assert "Changes:" in captured.err
    assert script.read_text() == SIMPLE


def test_check_exits_1_when_it_would_change(script, tmp_path):
    assert main(["migrate", str(script), "--check"]) == 1
    assert script.read_text() == SIMPLE
    done = tmp_path / "done.py"
    done.write_text((CASES_DIR / "single_main_argparse" / "after.py").read_text())
    assert main(["migrate", str(done), "--check"]) == 0


def test_crlf_newlines_and_encoding_survive(tmp_path):
    path = tmp_path / "train.py"
    path.write_bytes(b"\xef\xbb\xbf" + SIMPLE.replace("\n", "\r\n").encode())
    assert main(["migrate", str(path)]) == 0
    data = path.read_bytes()
    assert data.startswith(b"\xef\xbb\xbf")
    assert data.count(b"\r\n") == data.count(b"\n")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "No such file"),
        (b"def broken(:\n", "does not parse"),
        # libcst parses it; CPython's compiler refuses it (line 2 named)
        (b"import torch\nreturn 1\n", "'return' outside function (line 2)"),
        (b"x = '\xff\xfe'\n", "cannot decode"),
    ],
)
def test_bad_input_is_a_clear_error(tmp_path, capsys, content, message):
    path = tmp_path / "bad.py"
    if content is not None:
        path.write_bytes(content)
    assert main(["migrate", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_framework_script_exits_1_with_the_reason(capsys):
    path = CASES_DIR / "lightning_script" / "before.py"
    assert main(["migrate", str(path), "--check"]) == 1
    assert "Lightning" in capsys.readouterr().out


def test_script_arguments_need_verify(script, capsys):
    assert main(["migrate", str(script), "--", "--epochs", "1"]) == 2
    assert "--verify" in capsys.readouterr().err


def test_options_after_the_script_count(script, capsys):
    assert main(["migrate", "--amp", "off", str(script), "--diff", "--batch-policy", "global"]) == 0
    diff = capsys.readouterr().out
    assert "autocast" not in diff and "// WORLD_SIZE" in diff
    assert script.read_text() == SIMPLE


def test_comments_on_removed_and_rebuilt_statements_survive():
    source = (FIXTURES / "migrate" / "single_main_argparse" / "before.py").read_text()
    marked = source.replace('if __name__ == "__main__":', 'if __name__ == "__main__":  # entry', 1)
    lines = marked.splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("model = "))
    indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
    lines.insert(at, f"{indent}torch.cuda.set_device(0)  # pick the first GPU\n")
    result = migrate_source("".join(lines), "train.py")
    assert result.migrated
    assert "# pick the first GPU" in result.output and "# entry" in result.output
    assert "set_device(0)" not in result.output


def test_a_pass_that_drops_a_comment_fails_the_gate():
    def drop_comments(tree, plan):
        edits = Edits()
        stripped = tree.module.code.replace("  # the framework", "")
        edits.replace(tree.module, cst.parse_module(stripped))
        return edits

    source = (FIXTURES / "migrate" / "single_toplevel" / "before.py").read_text()
    source = source.replace("import torch\n", "import torch  # the framework\n", 1)
    with pytest.raises(GateError) as raised:
        migrate_source(source, "train.py", passes=[("dropper", drop_comments)])
    assert raised.value.pass_name == "dropper"
    assert "# the framework" in raised.value.reason


@pytest.fixture(params=["in this process", "in a forked child"])
def check_gate_where(request, monkeypatch):
    """The check gate runs beside the idempotency run for a large output: both ways."""
    if request.param == "in a forked child":
        if not hasattr(os, "fork"):
            pytest.skip("needs fork")
        import ddpify.migrate.pipeline as pipeline

        monkeypatch.setattr(pipeline, "PARALLEL_CHARS", 0)
    return request.param


def test_a_pass_that_claims_a_fix_check_still_reports_is_named_either_way(check_gate_where):
    def liar(tree, plan):
        plan.change("liar", "claims to fix map_location", None, "DDP012")
        return Edits()

    passes = [p for p in PASSES if p[0] != "data"] + [("liar", liar)]
    with pytest.raises(GateError) as info:
        migrate_source(SIMPLE, "t.py", passes=passes)
    assert info.value.pass_name == "liar"
    assert "DDP012" in info.value.reason


def test_a_pass_that_is_not_idempotent_fails_with_the_check_beside(check_gate_where):
    def noisy(tree, plan):
        plan.change("noisy", "adds a line every time", None)
        return _append("_ddpify_marker = 1\n")(tree, plan)

    with pytest.raises(GateError) as info:
        migrate_source(SIMPLE, "t.py", passes=[*PASSES, ("noisy", noisy)])
    assert "idempotent" in info.value.reason


def test_a_claimed_code_left_where_no_pass_touched_needs_a_human(check_gate_where):
    def partial(tree, plan):  # claims DDP012 at its own line, leaves another load alone
        plan.change("partial", "map_location on the first load", "state = torch.load(", "DDP012")
        return Edits()

    source = SIMPLE + 'state = torch.load("a.pt", map_location="cpu")\nextra = torch.load("b.pt")\n'
    passes = [p for p in PASSES if p[0] != "data"] + [("partial", partial)]
    result = migrate_source(source, "t.py", passes=passes)
    lines = result.output.splitlines()
    flagged = {lines[h.line - 1] for h in result.needs_human if "DDP012" in h.why}
    assert 'extra = torch.load("b.pt")' in flagged
    assert all("did not change this one" in h.why for h in result.needs_human if "DDP012" in h.why)


def test_the_readme_example_migrates_and_is_idempotent():
    # mp.spawn plus a `--local_rank` argument: the second run used to add a second setup.
    source = (FIXTURES / "examples" / "buggy_train.py").read_text()
    result = migrate_source(source, "buggy_train.py")
    assert result.migrated and "--local_rank" not in result.output
    assert migrate_source(result.output, "buggy_train.py").output == result.output


def test_a_progress_bar_kept_in_a_variable_is_the_loader_it_wraps():
    source = (
        "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"
        "from tqdm import tqdm\n"
        "model = torch.nn.Linear(2, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "loader = DataLoader(TensorDataset(torch.randn(64, 2), torch.randn(64, 1)), batch_size=8)\n"
        "for epoch in range(2):\n    pbar = tqdm(enumerate(loader))\n"
        "    for step, (x, y) in pbar:\n        ((model(x) - y) ** 2).mean().backward()\n"
        "        opt.step()\n"
    )
    result = migrate_source(source, "t.py")
    assert result.migrated
    assert "sampler=DistributedSampler(" in result.output
    assert "loader.sampler.set_epoch(epoch)" in result.output


def test_every_module_an_optimizer_trains_is_wrapped():
    source = (
        "import itertools\nimport torch\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "G = torch.nn.Linear(2, 2)\nD = torch.nn.Linear(2, 1)\n"
        "opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)\n"
        "opt_info = torch.optim.Adam(itertools.chain(G.parameters(), D.parameters()), lr=1e-3)\n"
        "loader = DataLoader(TensorDataset(torch.randn(64, 2)), batch_size=8, shuffle=True)\n"
        "for epoch in range(2):\n    for (x,) in loader:\n"
        "        D(G(x)).mean().backward()\n        opt_d.step()\n        opt_info.step()\n"
    )
    result = migrate_source(source, "t.py")
    assert result.migrated
    for name in ("G", "D"):
        assert f"{name} = DDP({name}, " in result.output
    assert result.output.count("find_unused_parameters=True") == 2


def test_a_loop_over_models_inside_the_loader_loop_trains_on_that_loader():
    source = (
        "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"
        "model = torch.nn.Linear(2, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "loader = DataLoader(TensorDataset(torch.randn(64, 2), torch.randn(64, 1)), batch_size=8)\n"
        "for epoch in range(2):\n    for x, y in loader:\n"
        "        for net, o in zip([model], [opt]):\n"
        "            ((net(x) - y) ** 2).mean().backward()\n            o.step()\n"
    )
    result = migrate_source(source, "t.py")
    assert result.migrated
    assert "sampler=DistributedSampler(" in result.output


def test_a_script_that_imports_torch_only_inside_a_function_is_refused():
    # The module-level set-up migrate adds would use torch, os and dist where none exists;
    # migrating such an output again duplicated it (found by benchmarks/fuzz.py).
    text = (
        "def run():\n"
        "    import torch\n\n"
        "    model = torch.nn.Linear(4, 1)\n"
        "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    for _ in range(3):\n"
        "        opt.zero_grad()\n"
        "        model(torch.randn(8, 4)).sum().backward()\n"
        "        opt.step()\n\n\n"
        "run()\n"
    )
    result = migrate_source(text)
    assert not result.migrated and result.output == text
    assert "`import torch`" in result.reason and "top of the file" in result.reason


def test_a_lazy_torch_import_beside_a_module_level_one_is_no_reason_to_refuse():
    text = (FIXTURES / "migrate" / "single_toplevel" / "before.py").read_text()
    text += "\n\ndef export():\n    import torch.onnx\n"
    result = migrate_source(text)
    assert result.migrated, result.reason


CPU_BATCH_NORM = (
    "import torch\n"
    "import torch.nn as nn\n"
    "from torch.utils.data import DataLoader, TensorDataset\n\n"
    "model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))\n"
    "loader = DataLoader(data, batch_size=16, shuffle=True)\n"
    "for epoch in range(2):\n"
    "    for x, y in loader:\n"
    "        opt.zero_grad()\n"
    "        nn.functional.mse_loss(model(x), y).backward()\n"
    "        opt.step()\n"
)


def _per_rank_statistics_notes(text: str) -> list[str]:
    result = migrate_source(text)
    assert result.migrated, result.reason
    return [h.why for h in result.needs_human if "share of the batch" in h.why]


def test_batch_norm_on_the_cpu_is_reported_as_per_rank_statistics():
    # SyncBatchNorm needs CUDA: on the CPU the statistics change with the rank's share.
    assert len(_per_rank_statistics_notes(CPU_BATCH_NORM)) == 1


def test_batch_norm_on_gpus_gets_the_conversion_not_the_note():
    text = CPU_BATCH_NORM.replace("nn.Linear(8, 1))\n", "nn.Linear(8, 1)).cuda()\n", 1)
    assert "convert_sync_batchnorm" in migrate_source(text).output
    assert _per_rank_statistics_notes(text) == []


def test_no_batch_norm_no_note():
    assert _per_rank_statistics_notes(CPU_BATCH_NORM.replace("nn.BatchNorm1d(8), ", "")) == []


CUDA_ONLY_WRAP = """\
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group("gloo")
    use_cuda = torch.cuda.is_available()
    model = nn.Linear(8, 1)
    if use_cuda:
        model = DDP(model.cuda(), device_ids=[int(os.environ["LOCAL_RANK"])])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), "model.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""


def test_module_is_not_written_where_the_wrap_holds_on_one_branch_only():
    """`if use_cuda: model = DDP(...)`: on the CPU path `model.module` would raise, so the
    save is left as it is and the report says why, at its line."""
    result = migrate_source(CUDA_ONLY_WRAP, "train.py")
    assert "model.module" not in result.output
    assert 'torch.save(model.state_dict(), "model.pt")' in result.output
    lines = result.output.splitlines()
    notes = [h for h in result.needs_human if "one branch of `if use_cuda:`" in h.why]
    assert notes and "model.state_dict()" in lines[notes[0].line - 1]


@pytest.mark.parametrize("case", ["single_main_argparse", "gan_main_inline", "dp_main"])
def test_the_check_beside_the_idempotency_run_reports_the_same(case, monkeypatch):
    path = FIXTURES / "migrate" / case / "before.py"
    if not path.exists() or not hasattr(os, "fork"):
        pytest.skip("no such fixture, or no fork")
    import ddpify.migrate.pipeline as pipeline

    here = migrate_source(path.read_text(), "train.py")
    monkeypatch.setattr(pipeline, "PARALLEL_CHARS", 0)
    beside = migrate_source(path.read_text(), "train.py")
    assert beside.output == here.output
    assert beside.needs_human == here.needs_human and beside.changes == here.changes


def _append_once(statement: cst.SimpleStatementLine):
    """A pass that appends `statement` unless the module already ends with its code."""

    def run(tree, plan):
        edits = Edits()
        last = tree.module.body[-1]
        if tree.module.code_for_node(last) != tree.module.code_for_node(statement):
            edits.after[last].append(statement)
        return edits

    return run


@pytest.mark.parametrize("built", ["as the parser makes it", "unlike its own parse"])
def test_the_gates_started_ahead_read_the_output_as_parsed(built, monkeypatch):
    # For a large output the idempotency and check gates start on the passes' final
    # module while the output is parsed; a module whose parse is another tree (same
    # text: `a * (b + c)` built without parentheses reads `(a * b) + c`) has both gates
    # run again on the parse, so they judge what a second run would read.
    if not hasattr(os, "fork"):
        pytest.skip("needs fork")
    import ddpify.migrate.pipeline as pipeline

    inner = cst.BinaryOperation(cst.Name("b"), cst.Add(), cst.Name("c"))
    if built == "as the parser makes it":
        inner = inner.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    value = cst.BinaryOperation(cst.Name("a"), cst.Multiply(), inner)
    statement = cst.SimpleStatementLine(
        [cst.Assign([cst.AssignTarget(cst.Name("_marker"))], value)]
    )
    passes = [*PASSES, ("append", _append_once(statement))]
    here = migrate_source(SIMPLE, "t.py", passes=passes)
    gated_again = []
    real = pipeline._gate_idempotent_and_check
    monkeypatch.setattr(
        pipeline, "_gate_idempotent_and_check", lambda *a: gated_again.append(1) or real(*a)
    )
    monkeypatch.setattr(pipeline, "PARALLEL_CHARS", 0)
    ahead = migrate_source(SIMPLE, "t.py", passes=passes)
    assert (ahead.output, ahead.needs_human) == (here.output, here.needs_human)
    assert len(gated_again) == (built == "unlike its own parse")
