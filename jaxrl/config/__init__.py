"""Typed, frozen run configuration with verl's keys (`jaxrl.config.load_config`).

    cfg = load_config("configs/quickstart.yaml", ["data.train_batch_size=64"], num_devices=8)
    cfg.actor_rollout_ref.rollout.n

See `docs/config.md` for every key.
"""

from jaxrl.config.checks import check, check_model_context, critic_enabled, resolved_mesh
from jaxrl.config.errors import ConfigError
from jaxrl.config.load import load_config, save_config, to_dict, to_yaml
from jaxrl.config.schema import (
    ActorConfig,
    ActorRolloutRefConfig,
    AlgorithmConfig,
    AssetsConfig,
    Config,
    CriticConfig,
    DataConfig,
    MeshConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    TrainerConfig,
)

__all__ = [
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AlgorithmConfig",
    "AssetsConfig",
    "Config",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "MeshConfig",
    "ModelConfig",
    "OptimConfig",
    "RolloutConfig",
    "TrainerConfig",
    "check",
    "check_model_context",
    "critic_enabled",
    "load_config",
    "resolved_mesh",
    "save_config",
    "to_dict",
    "to_yaml",
]
