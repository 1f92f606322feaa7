from ddpify.rules.base import Rule
from ddpify.rules.training_loop.ddp040_accumulation_without_no_sync import (
    AccumulationWithoutNoSync,
)
from ddpify.rules.training_loop.ddp041_lr_not_scaled import LrNotScaled
from ddpify.rules.training_loop.ddp042_schedule_steps_from_dataset import (
    ScheduleStepsFromDataset,
)
from ddpify.rules.training_loop.ddp043_amp_legacy_api import AmpLegacyApi
from ddpify.rules.training_loop.ddp044_clip_without_unscale import ClipWithoutUnscale
from ddpify.rules.training_loop.ddp045_divergent_control_flow import DivergentControlFlow

RULES: list[type[Rule]] = [
    AccumulationWithoutNoSync,
    LrNotScaled,
    ScheduleStepsFromDataset,
    AmpLegacyApi,
    ClipWithoutUnscale,
    DivergentControlFlow,
]
