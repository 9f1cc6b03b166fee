"""Shared core of the DSA kernel packages: arch detection, config tables, test/timing helpers."""

from kernel_common.arch import (
    ARCH_ENV,
    Arch,
    device_arch,
    parse_arch,
    shared_memory_per_block,
    sm_count,
    tilelang_target,
)
from kernel_common.config import (
    ConfigTable,
    KeyField,
    Lookup,
    config_fields,
    define_config_op,
    heads_bucket,
    next_pow2,
)
from kernel_common.validate import check_indices, check_int, check_tensor

__all__ = [
    "ARCH_ENV",
    "Arch",
    "ConfigTable",
    "KeyField",
    "Lookup",
    "check_indices",
    "check_int",
    "check_tensor",
    "config_fields",
    "define_config_op",
    "device_arch",
    "heads_bucket",
    "next_pow2",
    "parse_arch",
    "shared_memory_per_block",
    "sm_count",
    "tilelang_target",
]
__version__ = "0.1.0"
