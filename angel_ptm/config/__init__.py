"""Typed run configuration: dataclass sections, a YAML loader and ``section.field=value`` overrides.

    cfg = load_config("configs/small.yaml", overrides=["optimizer.lr=3e-4", "memory.host_budget=8GiB"])
    save_config(cfg, run_dir / "config.yaml")
"""

from angel_ptm.config.loader import config_to_dict, load_config, save_config, with_absolute_paths
from angel_ptm.config.schema import (
    Config,
    DataConfig,
    LRScheduleConfig,
    MemoryConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    CheckpointConfig,
    RunConfig,
    TraceConfig,
    TrainerConfig,
)
from angel_ptm.config.sizes import format_bytes, parse_bytes

__all__ = [
    "Config",
    "DataConfig",
    "LRScheduleConfig",
    "MemoryConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "CheckpointConfig",
    "RunConfig",
    "TraceConfig",
    "TrainerConfig",
    "config_to_dict",
    "format_bytes",
    "load_config",
    "parse_bytes",
    "save_config",
    "with_absolute_paths",
]
