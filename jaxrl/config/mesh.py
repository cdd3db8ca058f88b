"""The `mesh` config group's vocabulary, as data: mesh axes, logical axes and the default
layouts (logical name -> mesh axes), with the checks of sizes and rules. `jaxrl.sharding`
builds meshes and shardings from them.

    train   (mesh dp, fsdp, ep, tp, sp): weights ZeRO-3 over `fsdp` and tensor-parallel over
            `tp`, replicated over `dp`; a mixture of experts' experts over `ep`; batch over
            (dp, fsdp, ep); sequence over `sp`.
    rollout (mesh dp, tp): weights tensor-parallel over `tp` only, replicated over `dp`; every
            `dp` slice is a generation replica; KV cache over batch (dp) and kv heads (tp).

The config group `mesh` holds the layouts as `train_rules` / `rollout_rules`, so a run can
change them (`mesh.train_rules.vocab=null`). A name a layout leaves out is replicated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

# Parameter axes (jaxrl.models.params) and activation / cache axes.
LOGICAL_AXES = (
    "vocab",
    "embed",
    "mlp",
    "heads",
    "kv_heads",
    "head_dim",
    "layers",
    "labels",
    "batch",
    "seq",
    "cache_seq",
    "lora_rank",
    "experts",
)

TRAIN_MESH_AXES = ("dp", "fsdp", "ep", "tp", "sp")
ROLLOUT_MESH_AXES = ("dp", "tp")

TRAIN_RULES: dict[str, str | list[str] | None] = {
    "vocab": "tp",
    "embed": "fsdp",
    "mlp": "tp",
    "heads": "tp",
    "kv_heads": "tp",
    "experts": "ep",
    "batch": ["dp", "fsdp", "ep"],
    "seq": "sp",
}

ROLLOUT_RULES: dict[str, str | list[str] | None] = {
    "vocab": "tp",
    "mlp": "tp",
    "heads": "tp",
    "kv_heads": "tp",
    "batch": "dp",
}


def rule_problems(rules: dict, mesh_axes: tuple[str, ...], key: str) -> list[str]:
    """Messages for rules naming unknown logical names or mesh axes, or a mesh axis twice."""
    problems = []
    for name, target in rules.items():
        if name not in LOGICAL_AXES:
            problems.append(
                f"{key}.{name}: unknown logical axis; use one of {', '.join(LOGICAL_AXES)}"
            )
        if target is not None and not isinstance(target, str | list | tuple):
            problems.append(
                f"{key}.{name}: {target!r} is not a mesh axis name, a list of them or null"
            )
            continue
        axes = [] if target is None else [target] if isinstance(target, str) else list(target)
        for axis in axes:
            if axis not in mesh_axes:
                problems.append(
                    f"{key}.{name}: {axis!r} is not a mesh axis here; use {', '.join(mesh_axes)}"
                )
        if len(set(axes)) != len(axes):
            problems.append(f"{key}.{name}: a mesh axis appears twice in {axes}")
    return problems


AXES: tuple[str, ...] = TRAIN_MESH_AXES  # the global mesh: the train layout's axes


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


# Roles that may live on device groups of their own (`mesh.placement`), in the order they
# take their devices from the end of the device list; the trainer (actor) keeps the rest.
PLACED_ROLES = ("rollout", "ref", "critic", "reward", "teacher")


def device_groups(placed: Mapping[str, int], num_devices: int) -> dict[str, range]:
    """Device index ranges: `train` (the actor and every colocated role) first, then each
    role with a nonzero count in `PLACED_ROLES` order.

    Raises:
        ValueError: for a negative count, or placed roles that leave the trainer no device.
    """
    bad = [f"{r}={n}" for r, n in placed.items() if n < 0]
    if bad:
        raise ValueError(f"device counts must be >= 0 (0: colocated); got {', '.join(bad)}")
    counts = {r: placed.get(r, 0) for r in PLACED_ROLES if placed.get(r, 0) > 0}
    train = num_devices - sum(counts.values())
    if train < 1:
        shown = ", ".join(f"{r}={n}" for r, n in counts.items())
        raise ValueError(
            f"the placed roles ({shown}) take {num_devices - train} of the {num_devices} "
            "devices and leave the trainer none; place fewer"
        )
    groups, start = {"train": range(train)}, train
    for role, n in counts.items():
        groups[role] = range(start, start + n)
        start += n
    return groups
