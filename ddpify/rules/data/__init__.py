from ddpify.rules.base import Rule
from ddpify.rules.data.ddp020_no_distributed_sampler import NoDistributedSampler
from ddpify.rules.data.ddp021_shuffle_with_sampler import ShuffleWithSampler
from ddpify.rules.data.ddp022_missing_set_epoch import MissingSetEpoch
from ddpify.rules.data.ddp023_divergent_sampler_seed import DivergentSamplerSeed
from ddpify.rules.data.ddp024_unsharded_iterable_dataset import UnshardedIterableDataset
from ddpify.rules.data.ddp025_eval_padding_duplicates import EvalPaddingDuplicates
from ddpify.rules.data.ddp026_global_vs_per_process_batch import GlobalVsPerProcessBatch
from ddpify.rules.data.ddp027_download_race import DownloadRace

RULES: list[type[Rule]] = [
    NoDistributedSampler,
    ShuffleWithSampler,
    MissingSetEpoch,
    DivergentSamplerSeed,
    UnshardedIterableDataset,
    EvalPaddingDuplicates,
    GlobalVsPerProcessBatch,
    DownloadRace,
]
