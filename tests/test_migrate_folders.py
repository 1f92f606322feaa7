"""The folders pass: an experiment folder that every rank would remove and make again
is reset on rank 0, and the other ranks wait at a barrier; never where a barrier could
hang or where the other ranks need what the reset binds."""

from __future__ import annotations

from ddpify.migrate.pipeline import migrate_source

HEAD = """import os
import shutil
import torch

model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2)))
"""

TRAIN = """

def train():
    for (x,) in loader:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
"""


def _migrated(setup: str, main: str) -> str:
    text = HEAD + setup + TRAIN + "\n\nif __name__ == '__main__':\n" + main
    result = migrate_source(text)
    assert result.migrated, result.reason
    return result.output


def test_a_folder_reset_in_a_setup_function_runs_on_rank_zero_then_a_barrier():
    out = _migrated(
        "\n\ndef setup(path):\n"
        "    if os.path.exists(path):\n"
        "        shutil.rmtree(path)\n"
        "    os.makedirs(path)\n"
        "    return path\n",
        "    setup('runs/a')\n    train()\n",
    )
    assert (
        "    if RANK == 0:\n"
        "        if os.path.exists(path):\n"
        "            shutil.rmtree(path)\n"
        "    dist.barrier()\n"
        "    if RANK == 0:\n"
        "        os.makedirs(path)\n"
        "    dist.barrier()\n"
    ) in out


def test_no_barrier_in_a_function_called_on_rank_zero_only():
    out = _migrated(
        "\n\ndef fresh(path):\n    shutil.rmtree(path)\n",
        "    if int(os.environ.get('RANK', '0')) == 0:\n        fresh('runs/a')\n    train()\n",
    )
    assert "barrier" not in out


def test_a_reset_that_binds_what_follows_is_left_to_every_rank():
    out = _migrated(
        "\n\ndef setup(path):\n"
        "    if os.path.exists(path):\n"
        "        shutil.rmtree(path)\n"
        "        fresh = True\n"
        "    else:\n"
        "        fresh = False\n"
        "    return fresh\n",
        "    setup('runs/a')\n    train()\n",
    )
    assert "barrier" not in out


def test_makedirs_with_exist_ok_needs_nothing():
    out = _migrated(
        "\n\ndef setup(path):\n    os.makedirs(path, exist_ok=True)\n",
        "    setup('runs/a')\n    train()\n",
    )
    assert "barrier" not in out


def _with_setup(setup: str) -> str:
    return (
        HEAD
        + "import sys\n\n\ndef setup(path, keep):\n"
        + setup
        + TRAIN
        + "\n\nif __name__ == '__main__':\n    setup('runs/a', False)\n    train()\n"
    )


def test_a_reset_beside_an_exit_is_guarded_and_the_exit_reported():
    # Racing ranks in the usual path would be worse than rank 0 alone leaving: the reset
    # goes under rank 0, and the exit that now runs there alone is named for a human.
    result = migrate_source(
        _with_setup(
            "    if os.path.exists(path):\n"
            "        if not keep:\n"
            "            shutil.rmtree(path)\n"
            "        else:\n"
            "            sys.exit(0)  # keep the old run\n"
        )
    )
    assert result.migrated, result.reason
    assert (
        "    if RANK == 0:\n"
        "        if os.path.exists(path):\n"
        "            if not keep:\n"
        "                shutil.rmtree(path)\n"
        "            else:\n"
        "                sys.exit(0)  # keep the old run\n"
        "    dist.barrier()\n"
    ) in result.output
    reported = [h for h in result.needs_human if "exit now runs on rank 0 only" in h.why]
    assert [h.anchor for h in reported] == ["sys.exit(0)  # keep the old run"]


def test_a_reset_that_cannot_move_under_rank_zero_is_reported():
    # `fresh` is read after the `if`, so only the rmtree itself could move, and it sits
    # under a test of the folder that rank 0 is changing: left to every rank, and said.
    result = migrate_source(
        _with_setup(
            "    fresh = False\n"
            "    if os.path.exists(path):\n"
            "        shutil.rmtree(path)  # a fresh run\n"
            "        fresh = True\n"
            "    print(fresh, keep)\n"
        )
    )
    assert result.migrated, result.reason
    assert "barrier" not in result.output
    assert "        shutil.rmtree(path)  # a fresh run\n" in result.output
    reported = [h for h in result.needs_human if "they race" in h.why]
    assert [h.anchor for h in reported] == ["shutil.rmtree(path)  # a fresh run"]


def _evaluating(make: str, test: str = "if not os.path.isdir(path):") -> str:
    # The make sits in an evaluation that runs the model: the block cannot move under
    # rank 0 (DDP's forward is a collective), so every rank keeps making the folder.
    return (
        HEAD
        + "\n\ndef evaluate(path):\n    with torch.no_grad():\n        model(torch.randn(2, 2))\n"
        + f"        {test}\n            {make}\n"
        + TRAIN
        + "\n\nif __name__ == '__main__':\n    train()\n    evaluate('runs/a')\n"
    )


def _races_reported(result) -> list[str]:
    return [h.anchor for h in result.needs_human if "they race" in h.why]


def test_a_make_left_to_every_rank_under_a_missing_test_tolerates_the_folder_made():
    for make, race_free in [
        ("os.mkdir(path)", "os.makedirs(path, exist_ok=True)"),
        ("os.makedirs(path)", "os.makedirs(path, exist_ok=True)"),
        ("os.makedirs(path, 0o755, False)", "os.makedirs(path, 0o755, exist_ok=True)"),
        ("os.mkdir(path, mode=0o700)", "os.makedirs(path, mode=0o700, exist_ok=True)"),
    ]:
        result = migrate_source(_evaluating(make))
        assert result.migrated, result.reason
        assert f"        if not os.path.isdir(path):\n            {race_free}\n" in result.output
        assert _races_reported(result) == []
        changed = [c for c in result.changes if c.pass_name == "folders"]
        assert [c.anchor for c in changed] == [race_free]
        assert "exist_ok=True" in changed[0].description
        assert ("missing parent folders" in changed[0].description) == ("mkdir" in make)


def test_a_missing_test_among_the_terms_of_an_and_is_enough():
    for test in [
        "if path and not os.path.exists(path):",
        "if not os.path.isdir(path) and len(path) > 1 and path:",
    ]:
        result = migrate_source(_evaluating("os.makedirs(path)", test))
        assert result.migrated, result.reason
        assert "            os.makedirs(path, exist_ok=True)\n" in result.output
        assert _races_reported(result) == []


def test_a_make_whose_test_is_not_of_that_folder_is_reported_not_changed():
    for make, test in [
        ("os.mkdir(other)", "if not os.path.isdir(path):"),  # another folder
        ("os.mkdir(path)", "if os.path.isdir(path):"),  # not a test that it is missing
        ("os.mkdir(path)", "if path or not os.path.isdir(path):"),  # may run when it exists
        ("os.mkdir(path, dir_fd=3)", "if not os.path.isdir(path):"),  # makedirs has no dir_fd
    ]:
        result = migrate_source(_evaluating(make, test))
        assert result.migrated, result.reason
        assert f"            {make}\n" in result.output
        assert _races_reported(result) == [make]
