"""The downloads pass: a dataset built with `download=True` is fetched by rank 0 first while
the other ranks wait; never where the two barriers could miss each other (a loop, a
condition that reads the disk, a function some rank skips), and never twice."""

from __future__ import annotations

from ddpify.engine import check_source
from ddpify.migrate.pipeline import migrate_source
from ddpify.rules import ALL_RULES

HEAD = """import os
import torch
import torchvision

model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
"""

TRAIN = """

def train(dataset):
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=True)
    for epoch in range(2):
        for x, y in loader:
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
"""


def _migrate(setup: str, main: str):
    text = HEAD + setup + TRAIN + "\n\nif __name__ == '__main__':\n" + main
    result = migrate_source(text)
    assert result.migrated, result.reason
    return result


def _download_findings(output: str) -> list[str]:
    found = check_source(output, "train.py", ALL_RULES, force=True).diagnostics
    return [d.code for d in found if d.code == "DDP027"]


def test_datasets_built_in_a_helper_download_on_rank_zero_first():
    result = _migrate(
        "\n\ndef datasets(root):\n"
        "    train_set = torchvision.datasets.MNIST(root, train=True, download=True)\n"
        "    test_set = torchvision.datasets.MNIST(root, train=False, download=True)\n"
        "    return train_set, test_set\n",
        "    train_set, test_set = datasets('data')\n    train(train_set)\n",
    )
    assert (
        "    if RANK != 0:\n"
        "        dist.barrier()  # ddpify: rank 0 downloads first; the others wait for it\n"
        "    train_set = torchvision.datasets.MNIST(root, train=True, download=True)\n"
        "    test_set = torchvision.datasets.MNIST(root, train=False, download=True)\n"
        "    if RANK == 0:\n"
        "        dist.barrier()\n"
    ) in result.output
    assert not _download_findings(result.output)
    assert [c.code for c in result.changes if c.pass_name == "downloads"] == ["DDP027"]


def test_a_download_in_a_loop_is_left_to_every_rank_and_reported():
    result = _migrate(
        "\n\ndef datasets(root):\n"
        "    sets = []\n"
        "    for train_split in (True, False):\n"
        "        sets.append(torchvision.datasets.MNIST(root, train=train_split, download=True))\n"
        "    return sets\n",
        "    train_set, _ = datasets('data')\n    train(train_set)\n",
    )
    assert "barrier" not in result.output
    assert any("downloads this dataset" in item.why for item in result.needs_human)


def test_a_download_under_a_test_of_the_disk_is_left_and_reported():
    result = _migrate(
        "\n\ndef dataset(root):\n"
        "    if not os.path.isdir(root):\n"
        "        return torchvision.datasets.MNIST(root, download=True)\n"
        "    return torchvision.datasets.MNIST(root)\n",
        "    train(dataset('data'))\n",
    )
    assert "barrier" not in result.output
    assert any("downloads this dataset" in item.why for item in result.needs_human)


def test_a_download_already_on_rank_zero_is_left_alone():
    result = _migrate(
        "\n\ndef fetch(root):\n    torchvision.datasets.MNIST(root, download=True)\n",
        "    if int(os.environ.get('RANK', '0')) == 0:\n"
        "        fetch('data')\n"
        "    train(torchvision.datasets.MNIST('data'))\n",
    )
    assert "barrier" not in result.output
    assert not any("downloads this dataset" in item.why for item in result.needs_human)


def test_migrating_the_result_again_adds_no_second_wait():
    first = _migrate(
        "\n\ndef dataset(root):\n    return torchvision.datasets.MNIST(root, download=True)\n",
        "    train(dataset('data'))\n",
    )
    again = migrate_source(first.output, "train.py")
    assert again.output == first.output
    assert first.output.count("dist.barrier()") == 2


def test_a_returned_download_under_a_test_of_the_settings_releases_before_returning():
    result = _migrate(
        "\n\ndef dataset(name, root):\n"
        "    if name.startswith('mnist'):\n"
        "        return torchvision.datasets.MNIST(root, download=True)\n"
        "    return torchvision.datasets.FashionMNIST(root, download=True)\n",
        "    train(dataset('mnist', 'data'))\n",
    )
    assert (
        "    if name.startswith('mnist'):\n"
        "        if RANK != 0:\n"
        "            dist.barrier()  # ddpify: rank 0 downloads first; the others wait for it\n"
        "        downloaded_dataset = torchvision.datasets.MNIST(root, download=True)\n"
        "        if RANK == 0:\n"
        "            dist.barrier()\n"
        "        return downloaded_dataset\n"
    ) in result.output
    assert not _download_findings(result.output)


def test_a_download_inside_a_statement_that_may_return_is_left_and_reported():
    result = _migrate(
        "\n\ndef dataset(root, fake):\n"
        "    with open(os.devnull) as sink:\n"
        "        return torchvision.datasets.MNIST(root, download=True)\n",
        "    train(dataset('data', False))\n",
    )
    assert "barrier" not in result.output
    assert any("downloads this dataset" in item.why for item in result.needs_human)


def test_a_download_inline_under_the_main_guard_is_ordered():
    text = (
        HEAD
        + TRAIN
        + "\n\nif __name__ == '__main__':\n"
        + "    train_set = torchvision.datasets.MNIST('data', download=True)\n"
        + "    train(train_set)\n"
    )
    result = migrate_source(text)
    assert result.migrated, result.reason
    assert (
        "        if RANK != 0:\n"
        "            dist.barrier()  # ddpify: rank 0 downloads first; the others wait for it\n"
        "        train_set = torchvision.datasets.MNIST('data', download=True)\n"
        "        if RANK == 0:\n"
        "            dist.barrier()\n"
    ) in result.output
    assert not _download_findings(result.output)
