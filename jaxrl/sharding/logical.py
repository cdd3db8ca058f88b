"""Logical axis names -> `NamedSharding`s on a mesh, by a rule table (a layout).

A layout maps each logical name (`vocab`, `embed`, `mlp`, `heads`, `kv_heads`, `head_dim`,
`layers`, `labels`, `batch`, `seq`) to a mesh axis, a tuple of mesh axes, or None (replicated).
Names a layout does not mention are replicated. A dimension whose size does not divide by its
mesh axes is replicated too, and reported by `sharding_for`, rather than failing at placement.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rules = Mapping[str, str | tuple[str, ...] | None]


def _axes(rule: str | Sequence[str] | None) -> tuple[str, ...]:
    if rule is None:
        return ()
    return (rule,) if isinstance(rule, str) else tuple(rule)


def partition_spec(
    shape: Sequence[int], logical: Sequence[str | None], mesh: Mesh, rules: Rules
) -> PartitionSpec:
    """The `PartitionSpec` for one array; indivisible or repeated mesh axes are replicated."""
    used: set[str] = set()
    spec: list[Any] = []
    for size, name in zip(shape, logical, strict=True):
        axes = tuple(a for a in _axes(rules.get(name)) if a in mesh.shape and a not in used)
        if axes and size % math.prod(mesh.shape[a] for a in axes) == 0:
            used.update(axes)
            spec.append(axes[0] if len(axes) == 1 else axes)
        else:
            spec.append(None)
    return PartitionSpec(*spec)


def sharding_for(
    shape: Sequence[int], logical: Sequence[str | None], mesh: Mesh, rules: Rules
) -> NamedSharding:
    """A `NamedSharding` for one array with the given logical axis names."""
    return NamedSharding(mesh, partition_spec(shape, logical, mesh, rules))


def tree_shardings(abstract: Any, logical: Any, mesh: Mesh, rules: Rules) -> Any:
    """`NamedSharding`s for a tree of arrays (or ShapeDtypeStructs) and its logical-name tree."""
    return jax.tree.map(
        lambda x, names: sharding_for(x.shape, names, mesh, rules),
        abstract,
        logical,
        is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(n, str | None) for n in x),
    )
