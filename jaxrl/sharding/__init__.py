"""The named device mesh and the logical-axis layouts over it."""

from jaxrl.sharding.logical import Rules, partition_spec, sharding_for, tree_shardings
from jaxrl.sharding.mesh import AXES, make_mesh, resolve_axis_sizes

__all__ = [
    "AXES",
    "Rules",
    "make_mesh",
    "partition_spec",
    "resolve_axis_sizes",
    "sharding_for",
    "tree_shardings",
]
