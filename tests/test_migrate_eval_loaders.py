"""Evaluation loaders beside the training loader: only the loader whose loop reaches
`backward()` trains. A helper that builds both (`self.train_loader = get_loader(...)`,
`self.dev_loader = get_loader(...)`) and one epoch function run with a flag
(`run_epoch(dloader, train_mode=False)`) must not make the dev loader the training one:
not its set_epoch, not its dataset's name, not a sampler added silently. The fixture
pairs trainer_shared_loader_helper and run_epoch_train_flag run as python and under
torchrun in the batched runner (tests/test_migrate_run.py)."""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.roles import train_loaders
from ddpify.analysis.tree import Tree
from ddpify.migrate import migrate_source
from tests.helpers import FIXTURES


def before(case: str) -> str:
    return (FIXTURES / "migrate" / case / "before.py").read_text()


def migrate(case: str):
    result = migrate_source(before(case), "before.py")
    assert result.migrated, result.reason
    return result


def test_a_helper_built_dev_loader_is_not_a_name_of_the_training_loader():
    tree = Tree(cst.parse_module(before("trainer_shared_loader_helper")))
    loaders, _ = train_loaders(tree)
    assert len(loaders) == 1
    assert "self.train_loader" in loaders[0].names
    assert "self.dev_loader" not in loaders[0].names


def test_a_helper_result_nothing_shows_to_evaluate_stays_a_name_of_the_training_loader():
    """Only a result a non-training loop iterates, or named as evaluation data, is set
    apart: another may reach the step under a name the analysis does not follow."""
    text = before("trainer_shared_loader_helper").replace("self.dev_loader", "self.aux_loader")
    text = text.replace("for x, y in self.aux_loader:", "for x, y in self.train_loader:")
    loaders, _ = train_loaders(Tree(cst.parse_module(text)))
    assert {"self.train_loader", "self.aux_loader"} <= loaders[0].names


def test_the_training_loader_of_a_shared_helper_reshuffles_and_the_dev_one_is_reported():
    result = migrate("trainer_shared_loader_helper")
    out = result.output
    assert "self.train_loader.sampler.set_epoch(epoch)" in out
    assert "self.dev_loader.sampler" not in out
    # The dataset is named inside the helper, where no `self` exists.
    helper = out[out.index("def get_loader(") : out.index("class Classifier")]
    assert "    dataset = TensorDataset(features, labels)\n" in helper
    assert "self." not in helper
    # The helper's sampler shards the dev loader too: said, with the line, not silent.
    shared = [item for item in result.needs_human if "`self.dev_loader` comes from" in item.why]
    assert len(shared) == 1
    assert out.splitlines()[shared[0].line - 1].strip().startswith("self.dev_loader = ")


def test_a_loader_run_with_the_training_flag_off_is_left_whole():
    result = migrate("run_epoch_train_flag")
    out = result.output
    assert "DataLoader(train_set, batch_size=12, sampler=DistributedSampler(train_set" in out
    assert "        dloader = DataLoader(dev_set, batch_size=12)\n" in out
    assert "tloader.sampler.set_epoch(epoch)" in out and "dloader.sampler" not in out
    whole = [item for item in result.needs_human if "this loader is not sharded" in item.why]
    assert [out.splitlines()[item.line - 1].strip()[:8] for item in whole] == ["dloader "]


def test_a_print_that_calls_the_training_epoch_runs_on_every_rank():
    """Guarded, rank 0 alone would train and the other ranks would wait in its
    all-reduce: the print stays on every rank, and the report says why."""
    result = migrate("run_epoch_train_flag")
    assert '        print(f"epoch {epoch}", runner.run_epoch(tloader)' in result.output
    assert "if RANK == 0:" not in result.output
    items = [item for item in result.needs_human if "`runner.run_epoch`" in item.why]
    assert len(items) == 1 and "runs a training step" in items[0].why


def test_a_flag_that_is_not_a_literal_may_train():
    """`run_epoch(loader, train_mode=args.train)`: nothing says it evaluates."""
    text = before("run_epoch_train_flag").replace(
        "runner.run_epoch(dloader, train_mode=False)", "runner.run_epoch(dloader, train_mode=ON)"
    )
    text = text.replace("VOCAB, WINDOW = 20, 6\n", "VOCAB, WINDOW = 20, 6\nON = False\n")
    out = migrate_source(text, "before.py").output
    assert "dloader = DataLoader(dev_set, batch_size=12, sampler=DistributedSampler(" in out
