from ddpify.rules.base import Rule
from ddpify.rules.wrapping.ddp011_ddp_wrap_args import DdpWrapArgs
from ddpify.rules.wrapping.ddp030_batchnorm_not_synced import BatchNormNotSynced
from ddpify.rules.wrapping.ddp031_modify_after_wrap import ModifyAfterWrap
from ddpify.rules.wrapping.ddp032_wrapper_attribute_access import WrapperAttributeAccess
from ddpify.rules.wrapping.ddp033_bypass_wrapper_forward import BypassWrapperForward
from ddpify.rules.wrapping.ddp034_unused_parameters import UnusedParameters
from ddpify.rules.wrapping.ddp035_compile_order import CompileOrder
from ddpify.rules.wrapping.ddp036_dataparallel_only_test import DataParallelOnlyTest

RULES: list[type[Rule]] = [
    DdpWrapArgs,
    BatchNormNotSynced,
    ModifyAfterWrap,
    WrapperAttributeAccess,
    BypassWrapperForward,
    UnusedParameters,
    CompileOrder,
    DataParallelOnlyTest,
]
