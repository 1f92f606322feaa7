"""BatchNorm at the wrap: every form of wrap the pass writes converts to SyncBatchNorm (on
CUDA only) exactly the models whose classes hold BatchNorm, as the analysis
(ddpify/analysis/batch_norm.py) answers; a script that stays on the CPU is told which
models now keep per-rank statistics. The fixture model_list_batchnorm runs in the batched
runner and verifies in tests/test_verify_runs.py."""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.batch_norm import holds_batch_norm
from ddpify.analysis.tree import Tree
from ddpify.migrate import migrate_source
from tests.helpers import FIXTURES

LIST_FIXTURE = (FIXTURES / "migrate" / "model_list_batchnorm" / "before.py").read_text()
CONVERT_EACH = "    nets = [torch.nn.SyncBatchNorm.convert_sync_batchnorm(net) for net in nets]\n"

MODELS = """\
import torch
import torchvision
from torch import nn


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)


class Normed(Plain):
    def __init__(self, bn=False):
        super().__init__()
        if bn:
            self.bn = nn.BatchNorm1d(4)


NORM = nn.BatchNorm2d


class Aliased(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = NORM(8)


def block(width):
    return nn.Sequential(nn.Conv2d(width, width, 3), nn.BatchNorm2d(width))


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = block(8)


class Derived(Tower):
    pass


plain = Plain().to("cuda")
sequential = nn.Sequential(nn.Linear(2, 4), nn.ReLU())
normed_sequential = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4))
nets = [Plain(), Normed(bn=True)]
plains = {"a": Plain(), "b": Plain()}
appended = []
for width in (4, 8):
    appended.append(Normed(bn=width > 4))
derived = Derived()
resnet = torchvision.models.resnet18()
aliased = Aliased()
keyed = {}
keyed["plain"] = Plain()
keyed["normed"] = Normed(bn=True)
plain_keyed = {}
plain_keyed["a"] = Plain()
called = dict(a=Plain(), b=Normed(bn=True))
"""


def _holds(name: str) -> bool | None:
    return holds_batch_norm(Tree(cst.parse_module(MODELS)), name)


def test_the_analysis_tells_which_models_hold_batch_norm():
    assert _holds("nets") is True  # Normed builds one under `if bn:`
    assert _holds("normed_sequential") is True
    assert _holds("derived") is True  # through its base class and a builder function
    assert _holds("aliased") is True  # `NORM = nn.BatchNorm2d` at module level
    assert _holds("appended") is True  # `appended = []`, then `appended.append(Normed(...))`
    assert _holds("keyed") is True  # `keyed = {}`, then `keyed["normed"] = Normed(bn=True)`
    assert _holds("called") is True  # `dict(a=Plain(), b=Normed(bn=True))`
    assert _holds("plain_keyed") is False  # the empty `{}` it starts from says nothing
    assert _holds("plain") is False
    assert _holds("sequential") is False
    assert _holds("plains") is False


def test_a_model_built_outside_the_project_is_left_to_the_caller():
    assert _holds("resnet") is None
    assert _holds("not_bound_anywhere") is None


def migrate(source: str):
    result = migrate_source(source, "t.py")
    assert result.migrated, result.reason
    return result


def _per_rank_notes(result) -> list[str]:
    return [h.why for h in result.needs_human if "share of the batch" in h.why]


def test_each_model_of_a_list_is_converted_before_it_is_wrapped():
    result = migrate(LIST_FIXTURE)
    out = result.output
    guard = "if torch.cuda.is_available():  # SyncBatchNorm needs CUDA\n" + CONVERT_EACH
    assert out.index("nets = [Net(") < out.index(guard) < out.index("nets = [DDP(net")
    assert _per_rank_notes(result) == []
    assert not any("keep their BatchNorm" in h.why for h in result.needs_human)


def test_a_list_of_models_without_batch_norm_gets_no_conversion():
    source = LIST_FIXTURE.replace("nn.BatchNorm1d", "nn.LayerNorm")
    out = migrate(source).output
    assert "convert_sync_batchnorm" not in out and "nets = [DDP(net" in out


def test_a_list_of_models_on_the_cpu_is_named_in_the_per_rank_note():
    source = LIST_FIXTURE.replace('"cuda" if torch.cuda.is_available() else "cpu"', '"cpu"')
    result = migrate(source)
    assert "convert_sync_batchnorm" not in result.output
    [note] = _per_rank_notes(result)
    assert note.startswith("BatchNorm layers of `nets` now normalise")


GAN = """\
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

G = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 2)).cuda()
D = nn.Sequential(nn.Linear(2, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1)).cuda()
opt_g = torch.optim.Adam(G.parameters(), lr=1e-3)
opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)
loader = DataLoader(TensorDataset(torch.randn(64, 2)), batch_size=8, shuffle=True)
for epoch in range(2):
    for (real,) in loader:
        real = real.cuda()
        fake = G(torch.randn(8, 2).cuda())
        d_loss = -(D(real).mean() - D(fake.detach()).mean())
        opt_d.zero_grad()
        d_loss.backward()
        opt_d.step()
        g_loss = -D(fake).mean()
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
"""


def test_of_several_models_only_those_with_batch_norm_are_converted():
    out = migrate(GAN).output
    assert "    D = torch.nn.SyncBatchNorm.convert_sync_batchnorm(D)\n" in out
    assert "convert_sync_batchnorm(G)" not in out
    assert out.index("convert_sync_batchnorm(D)") < out.index("D = DDP(D")


def test_data_parallel_of_a_model_with_batch_norm_is_converted_before_the_wrap():
    source = GAN.replace(
        "opt_g = torch.optim", "G = nn.DataParallel(G)\nD = nn.DataParallel(D)\nopt_g = torch.optim"
    )
    out = migrate(source).output
    assert out.count("convert_sync_batchnorm(") == 1
    assert out.index("D = torch.nn.SyncBatchNorm.convert_sync_batchnorm(D)") < out.index("D = DDP(")


LOOP_FILLED = """\
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

data = TensorDataset(torch.randn(64, 2), torch.randn(64, 1))
loader = DataLoader(data, batch_size=8, shuffle=True)
nets = []
for width in (4, 8):
    net = nn.Sequential(nn.Linear(2, width), nn.BatchNorm1d(width), nn.Linear(width, 1))
    nets.append(net.cuda())
opts = [torch.optim.Adam(net.parameters(), lr=1e-3) for net in nets]
for epoch in range(2):
    for x, y in loader:
        for net, opt in zip(nets, opts):
            opt.zero_grad()
            ((net(x.cuda()) - y.cuda()) ** 2).mean().backward()
            opt.step()
"""


def test_a_list_filled_in_a_loop_is_converted_and_wrapped_once_it_is_complete():
    out = migrate(LOOP_FILLED).output
    filled = out.index("    nets.append(net.cuda(LOCAL_RANK))")
    assert filled < out.index(CONVERT_EACH) < out.index("nets = [DDP(net") < out.index("opts = [")
    assert "nets.module" not in out


DICT_OF_MODELS = """\
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

loader = DataLoader(TensorDataset(torch.randn(64, 2), torch.randn(64, 1)), batch_size=8)
nets = {"plain": nn.Linear(2, 1), "bn": nn.Sequential(nn.BatchNorm1d(2), nn.Linear(2, 1))}
nets = {name: net.cuda() for name, net in nets.items()}
opts = {name: torch.optim.Adam(net.parameters(), lr=1e-3) for name, net in nets.items()}
for epoch in range(2):
    for x, y in loader:
        for name, net in nets.items():
            opts[name].zero_grad()
            ((net(x.cuda()) - y.cuda()) ** 2).mean().backward()
            opts[name].step()
"""


def test_each_model_of_a_dict_is_converted_and_wrapped_under_its_key():
    out = migrate(DICT_OF_MODELS).output
    convert = (
        "    nets = {name: torch.nn.SyncBatchNorm.convert_sync_batchnorm(net) "
        "for name, net in nets.items()}\n"
    )
    wrap = "nets = {name: DDP(net, device_ids=[LOCAL_RANK] if torch.cuda.is_available() else None"
    assert out.index("nets = {name: net.cuda(") < out.index(convert) < out.index(wrap)
    assert out.index(wrap) < out.index("opts = {name:")
    assert "nets.module" not in out  # a dict of wrappers has no `.module`


DICT_FIXTURE = (FIXTURES / "migrate" / "model_dict_items" / "before.py").read_text()


def test_a_dict_filled_by_key_is_converted_and_wrapped_once_it_is_complete():
    """`models = {}; models["encoder"] = Encoder(...)`, optimizers picked by key
    (`Adam(models["encoder"].parameters())`): each model of the dict is wrapped."""
    out = migrate(DICT_FIXTURE).output
    convert = "models = {name: torch.nn.SyncBatchNorm.convert_sync_batchnorm(net) for name"
    wrap = "    models = {name: DDP(net, device_ids=[LOCAL_RANK] if torch.cuda.is_available()"
    assert out.index('models["decoder"] = Decoder(4, 12)') < out.index(convert)
    assert out.index(convert) < out.index(wrap) < out.index("for epoch in range(args.epochs):")


def test_a_dict_built_by_a_dict_call_is_wrapped_alike():
    source = DICT_FIXTURE.replace("    models = {}\n", "    models = dict()\n")
    assert "models = {name: DDP(net" in migrate(source).output


def test_models_in_a_container_a_comprehension_cannot_rebuild_are_refused_naming_it():
    """An `nn.ModuleDict` is a module of its own: rebuilt, its keys would change."""
    source = DICT_FIXTURE.replace("    models = {}\n", "    models = nn.ModuleDict()\n")
    result = migrate_source(source, "t.py")
    assert not result.migrated
    assert "are items of `models` (`models = nn.ModuleDict()` in this file)" in result.reason
    assert "only in a list or a dict" in result.reason


def test_a_munch_of_models_is_given_back_to_its_class():
    source = DICT_FIXTURE.replace("    models = {}\n", "    models = Munch()\n")
    out = migrate("from munch import Munch\n" + source).output
    assert "    models = Munch({name: DDP(net, device_ids=" in out


def test_an_item_of_a_wrapped_dict_saves_the_models_own_keys():
    """Each item is a DDP wrapper after the wrap: its state_dict goes through `.module`,
    or the checkpoint's keys gain a `module.` prefix (DDP051)."""
    save = '        torch.save(models["encoder"].state_dict(), "encoder.pt")\n'
    source = DICT_FIXTURE.replace("        print(f", save + "        print(f")
    result = migrate(source)
    assert 'torch.save(models["encoder"].module.state_dict(), "encoder.pt")' in result.output
    assert migrate(result.output).output == result.output


def test_a_dict_with_attribute_access_is_rebuilt_in_its_class():
    """`nets = AttrDict(encoder=..., head=...)` with optimizers over `nets.encoder`: the
    models are items, not attributes of one model; `nets = DDP(nets)` would fail on a
    dict. Each is wrapped and the dict given back to its class, so `nets.encoder` reads."""
    before = (FIXTURES / "migrate" / "model_attrdict" / "before.py").read_text()
    out = migrate(before).output
    assert "    nets = AttrDict({name: DDP(net, find_unused_parameters=True) for name" in out
    assert "DDP(nets" not in out and "nets.module" not in out
    assert "torch.save(nets.encoder.module.state_dict()," in out
