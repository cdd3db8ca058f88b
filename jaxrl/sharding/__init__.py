"""The named device mesh and (later) the train / rollout layouts over it."""

from jaxrl.sharding.mesh import AXES, make_mesh, resolve_axis_sizes

__all__ = ["AXES", "make_mesh", "resolve_axis_sizes"]
