"""Building the global mesh `(dp, fsdp, tp, sp)` from the `mesh` config group."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from jaxrl.config.mesh import resolve_axis_sizes

if TYPE_CHECKING:
    import jax


def make_mesh(
    sizes: Mapping[str, int], devices: Sequence[jax.Device] | None = None
) -> jax.sharding.Mesh:
    """A `jax.sharding.Mesh` with the named axes of `sizes` (after `resolve_axis_sizes`).

    `jax.make_mesh` orders devices so that the last axes (`tp`, `sp`) stay within a host's fast
    interconnect on multi-host runs. Axes are `Auto`: XLA propagates shardings from the
    parameters and the constraints jaxrl places, rather than requiring every op to name one.
    """
    import jax
    from jax.sharding import AxisType

    devices = list(jax.devices() if devices is None else devices)
    resolved = resolve_axis_sizes(sizes, len(devices))
    shape, names = tuple(resolved.values()), tuple(resolved)
    return jax.make_mesh(shape, names, devices=devices, axis_types=(AxisType.Auto,) * len(names))
