"""The named device mesh, logical-axis layouts (train, rollout), reshard and offload."""

from jaxrl.config.mesh import AXES, ROLLOUT_RULES, TRAIN_RULES, resolve_axis_sizes
from jaxrl.sharding.layouts import (
    Layout,
    active_layout,
    layouts_from_config,
    rollout_mesh,
    shard,
    train_mesh,
    use_layout,
)
from jaxrl.sharding.logical import Rules, partition_spec, sharding_for, tree_shardings
from jaxrl.sharding.mesh import make_mesh
from jaxrl.sharding.offload import offload, reload, supports_host_offload
from jaxrl.sharding.reshard import free, moved, reshard, reshard_report

__all__ = [
    "AXES",
    "ROLLOUT_RULES",
    "TRAIN_RULES",
    "Layout",
    "Rules",
    "active_layout",
    "free",
    "layouts_from_config",
    "make_mesh",
    "moved",
    "offload",
    "partition_spec",
    "reload",
    "reshard",
    "reshard_report",
    "resolve_axis_sizes",
    "rollout_mesh",
    "shard",
    "sharding_for",
    "supports_host_offload",
    "train_mesh",
    "tree_shardings",
    "use_layout",
]
