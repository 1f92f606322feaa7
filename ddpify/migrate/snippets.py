"""Code the migration writes, as templates, and helpers to turn text into nodes."""

from __future__ import annotations

import functools

import libcst as cst

from ddpify.libcst_speed import clone, parse_module
from ddpify.migrate.analyze import SETUP_FUNCTION

ENV_COMMENT = (
    "# ddpify: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; a plain `python` run is rank 0 of 1."
)

ENV_CONSTANTS = """\
RANK = int(os.environ.get("RANK", "0"))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))
"""

SETUP_GPU = '''\


def {name}():
    """Join torchrun's process group; a lone process makes its own."""
    # On GPUs: nccl for CUDA tensors and gloo for CPU ones, bound to this process's GPU.
    backend, device_id = "gloo", None
    if torch.cuda.is_available():
        torch.cuda.set_device(LOCAL_RANK)
        backend, device_id = "cpu:gloo,cuda:nccl", torch.device("cuda", LOCAL_RANK)
    if "RANK" in os.environ:
        {dist}.init_process_group(backend, device_id=device_id)
    else:
        store = {dist}.HashStore()  # a group of one needs no rendezvous
        {dist}.init_process_group(
            backend, store=store, rank=RANK, world_size=WORLD_SIZE, device_id=device_id
        )
'''
# A script that never puts anything on a GPU trains on the CPU on any machine: gloo.
SETUP_CPU = '''\


def {name}():
    """Join torchrun's process group; a lone process makes its own."""
    # gloo: this script keeps its tensors on the CPU, which nccl cannot carry.
    if "RANK" in os.environ:
        {dist}.init_process_group("gloo")
    else:
        store = {dist}.HashStore()  # a group of one needs no rendezvous
        {dist}.init_process_group("gloo", store=store, rank=RANK, world_size=WORLD_SIZE)
'''

AMP_COMMENT = "# ddpify: mixed precision on GPUs only ({choice}); CPU runs stay exact."
AMP_DTYPES = {
    "auto": "torch.bfloat16 if USE_AMP and torch.cuda.is_bf16_supported() else torch.float16",
    "bf16": "torch.bfloat16",
    "fp16": "torch.float16",
}
AMP_CONSTANTS = """\
USE_AMP = torch.cuda.is_available()
AMP_DTYPE = {dtype}
SCALER = torch.amp.GradScaler("cuda", enabled=USE_AMP and AMP_DTYPE == torch.float16)
"""
AMP_CHOICE = {
    "auto": "bf16, else fp16 with a GradScaler",
    "bf16": "bf16",
    "fp16": "fp16 with a GradScaler",
}
AUTOCAST = 'with torch.autocast("cuda", dtype=AMP_DTYPE, enabled=USE_AMP):\n    pass\n'
DEVICE_IDS = "[LOCAL_RANK] if torch.cuda.is_available() else None"


def statements(code: str, comment: str | None = None) -> list[cst.BaseStatement]:
    """Parse `code` as statements; leading blank lines and `comment` go before the first."""
    module = _parsed_module(code)
    body = list(module.body)
    leading = list(module.header)
    if comment is not None:
        leading.append(cst.EmptyLine(comment=cst.Comment(comment)))
    if body:
        body[0] = body[0].with_changes(leading_lines=[*leading, *body[0].leading_lines])
    return body


def statement(code: str) -> cst.BaseStatement:
    return statements(code)[0]


def expression(code: str) -> cst.BaseExpression:
    return clone(_parsed_expression(code))


# A pass builds the same snippet once per site (`if RANK == 0:` around every print): parse
# each text once, and hand every caller its own copy (passes and trees key their maps by
# node identity, so one node object must never sit in two places of a tree).
@functools.lru_cache(maxsize=512)
def _parsed_expression(code: str) -> cst.BaseExpression:
    return cst.parse_expression(code)


@functools.lru_cache(maxsize=512)
def _parsed_template(code: str) -> cst.Module:
    return parse_module(code)


def _parsed_module(code: str) -> cst.Module:
    return clone(_parsed_template(code))


def setup_function(dist: str, cuda: bool) -> list[cst.BaseStatement]:
    template = SETUP_GPU if cuda else SETUP_CPU
    return statements(template.format(name=SETUP_FUNCTION, dist=dist))


def with_comment(node: cst.BaseStatement, comment: str) -> cst.BaseStatement:
    """`node` with a `# comment` line above it (after its blank lines and comments)."""
    line = cst.EmptyLine(comment=cst.Comment(comment))
    return node.with_changes(leading_lines=[*node.leading_lines, line])


def bare(node: cst.BaseStatement) -> cst.BaseStatement:
    """`node` without the blank lines and comments above it."""
    return node.with_changes(leading_lines=[])


def nested_under(template: cst.BaseCompoundStatement):
    """A grouping callback: put the statements into `template`'s body (`with ...:`,
    `if ...:`), the first one's comments and blank lines staying above the new block."""

    def wrap(members: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        first = members[0]
        body = [bare(first), *members[1:]]
        return [
            template.with_changes(
                body=template.body.with_changes(body=body), leading_lines=first.leading_lines
            )
        ]

    return wrap


def try_finally(body: list[cst.BaseStatement], cleanup: cst.BaseStatement) -> cst.Try:
    """`try: <body> finally: <cleanup>`, keeping the first statement's leading lines outside."""
    first = body[0]
    inner = [bare(first), *body[1:]]
    return cst.Try(
        body=cst.IndentedBlock(body=inner),
        finalbody=cst.Finally(body=cst.IndentedBlock(body=[bare(cleanup)])),
        leading_lines=first.leading_lines,
    )


# WeightedRandomSampler shared out by rank (migrate/weighted.py): the class's name is how
# verify's probe recognises it in the converted run.
WEIGHTED_SAMPLER_CLASS = "DistributedWeightedSampler"
WEIGHTED_SAMPLER = '''\


class {name}({torch}.utils.data.Sampler):
    """ddpify: WeightedRandomSampler's draw, shared out by rank. Every rank draws the same
    `num_samples` indices (a generator seeded with `seed` + the epoch), drops the last
    `num_samples % WORLD_SIZE` and keeps every WORLD_SIZE-th index from RANK: together the
    ranks draw from the original's distribution. Each pass draws anew (the epoch counts
    the passes; `set_epoch` sets it, as a DistributedSampler's does). A `generator` is
    not used: a per-process generator would give the ranks different draws."""

    def __init__(self, weights, num_samples, replacement=True, generator=None, seed=0):
        self.weights = {torch}.as_tensor(weights, dtype={torch}.double)
        self.num_samples = num_samples
        self.replacement = replacement
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        generator = {torch}.Generator()
        generator.manual_seed(self.seed + self.epoch)
        self.epoch += 1
        drawn = {torch}.multinomial(
            self.weights, self.num_samples, self.replacement, generator=generator
        )
        kept = len(drawn) // WORLD_SIZE * WORLD_SIZE
        return iter(drawn[:kept][RANK::WORLD_SIZE].tolist())

    def __len__(self):
        return self.num_samples // WORLD_SIZE
'''
