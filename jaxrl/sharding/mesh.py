"""Building the global mesh `(dp, fsdp, tp, sp)` from the `mesh` config group."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import jax

AXES: tuple[str, ...] = ("dp", "fsdp", "tp", "sp")


def resolve_axis_sizes(sizes: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Replace a single -1 by "the rest" and check that the sizes cover `num_devices` exactly.

    Args:
        sizes: Axis name -> size (>= 1, or -1 for at most one axis).
        num_devices: Devices the mesh must span.

    Returns:
        Axis name -> size, in the order given, with product `num_devices`.

    Raises:
        ValueError: naming the axes and the device count when they do not fit.
    """
    bad = [f"{a}={s}" for a, s in sizes.items() if s != -1 and s < 1]
    if bad:
        raise ValueError(f"mesh sizes must be >= 1 or -1 (the rest); got {', '.join(bad)}")
    rest = [a for a, s in sizes.items() if s == -1]
    if len(rest) > 1:
        raise ValueError(f"only one mesh axis may be -1 (the rest); got {', '.join(rest)}")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    shown = " x ".join(f"{a}={s}" for a, s in sizes.items())
    if rest:
        if num_devices % fixed:
            raise ValueError(
                f"mesh {shown}: {num_devices} devices cannot be split by the fixed axes "
                f"(product {fixed}); choose sizes whose product divides {num_devices}"
            )
        return {a: (num_devices // fixed if s == -1 else s) for a, s in sizes.items()}
    if fixed != num_devices:
        raise ValueError(
            f"mesh {shown} spans {fixed} devices but {num_devices} are available; make the "
            f"product {num_devices}, or set one axis to -1 to take the rest"
        )
    return dict(sizes)


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
