"""Settings: pydantic sections held by one EngineConfig, loadable from YAML with overrides."""
from raylm.configs.engine_config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServingConfig,
)
from raylm.configs.loader import FIELD_SECTION, add_engine_args, engine_args_from, load_yaml, make_engine_config

__all__ = [
    "FIELD_SECTION", "CacheConfig", "CompilationConfig", "EngineConfig", "ModelConfig", "ParallelConfig",
    "SchedulerConfig", "ServingConfig", "add_engine_args", "engine_args_from", "load_yaml", "make_engine_config",
]
